// Checked number parsing and shortest round-trip formatting (see qkv/core/settings.hpp).
#include "qkv/core/settings.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "qkv/core/error.hpp"

namespace qkv {

namespace {
[[noreturn]] void bad(std::string_view text, const std::string& what, const char* kind) {
  throw ValueError(what + " = \"" + printable(text) + "\" is not " + kind);
}
}  // namespace

namespace {
template <typename T>
T parse_integer(std::string_view text, const std::string& what, const char* kind, const char* range) {
  T v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range) bad(text, what, range);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) bad(text, what, kind);
  return v;
}
}  // namespace

int64_t parse_int(std::string_view text, const std::string& what) {
  return parse_integer<int64_t>(text, what, "an integer", "an integer in range (at most 9223372036854775807)");
}

uint64_t parse_uint(std::string_view text, const std::string& what) {
  if (!text.empty() && text[0] == '-') bad(text, what, "a non-negative integer");
  return parse_integer<uint64_t>(text, what, "a non-negative integer",
                                 "an integer in range (at most 18446744073709551615)");
}

double parse_real(std::string_view text, const std::string& what) {
  const std::string s(text);
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) bad(text, what, "a number");
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0') bad(text, what, "a number");
  if (!std::isfinite(v) || (errno == ERANGE && std::fabs(v) > 1.0)) bad(text, what, "a finite number");
  return v;
}

bool parse_bool(std::string_view text, const std::string& what) {
  if (text == "true" || text == "True" || text == "1") return true;
  if (text == "false" || text == "False" || text == "0") return false;
  bad(text, what, "true or false");
}

std::string format_real(double v) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

namespace settings {
void throw_missing(const std::string& what, const char* key) {
  throw ValueError(what + " lacks \"" + key + "\"");
}
}  // namespace settings

}  // namespace qkv
