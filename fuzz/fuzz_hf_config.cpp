// A Hugging Face config.json (the input): it parses into a decoder configuration or fails with a qkv::Error, and what
// parses lays out its parameters and writes back without allocating the model.
#include "fuzz_common.hpp"
#include "qkv/nn/hf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  qkv::fuzz::expect_only_qkv_errors([&] {
    const qkv::nn::DecoderConfig c = qkv::nn::decoder_config_from_hf(text, "fuzz/config.json");
    (void)c.parameter_count();
    (void)qkv::nn::decoder_config_from_hf(qkv::nn::decoder_config_to_hf(c));
  });
  return 0;
}
