// Weights as a storage type: float32, the 16-bit floats and ggml's block formats (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), with
// their ggml type ids and byte layouts, and the conversions of rows to and from float32 — bit for bit what ggml's
// reference code does (llama-quantize without an importance matrix; tests/test_quant.cpp checks bytes made by ggml).
// Not here: products with stored weights (weights.hpp), reading or writing GGUF files (io/).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace qkv::kernels {

// How a weight matrix's values are stored, row by row (a row of K values is a GGUF tensor's ne0 = K). The block types
// hold `block_elements` consecutive values of a row in `block_bytes` bytes (ggml-common.h is the specification):
//   Q8_0  32 values in 34 bytes: a half scale d, 32 int8 q;                     x = d·q
//   Q4_0  32 values in 18 bytes: d, 16 bytes of nibbles (value j low, j+16 high); x = d·(q − 8)
//   Q4_K 256 values in 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
//        nibbles;                                                                   x = d·sc·q − dmin·m
//   Q5_K 256 values in 176 bytes: Q4_K's and a fifth bit per value (32 bytes)
//   Q6_K 256 values in 210 bytes: 4 low bits (128 bytes), 2 high bits (64), 16 int8 scales of sub-blocks of 16, d;
//                                                                                   x = d·sc·(q − 32)
//   MXFP4 32 values in 17 bytes: an E8M0 exponent e, 16 bytes of E2M1 codes (Q4_0's order); x = v[q]·2^(e − 128), v
//        the E2M1 levels doubled (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) — OCP's microscaling format, gpt-oss's experts
// Halves are IEEE binary16, little-endian, as all multi-byte fields. (MXFP4's blocks have no field wider than a byte, so
// its rows may start at any address.)
enum class WeightType : uint8_t { F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4 };

// One row of the type table: its name, ggml id and block geometry
struct WeightTypeInfo {
  const char* name;        // as GGUF tools print it: "f32", "q4_K", …
  uint32_t ggml_type;      // GGML_TYPE_*: the id a GGUF tensor info holds
  int64_t block_elements;  // values per block (1 for the float types)
  int64_t block_bytes;     // bytes per block
};

const WeightTypeInfo& weight_type_info(WeightType type);
inline const char* weight_type_name(WeightType type) { return weight_type_info(type).name; }
// The type a GGUF tensor's ggml id names, or nothing for ids qkv does not hold (Q4_1, Q2_K, the IQ types, …).
std::optional<WeightType> weight_type_from_ggml(uint32_t ggml_type);
// The type named "q4_k", "Q4_K", "bf16", … (case-insensitive), or nothing.
std::optional<WeightType> weight_type_from_name(std::string_view name);
inline bool is_block_quantized(WeightType type) { return weight_type_info(type).block_elements > 1; }

// Bytes of one row of `cols` values. std::invalid_argument (the kernels sit below qkv's typed errors; callers that read
// files check first and raise their own) when cols is negative, not a multiple of the block, or the size overflows.
int64_t row_bytes(WeightType type, int64_t cols);

// rows × cols floats (row-major, rows `cols` apart) → `rows` rows of row_bytes(type, cols) bytes, one after another.
// The block types run ggml's reference quantizers (quantize_row_*_ref: absmax for Q8_0 and Q4_0, make_qkx2_quants'
// search of scale and min for Q4_K and Q5_K, make_qx_quants' for Q6_K, the nearest level under a power-of-two scale for
// MXFP4), giving the bytes llama-quantize writes without an
// importance matrix; F16 rounds to nearest even as ggml_fp32_to_fp16 (a NaN becomes 0x7e00 with its sign), BF16 as
// ggml_fp32_to_bf16 (to nearest even; a NaN stays a quiet NaN). Threads split the rows.
// Values must be finite for the block types: ggml's quantizers turn a NaN or ±Inf into meaningless blocks (the C
// conversion of NaN to an integer is undefined), so std::invalid_argument names the first such value instead. A
// finite value beyond what a half scale can hold (|x| > 65504·127 for Q8_0) gives an infinite scale, as in ggml.
void quantize_rows(WeightType type, const float* src, void* dst, int64_t rows, int64_t cols);
// The inverse: `rows` rows of `type` → rows × cols floats, as ggml's dequantize_row_* (exactly: each value is the
// float32 rounding of the same products and differences). Threads split the rows.
void dequantize_rows(WeightType type, const void* src, float* dst, int64_t rows, int64_t cols);

// One value of a row, widened from its block (for checks and references; slow).
float stored_value(WeightType type, const void* row, int64_t col);

}  // namespace qkv::kernels
