// ggml's tensor types as a GGUF file names them, for the layers above io that read GGUF models: which of qkv's weight
// types a ggml type id is, how many bytes a row of it takes, and its values widened to float32.
// Not here: the block formats and their products (kernels/quant.hpp); reading the file (io/gguf.hpp).
#pragma once

#include <cstdint>
#include <optional>

#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/quant.hpp"

namespace qkv::io {

using kernels::WeightType;  // how a matrix is stored: f32, f16, bf16 or one of ggml's block formats

// qkv's weight type for a GGUF tensor's ggml type id; nullopt for a type qkv does not store as such
inline std::optional<WeightType> weight_type_from_ggml(uint32_t ggml_type) { return kernels::weight_type_from_ggml(ggml_type); }
// Bytes of one row of `cols` values stored as `type`
inline int64_t row_bytes(WeightType type, int64_t cols) { return kernels::row_bytes(type, cols); }
// rows × cols values stored as `type` at src, widened into dst (float32)
inline void dequantize_rows(WeightType type, const void* src, float* dst, int64_t rows, int64_t cols) {
  kernels::dequantize_rows(type, src, dst, rows, cols);
}
// rows × cols floats (row-major) stored as `type` at dst, as ggml's reference quantizers do (llama-quantize without an
// importance matrix); std::invalid_argument for a non-finite value in a block type (kernels::quantize_rows)
inline void quantize_rows(WeightType type, const float* src, void* dst, int64_t rows, int64_t cols) {
  kernels::quantize_rows(type, src, dst, rows, cols);
}
// The ggml type id and name of a weight type, and its block geometry
inline const kernels::WeightTypeInfo& weight_type_info(WeightType type) { return kernels::weight_type_info(type); }
// One IEEE half-precision value as float32
inline float f16_to_f32(uint16_t h) { return kernels::f16_to_f32_reference(h); }

}  // namespace qkv::io
