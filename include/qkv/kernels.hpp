// Kernels: pure compute on raw float pointers. No allocation in hot loops, no graph, no I/O.
// Each fast kernel has a plain scalar reference beside it (suffix _reference) that the tests compare
// against. Layouts are row-major; every comment states the shapes.
#pragma once

#include <cstdint>

namespace qkv::kernels {

// C (M,N) = alpha * op(A) @ op(B) + beta * C, op(X) = X or Xᵀ. A is (M,K) or, transposed, (K,M);
// B is (K,N) or (N,K). lda/ldb/ldc are row strides. OpenBLAS sgemm does the work.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// y (rows,n) = softmax of each row of x (rows,n), subtracting the row max first so exp cannot overflow.
// A row of all -inf gives NaN, as in PyTorch. x and y may alias.
void softmax_rows(const float* x, float* y, int64_t rows, int64_t n);
void softmax_rows_reference(const float* x, float* y, int64_t rows, int64_t n);
// dx (rows,n) += y ⊙ (dy − rowsum(dy ⊙ y)): the softmax Jacobian-vector product from the output y.
void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t n);

// dst (batch, cols, rows) = transpose of each src (batch, rows, cols) matrix.
void transpose_batched(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols);

}  // namespace qkv::kernels
