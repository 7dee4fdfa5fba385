// Matrix products: OpenBLAS sgemm, split between OpenMP threads by output slices, beside a plain reference.
// Not here: the attention kernel's own micro-kernel (kernels/attention.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// What a product does with denormals (magnitudes below float's smallest normal, 1.2e-38). Keep: IEEE arithmetic,
// as PyTorch. Flush: every thread of the product runs with FTZ and DAZ set (x86), so a denormal input or result
// is 0. For products of probabilities, whose tiny entries times a small weight land there: each such operation
// costs a microcode assist, ~100× an FMA (measured: the GPT-2 head's dlogits products 25% slower in the steps
// where a tenth of the probabilities fell below 1e-30). A flushed term changes a sum only when that sum is itself
// below ~1e-31.
enum class Denormals { Keep, Flush };

// C (M,N) = alpha * op(A) @ op(B) + beta * C, op(X) = X or Xᵀ. A is (M,K) or, transposed, (K,M);
// B is (K,N) or (N,K). lda/ldb/ldc are row strides. OpenBLAS runs single-threaded inside qkv; this function
// splits C between OpenMP threads by rows or columns (each thread owns its slice).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, Denormals denormals = Denormals::Keep);
// The BLAS kernels this process runs, e.g. "OpenBLAS SkylakeX" (OpenBLAS picks them at load time from the CPU, or
// from OPENBLAS_CORETYPE), for benchmarks to report beside their figures.
const char* gemm_backend();

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace qkv::kernels
