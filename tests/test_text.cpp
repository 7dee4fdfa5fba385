// Tokenizers (GPT-2 BPE and bytes), UTF-8 handling, and the sliding-window dataset.
#include <ctime>

#include "helpers.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/dataset.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::test {
namespace {

std::unique_ptr<text::Tokenizer> gpt2() {
  const auto dir = text::find_gpt2_vocabulary();
  if (!dir) ADD_FAILURE() << "GPT-2 vocabulary missing: run scripts/fetch-gpt2-vocab (scripts/run test does)";
  return text::make_tokenizer("gpt2", dir.value_or(""));
}

TEST(GPT2Tokenizer, KnownIdsAndRoundTrip) {
  const auto tok = gpt2();
  EXPECT_EQ(tok->encode("Hello, world!"), (std::vector<int64_t>{15496, 11, 995, 0}));
  EXPECT_EQ(tok->encode("Hello world<|endoftext|>"), (std::vector<int64_t>{15496, 995, 50256}));
  EXPECT_NE(tok->encode("<|endoftext|>", false).size(), 1u);  // as plain text when specials are off
  EXPECT_EQ(tok->vocab_size(), 50257);
  const std::string text = "It's 2026 — naïve café 🤖\n\n  indented\tand tabs";
  EXPECT_EQ(tok->decode(tok->encode(text)), text);
}

TEST(GPT2Tokenizer, InvalidUtf8IsAnErrorNamingTheByte) {
  const auto tok = gpt2();
  try {
    tok->encode(std::string("ok\xC3\x28", 4));
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("invalid UTF-8 at byte 2"), std::string::npos) << e.what();
  }
  // Decoding half of a multi-byte character replaces the broken bytes with U+FFFD.
  const std::vector<int64_t> ids = tok->encode("é");
  ASSERT_EQ(ids.size(), 1u);  // "é" is a single token made of two bytes, so cut a split version by bytes:
  const auto bytes = text::ByteTokenizer().encode("\xC3");
  EXPECT_EQ(text::ByteTokenizer().decode(bytes), "\xEF\xBF\xBD");
  EXPECT_THROW(tok->decode(std::vector<int64_t>{50257}), ValueError);
}

TEST(GPT2Tokenizer, MissingVocabularySaysHowToGetIt) {
  try {
    text::make_tokenizer("gpt2", "/nonexistent/dir");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("scripts/fetch-gpt2-vocab"), std::string::npos) << e.what();
  }
  EXPECT_THROW(text::make_tokenizer("sentencepiece"), ValueError);
}

TEST(Utf8, ValidationAndReplacement) {
  EXPECT_FALSE(text::first_invalid_utf8("plain ascii, é, 中, 🤖").has_value());
  EXPECT_EQ(text::first_invalid_utf8("ab\xC0\xAF"), std::optional<size_t>(2));        // overlong
  EXPECT_EQ(text::first_invalid_utf8("\xED\xA0\x80"), std::optional<size_t>(0));      // surrogate
  EXPECT_EQ(text::first_invalid_utf8("x\xF4\x90\x80\x80"), std::optional<size_t>(1)); // above U+10FFFF
  EXPECT_EQ(text::first_invalid_utf8("\xE4\xB8"), std::optional<size_t>(0));          // truncated
  EXPECT_EQ(text::replace_invalid_utf8("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  // One U+FFFD per maximal subpart, as Python's errors="replace" (these are its outputs), Rust's from_utf8_lossy and
  // TextDecoder give: a character cut short is one replacement, a byte that cannot continue it starts afresh.
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(text::replace_invalid_utf8("\xE4\xB8"), r);
  EXPECT_EQ(text::replace_invalid_utf8("\xE4\xB8" "a"), r + "a");
  EXPECT_EQ(text::replace_invalid_utf8("\xF0\x9F\x98" "\xE4\xB8\xAD"), r + "\xE4\xB8\xAD");
  EXPECT_EQ(text::replace_invalid_utf8("\xC0\xAF"), r + r);
  EXPECT_EQ(text::replace_invalid_utf8("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(text::replace_invalid_utf8("\xE0\x80\xAF"), r + r + r);
  EXPECT_EQ(text::replace_invalid_utf8("\xF4\x90\x80\x80"), r + r + r + r);
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  text::ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 128; ++b) all += static_cast<char>(b);
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
  EXPECT_EQ(tok.encode("A").at(0), 65);
  EXPECT_THROW(tok.decode(std::vector<int64_t>{256}), ValueError);
}

TEST(Dataset, WindowsTargetsAndDeterministicBatches) {
  std::vector<int64_t> ids(50);
  for (int i = 0; i < 50; ++i) ids[static_cast<size_t>(i)] = i;
  text::SlidingWindowDataset data(ids, 8, 4);
  EXPECT_EQ(data.size(), (50 - 9) / 4 + 1);
  std::vector<int64_t> in(8), out(8);
  data.window(2, in.data(), out.data());
  EXPECT_EQ(in.front(), 8);
  EXPECT_EQ(out.front(), 9);
  EXPECT_EQ(out.back(), 16);
  text::DataLoader loader(data, 3, true, 42);
  EXPECT_EQ(loader.batches_per_epoch(), data.size() / 3);
  const text::Batch a = loader.batch(5), b = loader.batch(5);
  EXPECT_EQ(a.inputs, b.inputs);  // a pure function of (seed, step)
  text::DataLoader other(data, 3, true, 43);
  bool differs = false;
  for (int64_t s = 0; s < loader.batches_per_epoch(); ++s) differs = differs || other.batch(s).inputs != loader.batch(s).inputs;
  EXPECT_TRUE(differs);
  EXPECT_THROW(text::SlidingWindowDataset(std::vector<int64_t>(8, 1), 8, 1), ValueError);  // shorter than one window
  EXPECT_THROW(text::DataLoader(data, 100, false, 0), ValueError);
  const auto [train, validation] = text::split_tokens(ids, 0.9);
  EXPECT_EQ(train.size(), 45u);
  EXPECT_EQ(validation.front(), 45);
}

// A message's other fields (tool calls, tool results) reach the template as message.<field>, objects in the file's
// order (tojson prints them so), null as none; a field text that is not a JSON object is refused.
TEST(ChatTemplate, MessageFieldsReachTheTemplateInTheirOrder) {
  const auto t = text::ChatTemplate::parse(
      "{% for m in messages %}[{{ m.role }}"
      "{% if m.tool_calls %} call {{ m.tool_calls[0].function.name }}{{ m.tool_calls[0].function.arguments | tojson }}"
      "{% endif %}{% if m.tool_call_id is defined %} id {{ m.tool_call_id }}{% endif %}"
      "{% if m.content is none %} none{% else %} {{ m.content }}{% endif %}]{% endfor %}");
  const std::vector<text::ChatMessage> messages = {
      {"user", "Paris?", ""},
      {"assistant", "", R"({"content": null, "tool_calls": [{"function": {"name": "weather", "arguments": {"z": 1, "a": [true, 2.5]}}}]})"},
      {"tool", "21", R"({"tool_call_id": "c1"})"}};
  EXPECT_EQ(t.render(messages, {}), "[user Paris?][assistant call weather{\"z\": 1, \"a\": [true, 2.5]} none][tool id c1 21]");
  EXPECT_THROW(t.render({{"tool", "x", "[1]"}}, {}), ValueError);
  EXPECT_THROW(t.render({{"tool", "x", "{"}}, {}), ValueError);
}

// Macros as gpt-oss's template uses them: called as functions returning their text, parameters by place, by name or
// by default, recursion, the template's globals but not the caller's variables; `is defined` for the functions;
// strftime_now the local date as transformers gives it. Mistakes are refused naming the macro.
TEST(ChatTemplate, MacrosAndTheDate) {
  const auto t = text::ChatTemplate::parse(
      "{%- macro kind(spec, nullable=false) -%}"
      "{%- if spec.type == 'array' -%}{{ kind(spec['items']) }}[]"
      "{%- else -%}{{ spec.type }}{%- endif -%}{%- if nullable %} | null{% endif -%}"
      "{%- endmacro -%}"
      "{%- macro greet(who) -%}{{ prefix }}{{ who }}{{ secret }}{%- endmacro -%}"
      "{%- set prefix = 'hi ' -%}"
      "{%- for m in messages %}{% set secret = '!' %}{{ greet(m.content) }};{% endfor -%}"
      "{{ kind({'type': 'array', 'items': {'type': 'array', 'items': {'type': 'number'} } }) }};"
      "{{ kind({'type': 'string'}, nullable=true) }};"
      "{{ greet is defined }} {{ strftime_now is defined }} {{ nothing is defined }};{{ strftime_now('%Y') }}");
  char year[8];
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::strftime(year, sizeof year, "%Y", &local);
  EXPECT_EQ(t.render({{"user", "a", ""}, {"user", "b", ""}}, {}),
            "hi a;hi b;number[][];string | null;True True False;" + std::string(year));
  auto refusal = [](const std::string& source) {
    try {
      text::ChatTemplate::parse(source).render({{"user", "a", ""}}, {});
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("(rendered)");
  };
  EXPECT_NE(refusal("{% macro f(a) %}{{ a }}{% endmacro %}{{ f(1, 2) }}").find("the macro 'f' takes 1 arguments, not 2"),
            std::string::npos);
  EXPECT_NE(refusal("{% macro f(a) %}{{ a }}{% endmacro %}{{ f(b=1) }}").find("the macro 'f' has no parameter 'b'"),
            std::string::npos);
  EXPECT_NE(refusal("{% macro f(a) %}{{ f(a) }}{% endmacro %}{{ f(1) }}").find("more than 200 deep"), std::string::npos);
  EXPECT_NE(refusal("{% macro f(a) %}{{ a }}").find("without '{% endmacro %}'"), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
