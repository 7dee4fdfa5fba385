// The one place a broken invariant ends the process (see qkv/core/error.hpp): a bug in qkv, never user input.
#include "qkv/core/error.hpp"

#include <cstdio>
#include <cstdlib>

namespace qkv::detail {

void check_failed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "qkv internal error at %s:%d: check `%s` failed: %s\n", file, line, condition,
               message.c_str());
  std::abort();
}

}  // namespace qkv::detail
