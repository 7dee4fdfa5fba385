// safetensors: parse, then read every tensor as float, weights and int64 where it fits.
#include <vector>

#include "fuzz_common.hpp"
#include "qkv/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
    const auto file = qkv::io::SafetensorsFile::parse(std::move(bytes), "fuzz");
    for (const auto& info : file.tensors()) {
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.tensor(info.name); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.weights(info.name); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.int64s(info.name); });
    }
  });
  return 0;
}
