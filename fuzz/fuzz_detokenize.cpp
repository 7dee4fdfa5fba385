// Decoding arbitrary ids: the input is read as little-endian int64 ids; out-of-range ids are an error.
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "qkv/text/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto gpt2 = qkv::text::make_tokenizer("gpt2");
  std::vector<int64_t> ids(size / 8);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 8);
  for (int64_t& id : ids) id %= 60000;  // mostly in range, some out (negative or ≥ 50257)
  qkv::fuzz::expect_only_qkv_errors([&] { (void)gpt2->decode(ids); });
  qkv::fuzz::expect_only_qkv_errors([&] { (void)qkv::text::ByteTokenizer().decode(ids); });
  return 0;
}
