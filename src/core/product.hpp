// The matrix product every op of src/core runs, in the precision the op was recorded in (internal to src/core).
#pragma once

#include <utility>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/weights.hpp"

namespace qkv::detail {

// The weight view of rows [at / K, …) of a stored matrix b (BF16 or Stored): kernels::gemm_weight's operand.
inline kernels::WeightView weight_rows(const Tensor& b, int64_t at, int64_t rows) {
  const int64_t K = b.size(1);
  const kernels::WeightType type = b.weight_type();
  const auto* base = b.dtype() == DType::BF16 ? static_cast<const void*>(b.bf16()) : b.stored_bytes();
  return {type, static_cast<const unsigned char*>(base) + at / K * kernels::row_bytes(type, K), rows, K};
}

// C = alpha · op(A) op(B) + beta · C, where A starts `a_at` elements into tensor a and B `b_at` into b (kernels::gemm's
// layout rules). FP32: kernels::gemm on the values. BF16: kernels::gemm_bf16 on the tensors' bf16 copies (Tensor::bf16:
// rounded once per write of the tensor, so a weight once per optimiser step), float32 sums into C.
// A weight kept in another storage type — B a Stored matrix, or a BF16 one in FP32 precision — is read by
// kernels::gemm_weight, which widens it inside the kernel on every CPU: x·Wᵀ (the forward) and dY·W (the backward's dX
// through a frozen weight). The precision decides the arithmetic, not the storage: a BF16 weight in BF16 precision
// takes gemm_bf16's bf16 products as before. Any other use of a Stored tensor is a ValueError naming it.
inline void product(Precision p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const Tensor& a, int64_t a_at, int64_t lda, const Tensor& b, int64_t b_at, int64_t ldb, float beta,
                    float* C, int64_t ldc) {
  const bool stored_b = b.dtype() == DType::Stored || (b.dtype() == DType::BF16 && p != Precision::BF16 && a.dtype() == DType::F32);
  if (stored_b && !trans_a && alpha == 1.0f && b.rank() == 2 && ldb == b.size(1) && b_at % ldb == 0) {
    if (trans_b)  // C (M × N) = A · Bᵀ, B's rows [b_at / K, + N)
      return kernels::gemm_weight(weight_rows(b, b_at, N), M, a.data() + a_at, lda, beta, C, ldc);
    if (b_at == 0 && K == b.size(0))  // C (M × N) = A · B: the gradient through the whole weight
      return kernels::gemm_weight_backward(weight_rows(b, 0, K), M, a.data() + a_at, lda, beta, C, ldc);
  }
  if (a.dtype() == DType::Stored || b.dtype() == DType::Stored) {
    const Tensor& s = a.dtype() == DType::Stored ? a : b;
    throw ValueError(std::string("a weight ") + s.shape().str() + " stored as " + kernels::weight_type_name(s.weight_type()) +
                     " is read only by products with activations (x·Wᵀ, and the input's gradient through it when "
                     "frozen): it cannot be trained; freeze it (train LoRA adapters on it) or load the model in float32");
  }
  if (p == Precision::BF16 || a.dtype() == DType::BF16 || b.dtype() == DType::BF16)
    kernels::gemm_bf16(trans_a, trans_b, M, N, K, alpha, a.bf16() + a_at, lda, b.bf16() + b_at, ldb, beta, C, ldc);
  else
    kernels::gemm(trans_a, trans_b, M, N, K, alpha, a.data() + a_at, lda, b.data() + b_at, ldb, beta, C, ldc);
}

// C (M × Σ rows) = A · [B_0; B_1; …]ᵀ + beta·C, the parts' columns side by side (linear_concat's forward): product()
// per part, except that stored parts (see product()) go to kernels::gemm_weights together, which runs parts of one
// type as one matrix: generation then pays one parallel region for a layer's q, k and v instead of three.
inline void product_parts(Precision p, int64_t M, int64_t K, const Tensor& a, const std::vector<std::pair<Tensor, int64_t>>& parts,
                          float beta, float* C, int64_t ldc) {
  thread_local std::vector<kernels::WeightView> views;  // kept: generation calls this for every layer and token
  views.clear();
  for (const auto& [b, rows] : parts) {
    const bool stored = b.dtype() == DType::Stored || (b.dtype() == DType::BF16 && p != Precision::BF16 && a.dtype() == DType::F32);
    if (!stored || b.rank() != 2 || b.size(1) != K || b.size(0) != rows) break;
    views.push_back(weight_rows(b, 0, rows));
  }
  if (parts.size() > 1 && views.size() == parts.size()) return kernels::gemm_weights(views, M, a.data(), K, beta, C, ldc);
  for (int64_t column = 0; const auto& [b, rows] : parts) {
    product(p, false, true, M, rows, K, 1.0f, a, 0, K, b, 0, K, beta, C + column, ldc);
    column += rows;
  }
}

// A stored weight (not float32) that is to be trained: ValueError naming it and the fix, before any product runs.
inline void refuse_training_stored(const Tensor& w, const char* op) {
  if (w.defined() && w.dtype() == DType::Stored && w.requires_grad() && grad_enabled())
    throw ValueError(std::string(op) + ": a weight " + w.shape().str() + " stored as " + kernels::weight_type_name(w.weight_type()) +
                     " cannot be trained (its gradient has nowhere to go): freeze it (requires_grad_(false); LoRA trains "
                     "adapters on a frozen base) or load the model in float32");
}

}  // namespace qkv::detail
