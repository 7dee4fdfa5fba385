// A model.safetensors.index.json (the input) beside a tiny Qwen3's config.json and its two shards: the folder loads, or
// fails with a qkv::Error (a missing or unsafe shard name, a tensor in the wrong shard, a malformed index).
#include <filesystem>
#include <fstream>

#include "fuzz_common.hpp"
#include "qkv/nn/hf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const fs::path source = [] {
    const char* dir = std::getenv("QKV_FUZZ_HF_FOLDER");
    return fs::path(dir ? dir : "tests/fixtures/hf/qwen3");
  }();
  const fs::path dir = qkv::fuzz::scratch_dir("shards");
  if (!fs::exists(dir / "config.json")) {
    for (const char* f : {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
      fs::copy_file(source / f, dir / f, fs::copy_options::overwrite_existing);
  }
  std::ofstream(dir / "model.safetensors.index.json", std::ios::binary).write(reinterpret_cast<const char*>(data), size);
  qkv::fuzz::expect_only_qkv_errors([&] { (void)qkv::nn::load_hf_decoder(dir.string()); });
  return 0;
}
