// GPT-2 and byte tokenization of arbitrary text: valid UTF-8 must decode back to itself; invalid UTF-8 is an error
// unless replaced first.
#include <cstdlib>
#include <memory>

#include "fuzz_common.hpp"
#include "qkv/text/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto gpt2 = qkv::text::make_tokenizer("gpt2");  // QKV_VOCAB_DIR or ./data/gpt2
  static const qkv::text::ByteTokenizer bytes;
  const std::string text(reinterpret_cast<const char*>(data), size);
  qkv::fuzz::expect_only_qkv_errors([&] {
    const auto ids = gpt2->encode(text);
    if (gpt2->decode(ids) != text) std::abort();  // a finding: not a round trip
  });
  const std::string clean = qkv::text::replace_invalid_utf8(text);
  if (gpt2->decode(gpt2->encode(clean, false)) != clean) std::abort();
  if (bytes.decode(bytes.encode(clean)) != clean) std::abort();
  return 0;
}
