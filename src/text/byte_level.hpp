// Shared by GPT-2's tokenizer and tokenizer.json's ByteLevel pieces (internal to src/text/): UTF-8 encoding of a code
// point and GPT-2's bytes_to_unicode alphabet.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace qkv::text::detail {

// Appends code point cp (below U+110000) as UTF-8.
inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// encoder.py's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 to U+0100….
inline std::array<uint32_t, 256> byte_code_points() {
  std::array<uint32_t, 256> cps{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[static_cast<size_t>(b)] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[static_cast<size_t>(b)] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[static_cast<size_t>(b)] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) cps[static_cast<size_t>(b)] = printable[static_cast<size_t>(b)] ? static_cast<uint32_t>(b) : next++;
  return cps;
}

inline std::array<std::string, 256> byte_to_unicode() {
  const auto cps = byte_code_points();
  std::array<std::string, 256> out;
  for (int b = 0; b < 256; ++b) append_utf8(out[static_cast<size_t>(b)], cps[static_cast<size_t>(b)]);
  return out;
}

}  // namespace qkv::text::detail
