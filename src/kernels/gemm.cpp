// GEMM through OpenBLAS, split between OpenMP threads by output slices, beside its scalar reference.
#include "qkv/kernels/gemm.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <string>

#include "denormals.hpp"
#include "reference_product.hpp"

namespace qkv::kernels {

namespace {

// One thread model for the whole library: OpenMP. OpenBLAS's own pthreads would spin and yield against
// OpenMP's (measured: a third of a training step in sched_yield and libgomp spinning), so OpenBLAS runs
// single-threaded and gemm() splits C between OpenMP threads by rows or columns — each thread owns its
// slice of the output.
// OpenBLAS's pthreads build (Debian's default) starts a server thread per core when it is loaded, and each spins in
// sched_yield for 2^28 cycles (~0.1 s) before it sleeps: at the start of every program, a core taken from loading
// the model (37% of the samples of a BF16 folder's load, on 2 cores). Single-threaded, OpenBLAS never uses them, so
// they are stopped. Weak: a build of OpenBLAS without a thread server need not have the function.
extern "C" int blas_thread_shutdown_(void) __attribute__((weak));
const bool g_blas_single_threaded = [] {
  openblas_set_num_threads(1);
  if (blas_thread_shutdown_) blas_thread_shutdown_();
  return true;
}();

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc, Denormals denormals) {
  const DenormalMode mode(denormals);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

// One row of C (M = 1: a token at a time, as generation runs) is a matrix-vector product: sgemm would pack the whole
// of B first, sgemv streams it once (the head of a Qwen3-0.6B-shaped model, 1 × 1024 × 151936, in bench/decoder_bench).
// C (1 × N) = α a op(B) + β C, a's elements `inc_a` apart; columns [begin, begin + count) only.
void sgemv_row(bool trans_b, int64_t begin, int64_t count, int64_t K, float alpha, const float* a, int64_t inc_a,
               const float* B, int64_t ldb, float beta, float* C, Denormals denormals) {
  const DenormalMode mode(denormals);
  if (trans_b)  // B is N × K: y = B a
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(count), static_cast<blasint>(K), alpha,
                B + begin * ldb, static_cast<blasint>(ldb), a, static_cast<blasint>(inc_a), beta, C + begin, 1);
  else          // B is K × N: y = Bᵀ a
    cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<blasint>(K), static_cast<blasint>(count), alpha, B + begin,
                static_cast<blasint>(ldb), a, static_cast<blasint>(inc_a), beta, C + begin, 1);
}

}  // namespace

const char* gemm_backend() {
  static const std::string name = std::string("OpenBLAS ") + openblas_get_corename();
  return name.c_str();
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, Denormals denormals) {
  (void)g_blas_single_threaded;
  if (M == 0 || N == 0) return;
  if (K == 0) {  // BLAS leaves C alone only when beta == 1; make the empty sum explicit
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (!trans_a && trans_b && RowIndependentProducts::active()) {
    gemm_rows_nt(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double flops = 2.0 * static_cast<double>(M) * N * K;
  if (M == 1) {  // threads own slices of the output row; each streams its part of B once
    const int64_t inc_a = trans_a ? lda : 1;
    // Memory-bound: worth splitting once B is beyond a few hundred KiB (Gemma 3 270M's 640 × 2048 layers are).
    const int parts = N * K < (int64_t{1} << 16) ? 1 : threads;
    const int64_t slice = (N + parts - 1) / parts;
    if (parts == 1) {  // no OpenMP region at all (see parallel_for in parallel.hpp)
      sgemv_row(trans_b, 0, N, K, alpha, A, inc_a, B, ldb, beta, C, denormals);
      return;
    }
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = p * slice, count = std::min(slice, N - begin);
      if (count > 0) sgemv_row(trans_b, begin, count, K, alpha, A, inc_a, B, ldb, beta, C, denormals);
    }
    return;
  }
  if (threads <= 1 || flops < 4e6) {
    sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, denormals);
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
      sgemm(trans_a, trans_b, count, N, K, alpha, a, lda, B, ldb, beta, C + begin * ldc, ldc, denormals);
    } else {        // columns [begin, begin + count) of C and of op(B)
      const float* b = trans_b ? B + begin * ldb : B + begin;
      sgemm(trans_a, trans_b, M, count, K, alpha, A, lda, b, ldb, beta, C + begin, ldc, denormals);
    }
  }
}

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  reference_product(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, [](float v) { return v; });
}

}  // namespace qkv::kernels
