// Products with a weight matrix kept as its file stores it (float32, f16, bf16 or one of ggml's block formats, see
// quant.hpp): the forward product of a linear layer, x·Wᵀ, for generation's few rows and for prompts, evaluation and
// training's many, and the backward dX = dY·W of a frozen stored weight (LoRA on a quantized base). Each beside a
// double-precision reference. Not here: the storage formats (quant.hpp), float32 and bf16 operand products (gemm.hpp).
#pragma once

#include <cstdint>
#include <span>

#include "qkv/kernels/quant.hpp"

namespace qkv::kernels {

// A weight matrix W (N × K) as stored: N rows of K values, row_bytes(type, K) bytes each, one after another — an
// nn.Linear weight (out_features × in_features), a GGUF tensor with ne0 = K and ne1 = N. A view: nothing is owned.
// The bytes need 2-byte alignment (4 for F32), as every GGUF tensor has.
struct WeightView {
  WeightType type = WeightType::F32;  // how the rows are stored
  const void* data = nullptr;         // the first row's first byte
  int64_t rows = 0;  // N, outputs
  int64_t cols = 0;  // K, inputs (a multiple of the block for the block types: row_bytes throws otherwise)
};

// Y (M × N) = X (M × K) · Wᵀ + beta·Y (beta 0: Y is not read). X's rows are ldx floats apart, Y's ldy. Threads own
// slices of Y's columns (rows of W).
//   F32 storage is kernels::gemm. For the others W is read in one stream, each of its blocks unpacked once for up to 4
//   rows of X (Q4_0, Q8_0, Q4_K and Q5_K on CPUs with AVX2 or AVX-512 VNNI, for more rows of X: 8 or 16 rows of W at a
//   time, one per vector lane, unpacked once for all the rows of X): a block type's products run in integers against
//   each row of X quantized once to 8-bit blocks (ggml's q8_0 for Q8_0 and Q4_0, q8_K for the K-quants: the values of
//   gemm_weight_integer_reference), f16/bf16 widen to float32 in the loop (gemm_weight_reference's values, float32
//   sums).
// A row of Y depends only on its row of X and on W: not on M, the row's place among the others, nor the thread count
// (bit for bit), so a batch of sequences gives each the values it gets alone.
// A NaN or ±Inf in a row of X makes that row of Y NaN for the block types (its block's scale is NaN).
void gemm_weight(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy);
// gemm_weight for W in parts (a layer's q, k and v projections; gate and up): Y's columns are the parts' rows in
// order, each part's values what gemm_weight gives it alone, bit for bit. Parts of one storage type (not F32) and one
// width run as one matrix — one parallel region, X quantized once — which saves generation a barrier per part.
void gemm_weights(std::span<const WeightView> parts, int64_t M, const float* X, int64_t ldx, float beta, float* Y,
                  int64_t ldy);

// dX (M × K) = dY (M × N) · W + beta·dX: the gradient of the input through a stored (frozen) weight. Panels of W are
// widened to float32 and multiplied with sgemm; threads own slices of dX's columns (whole blocks), or of its rows when K
// holds fewer blocks than threads.
void gemm_weight_backward(const WeightView& w, int64_t M, const float* dY, int64_t ldy, float beta, float* dX, int64_t ldx);

// gemm_weight's path (block and 16-bit types; not F32), and its alternative for many rows: W widened to float32 a panel
// at a time and multiplied with sgemm (float32 activations; faster than the streaming path from ~128 rows on for some
// types, but its rows' values differ from gemm_weight's), for benchmarks that set them side by side.
void gemm_weight_streaming(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy);
void gemm_weight_panels(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy);

// What gemm_weight runs for this type, for benchmark headers: e.g. "AVX-512 VNNI … integer dots". Where it says
// "rows of W across a vector's lanes", a row of Y is, bit for bit, a fixed sum of float32 chains over the blocks (q,
// d_x: X's 8-bit blocks): Q4_0 and Q8_0, 8 chains c_j ← fma(float(Σ_j w_j·q_j), d_w·d_x, c_j) over the blocks b ≡ j mod
// 8 in order, summed ((c₀ + c₁) + (c₄ + c₅)) + ((c₂ + c₃) + (c₆ + c₇)); Q4_K and Q5_K, c_S − c_M (quant_dot.cpp's
// dot_q45_K).
const char* gemm_weight_backend(WeightType type);

// References, in double: W as dequantize_rows gives it, X as given (the panel path's arithmetic) …
void gemm_weight_reference(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y, int64_t ldy);
void gemm_weight_backward_reference(const WeightView& w, int64_t M, const float* dY, int64_t ldy, float beta, float* dX,
                                    int64_t ldx);
// … and with X quantized to 8-bit blocks as the integer path does (block types only; the float types as above).
void gemm_weight_integer_reference(const WeightView& w, int64_t M, const float* X, int64_t ldx, float beta, float* Y,
                                   int64_t ldy);

}  // namespace qkv::kernels
