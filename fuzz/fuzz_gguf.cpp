// GGUF: parse from memory, read every metadata value through the typed getters and every tensor's bytes; when it
// loads, write it back with GgufWriter (metadata, table and bytes as read) and check the copy reads the same.
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "qkv/io/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using qkv::io::GgufFile;
  qkv::fuzz::expect_only_qkv_errors([&] {
    std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
    const GgufFile file = GgufFile::parse(std::move(bytes), "fuzz");
    // Every getter on every key: a wrong type is an IoError, never anything else.
    for (const auto& entry : file.metadata()) {
      const std::string& key = entry.first;  // a plain reference: clang 14 cannot capture structured bindings
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.string(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.integer(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.real(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.boolean(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.strings(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.integers(key); });
      qkv::fuzz::expect_only_qkv_errors([&] { (void)file.floats(key); });
    }
    // Every tensor's bytes are inside the buffer (ASan checks the reads).
    unsigned checksum = 0;
    for (const auto& t : file.tensors()) {
      if (file.find(t.name) != &t) std::abort();  // a finding: the index disagrees with the table
      for (uint64_t i = 0; i < t.bytes; i += 61) checksum += std::to_integer<unsigned>(t.data[i]);
      if (t.bytes) checksum += std::to_integer<unsigned>(t.data[t.bytes - 1]);
    }
    (void)checksum;
    // Written back: the same metadata, table and bytes.
    const std::string path = qkv::fuzz::scratch_file(nullptr, 0, ".gguf");
    qkv::io::GgufWriter writer(path);
    try {
      for (const auto& [key, value] : file.metadata()) writer.add_metadata(key, value);
      for (const auto& t : file.tensors()) writer.add_tensor(t.name, t.dims, t.type);
    } catch (const qkv::ValueError&) {
      return;  // a name of 64 bytes is readable but not writable (llama.cpp's limit)
    }
    for (const auto& t : file.tensors()) writer.write_tensor_data(t.span());
    writer.finish();
    const GgufFile back = GgufFile::open(path);
    if (back.metadata().size() != file.metadata().size() || back.tensors().size() != file.tensors().size()) std::abort();
    for (size_t i = 0; i < file.metadata().size(); ++i)
      if (back.metadata()[i].first != file.metadata()[i].first || !(back.metadata()[i].second == file.metadata()[i].second))
        std::abort();  // a finding: a value changed on the way through the writer
    for (size_t i = 0; i < file.tensors().size(); ++i) {
      const auto &a = file.tensors()[i], &b = back.tensors()[i];
      if (a.name != b.name || a.dims != b.dims || a.type != b.type || a.bytes != b.bytes ||
          (a.bytes && std::memcmp(a.data, b.data, a.bytes) != 0))
        std::abort();
    }
  });
  return 0;
}
