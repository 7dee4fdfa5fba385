// Whole .pth files: the zip archive (libzip), the unpickler, the storages, and the book-model loader on top.
#include <vector>

#include "fuzz_walk.hpp"
#include "qkv/train/model_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
    const auto file = qkv::io::PthFile::parse(std::move(bytes), "fuzz");
    qkv::fuzz::walk(file);
  });
  qkv::fuzz::expect_only_qkv_errors([&] {
    const std::string path = qkv::fuzz::scratch_file(data, size, ".pth");
    (void)qkv::train::load_model_file(path, {"", 4, "bytes"});
  });
  return 0;
}
