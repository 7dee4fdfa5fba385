// .npy: parse and, when it loads, save it back and parse the copy (the same values).
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "qkv/io/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    const std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
    const qkv::Tensor t = qkv::io::parse_npy(bytes, "fuzz");
    const std::string path = qkv::fuzz::scratch_file(nullptr, 0, ".npy");
    qkv::io::save_npy(path, t);
    const qkv::Tensor back = qkv::io::load_npy(path);
    if (!(back.shape() == t.shape()) || (t.numel() && std::memcmp(back.data(), t.data(), t.numel() * sizeof(float)) != 0))
      std::abort();  // a finding: the round trip changed the array
  });
  return 0;
}
