// GEMM (through OpenBLAS), row softmax and batched transpose, each beside its scalar reference.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qkv/kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {

// One thread model for the whole library: OpenMP. OpenBLAS's own pthreads would spin and yield against
// OpenMP's (measured: a third of a training step in sched_yield and libgomp spinning), so OpenBLAS runs
// single-threaded and gemm() splits C between OpenMP threads by rows or columns — each thread owns its
// slice of the output.
const bool g_blas_single_threaded = [] {
  openblas_set_num_threads(1);
  return true;
}();

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  (void)g_blas_single_threaded;
  if (M == 0 || N == 0) return;
  if (K == 0) {  // BLAS leaves C alone only when beta == 1; make the empty sum explicit
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double flops = 2.0 * static_cast<double>(M) * N * K;
  if (threads <= 1 || flops < 4e6) {
    sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  // Split the longer side of C into equal slices, rounded to 16 so the micro-kernels stay full.
  const bool by_rows = M >= N;
  const int64_t extent = by_rows ? M : N;
  const int64_t slice = std::max<int64_t>(16, (extent / threads + 15) / 16 * 16);
  const int64_t slices = (extent + slice - 1) / slice;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t begin = s * slice, count = std::min(slice, extent - begin);
    if (by_rows) {  // rows [begin, begin + count) of C and of op(A)
      const float* a = trans_a ? A + begin : A + begin * lda;
      sgemm(trans_a, trans_b, count, N, K, alpha, a, lda, B, ldb, beta, C + begin * ldc, ldc);
    } else {        // columns [begin, begin + count) of C and of op(B)
      const float* b = trans_b ? B + begin * ldb : B + begin;
      sgemm(trans_a, trans_b, M, count, K, alpha, A, lda, b, ldb, beta, C + begin, ldc);
    }
  }
}

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const float a = trans_a ? A[k * lda + i] : A[i * lda + k];
        const float b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        acc += static_cast<double>(a) * b;
      }
      const float prior = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
      C[i * ldc + j] = static_cast<float>(alpha * acc) + prior;
    }
  }
}

void softmax_rows(const float* x, float* y, int64_t rows, int64_t n) { softmax_rows_lse(x, y, nullptr, rows, n); }

void softmax_rows_lse(const float* x, float* y, float* lse, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float max_value = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max(max_value, xr[j]);
    // std::max skips a NaN, but the NaN still reaches the sum, so the whole row becomes NaN as in PyTorch.
    const float sum = simd::exp_shifted_sum(xr, yr, n, max_value);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) yr[j] *= inv;
    if (lse) lse[r] = max_value + std::log(sum);
  }
}

void softmax_rows_reference(const float* x, float* y, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    double max_value = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max<double>(max_value, x[r * n + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(static_cast<double>(x[r * n + j]) - max_value);
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = static_cast<float>(std::exp(x[r * n + j] - max_value) / sum);
  }
}

void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * n;
    const float* dyr = dy + r * n;
    float* dxr = dx + r * n;
    float dot = 0.0f;
    for (int64_t j = 0; j < n; ++j) dot += yr[j] * dyr[j];
    for (int64_t j = 0; j < n; ++j) dxr[j] += yr[j] * (dyr[j] - dot);
  }
}

void add_column_sums(const float* x, float* out, int64_t rows, int64_t cols) {
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks <= 1) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c] += x[r * cols + c];
    return;
  }
  std::vector<float> partial(static_cast<size_t>(chunks * cols), 0.0f);
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 15))
  for (int64_t k = 0; k < chunks; ++k) {
    float* p = partial.data() + k * cols;
    for (int64_t r = k * kChunk; r < std::min(rows, (k + 1) * kChunk); ++r)
      for (int64_t c = 0; c < cols; ++c) p[c] += x[r * cols + c];
  }
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < cols; ++c) out[c] += partial[static_cast<size_t>(k * cols + c)];
}

void transpose_batched(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 32;  // tiles keep both the read and the write side in cache
  for (int64_t b = 0; b < batch; ++b) {
    const float* s = src + b * rows * cols;
    float* d = dst + b * rows * cols;
    for (int64_t i0 = 0; i0 < rows; i0 += kBlock)
      for (int64_t j0 = 0; j0 < cols; j0 += kBlock)
        for (int64_t i = i0; i < std::min(rows, i0 + kBlock); ++i)
          for (int64_t j = j0; j < std::min(cols, j0 + kBlock); ++j) d[j * rows + i] = s[i * cols + j];
  }
}

}  // namespace qkv::kernels
