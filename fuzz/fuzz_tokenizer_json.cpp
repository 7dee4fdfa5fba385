// A tokenizer.json (the input) and, when it loads, text through it both ways: whatever loads must encode, decode and
// never hang on its own regex (PCRE2's match limit turns a catastrophic pattern into an error).
#include "fuzz_common.hpp"
#include "qkv/text/hf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  qkv::fuzz::expect_only_qkv_errors([&] {
    const auto tok = qkv::text::HfTokenizer::parse(text, "", "fuzz/tokenizer.json");
    for (const char* sample : {"Hello, world! 123 caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac", "  <s> </s> <|endoftext|>\n\n\t", ""}) {
      const auto ids = tok->encode(sample);
      (void)tok->decode(ids);
      (void)tok->encode(sample, false);
    }
  });
  return 0;
}
