// A qkv train checkpoint, as `qkv generate` and `qkv train --resume` read it: settings, the tensor check, the model.
#include "fuzz_common.hpp"
#include "qkv/train/trainer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    const std::string path = qkv::fuzz::scratch_file(data, size, ".safetensors");
    qkv::train::TrainSettings settings;
    auto model = qkv::train::load_checkpoint_model(path, &settings);
    qkv::fuzz::expect_only_qkv_errors([&] { qkv::train::check_checkpoint(path, settings); });
    const int64_t ids[2] = {0, 0};
    (void)model->forward(ids, 1, std::min<int64_t>(2, model->context_length()));
  });
  return 0;
}
