// The Hugging Face tokenizer pipeline's parts (internal to src/text/): normalizers, pre-tokenizers (PCRE2 regexes),
// decoders, added tokens and their trie, and the state a tokenizer.json or a GGUF file's tokenizer.ggml.* metadata is
// read into. The pipeline is Hugging Face tokenizers' own: added tokens split off first (leftmost-longest, through a
// byte trie), then per remaining segment normalizer → pre-tokenizer → BPE, then the post_processor; decoding runs the
// decoder chain. Not here: reading either file (hf_tokenizer.cpp, gguf_tokenizer.cpp), BPE itself (bpe.hpp).
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bpe.hpp"
#include "byte_level.hpp"
#include "qkv/core/error.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace qkv::text {

namespace detail {

using json = nlohmann::json;

// Ids may leave gaps, but not many: an id is at most this far beyond the number of entries the file lists, so the id
// table stays proportional to the file.
inline constexpr int64_t kMaxIdGap = 65536;
// A pre-tokenizer regex from a file gets this many backtracking steps per match: a pattern that needs more (a
// catastrophic one) is an error, not a hang.
inline constexpr uint32_t kMatchLimit = 10'000'000;

// Length of the UTF-8 sequence starting with byte c (1 for a stray byte, so scanning always advances).
inline size_t utf8_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

inline uint32_t decode_code_point(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (n == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

inline void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size()) out.append(s, at, hit - at).append(to);
  out.append(s, at, std::string::npos);
  s = std::move(out);
}

// A compiled PCRE2 pattern (UTF + UCP, JIT where available), as Hugging Face's Split regexes need.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                          &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      throw IoError(where + ": the regex " + printable(pattern, 120) + " does not compile at offset " +
                    std::to_string(offset) + " (" + reinterpret_cast<const char*>(message) + ")");
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
    context_ = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(context_, kMatchLimit);
    pcre2_set_depth_limit(context_, kMatchLimit);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() {
    pcre2_match_context_free(context_);
    pcre2_code_free(code_);
  }
  // Every non-overlapping match in s, as (begin, end) byte ranges; an empty match moves on one character.
  std::vector<std::pair<size_t, size_t>> matches(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, PCRE2_NO_UTF_CHECK, data, context_);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(data);
        throw ValueError("tokenizer.json: its pre-tokenizer regex gave up on this text (PCRE2 error " + std::to_string(rc) +
                         ", e.g. its backtracking limit); the pattern is not one a tokenizer can use");
      }
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(data);
      if (v[1] > v[0]) {
        out.emplace_back(v[0], v[1]);
        at = v[1];
      } else {
        at = v[0] + (v[0] < s.size() ? utf8_length(static_cast<unsigned char>(s[v[0]])) : 1);
      }
    }
    pcre2_match_data_free(data);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_context* context_ = nullptr;
};

// Matches of a literal string.
inline std::vector<std::pair<size_t, size_t>> literal_matches(std::string_view s, const std::string& needle) {
  std::vector<std::pair<size_t, size_t>> out;
  if (needle.empty()) return out;
  for (size_t at = 0, hit; (hit = s.find(needle, at)) != std::string_view::npos; at = hit + needle.size())
    out.emplace_back(hit, hit + needle.size());
  return out;
}

inline std::string describe(const json& j) { return printable(j.dump(), 120); }

// ---- normalizers ----

struct Normalizer {
  enum class Kind { NFC, NFKC, NFD, NFKD, Replace, Prepend, Lowercase, Strip, Sequence } kind = Kind::Sequence;
  std::string pattern, content;
  bool strip_left = false, strip_right = false;
  std::vector<Normalizer> children;

  static Normalizer from(const json& j, const std::string& where) {
    Normalizer n;
    const std::string type = j.value("type", "");
    if (type == "NFC") n.kind = Kind::NFC;
    else if (type == "NFKC") n.kind = Kind::NFKC;
    else if (type == "NFD") n.kind = Kind::NFD;
    else if (type == "NFKD") n.kind = Kind::NFKD;
    else if (type == "Lowercase") n.kind = Kind::Lowercase;
    else if (type == "Prepend") {
      n.kind = Kind::Prepend;
      n.content = j.value("prepend", "");
    } else if (type == "Replace") {
      n.kind = Kind::Replace;
      if (!j.contains("pattern") || !j["pattern"].contains("String"))
        throw IoError(where + ": normalizer Replace with " + describe(j) + "; qkv supports a String pattern");
      n.pattern = j["pattern"]["String"].get<std::string>();
      n.content = j.value("content", "");
    } else if (type == "Strip") {
      n.kind = Kind::Strip;
      n.strip_left = j.value("strip_left", true);
      n.strip_right = j.value("strip_right", true);
    } else if (type == "Sequence") {
      for (const json& c : j.at("normalizers")) n.children.push_back(from(c, where));
    } else {
      throw IoError(where + ": normalizer '" + printable(type, 40) +
                    "' is not supported; qkv has NFC, NFKC, NFD, NFKD, Replace, Prepend, Lowercase, Strip and Sequence");
    }
    return n;
  }

  void apply(std::string& s) const {
    auto unicode = [&](utf8proc_option_t options) {
      utf8proc_uint8_t* out = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                              static_cast<utf8proc_ssize_t>(s.size()), &out, options);
      if (n >= 0) s.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
      std::free(out);
    };
    switch (kind) {
      case Kind::NFC: unicode(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE)); break;
      case Kind::NFKC: unicode(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT)); break;
      case Kind::NFD: unicode(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE)); break;
      case Kind::NFKD: unicode(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT)); break;
      case Kind::Lowercase: unicode(static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_CASEFOLD)); break;
      case Kind::Replace: replace_all(s, pattern, content); break;
      case Kind::Prepend:
        if (!s.empty()) s = content + s;
        break;
      case Kind::Strip: {
        size_t b = 0, e = s.size();
        if (strip_left) while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
        if (strip_right) while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
        s = s.substr(b, e - b);
        break;
      }
      case Kind::Sequence:
        for (const Normalizer& c : children) c.apply(s);
        break;
    }
  }
};

// ---- pre-tokenizers ----

inline constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The name llama.cpp gives (tokenizer.ggml.pre) to a byte-level pre-tokenizer made of these Split regexes, applied in
// order; "" when it knows none with exactly these (gguf_tokenizer.cpp holds the table).
std::string gguf_pre_for_regexes(const std::vector<std::string>& regexes);

struct PreTokenizer {
  enum class Kind { Split, ByteLevel, Metaspace, Sequence } kind = Kind::Sequence;
  enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous } behavior = Behavior::Isolated;
  bool invert = false;  // Split: the pattern names what to keep, not the delimiters
  std::shared_ptr<Regex> regex;  // Split with a Regex pattern, ByteLevel with use_regex
  std::string literal;           // Split with a String pattern
  bool add_prefix_space = false;
  std::string replacement = "\xE2\x96\x81";  // Metaspace: ▁
  enum class Prepend { Always, First, Never } prepend = Prepend::Always;
  bool metaspace_split = true;
  std::vector<PreTokenizer> children;

  static PreTokenizer from(const json& j, const std::string& where) {
    PreTokenizer p;
    const std::string type = j.value("type", "");
    if (type == "Split") {
      p.kind = Kind::Split;
      const json& pattern = j.at("pattern");
      if (pattern.contains("Regex")) p.regex = std::make_shared<Regex>(pattern["Regex"].get<std::string>(), where);
      else if (pattern.contains("String")) p.literal = pattern["String"].get<std::string>();
      else throw IoError(where + ": Split pattern " + describe(pattern) + " is neither Regex nor String");
      const std::string behavior = j.value("behavior", "Isolated");
      if (behavior == "Isolated") p.behavior = Behavior::Isolated;
      else if (behavior == "Removed") p.behavior = Behavior::Removed;
      else if (behavior == "MergedWithPrevious") p.behavior = Behavior::MergedWithPrevious;
      else if (behavior == "MergedWithNext") p.behavior = Behavior::MergedWithNext;
      else if (behavior == "Contiguous") p.behavior = Behavior::Contiguous;
      else throw IoError(where + ": Split behavior '" + printable(behavior, 40) + "' is not supported; qkv has Isolated, "
                         "Removed, MergedWithPrevious, MergedWithNext and Contiguous");
      p.invert = j.value("invert", false);
    } else if (type == "ByteLevel") {
      p.kind = Kind::ByteLevel;
      p.add_prefix_space = j.value("add_prefix_space", false);
      if (j.value("use_regex", true)) p.regex = std::make_shared<Regex>(kGpt2Pattern, where);
    } else if (type == "Metaspace") {
      p.kind = Kind::Metaspace;
      p.replacement = j.value("replacement", p.replacement);
      p.metaspace_split = j.value("split", true);
      const std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                                     ? j["prepend_scheme"].get<std::string>()
                                     : (j.value("add_prefix_space", true) ? "always" : "never");
      p.prepend = scheme == "first" ? Prepend::First : scheme == "never" ? Prepend::Never : Prepend::Always;
    } else if (type == "Sequence") {
      for (const json& c : j.at("pretokenizers")) p.children.push_back(from(c, where));
    } else {
      throw IoError(where + ": pre_tokenizer '" + printable(type, 40) +
                    "' is not supported; qkv has Split, ByteLevel, Metaspace and Sequence");
    }
    return p;
  }

  // tokenizers' Pattern::find_matches: the piece cut into ranges that each are a match or the text between two, every
  // match flagged (flags flipped with invert: Split's "invert" keeps what the pattern does not match as delimiters).
  struct Range {
    size_t begin, end;
    bool match;
  };
  static std::vector<Range> ranges(size_t size, const std::vector<std::pair<size_t, size_t>>& hits, bool invert) {
    std::vector<Range> out;
    size_t at = 0;
    for (const auto& [b, e] : hits) {
      if (b > at) out.push_back({at, b, invert});
      out.push_back({b, e, !invert});
      at = e;
    }
    if (at < size) out.push_back({at, size, invert});
    return out;
  }

  // tokenizers' NormalizedString::split: the ranges grouped by the behaviour, empty pieces dropped.
  static void split(const std::string& piece, const std::vector<Range>& parts, Behavior behavior, std::vector<std::string>& out) {
    std::vector<std::pair<size_t, size_t>> kept;
    bool previous_match = false;
    switch (behavior) {
      case Behavior::Isolated:
        for (const Range& r : parts) kept.emplace_back(r.begin, r.end);
        break;
      case Behavior::Removed:
        for (const Range& r : parts)
          if (!r.match) kept.emplace_back(r.begin, r.end);
        break;
      case Behavior::MergedWithPrevious:  // a match joins the text before it (not another match)
        for (const Range& r : parts) {
          if (r.match && !previous_match && !kept.empty()) kept.back().second = r.end;
          else kept.emplace_back(r.begin, r.end);
          previous_match = r.match;
        }
        break;
      case Behavior::MergedWithNext:  // a match joins the text after it (not another match)
        for (auto r = parts.rbegin(); r != parts.rend(); ++r) {
          if (r->match && !previous_match && !kept.empty()) kept.back().first = r->begin;
          else kept.emplace_back(r->begin, r->end);
          previous_match = r->match;
        }
        std::reverse(kept.begin(), kept.end());
        break;
      case Behavior::Contiguous:  // consecutive matches become one piece
        for (const Range& r : parts) {
          if (r.match && previous_match) kept.back().second = r.end;
          else kept.emplace_back(r.begin, r.end);
          previous_match = r.match;
        }
        break;
    }
    for (const auto& [b, e] : kept)
      if (e > b) out.push_back(piece.substr(b, e - b));
  }

  // pieces in, pieces out; `first` says whether the segment starts the text (Metaspace's prepend_scheme "first").
  void apply(std::vector<std::string>& pieces, bool first, const std::array<std::string, 256>& bytes) const {
    std::vector<std::string> out;
    switch (kind) {
      case Kind::Sequence:
        for (const PreTokenizer& c : children) c.apply(pieces, first, bytes);
        return;
      case Kind::Split:
        for (const std::string& p : pieces)
          split(p, ranges(p.size(), regex ? regex->matches(p) : literal_matches(p, literal), invert), behavior, out);
        break;
      case Kind::ByteLevel:
        for (std::string p : pieces) {
          if (add_prefix_space && (p.empty() || p[0] != ' ')) p = " " + p;
          std::vector<std::string> words;
          if (regex) split(p, ranges(p.size(), regex->matches(p), false), Behavior::Isolated, words);
          else words.push_back(p);
          for (const std::string& w : words) {
            std::string mapped;
            for (unsigned char c : w) mapped += bytes[c];
            out.push_back(std::move(mapped));
          }
        }
        break;
      case Kind::Metaspace:
        for (size_t i = 0; i < pieces.size(); ++i) {
          std::string p = pieces[i];
          replace_all(p, " ", replacement);
          const bool prepend_here = prepend == Prepend::Always || (prepend == Prepend::First && first && i == 0);
          if (prepend_here && p.compare(0, replacement.size(), replacement) != 0) p = replacement + p;
          if (metaspace_split) split(p, ranges(p.size(), literal_matches(p, replacement), false), Behavior::MergedWithNext, out);
          else out.push_back(p);
        }
        break;
    }
    pieces = std::move(out);
  }
};

// ---- decoders ----

struct Decoder {
  enum class Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence } kind = Kind::Sequence;
  std::string pattern, content;
  size_t start = 0, stop = 0;
  bool prepend = true;
  std::vector<Decoder> children;

  static Decoder from(const json& j, const std::string& where) {
    Decoder d;
    const std::string type = j.value("type", "");
    if (type == "ByteLevel") d.kind = Kind::ByteLevel;
    else if (type == "ByteFallback") d.kind = Kind::ByteFallback;
    else if (type == "Fuse") d.kind = Kind::Fuse;
    else if (type == "Replace") {
      d.kind = Kind::Replace;
      if (!j.contains("pattern") || !j["pattern"].contains("String"))
        throw IoError(where + ": decoder Replace with " + describe(j) + "; qkv supports a String pattern");
      d.pattern = j["pattern"]["String"].get<std::string>();
      d.content = j.value("content", "");
    } else if (type == "Strip") {
      d.kind = Kind::Strip;
      d.content = j.value("content", " ");
      d.start = j.value("start", 0u);
      d.stop = j.value("stop", 0u);
    } else if (type == "Metaspace") {
      d.kind = Kind::Metaspace;
      d.content = j.value("replacement", "\xE2\x96\x81");
      d.prepend = !(j.contains("prepend_scheme") && j["prepend_scheme"] == "never") && j.value("add_prefix_space", true);
    } else if (type == "Sequence") {
      for (const json& c : j.at("decoders")) d.children.push_back(from(c, where));
    } else {
      throw IoError(where + ": decoder '" + printable(type, 40) +
                    "' is not supported; qkv has ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequence");
    }
    return d;
  }

  // Bytes that are not UTF-8 become U+FFFD, as String::from_utf8_lossy does.
  static std::string lossy(const std::string& bytes) { return replace_invalid_utf8(bytes); }

  void apply(std::vector<std::string>& tokens, const std::unordered_map<uint32_t, unsigned char>& byte_of) const {
    switch (kind) {
      case Kind::Sequence:
        for (const Decoder& c : children) c.apply(tokens, byte_of);
        return;
      case Kind::ByteLevel: {  // all tokens' characters back to bytes, then one lossy UTF-8 decode
        std::string bytes;
        for (const std::string& t : tokens) {
          std::string mine;
          bool all = true;
          for (size_t i = 0; i < t.size();) {
            const size_t n = std::min(utf8_length(static_cast<unsigned char>(t[i])), t.size() - i);
            const auto it = byte_of.find(decode_code_point(t, i, n));
            if (it == byte_of.end()) {
              all = false;
              break;
            }
            mine += static_cast<char>(it->second);
            i += n;
          }
          bytes += all ? mine : t;
        }
        tokens = {lossy(bytes)};
        return;
      }
      case Kind::Replace:
        for (std::string& t : tokens) replace_all(t, pattern, content);
        return;
      case Kind::ByteFallback: {  // a run of <0xNN> tokens: its text if UTF-8, else U+FFFD per byte (as tokenizers)
        std::vector<std::string> out;
        std::string pending;
        auto flush = [&] {
          if (first_invalid_utf8(pending)) out.insert(out.end(), pending.size(), "\xEF\xBF\xBD");
          else if (!pending.empty()) out.push_back(pending);
          pending.clear();
        };
        for (const std::string& t : tokens) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
          } else {
            flush();
            out.push_back(t);
          }
        }
        flush();
        tokens = std::move(out);
        return;
      }
      case Kind::Fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {all};
        return;
      }
      case Kind::Strip:
        for (std::string& t : tokens) {
          size_t b = 0, e = t.size();
          for (size_t k = 0; k < start && t.compare(b, content.size(), content) == 0; ++k) b += content.size();
          for (size_t k = 0; k < stop && e >= b + content.size() && t.compare(e - content.size(), content.size(), content) == 0; ++k)
            e -= content.size();
          t = t.substr(b, e - b);
        }
        return;
      case Kind::Metaspace:  // tokenizers drops every ▁ of the first token (not only a leading one) when it prepends
        for (size_t i = 0; i < tokens.size(); ++i) replace_all(tokens[i], content, i == 0 && prepend ? "" : " ");
        return;
    }
  }
};

// ---- added tokens: a byte trie for leftmost-longest matching ----

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// Rust's char::is_whitespace (Unicode White_Space), which tokenizers' lstrip and rstrip use.
inline bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Rust's char::is_alphanumeric, for single_word tokens: letters and numbers by general category (Rust's Alphabetic
// adds a few marks, e.g. Devanagari vowel signs, that this leaves out).
inline bool is_alphanumeric(uint32_t cp) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

// The code point that ends at s[end) (end > 0) and its first byte.
inline std::pair<uint32_t, size_t> code_point_before(std::string_view s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80 && end - b < 4) --b;
  return {decode_code_point(s, b, end - b), b};
}
inline uint32_t code_point_at(std::string_view s, size_t at) {
  return decode_code_point(s, at, std::min(utf8_length(static_cast<unsigned char>(s[at])), s.size() - at));
}

class Trie {
 public:
  bool empty() const { return nodes_.size() == 1; }
  void insert(const std::string& s, int32_t token) {
    int32_t node = 0;
    for (unsigned char c : s) {
      auto& next = nodes_[static_cast<size_t>(node)].next;
      auto it = next.find(c);
      if (it == next.end()) {
        nodes_.push_back({});
        it = nodes_[static_cast<size_t>(node)].next.emplace(c, static_cast<int32_t>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[static_cast<size_t>(node)].token = token;
  }
  // The longest inserted string starting at s[at]: (token, length), or (−1, 0).
  std::pair<int32_t, size_t> longest(std::string_view s, size_t at) const {
    int32_t node = 0, best = -1;
    size_t best_len = 0;
    for (size_t i = at; i < s.size(); ++i) {
      const auto& next = nodes_[static_cast<size_t>(node)].next;
      const auto it = next.find(static_cast<unsigned char>(s[i]));
      if (it == next.end()) break;
      node = it->second;
      const int32_t t = nodes_[static_cast<size_t>(node)].token;
      if (t >= 0) best = t, best_len = i + 1 - at;
    }
    return {best, best_len};
  }

 private:
  struct Node {
    std::unordered_map<unsigned char, int32_t> next;
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
};


}  // namespace detail

struct HfTokenizer::State {
  std::string label;
  std::string kind = "tokenizer.json";  // name(): the source it was read from
  detail::BpeModel model;     // vocabulary (with the added tokens), merges and unknown-character handling
  std::vector<bool> special;  // id → an added token marked special
  std::optional<detail::Normalizer> normalizer;
  std::optional<detail::PreTokenizer> pre_tokenizer;
  std::optional<detail::Decoder> decoder;
  std::vector<detail::AddedToken> added;
  detail::Trie added_trie;             // added tokens matched in the text as given (normalized: false)
  detail::Trie normalized_added_trie;  // those matched in the normalized text, by their normalized content (normalized: true)
  // post_processor: the single-sequence template, as (token id or −1 for the text) items; empty: nothing added
  std::vector<int64_t> template_items;
  bool has_template = false;
  std::array<std::string, 256> byte_alphabet = detail::byte_to_unicode();
  std::unordered_map<uint32_t, unsigned char> byte_of;
  int64_t eos = -1, bos = -1, pad = -1;
  std::string chat_template;

  int32_t id_of(std::string_view token) const { return model.vocab.find(token); }

  // After the vocabulary, added tokens and normalizer are set: the tries of added tokens (a normalized one by its
  // normalized content, as tokenizers' refresh_added_tokens builds its second trie) and the byte-level alphabet.
  void finish() {
    for (size_t i = 0; i < added.size(); ++i) {
      std::string content = added[i].content;
      if (added[i].normalized && normalizer) normalizer->apply(content);
      if (!content.empty()) (added[i].normalized ? normalized_added_trie : added_trie).insert(content, static_cast<int32_t>(i));
    }
    const auto cps = detail::byte_code_points();
    for (int b = 0; b < 256; ++b) byte_of[cps[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
  }
  int64_t size() const { return model.vocab.size(); }
  void bpe(std::string_view word, std::vector<int64_t>& out) const { model.encode(word, out); }

  // tokenizers' AddedVocabulary::find_matches: `text` cut at the added tokens of `trie` (leftmost-longest); piece(begin,
  // end) gets the text between them, token(id) each token. A special token is passed over (left in the text) without
  // allow_special, a single_word one unless it stands between non-word characters; lstrip and rstrip take the white
  // space beside a token with it.
  template <typename Piece, typename Token>
  void split_added(std::string_view text, const detail::Trie& trie, bool allow_special, Piece&& piece, Token&& token) const {
    size_t piece_start = 0, at = 0;
    while (at < text.size()) {
      const auto [index, length] = trie.longest(text, at);
      if (index < 0) {
        ++at;
        continue;
      }
      const detail::AddedToken& t = added[static_cast<size_t>(index)];
      size_t start = at, stop = at + length;
      at = stop;  // a token passed over is not searched again for a shorter one inside it, as with Aho-Corasick
      if (t.special && !allow_special) continue;
      if (t.single_word && ((start > 0 && detail::is_alphanumeric(detail::code_point_before(text, start).first)) ||
                            (stop < text.size() && detail::is_alphanumeric(detail::code_point_at(text, stop)))))
        continue;
      if (t.lstrip)
        while (start > piece_start) {
          const auto [cp, b] = detail::code_point_before(text, start);
          if (!detail::is_white_space(cp)) break;
          start = b;
        }
      if (t.rstrip)
        while (stop < text.size() && detail::is_white_space(detail::code_point_at(text, stop)))
          stop += std::min(detail::utf8_length(static_cast<unsigned char>(text[stop])), text.size() - stop);
      if (start > piece_start) piece(piece_start, start);
      token(t.id);
      piece_start = at = stop;
    }
    if (piece_start < text.size()) piece(piece_start, text.size());
  }

  // tokenizers' encode: added tokens split off the text as given, each piece between them normalized and split again
  // at the added tokens written for normalized text, and what is left pre-tokenized and merged.
  void encode_text(std::string_view text, bool allow_special, std::vector<int64_t>& out) const {
    const auto emit = [&](int64_t id) { out.push_back(id); };
    split_added(text, added_trie, allow_special, [&](size_t begin, size_t end) {
      std::string normalized(text.substr(begin, end - begin));
      if (normalizer) normalizer->apply(normalized);
      split_added(normalized, normalized_added_trie, allow_special, [&](size_t b, size_t e) {
        // Metaspace's prepend_scheme "first" prepends only to the piece that starts the text.
        std::vector<std::string> pieces{normalized.substr(b, e - b)};
        if (pre_tokenizer) pre_tokenizer->apply(pieces, begin == 0 && b == 0, byte_alphabet);
        for (const std::string& p : pieces) bpe(p, out);
      }, emit);
    }, emit);
  }
};

}  // namespace qkv::text
