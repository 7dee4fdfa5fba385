// The one place a broken invariant ends the process (see qkv/core/error.hpp): a bug in qkv, never user input.
#include "qkv/core/error.hpp"

#include <cstdio>
#include <cstdlib>

namespace qkv {

std::string printable(std::string_view text, size_t max_length) {
  std::string out;
  for (size_t i = 0; i < text.size() && out.size() < max_length; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (out.size() >= max_length) out += "…";
  return out;
}

}  // namespace qkv

namespace qkv::detail {

void check_failed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "qkv internal error at %s:%d: check `%s` failed: %s\n", file, line, condition,
               message.c_str());
  std::abort();
}

}  // namespace qkv::detail
