// Errors: what the library throws when a caller gives it something wrong, and the check for our own bugs.
// User mistakes (a shape, a file, an option) are typed exceptions with a message that names the problem
// and the fix. A broken invariant inside qkv is a bug: QKV_CHECK prints file and line and aborts.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace qkv {

// Base of every error a caller can cause. The CLI maps it to exit code 1.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Tensor shapes that do not fit an operation. The message names the op and both shapes.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An argument with a bad value: a dimension of 0, a probability outside [0, 1), an unknown name.
class ValueError : public Error {
 public:
  using Error::Error;
};

// A file that cannot be read or written, or whose contents are malformed.
class IoError : public Error {
 public:
  using Error::Error;
};

// Text taken from a file or a command line, made safe to print in a message: bytes outside printable ASCII
// (control characters, escape sequences, invalid UTF-8) become \xNN, and very long text is cut with "…".
std::string printable(std::string_view text, size_t max_length = 200);

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* condition, const std::string& message);
}  // namespace detail

}  // namespace qkv

// QKV_CHECK(cond, message): an invariant that only a bug in qkv can break.
#define QKV_CHECK(cond, message)                                                \
  do {                                                                          \
    if (!(cond)) ::qkv::detail::check_failed(__FILE__, __LINE__, #cond, (message)); \
  } while (0)
