// Elementwise kernels: broadcasting arithmetic, unary maps, sums over a dimension, masking, copies between
// row-strided blocks, column sums, transposes and counter-based dropout. Each has a plain reference (suffix
// _reference) or is one that the tests compare against; every loop the autograd ops need lives here.
// Parallel loops split by output ownership: results do not depend on the thread count.
#pragma once

#include <array>
#include <cstdint>

namespace qkv::kernels {

// ---- broadcasting binary arithmetic ----

enum class BinaryOp { Add, Sub, Mul, Div };

// Operands seen with the broadcast output's shape, padded to 4 dimensions (outermost first): dims of the
// output, and element strides of a and b in it (0 along a stretched dimension).
struct Broadcast {
  std::array<int64_t, 4> dims{1, 1, 1, 1};  // the output's sizes, outermost first
  std::array<int64_t, 4> a_stride{}, b_stride{};  // element strides of a and b in it
  // Elements of the output
  int64_t numel() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
};

// out = a op b over the broadcast shape.
void binary_forward(BinaryOp op, const Broadcast& shape, const float* a, const float* b, float* out);
void binary_forward_reference(BinaryOp op, const Broadcast& shape, const float* a, const float* b, float* out);
// da += ∂(a op b)/∂a · g and db += ∂(a op b)/∂b · g, summed over every position an operand was stretched
// over (da or db may be null). Per element: add (g, g), sub (g, −g), mul (g·b, g·a), div (g/b, −g·a/b²).
// With accumulate_a (or _b) false that gradient is written, not added to: a fresh one needs no zeroing.
void binary_backward(BinaryOp op, const Broadcast& shape, const float* a, const float* b, const float* g, float* da,
                     float* db, bool accumulate_a = true, bool accumulate_b = true);
void binary_backward_reference(BinaryOp op, const Broadcast& shape, const float* a, const float* b, const float* g,
                               float* da, float* db);

// ---- unary maps y = f(x) with a scalar s ----

// SoftCap: s·tanh(x / s), Gemma 2's soft-capping of its final logits. Sigmoid: 1 / (1 + e^−x). Softplus: log(1 + e^x),
// x itself above 20 (torch.nn.functional.softplus's threshold; Gated DeltaNet's decay).
enum class UnaryOp { AddScalar, MulScalar, DivScalar, Neg, Exp, Log, SoftCap, Sigmoid, Softplus };

void unary_forward(UnaryOp op, float s, const float* x, float* y, int64_t n);
// dx += g · f'(x) (y = f(x) is given for ops whose derivative is cheapest from it: exp).
void unary_backward(UnaryOp op, float s, const float* x, const float* y, const float* g, float* dx, int64_t n);
void unary_forward_reference(UnaryOp op, float s, const float* x, float* y, int64_t n);

// ---- sums over the middle of (outer, n, inner) ----

// out (outer, inner) = Σ_k x (outer, k, inner).
void sum_middle(const float* x, float* out, int64_t outer, int64_t n, int64_t inner);
void sum_middle_reference(const float* x, float* out, int64_t outer, int64_t n, int64_t inner);
// dx (outer, n, inner) += g (outer, inner), repeated along n: the backward of sum_middle.
void repeat_middle_accumulate(const float* g, float* dx, int64_t outer, int64_t n, int64_t inner);

// out (cols) += Σ_r x (rows, cols): column sums, as bias gradients need. Rows go in fixed chunks summed in
// order, so the result does not depend on the thread count.
void add_column_sums(const float* x, float* out, int64_t rows, int64_t cols);
void add_column_sums_reference(const float* x, float* out, int64_t rows, int64_t cols);

// ---- copies ----

// dst (+)= src, n values.
void accumulate(float* dst, const float* src, int64_t n);
// dst (+)= a ⊙ b, n values.
void multiply(const float* a, const float* b, float* dst, int64_t n, bool accumulate);
// rows × width values from src (row stride src_stride) to dst (row stride dst_stride); added with `accumulate`.
void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows, int64_t width,
               bool accumulate);

// y = x with y[o, i] = value where mask[i] != 0; x is (outer, inner), mask (inner). x and y may alias.
void masked_fill(const float* x, const float* mask, float value, float* y, int64_t outer, int64_t inner);
// dx (outer, inner) += g where mask == 0.
void masked_fill_backward(const float* mask, const float* g, float* dx, int64_t outer, int64_t inner);
// mask (T, T): 1 above the diagonal (the future), 0 on and below it.
void causal_mask(float* mask, int64_t T);

// dst (batch, cols, rows) = transpose of each src (batch, rows, cols) matrix.
void transpose_batched(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols);
void transpose_batched_reference(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols);
// dst (cols, rows) = the transpose of a (rows × cols) block of src whose rows are src_stride floats apart:
// a column slice of a wider matrix (GPT-2's fused c_attn), in cache-sized tiles.
void transpose_strided(const float* src, int64_t rows, int64_t cols, int64_t src_stride, float* dst);

// Viewed as (outer, n0, mid, n1, inner), dst is (outer, n1, mid, n0, inner): dimensions n0 and n1 swapped;
// dst (+)= the swapped src.
void swap_axes(const float* src, float* dst, int64_t outer, int64_t n0, int64_t mid, int64_t n1, int64_t inner,
               bool accumulate);

// ---- counter-based dropout ----

// Inverted dropout with a counter-based mask: y[i] (+)= x[i] · keep(seed, i) / (1 − p), where keep is a pure
// function of (seed, i) (murmur3's finalizer), so the backward pass regenerates the mask instead of storing
// it. Vectorised; the result does not depend on the thread count.
void hashed_dropout(const float* x, float* y, int64_t n, uint64_t seed, float p, bool accumulate);
void hashed_dropout_reference(const float* x, float* y, int64_t n, uint64_t seed, float p, bool accumulate);

}  // namespace qkv::kernels
