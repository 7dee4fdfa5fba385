// A GPT-2 vocabulary: the input is encoder.json, a 0xFF byte, then vocab.bpe. Whatever loads must encode and decode.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include "fuzz_common.hpp"
#include "qkv/text/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint8_t* split = std::find(data, data + size, 0xFF);
  const std::string dir = qkv::fuzz::scratch_dir("vocab").string();
  std::ofstream(dir + "/encoder.json", std::ios::binary).write(reinterpret_cast<const char*>(data), split - data);
  const uint8_t* merges = split == data + size ? split : split + 1;
  std::ofstream(dir + "/vocab.bpe", std::ios::binary).write(reinterpret_cast<const char*>(merges), data + size - merges);
  qkv::fuzz::expect_only_qkv_errors([&] {
    const auto tok = qkv::text::GPT2Tokenizer::load(dir);
    const auto ids = tok->encode("Hello, world! 123 caf\xc3\xa9 <|endoftext|>");
    (void)tok->decode(ids);
  });
  return 0;
}
