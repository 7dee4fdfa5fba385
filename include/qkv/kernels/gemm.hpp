// Matrix products: OpenBLAS sgemm, split between OpenMP threads by output slices, beside a plain reference.
// Not here: the attention kernel's own micro-kernel (kernels/attention.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// C (M,N) = alpha * op(A) @ op(B) + beta * C, op(X) = X or Xᵀ. A is (M,K) or, transposed, (K,M);
// B is (K,N) or (N,K). lda/ldb/ldc are row strides. OpenBLAS runs single-threaded inside qkv; this function
// splits C between OpenMP threads by rows or columns (each thread owns its slice).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace qkv::kernels
