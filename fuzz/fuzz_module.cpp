// A module file for `qkv apply`: metadata + state dict → module, then a forward pass on a small input.
#include "fuzz_common.hpp"
#include "qkv/nn/apply.hpp"
#include "qkv/nn/attention.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    auto module = qkv::nn::load_attention_module(qkv::fuzz::scratch_file(data, size, ".safetensors"));
    module->eval();
    int64_t d_in = 0;
    for (const auto& [name, p] : module->named_parameters())
      if (name.find("W_query") != std::string::npos) d_in = name.find(".weight") != std::string::npos ? p.size(1) : p.size(0);
    if (d_in > 0 && d_in <= 4096) (void)module->forward(qkv::Tensor::ones({1, 2, d_in}));
  });
  return 0;
}
