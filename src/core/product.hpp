// The matrix product every op of src/core runs, in the precision the op was recorded in (internal to src/core).
#pragma once

#include "qkv/core/precision.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/kernels/gemm.hpp"

namespace qkv::detail {

// C = alpha · op(A) op(B) + beta · C, where A starts `a_at` elements into tensor a and B `b_at` into b (kernels::gemm's
// layout rules). FP32: kernels::gemm on the values. BF16: kernels::gemm_bf16 on the tensors' bf16 copies (Tensor::bf16:
// rounded once per write of the tensor, so a weight once per optimiser step), float32 sums into C. A BF16 tensor
// (Tensor::to_bf16_) is multiplied in bf16 whatever the precision: it has no float32 values.
inline void product(Precision p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const Tensor& a, int64_t a_at, int64_t lda, const Tensor& b, int64_t b_at, int64_t ldb, float beta,
                    float* C, int64_t ldc) {
  if (p == Precision::BF16 || a.dtype() == DType::BF16 || b.dtype() == DType::BF16)
    kernels::gemm_bf16(trans_a, trans_b, M, N, K, alpha, a.bf16() + a_at, lda, b.bf16() + b_at, ldb, beta, C, ldc);
  else
    kernels::gemm(trans_a, trans_b, M, N, K, alpha, a.data() + a_at, lda, b.data() + b_at, ldb, beta, C, ldc);
}

}  // namespace qkv::detail
