// Row softmax and cross-entropy over rows of logits, each beside a scalar reference (suffix _reference).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// y (rows,n) = softmax of each row of x (rows,n), subtracting the row max first so exp cannot overflow.
// A row of all -inf gives NaN, as in PyTorch. x and y may alias. Rows in parallel.
void softmax_rows(const float* x, float* y, int64_t rows, int64_t n);
void softmax_rows_reference(const float* x, float* y, int64_t rows, int64_t n);
// As softmax_rows, also writing each row's log-sum-exp (max + log Σ exp(x − max)) to lse (rows) unless lse
// is null.
void softmax_rows_lse(const float* x, float* y, float* lse, int64_t rows, int64_t n);
// dx (rows,n) += y ⊙ (dy − rowsum(dy ⊙ y)): the softmax Jacobian-vector product from the output y.
void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t n);
void softmax_rows_backward_reference(const float* y, const float* dy, float* dx, int64_t rows, int64_t n);

// Cross-entropy of logits (rows, V) against targets (rows); rows whose target is ignore_index are skipped.
// Writes probs (rows, V) = softmax(logits) and returns Σ over counted rows of logsumexp(z) − z[target]
// (in double), with *counted the number of counted rows. A target outside [0, V) (and not ignore_index) is
// reported through *bad_row (its index, else −1) without reading out of bounds; the caller raises the error.
double cross_entropy_forward(const float* logits, const int64_t* targets, float* probs, int64_t rows, int64_t V,
                             int64_t ignore_index, int64_t* counted, int64_t* bad_row);
double cross_entropy_forward_reference(const float* logits, const int64_t* targets, int64_t rows, int64_t V,
                                       int64_t ignore_index, int64_t* counted);
// dlogits (rows, V) += scale · (probs − onehot(target)) for counted rows.
void cross_entropy_backward(const float* probs, const int64_t* targets, float* dlogits, int64_t rows, int64_t V,
                            int64_t ignore_index, float scale);
void cross_entropy_backward_reference(const float* logits, const int64_t* targets, float* dlogits, int64_t rows,
                                      int64_t V, int64_t ignore_index, float scale);

// The output head and the cross-entropy in one pass over blocks of rows, x (N, C), weight (V, C), bias (V) or null:
// logits = x Wᵀ + b for a block of rows, their loss, and — when dx, dweight or dbias is given — the gradient of the
// mean loss, dlogits = (softmax − onehot(target)) / counted, turned at once into dx (N, C) = dlogits W,
// dweight (V, C) = Σ dlogitsᵀ x and dbias (V) = Σ dlogits (each overwritten, any of them may be null). So the
// (N, V) logits never exist whole: one block of rows (`block_rows`; 0 picks 64 MiB of logits, or C rows up to
// 256 MiB) is computed, soft-maxed in place and used while it is hot. Rows whose target is ignore_index count in
// neither loss nor mean; a target outside [0, V) is reported through bad_row (its index, else −1) before anything
// is computed. With x_bf16 and weight_bf16 (x's and weight's values rounded to bfloat16) the three products run in
// gemm_bf16 on them, dlogits rounded to bfloat16 per block; the softmax, the loss and every sum stay float32.
struct CrossEntropySum {
  double total = 0.0;    // Σ over counted rows of logsumexp(z) − z[target]
  int64_t counted = 0;  // rows that counted
  int64_t bad_row = -1;  // the first row whose target is outside [0, V), or −1
};
CrossEntropySum linear_cross_entropy(const float* x, const float* weight, const float* bias, const int64_t* targets,
                                     int64_t N, int64_t C, int64_t V, int64_t ignore_index, float* dx, float* dweight,
                                     float* dbias, int64_t block_rows = 0, const uint16_t* x_bf16 = nullptr,
                                     const uint16_t* weight_bf16 = nullptr);
// The rows per block linear_cross_entropy takes when block_rows is 0 (at most N).
int64_t linear_cross_entropy_block_rows(int64_t N, int64_t C, int64_t V);
// In double, the logits materialised: what the fused pass must equal.
CrossEntropySum linear_cross_entropy_reference(const float* x, const float* weight, const float* bias,
                                               const int64_t* targets, int64_t N, int64_t C, int64_t V,
                                               int64_t ignore_index, float* dx, float* dweight, float* dbias);

}  // namespace qkv::kernels
