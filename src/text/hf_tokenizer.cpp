// tokenizer.json (see qkv/text/hf_tokenizer.hpp). The pipeline is Hugging Face tokenizers' own: added tokens split
// off first (leftmost-longest, through a byte trie), then per remaining segment normalizer → pre-tokenizer → BPE, then
// the post_processor; decoding runs the file's decoder chain. BPE merges a word with a heap of candidate pairs (lowest
// rank first, then leftmost), so a word of n symbols costs O(n log n) and a text costs about linear time in its length.
#include "qkv/text/hf_tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fcntl.h>
#include <pcre2.h>
#include <simdjson.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utf8proc.h>

#include <cstring>
#include <deque>
#include <functional>
#include <optional>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "bpe.hpp"
#include "byte_level.hpp"
#include "qkv/core/error.hpp"

namespace qkv::text {

namespace {

using json = nlohmann::json;

// Ids may leave gaps, but not many: an id is at most this far beyond the number of entries the file lists, so the id
// table stays proportional to the file.
constexpr int64_t kMaxIdGap = 65536;
// A pre-tokenizer regex from a file gets this many backtracking steps per match: a pattern that needs more (a
// catastrophic one) is an error, not a hang.
constexpr uint32_t kMatchLimit = 10'000'000;

// Length of the UTF-8 sequence starting with byte c (1 for a stray byte, so scanning always advances).
size_t utf8_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

uint32_t decode_code_point(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (n == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
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
std::vector<std::pair<size_t, size_t>> literal_matches(std::string_view s, const std::string& needle) {
  std::vector<std::pair<size_t, size_t>> out;
  if (needle.empty()) return out;
  for (size_t at = 0, hit; (hit = s.find(needle, at)) != std::string_view::npos; at = hit + needle.size())
    out.emplace_back(hit, hit + needle.size());
  return out;
}

std::string describe(const json& j) { return printable(j.dump(), 120); }

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

constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

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
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Rust's char::is_alphanumeric, for single_word tokens: letters and numbers by general category (Rust's Alphabetic
// adds a few marks, e.g. Devanagari vowel signs, that this leaves out).
bool is_alphanumeric(uint32_t cp) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

// The code point that ends at s[end) (end > 0) and its first byte.
std::pair<uint32_t, size_t> code_point_before(std::string_view s, size_t end) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80 && end - b < 4) --b;
  return {decode_code_point(s, b, end - b), b};
}
uint32_t code_point_at(std::string_view s, size_t at) {
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


}  // namespace

struct HfTokenizer::State {
  std::string label;
  detail::BpeModel model;     // vocabulary (with the added tokens), merges and unknown-character handling
  std::vector<bool> special;  // id → an added token marked special
  std::optional<Normalizer> normalizer;
  std::optional<PreTokenizer> pre_tokenizer;
  std::optional<Decoder> decoder;
  std::vector<AddedToken> added;
  Trie added_trie;             // added tokens matched in the text as given (normalized: false)
  Trie normalized_added_trie;  // those matched in the normalized text, by their normalized content (normalized: true)
  // post_processor: the single-sequence template, as (token id or −1 for the text) items; empty: nothing added
  std::vector<int64_t> template_items;
  bool has_template = false;
  std::array<std::string, 256> byte_alphabet = detail::byte_to_unicode();
  std::unordered_map<uint32_t, unsigned char> byte_of;
  int64_t eos = -1, bos = -1;
  std::string chat_template;

  int32_t id_of(std::string_view token) const { return model.vocab.find(token); }
  int64_t size() const { return model.vocab.size(); }
  void bpe(std::string_view word, std::vector<int64_t>& out) const { model.encode(word, out); }

  // tokenizers' AddedVocabulary::find_matches: `text` cut at the added tokens of `trie` (leftmost-longest); piece(begin,
  // end) gets the text between them, token(id) each token. A special token is passed over (left in the text) without
  // allow_special, a single_word one unless it stands between non-word characters; lstrip and rstrip take the white
  // space beside a token with it.
  template <typename Piece, typename Token>
  void split_added(std::string_view text, const Trie& trie, bool allow_special, Piece&& piece, Token&& token) const {
    size_t piece_start = 0, at = 0;
    while (at < text.size()) {
      const auto [index, length] = trie.longest(text, at);
      if (index < 0) {
        ++at;
        continue;
      }
      const AddedToken& t = added[static_cast<size_t>(index)];
      size_t start = at, stop = at + length;
      at = stop;  // a token passed over is not searched again for a shorter one inside it, as with Aho-Corasick
      if (t.special && !allow_special) continue;
      if (t.single_word && ((start > 0 && is_alphanumeric(code_point_before(text, start).first)) ||
                            (stop < text.size() && is_alphanumeric(code_point_at(text, stop)))))
        continue;
      if (t.lstrip)
        while (start > piece_start) {
          const auto [cp, b] = code_point_before(text, start);
          if (!is_white_space(cp)) break;
          start = b;
        }
      if (t.rstrip)
        while (stop < text.size() && is_white_space(code_point_at(text, stop)))
          stop += std::min(utf8_length(static_cast<unsigned char>(text[stop])), text.size() - stop);
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

HfTokenizer::HfTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
HfTokenizer::~HfTokenizer() = default;

namespace {
std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}
}  // namespace

namespace {

// What one pass over tokenizer.json finds besides the vocabulary and merges (which go into the model as they are
// read): the model's settings, the added tokens, and the small sections (normalizer, pre-tokenizer, post-processor,
// decoder) as nlohmann values. simdjson's On-Demand API walks the file once at GB/s; nlohmann's DOM took a third of a
// load, its maps another half (bench/tokenizer_load.cpp).
struct Scan {
  std::string type = "BPE";
  bool has_vocab = false;
  std::vector<AddedToken> added;
  std::optional<std::string> unk_token;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  json normalizer, pre_tokenizer, post_processor, decoder;  // null when absent
};

namespace od = simdjson::ondemand;

bool is_null(od::value& v) { return v.type().value() == od::json_type::null; }

std::string_view string_of(od::value v, const std::string& what, const std::string& label) {
  std::string_view out;
  if (v.get_string().get(out)) throw IoError(label + ": " + what + " is not a string");
  return out;
}

bool bool_of(od::value v, const std::string& what, const std::string& label) {
  if (is_null(v)) return false;
  bool out = false;
  if (v.get_bool().get(out)) throw IoError(label + ": " + what + " is not true or false");
  return out;
}

// Appends code point cp as UTF-8.
void append_utf8(std::string& out, uint32_t cp) { detail::append_utf8(out, cp); }

// A JSON string's text from its raw bytes: p is just after its opening quote, in a document whose structure simdjson
// has checked (so a closing quote follows). The common string, without escapes, is a view of the document's own bytes
// (no copy into simdjson's buffer, whose fresh pages cost more than the parse); one with escapes is unescaped into
// `scratch` (whose element must then outlive the view). nullopt for a malformed escape.
std::optional<std::string_view> json_string(const char* p, std::deque<std::string>& scratch) {
  const char* q = p;
  while (*q != '"' && *q != '\\') ++q;
  if (*q == '"') return std::string_view(p, static_cast<size_t>(q - p));
  std::string& out = scratch.emplace_back(p, q);
  auto hex4 = [](const char* h, uint32_t& v) {
    v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = h[k];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return true;
  };
  while (*q != '"') {
    if (*q != '\\') {
      out += *q++;
      continue;
    }
    const char e = q[1];
    q += 2;
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        uint32_t cp = 0, low = 0;
        if (!hex4(q, cp)) return std::nullopt;
        q += 4;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return std::nullopt;  // a low surrogate alone
        if (cp >= 0xD800 && cp <= 0xDBFF) {                       // a high one: its low one follows
          if (q[0] != '\\' || q[1] != 'u' || !hex4(q + 2, low) || low < 0xDC00 || low > 0xDFFF) return std::nullopt;
          q += 6;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        append_utf8(out, cp);
        break;
      }
      default:
        return std::nullopt;
    }
  }
  return std::string_view(out);
}

// The model's vocabulary and merges, put into the BPE model a batch at a time while the file is read: each batch's
// lookups overlap their cache misses, and no list of the whole file's strings is kept. The views point into the
// parser's buffer of unescaped strings, valid while the parser lives. Merges are resolved against the model's own
// vocabulary (added tokens come after it, as in tokenizers, whose BPE model knows nothing of them).
class ModelBuilder {
 public:
  ModelBuilder(detail::BpeModel& model, const std::string& label) : model_(model), label_(label) {}

  // `entries` tokens whose texts take at most `bytes` (the file's size: only the pages used are touched).
  void vocab_size_hint(size_t entries, size_t bytes) {
    max_id_ = static_cast<int64_t>(entries) + kMaxIdGap;
    model_.vocab.reserve(entries, bytes);
  }
  void add_token(std::string_view token, int64_t id) {
    if (id < 0 || id >= max_id_)
      throw IoError(label_ + ": model.vocab id " + std::to_string(id) + " of " + printable(std::string(token), 60) +
                    " is outside [0, " + std::to_string(max_id_) + "): ids are numbered from 0 without large gaps");
    tokens_.emplace_back(token, static_cast<int32_t>(id));
    if (tokens_.size() == kChunk) flush_tokens();
  }
  // The text of the JSON string whose raw bytes start at p, valid until the batch it joins is flushed.
  std::string_view string(const char* p, const char* what) {
    const auto text = json_string(p, escaped_);
    if (!text) throw IoError(label_ + ": " + what + " holds a malformed escape sequence");
    return *text;
  }
  void vocab_done() {
    flush_tokens();
    vocab_done_ = true;
    for (const auto& [a, b] : early_merges_) add_merge(a, b);  // merges listed before the vocabulary
    early_merges_ = {};
  }
  void merges_size_hint(size_t merges) { merges_.reserve(merges); }
  void add_merge(std::string_view a, std::string_view b) {
    if (!vocab_done_) {
      early_merges_.emplace_back(a, b);  // copies: the views die with their batch
      return;
    }
    pairs_.emplace_back(a, b);
    if (pairs_.size() == kChunk) flush_merges();
  }
  void merges_done() { flush_merges(); }
  detail::BigVector<detail::MergeTable::Merge> take_merges() { return std::move(merges_); }

 private:
  static constexpr size_t kChunk = 256;

  void flush_tokens() {
    model_.vocab.set_all(tokens_);
    tokens_.clear();
    escaped_.clear();
  }
  // Each merge's two tokens and their concatenation, looked up together.
  void flush_merges() {
    joined_.clear();
    for (const auto& [a, b] : pairs_) joined_.append(a).append(b);
    texts_.clear();
    for (size_t k = 0, offset = 0; k < pairs_.size(); ++k) {
      const auto& [a, b] = pairs_[k];
      texts_.insert(texts_.end(), {a, b, std::string_view(joined_).substr(offset, a.size() + b.size())});
      offset += a.size() + b.size();
    }
    ids_.resize(texts_.size());
    model_.vocab.find_all(texts_, ids_.data());
    for (size_t k = 0; k < pairs_.size(); ++k) {
      const int32_t ia = ids_[3 * k], ib = ids_[3 * k + 1], im = ids_[3 * k + 2];
      const auto rank = static_cast<int32_t>(merges_.size());
      if (ia < 0 || ib < 0 || im < 0) {
        const std::string unknown(texts_[3 * k + (ia < 0 ? 0 : ib < 0 ? 1 : 2)]);
        throw IoError(label_ + ": merges entry " + std::to_string(rank) + " names " + printable(unknown, 60) +
                      ", which is not in the vocabulary; the file is damaged or from another model");
      }
      merges_.push_back({ia, ib, rank, im});
    }
    pairs_.clear();
    if (vocab_done_) escaped_.clear();
  }

  detail::BpeModel& model_;
  const std::string& label_;
  int64_t max_id_ = kMaxIdGap;
  bool vocab_done_ = false;
  std::vector<std::pair<std::string_view, int32_t>> tokens_;
  std::vector<std::pair<std::string_view, std::string_view>> pairs_;
  std::vector<std::pair<std::string, std::string>> early_merges_;
  std::deque<std::string> escaped_;  // this batch's strings that had escapes (a deque: their views stay valid)
  detail::BigVector<detail::MergeTable::Merge> merges_;
  std::string joined_;
  std::vector<std::string_view> texts_;
  std::vector<int32_t> ids_;
};

void scan_model(od::object model, Scan& scan, ModelBuilder& builder, size_t file_bytes, const std::string& label) {
  bool has_merges = false;
  for (auto field : model) {
    const std::string_view key = field.unescaped_key();
    od::value value = field.value();
    if (key == "type") {
      scan.type = std::string(string_of(value, "model.type", label));
    } else if (key == "vocab") {
      od::object vocab;
      if (value.get_object().get(vocab)) continue;  // Unigram's is a list: the type check names the problem
      scan.has_vocab = true;
      size_t count = 0;
      if (vocab.count_fields().get(count)) throw IoError(label + ": model.vocab is not valid JSON");
      builder.vocab_size_hint(count + scan.added.size(), file_bytes);
      for (auto entry : vocab) {
        const std::string_view token = builder.string(entry.key().value().raw(), "a model.vocab key");
        int64_t id = 0;
        if (entry.value().get_int64().get(id))
          throw IoError(label + ": model.vocab[" + printable(std::string(token), 60) + "] is not an integer id");
        builder.add_token(token, id);
      }
      builder.vocab_done();
    } else if (key == "merges") {
      od::array merges;
      if (value.get_array().get(merges)) throw IoError(label + ": model.merges is not a list");
      has_merges = true;
      size_t count = 0;
      if (!merges.count_elements().get(count)) builder.merges_size_hint(count);
      size_t rank = 0;
      for (od::value m : merges) {
        std::string_view line, pair[2];
        od::raw_json_string raw;
        if (!m.get_raw_json_string().get(raw)) {  // "a b"
          line = builder.string(raw.raw(), "a merges entry");
          const size_t space = line.find(' ');
          if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
            throw IoError(label + ": merges entry " + std::to_string(rank) + " (" + printable(std::string(line), 60) +
                          ") is not two tokens separated by one space");
          builder.add_merge(line.substr(0, space), line.substr(space + 1));
        } else {  // ["a", "b"]
          od::array parts;
          size_t n = 0;
          bool ok = !m.get_array().get(parts);
          if (ok)
            for (od::value part : parts) {
              ok = ok && n < 2 && !part.get_raw_json_string().get(raw);
              if (ok) pair[n++] = builder.string(raw.raw(), "a merges entry");
            }
          if (!ok || n != 2) throw IoError(label + ": merges entry " + std::to_string(rank) + " is not a pair of tokens");
          builder.add_merge(pair[0], pair[1]);
        }
        ++rank;
      }
    } else if (key == "unk_token") {
      if (!is_null(value)) scan.unk_token = std::string(string_of(value, "model.unk_token", label));
    } else if (key == "byte_fallback") {
      scan.byte_fallback = bool_of(value, "model.byte_fallback", label);
    } else if (key == "fuse_unk") {
      scan.fuse_unk = bool_of(value, "model.fuse_unk", label);
    } else if (key == "ignore_merges") {
      scan.ignore_merges = bool_of(value, "model.ignore_merges", label);
    } else if (key == "continuing_subword_prefix" || key == "end_of_word_suffix") {
      if (!is_null(value) && !string_of(value, "model." + std::string(key), label).empty())
        throw IoError(label + ": model." + std::string(key) + " is set; qkv's BPE has none");
    } else if (key == "dropout") {
      double dropout = 0;
      if (!is_null(value) && (value.get_double().get(dropout) || dropout != 0.0))
        throw IoError(label + ": model.dropout is set; BPE dropout is for training tokenizers, qkv has none");
    }
  }
  if (!scan.has_vocab && has_merges) builder.vocab_done();  // the type check below names the problem
  builder.merges_done();
}

void scan_added_tokens(od::array list, Scan& scan, const std::string& label) {
  for (od::value item : list) {
    AddedToken t;
    bool has_content = false, has_id = false, has_normalized = false;
    od::object a;
    if (item.get_object().get(a)) throw IoError(label + ": added_tokens entry " + std::to_string(scan.added.size()) + " is not an object");
    for (auto field : a) {
      const std::string_view key = field.unescaped_key();
      od::value v = field.value();
      const auto what = [&] { return "added_tokens entry " + std::to_string(scan.added.size()) + "'s " + std::string(key); };
      if (key == "content") {
        std::string_view content;
        has_content = !v.get_string().get(content);
        t.content = std::string(content);
      } else if (key == "id") {
        has_id = !v.get_int64().get(t.id);
      } else if (key == "special") {
        t.special = bool_of(v, what(), label);
      } else if (key == "lstrip") {
        t.lstrip = bool_of(v, what(), label);
      } else if (key == "rstrip") {
        t.rstrip = bool_of(v, what(), label);
      } else if (key == "single_word") {
        t.single_word = bool_of(v, what(), label);
      } else if (key == "normalized") {
        t.normalized = bool_of(v, what(), label);
        has_normalized = true;
      }
    }
    if (!has_content || !has_id)
      throw IoError(label + ": added_tokens entry " + std::to_string(scan.added.size()) + " needs a string content and an integer id");
    if (!has_normalized) t.normalized = !t.special;  // AddedToken::from(content, special)'s default
    scan.added.push_back(std::move(t));
  }
}

// A small section as an nlohmann value (its components' readers take those).
json section(od::value v, const std::string& key, const std::string& label) {
  if (is_null(v)) return nullptr;
  std::string_view raw;
  od::object o;
  if (v.get_object().get(o) || o.raw_json().get(raw)) throw IoError(label + ": " + key + " is not an object");
  try {
    return json::parse(raw);
  } catch (const json::exception& e) {
    throw IoError(label + ": " + key + " is malformed (" + e.what() + ")");
  }
}

// The whole file in one pass: the model's vocabulary and merges into s.model, the rest into the Scan.
Scan scan_file(simdjson::padded_string_view bytes, HfTokenizer::State& s, const std::string& label) {
  Scan scan;
  bool has_model = false;
  od::parser parser;
  ModelBuilder builder(s.model, label);
  try {
    // A value of another type is the file's mistake to name; any other error is JSON that does not parse.
    auto expect = [&](simdjson::error_code e, const std::string& problem) {
      if (e == simdjson::INCORRECT_TYPE) throw IoError(label + ": " + problem);
      if (e) throw simdjson::simdjson_error(e);
    };
    od::document doc = parser.iterate(bytes);
    od::object top;
    expect(doc.get_object().get(top), "has no 'model' object; a tokenizer.json has one");
    for (auto field : top) {
      const std::string_view key = field.unescaped_key();
      od::value value = field.value();
      if (key == "model") {
        od::object model;
        expect(value.get_object().get(model), "has no 'model' object; a tokenizer.json has one");
        has_model = true;
        scan_model(model, scan, builder, bytes.length(), label);
      } else if (key == "added_tokens") {
        if (is_null(value)) continue;
        od::array list;
        expect(value.get_array().get(list), "added_tokens is not a list");
        scan_added_tokens(list, scan, label);
      } else if (key == "normalizer") {
        scan.normalizer = section(value, "normalizer", label);
      } else if (key == "pre_tokenizer") {
        scan.pre_tokenizer = section(value, "pre_tokenizer", label);
      } else if (key == "post_processor") {
        scan.post_processor = section(value, "post_processor", label);
      } else if (key == "decoder") {
        scan.decoder = section(value, "decoder", label);
      }
    }
    const char* rest = nullptr;  // OUT_OF_BOUNDS once the whole text is consumed
    if (!doc.current_location().get(rest)) throw IoError(label + ": has text after its JSON object");
  } catch (const simdjson::simdjson_error& e) {
    throw IoError(label + ": not valid JSON (" + e.what() + ")");
  }
  if (!has_model) throw IoError(label + ": has no 'model' object; a tokenizer.json has one");
  if (scan.type != "BPE") throw IoError(label + ": model type '" + printable(scan.type, 40) + "' is not supported; qkv reads BPE");
  if (!scan.has_vocab) throw IoError(label + ": model.vocab is not an object");
  s.model.merges.build(builder.take_merges(), s.model.vocab.size());
  return scan;
}

// The added tokens after the model's vocabulary (their text now finds their id), and the model's settings.
void add_tokens(const Scan& scan, HfTokenizer::State& s, const std::string& label) {
  const int64_t max_id = static_cast<int64_t>(s.model.vocab.size()) + static_cast<int64_t>(scan.added.size()) + kMaxIdGap;
  for (const AddedToken& t : scan.added) {
    if (t.content.empty()) continue;
    if (t.id < 0 || t.id >= max_id)
      throw IoError(label + ": added_tokens id " + std::to_string(t.id) + " of " + printable(t.content, 60) + " is outside [0, " +
                    std::to_string(max_id) + "): ids are numbered from 0 without large gaps");
    s.model.vocab.set(static_cast<int32_t>(t.id), t.content);
  }
  s.special.assign(static_cast<size_t>(s.model.vocab.size()), false);
  for (const AddedToken& t : scan.added) {
    if (t.content.empty()) continue;
    s.special[static_cast<size_t>(t.id)] = t.special;
    s.added.push_back(t);
  }
  s.model.ignore_merges = scan.ignore_merges;
  s.model.byte_fallback = scan.byte_fallback;
  s.model.fuse_unk = scan.fuse_unk;
  if (scan.unk_token) s.model.unk = s.id_of(*scan.unk_token);
  s.model.byte_tokens.fill(-1);
  if (s.model.byte_fallback) s.model.find_byte_tokens();
}

// The normalizer, pre-tokenizer, decoder and post-processor, then the tries of added tokens (normalized ones by
// their normalized content).
void build_components(const Scan& scan, HfTokenizer::State& s, const std::string& label) {
  try {
    if (!scan.normalizer.is_null()) s.normalizer = Normalizer::from(scan.normalizer, label);
    if (!scan.pre_tokenizer.is_null()) s.pre_tokenizer = PreTokenizer::from(scan.pre_tokenizer, label);
    if (!scan.decoder.is_null()) s.decoder = Decoder::from(scan.decoder, label);
    // The post-processor's single-sequence template, found in a TemplateProcessing alone or inside a Sequence.
    std::function<void(const json&)> post = [&](const json& p) {
      const std::string type = p.value("type", "");
      if (type == "Sequence") {
        for (const json& c : p.at("processors")) post(c);
      } else if (type == "TemplateProcessing") {
        s.has_template = true;
        s.template_items.clear();
        for (const json& item : p.at("single")) {
          if (item.contains("Sequence")) {
            s.template_items.push_back(-1);
          } else if (item.contains("SpecialToken")) {
            const std::string name = item["SpecialToken"].value("id", "");
            const json& specials = p.value("special_tokens", json::object());
            if (specials.contains(name) && specials[name].contains("ids")) {
              for (const json& id : specials[name]["ids"]) s.template_items.push_back(id.get<int64_t>());
            } else if (s.id_of(name) >= 0) {
              s.template_items.push_back(s.id_of(name));
            } else {
              throw IoError(label + ": post_processor names special token " + printable(name, 60) + ", which has no id");
            }
          }
        }
        for (int64_t id : s.template_items)
          if (id >= s.size()) throw IoError(label + ": post_processor id " + std::to_string(id) + " is outside the vocabulary");
      } else if (type != "ByteLevel") {
        throw IoError(label + ": post_processor '" + printable(type, 40) + "' is not supported; qkv has TemplateProcessing, "
                      "ByteLevel and Sequence");
      }
    };
    if (!scan.post_processor.is_null()) post(scan.post_processor);
  } catch (const json::exception& e) {
    throw IoError(label + ": malformed (" + std::string(e.what()) + ")");
  }
  // A normalized added token is looked for in normalized text, so by its own normalized content (as tokenizers'
  // refresh_added_tokens builds its second trie).
  for (size_t i = 0; i < s.added.size(); ++i) {
    std::string content = s.added[i].content;
    if (s.added[i].normalized && s.normalizer) s.normalizer->apply(content);
    if (!content.empty()) (s.added[i].normalized ? s.normalized_added_trie : s.added_trie).insert(content, static_cast<int32_t>(i));
  }
  const auto cps = detail::byte_code_points();
  for (int b = 0; b < 256; ++b) s.byte_of[cps[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
}

// A file mapped with the padding simdjson reads past its end: anonymous zero pages reserved for size + padding, the
// file mapped over their start. MAP_POPULATE maps the page cache's pages in one call, so the bytes are neither copied
// (read() into a fresh buffer was a third of a warm load: the copy and a page fault per 4 KiB) nor faulted in one by
// one. Held only while the file is parsed; a file shortened meanwhile faults, as with any mmap reader (io::MappedFile).
class PaddedMapping {
 public:
  explicit PaddedMapping(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(path + ": cannot be read (" + std::strerror(errno) + ")");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw IoError(path + ": cannot be read (not a regular file)");
    }
    size_ = static_cast<size_t>(st.st_size);
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    length_ = (size_ + simdjson::SIMDJSON_PADDING + page - 1) / page * page;
    void* base = ::mmap(nullptr, length_, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED && size_ > 0 &&
        ::mmap(base, size_, PROT_READ, MAP_PRIVATE | MAP_FIXED | MAP_POPULATE, fd, 0) == MAP_FAILED) {
      ::munmap(base, length_);
      base = MAP_FAILED;
    }
    const int error = errno;
    ::close(fd);
    if (base == MAP_FAILED) throw IoError(path + ": cannot be mapped (" + std::strerror(error) + ")");
    data_ = static_cast<const char*>(base);
  }
  PaddedMapping(const PaddedMapping&) = delete;
  PaddedMapping& operator=(const PaddedMapping&) = delete;
  ~PaddedMapping() { ::munmap(const_cast<char*>(data_), length_); }
  simdjson::padded_string_view view() const { return simdjson::padded_string_view(data_, size_, length_); }

 private:
  const char* data_ = nullptr;
  size_t size_ = 0, length_ = 0;
};

std::unique_ptr<HfTokenizer::State> build_state(simdjson::padded_string_view bytes, std::string_view config_text,
                                                const std::string& label);

}  // namespace

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& tokenizer_path, const std::string& config_path) {
  std::string config;
  std::error_code ec;
  if (!config_path.empty() && std::filesystem::exists(config_path, ec)) config = read_text(config_path);
  const PaddedMapping file(tokenizer_path);
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(build_state(file.view(), config, tokenizer_path)));
}

std::unique_ptr<HfTokenizer> HfTokenizer::from_folder(const std::string& dir) {
  const std::filesystem::path p(dir);
  std::error_code ec;
  if (!std::filesystem::exists(p / "tokenizer.json", ec)) return nullptr;
  return load((p / "tokenizer.json").string(), (p / "tokenizer_config.json").string());
}

std::unique_ptr<HfTokenizer> HfTokenizer::parse(std::string_view text, std::string_view config_text, const std::string& label) {
  const simdjson::padded_string padded(text);
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(build_state(padded, config_text, label)));
}

namespace {
std::unique_ptr<HfTokenizer::State> build_state(simdjson::padded_string_view bytes, std::string_view config_text,
                                                const std::string& label) {
  using State = HfTokenizer::State;
  auto state = std::make_unique<State>();
  State& s = *state;
  s.label = label;
  const Scan scan = scan_file(bytes, s, label);
  add_tokens(scan, s, label);
  build_components(scan, s, label);
  if (!config_text.empty()) {
    const std::string where = std::filesystem::path(label).parent_path().empty()
                                  ? std::string("tokenizer_config.json")
                                  : (std::filesystem::path(label).parent_path() / "tokenizer_config.json").string();
    json c;
    try {
      c = json::parse(config_text);
    } catch (const json::exception& e) {
      throw IoError(where + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!c.is_object()) throw IoError(where + ": not a JSON object");
    // transformers' LlamaTokenizerFast (and CodeLlama's, Gemma's, Cohere's) replace the file's post-processor by
    // "[bos] $A [eos]" from add_bos_token / add_eos_token (update_post_processor), their bos/eos defaulting to the
    // class's own: DeepSeek-V3's tokenizer.json adds no BOS, its LlamaTokenizerFast does.
    struct BosEosClass {
      const char* name;
      const char *bos, *eos;
    };
    static constexpr BosEosClass kBosEosClasses[] = {{"LlamaTokenizer", "<s>", "</s>"},
                                                     {"CodeLlamaTokenizer", "<s>", "</s>"},
                                                     {"GemmaTokenizer", "<bos>", "<eos>"},
                                                     {"CohereTokenizer", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"}};
    std::string cls = c.contains("tokenizer_class") && c["tokenizer_class"].is_string() ? c["tokenizer_class"].get<std::string>() : "";
    if (cls.size() > 4 && cls.compare(cls.size() - 4, 4, "Fast") == 0) cls.resize(cls.size() - 4);
    const BosEosClass* bos_eos_class = nullptr;
    for (const BosEosClass& k : kBosEosClasses)
      if (cls == k.name) bos_eos_class = &k;
    std::string bos_text = bos_eos_class ? bos_eos_class->bos : "", eos_text = bos_eos_class ? bos_eos_class->eos : "";
    if (c.contains("eos_token")) eos_text = token_text(c["eos_token"]);
    if (c.contains("bos_token")) bos_text = token_text(c["bos_token"]);
    if (!eos_text.empty()) s.eos = s.id_of(eos_text);
    if (!bos_text.empty()) s.bos = s.id_of(bos_text);
    if (bos_eos_class) {
      auto flag = [&](const char* key, bool fallback) {
        if (!c.contains(key) || c[key].is_null()) return fallback;
        if (!c[key].is_boolean()) throw IoError(where + ": " + key + " is " + describe(c[key]) + ", not true or false");
        return c[key].get<bool>();
      };
      const bool add_bos = flag("add_bos_token", true), add_eos = flag("add_eos_token", false);
      if (add_bos && s.bos < 0)
        throw IoError(where + ": add_bos_token is true but bos_token (" + printable(bos_text, 60) + ") is no token of " +
                      label + "; name the BOS token or set add_bos_token to false");
      if (add_eos && s.eos < 0)
        throw IoError(where + ": add_eos_token is true but eos_token (" + printable(eos_text, 60) + ") is no token of " +
                      label + "; name the EOS token or set add_eos_token to false");
      s.has_template = true;
      s.template_items.clear();
      if (add_bos) s.template_items.push_back(s.bos);
      s.template_items.push_back(-1);
      if (add_eos) s.template_items.push_back(s.eos);
    }
    if (c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        s.chat_template = t.get<std::string>();
      } else if (t.is_array()) {
        for (const json& named : t)
          if (named.is_object() && named.value("name", "") == "default" && named.contains("template") && named["template"].is_string())
            s.chat_template = named["template"].get<std::string>();
      }
    }
  }
  return state;
}
}  // namespace

std::vector<int64_t> HfTokenizer::encode_rendered(std::string_view text) const { return encode_impl(text, true, false); }

std::vector<int64_t> HfTokenizer::encode(std::string_view text, bool allow_special) const {
  return encode_impl(text, allow_special, allow_special);
}

std::vector<int64_t> HfTokenizer::encode_impl(std::string_view text, bool allow_special, bool post_process) const {
  if (const auto bad = first_invalid_utf8(text)) {
    throw ValueError("tokenizer.json: the text is not valid UTF-8 at byte " + std::to_string(*bad) +
                     "; fix the encoding or replace invalid bytes (--replace-invalid)");
  }
  const State& s = *state_;
  std::vector<int64_t> body;
  s.encode_text(text, allow_special, body);
  if (!post_process || !s.has_template) return body;
  std::vector<int64_t> out;
  for (int64_t item : s.template_items) {
    if (item < 0) out.insert(out.end(), body.begin(), body.end());
    else out.push_back(item);
  }
  return out;
}

namespace {
std::string decode_ids(const HfTokenizer::State& s, std::span<const int64_t> ids, bool skip_special) {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= s.size())
      throw ValueError("tokenizer.json: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(s.size()) + ")");
    if (skip_special && s.special[static_cast<size_t>(id)]) continue;
    tokens.emplace_back(s.model.vocab.text(static_cast<int32_t>(id)));
  }
  if (s.decoder) s.decoder->apply(tokens, s.byte_of);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return replace_invalid_utf8(out);
}
}  // namespace

std::string HfTokenizer::decode(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, false); }
std::string HfTokenizer::decode_text(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, true); }
int64_t HfTokenizer::vocab_size() const { return state_->size(); }
int64_t HfTokenizer::end_of_text() const { return state_->eos; }
int64_t HfTokenizer::bos_id() const { return state_->bos; }
int64_t HfTokenizer::token_id(std::string_view token) const { return state_->id_of(token); }
bool HfTokenizer::is_special(int64_t id) const {
  return id >= 0 && id < static_cast<int64_t>(state_->special.size()) && state_->special[static_cast<size_t>(id)];
}
const std::string& HfTokenizer::chat_template() const { return state_->chat_template; }
std::string HfTokenizer::token_content(int64_t id) const {
  if (id < 0 || id >= state_->size()) return "";
  return std::string(state_->model.vocab.text(static_cast<int32_t>(id)));
}

}  // namespace qkv::text
