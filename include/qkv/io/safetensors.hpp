// safetensors: read (memory-mapped, validated like the reference implementation) and write (atomically).
// Format: u64 little-endian header length N, N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets}},
// optional "__metadata__" {string: string}, then the byte buffer the offsets point into.
// Not here: what the tensors mean (state dicts: nn/module.hpp; checkpoints: train/trainer.hpp); whole-file reads and atomic writes: io/file.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv::io {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };
const char* dtype_name(DType dtype);  // "F32"
size_t dtype_size(DType dtype);
// One element of `dtype` at p (little-endian) as a double: exact for every dtype but I64 beyond 2^53.
double element_value(const std::byte* p, DType dtype);

// One tensor's entry in a safetensors header
struct TensorInfo {
  std::string name;  // its key
  DType dtype = DType::F32;  // its element type
  std::vector<int64_t> shape;  // its sizes
  uint64_t begin = 0, end = 0;  // byte range within the data buffer
  int64_t numel() const;  // Elements (the product of shape)
};

// A safetensors file, memory-mapped and validated as the reference implementation validates it
class SafetensorsFile {
 public:
  // Maps the file and validates it; throws IoError naming the file and the problem.
  static SafetensorsFile open(const std::string& path);
  // Validates bytes already in memory (kept alive by the returned object).
  static SafetensorsFile parse(std::vector<std::byte> bytes, const std::string& label = "<memory>");

  // The path it was opened from
  const std::string& path() const { return label_; }
  // The header's __metadata__ strings
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in buffer order
  const TensorInfo* find(const std::string& name) const;  // The entry named `name`, or nullptr
  // Whether there is an entry named `name`
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // The entry's raw little-endian bytes (in the mapped file)
  std::span<const std::byte> bytes(const TensorInfo& info) const;

  // The named tensor converted to float32 (from F32, F16, BF16, F64 or an integer type).
  // Throws IoError if it is missing ("... has no tensor 'x'") or has more than 4 dimensions.
  Tensor tensor(const std::string& name) const;
  // Weights: as tensor(), but only from a floating-point dtype and only finite values (IoError naming the tensor
  // and the first bad value otherwise), so a file cannot slip NaN, Inf, booleans or bytes into a model.
  Tensor weights(const std::string& name) const;
  // An integer tensor (or a float one holding whole numbers) as int64; IoError for NaN, fractions or values
  // outside int64.
  std::vector<int64_t> int64s(const std::string& name) const;
  // Weights read straight into `dst` (a tensor of the same shape, e.g. a model's parameter): converted from F32,
  // F16, BF16 or F64 in one pass with no temporary, then checked finite. IoError naming the tensor otherwise. Into a
  // BF16 tensor (Tensor::to_bf16_): BF16 bytes as they are, other dtypes rounded a chunk at a time.
  void read_weights(const std::string& name, Tensor& dst) const;
  // A BF16 entry's values where they lie in the file's mapping, and what keeps that mapping alive
  struct InPlace {
    const void* bytes = nullptr;        // the entry's first value; nullptr: not usable in place
    std::shared_ptr<const void> owner;  // the mapping (Tensor::stored keeps it as long as the tensor)
  };
  // The named entry for a matrix used without a copy (Tensor::stored): when it is BF16 of `shape` and 2-byte aligned,
  // its values checked finite as read_weights checks them (IoError naming it otherwise). Empty (bytes nullptr) when the
  // entry is another dtype, shape or alignment: read_weights copies it then.
  InPlace bf16_in_place(const std::string& name, const Shape& shape) const;

 private:
  void read_weights_bf16(const std::string& name, Tensor& dst) const;
  struct Mapping;
  std::shared_ptr<Mapping> mapping_;
  const std::byte* data_ = nullptr;  // start of the byte buffer
  std::string label_;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name → position in tensors_: lookups are O(1)
  void validate(const std::byte* file, size_t size);
};

// One tensor to write: raw little-endian bytes of `dtype` with `shape`.
struct TensorData {
  std::string name;  // the key to write it under
  DType dtype = DType::F32;  // the element type of `bytes`
  std::vector<int64_t> shape;  // its sizes
  std::vector<std::byte> bytes;  // raw little-endian values
  // The tensor's float32 values (a BF16 tensor's widened exactly)
  static TensorData from_tensor(std::string name, const Tensor& t);
  // The tensor rounded to bfloat16 (nearest even; NaN kept), half the bytes; a BF16 tensor's values as they are.
  static TensorData from_tensor_bf16(std::string name, const Tensor& t);
  static TensorData from_int64s(std::string name, std::span<const int64_t> values);
};

// Writes a safetensors file: to a temporary file beside `path`, fsync, then rename, so an existing file is
// either kept whole or replaced whole, never left half-written. Tensors are stored in the given order.
void save_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Convenience: float32 tensors.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Hugging Face's MXFP4 tensors (gpt-oss's published experts, transformers' Mxfp4 quantizer) as ggml's blocks: X_blocks
// (U8 (…, G, 16): byte i of a group of 32 holds its values 2i in the low nibble and 2i + 1 in the high one) and
// X_scales (U8 (…, G): E8M0 exponents, x = FP4[code]·2^(e − 127)) → `groups` blocks of kernels::WeightType::MXFP4
// (17 bytes: the same exponent byte, then value j in the low nibble and j + 16 in the high one of byte j). The values
// are the same: ggml's levels are FP4's doubled and its scale 2^(e − 128).
void mxfp4_blocks_from_hf(const std::byte* blocks, const std::byte* scales, int64_t groups, unsigned char* out);

}  // namespace qkv::io
