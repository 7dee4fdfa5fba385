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
#include "simd.hpp"  // <immintrin.h>, without GCC 12's false warnings
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
#include "micro_kernels.hpp"
#include "parallel.hpp"
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
    simd::prefetch(row + k + kPrefetchAhead, 64 * sizeof(uint16_t));  // the two lines 8 KiB on
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
  parallel_for(N, N * K >= (int64_t{1} << 16) && omp_get_max_threads() > 1,
               [&](int64_t n) { gemv_row(n, K, alpha, a, B, ldb, beta, y); });
}
#endif

#if defined(QKV_AMX)
// ---- bf16 products on AMX tiles, qkv's own (see amx_product below) ----
// Packed operands, in the layouts amx_tiles reads: a block of 32 rows of A over a chunk of `steps` 32-k steps is 32
// rows of 32·steps k (zero past M and K); a block of 32 columns of B over the chunk is 16·steps pair rows of 64 words,
// (B[2kk][n], B[2kk+1][n]) for its 32 n (zero past N and K).

// Block mb of A over k-steps [ksb, kse) into `out`. A with rows k-contiguous (masked loads), or transposed (A is K × M:
// each pair of packed rows m, m + 1 comes from two gathers of 16 dwords down the k rows, split into their halves).
void pack_a_block(bool trans_a, int64_t M, int64_t K, const uint16_t* A, int64_t lda, int64_t mb, int64_t ksb,
                  int64_t kse, uint16_t* out) {
  const int64_t la = 32 * (kse - ksb);
  alignas(64) int32_t offsets[16];  // bytes from a k row to the one two further on
  for (int i = 0; i < 16; ++i) offsets[i] = static_cast<int32_t>(2 * i * lda * 2);
  const __m512i rows2 = _mm512_load_si512(offsets), low = _mm512_set1_epi32(0xffff);
  for (int64_t ks = ksb; ks < kse; ++ks) {
    uint16_t* dst = out + (ks - ksb) * 32;
    const int64_t k0 = ks * 32, kn = std::clamp<int64_t>(K - k0, 0, 32);
    if (!trans_a) {
      const __mmask32 keep = kn == 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << kn) - 1);
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t m = mb * 32 + r;
        const __m512i words = m < M ? _mm512_maskz_loadu_epi16(keep, A + m * lda + k0) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + r * la, words);
      }
      continue;
    }
    const __mmask16 even = static_cast<__mmask16>((1u << ((kn + 1) / 2)) - 1);  // the k rows there are
    const __mmask16 odd = static_cast<__mmask16>((1u << (kn / 2)) - 1);
    for (int64_t r = 0; r < 32; r += 2) {
      const int64_t m = mb * 32 + r;
      if (m + 1 < M) {  // dwords (A[k][m], A[k][m+1]) for the even k, then the odd k
        const uint16_t* at = A + k0 * lda + m;
        const __m512i e = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), even, rows2, at, 1);
        const __m512i o = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), odd, rows2, at + lda, 1);
        _mm512_storeu_si512(dst + r * la, _mm512_or_si512(_mm512_and_si512(e, low), _mm512_slli_epi32(o, 16)));
        _mm512_storeu_si512(dst + (r + 1) * la, _mm512_or_si512(_mm512_srli_epi32(e, 16), _mm512_andnot_si512(low, o)));
      } else {  // the last row alone (M odd), or rows past M
        for (int64_t rr = r; rr < r + 2; ++rr)
          for (int64_t k = 0; k < 32; ++k)
            dst[rr * la + k] = mb * 32 + rr < M && k < kn ? A[(k0 + k) * lda + mb * 32 + rr] : uint16_t{0};
      }
    }
  }
}

// Block nb of B over k-steps [ksb, kse) into `out`. B k × n (n contiguous): two k rows interleaved word by word;
// transposed (B is N × K, k contiguous): a gather of 16 dwords, one per column, per pair row.
void pack_b_block(bool trans_b, int64_t N, int64_t K, const uint16_t* B, int64_t ldb, int64_t nb, int64_t ksb,
                  int64_t kse, uint16_t* out) {
  alignas(64) uint16_t first_half[32], second_half[32];  // word j of each output: row (j & 1), column j / 2 (+ 16)
  for (int j = 0; j < 16; ++j) {
    first_half[2 * j] = static_cast<uint16_t>(j), first_half[2 * j + 1] = static_cast<uint16_t>(32 + j);
    second_half[2 * j] = static_cast<uint16_t>(16 + j), second_half[2 * j + 1] = static_cast<uint16_t>(48 + j);
  }
  const __m512i lo = _mm512_load_si512(first_half), hi = _mm512_load_si512(second_half);
  alignas(64) int32_t offsets[16];  // bytes from one column's row of B to the next
  for (int i = 0; i < 16; ++i) offsets[i] = static_cast<int32_t>(i * ldb * 2);
  const __m512i columns = _mm512_load_si512(offsets);
  const int64_t n0 = nb * 32, nn = std::clamp<int64_t>(N - n0, 0, 32);
  for (int64_t ks = ksb; ks < kse; ++ks) {
    uint16_t* dst = out + (ks - ksb) * 1024;
    for (int64_t kk = 0; kk < 16; ++kk) {
      const int64_t k = ks * 32 + 2 * kk;
      if (!trans_b) {
        const __mmask32 keep = nn == 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << nn) - 1);
        const __m512i r0 = k < K ? _mm512_maskz_loadu_epi16(keep, B + k * ldb + n0) : _mm512_setzero_si512();
        const __m512i r1 = k + 1 < K ? _mm512_maskz_loadu_epi16(keep, B + (k + 1) * ldb + n0) : _mm512_setzero_si512();
        _mm512_store_si512(dst + kk * 64, _mm512_permutex2var_epi16(r0, lo, r1));
        _mm512_store_si512(dst + kk * 64 + 32, _mm512_permutex2var_epi16(r0, hi, r1));
        continue;
      }
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t h0 = n0 + 16 * half, hn = std::clamp<int64_t>(N - h0, 0, 16);
        const uint16_t* first = B + std::min(h0, N - 1) * ldb;
        uint16_t* row = dst + kk * 64 + 32 * half;
        if (k + 1 < K) {
          const __mmask16 there = static_cast<__mmask16>((1u << hn) - 1);
          _mm512_store_si512(row, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), there, columns, first + k, 1));
        } else {  // the last k alone (K odd: its pair's second word is zero), or past K
          std::fill_n(row, 32, uint16_t{0});
          if (k < K)
            for (int64_t j = 0; j < hn; ++j) row[2 * j] = first[j * ldb + k];
        }
      }
    }
  }
}

// C (M × N) = alpha · op(A) · op(B) + beta · C on AMX tiles, any layout (beta 0: C is not read). oneDNN 2.6's AMX
// matmul runs GPT-2's products at a tenth of the tile rate here; this loop, measured side by side on every product
// of a GPT-2 124M bf16 step (B 8 × T 256, 2 threads of a Sapphire Rapids, each product alone), takes 1.25-1.28× less
// time in all, and 1.5× less on a small model's output head (K 192). K goes in chunks of at most 1,024 (C
// accumulates from the second on). The threads split the dimension with more 32-blocks (columns of C, else rows):
// the other operand's blocks are packed once per chunk and shared; each thread packs its own blocks a group at a
// time (as many as fit in about 1 MiB, so they stay in its L2) and multiplies the group by every shared block, so C
// is written in runs of whole groups. Every C element is one thread's sum over the chunks in order: the bits do not
// depend on the thread count.
void amx_product(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                 int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const bool plain = alpha == 1.0f && (beta == 0.0f || beta == 1.0f);  // else each block is scaled into C
  constexpr int64_t kChunk = 1024, kGroupBytes = int64_t{1} << 20;
  const int64_t KS = (K + 31) / 32, MB = (M + 31) / 32, NB = (N + 31) / 32;
  const int64_t chunks = (KS * 32 + kChunk - 1) / kChunk, chunk_steps = (KS + chunks - 1) / chunks;
  const bool split_columns = NB >= MB;
  const int64_t shared_blocks = split_columns ? MB : NB, block_words = chunk_steps * 1024;
  const int64_t group = std::clamp<int64_t>(kGroupBytes / (block_words * 2), 4, 64);
  const int threads = M * N * K < (int64_t{1} << 21) ? 1 : omp_get_max_threads();
  memory::Buffer<uint16_t> shared(static_cast<size_t>(shared_blocks * block_words)),
      own(static_cast<size_t>(threads * group * block_words));
#pragma omp parallel num_threads(threads)
  {
    const Tiles tiles;
    alignas(64) float edge[32 * 32];  // a block of C that C does not fill: multiplied here, its part copied
    const int t = omp_get_thread_num(), parts = omp_get_num_threads();
    const int64_t split = split_columns ? NB : MB, b0 = split * t / parts, b1 = split * (t + 1) / parts;
    uint16_t* mine = own.data() + t * group * block_words;
    for (int64_t ksb = 0; ksb < KS; ksb += chunk_steps) {
      const int64_t kse = std::min(KS, ksb + chunk_steps), steps = kse - ksb, words = steps * 1024;
      const bool accumulate = ksb > 0 || beta != 0.0f;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < shared_blocks; ++i) {
        if (split_columns) pack_a_block(trans_a, M, K, A, lda, i, ksb, kse, shared.data() + i * words);
        else pack_b_block(trans_b, N, K, B, ldb, i, ksb, kse, shared.data() + i * words);
      }
      for (int64_t g0 = b0; g0 < b1; g0 += group) {
        const int64_t g1 = std::min(b1, g0 + group);
        for (int64_t g = g0; g < g1; ++g) {
          if (split_columns) pack_b_block(trans_b, N, K, B, ldb, g, ksb, kse, mine + (g - g0) * words);
          else pack_a_block(trans_a, M, K, A, lda, g, ksb, kse, mine + (g - g0) * words);
        }
        for (int64_t s = 0; s < shared_blocks; ++s)
          for (int64_t g = g0; g < g1; ++g) {
            const int64_t mb = split_columns ? s : g, nb = split_columns ? g : s;
            const uint16_t* a = (split_columns ? shared.data() + s * words : mine + (g - g0) * words);
            const uint16_t* b = (split_columns ? mine + (g - g0) * words : shared.data() + s * words);
            const int64_t rows = std::min<int64_t>(32, M - mb * 32), width = std::min<int64_t>(32, N - nb * 32);
            float* at = C + mb * 32 * ldc + nb * 32;
            if (!plain) {  // the chunk's product apart, then C = (first chunk: beta·C) + alpha·product
              amx_tiles<2, 2>(0, 16 * steps, 16 * steps, a, 32 * steps, b, 64, nullptr, edge, 32, false);
              const float keep = ksb > 0 ? 1.0f : beta;
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < width; ++c)
                  at[r * ldc + c] = (keep == 0.0f ? 0.0f : keep * at[r * ldc + c]) + alpha * edge[r * 32 + c];
              continue;
            }
            const bool direct = rows == 32 && width == 32;
            if (!direct && accumulate) {
              std::fill_n(edge, 32 * 32, 0.0f);
              for (int64_t r = 0; r < rows; ++r) std::copy_n(at + r * ldc, width, edge + r * 32);
            }
            amx_tiles<2, 2>(0, 16 * steps, 16 * steps, a, 32 * steps, b, 64, nullptr, direct ? at : edge,
                            direct ? ldc : 32, accumulate);
            if (!direct)
              for (int64_t r = 0; r < rows; ++r) std::copy_n(edge + r * 32, width, at + r * ldc);
          }
      }
#pragma omp barrier
    }
  }
}

// Whether amx_product takes this product: on a CPU whose tiles Linux grants, all but a transposed A much wider than B
// (an output head's dW = dlogitsᵀ·x, M = the vocabulary; beta 0 or 1 and alpha 1 there): gathering the transposed
// dlogits and streaming a C that big ran slower than oneDNN (338 against 466 GFLOP/s for the default model's
// head). oneDNN 2.6's AMX matmul is kept from the rest: besides being slower, it dies of SIGILL in its own code on
// some shapes (97 × 40 × 63 with alpha 0.5, any layout, in a fresh process). The packs gather 16 rows at int32 byte
// offsets, so row strides stay below 2^25 elements.
bool amx_takes(bool trans_a, bool trans_b, int64_t M, int64_t N, float alpha, int64_t lda, int64_t ldb, float beta) {
  const bool wide_dw = trans_a && !trans_b && M >= 8 * N && alpha == 1.0f && (beta == 0.0f || beta == 1.0f);
  constexpr int64_t kStride = int64_t{1} << 25;
  return !wide_dw && lda < kStride && ldb < kStride && amx_bf16_ready();
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
  parallel_for(rows, rows * cols > (int64_t{1} << 18),
               [&](int64_t r) { std::copy_n(from + r * from_ld, cols, to + r * to_ld); });
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
#if defined(QKV_AMX)
    if (amx_bf16_ready()) name = "qkv's AMX tiles (TDPBF16PS); " + name + " for output heads' dW";
#endif
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
  if (amx_takes(trans_a, trans_b, M, N, alpha, lda, ldb, beta)) {
    amx_product(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#endif
#if defined(QKV_HAVE_DNNL)
  if (bf16_native() && run_dnnl_dense(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
#endif
  widened(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

bool gemm_bf16_onednn(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                      int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#if defined(QKV_HAVE_DNNL)
  return M > 0 && N > 0 && K > 0 && bf16_native() &&
         run_dnnl_dense(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
  (void)trans_a, (void)trans_b, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda, (void)B, (void)ldb;
  (void)beta, (void)C, (void)ldc;
  return false;
#endif
}

void gemm_bf16_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                         int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  reference_product(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bf16_to_f32_reference);
}

}  // namespace qkv::kernels
