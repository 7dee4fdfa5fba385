// bf16 × bf16 → f32 products: oneDNN's matmul where the CPU multiplies bf16 in hardware, else both operands
// widened to float32 and handed to gemm() (see qkv/kernels/gemm.hpp).
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(QKV_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "amx.hpp"
#include "reference_product.hpp"

namespace qkv::kernels {

namespace {

struct CpuBf16 {
  bool avx512_bf16 = false, amx_bf16 = false, amx_tile = false;
};

CpuBf16 detect() {
  CpuBf16 cpu;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    const bool avx512f = (b >> 16) & 1u;
    cpu.amx_bf16 = (d >> 22) & 1u;
    cpu.amx_tile = (d >> 24) & 1u;
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (a >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) cpu.avx512_bf16 = avx512f && ((a1 >> 5) & 1u);
  }
#endif
  return cpu;
}

const CpuBf16& cpu() {
  static const CpuBf16 c = detect();
  return c;
}

// Widens both operands and multiplies in float32: exact operands, float32 sums, so the values gemm_bf16 promises.
void widened(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
             const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t a_rows = trans_a ? K : M, b_rows = trans_b ? N : K;
  const int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  memory::Buffer<float> a(static_cast<size_t>(a_rows * a_cols)), b(static_cast<size_t>(b_rows * b_cols));
  for (int64_t r = 0; r < a_rows; ++r) bf16_to_f32(A + r * lda, a.data() + r * a_cols, a_cols);
  for (int64_t r = 0; r < b_rows; ++r) bf16_to_f32(B + r * ldb, b.data() + r * b_cols, b_cols);
  gemm(trans_a, trans_b, M, N, K, alpha, a.data(), a_cols, b.data(), b_cols, beta, C, ldc);
}

#if defined(__AVX512BF16__)
// One row times a transposed matrix, y (1 × N) = alpha · a Bᵀ + beta · y with B (N × K): generation's products, a
// token at a time. Memory-bound, so it streams B once with VDPBF16PS, threads owning slices of y (oneDNN's matmul
// reads a bf16 weight at about half the rate here: 13 against 25-30 GB/s). One row at a time, so each thread reads
// one sequential stream: measured on GPT-2's head (50257 × 768, far beyond the caches), 22.5 / 29.2 GB/s on 1 / 2
// threads against 7.9 / 15.5 for eight rows read side by side (eight streams 1.5 KB apart defeat the prefetcher).
// Row n of y: two accumulators over alternate 64-byte steps, the last partial step masked. Each step also asks for
// the line 8 KiB further on (the rows a thread reads lie one after another): the hardware prefetcher alone kept a
// thread's stream at 31-32 GB/s on 2 threads of a Zen 5 whose read loop measured 41-51; with it 38-55 (fc1, fc2 and
// the head of GPT-2 124M, far beyond the caches).
constexpr int64_t kPrefetchAhead = 4096;  // bf16 elements
void gemv_row(int64_t n, int64_t K, float alpha, const uint16_t* a, const uint16_t* B, int64_t ldb, float beta, float* y) {
  const uint16_t* row = B + n * ldb;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  auto step = [&](__m512& acc, int64_t k) {
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(a + k)),
                           reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + k)));
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k + kPrefetchAhead), _MM_HINT_T0);  // a hint: never faults
    _mm_prefetch(reinterpret_cast<const char*>(row + k + kPrefetchAhead + 32), _MM_HINT_T0);
    step(acc0, k);
    step(acc1, k + 32);
  }
  if (k + 32 <= K) {
    step(acc0, k);
    k += 32;
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    acc1 = _mm512_dpbf16_ps(acc1, reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, a + k)),
                            reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, row + k)));
  }
  float lanes[16], dot = 0.0f;  // not _mm512_reduce_add_ps: GCC 12 warns inside it (-Wuninitialized)
  _mm512_storeu_ps(lanes, _mm512_add_ps(acc0, acc1));
  for (float l : lanes) dot += l;
  const float sum = alpha * dot;
  y[n] = beta == 0.0f ? sum : sum + beta * y[n];
}

void gemv_bf16(int64_t N, int64_t K, float alpha, const uint16_t* a, const uint16_t* B, int64_t ldb, float beta,
               float* y) {
  const int parts = N * K < (int64_t{1} << 16) ? 1 : omp_get_max_threads();
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int64_t n = 0; n < N; ++n) gemv_row(n, K, alpha, a, B, ldb, beta, y);
}
#endif

#if defined(QKV_AMX)
// C (M × N) (+)= A · Bᵀ with a short K (B is N × K: a Linear layer's weight, an output head) on AMX tiles. oneDNN
// 2.6's AMX matmul runs such products at a fraction of the tile rate: a 50,257-word head of width 192 (the default
// `qkv train` model) at 70 / 151 GFLOP/s on 1 / 2 threads of a Sapphire Rapids, slower than OpenBLAS in float32
// (105 / 210); this loop 195 / 491, measured alone. B is packed once per call into pair rows of 32 columns
// (zero-padded in k and n), A into rows of whole 16-pair steps; threads own 32-row blocks of C and sweep its columns
// in order, so C is written as it lies. Every C element is one thread's fixed sum: the bits do not depend on the
// thread count.
constexpr int64_t kShortK = 256;
bool amx_short_k(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                 int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (trans_a || !trans_b || alpha != 1.0f || (beta != 0.0f && beta != 1.0f) || K > kShortK || M < 32 || N < 1024 ||
      !amx_bf16_ready())
    return false;
  const int64_t KK = (K + 1) / 2, KKp = (KK + 15) / 16 * 16, blocks = (N + 31) / 32, Mp = (M + 31) / 32 * 32;
  memory::Buffer<uint16_t> packed(static_cast<size_t>(blocks * KKp * 64)), a(static_cast<size_t>(Mp * 2 * KKp));
  const bool accumulate = beta != 0.0f;
#pragma omp parallel
  {
    alignas(64) int32_t step[16];  // byte offsets of 16 rows of B
    for (int j = 0; j < 16; ++j) step[j] = static_cast<int32_t>(j * ldb * 2);
    const __m512i rows16 = _mm512_load_si512(step);
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {  // pair row kk of block nb: (B[n][2kk], B[n][2kk + 1]) for 32 n
      uint16_t* dst = packed.data() + nb * KKp * 64;
      for (int half = 0; half < 2; ++half) {  // columns 16·half … 16·half + 15: a gather of 16 words per pair row
        const int64_t n0 = nb * 32 + 16 * half, n = std::clamp<int64_t>(N - n0, 0, 16);
        const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
        const uint16_t* first = B + std::min(n0, N - 1) * ldb;
        for (int64_t kk = 0; kk < K / 2; ++kk)
          _mm512_storeu_si512(dst + kk * 64 + 32 * half,
                              _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, rows16, first + 2 * kk, 1));
        if (K % 2)  // the last k alone: its pair's second half is zero
          for (int64_t j = 0; j < 16; ++j) {
            dst[(K / 2) * 64 + 32 * half + 2 * j] = j < n ? first[j * ldb + K - 1] : uint16_t{0};
            dst[(K / 2) * 64 + 32 * half + 2 * j + 1] = 0;
          }
      }
      std::fill(dst + KK * 64, dst + KKp * 64, uint16_t{0});
    }
#pragma omp for schedule(static)
    for (int64_t m = 0; m < Mp; ++m) {
      uint16_t* row = a.data() + m * 2 * KKp;
      if (m < M) std::copy_n(A + m * lda, K, row);
      std::fill(row + (m < M ? K : 0), row + 2 * KKp, uint16_t{0});
    }
    configure_tiles();
    alignas(64) float tile[32 * 32];
#pragma omp for schedule(static)
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const uint16_t* a0 = a.data() + m0 * 2 * KKp;
      const int64_t rows = std::min<int64_t>(32, M - m0);
      for (int64_t nb = 0; nb < blocks; ++nb) {
        const int64_t n0 = nb * 32, width = std::min<int64_t>(32, N - n0);
        const bool direct = rows == 32 && width == 32;  // else through `tile`, the part inside C copied
        float* c = direct ? C + m0 * ldc + n0 : tile;
        const int64_t lc = direct ? ldc : 32;
        if (!direct && accumulate) {
          std::fill_n(tile, 32 * 32, 0.0f);
          for (int64_t r = 0; r < rows; ++r) std::copy_n(C + (m0 + r) * ldc + n0, width, tile + r * 32);
        }
        amx_tiles<2, 2>(0, KKp, KKp, a0, 2 * KKp, packed.data() + nb * KKp * 64, 64, nullptr, c, lc, accumulate);
        if (!direct)
          for (int64_t r = 0; r < rows; ++r) std::copy_n(tile + r * 32, width, C + (m0 + r) * ldc + n0);
      }
    }
  }
  return true;
}
#endif

#if defined(QKV_HAVE_DNNL)
// One matmul primitive per layout, created on first use and kept: creating one JIT-compiles its kernel (~ms).
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float>;

struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory::desc a, b, c;
  std::string impl;
};

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

std::mutex g_mutex;
std::map<Key, std::shared_ptr<const Primitive>> g_primitives;
std::string g_last_impl;  // the implementation oneDNN chose most recently, for gemm_bf16_backend()

std::shared_ptr<const Primitive> primitive(const Key& key) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = g_primitives.find(key); it != g_primitives.end()) return it->second;
  const auto [trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha, beta] = key;
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  auto p = std::make_shared<Primitive>();
  p->a = dnnl::memory::desc({M, K}, dt::bf16, trans_a ? dims{1, lda} : dims{lda, 1});
  p->b = dnnl::memory::desc({K, N}, dt::bf16, trans_b ? dims{1, ldb} : dims{ldb, 1});
  p->c = dnnl::memory::desc({M, N}, dt::f32, dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a, p->b, p->c), attr, engine());
  p->impl = pd.impl_info_str();
  p->matmul = dnnl::matmul(pd);
  g_last_impl = p->impl;
  g_primitives.emplace(key, p);
  return p;
}

// Runs the product through oneDNN; false if oneDNN has no kernel for it (then the caller widens).
bool run_dnnl(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
              const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  std::shared_ptr<const Primitive> p;
  try {
    p = primitive(Key{trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha, beta});
  } catch (const dnnl::error&) {
    return false;
  }
  thread_local dnnl::stream stream(engine());
  const dnnl::memory a(p->a, engine(), const_cast<uint16_t*>(A)), b(p->b, engine(), const_cast<uint16_t*>(B)),
      c(p->c, engine(), C);
  p->matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream.wait();
  return true;
}

// rows × cols elements, rows `from_ld` apart in `from` and `to_ld` apart in `to`.
template <typename T>
void copy_rows(const T* from, int64_t from_ld, int64_t rows, int64_t cols, T* to, int64_t to_ld) {
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t{1} << 18))
  for (int64_t r = 0; r < rows; ++r) std::copy_n(from + r * from_ld, cols, to + r * to_ld);
}

// run_dnnl on dense operands. oneDNN 2.6's fast matmul (brgemm, on AMX or AVX512_BF16) takes only dense matrices: a
// strided one (a slice of the packed q/k/v, say) is handed to its gemm:jit, which on a Sapphire Rapids ran GPT-2's
// 2048 × 768 × 768 products at a fraction of the AMX rate (540 of a profiled bf16 run's 1,197 products, 3.2 of its
// 21.8 s, measured with ONEDNN_VERBOSE). So strided operands are copied dense first, a strided C computed apart and copied
// back: a copy costs what a few percent of the product does.
bool run_dnnl_dense(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                    int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K, b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  const bool copy_a = lda != a_cols, copy_b = ldb != b_cols, copy_c = ldc != N;
  memory::Buffer<uint16_t> a(copy_a ? static_cast<size_t>(a_rows * a_cols) : 0),
      b(copy_b ? static_cast<size_t>(b_rows * b_cols) : 0);
  memory::Buffer<float> c(copy_c ? static_cast<size_t>(M * N) : 0);
  if (copy_a) copy_rows(A, lda, a_rows, a_cols, a.data(), a_cols);
  if (copy_b) copy_rows(B, ldb, b_rows, b_cols, b.data(), b_cols);
  if (copy_c && beta != 0.0f) copy_rows(C, ldc, M, N, c.data(), N);
  if (!run_dnnl(trans_a, trans_b, M, N, K, alpha, copy_a ? a.data() : A, copy_a ? a_cols : lda, copy_b ? b.data() : B,
                copy_b ? b_cols : ldb, beta, copy_c ? c.data() : C, copy_c ? N : ldc))
    return false;
  if (copy_c) copy_rows(c.data(), N, M, N, C, ldc);
  return true;
}
#endif

}  // namespace

bool bf16_native() { return cpu().avx512_bf16 || cpu().amx_bf16; }

bool amx_bf16_ready() {
  static const bool ready = [] {
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return cpu().amx_bf16 && cpu().amx_tile && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

const char* bf16_missing() {
  return bf16_native() ? "" : "AVX512_BF16 and AMX-BF16 (bf16 products in hardware: AMD Zen 4 and later, Intel Cooper "
                              "Lake and Sapphire Rapids and later)";
}

const char* gemm_bf16_backend() {
  static std::string name;
#if defined(QKV_HAVE_DNNL)
  if (bf16_native()) {
    const dnnl_version_t* v = dnnl_version();
    std::string impl;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      impl = g_last_impl.empty() ? std::string(cpu().amx_bf16 ? "AMX" : "AVX512_BF16") : g_last_impl;
    }
    name = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
           " matmul " + impl;
    return name.c_str();
  }
  name = std::string("widened to float32 (") + gemm_backend() + "): the CPU lacks " + bf16_missing();
#else
  name = std::string("widened to float32 (") + gemm_backend() + "): qkv was built without oneDNN";
#endif
  return name.c_str();
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0 || K == 0) {  // nothing to multiply: gemm() makes the empty sum
    gemm(trans_a, trans_b, M, N, K, alpha, nullptr, lda, nullptr, ldb, beta, C, ldc);
    return;
  }
#if defined(__AVX512BF16__)
  if (M == 1 && trans_b && (!trans_a || lda == 1) && bf16_native()) {
    gemv_bf16(N, K, alpha, A, B, ldb, beta, C);
    return;
  }
#endif
#if defined(QKV_AMX)
  if (amx_short_k(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
#endif
#if defined(QKV_HAVE_DNNL)
  if (bf16_native() && run_dnnl_dense(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
#endif
  widened(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                         int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  reference_product(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bf16_to_f32_reference);
}

}  // namespace qkv::kernels
