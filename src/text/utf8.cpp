// UTF-8 validation and replacement (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF).
#include <string>

#include "qkv/text/tokenizer.hpp"

namespace qkv::text {

namespace {
// The well-formed sequence starting at s[i] (Unicode's Table 3-7): {bytes, true} when whole, else {bytes of its maximal
// subpart — the longest prefix that could still have begun a valid sequence, at least 1 —, false}. Replacing each
// maximal subpart by one U+FFFD is the Unicode recommendation that Python's errors="replace", Rust's
// String::from_utf8_lossy and WHATWG's TextDecoder all follow: a sequence cut short is one U+FFFD, not one per byte.
std::pair<size_t, bool> sequence(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return {1, true};
  size_t n;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range; later ones are 80..BF
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c == 0xE0) n = 3, low = 0xA0;              // no overlongs
  else if (c == 0xED) n = 3, high = 0x9F;             // no surrogates
  else if (c >= 0xE1 && c <= 0xEF) n = 3;
  else if (c == 0xF0) n = 4, low = 0x90;              // no overlongs
  else if (c == 0xF4) n = 4, high = 0x8F;             // nothing above U+10FFFF
  else if (c >= 0xF1 && c <= 0xF3) n = 4;
  else return {1, false};                             // 80..C1, F5..FF never start one
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) return {k, false};
    const unsigned char b = byte(i + k);
    if (b < (k == 1 ? low : 0x80) || b > (k == 1 ? high : 0xBF)) return {k, false};
  }
  return {n, true};
}
}  // namespace

std::optional<size_t> first_invalid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto [n, whole] = sequence(text, i);
    if (!whole) return i;
    i += n;
  }
  return std::nullopt;
}

std::string replace_invalid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto [n, whole] = sequence(text, i);
    if (whole) out.append(text.substr(i, n));
    else out += "\xEF\xBF\xBD";  // one U+FFFD for the maximal subpart
    i += n;
  }
  return out;
}

}  // namespace qkv::text
