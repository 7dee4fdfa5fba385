// The .pth unpickler alone: the input is data.pkl, beside 40 storages of 16 KiB ("data/0" … "data/39"), enough for
// the tensors of the seeds (tests/fuzz/seeds/pickle: the data.pkl of the fixtures).
#include <map>
#include <vector>

#include "fuzz_walk.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::fuzz::expect_only_qkv_errors([&] {
    std::map<std::string, std::vector<std::byte>> records;
    records["data.pkl"].assign(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
    for (int k = 0; k < 40; ++k) {
      std::vector<std::byte> storage(16 << 10);
      for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<std::byte>(i * 37 + k);
      records["data/" + std::to_string(k)] = std::move(storage);
    }
    const auto file = qkv::io::PthFile::from_records(std::move(records), "fuzz");
    qkv::fuzz::walk(file);
  });
  return 0;
}
