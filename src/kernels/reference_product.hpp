// The plain product every GEMM is checked against, for any operand type (internal to src/kernels/).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// C (M,N) = alpha · op(A) op(B) + beta · C with gemm()'s layout rules; each element of A and B read through
// `value` (a float as it is, a bf16 pattern widened), products summed in double.
template <class T, class Value>
void reference_product(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const T* A, int64_t lda,
                       const T* B, int64_t ldb, float beta, float* C, int64_t ldc, Value value) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const float a = value(trans_a ? A[k * lda + i] : A[i * lda + k]);
        const float b = value(trans_b ? B[j * ldb + k] : B[k * ldb + j]);
        acc += static_cast<double>(a) * b;
      }
      const float prior = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(alpha * acc) + prior;
    }
  }
}

}  // namespace qkv::kernels
