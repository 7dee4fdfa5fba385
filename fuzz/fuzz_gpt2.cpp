// A Hugging Face GPT-2 model.safetensors, as `qkv generate --gpt2` reads it.
#include "fuzz_common.hpp"
#include "qkv/nn/gpt2.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    auto model = qkv::nn::load_gpt2(qkv::fuzz::scratch_file(data, size, ".safetensors"));
    const int64_t ids[1] = {0};
    (void)model->forward(ids, 1, 1);
  });
  return 0;
}
