// The tokenizer of a GGUF file's tokenizer.ggml.* metadata (HfTokenizer::from_gguf), on tiny files written here:
// byte-level BPE ("gpt2") with its pre-tokenizer, control and user-defined tokens, BOS/EOS; SentencePiece ("llama")
// merging by score, byte fallback, the space prefix; malformed metadata as errors naming the file and key.
// (The real tokenizers converted as llama.cpp's convert_hf_to_gguf.py would, against Hugging Face and llama.cpp:
// tests/tokenizer_cases_vs_hf.sh.)
#include <unistd.h>

#include <filesystem>

#include "helpers.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace qkv::test {
namespace {

using io::GgufValue;
using ids = std::vector<int64_t>;
using Metadata = std::vector<std::pair<std::string, GgufValue>>;

std::unique_ptr<text::HfTokenizer> from(const Metadata& metadata, const std::string& name = "tok") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("qkv_gguf_tokenizer_" + std::to_string(getpid()) + "_" + name + ".gguf")).string();
  {
    io::GgufWriter w(path);
    for (const auto& [k, v] : metadata) w.add_metadata(k, v);
    w.finish();
  }
  // removed also when reading it throws, as the malformed cases expect
  const std::unique_ptr<const std::string, void (*)(const std::string*)> remove(
      &path, [](const std::string* p) { std::filesystem::remove(*p); });
  return text::HfTokenizer::from_gguf(io::GgufFile::open(path));
}

// A byte-level vocabulary: ids 0–7, with "<|end|>" a control token and "<u>" a user-defined one.
Metadata gpt2(Metadata extra = {}) {
  Metadata m = {{"tokenizer.ggml.model", GgufValue::string("gpt2")},
                {"tokenizer.ggml.pre", GgufValue::string("gpt-2")},
                {"tokenizer.ggml.tokens", GgufValue::strings({"a", "b", "\xC4\xA0", "\xC4\xA0" "a", "ab", "\xC4\xA0" "ab", "<|end|>", "<u>"})},
                {"tokenizer.ggml.token_type", GgufValue::i32s(std::vector<int32_t>{1, 1, 1, 1, 1, 1, 3, 4})},
                {"tokenizer.ggml.merges", GgufValue::strings({"\xC4\xA0 a", "a b", "\xC4\xA0" "a b"})},
                {"tokenizer.ggml.bos_token_id", GgufValue::u32(6)},
                {"tokenizer.ggml.eos_token_id", GgufValue::u32(6)}};
  for (auto& e : extra) m.push_back(std::move(e));
  return m;
}

TEST(GgufTokenizer, ByteLevelBpeWithItsTokenTypes) {
  const auto tok = from(gpt2());
  EXPECT_EQ(tok->name(), "gguf");
  EXPECT_EQ(tok->encode("ab ab"), (ids{4, 5}));  // "Ġ a" ranks first, then "Ġa b": " ab" is one token
  EXPECT_EQ(tok->decode(ids{4, 5}), "ab ab");
  EXPECT_EQ(tok->encode("ab<|end|>ab"), (ids{4, 6, 4}));  // a control token, matched as special
  const auto plain = tok->encode("ab<|end|>ab", false);
  EXPECT_EQ(std::find(plain.begin(), plain.end(), 6), plain.end());
  EXPECT_EQ(tok->encode("a<u>b", false), (ids{0, 7, 1}));  // a user-defined token, always matched
  EXPECT_TRUE(tok->is_special(6));
  EXPECT_FALSE(tok->is_special(7));
  EXPECT_EQ(tok->end_of_text(), 6);
  EXPECT_EQ(tok->pad_id(), -1);
  // gpt-2's pre-tokenizer adds no BOS unless the file says so; then it goes first, and EOS last.
  const auto with = from(gpt2({{"tokenizer.ggml.add_bos_token", GgufValue::boolean(true)},
                               {"tokenizer.ggml.add_eos_token", GgufValue::boolean(true)},
                               {"tokenizer.ggml.padding_token_id", GgufValue::u32(7)},
                               {"tokenizer.chat_template", GgufValue::string("{{ messages }}")}}));
  EXPECT_EQ(with->encode("ab"), (ids{6, 4, 6}));
  EXPECT_EQ(with->encode_rendered("ab"), (ids{4}));
  EXPECT_EQ(with->chat_template(), "{{ messages }}");
  EXPECT_EQ(with->pad_id(), 7);
}

// Every tokenizer.ggml.pre name llama.cpp gives a byte-level BPE vocabulary compiles to a pre-tokenizer whose pieces
// together are the text; digits show which family a name is in (gpt-2 keeps a run of digits together, smollm's
// starcoder family splits each digit off, llama-bpe takes three at a time).
TEST(GgufTokenizer, EveryPreTokenizerNameLlamaCppWrites) {
  const std::vector<std::string> names = {
      "default", "llama-bpe", "llama3", "dbrx", "smaug-bpe", "jais-2", "qwen2", "deepseek-r1-qwen", "stablelm2", "grok-2",
      "laguna", "qwen35", "deepseek-llm", "deepseek-v3", "spark2_5", "deepseek-coder", "gpt-4o", "llama4",
      "granite-embed-multi-97m", "youtu", "tiny_aya", "tekken", "poro-chat", "bloom", "viking", "bailingmoe", "seed-coder",
      "ufakzeka", "exaone-moe", "minicpm5", "gpt-2", "olmo", "mpt", "starcoder", "smollm", "falcon", "chatglm-bpe"};
  Metadata digits = gpt2();
  digits[2].second = GgufValue::strings({"a", "b", "\xC4\xA0", "\xC4\xA0" "a", "ab", "\xC4\xA0" "ab", "<|end|>", "<u>", "1", "2",
                                         "12", "3", "4", "123", "1234"});
  digits[3].second = GgufValue::i32s(std::vector<int32_t>{1, 1, 1, 1, 1, 1, 3, 4, 1, 1, 1, 1, 1, 1, 1});
  digits[4].second = GgufValue::strings({"\xC4\xA0 a", "a b", "\xC4\xA0" "a b", "1 2", "12 3", "123 4"});
  for (const std::string& name : names) {
    Metadata m = digits;
    m[1].second = GgufValue::string(name);
    const auto tok = from(m, "pre");
    EXPECT_EQ(tok->decode(tok->encode("ab ab 1234  ab", false)), "ab ab 1234  ab") << name;
    const auto got = tok->encode("1234", false);
    if (name == "gpt-2" || name == "olmo" || name == "mpt") EXPECT_EQ(got, (ids{14})) << name;
    if (name == "smollm" || name == "starcoder" || name == "qwen2") EXPECT_EQ(got, (ids{8, 9, 11, 12})) << name;
    if (name == "llama-bpe" || name == "deepseek-v3" || name == "gpt-4o") EXPECT_EQ(got, (ids{13, 12})) << name;
  }
}

// A SentencePiece vocabulary: unk, <s>, </s>, byte tokens for é (C3 A9), and pieces whose scores decide the merges.
Metadata llama(float score_a_b, float score_space_a, Metadata extra = {}) {
  Metadata m = {{"tokenizer.ggml.model", GgufValue::string("llama")},
                {"tokenizer.ggml.tokens", GgufValue::strings({"<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "\xE2\x96\x81", "a", "b",
                                                              "\xE2\x96\x81" "a", "ab"})},
                {"tokenizer.ggml.scores", GgufValue::f32s(std::vector<float>{0, 0, 0, 0, 0, -100, -100, -100, score_space_a, score_a_b})},
                {"tokenizer.ggml.token_type", GgufValue::i32s(std::vector<int32_t>{2, 3, 3, 6, 6, 1, 1, 1, 1, 1})}};
  for (auto& e : extra) m.push_back(std::move(e));
  return m;
}

TEST(GgufTokenizer, SentencePieceMergesByScore) {
  // "ab" → "▁ab" (the space prefix): whichever of "▁a" and "ab" scores higher is merged (there is no "▁ab").
  EXPECT_EQ(from(llama(-1, -2))->encode("ab"), (ids{1, 5, 9}));  // <s> ▁ ab
  EXPECT_EQ(from(llama(-2, -1))->encode("ab"), (ids{1, 8, 7}));  // <s> ▁a b
  const auto tok = from(llama(-1, -2));
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->end_of_text(), 2);
  EXPECT_EQ(tok->encode("\xC3\xA9", false), (ids{5, 3, 4}));  // é is no piece: its bytes
  EXPECT_EQ(tok->decode(ids{1, 5, 9, 3, 4}), "<s> ab\xC3\xA9");
  EXPECT_EQ(tok->decode_text(ids{1, 8, 7}), "ab");  // the prefix space stripped, <s> skipped
  EXPECT_EQ(tok->encode("a</s>b"), (ids{1, 8, 2, 5, 7}));  // each piece between special tokens gets its ▁
  // Gemma's files turn the prefix off and add no BOS when asked not to.
  const auto gemma = from(llama(-1, -2, {{"tokenizer.ggml.add_space_prefix", GgufValue::boolean(false)},
                                         {"tokenizer.ggml.add_bos_token", GgufValue::boolean(false)}}));
  EXPECT_EQ(gemma->encode("ab a"), (ids{9, 8}));
  EXPECT_EQ(gemma->decode(ids{9, 8}), "ab a");
}

::testing::AssertionResult fails_with(const Metadata& m, const std::string& needle) {
  try {
    from(m, "bad");
  } catch (const IoError& e) {
    const std::string what = e.what();
    if (what.find(needle) != std::string::npos && what.find("qkv_gguf_tokenizer_") != std::string::npos)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message: " << what;
  }
  return ::testing::AssertionFailure() << "loaded";
}

TEST(GgufTokenizer, MalformedMetadataNamesTheKey) {
  EXPECT_TRUE(fails_with({{"general.architecture", GgufValue::string("llama")}}, "has no tokenizer (tokenizer.ggml.model)"));
  EXPECT_TRUE(fails_with({{"tokenizer.ggml.model", GgufValue::string("bert")}}, "'bert' is not supported"));
  Metadata unknown_pre = gpt2();
  unknown_pre[1].second = GgufValue::string("mystery");
  EXPECT_TRUE(fails_with(unknown_pre, "tokenizer.ggml.pre 'mystery' is not a pre-tokenizer qkv knows"));
  Metadata bad_merge = gpt2();
  bad_merge[4].second = GgufValue::strings({"a zz"});
  EXPECT_TRUE(fails_with(bad_merge, "tokenizer.ggml.merges[0] names zz"));
  bad_merge[4].second = GgufValue::strings({"ab"});
  EXPECT_TRUE(fails_with(bad_merge, "is not two tokens separated by a space"));
  Metadata short_scores = llama(-1, -2);
  short_scores[2].second = GgufValue::f32s(std::vector<float>{0, 0});
  EXPECT_TRUE(fails_with(short_scores, "tokenizer.ggml.scores has 2 entries for 10 tokens"));
  Metadata wrong_type = gpt2();
  wrong_type[2].second = GgufValue::u32(3);
  EXPECT_TRUE(fails_with(wrong_type, "tokenizer.ggml.tokens is u32, not an array of str"));
}

}  // namespace
}  // namespace qkv::test
