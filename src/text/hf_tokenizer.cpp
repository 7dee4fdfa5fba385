// tokenizer.json (see qkv/text/hf_tokenizer.hpp). The pipeline is Hugging Face tokenizers' own: added tokens split
// off first (leftmost-longest, through a byte trie), then per remaining segment normalizer → pre-tokenizer → BPE, then
// the post_processor; decoding runs the file's decoder chain. BPE merges a word with a heap of candidate pairs (lowest
// rank first, then leftmost), so a word of n symbols costs O(n log n) and a text costs about linear time in its length.
#include "qkv/text/hf_tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstring>
#include <functional>
#include <optional>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

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
  enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext } behavior = Behavior::Isolated;
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
      else throw IoError(where + ": Split behavior '" + printable(behavior, 40) + "' is not supported; qkv has Isolated, "
                         "Removed, MergedWithPrevious and MergedWithNext");
      if (j.value("invert", false)) throw IoError(where + ": Split with invert = true is not supported");
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

  static void split(const std::string& piece, const std::vector<std::pair<size_t, size_t>>& hits, Behavior behavior,
                    std::vector<std::string>& out) {
    size_t at = 0;
    std::string pending;  // MergedWithNext: the delimiter waiting for what follows
    for (const auto& [b, e] : hits) {
      std::string before = piece.substr(at, b - at), match = piece.substr(b, e - b);
      switch (behavior) {
        case Behavior::Isolated:
          if (!before.empty()) out.push_back(before);
          out.push_back(match);
          break;
        case Behavior::Removed:
          if (!before.empty()) out.push_back(before);
          break;
        case Behavior::MergedWithPrevious:
          out.push_back(before + match);
          break;
        case Behavior::MergedWithNext:
          if (!pending.empty() || !before.empty()) out.push_back(pending + before);
          pending = match;
          break;
      }
      at = e;
    }
    std::string rest = piece.substr(at);
    if (behavior == Behavior::MergedWithNext) rest = pending + rest;
    if (!rest.empty()) out.push_back(rest);
  }

  // pieces in, pieces out; `first` says whether the segment starts the text (Metaspace's prepend_scheme "first").
  void apply(std::vector<std::string>& pieces, bool first, const std::array<std::string, 256>& bytes) const {
    std::vector<std::string> out;
    switch (kind) {
      case Kind::Sequence:
        for (const PreTokenizer& c : children) c.apply(pieces, first, bytes);
        return;
      case Kind::Split:
        for (const std::string& p : pieces) split(p, regex ? regex->matches(p) : literal_matches(p, literal), behavior, out);
        break;
      case Kind::ByteLevel:
        for (std::string p : pieces) {
          if (add_prefix_space && (p.empty() || p[0] != ' ')) p = " " + p;
          std::vector<std::string> words;
          if (regex) split(p, regex->matches(p), Behavior::Isolated, words);
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
          if (metaspace_split) split(p, literal_matches(p, replacement), Behavior::MergedWithNext, out);
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
      case Kind::ByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        auto flush = [&] {
          if (!pending.empty()) out.push_back(lossy(pending));
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
      case Kind::Metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          replace_all(tokens[i], content, " ");
          if (i == 0 && prepend && !tokens[i].empty() && tokens[i][0] == ' ') tokens[i].erase(0, 1);
        }
        return;
    }
  }
};

// ---- added tokens: a byte trie for leftmost-longest matching ----

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool special = false, lstrip = false, rstrip = false;
};

class Trie {
 public:
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
  // The longest inserted string starting at s[at] that `accept` allows: (token, length), or (−1, 0).
  template <typename Accept>
  std::pair<int32_t, size_t> longest(std::string_view s, size_t at, Accept&& accept) const {
    int32_t node = 0, best = -1;
    size_t best_len = 0;
    for (size_t i = at; i < s.size(); ++i) {
      const auto& next = nodes_[static_cast<size_t>(node)].next;
      const auto it = next.find(static_cast<unsigned char>(s[i]));
      if (it == next.end()) break;
      node = it->second;
      const int32_t t = nodes_[static_cast<size_t>(node)].token;
      if (t >= 0 && accept(t)) best = t, best_len = i + 1 - at;
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

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

}  // namespace

struct HfTokenizer::State {
  std::string label;
  std::unordered_map<std::string, int32_t> vocab;  // model vocabulary and added tokens
  std::vector<std::string> tokens;                  // id → content
  std::vector<bool> special;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) → (rank, merged)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk = -1;
  std::vector<int32_t> byte_tokens;  // <0xNN> ids for byte fallback (−1 where missing)
  std::optional<Normalizer> normalizer;
  std::optional<PreTokenizer> pre_tokenizer;
  std::optional<Decoder> decoder;
  std::vector<AddedToken> added;
  Trie added_trie;
  // post_processor: the single-sequence template, as (token id or −1 for the text) items; empty: nothing added
  std::vector<int64_t> template_items;
  bool has_template = false;
  std::array<std::string, 256> byte_alphabet = detail::byte_to_unicode();
  std::unordered_map<uint32_t, unsigned char> byte_of;
  int64_t eos = -1, bos = -1;
  std::string chat_template;

  int32_t id_of(const std::string& token) const {
    const auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }

  // One pre-tokenized word → ids.
  void bpe(const std::string& word, std::vector<int64_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      const int32_t whole = id_of(word);
      if (whole >= 0) {
        out.push_back(whole);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int32_t prev, next;
      bool alive;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    auto push = [&](int32_t id) {
      if (id == unk && fuse_unk && !symbols.empty() && symbols.back().id == unk) return;
      const int32_t n = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, n - 1, n + 1, true});
    };
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
      const int32_t id = id_of(word.substr(i, n));
      if (id >= 0) {
        push(id);
      } else if (byte_fallback) {
        bool all = true;
        for (size_t k = 0; k < n; ++k) all = all && byte_tokens[static_cast<unsigned char>(word[i + k])] >= 0;
        if (all) {
          for (size_t k = 0; k < n; ++k) push(byte_tokens[static_cast<unsigned char>(word[i + k])]);
        } else if (unk >= 0) {
          push(unk);
        }
      } else if (unk >= 0) {
        push(unk);
      }
      i += n;
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;
    struct Candidate {
      int32_t rank, pos, merged;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
    auto consider = [&](int32_t pos) {
      if (pos < 0) return;
      const int32_t next = symbols[static_cast<size_t>(pos)].next;
      if (next < 0) return;
      const auto it = merges.find(pair_key(symbols[static_cast<size_t>(pos)].id, symbols[static_cast<size_t>(next)].id));
      if (it != merges.end()) queue.push({it->second.first, pos, it->second.second});
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[static_cast<size_t>(top.pos)];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = symbols[static_cast<size_t>(left.next)];
      const auto it = merges.find(pair_key(left.id, right.id));
      if (it == merges.end() || it->second.second != top.merged) continue;  // stale: a neighbour changed since
      left.id = top.merged;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
      consider(left.prev);
      consider(top.pos);
    }
    for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) out.push_back(symbols[static_cast<size_t>(i)].id);
  }

  void encode_segment(std::string segment, bool first, std::vector<int64_t>& out) const {
    if (normalizer) normalizer->apply(segment);
    std::vector<std::string> pieces{segment};
    if (pre_tokenizer) pre_tokenizer->apply(pieces, first, byte_alphabet);
    for (const std::string& p : pieces) bpe(p, out);
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

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& tokenizer_path, const std::string& config_path) {
  std::string config;
  std::error_code ec;
  if (!config_path.empty() && std::filesystem::exists(config_path, ec)) config = read_text(config_path);
  return parse(read_text(tokenizer_path), config, tokenizer_path);
}

std::unique_ptr<HfTokenizer> HfTokenizer::from_folder(const std::string& dir) {
  const std::filesystem::path p(dir);
  std::error_code ec;
  if (!std::filesystem::exists(p / "tokenizer.json", ec)) return nullptr;
  return load((p / "tokenizer.json").string(), (p / "tokenizer_config.json").string());
}

std::unique_ptr<HfTokenizer> HfTokenizer::parse(std::string_view text, std::string_view config_text, const std::string& label) {
  auto state = std::make_unique<State>();
  State& s = *state;
  s.label = label;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError(label + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  try {
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      throw IoError(label + ": has no 'model' object; a tokenizer.json has one");
    const json& model = j["model"];
    const std::string type = model.value("type", "BPE");
    if (type != "BPE") throw IoError(label + ": model type '" + printable(type, 40) + "' is not supported; qkv reads BPE");
    if (!model.contains("vocab") || !model["vocab"].is_object()) throw IoError(label + ": model.vocab is not an object");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
        throw IoError(label + ": model." + key + " is set; qkv's BPE has none");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      throw IoError(label + ": model.dropout is set; BPE dropout is for training tokenizers, qkv has none");
    int64_t size = 0;
    const int64_t entries = static_cast<int64_t>(model["vocab"].size()) +
                            (j.contains("added_tokens") && j["added_tokens"].is_array() ? static_cast<int64_t>(j["added_tokens"].size()) : 0);
    const int64_t max_id = entries + kMaxIdGap;
    auto place = [&](const std::string& token, int64_t id, const std::string& where) {
      if (id < 0 || id >= max_id) throw IoError(label + ": " + where + " id " + std::to_string(id) + " of " +
                                                printable(token, 60) + " is outside [0, " + std::to_string(max_id) +
                                                "): ids are numbered from 0 without large gaps");
      s.vocab[token] = static_cast<int32_t>(id);
      size = std::max(size, id + 1);
      if (s.tokens.size() < static_cast<size_t>(size)) s.tokens.resize(static_cast<size_t>(size)), s.special.resize(static_cast<size_t>(size));
      s.tokens[static_cast<size_t>(id)] = token;
    };
    for (const auto& [token, id] : model["vocab"].items()) {
      if (!id.is_number_integer()) throw IoError(label + ": model.vocab[" + printable(token, 60) + "] is not an integer id");
      place(token, id.get<int64_t>(), "model.vocab");
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (const json& a : j["added_tokens"]) {
        AddedToken t;
        if (!a.is_object() || !a.contains("content") || !a["content"].is_string() || !a.contains("id") || !a["id"].is_number_integer())
          throw IoError(label + ": added_tokens entry " + describe(a) + " needs a string content and an integer id");
        t.content = a["content"].get<std::string>();
        t.id = a["id"].get<int64_t>();
        t.special = a.value("special", false);
        t.lstrip = a.value("lstrip", false);
        t.rstrip = a.value("rstrip", false);
        if (t.content.empty()) continue;
        place(t.content, t.id, "added_tokens");
        s.special[static_cast<size_t>(t.id)] = t.special;
        s.added_trie.insert(t.content, static_cast<int32_t>(s.added.size()));
        s.added.push_back(std::move(t));
      }
    }
    s.ignore_merges = model.value("ignore_merges", false);
    s.byte_fallback = model.value("byte_fallback", false);
    s.fuse_unk = model.value("fuse_unk", false);
    if (model.contains("unk_token") && model["unk_token"].is_string()) s.unk = s.id_of(model["unk_token"].get<std::string>());
    s.byte_tokens.assign(256, -1);
    if (s.byte_fallback) {
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        s.byte_tokens[static_cast<size_t>(b)] = s.id_of(name);
      }
    }
    if (model.contains("merges")) {
      const json& merges = model["merges"];
      if (!merges.is_array()) throw IoError(label + ": model.merges is not a list");
      s.merges.reserve(merges.size());
      int32_t rank = 0;
      for (const json& m : merges) {
        std::string a, b;
        if (m.is_string()) {
          const std::string line = m.get<std::string>();
          const size_t space = line.find(' ');
          if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
            throw IoError(label + ": merges entry " + std::to_string(rank) + " (" + printable(line, 60) +
                          ") is not two tokens separated by one space");
          a = line.substr(0, space), b = line.substr(space + 1);
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
          a = m[0].get<std::string>(), b = m[1].get<std::string>();
        } else {
          throw IoError(label + ": merges entry " + std::to_string(rank) + " is " + describe(m) + ", not a pair of tokens");
        }
        const int32_t ia = s.id_of(a), ib = s.id_of(b), im = s.id_of(a + b);
        if (ia < 0 || ib < 0 || im < 0) {
          const std::string& unknown = ia < 0 ? a : ib < 0 ? b : a + b;
          throw IoError(label + ": merges entry " + std::to_string(rank) + " names " + printable(unknown, 60) +
                        ", which is not in the vocabulary; the file is damaged or from another model");
        }
        s.merges.try_emplace(pair_key(ia, ib), rank, im);
        ++rank;
      }
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null()) s.normalizer = Normalizer::from(j["normalizer"], label);
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) s.pre_tokenizer = PreTokenizer::from(j["pre_tokenizer"], label);
    if (j.contains("decoder") && !j["decoder"].is_null()) s.decoder = Decoder::from(j["decoder"], label);
    const auto cps = detail::byte_code_points();
    for (int b = 0; b < 256; ++b) s.byte_of[cps[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
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
          if (id >= static_cast<int64_t>(s.tokens.size())) throw IoError(label + ": post_processor id " + std::to_string(id) + " is outside the vocabulary");
      } else if (type != "ByteLevel") {
        throw IoError(label + ": post_processor '" + printable(type, 40) + "' is not supported; qkv has TemplateProcessing, "
                      "ByteLevel and Sequence");
      }
    };
    if (j.contains("post_processor") && !j["post_processor"].is_null()) post(j["post_processor"]);
  } catch (const json::exception& e) {
    throw IoError(label + ": malformed (" + std::string(e.what()) + ")");
  }
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
    if (c.contains("eos_token")) s.eos = s.id_of(token_text(c["eos_token"]));
    if (c.contains("bos_token")) s.bos = s.id_of(token_text(c["bos_token"]));
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
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(state)));
}

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
  // Added tokens first, leftmost-longest; the text between them goes through the model.
  size_t segment_start = 0, at = 0;
  bool first = true;
  std::string pending;
  auto flush = [&](size_t end) {
    std::string segment(text.substr(segment_start, end - segment_start));
    if (!segment.empty()) s.encode_segment(std::move(segment), first, body);
    first = false;
  };
  while (at < text.size()) {
    const auto [token, length] = s.added_trie.longest(text, at, [&](int32_t t) { return allow_special || !s.added[static_cast<size_t>(t)].special; });
    if (token < 0) {
      ++at;
      continue;
    }
    const AddedToken& added = s.added[static_cast<size_t>(token)];
    size_t end = at;
    if (added.lstrip) while (end > segment_start && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
    flush(end);
    body.push_back(added.id);
    at += length;
    if (added.rstrip) while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    segment_start = at;
  }
  flush(text.size());
  if (!post_process || !s.has_template) return body;
  std::vector<int64_t> out;
  for (int64_t item : s.template_items) {
    if (item < 0) out.insert(out.end(), body.begin(), body.end());
    else out.push_back(item);
  }
  return out;
}

namespace {
std::string decode_ids(const HfTokenizer::State& s, std::span<const int64_t> ids, bool skip_special, bool raw = false) {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(s.tokens.size()))
      throw ValueError("tokenizer.json: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(s.tokens.size()) + ")");
    if (skip_special && s.special[static_cast<size_t>(id)]) continue;
    tokens.push_back(s.tokens[static_cast<size_t>(id)]);
  }
  if (s.decoder) s.decoder->apply(tokens, s.byte_of);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return raw ? out : replace_invalid_utf8(out);
}
}  // namespace

std::string HfTokenizer::decode(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, false); }
std::string HfTokenizer::decode_text(std::span<const int64_t> ids) const { return decode_ids(*state_, ids, true); }
std::string HfTokenizer::token_bytes(int64_t id) const {
  return decode_ids(*state_, std::span<const int64_t>(&id, 1), false, true);
}
int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(state_->tokens.size()); }
int64_t HfTokenizer::end_of_text() const { return state_->eos; }
int64_t HfTokenizer::bos_id() const { return state_->bos; }
int64_t HfTokenizer::token_id(std::string_view token) const { return state_->id_of(std::string(token)); }
bool HfTokenizer::is_special(int64_t id) const {
  return id >= 0 && id < static_cast<int64_t>(state_->special.size()) && state_->special[static_cast<size_t>(id)];
}
const std::string& HfTokenizer::chat_template() const { return state_->chat_template; }
std::string HfTokenizer::token_content(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(state_->tokens.size())) return "";
  return state_->tokens[static_cast<size_t>(id)];
}

}  // namespace qkv::text
