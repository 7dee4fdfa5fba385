// A GGUF file's tokenizer.ggml.* metadata read into the pipeline of hf_pipeline.hpp (see HfTokenizer::from_gguf):
// llama.cpp's vocabulary, run as the tokenizer.json it was converted from (convert_hf_to_gguf.py and gguf-py's
// SpecialVocab write it; llama.cpp's llama-vocab.cpp reads it). Not here: tokenizer.json (hf_tokenizer.cpp), the
// GGUF format itself (io/gguf.hpp).
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>

#include "hf_pipeline.hpp"
#include "qkv/io/gguf.hpp"

namespace qkv::text {

using namespace detail;

namespace {

// llama.cpp's token types (llama_token_type), as tokenizer.ggml.token_type stores them.
enum TokenType : int64_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// tokenizer.ggml.pre: the pre-tokenizer of a byte-level BPE vocabulary, named by convert_hf_to_gguf.py from a hash
// of how the model's tokenizer splits a test text. Its regexes are the model's tokenizer.json Split patterns, applied
// one after the other, each keeping matches and the text between them as pieces (llama-vocab.cpp lists the same,
// some rewritten for its own regex engine; PCRE2 takes the originals).
struct PreTokenizerType {
  std::vector<std::string_view> names;
  std::vector<const char*> regexes;
  bool ignore_merges = false;  // llama.cpp's flag: a word that is a token is that token
  bool add_bos = false;        // llama.cpp's default when the file has no add_bos_token
  bool nfc = false;            // the tokenizer.json normalises to NFC (Qwen2's); llama.cpp does not
};

constexpr const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen35 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kO200k =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kTekken =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kDeepseek3Words =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kO200kOneDigit =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kSpark25Words =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+)";
// Jais 2: runs of white space cut into powers of two (llama.cpp's list).
constexpr const char* kJais2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1})";
// DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee … as its tokenizer.json lists them.
constexpr const char* kDeepseekLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
constexpr const char* kGpt2NoTrailing = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";

const std::vector<PreTokenizerType>& pre_tokenizer_types() {
  static const std::vector<PreTokenizerType> types = {
      {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"},
       {kLlama3}, true, true},
      {{"dbrx", "smaug-bpe", "chatglm-bpe", "glm4"}, {kLlama3}},
      {{"jais-2"}, {kJais2}},
      {{"qwen2", "deepseek-r1-qwen"}, {kQwen2}, false, false, true},
      {{"kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"}, {kQwen2}},
      {{"laguna"}, {"[^\n]+|[\n]+", kQwen2}},
      {{"qwen35"}, {kQwen35}},
      {{"deepseek-llm"},
       {"[\r\n]", kDeepseekLetters, R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", R"(\s+\z)", R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)", R"(\p{N}+)"}},
      {{"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"}, {R"(\p{N}{1,3})", "[一-龥぀-ゟ゠-ヿ]+", kDeepseek3Words}},
      {{"spark2_5"}, {R"(\p{N}{1,3})", "[一-龥぀-ゟ゠-ヿ]+", kSpark25Words, R"(\p{N})"}},
      {{"deepseek-coder"}, {"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[一-龥ࠀ-一가-퟿]+", R"(\p{N})"}},
      {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {kO200k}},
      {{"granite-embed-multi-97m"}, {kO200k}, true},
      {{"youtu"}, {"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+", kO200kOneDigit}, true},
      {{"tiny_aya", "cohere2moe"}, {R"(\d{1,3}(?=(?:\d{3})*\b))", kO200k}},
      {{"tekken"}, {kTekken}, true, true},
      {{"poro-chat", "bloom", "gpt3-finnish"}, {R"( ?[^(\s|.,!?…。，、।۔،)]+)"}},
      {{"viking"}, {R"( ?[^(\s|.,!?…。，、।۔،)]+)", R"(\p{N})"}},
      {{"bailingmoe", "bailingmoe2", "llada-moe"},
       {R"('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)"}},
      {{"seed-coder"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"ufakzeka"}, {R"([^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"exaone-moe"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+)"}},
      {{"minicpm5"},
       {R"(\p{N}{1,3})", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       true},
      {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
        "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"},
       {kGpt2Pattern}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"},
       {R"(\p{N})", kGpt2Pattern}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2NoTrailing, "[0-9][0-9][0-9]"}},
      {{"default", ""}, {R"([\p{P}\$\+<=>\^~\|]+)", kGpt2NoTrailing, R"(\p{N}+)", "[0-9][0-9][0-9]"}},
  };
  return types;
}

}  // namespace

std::string detail::gguf_pre_for_regexes(const std::vector<std::string>& regexes) {
  for (const PreTokenizerType& type : pre_tokenizer_types()) {
    if (type.regexes.size() != regexes.size()) continue;
    bool same = true;
    for (size_t i = 0; i < regexes.size(); ++i) same = same && regexes[i] == type.regexes[i];
    if (!same) continue;
    // convert_hf_to_gguf.py's name where a row has several (Llama 3's is "llama-bpe")
    for (std::string_view name : type.names)
      if (name == "llama-bpe") return std::string(name);
    return std::string(type.names.front());
  }
  return "";
}

namespace {

// Reads the metadata with the file's name and the key in every error.
class Metadata {
 public:
  explicit Metadata(const io::GgufFile& file) : file_(file) {}
  const std::string& where() const { return file_.path(); }
  bool has(std::string_view key) const { return file_.contains(key); }
  std::string string(std::string_view key, std::string fallback) const { return has(key) ? file_.string(key) : fallback; }
  bool boolean(std::string_view key, bool fallback) const { return has(key) ? file_.boolean(key) : fallback; }
  // A token id, −1 when absent (or when the key says so with a negative or out-of-range id, as llama.cpp disables it).
  int64_t id(std::string_view key, int64_t fallback, int64_t tokens) const {
    const int64_t id = has(key) ? file_.integer(key) : fallback;
    return id >= 0 && id < tokens ? id : -1;
  }
  io::GgufStrings strings(std::string_view key) const {  // in place in the file
    const io::GgufValue& v = file_.value(key);
    if (!v.is_array() || v.element_type() != io::GgufType::String)
      throw IoError(where() + ": " + std::string(key) + " is " + v.type_text() + ", not an array of str");
    return v.string_list();
  }
  std::vector<int64_t> integers(std::string_view key) const { return file_.integers(key); }
  std::vector<float> floats(std::string_view key) const { return file_.floats(key); }

 private:
  const io::GgufFile& file_;
};

// A tokenizer.json section, built here so that the pipeline's own readers check it and make the part.
nlohmann::json byte_level_pre_tokenizer(const PreTokenizerType& type) {
  nlohmann::json steps = nlohmann::json::array();
  for (const char* regex : type.regexes)
    steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}});
  steps.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}});
  return {{"type", "Sequence"}, {"pretokenizers", steps}};
}

// The merges "a b" (split at the first space after the first byte, as llama.cpp does) into the model.
void read_merges(const io::GgufStrings& merges, BpeModel& model, const std::string& where) {
  BigVector<MergeTable::Merge> table;
  table.reserve(merges.size());
  constexpr size_t kChunk = 256;
  std::vector<std::string_view> texts(3 * kChunk), chunk(kChunk);
  std::vector<int32_t> ids(3 * kChunk);
  std::vector<size_t> space(kChunk);
  std::string joined;
  auto next = merges.begin();
  for (size_t at = 0; at < merges.size(); at += kChunk) {
    const size_t n = std::min<size_t>(kChunk, merges.size() - at);
    joined.clear();
    for (size_t k = 0; k < n; ++k) {
      const std::string_view m = chunk[k] = *next++;
      space[k] = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
      if (space[k] == std::string_view::npos)
        throw IoError(where + ": tokenizer.ggml.merges[" + std::to_string(at + k) + "] (" + printable(m, 60) +
                      ") is not two tokens separated by a space");
      joined.append(m.substr(0, space[k])).append(m.substr(space[k] + 1));
    }
    for (size_t k = 0, offset = 0; k < n; ++k) {
      const std::string_view m = chunk[k];
      const std::string_view a = m.substr(0, space[k]), b = m.substr(space[k] + 1);
      texts[3 * k] = a, texts[3 * k + 1] = b, texts[3 * k + 2] = std::string_view(joined).substr(offset, a.size() + b.size());
      offset += a.size() + b.size();
    }
    model.vocab.find_all(std::span(texts).first(3 * n), ids.data());
    for (size_t k = 0; k < n; ++k) {
      const int32_t ia = ids[3 * k], ib = ids[3 * k + 1], im = ids[3 * k + 2];
      if (ia < 0 || ib < 0 || im < 0)
        throw IoError(where + ": tokenizer.ggml.merges[" + std::to_string(at + k) + "] names " +
                      printable(std::string(texts[3 * k + (ia < 0 ? 0 : ib < 0 ? 1 : 2)]), 60) +
                      ", which is not in tokenizer.ggml.tokens; the file is damaged");
      table.push_back({ia, ib, static_cast<int32_t>(at + k), im});
    }
  }
  model.merges.build(std::move(table), model.vocab.size());
}

}  // namespace

std::unique_ptr<HfTokenizer> HfTokenizer::from_gguf(const io::GgufFile& file) {
  const Metadata meta(file);
  const std::string& where = meta.where();
  auto state = std::make_unique<State>();
  State& s = *state;
  s.label = where;
  s.kind = "gguf";
  if (!meta.has("tokenizer.ggml.model"))
    throw IoError(where + ": has no tokenizer (tokenizer.ggml.model); use the model's tokenizer.json instead");
  const std::string model = file.string("tokenizer.ggml.model");
  const bool spm = model == "llama", bpe = model == "gpt2";
  if (!spm && !bpe)
    throw IoError(where + ": tokenizer.ggml.model '" + printable(model, 40) + "' is not supported; qkv reads \"gpt2\" "
                  "(byte-level BPE) and \"llama\" (SentencePiece)");

  // The vocabulary, every token found by its text (as llama.cpp's token_to_id).
  const io::GgufStrings tokens = meta.strings("tokenizer.ggml.tokens");
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0 || n > (int64_t{1} << 30)) throw IoError(where + ": tokenizer.ggml.tokens holds " + std::to_string(n) + " tokens");
  // Each token's type, read in place when stored as i32 (as convert_hf_to_gguf writes them), else widened once.
  std::span<const std::byte> i32_types;
  std::vector<int64_t> wide_types;
  if (meta.has("tokenizer.ggml.token_type")) {
    const io::GgufValue& v = file.value("tokenizer.ggml.token_type");
    if (v.is_array() && v.element_type() == io::GgufType::I32) i32_types = v.raw();
    else wide_types = meta.integers("tokenizer.ggml.token_type");
    const uint64_t count = v.is_array() ? v.size() : 0;
    if (count < static_cast<uint64_t>(n))
      throw IoError(where + ": tokenizer.ggml.token_type has " + std::to_string(count) + " entries for " +
                    std::to_string(n) + " tokens");
  }
  auto type_of = [&](int64_t id) -> int64_t {
    if (!i32_types.empty()) {
      int32_t t;
      std::memcpy(&t, i32_types.data() + 4 * id, 4);
      return t;
    }
    return wide_types.empty() ? kNormal : wide_types[static_cast<size_t>(id)];
  };
  // convert_hf_to_gguf.py writes a SentencePiece vocabulary's user-defined tokens with their ▁ as spaces (for
  // llama.cpp, which matches them in the raw text); as ▁ again, "  " in a text and a literal "▁▁" give the ids the
  // tokenizer.json (and SentencePiece, which sees spaces as ▁) gives.
  std::deque<std::string> respelled;
  auto text_of = [&](int64_t id, std::string_view t) -> std::string_view {
    if (!spm || type_of(id) != kUserDefined || t.find(' ') == std::string_view::npos) return t;
    std::string u(t);
    replace_all(u, " ", "\xE2\x96\x81");
    return respelled.emplace_back(std::move(u));
  };
  size_t bytes = 0;
  for (std::string_view t : tokens) bytes += 3 * t.size();
  s.model.vocab.reserve(tokens.size(), bytes);
  // In batches: no list as long as the vocabulary is made (its pages would cost more than the batches).
  constexpr size_t kBatch = 4096;
  std::vector<std::pair<std::string_view, int32_t>> entries;
  entries.reserve(kBatch);
  int32_t id = 0;
  for (std::string_view t : tokens) {
    entries.emplace_back(text_of(id, t), id);
    ++id;
    if (entries.size() == kBatch) s.model.vocab.set_all(entries), entries.clear();
  }
  s.model.vocab.set_all(entries);

  // Control, unknown and user-defined tokens are matched in the text before the model sees it (llama.cpp's
  // tokenizer_st_partition): a user-defined one always, the others as special tokens.
  s.special.assign(tokens.size(), false);
  for (int64_t id = 0; id < n; ++id) {
    const int64_t type = type_of(id);
    if (type != kControl && type != kUnknown && type != kUserDefined) continue;
    AddedToken t;
    t.content = std::string(s.model.vocab.text(static_cast<int32_t>(id)));
    t.id = id;
    t.special = type != kUserDefined;
    t.normalized = false;
    s.special[static_cast<size_t>(id)] = t.special;
    if (!t.content.empty()) s.added.push_back(std::move(t));
  }

  bool add_bos = false, add_eos = false;
  int64_t bos = -1, eos = -1, unk = -1;
  if (bpe) {
    const std::string pre = meta.string("tokenizer.ggml.pre", "");
    const PreTokenizerType* type = nullptr;
    for (const PreTokenizerType& t : pre_tokenizer_types())
      if (std::find(t.names.begin(), t.names.end(), pre) != t.names.end()) type = &t;
    if (!type) {
      std::string known;
      for (const PreTokenizerType& t : pre_tokenizer_types())
        for (std::string_view name : t.names)
          if (!name.empty()) known += (known.empty() ? "" : ", ") + std::string(name);
      throw IoError(where + ": tokenizer.ggml.pre '" + printable(pre, 40) + "' is not a pre-tokenizer qkv knows (" + known +
                    "); use the model's tokenizer.json instead");
    }
    s.pre_tokenizer = PreTokenizer::from(byte_level_pre_tokenizer(*type), where);
    if (type->nfc) s.normalizer = Normalizer::from({{"type", "NFC"}}, where);
    s.decoder = Decoder::from({{"type", "ByteLevel"}}, where);
    s.model.ignore_merges = type->ignore_merges;
    read_merges(meta.strings("tokenizer.ggml.merges"), s.model, where);
    add_bos = type->add_bos;
    bos = meta.id("tokenizer.ggml.bos_token_id", 11, n), eos = meta.id("tokenizer.ggml.eos_token_id", 11, n);
    unk = meta.id("tokenizer.ggml.unknown_token_id", -1, n);
  } else {
    // SentencePiece: spaces are ▁ (and one leads each piece of text between special tokens unless
    // add_space_prefix is false, as Gemma's), merges follow the scores, characters outside the vocabulary become
    // their <0xNN> byte tokens.
    const bool prefix = meta.boolean("tokenizer.ggml.add_space_prefix", true);
    nlohmann::json steps = nlohmann::json::array();
    if (prefix) steps.push_back({{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}});
    steps.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}});
    s.normalizer = Normalizer::from({{"type", "Sequence"}, {"normalizers", steps}}, where);
    nlohmann::json decoders = nlohmann::json::array(
        {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}}, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}});
    if (prefix) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    s.decoder = Decoder::from({{"type", "Sequence"}, {"decoders", decoders}}, where);
    if (!meta.has("tokenizer.ggml.scores")) throw IoError(where + ": tokenizer.ggml.scores is missing; a \"llama\" tokenizer needs them");
    s.model.scores = meta.floats("tokenizer.ggml.scores");
    if (static_cast<int64_t>(s.model.scores.size()) < n)
      throw IoError(where + ": tokenizer.ggml.scores has " + std::to_string(s.model.scores.size()) + " entries for " +
                    std::to_string(n) + " tokens");
    for (int64_t id = 0; id < n && !s.model.byte_fallback; ++id) s.model.byte_fallback = type_of(id) == kByte;
    add_bos = true;
    bos = meta.id("tokenizer.ggml.bos_token_id", 1, n), eos = meta.id("tokenizer.ggml.eos_token_id", 2, n);
    unk = meta.id("tokenizer.ggml.unknown_token_id", 0, n);
  }
  s.model.unk = static_cast<int32_t>(unk);
  s.model.byte_tokens.fill(-1);
  if (s.model.byte_fallback) s.model.find_byte_tokens();

  add_bos = meta.boolean("tokenizer.ggml.add_bos_token", add_bos);
  add_eos = meta.boolean("tokenizer.ggml.add_eos_token", add_eos);
  s.bos = bos, s.eos = eos;
  s.pad = meta.id("tokenizer.ggml.padding_token_id", -1, n);
  s.has_template = true;
  if (add_bos && bos >= 0) s.template_items.push_back(bos);
  s.template_items.push_back(-1);
  if (add_eos && eos >= 0) s.template_items.push_back(eos);
  if (meta.has("tokenizer.chat_template")) s.chat_template = file.string("tokenizer.chat_template");
  s.finish();
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(state)));
}

}  // namespace qkv::text
