// Fused scaled-dot-product attention, forward and backward, FlashAttention-2 style, on the CPU.
// Not here: the autograd op that wraps it (core/ops_sdpa.cpp) or the plain materialised path
// (nn/attention.cpp), which the tests compare this against.
//
// Blocking. Queries go in blocks of Br rows (48; 64 on AMX tiles), keys in blocks of kBc columns. Per (b, h) each
// thread packs what it streams: Kᵀ in (D × kBc) blocks, V and K row-major padded to Dp = D rounded up to 16
// columns, Q·scale and dO padded to Dp. Every product is then one shape of GEMM, C (M × N) (+)= A (M × K) ·
// B (K × N) with B rows of 16 contiguous floats, done by one register-blocked micro-kernel: 6 × 16 (12 AVX2
// accumulators), or 8 × 32 with AVX-512 (16 accumulators).
//
// bf16 products (options.bf16, AVX512_BF16): the same blocks, ownership and softmax, with bf16 operands and float32
// sums. VDPBF16PS adds a pair of k per lane, so B operands are packed in pair rows (Kᵀ per key block, V and K by
// pairs of keys, Qs and dO by pairs of queries) and A is read a pair at a time; P and dS are rounded once per tile.
// Where the CPU has AMX (amx_bf16_ready), the same packs feed TDPBF16PS tiles: A must then hold k contiguous in its
// rows, so dV and dK are summed transposed (BackwardBf16).
// ForwardF32/ForwardBf16 and BackwardF32/BackwardBf16 hold the packs and products; forward_blocks and
// backward_blocks are written once over them.
//
// Forward, per query block (thread-owned):
//   S = Qs Kᵀ_j (Br × Bc);  m' = max(m, rowmax S);  P = exp(S − m');  l = l·e^(m−m') + rowsum P
//   O = O·e^(m−m') + (P ∘ Z) V_j           (Z: dropout keep / (1 − p), or 1)
//   finally O /= l and lse = m + log l.
// Backward: with Di = rowsum(dO ∘ O), P = exp(S − lse), G = dO Vᵀ_j, dS = P ∘ (G ∘ Z − Di).
// Grouped-query attention: the H / H_kv query heads that read one K/V head are one unit of work in the backward, so
// dK and dV are summed over the group in head order by one owner, and K/V are packed once per group, never copied per
// query head. A sliding window (and the causal diagonal) bound each row's keys to [key_begin, key_end): blocks wholly
// outside are skipped; edge tiles are computed and masked.
//   With at least as many K/V groups as threads, one pass, a whole group per thread: per key block j, each query
//   block i that sees it gives S and G once, then dV_j += (P∘Z)ᵀ dO_i, dK_j += dSᵀ Qs_i and dQ_i += dS K_j into
//   the thread's own dQ buffer for the head — five products per tile.
//   With fewer heads than threads, two passes split a head by blocks, each thread owning what it writes:
//     pass 1, per key block:   dV_j = Σ_i (P∘Z)ᵀ dO_i,  dK_j = Σ_i dSᵀ Qs_i
//     pass 2, per query block: dQ_i = scale · Σ_j dS K_j   (S and G recomputed: seven products per tile)
// Either way no atomics and no reduction across threads: for a given thread count the bits never vary.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <tuple>
#include <utility>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "amx.hpp"
#include "simd.hpp"

#if defined(QKV_AVX512) && defined(__AVX512BF16__)
#define QKV_ATTENTION_BF16 1  // bf16 products (options.bf16): VDPBF16PS micro-kernels
#if defined(QKV_AMX)
#define QKV_ATTENTION_AMX 1  // and AMX tiles where the CPU and the kernel allow them (amx_bf16_ready)
#endif
#endif

namespace qkv::kernels {

namespace {

// Query rows per block (Plan::Br): 48 = 8 strips of the AVX2 6-row micro-kernel, 6 of the 8-row AVX-512 and
// VDPBF16PS ones.
// On AMX tiles 64: the transposed dV and dK products sum over a block's queries, 32 (16 pairs) a tile step, so
// 48 rows padded every such product to 64 with copies of both operands (64 rows: the bf16 backward at (4, 12, 1024,
// 64) 7% / 16% faster on 1 / 2 threads).
constexpr int64_t kBrF32 = 48, kBrAmx = 64, kBrMax = 64;
static_assert(kBrF32 <= kBrMax && kBrAmx <= kBrMax && kBrAmx % 32 == 0);
#ifdef QKV_AVX512
// Keys per block: 4 strips of 32 columns. Twice the AVX2 block: longer runs for the 8 × 32 micro-kernel (the P·V
// product's K), measured (4,12,1024,64) forward 5–13% and full fwd+bwd 5% faster than 64, in one session; the
// (64 × 128) Kᵀ block fits this CPU's 48 KiB L1.
constexpr int64_t kBc = 128;
#else
constexpr int64_t kBc = 64;  // keys per block: 4 strips of 16 columns; the (64 × 64) Kᵀ block fits a 32 KiB L1
#endif
constexpr int kMR = 6, kNR = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A buffer of T (floats, or bf16 bit patterns) aligned to 64 bytes, sized once per call and reused across blocks.
template <typename T>
class ScratchOf {
 public:
  ScratchOf() = default;
  ScratchOf(const ScratchOf&) = delete;
  ScratchOf& operator=(const ScratchOf&) = delete;
  T* get(size_t n) {
    if (n > capacity_) {
      release();
      data_ = static_cast<T*>(memory::allocate_block(n * sizeof(T)));
      if (!data_) throw std::bad_alloc();
      capacity_ = n;
    }
    return data_;
  }
  ~ScratchOf() { release(); }

 private:
  void release() {
    memory::free_block(data_, capacity_ * sizeof(T));
    data_ = nullptr;
    capacity_ = 0;
  }
  T* data_ = nullptr;
  size_t capacity_ = 0;
};
using Scratch = ScratchOf<float>;

// ---- the micro-kernel: C (MR × 16) (+)= A (MR × K) · B (K × 16) ----
// A element (r, k) sits at A[r·lda + k·ak] (ak = 1 for row-major, lda = 1 for a transposed read);
// B row k at B[k·ldb]. One broadcast of A per row and two B vectors per k feed 2·MR FMAs.

#ifdef QKV_AVX2
// The vector operations the micro-kernel needs, for 8 and (with AVX-512) 16 lanes.
struct Avx2Lanes {
  using V = __m256;
  static constexpr int kLanes = 8, kMaxRows = 6;  // 12 accumulators of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V exp(V x) { return simd::exp(x); }
};
#ifdef QKV_AVX512
// 8 rows × 32 columns: the inner loop is 2 loads, 8 broadcasts and 16 FMAs, so the two FMA ports, not the load
// ports, set the pace.
struct Avx512Lanes {
  using V = __m512;
  static constexpr int kLanes = 16, kMaxRows = 8;  // 16 accumulators of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V exp(V x) { return simd::exp(x); }
};
constexpr int kMR512 = Avx512Lanes::kMaxRows;
#endif

// C (MR × 2·lanes) (+)= A (MR × K) · B (K × 2·lanes): two vectors of C per row. Each C element is one FMA chain
// over k in order, so the 8- and 16-lane kernels give the same bits. Accumulators are named variables, not an
// array: GCC keeps an array of vectors on the stack and spills every FMA result (measured: 37% of peak); named
// ones stay in registers.
template <typename L, int MR>
inline void micro_kernel(int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  static_assert(MR >= 1 && MR <= L::kMaxRows && L::kMaxRows <= 8);
  constexpr int W = L::kLanes;
  using V = typename L::V;
  V c00 = L::zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00, c40 = c00,
    c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
#define QKV_ROW(r, x0, x1)                          \
  if constexpr (MR > r) {                           \
    if (accumulate) {                               \
      x0 = L::load(C + r * ldc);                    \
      x1 = L::load(C + r * ldc + W);                \
    }                                               \
  }
  QKV_ROW(0, c00, c01) QKV_ROW(1, c10, c11) QKV_ROW(2, c20, c21) QKV_ROW(3, c30, c31) QKV_ROW(4, c40, c41)
  QKV_ROW(5, c50, c51) QKV_ROW(6, c60, c61) QKV_ROW(7, c70, c71)
#undef QKV_ROW
  const float* a[8];
  for (int r = 0; r < 8; ++r) a[r] = A + (r < MR ? r : 0) * lda;
  for (int64_t k = 0; k < K; ++k) {
    const V b0 = L::load(B);
    const V b1 = L::load(B + W);
    B += ldb;
    V x;
#define QKV_FMA(r, x0, x1)                          \
  if constexpr (MR > r) {                           \
    x = L::broadcast(a[r] + k * ak);                \
    x0 = L::fma(x, b0, x0);                         \
    x1 = L::fma(x, b1, x1);                         \
  }
    QKV_FMA(0, c00, c01) QKV_FMA(1, c10, c11) QKV_FMA(2, c20, c21) QKV_FMA(3, c30, c31) QKV_FMA(4, c40, c41)
    QKV_FMA(5, c50, c51) QKV_FMA(6, c60, c61) QKV_FMA(7, c70, c71)
#undef QKV_FMA
  }
#define QKV_STORE(r, x0, x1)                        \
  if constexpr (MR > r) {                           \
    L::store(C + r * ldc, x0);                      \
    L::store(C + r * ldc + W, x1);                  \
  }
  QKV_STORE(0, c00, c01) QKV_STORE(1, c10, c11) QKV_STORE(2, c20, c21) QKV_STORE(3, c30, c31)
  QKV_STORE(4, c40, c41) QKV_STORE(5, c50, c51) QKV_STORE(6, c60, c61) QKV_STORE(7, c70, c71)
#undef QKV_STORE
}
using Lanes16 = Avx2Lanes;  // 16 columns: two 8-lane vectors
#else
struct PortableLanes {
  static constexpr int kMaxRows = 6;
};
using Lanes16 = PortableLanes;
// Without AVX2: the same 16-column product in plain loops.
template <typename L, int MR>
inline void micro_kernel(int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb, float* C,
                         int64_t ldc, bool accumulate) {
  float acc[MR][kNR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kNR; ++c) acc[r][c] = accumulate ? C[r * ldc + c] : 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k * ak];
      for (int c = 0; c < kNR; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kNR; ++c) C[r * ldc + c] = acc[r][c];
}
#endif


// micro_kernel<L, mr> for a row count known only at run time (1 … L::kMaxRows).
template <typename L, int MR = L::kMaxRows>
inline void micro_kernel_rows(int mr, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb,
                              float* C, int64_t ldc, bool accumulate) {
  if constexpr (MR >= 1) {
    if (mr == MR) return micro_kernel<L, MR>(K, A, lda, ak, B, ldb, C, ldc, accumulate);
    micro_kernel_rows<L, MR - 1>(mr, K, A, lda, ak, B, ldb, C, ldc, accumulate);
  }
}

// The causal triangle inside one (query block × key block) tile: local query row r may see local key
// column c iff c < r + diag. Products whose result or inputs are zero outside it skip that part, at the
// granularity of the micro-kernel (6 rows, 16 columns), so diagonal tiles cost about half.
enum class Trim {
  None,
  Columns,   // C = S-like (rows = queries, columns = keys): compute only columns < last row's limit
  KEnd,      // C rows = queries, K = keys (P·V, dS·K): the sum stops at the last row's limit
  KBegin,    // C rows = keys, K = queries (Pᵀ·dO, dSᵀ·Q): the sum starts at the first query that sees them
};

// What one strip of a trimmed product computes: rows m0 .. m0 + mr, columns n0 .. n0 + width, the sum over
// [k_begin, k_end) of K; `skip` when nothing in it is visible. With a sliding window W (> 0) the band has a lower
// edge too: local key c is visible to local row r only if also c ≥ r + diag − W.
struct StripRange {
  bool skip = false;
  int64_t k_begin = 0, k_end = 0;
};
StripRange strip_range(Trim trim, int64_t m0, int mr, int64_t n0, int64_t width, int64_t K, int64_t diag,
                       int64_t window) {
  StripRange r{false, 0, K};
  switch (trim) {
    case Trim::None:
      break;
    case Trim::Columns:
      r.skip = n0 >= m0 + mr - 1 + diag || (window > 0 && n0 + width <= m0 + diag - window);
      break;
    case Trim::KEnd:
      r.k_end = std::clamp<int64_t>(m0 + mr - 1 + diag, 0, K);
      if (window > 0) r.k_begin = std::clamp<int64_t>(m0 + diag - window, 0, K);  // the first row's oldest key
      break;
    case Trim::KBegin:
      r.k_begin = std::clamp<int64_t>(m0 - diag + 1, 0, K);
      if (window > 0) r.k_end = std::clamp<int64_t>(m0 + mr - diag + window, 0, K);  // the last query that sees the last key
      break;
  }
  return r;
}

// Calls strip(mr, m0, n0, width) over C (M × N), N a multiple of 16: strips of 32 columns (with AVX-512) and 16, rows
// in runs of `rows_wide` (32-column strips) and kMR (16-column strips), the last run of each shorter.
template <typename Strip>
void for_each_strip(int64_t M, int64_t N, [[maybe_unused]] int rows_wide, Strip&& strip) {
  int64_t n0 = 0;
#ifdef QKV_AVX512
  for (; n0 + 2 * kNR <= N; n0 += 2 * kNR) {
    int64_t m0 = 0;
    for (; m0 + rows_wide <= M; m0 += rows_wide) strip(rows_wide, m0, n0, 2 * kNR);
    if (m0 < M) strip(static_cast<int>(M - m0), m0, n0, 2 * kNR);
  }
#endif
  for (; n0 < N; n0 += kNR) {
    int64_t m0 = 0;
    for (; m0 + kMR <= M; m0 += kMR) strip(kMR, m0, n0, kNR);
    if (m0 < M) strip(static_cast<int>(M - m0), m0, n0, kNR);
  }
}

// C (M × N) (+)= A (M × K) · B (K × N); N a multiple of 16. A has row stride lda and column stride ak. The trims
// skip what lies in the future of a row (and, with a window, before it).
void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb,
                float* C, int64_t ldc, bool accumulate, Trim trim = Trim::None, int64_t diag = 0, int64_t window = 0) {
#ifdef QKV_AVX512
  constexpr int rows_wide = kMR512;
#else
  constexpr int rows_wide = kMR;
#endif
  for_each_strip(M, N, rows_wide, [&](int mr, int64_t m0, int64_t n0, int64_t width) {
    const StripRange range = strip_range(trim, m0, mr, n0, width, K, diag, window);
    if (range.skip) {
      if (!accumulate)  // nothing visible here: the caller reads only visible columns, but keep C defined
        for (int r = 0; r < mr; ++r) std::fill_n(C + (m0 + r) * ldc + n0, width, 0.0f);
      return;
    }
    const float* a = A + m0 * lda + range.k_begin * ak;
    const float* b = B + range.k_begin * ldb + n0;
    float* c = C + m0 * ldc + n0;
    const int64_t k = std::max<int64_t>(range.k_end - range.k_begin, 0);
#ifdef QKV_AVX512
    if (width == 32) return micro_kernel_rows<Avx512Lanes>(mr, k, a, lda, ak, b, ldb, c, ldc, accumulate);
#endif
    micro_kernel_rows<Lanes16>(mr, k, a, lda, ak, b, ldb, c, ldc, accumulate);
  });
}

#ifdef QKV_ATTENTION_BF16
// ---- bf16 products (VDPBF16PS): C (float32) (+)= A · B with bf16 operands ----
// VDPBF16PS adds to each float lane the products of one pair of k: c[n] += a[2kk]·b[2kk][n] + a[2kk+1]·b[2kk+1][n].
// So A is read a pair at a time (row r's pair kk is the 32-bit word at A + r·lda + 2·kk: k contiguous in A's rows)
// and B is packed in pair rows (pair row kk holds (b[2kk][n], b[2kk+1][n]) for every column n, ldb bf16 apart).
// K is even, and every operand is zero beyond its valid part, so a sum that runs one k too far adds 0 · 0.

// C (MR × 16·NV) (+)= A (MR × 2·KK) · B (2·KK × 16·NV). The same shape as the float kernel (8 × 32 with 16 named
// accumulators), each instruction taking two k. A's pair kk of row r is at A + r·lda + kk·ak2 (ak2 = 2: rows with k
// contiguous; a tile in pair rows is read transposed with lda = 2, ak2 = 2·its width).
template <int MR, int NV>
inline void micro_kernel_bf16(int64_t KK, const uint16_t* A, int64_t lda, int64_t ak2, const uint16_t* B, int64_t ldb,
                              float* C, int64_t ldc, bool accumulate) {
  static_assert(MR >= 1 && MR <= 8 && (NV == 1 || NV == 2));
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
#define QKV_ROW(r, x0, x1)                                     \
  if constexpr (MR > r) {                                      \
    if (accumulate) {                                          \
      x0 = _mm512_loadu_ps(C + r * ldc);                       \
      if constexpr (NV == 2) x1 = _mm512_loadu_ps(C + r * ldc + 16); \
    }                                                          \
  }
  QKV_ROW(0, c00, c01) QKV_ROW(1, c10, c11) QKV_ROW(2, c20, c21) QKV_ROW(3, c30, c31) QKV_ROW(4, c40, c41)
  QKV_ROW(5, c50, c51) QKV_ROW(6, c60, c61) QKV_ROW(7, c70, c71)
#undef QKV_ROW
  const uint16_t* a[8];
  for (int r = 0; r < 8; ++r) a[r] = A + (r < MR ? r : 0) * lda;
  for (int64_t kk = 0; kk < KK; ++kk) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(B));
    const __m512bh b1 = NV == 2 ? reinterpret_cast<__m512bh>(_mm512_loadu_si512(B + 32)) : b0;
    B += ldb;
    __m512bh x;
#define QKV_DOT(r, x0, x1)                                                \
  if constexpr (MR > r) {                                                 \
    int32_t pair;                                                         \
    std::memcpy(&pair, a[r] + kk * ak2, sizeof pair);                     \
    x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));              \
    x0 = _mm512_dpbf16_ps(x0, x, b0);                                     \
    if constexpr (NV == 2) x1 = _mm512_dpbf16_ps(x1, x, b1);              \
  }
    QKV_DOT(0, c00, c01) QKV_DOT(1, c10, c11) QKV_DOT(2, c20, c21) QKV_DOT(3, c30, c31) QKV_DOT(4, c40, c41)
    QKV_DOT(5, c50, c51) QKV_DOT(6, c60, c61) QKV_DOT(7, c70, c71)
#undef QKV_DOT
  }
#define QKV_STORE(r, x0, x1)                                   \
  if constexpr (MR > r) {                                      \
    _mm512_storeu_ps(C + r * ldc, x0);                         \
    if constexpr (NV == 2) _mm512_storeu_ps(C + r * ldc + 16, x1); \
  }
  QKV_STORE(0, c00, c01) QKV_STORE(1, c10, c11) QKV_STORE(2, c20, c21) QKV_STORE(3, c30, c31)
  QKV_STORE(4, c40, c41) QKV_STORE(5, c50, c51) QKV_STORE(6, c60, c61) QKV_STORE(7, c70, c71)
#undef QKV_STORE
}

template <int NV, int MR = 8>
inline void micro_kernel_bf16_rows(int mr, int64_t KK, const uint16_t* A, int64_t lda, int64_t ak2, const uint16_t* B,
                                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if constexpr (MR >= 1) {
    if (mr == MR) return micro_kernel_bf16<MR, NV>(KK, A, lda, ak2, B, ldb, C, ldc, accumulate);
    micro_kernel_bf16_rows<NV, MR - 1>(mr, KK, A, lda, ak2, B, ldb, C, ldc, accumulate);
  }
}

#ifdef QKV_ATTENTION_AMX
void block_gemm_amx(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                    float* C, int64_t ldc, bool accumulate, Trim trim, int64_t diag, int64_t window);
#endif

// C (M × N) (+)= A (M × K) · B (K × N) with bf16 operands as above (K even, N a multiple of 16; A's pairs ak2 apart)
// and the float kernel's trims, each strip's k range widened to whole pairs.
void block_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, int64_t ak2, const uint16_t* B,
                     int64_t ldb, float* C, int64_t ldc, bool accumulate, Trim trim = Trim::None, int64_t diag = 0,
                     int64_t window = 0) {
#ifdef QKV_ATTENTION_AMX
  if (ak2 == 2 && amx_bf16_ready()) return block_gemm_amx(M, N, K, A, lda, B, ldb, C, ldc, accumulate, trim, diag, window);
#endif
  for_each_strip(M, N, 8, [&](int mr, int64_t m0, int64_t n0, int64_t width) {
    const StripRange range = strip_range(trim, m0, mr, n0, width, K, diag, window);
    if (range.skip) {
      if (!accumulate)
        for (int r = 0; r < mr; ++r) std::fill_n(C + (m0 + r) * ldc + n0, width, 0.0f);
      return;
    }
    const int64_t kk_begin = range.k_begin / 2, kk_end = std::max((range.k_end + 1) / 2, kk_begin);
    const uint16_t* a = A + m0 * lda + kk_begin * ak2;
    const uint16_t* b = B + kk_begin * ldb + 2 * n0;
    float* c = C + m0 * ldc + n0;
    if (width == 32) return micro_kernel_bf16_rows<2>(mr, kk_end - kk_begin, a, lda, ak2, b, ldb, c, ldc, accumulate);
    micro_kernel_bf16_rows<1>(mr, kk_end - kk_begin, a, lda, ak2, b, ldb, c, ldc, accumulate);
  });
}

#ifdef QKV_ATTENTION_AMX
// ---- bf16 products on AMX tiles (Intel Sapphire Rapids and later) ----
// TDPBF16PS multiplies a 16 × 32 bf16 tile of A (rows with k contiguous, 64 bytes each) by a 16-pair-row tile of B
// in the same pair rows as VDPBF16PS reads (16 columns × 2 k, 64 bytes each) into a 16 × 16 float32 tile: 16,384
// flops an instruction. On a Xeon whose VDPBF16PS runs at half its FMA rate, the only way bf16 beats float32 here.
// The tile state is asked of Linux once per process (amx_bf16_ready).

// The tiles: Tiles and amx_tiles (amx.hpp).

// block_gemm_bf16 for A with k contiguous in its rows (ak2 = 2), on tiles. Blocks of 32 × 32 (16 at the edges); the
// trims are widened to whole steps of 16 pairs (what they skip is zero or masked, never needed). Rows past M and
// pairs past K/2 are never read: A is copied zero-padded when M or K/2 is not a multiple of 16, B's last partial
// step per strip, and a block with rows past M goes through a float tile.
void block_gemm_amx(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                    float* C, int64_t ldc, bool accumulate, Trim trim, int64_t diag, int64_t window) {
  thread_local ScratchOf<uint16_t> a_pad, b_pad;
  thread_local ScratchOf<float> c_pad;
  const int64_t KK = K / 2, Mp = round_up(M, 16), KKp = round_up(KK, 16);
  const uint16_t* a = A;
  int64_t la = lda;
  if (Mp != M || KKp != KK) {
    uint16_t* dst = a_pad.get(static_cast<size_t>(Mp * 2 * KKp));
    for (int64_t m = 0; m < Mp; ++m) {
      uint16_t* row = dst + m * 2 * KKp;
      if (m < M) std::copy_n(A + m * lda, 2 * KK, row);
      std::fill(row + (m < M ? 2 * KK : 0), row + 2 * KKp, uint16_t{0});
    }
    a = dst;
    la = 2 * KKp;
  }
  uint16_t* b_last = b_pad.get(16 * 64);
  float* c_tile = c_pad.get(32 * 32);
  const Tiles tiles;
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int64_t width = std::min<int64_t>(32, N - n0);
    const uint16_t* b = B + 2 * n0;
    if (KKp != KK) {  // the last step's pair rows of this strip, zero beyond KK
      std::fill_n(b_last, 16 * 64, uint16_t{0});
      for (int64_t kk = KKp - 16; kk < KK; ++kk) std::copy_n(b + kk * ldb, 2 * width, b_last + (kk - (KKp - 16)) * 64);
    }
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const int64_t height = std::min<int64_t>(32, Mp - m0), rows = std::min(height, M - m0);
      const StripRange range = strip_range(trim, m0, static_cast<int>(rows), n0, width, K, diag, window);
      const int64_t kb = range.k_begin / 2 / 16 * 16, ke = std::min(round_up((range.k_end + 1) / 2, 16), KKp);
      float* c = C + m0 * ldc + n0;
      if (range.skip || ke <= kb) {
        if (!accumulate)
          for (int64_t r = 0; r < rows; ++r) std::fill_n(c + r * ldc, width, 0.0f);
        continue;
      }
      const bool direct = rows == height;  // else through c_tile (32 × 32), rows past M dropped
      float* cc = direct ? c : c_tile;
      const int64_t lc = direct ? ldc : 32;
      if (!direct && accumulate) {
        std::fill_n(c_tile, 32 * 32, 0.0f);
        for (int64_t r = 0; r < rows; ++r) std::copy_n(c + r * ldc, width, c_tile + r * 32);
      }
      const uint16_t* ar = a + m0 * la;
      if (height == 32 && width == 32) amx_tiles<2, 2>(kb, ke, KK, ar, la, b, ldb, b_last, cc, lc, accumulate);
      else if (height == 32) amx_tiles<2, 1>(kb, ke, KK, ar, la, b, ldb, b_last, cc, lc, accumulate);
      else if (width == 32) amx_tiles<1, 2>(kb, ke, KK, ar, la, b, ldb, b_last, cc, lc, accumulate);
      else amx_tiles<1, 1>(kb, ke, KK, ar, la, b, ldb, b_last, cc, lc, accumulate);
      if (!direct)
        for (int64_t r = 0; r < rows; ++r) std::copy_n(c_tile + r * 32, width, c + r * ldc);
    }
  }
}
#endif

// Conversions into the products' layouts, rounding to nearest even (VCVTNE2PS2BF16: NaN stays NaN; float32
// denormals become zero, which at bf16's 8-bit mantissa is below its own rounding error).
// dst[j] = bf16(src[j] · factor) for j < n, zero for n ≤ j < n_pad.
void to_bf16_scaled(const float* src, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + j), f));
    _mm256_mask_storeu_epi16(dst + j, m, reinterpret_cast<__m256i>(h));
  }
  std::fill(dst + n, dst + n_pad, uint16_t{0});
}

// One pair row: dst[2j] = bf16(r0[j] · factor), dst[2j + 1] = bf16(r1[j] · factor) for j < n (r1 null: zeros),
// zero pairs for n ≤ j < n_pad.
// Words 0…15 and 16…31 of a vector of 32 bf16, interleaved: (0, 16, 1, 17, …)
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Stores the 32 bf16 of `both` (values j… of row 0 in its low half, of row 1 in its high half) as pairs at dst + 2j,
// only the first `left` pairs when fewer than 16 are left.
void store_pairs(__m512i both, int64_t j, int64_t left, uint16_t* dst) {
  const __mmask32 keep = left >= 16 ? ~__mmask32(0) : static_cast<__mmask32>((uint64_t{1} << (2 * left)) - 1);
  _mm512_mask_storeu_epi16(dst + 2 * j, keep, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both));
}

void interleave_bf16(const float* r0, const float* r1, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r0 + j), f);
    const __m512 x1 = r1 ? _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r1 + j), f) : _mm512_setzero_ps();
    store_pairs(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)), j, n - j, dst);  // x0 in the low half
  }
  std::fill(dst + 2 * n, dst + 2 * n_pad, uint16_t{0});
}

// The same from values already in bf16 (a bf16 KV cache): copied, zero-padded (factor must be 1).
void to_bf16_scaled(const uint16_t* src, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  static_cast<void>(factor);
  std::copy_n(src, n, dst);
  std::fill(dst + n, dst + n_pad, uint16_t{0});
}
void interleave_bf16(const uint16_t* r0, const uint16_t* r1, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  static_cast<void>(factor);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256i x0 = _mm256_maskz_loadu_epi16(m, r0 + j);
    const __m256i x1 = r1 ? _mm256_maskz_loadu_epi16(m, r1 + j) : _mm256_setzero_si256();
    store_pairs(_mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1), j, n - j, dst);
  }
  std::fill(dst + 2 * n, dst + 2 * n_pad, uint16_t{0});
}

// y[j] = bf16(exp(x[j] − shift)) for lo ≤ j < hi, 0 elsewhere below n; returns the float32 Σ exp (lanes of 16
// summed in order, then across lanes).
float exp_to_bf16(const float* x, uint16_t* y, int64_t lo, int64_t hi, int64_t n, float shift) {
  std::fill(y, y + std::min(lo, n), uint16_t{0});
  std::fill(y + std::max(hi, lo), y + n, uint16_t{0});
  if (hi <= lo) return 0.0f;
  const __m512 s16 = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = lo; j < hi; j += 16) {
    const __mmask16 m = hi - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (hi - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s16)));
    sum = _mm512_add_ps(sum, e);
    _mm256_mask_storeu_epi16(y + j, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return simd::reduce_add(sum);
}

// Σ bf16(a[j]) · b[j] over j < n, in float32.
float dot_rounded_bf16(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + j)));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    sum = _mm512_fmadd_ps(rounded, _mm512_maskz_loadu_ps(m, b + j), sum);
  }
  return simd::reduce_add(sum);
}
#endif

#ifdef QKV_AVX2
// The vector part of probabilities_and_dscores_row in L's lanes, from j on; returns where it stopped.
template <typename L>
int64_t probabilities_and_dscores_lanes(float* p, float* g, int64_t j, int64_t valid, float lse, float di) {
  const typename L::V l = L::set1(lse), d = L::set1(di);
  for (; j + L::kLanes <= valid; j += L::kLanes) {
    const typename L::V e = L::exp(L::sub(L::load(p + j), l));
    L::store(p + j, e);
    L::store(g + j, L::mul(e, L::sub(L::load(g + j), d)));
  }
  return j;
}
#endif

// Without dropout, one pass per row of a backward tile: p[j] = exp(p[j] − lse) (S in, P out) and
// g[j] = p[j]·(g[j] − di) (dO·Vᵀ in, dS out) for j < valid; both 0 from valid to n.
void probabilities_and_dscores_row(float* p, float* g, int64_t valid, int64_t n, float lse, float di) {
  int64_t j = 0;
#ifdef QKV_AVX512
  j = probabilities_and_dscores_lanes<Avx512Lanes>(p, g, j, valid, lse, di);
#endif
#ifdef QKV_AVX2
  j = probabilities_and_dscores_lanes<Avx2Lanes>(p, g, j, valid, lse, di);
#endif
  for (; j < valid; ++j) {
    p[j] = simd::exp_flushed(p[j] - lse);
    g[j] = p[j] * (g[j] - di);
  }
  std::fill(p + valid, p + n, 0.0f);
  std::fill(g + valid, g + n, 0.0f);
}

float row_max(const float* x, int64_t n) {
  float m = kNegInf;
  int64_t j = 0;
#ifdef QKV_AVX512
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (j = 16; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + j));
    m = _mm512_reduce_max_ps(v);
  }
#elif defined(QKV_AVX2)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float l : lanes) m = std::max(m, l);
  }
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// dst[i] = src[i] · factor. Restrict-qualified so GCC vectorises it: with a Plan's scale read through a
// reference, a plain loop reloads it after every store (measured: 10% of the forward pass, scalar).
void scaled_copy(const float* __restrict src, float* __restrict dst, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

void scale_row(float* x, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// ---- dropout: a counter-based stream ----
// The decision for weight (bh, i, j) is a pure function of (seed, bh, i, j): murmur3's 32-bit finalizer
// over a per-row key and the column. The backward pass regenerates the mask instead of storing it, and 8
// decisions cost a handful of AVX2 instructions.

uint32_t dropout_row_key(uint64_t seed, int64_t bh, int64_t i) {
  const uint32_t key = simd::mix32(static_cast<uint32_t>(seed) ^ simd::mix32(static_cast<uint32_t>(seed >> 32) + 0x9E3779B9u));
  const uint32_t row = simd::mix32(static_cast<uint32_t>(bh) * 0x85ebca6bu ^ simd::mix32(static_cast<uint32_t>(i) + 0x27d4eb2fu) ^
                                   static_cast<uint32_t>(static_cast<uint64_t>(bh) >> 32));
  return simd::mix32(key ^ row);
}

// z[j] *= keep(bh, i, j0 + j) / (1 − p) for j < n.
void apply_dropout_row(float* z, int64_t n, uint64_t seed, uint32_t threshold, float inv_keep, int64_t bh, int64_t i,
                       int64_t j0) {
  simd::apply_keep(z, z, n, dropout_row_key(seed, bh, i), static_cast<uint32_t>(j0), threshold, inv_keep, false);
}

// ---- per-call setup shared by forward and backward ----

// Plan::Br for these options: whole tile steps where bf16 products run on AMX tiles.
int64_t query_block_rows(const AttentionOptions& o) {
#ifdef QKV_ATTENTION_AMX
  if (o.bf16 && attention_bf16_available() && amx_bf16_ready()) return kBrAmx;
#endif
  static_cast<void>(o);
  return kBrF32;
}

struct Plan {
  AttentionDims dims;
  AttentionLayout layout;
  AttentionOptions options;
  float scale, softcap;
  int64_t Br;                                                  // query rows per block (query_block_rows)
  int64_t Dp, Tk_pad, Tq_pad, q_blocks, k_blocks, offset;  // offset = Tk − Tq (causal diagonal shift)
  int64_t kv_heads, group;                                 // K/V heads, query heads per K/V head
  bool dropout;
  uint32_t threshold;
  float inv_keep;

  Plan(const AttentionDims& d, const AttentionLayout& l, const AttentionOptions& o) : dims(d), layout(l), options(o) {
    scale = o.scale != 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(d.D, 1)));
    softcap = o.softcap > 0.0f ? o.softcap : 0.0f;
    Dp = round_up(std::max<int64_t>(d.D, 1), kNR);
    Tk_pad = round_up(std::max<int64_t>(d.Tk, 1), kBc);
    Br = query_block_rows(o);
    Tq_pad = round_up(std::max<int64_t>(d.Tq, 1), Br);
    q_blocks = (d.Tq + Br - 1) / Br;
    k_blocks = (d.Tk + kBc - 1) / kBc;
    offset = d.Tk - d.Tq;
    kv_heads = d.kv_heads();
    group = std::max<int64_t>(d.H / std::max<int64_t>(kv_heads, 1), 1);
    dropout = o.dropout_p > 0.0f;
    threshold = simd::drop_threshold(o.dropout_p);
    inv_keep = o.dropout_p < 1.0f ? 1.0f / (1.0f - o.dropout_p) : 0.0f;
  }
  int threads() const { return options.threads > 0 ? options.threads : omp_get_max_threads(); }
  // The window the products' trims may use: only with the causal mask, whose diagonal they are relative to.
  int64_t band() const { return options.causal ? options.window : 0; }
  // Query row i (absolute) sees keys [key_begin(i), key_end(i)). Both are non-decreasing in i.
  int64_t key_end(int64_t i) const {
    return options.causal ? std::clamp<int64_t>(i + offset + 1, 0, dims.Tk) : dims.Tk;
  }
  int64_t key_begin(int64_t i) const {
    return options.window > 0 ? std::clamp<int64_t>(i + offset - options.window + 1, 0, dims.Tk) : 0;
  }
  int64_t visible(int64_t i) const { return std::max<int64_t>(key_end(i) - key_begin(i), 0); }
  // Key j is seen by query rows [query_begin(j), query_end(j)).
  int64_t query_begin(int64_t j) const { return options.causal ? std::clamp<int64_t>(j - offset, 0, dims.Tq) : 0; }
  int64_t query_end(int64_t j) const {
    return options.window > 0 ? std::clamp<int64_t>(j - offset + options.window, 0, dims.Tq) : dims.Tq;
  }
  // The first key block any of the rows [q0, q0 + rows) sees, and the end of the keys any of them sees.
  int64_t first_key_block(int64_t q0) const { return key_begin(q0) / kBc * kBc; }
  // Query heads are bh = b·H + h; K/V heads bkv = b·H_kv + h_kv. Head h reads K/V head h / group.
  int64_t kv_of(int64_t bh) const { return (bh / dims.H) * kv_heads + (bh % dims.H) / group; }
  int64_t query_head(int64_t bkv, int64_t g) const { return (bkv / kv_heads) * dims.H + (bkv % kv_heads) * group + g; }
  const float* row(const float* base, const AttentionStrides& s, int64_t bh, int64_t t) const {
    return base + (bh / dims.H) * s.batch + (bh % dims.H) * s.head + t * s.token;
  }
  float* row(float* base, const AttentionStrides& s, int64_t bh, int64_t t) const {
    return base + (bh / dims.H) * s.batch + (bh % dims.H) * s.head + t * s.token;
  }
  // K/V rows, float32 or (a bf16 KV cache) bf16
  template <typename T>
  const T* kv_row(const T* base, const AttentionStrides& s, int64_t bkv, int64_t t) const {
    return base + (bkv / kv_heads) * s.batch + (bkv % kv_heads) * s.head + t * s.token;
  }
  float* kv_row(float* base, const AttentionStrides& s, int64_t bkv, int64_t t) const {
    return base + (bkv / kv_heads) * s.batch + (bkv % kv_heads) * s.head + t * s.token;
  }
  // The elements a strided tensor of `heads` heads × T tokens spans from its first: where a copy of it must reach.
  int64_t extent(const AttentionStrides& s, int64_t heads, int64_t T) const {
    if (dims.B <= 0 || heads <= 0 || T <= 0 || dims.D <= 0) return 0;
    return (dims.B - 1) * s.batch + (heads - 1) * s.head + (T - 1) * s.token + dims.D;
  }
  // Soft-capping of a row's visible scores [lo, hi), in place: s = cap·tanh(s / cap).
  void cap_scores(float* s, int64_t lo, int64_t hi) const {
    if (softcap == 0.0f) return;
    const float inv = 1.0f / softcap;
    for (int64_t j = lo; j < hi; ++j) s[j] = softcap * std::tanh(s[j] * inv);
  }
  // The visible part of key block k0 (cols keys) for query row i: local columns [lo, hi), empty when hi ≤ lo.
  std::pair<int64_t, int64_t> visible_in_block(int64_t i, int64_t k0, int64_t cols) const {
    return {std::clamp<int64_t>(key_begin(i) - k0, 0, cols), std::clamp<int64_t>(key_end(i) - k0, 0, cols)};
  }
};

// y[j] = exp(x[j] − shift) for lo ≤ j < hi, 0 elsewhere below n (x and y may alias); returns Σ y.
float exp_range(const float* x, float* y, int64_t lo, int64_t hi, int64_t n, float shift) {
  if (hi <= lo) {
    std::fill(y, y + n, 0.0f);
    return 0.0f;
  }
  const float total = simd::exp_shifted_sum(x + lo, y + lo, hi - lo, shift);
  std::fill(y, y + lo, 0.0f);
  std::fill(y + hi, y + n, 0.0f);
  return total;
}

// A head's rows lie `token` floats apart (H·D in the (B, T, H·D) layout: 3 KiB at GPT-2's shape), a stride the
// hardware prefetcher does not follow, so a pack waited on every row it read (on AMX, 85% of a bf16 K pack's samples
// sat on its row loads and the packs were 18% of a forward + backward). The packs ask for the row kRowsAhead rows on.
constexpr int64_t kRowsAhead = 8;
template <typename Src>
[[gnu::always_inline]] inline void prefetch_row(const Src* first, int64_t token, int64_t t, int64_t T, int64_t n) {
  if (t < T) simd::prefetch(first + t * token, n * static_cast<int64_t>(sizeof(Src)));
}

// Kᵀ of one head, key block by key block: block j is (D × kBc) contiguous, zero beyond Tk. `first` is the head's
// token 0 and `token` its token stride. Whole-head (D × Tk) rows would put the D rows a block reads a multiple of
// 4 KiB apart — one L1 set for all of them. Tokens go 16 at a time: their rows stay in L1 while each of the D output
// rows gets 16 contiguous floats (a token-by-token loop scatters every token over D lines: measured 2.3 ns per
// float, 5% of a pass).
void pack_transposed(const Plan& p, const float* first, int64_t token, float* dst) {
  constexpr int64_t kTile = 16;
  const int64_t D = p.dims.D, T = p.dims.Tk;
  for (int64_t k0 = 0; k0 < p.Tk_pad; k0 += kBc) {
    float* block = dst + k0 * D;  // (k0 / kBc) · D · kBc
    const int64_t cols = std::clamp<int64_t>(T - k0, 0, kBc);
    for (int64_t t0 = 0; t0 < cols; t0 += kTile) {
      const int64_t n = std::min(kTile, cols - t0);
      const float* rows[kTile];
      for (int64_t t = 0; t < n; ++t) rows[t] = first + (k0 + t0 + t) * token;
      for (int64_t t = 0; t < n; ++t) prefetch_row(first, token, k0 + t0 + kTile + t, T, D);
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < n; ++t) block[d * kBc + t0 + t] = rows[t][d];
    }
    for (int64_t d = 0; d < D; ++d) std::fill(block + d * kBc + cols, block + (d + 1) * kBc, 0.0f);
  }
}

// Rows of one head (token 0 at `first`, token stride `token`): (rows_pad × Dp), values · factor, zero in the padding.
void pack_rows(const Plan& p, const float* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
               float* dst) {
  const int64_t D = p.dims.D, ld = p.Dp;
  for (int64_t t = 0; t < T; ++t) {
    prefetch_row(first, token, t + kRowsAhead, T, D);
    scaled_copy(first + t * token, dst + t * ld, D, factor);
    std::fill(dst + t * ld + D, dst + (t + 1) * ld, 0.0f);
  }
  std::fill(dst + T * ld, dst + rows_pad * ld, 0.0f);
}

// One Workspace per thread, every buffer at its full size before the threads start (each Workspace has
// reserve(plan, args…)). What a call holds is then the same whatever the schedule, so once the block cache has
// seen one call, later calls take nothing fresh from the system, with any number of threads; and nothing is held
// between calls or allocated inside the block loops.
template <typename Workspace, typename... Args>
std::vector<Workspace> workspaces(int threads, const Plan& p, Args... args) {
  std::vector<Workspace> all(static_cast<size_t>(std::max(threads, 1)));
  for (Workspace& w : all) w.reserve(p, args...);
  return all;
}

// Items are (head, block) pairs ordered head-major. With many heads per thread, each thread takes one contiguous
// run of items, so it packs each of its heads once (a cyclic schedule would have every thread pack every head:
// at T = 256, 6 query blocks a head, that was a fifth of a two-thread forward); the runs mix early and late blocks
// alike, so causal work balances. With few heads, items go round-robin, so each thread still sees each head as one
// run and causal work (more keys for later blocks) balances.
template <typename Workspace, typename F>
void parallel_items(std::vector<Workspace>& spaces, int64_t heads, int64_t blocks, F&& body) {
  const int64_t items = heads * blocks;
#pragma omp parallel num_threads(static_cast<int>(spaces.size()))
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    Workspace& workspace = spaces[static_cast<size_t>(t)];
    int64_t packed_head = -1;
    auto run = [&](int64_t item) {
      const int64_t bh = item / blocks;
      body(workspace, bh, item % blocks, bh != packed_head);
      packed_head = bh;
    };
    if (heads >= 4 * n) {
      for (int64_t item = items * t / n; item < items * (t + 1) / n; ++item) run(item);
    } else {
      for (int64_t item = t; item < items; item += n) run(item);
    }
  }
}

}  // namespace

const char* attention_isa() {
#if defined(QKV_AVX512)
  return "avx512f";
#elif defined(QKV_AVX2)
  return "avx2+fma";
#else
  return "portable";
#endif
}

bool attention_dropout_keep(uint64_t seed, float p, int64_t bh, int64_t i, int64_t j) {
  if (p <= 0.0f) return true;
  return simd::keep_hash(dropout_row_key(seed, bh, i), static_cast<uint32_t>(j)) >= simd::drop_threshold(p);
}

namespace {

// The forward's packs and its two products per (query block × key block), in float32: S = Qs Kᵀ_j from Kᵀ in
// (D × kBc) blocks, and O += P V_j from V's rows padded to Dp.
struct ForwardF32 {
  Scratch kt_buf, v_buf, q_buf;
  float *kt = nullptr, *vp = nullptr, *qs = nullptr;
  void reserve(const Plan& p) {
    kt = kt_buf.get(static_cast<size_t>(p.dims.D * p.Tk_pad));
    vp = v_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
    qs = q_buf.get(static_cast<size_t>(p.Br * p.Dp));
  }
  void pack_kv(const Plan& p, const float* k, const float* v, int64_t bkv) {
    pack_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, kt);
    pack_rows(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, p.dims.Tk, p.Tk_pad, 1.0f, vp);
  }
  void pack_queries(const Plan& p, const float* q, int64_t bh, int64_t q0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) scaled_copy(p.row(q, p.layout.q, bh, q0 + r), qs + r * p.Dp, p.dims.D, p.scale);
  }
  void scores(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, float* s, Trim trim, int64_t diag) {
    block_gemm(rows, cols_pad, p.dims.D, qs, p.Dp, 1, kt + k0 * p.dims.D, kBc, s, kBc, false, trim, diag, p.band());
  }
  // Row r of the tile: P = exp(S − m) on the visible columns [lo, hi), 0 elsewhere, then dropout's Z; returns Σ P
  // before dropout. A row with nothing visible is all 0.
  float exp_row(const Plan& p, float* sr, int64_t r, int64_t lo, int64_t hi, int64_t cols_pad, float m, int64_t bh,
                int64_t i, int64_t k0) {
    static_cast<void>(r);
    const float sum = exp_range(sr, sr, lo, hi, cols_pad, m);
    if (p.dropout && hi > lo) apply_dropout_row(sr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);
    return sum;
  }
  void add_values(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, const float* s, float* acc, Trim trim,
                  int64_t diag) {
    block_gemm(rows, p.Dp, cols_pad, s, kBc, 1, vp + k0 * p.Dp, p.Dp, acc, p.Dp, true, trim, diag, p.band());
  }
};

#ifdef QKV_ATTENTION_BF16
// De: D rounded up to a whole pair, the sum length of the products over the head width.
int64_t pair_width(const Plan& p) { return round_up(p.dims.D, 2); }

// Kᵀ (or Vᵀ) of one head as bf16 pair rows, key block by key block: block j holds De/2 pair rows of kBc words,
// word (dd, c) = (x[k0 + c][2dd], x[k0 + c][2dd + 1]); zero beyond Tk and D. Tokens go 16 at a time through `tile`.
template <typename Src>
void pack_pairs_transposed(const Plan& p, const Src* first, int64_t token, ScratchOf<uint16_t>& tile, uint16_t* dst) {
  constexpr int64_t kTile = 16;
  const int64_t D = p.dims.D, T = p.dims.Tk, De = pair_width(p), pairs = De / 2;
  uint16_t* rows = tile.get(static_cast<size_t>(kTile * De));
  for (int64_t k0 = 0; k0 < p.Tk_pad; k0 += kBc) {
    uint16_t* block = dst + k0 * De;
    const int64_t cols = std::clamp<int64_t>(T - k0, 0, kBc);
    for (int64_t t0 = 0; t0 < cols; t0 += kTile) {
      const int64_t n = std::min(kTile, cols - t0);
      for (int64_t t = 0; t < n; ++t) {
        prefetch_row(first, token, k0 + t0 + kTile + t, T, D);
        to_bf16_scaled(first + (k0 + t0 + t) * token, D, De, 1.0f, rows + t * De);  // or copied
      }
      // Pair dd of the n tokens: one gather of 16 words (rows past n read row 0 and are not stored).
      alignas(64) int32_t step[kTile];
      for (int64_t t = 0; t < kTile; ++t) step[t] = static_cast<int32_t>((t < n ? t : 0) * pairs);
      const __m512i index = _mm512_load_si512(step);
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t dd = 0; dd < pairs; ++dd)
        _mm512_mask_storeu_epi32(block + 2 * (dd * kBc + t0), keep, _mm512_i32gather_epi32(index, rows + 2 * dd, 4));
    }
    for (int64_t dd = 0; dd < pairs; ++dd) std::fill(block + 2 * (dd * kBc + cols), block + 2 * (dd + 1) * kBc, uint16_t{0});
  }
}

// Rows of one head as bf16 pair rows of Dp columns: pair row kk = (x[2kk][n], x[2kk + 1][n]) · factor, T tokens,
// zero up to rows_pad (even).
template <typename Src>
void pack_pair_rows(const Plan& p, const Src* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
                    uint16_t* dst) {
  for (int64_t t = 0; t < rows_pad; t += 2) {
    prefetch_row(first, token, t + kRowsAhead, T, p.dims.D);
    prefetch_row(first, token, t + kRowsAhead + 1, T, p.dims.D);
    const Src* r0 = t < T ? first + t * token : nullptr;
    const Src* r1 = t + 1 < T ? first + (t + 1) * token : nullptr;
    if (r0) interleave_bf16(r0, r1, p.dims.D, p.Dp, factor, dst + t * p.Dp);
    else std::fill_n(dst + t * p.Dp, 2 * p.Dp, uint16_t{0});
  }
}

// The float32 tile (rows × kBc, the first cols_pad columns) as bf16 pair rows over its rows: (rows_even / 2) pair
// rows of kBc columns.
void tile_pair_rows(const float* tile, int64_t rows, int64_t cols_pad, uint16_t* dst) {
  for (int64_t r = 0; r < rows; r += 2)
    interleave_bf16(tile + r * kBc, r + 1 < rows ? tile + (r + 1) * kBc : nullptr, cols_pad, cols_pad, 1.0f,
                    dst + r * kBc);
}

#ifdef QKV_ATTENTION_AMX
// dst (C × R 32-bit words, rows R apart) = srcᵀ, src (R × C words, rows C apart): pair rows of queries turned into
// rows of k-contiguous pairs, 16 words a gather.
void transpose_words(const uint16_t* src, int64_t R, int64_t C, uint16_t* dst) {
  alignas(64) int32_t step[16];
  for (int i = 0; i < 16; ++i) step[i] = static_cast<int32_t>(i * C);
  const __m512i index = _mm512_load_si512(step);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const __mmask16 keep = R - r0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (R - r0)) - 1);
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, index, src + 2 * (r0 * C + c), 4);
      _mm512_mask_storeu_epi32(dst + 2 * (c * R + r0), keep, words);
    }
}

// dst (cols × rows, rows ld_dst apart) = the first `cols` columns of src (rows × ld_src), transposed.
void transpose_block(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t d = 0; d < rows; ++d) dst[j * ld_dst + d] = src[d * ld_src + j];
}
#endif

// The forward with bf16 operands: Qs, P and the packs of K and V rounded to bf16, the sums and the online softmax
// in float32. Kᵀ in pair rows per key block (S = Qs Kᵀ_j sums over D), V in pair rows of keys (O += P V_j sums over
// keys), P rounded once per tile.
template <typename KV = float>  // K and V as the caller holds them: float32, or bf16 (a bf16 KV cache)
struct ForwardBf16 {
  ScratchOf<uint16_t> kt_buf, v_buf, q_buf, p_buf, tile;
  uint16_t *kt = nullptr, *vp = nullptr, *qs = nullptr, *pb = nullptr;
  void reserve(const Plan& p) {
    kt = kt_buf.get(static_cast<size_t>(pair_width(p) * p.Tk_pad));
    vp = v_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
    qs = q_buf.get(static_cast<size_t>(p.Br * p.Dp));
    pb = p_buf.get(static_cast<size_t>(p.Br * kBc));
    tile.get(static_cast<size_t>(16 * pair_width(p)));
  }
  void pack_kv(const Plan& p, const KV* k, const KV* v, int64_t bkv) {
    pack_pairs_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, tile, kt);
    pack_pair_rows(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, p.dims.Tk, p.Tk_pad, 1.0f, vp);
  }
  void pack_queries(const Plan& p, const float* q, int64_t bh, int64_t q0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      to_bf16_scaled(p.row(q, p.layout.q, bh, q0 + r), p.dims.D, p.Dp, p.scale, qs + r * p.Dp);
  }
  void scores(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, float* s, Trim trim, int64_t diag) {
    const int64_t De = pair_width(p);
    block_gemm_bf16(rows, cols_pad, De, qs, p.Dp, 2, kt + k0 * De, 2 * kBc, s, kBc, false, trim, diag, p.band());
  }
  // As ForwardF32's, with P written straight to its bf16 tile (through the float tile only with dropout).
  float exp_row(const Plan& p, float* sr, int64_t r, int64_t lo, int64_t hi, int64_t cols_pad, float m, int64_t bh,
                int64_t i, int64_t k0) {
    uint16_t* dst = pb + r * kBc;
    if (!p.dropout) return exp_to_bf16(sr, dst, lo, hi, cols_pad, m);
    const float sum = exp_range(sr, sr, lo, hi, cols_pad, m);
    if (hi > lo) apply_dropout_row(sr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);
    to_bf16_scaled(sr, cols_pad, cols_pad, 1.0f, dst);
    return sum;
  }
  void add_values(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, const float* s, float* acc, Trim trim,
                  int64_t diag) {
    static_cast<void>(s);  // P is already in pb
    block_gemm_bf16(rows, p.Dp, cols_pad, pb, kBc, 2, vp + k0 * p.Dp, 2 * p.Dp, acc, p.Dp, true, trim, diag, p.band());
  }
};
#endif

template <typename Products, typename KV = float>
void forward_blocks(const Plan& p, const float* q, const KV* k, const KV* v, float* o, float* lse) {
  const AttentionDims& dims = p.dims;
  const AttentionOptions& options = p.options;
  const int64_t Dp = p.Dp;
  struct Workspace {
    Products products;
    Scratch s_buf, o_buf;
    float *s = nullptr, *acc = nullptr;
    int64_t packed_kv = -1;  // the K/V head the products hold: query heads of one group reuse them
    void reserve(const Plan& p) {
      products.reserve(p);
      s = s_buf.get(static_cast<size_t>(p.Br * kBc));
      acc = o_buf.get(static_cast<size_t>(p.Br * p.Dp));
    }
  };
  auto spaces = workspaces<Workspace>(p.threads(), p);
  parallel_items(spaces, dims.B * dims.H, p.q_blocks, [&](Workspace& ws, int64_t bh, int64_t qb, bool) {
    const int64_t bkv = p.kv_of(bh);
    if (bkv != ws.packed_kv) {
      ws.products.pack_kv(p, k, v, bkv);
      ws.packed_kv = bkv;
    }
    const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
    ws.products.pack_queries(p, q, bh, q0, rows);
    float* s = ws.s;
    float* acc = ws.acc;
    std::fill_n(acc, rows * Dp, 0.0f);
    float m[kBrMax], l[kBrMax], m_new[kBrMax], alpha[kBrMax];
    int64_t lo[kBrMax], hi[kBrMax];  // the keys of the current block each row sees: local columns [lo, hi)
    std::fill_n(m, rows, kNegInf);
    std::fill_n(l, rows, 0.0f);
    const int64_t key_end = p.key_end(q0 + rows - 1);  // keys beyond this are masked for every row
    for (int64_t k0 = p.first_key_block(q0); k0 < key_end; k0 += kBc) {
      const int64_t cols = std::min(kBc, dims.Tk - k0), cols_pad = round_up(cols, kNR);
      const Trim columns = options.causal ? Trim::Columns : Trim::None, k_end = options.causal ? Trim::KEnd : Trim::None;
      const int64_t diag = q0 + p.offset - k0 + 1;  // local key c visible to local row r iff c < r + diag
      ws.products.scores(p, rows, cols_pad, k0, s, columns, diag);  // S = Qs Kᵀ
      // The new running maxima, then every row's rescale factor e^(m − m') in one vector pass (e^−∞ = 0 for a
      // row's first visible block): a scalar exp per row and block was 2–4% of the pass.
      for (int64_t r = 0; r < rows; ++r) {
        std::tie(lo[r], hi[r]) = p.visible_in_block(q0 + r, k0, cols);
        p.cap_scores(s + r * kBc, lo[r], hi[r]);
        m_new[r] = hi[r] <= lo[r] ? m[r] : std::max(m[r], row_max(s + r * kBc + lo[r], hi[r] - lo[r]));
      }
      simd::exp_difference(m, m_new, alpha, rows);
      for (int64_t r = 0; r < rows; ++r) {
        const float sum = ws.products.exp_row(p, s + r * kBc, r, lo[r], hi[r], cols_pad, m_new[r], bh, q0 + r, k0);
        if (hi[r] <= lo[r]) continue;  // nothing visible in this block: P's row is 0
        l[r] = l[r] * alpha[r] + sum;
        if (alpha[r] != 1.0f) scale_row(acc + r * Dp, Dp, alpha[r]);
        m[r] = m_new[r];
      }
      ws.products.add_values(p, rows, cols_pad, k0, s, acc, k_end, diag);  // O += P V
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = p.row(o, p.layout.o, bh, q0 + r);
      // l = 0 (no visible key) gives NaN, as PyTorch does
      scaled_copy(acc + r * Dp, dst, dims.D, l[r] > 0.0f ? 1.0f / l[r] : std::numeric_limits<float>::quiet_NaN());
      lse[bh * dims.Tq + q0 + r] = m[r] + std::log(l[r]);
    }
  });
}

}  // namespace

bool attention_bf16_available() {
#ifdef QKV_ATTENTION_BF16
  return bf16_native();
#else
  return false;
#endif
}

const char* attention_bf16_products() {
  if (!attention_bf16_available()) return "none";
#ifdef QKV_ATTENTION_AMX
  if (amx_bf16_ready()) return "AMX tiles (TDPBF16PS)";
#endif
  return "VDPBF16PS";
}

void attention_forward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                       const float* q, const float* k, const float* v, float* o, float* lse) {
  if (dims.B <= 0 || dims.H <= 0 || dims.Tq <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D;
  if (dims.Tk <= 0 || D <= 0) {  // nothing to attend to (Tk = 0: NaN rows) or nothing to carry (D = 0)
    for (int64_t bh = 0; bh < dims.B * dims.H; ++bh)
      for (int64_t i = 0; i < dims.Tq; ++i) {
        std::fill_n(p.row(o, layout.o, bh, i), D, std::numeric_limits<float>::quiet_NaN());
        lse[bh * dims.Tq + i] = dims.Tk <= 0 ? kNegInf : std::log(static_cast<float>(p.visible(i)));
      }
    return;
  }
#ifdef QKV_ATTENTION_BF16
  if (options.bf16 && attention_bf16_available()) return forward_blocks<ForwardBf16<>>(p, q, k, v, o, lse);
#endif
  forward_blocks<ForwardF32>(p, q, k, v, o, lse);
}

void attention_forward_bf16_kv(const AttentionDims& dims, const AttentionLayout& layout,
                               const AttentionOptions& options, const float* q, const uint16_t* k, const uint16_t* v,
                               float* o, float* lse) {
  if (dims.B <= 0 || dims.H <= 0 || dims.Tq <= 0) return;
  const Plan p(dims, layout, options);
#ifdef QKV_ATTENTION_BF16
  if (attention_bf16_available() && dims.Tk > 0 && dims.D > 0) return forward_blocks<ForwardBf16<uint16_t>>(p, q, k, v, o, lse);
#endif
  // Without bf16 products: K and V widened (exactly) over their extent, then the float32 kernel.
  auto widen = [&](const uint16_t* x, const AttentionStrides& s) {
    std::vector<float> out(static_cast<size_t>(p.extent(s, p.kv_heads, dims.Tk)));
    bf16_to_f32(x, out.data(), static_cast<int64_t>(out.size()));
    return out;
  };
  const std::vector<float> kf = widen(k, layout.k), vf = widen(v, layout.v);
  AttentionOptions fp32 = options;
  fp32.bf16 = false;
  attention_forward(dims, layout, fp32, q, kf.data(), vf.data(), o, lse);
}

void attention_probabilities(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                             const float* q, const float* k, const float* lse, int64_t b, int64_t h, float* out) {
  if (dims.Tq <= 0 || dims.Tk <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D, Dp = p.Dp, bh = b * dims.H + h, Tk = dims.Tk;
  if (D <= 0) {  // every score is 0: uniform over the visible keys
    for (int64_t i = 0; i < dims.Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j)
        out[i * Tk + j] = j >= p.key_begin(i) && j < p.key_end(i) ? std::exp(-lse[bh * dims.Tq + i]) : 0.0f;
    return;
  }
  Scratch kt_buf;
  float* kt = kt_buf.get(static_cast<size_t>(D * p.Tk_pad));
  const int64_t bkv = p.kv_of(bh);
  pack_transposed(p, p.kv_row(k, layout.k, bkv, 0), layout.k.token, kt);
  const float* lse_head = lse + bh * dims.Tq;
#pragma omp parallel num_threads(p.threads())
  {
    Scratch qs_buf, s_buf;
    float* qs = qs_buf.get(static_cast<size_t>(p.Br * Dp));
    float* s = s_buf.get(static_cast<size_t>(p.Br * kBc));
#pragma omp for schedule(static, 1)
    for (int64_t qb = 0; qb < p.q_blocks; ++qb) {
      const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = p.row(q, layout.q, bh, q0 + r);
        scaled_copy(src, qs + r * Dp, D, p.scale);
      }
      for (int64_t k0 = 0; k0 < Tk; k0 += kBc) {
        const int64_t cols = std::min(kBc, Tk - k0), cols_pad = round_up(cols, kNR);
        const int64_t diag = q0 + p.offset - k0 + 1;
        // the whole tile is in the future of every row, or before every row's window
        if ((options.causal && rows - 1 + diag <= 0) || k0 + cols <= p.key_begin(q0)) {
          for (int64_t r = 0; r < rows; ++r) std::fill_n(out + (q0 + r) * Tk + k0, cols, 0.0f);
          continue;
        }
        block_gemm(rows, cols_pad, D, qs, Dp, 1, kt + k0 * D, kBc, s, kBc, false,
                   options.causal ? Trim::Columns : Trim::None, diag, p.band());  // S = Qs Kᵀ
        for (int64_t r = 0; r < rows; ++r) {
          const auto [lo, hi] = p.visible_in_block(q0 + r, k0, cols);
          p.cap_scores(s + r * kBc, lo, hi);
          exp_range(s + r * kBc, out + (q0 + r) * Tk + k0, lo, hi, cols, lse_head[q0 + r]);  // P = exp(S − lse)
        }
      }
    }
  }
}

namespace {

// The dK and dV rows of key block k0 (cols keys) out of their (kBc × Dp) accumulators.
void store_key_block(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc,
                     float* dk, float* dv) {
  for (int64_t j = 0; j < cols; ++j) {
    std::copy_n(dk_acc + j * p.Dp, p.dims.D, p.kv_row(dk, p.layout.k, bkv, k0 + j));
    std::copy_n(dv_acc + j * p.Dp, p.dims.D, p.kv_row(dv, p.layout.v, bkv, k0 + j));
  }
}

// The packs of one K/V head and of the `group` query heads that read it, for the backward pass, owned by one
// thread, and the backward's five products in float32: Kᵀ, Vᵀ (and K row-major) of the K/V head; Q·scale and dO of
// each query head, one after another.
struct BackwardF32 {
  Scratch kt_buf, vt_buf, k_buf, qs_buf, do_buf;
  float *kt = nullptr, *vt = nullptr, *kp = nullptr, *qs = nullptr, *dop = nullptr;
  int64_t head_floats = 0;  // Tq_pad · Dp: the offset between query heads in qs and dop
  void reserve(const Plan& p, bool need_k) {
    for (Scratch* b : {&kt_buf, &vt_buf}) b->get(static_cast<size_t>(p.dims.D * p.Tk_pad));
    for (Scratch* b : {&qs_buf, &do_buf}) b->get(static_cast<size_t>(p.group * p.Tq_pad * p.Dp));
    if (need_k) k_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
  }
  void pack(const Plan& p, const float* q, const float* k, const float* v, const float* d_o, int64_t bkv, bool need_k) {
    const int64_t D = p.dims.D, Dp = p.Dp;
    head_floats = p.Tq_pad * Dp;
    kt = kt_buf.get(static_cast<size_t>(D * p.Tk_pad));
    vt = vt_buf.get(static_cast<size_t>(D * p.Tk_pad));
    qs = qs_buf.get(static_cast<size_t>(p.group * head_floats));
    dop = do_buf.get(static_cast<size_t>(p.group * head_floats));
    pack_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, kt);
    pack_transposed(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, vt);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      pack_rows(p, p.row(q, p.layout.q, bh, 0), p.layout.q.token, p.dims.Tq, p.Tq_pad, p.scale, qs + g * head_floats);
      pack_rows(p, p.row(d_o, p.layout.o, bh, 0), p.layout.o.token, p.dims.Tq, p.Tq_pad, 1.0f, dop + g * head_floats);
    }
    if (need_k) {
      kp = k_buf.get(static_cast<size_t>(p.Tk_pad * Dp));
      pack_rows(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, p.dims.Tk, p.Tk_pad, 1.0f, kp);
    }
  }
  // S = Qs Kᵀ_j into pz and G = dO Vᵀ_j into ds for query block (q0, rows) of query head g.
  void scores(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t k0, int64_t cols_pad, float* pz, float* ds,
              Trim trim, int64_t diag) {
    const int64_t D = p.dims.D, Dp = p.Dp;
    block_gemm(rows, cols_pad, D, qs + g * head_floats + q0 * Dp, Dp, 1, kt + k0 * D, kBc, pz, kBc, false, trim, diag, p.band());
    block_gemm(rows, cols_pad, D, dop + g * head_floats + q0 * Dp, Dp, 1, vt + k0 * D, kBc, ds, kBc, false, trim, diag, p.band());
  }
  // dV_j += (P∘Z)ᵀ dO and dK_j += dSᵀ Qs: accumulators (cols × Dp).
  void add_dv_dk(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t cols, const float* pz, const float* ds,
                 float* dv_acc, float* dk_acc, int64_t diag) {
    const int64_t Dp = p.Dp;
    const Trim k_begin = p.options.causal ? Trim::KBegin : Trim::None;
    block_gemm(cols, Dp, rows, pz, 1, kBc, dop + g * head_floats + q0 * Dp, Dp, dv_acc, Dp, true, k_begin, diag, p.band());
    block_gemm(cols, Dp, rows, ds, 1, kBc, qs + g * head_floats + q0 * Dp, Dp, dk_acc, Dp, true, k_begin, diag, p.band());
  }
  // dq_acc (rows × Dp) += dS K_j
  void add_dq(const Plan& p, int64_t rows, int64_t k0, int64_t cols_pad, const float* ds, float* dq_acc, int64_t diag) {
    block_gemm(rows, p.Dp, cols_pad, ds, kBc, 1, kp + k0 * p.Dp, p.Dp, dq_acc, p.Dp, true,
               p.options.causal ? Trim::KEnd : Trim::None, diag, p.band());
  }
  void store(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc, float* dk,
             float* dv) const {
    store_key_block(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
  }
};

#ifdef QKV_ATTENTION_BF16
// The backward with bf16 operands. S and G sum over D (Qs, dO row-major; Kᵀ, Vᵀ in pair rows per key block, as the
// forward's Kᵀ); dQ += dS K_j sums over keys (K in pair rows of keys, dS rounded row-major); dV += (P∘Z)ᵀ dO and
// dK += dSᵀ Qs sum over queries: dO and Qs in pair rows of queries, the tiles of P∘Z and dS turned into pair rows of
// queries and read transposed. Accumulators as float32's, (kBc × Dp).
struct BackwardBf16 {
  ScratchOf<uint16_t> kt_buf, vt_buf, k_buf, qs_buf, do_buf, qsp_buf, dop_buf, tile_buf, pair_buf, ds_buf;
  uint16_t *kt = nullptr, *vt = nullptr, *kp = nullptr, *qs = nullptr, *dop = nullptr, *qs_pairs = nullptr,
           *do_pairs = nullptr, *pairs = nullptr, *dsb = nullptr;
  int64_t head = 0;  // Tq_pad · Dp: the offset between query heads in every per-head pack
#ifdef QKV_ATTENTION_AMX
  // On AMX tiles A must have k contiguous in its rows, so dV and dK are summed transposed: dVᵀ += dOᵀ (P∘Z) and
  // dKᵀ += Qsᵀ dS, with Qsᵀ and dOᵀ (Dp × Tq_pad: the pair-row packs turned word for word) and the tiles of P∘Z and
  // dS in pair rows as B. The accumulators hold (Dp × kBc) and are turned back as the key block is stored.
  bool amx = false;
  ScratchOf<uint16_t> qst_buf, dot_buf;
  ScratchOf<float> turned_buf;
  uint16_t *qs_t = nullptr, *do_t = nullptr;
#endif
  void reserve(const Plan& p, bool need_k) {
    const size_t kv = static_cast<size_t>(pair_width(p) * p.Tk_pad), per_group = static_cast<size_t>(p.group * p.Tq_pad * p.Dp);
    kt = kt_buf.get(kv);
    vt = vt_buf.get(kv);
    qs = qs_buf.get(per_group);
    dop = do_buf.get(per_group);
    qs_pairs = qsp_buf.get(per_group);
    do_pairs = dop_buf.get(per_group);
    tile_buf.get(static_cast<size_t>(16 * pair_width(p)));
    pairs = pair_buf.get(static_cast<size_t>(p.Br * kBc));
    dsb = ds_buf.get(static_cast<size_t>(p.Br * kBc));
    if (need_k) kp = k_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
#ifdef QKV_ATTENTION_AMX
    amx = amx_bf16_ready();
    if (amx) {
      qs_t = qst_buf.get(per_group);
      do_t = dot_buf.get(per_group);
      turned_buf.get(static_cast<size_t>(2 * kBc * p.Dp));
    }
#endif
  }
  void pack(const Plan& p, const float* q, const float* k, const float* v, const float* d_o, int64_t bkv, bool need_k) {
    const int64_t Dp = p.Dp, Tq = p.dims.Tq;
    head = p.Tq_pad * Dp;
    pack_pairs_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, tile_buf, kt);
    pack_pairs_transposed(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, tile_buf, vt);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      const float* qh = p.row(q, p.layout.q, bh, 0);
      const float* oh = p.row(d_o, p.layout.o, bh, 0);
      for (int64_t t = 0; t < p.Tq_pad; ++t) {
        if (t < Tq) {
          prefetch_row(qh, p.layout.q.token, t + kRowsAhead, Tq, p.dims.D);
          prefetch_row(oh, p.layout.o.token, t + kRowsAhead, Tq, p.dims.D);
          to_bf16_scaled(qh + t * p.layout.q.token, p.dims.D, Dp, p.scale, qs + g * head + t * Dp);
          to_bf16_scaled(oh + t * p.layout.o.token, p.dims.D, Dp, 1.0f, dop + g * head + t * Dp);
        } else {
          std::fill_n(qs + g * head + t * Dp, Dp, uint16_t{0});
          std::fill_n(dop + g * head + t * Dp, Dp, uint16_t{0});
        }
      }
      pack_pair_rows(p, qh, p.layout.q.token, Tq, p.Tq_pad, p.scale, qs_pairs + g * head);
      pack_pair_rows(p, oh, p.layout.o.token, Tq, p.Tq_pad, 1.0f, do_pairs + g * head);
#ifdef QKV_ATTENTION_AMX
      if (amx) {
        transpose_words(qs_pairs + g * head, p.Tq_pad / 2, Dp, qs_t + g * head);
        transpose_words(do_pairs + g * head, p.Tq_pad / 2, Dp, do_t + g * head);
      }
#endif
    }
    if (need_k) pack_pair_rows(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, p.dims.Tk, p.Tk_pad, 1.0f, kp);
  }
  void scores(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t k0, int64_t cols_pad, float* pz, float* ds,
              Trim trim, int64_t diag) {
    const int64_t De = pair_width(p), Dp = p.Dp;
    block_gemm_bf16(rows, cols_pad, De, qs + g * head + q0 * Dp, Dp, 2, kt + k0 * De, 2 * kBc, pz, kBc, false, trim, diag, p.band());
    block_gemm_bf16(rows, cols_pad, De, dop + g * head + q0 * Dp, Dp, 2, vt + k0 * De, 2 * kBc, ds, kBc, false, trim, diag, p.band());
  }
  // dV += (P∘Z)ᵀ dO and dK += dSᵀ Qs over the block's query rows (rounded up to a pair: the packs are zero there).
  void add_dv_dk(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t cols, const float* pz, const float* ds,
                 float* dv_acc, float* dk_acc, int64_t diag) {
    const int64_t cols_pad = round_up(cols, kNR), rows_even = round_up(rows, 2), Dp = p.Dp;
    const Trim k_begin = p.options.causal ? Trim::KBegin : Trim::None;
    tile_pair_rows(pz, rows, cols_pad, pairs);
#ifdef QKV_ATTENTION_AMX
    if (amx) {  // transposed (see above); the tiles are zero where masked, so no trim is needed
      block_gemm_amx(Dp, cols_pad, rows_even, do_t + g * head + q0, p.Tq_pad, pairs, 2 * kBc, dv_acc, kBc, true,
                     Trim::None, 0, 0);
      tile_pair_rows(ds, rows, cols_pad, pairs);
      block_gemm_amx(Dp, cols_pad, rows_even, qs_t + g * head + q0, p.Tq_pad, pairs, 2 * kBc, dk_acc, kBc, true,
                     Trim::None, 0, 0);
      return;
    }
#endif
    block_gemm_bf16(cols, Dp, rows_even, pairs, 2, 2 * kBc, do_pairs + g * head + q0 * Dp, 2 * Dp, dv_acc, Dp, true,
                    k_begin, diag, p.band());
    tile_pair_rows(ds, rows, cols_pad, pairs);
    block_gemm_bf16(cols, Dp, rows_even, pairs, 2, 2 * kBc, qs_pairs + g * head + q0 * Dp, 2 * Dp, dk_acc, Dp, true,
                    k_begin, diag, p.band());
  }
  void add_dq(const Plan& p, int64_t rows, int64_t k0, int64_t cols_pad, const float* ds, float* dq_acc, int64_t diag) {
    for (int64_t r = 0; r < rows; ++r) to_bf16_scaled(ds + r * kBc, cols_pad, cols_pad, 1.0f, dsb + r * kBc);
    block_gemm_bf16(rows, p.Dp, cols_pad, dsb, kBc, 2, kp + k0 * p.Dp, 2 * p.Dp, dq_acc, p.Dp, true,
                    p.options.causal ? Trim::KEnd : Trim::None, diag, p.band());
  }
  void store(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc, float* dk,
             float* dv) {
#ifdef QKV_ATTENTION_AMX
    if (amx) {
      float* turned = turned_buf.get(static_cast<size_t>(2 * kBc * p.Dp));
      transpose_block(dk_acc, p.dims.D, cols, kBc, turned, p.Dp);
      transpose_block(dv_acc, p.dims.D, cols, kBc, turned + kBc * p.Dp, p.Dp);
      return store_key_block(p, bkv, k0, cols, turned, turned + kBc * p.Dp, dk, dv);
    }
#endif
    store_key_block(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
  }
};
#endif

// For query block (q0, rows) of query head g of the group × key block (k0, cols): P (or P∘Z when `dropped`) into pz
// and dS into ds, both (rows × kBc), zero outside the visible region. With soft-capping, S is capped before the
// exponential and dS carries its derivative: d(cap·tanh(s/cap))/ds = 1 − (capped / cap)².
template <typename Group>
void probabilities_and_dscores(const Plan& p, Group& group, int64_t g, const float* lse_head, const float* delta_head,
                               int64_t bh, int64_t q0, int64_t rows, int64_t k0, int64_t cols, float* pz, float* ds) {
  const int64_t cols_pad = round_up(cols, kNR);
  group.scores(p, g, q0, rows, k0, cols_pad, pz, ds, p.options.causal ? Trim::Columns : Trim::None,
               q0 + p.offset - k0 + 1);  // S and G
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = q0 + r;
    float* pr = pz + r * kBc;
    float* dr = ds + r * kBc;
    const auto [lo, hi] = p.visible_in_block(i, k0, cols);
    if (hi - lo == 1 && p.visible(i) == 1) {
      // One key in all: its softmax is exactly 1 whatever the score, so dS = 0 (G − Di is rounding alone: the two
      // dot products dO·V and dO·O come from different loops) and P = 1, as PyTorch has them.
      std::fill_n(pr, cols_pad, 0.0f);
      std::fill_n(dr, cols_pad, 0.0f);
      pr[lo] = 1.0f;
      if (p.dropout) apply_dropout_row(pr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // P ∘ Z for dV
      continue;
    }
    if (!p.dropout && p.softcap == 0.0f) {  // P = exp(S − lse), dS = P ∘ (G − Di) on [lo, hi), zero elsewhere
      if (hi <= lo) {
        std::fill_n(pr, cols_pad, 0.0f);
        std::fill_n(dr, cols_pad, 0.0f);
        continue;
      }
      probabilities_and_dscores_row(pr + lo, dr + lo, hi - lo, cols_pad - lo, lse_head[i], delta_head[i]);
      std::fill_n(pr, lo, 0.0f);
      std::fill_n(dr, lo, 0.0f);
      continue;
    }
    if (hi <= lo) {
      std::fill_n(pr, cols_pad, 0.0f);
      std::fill_n(dr, cols_pad, 0.0f);
      continue;
    }
    p.cap_scores(pr, lo, hi);
    exp_range(pr, pr, lo, hi, cols_pad, lse_head[i]);  // P = exp(S − lse)
    if (p.dropout) apply_dropout_row(dr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // G ∘ Z
    const float di = delta_head[i];
    for (int64_t j = lo; j < hi; ++j) dr[j] = pr[j] * (dr[j] - di);
    if (p.softcap != 0.0f) {
      // pr holds exp(capped − lse); the capped score itself is lse + log P, but recomputing it from S would need S
      // again: take it from P instead, which is exact where P > 0 and irrelevant where P = 0 (dS = 0 there).
      const float inv = 1.0f / p.softcap;
      for (int64_t j = lo; j < hi; ++j) {
        if (pr[j] == 0.0f) continue;
        const float t = (lse_head[i] + std::log(pr[j])) * inv;
        dr[j] *= 1.0f - t * t;
      }
    }
    if (p.dropout) apply_dropout_row(pr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // P ∘ Z for dV
    std::fill(dr, dr + lo, 0.0f);
    std::fill(dr + hi, dr + cols_pad, 0.0f);
  }
}

// One key block (k0) of one K/V head against every query block of every query head of its group that sees it, in
// head order: dK and dV of the block, written to dk and dv; with dq_acc (the group's Tq_pad × Dp accumulators, one
// per query head) also dQ += dS K, so S and dO·Vᵀ are computed once per tile.
template <typename Group>
void key_block_backward(const Plan& p, Group& group, const float* lse, const float* delta, int64_t bkv, int64_t k0,
                        float* pz, float* ds, float* dk_acc, float* dv_acc, float* dq_acc, float* dk, float* dv) {
  const int64_t cols = std::min(kBc, p.dims.Tk - k0), cols_pad = round_up(cols, kNR);
  std::fill_n(dk_acc, kBc * p.Dp, 0.0f);
  std::fill_n(dv_acc, kBc * p.Dp, 0.0f);
  // The query rows that see some key of the block: from the first that sees key k0 to the last that sees its last.
  const int64_t first_row = p.query_begin(k0), end_row = p.query_end(k0 + cols - 1);
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t bh = p.query_head(bkv, g);
    for (int64_t q0 = first_row / p.Br * p.Br; q0 < end_row; q0 += p.Br) {
      const int64_t rows = std::min(p.Br, p.dims.Tq - q0);
      probabilities_and_dscores(p, group, g, lse + bh * p.dims.Tq, delta + bh * p.dims.Tq, bh, q0, rows, k0, cols, pz,
                                ds);
      const int64_t diag = q0 + p.offset - k0 + 1;
      group.add_dv_dk(p, g, q0, rows, cols, pz, ds, dv_acc, dk_acc, diag);  // dV += (P∘Z)ᵀ dO, dK += dSᵀ Qs
      if (dq_acc) group.add_dq(p, rows, k0, cols_pad, ds, dq_acc + g * p.Tq_pad * p.Dp + q0 * p.Dp, diag);  // dQ += dS K
    }
  }
  group.store(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
}

template <typename Group>
void backward_blocks(const Plan& p, const float* q, const float* k, const float* v, const float* lse,
                     const float* delta, const float* d_o, float* dq, float* dk, float* dv) {
  const AttentionDims& dims = p.dims;
  const int64_t D = dims.D, Dp = p.Dp, units = dims.B * p.kv_heads;
  // Per thread: the group's packs, the P and dS tiles, up to two block accumulators, and with whole groups per
  // thread the group's dQ accumulators.
  struct Workspace {
    Group group;
    Scratch pz_buf, ds_buf, acc_a, acc_b, dq_buf;
    float *pz, *ds;
    void reserve(const Plan& p, bool whole_groups) {
      group.reserve(p, true);
      pz = pz_buf.get(static_cast<size_t>(p.Br * kBc));
      ds = ds_buf.get(static_cast<size_t>(p.Br * kBc));
      acc_a.get(static_cast<size_t>(std::max(kBc, p.Br) * p.Dp));
      acc_b.get(static_cast<size_t>(kBc * p.Dp));
      if (whole_groups) dq_buf.get(static_cast<size_t>(p.group * p.Tq_pad * p.Dp));
    }
  };

  // One pass when every thread can own whole K/V groups: for each key block, each query block of each head of the
  // group that sees it gives S = QKᵀ and dP = dO Vᵀ once, and from them dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K —
  // five products instead of the two-pass scheme's seven — with dQ accumulated in the thread's own buffers. A group
  // is computed by one thread from start to end, so the bits do not depend on the number of threads.
  const int threads = p.threads();
  const bool whole_groups = units >= threads && (units % threads == 0 || units >= 4 * threads);
  auto spaces = workspaces<Workspace>(threads, p, whole_groups);
  if (whole_groups) {
#pragma omp parallel num_threads(threads)
    {
      Workspace& ws = spaces[static_cast<size_t>(omp_get_thread_num())];
      float* dq_acc = ws.dq_buf.get(static_cast<size_t>(p.group * p.Tq_pad * Dp));
#pragma omp for schedule(dynamic, 1)
      for (int64_t bkv = 0; bkv < units; ++bkv) {
        ws.group.pack(p, q, k, v, d_o, bkv, true);
        float* dk_acc = ws.acc_a.get(static_cast<size_t>(kBc * Dp));
        float* dv_acc = ws.acc_b.get(static_cast<size_t>(kBc * Dp));
        std::fill_n(dq_acc, p.group * p.Tq_pad * Dp, 0.0f);
        for (int64_t k0 = 0; k0 < dims.Tk; k0 += kBc)
          key_block_backward(p, ws.group, lse, delta, bkv, k0, ws.pz, ws.ds, dk_acc, dv_acc, dq_acc, dk, dv);
        for (int64_t g = 0; g < p.group; ++g) {
          const int64_t bh = p.query_head(bkv, g);
          for (int64_t i = 0; i < dims.Tq; ++i)
            scaled_copy(dq_acc + g * p.Tq_pad * Dp + i * Dp, p.row(dq, p.layout.q, bh, i), D, p.scale);
        }
      }
    }
    return;
  }

  // Fewer groups than threads: two passes that split each group by blocks. Pass 1: dK and dV, one key block per item.
  parallel_items(spaces, units, p.k_blocks, [&](Workspace& ws, int64_t bkv, int64_t kb, bool new_group) {
    if (new_group) ws.group.pack(p, q, k, v, d_o, bkv, false);
    key_block_backward(p, ws.group, lse, delta, bkv, kb * kBc, ws.pz, ws.ds, ws.acc_a.get(static_cast<size_t>(kBc * Dp)),
                       ws.acc_b.get(static_cast<size_t>(kBc * Dp)), nullptr, dk, dv);
  });

  // Pass 2: dQ, one query block (of every head of the group) per item.
  parallel_items(spaces, units, p.q_blocks, [&](Workspace& ws, int64_t bkv, int64_t qb, bool new_group) {
    if (new_group) ws.group.pack(p, q, k, v, d_o, bkv, true);
    Group& group = ws.group;
    float *pz = ws.pz, *ds = ws.ds;
    float* dq_acc = ws.acc_a.get(static_cast<size_t>(p.Br * Dp));
    const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
    const int64_t key_end = p.key_end(q0 + rows - 1);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      std::fill_n(dq_acc, rows * Dp, 0.0f);
      for (int64_t k0 = p.first_key_block(q0); k0 < key_end; k0 += kBc) {
        const int64_t cols = std::min(kBc, dims.Tk - k0), cols_pad = round_up(cols, kNR);
        probabilities_and_dscores(p, group, g, lse + bh * dims.Tq, delta + bh * dims.Tq, bh, q0, rows, k0, cols, pz, ds);
        group.add_dq(p, rows, k0, cols_pad, ds, dq_acc, q0 + p.offset - k0 + 1);  // dQ += dS K
      }
      for (int64_t r = 0; r < rows; ++r) scaled_copy(dq_acc + r * Dp, p.row(dq, p.layout.q, bh, q0 + r), D, p.scale);
    }
  });
}

}  // namespace

void attention_backward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                        const float* q, const float* k, const float* v, const float* o, const float* lse,
                        const float* d_o, float* dq, float* dk, float* dv) {
  if (dims.B <= 0 || dims.H <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D, heads = dims.B * dims.H, units = dims.B * p.kv_heads;
  if (dims.Tq <= 0 || dims.Tk <= 0 || D <= 0) {
    for (int64_t bh = 0; bh < heads; ++bh)
      for (int64_t t = 0; t < dims.Tq; ++t) std::fill_n(p.row(dq, layout.q, bh, t), D, 0.0f);
    for (int64_t bkv = 0; bkv < units; ++bkv)
      for (int64_t t = 0; t < dims.Tk; ++t) {
        std::fill_n(p.kv_row(dk, layout.k, bkv, t), D, 0.0f);
        std::fill_n(p.kv_row(dv, layout.v, bkv, t), D, 0.0f);
      }
    return;
  }
  // Di = rowsum(dO ∘ O), one per query row; with bf16 products from dO as they round it, so that dS = P ∘ (G − Di)
  // is zero where it should be (one visible key: G = Di exactly), not bf16's rounding error.
  [[maybe_unused]] const bool bf16 = options.bf16 && attention_bf16_available();  // read only where bf16 is built
  Scratch delta_buf;
  float* delta = delta_buf.get(static_cast<size_t>(heads * dims.Tq));
#pragma omp parallel for num_threads(p.threads()) schedule(static)
  for (int64_t row = 0; row < heads * dims.Tq; ++row) {
    const int64_t bh = row / dims.Tq, i = row % dims.Tq;
    const float* d_o_row = p.row(d_o, layout.o, bh, i);
    const float* o_row = p.row(o, layout.o, bh, i);
#ifdef QKV_ATTENTION_BF16
    if (bf16) {
      delta[row] = dot_rounded_bf16(d_o_row, o_row, D);
      continue;
    }
#endif
    delta[row] = simd::dot(d_o_row, o_row, D);
  }

#ifdef QKV_ATTENTION_BF16
  if (bf16) return backward_blocks<BackwardBf16>(p, q, k, v, lse, delta, d_o, dq, dk, dv);
#endif
  backward_blocks<BackwardF32>(p, q, k, v, lse, delta, d_o, dq, dk, dv);
}

// ---- the plain reference: scores and weights materialised, double precision ----

namespace {
// Visibility straight from the definition, not from the Plan's block bounds the fused kernel uses.
bool reference_visible(const AttentionDims& d, const AttentionOptions& o, int64_t i, int64_t j) {
  const int64_t shifted = i + (d.Tk - d.Tq);
  if (o.causal && j > shifted) return false;
  if (o.window > 0 && j <= shifted - o.window) return false;
  return true;
}

struct ReferenceHead {
  std::vector<double> weights;  // (Tq × Tk) after softmax, before dropout
  std::vector<double> zmask;    // dropout factor per weight
  std::vector<double> capping;  // d(capped score)/d(score) per weight: 1 − tanh², or 1 without soft-capping
  std::vector<bool> any_visible;  // per query row
};

ReferenceHead reference_weights(const Plan& p, const float* q, const float* k, int64_t bh) {
  const auto& d = p.dims;
  const int64_t bkv = p.kv_of(bh);
  ReferenceHead h;
  h.weights.assign(static_cast<size_t>(d.Tq * d.Tk), 0.0);
  h.zmask.assign(static_cast<size_t>(d.Tq * d.Tk), 1.0);
  h.capping.assign(static_cast<size_t>(d.Tq * d.Tk), 1.0);
  for (int64_t i = 0; i < d.Tq; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    std::vector<double> s(static_cast<size_t>(d.Tk), -std::numeric_limits<double>::infinity());
    for (int64_t j = 0; j < d.Tk; ++j) {
      if (!reference_visible(d, p.options, i, j)) continue;
      double acc = 0.0;
      for (int64_t e = 0; e < d.D; ++e)
        acc += static_cast<double>(p.row(q, p.layout.q, bh, i)[e]) * p.kv_row(k, p.layout.k, bkv, j)[e];
      acc *= p.scale;
      if (p.softcap != 0.0f) {
        const double t = std::tanh(acc / p.softcap);
        acc = p.softcap * t;
        h.capping[static_cast<size_t>(i * d.Tk + j)] = 1.0 - t * t;
      }
      s[static_cast<size_t>(j)] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < d.Tk; ++j) sum += std::exp(s[static_cast<size_t>(j)] - mx);
    h.any_visible.push_back(sum > 0.0);
    for (int64_t j = 0; j < d.Tk; ++j) {
      if (!reference_visible(d, p.options, i, j)) continue;
      h.weights[static_cast<size_t>(i * d.Tk + j)] = std::exp(s[static_cast<size_t>(j)] - mx) / sum;
      if (p.dropout)
        h.zmask[static_cast<size_t>(i * d.Tk + j)] =
            attention_dropout_keep(p.options.seed, p.options.dropout_p, bh, i, j) ? p.inv_keep : 0.0;
    }
  }
  return h;
}
}  // namespace

namespace {

// What options.bf16 rounds, as the fused kernel rounds it: a copy of a strided tensor (heads × T rows of D) with every
// value x → bf16(x · factor) / factor. (The kernel also rounds the tiles of P and dS; the reference does not.)
std::vector<float> rounded_bf16(const Plan& p, const AttentionStrides& s, int64_t heads, int64_t T, const float* x,
                                float factor) {
  std::vector<float> out(x, x + p.extent(s, heads, T));
  for (float& value : out) value = bf16_to_f32_reference(f32_to_bf16_reference(value * factor)) / factor;
  return out;
}

struct RoundedInputs {
  std::vector<float> q, k, v, d_o;
  RoundedInputs(const Plan& p, const float* q_in, const float* k_in, const float* v_in, const float* d_o_in) {
    const AttentionDims& d = p.dims;
    q = rounded_bf16(p, p.layout.q, d.H, d.Tq, q_in, p.scale);
    k = rounded_bf16(p, p.layout.k, p.kv_heads, d.Tk, k_in, 1.0f);
    v = rounded_bf16(p, p.layout.v, p.kv_heads, d.Tk, v_in, 1.0f);
    if (d_o_in) d_o = rounded_bf16(p, p.layout.o, d.H, d.Tq, d_o_in, 1.0f);
  }
};

}  // namespace

void attention_forward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                 const AttentionOptions& options, const float* q, const float* k, const float* v,
                                 float* o) {
  const Plan p(dims, layout, options);
  if (options.bf16 && dims.B > 0 && dims.H > 0 && dims.Tq > 0 && dims.Tk > 0 && dims.D > 0) {
    AttentionOptions exact = options;
    exact.bf16 = false;
    const RoundedInputs r(p, q, k, v, nullptr);
    return attention_forward_reference(dims, layout, exact, r.q.data(), r.k.data(), r.v.data(), o);
  }
  for (int64_t bh = 0; bh < dims.B * dims.H; ++bh) {
    const ReferenceHead h = reference_weights(p, q, k, bh);
    const int64_t bkv = p.kv_of(bh);
    for (int64_t i = 0; i < dims.Tq; ++i)
      for (int64_t e = 0; e < dims.D; ++e) {
        double acc = 0.0;
        for (int64_t j = 0; j < dims.Tk; ++j) {
          const size_t at = static_cast<size_t>(i * dims.Tk + j);
          acc += h.weights[at] * h.zmask[at] * p.kv_row(v, layout.v, bkv, j)[e];
        }
        p.row(o, layout.o, bh, i)[e] =
            h.any_visible[static_cast<size_t>(i)] ? static_cast<float>(acc) : std::numeric_limits<float>::quiet_NaN();
      }
  }
}

void attention_backward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                  const AttentionOptions& options, const float* q, const float* k, const float* v,
                                  const float* d_o, float* dq, float* dk, float* dv) {
  const Plan p(dims, layout, options);
  if (options.bf16 && dims.B > 0 && dims.H > 0 && dims.Tq > 0 && dims.Tk > 0 && dims.D > 0) {
    AttentionOptions exact = options;
    exact.bf16 = false;
    const RoundedInputs r(p, q, k, v, d_o);
    return attention_backward_reference(dims, layout, exact, r.q.data(), r.k.data(), r.v.data(), r.d_o.data(), dq, dk, dv);
  }
  const int64_t Tq = dims.Tq, Tk = dims.Tk, D = dims.D, units = dims.B * p.kv_heads;
  // dK and dV of every K/V head, summed over the query heads that read it.
  std::vector<double> dk_all(static_cast<size_t>(units * Tk * D), 0.0), dv_all(static_cast<size_t>(units * Tk * D), 0.0);
  for (int64_t bh = 0; bh < dims.B * dims.H; ++bh) {
    const ReferenceHead h = reference_weights(p, q, k, bh);
    const int64_t bkv = p.kv_of(bh);
    double* dk_h = dk_all.data() + bkv * Tk * D;
    double* dv_h = dv_all.data() + bkv * Tk * D;
    std::vector<double> dq_h(static_cast<size_t>(Tq * D), 0.0);
    for (int64_t i = 0; i < Tq; ++i) {
      // dA_ij = Z_ij · (dO_i · V_j);  dS_ij = A_ij (dA_ij − Σ_l A_il dA_il), times the capping derivative
      std::vector<double> da(static_cast<size_t>(Tk), 0.0);
      double dot = 0.0;
      for (int64_t j = 0; j < Tk; ++j) {
        const size_t at = static_cast<size_t>(i * Tk + j);
        double g = 0.0;
        for (int64_t e = 0; e < D; ++e)
          g += static_cast<double>(p.row(d_o, layout.o, bh, i)[e]) * p.kv_row(v, layout.v, bkv, j)[e];
        da[static_cast<size_t>(j)] = g * h.zmask[at];
        dot += h.weights[at] * da[static_cast<size_t>(j)];
        for (int64_t e = 0; e < D; ++e) dv_h[j * D + e] += h.weights[at] * h.zmask[at] * p.row(d_o, layout.o, bh, i)[e];
      }
      for (int64_t j = 0; j < Tk; ++j) {
        const size_t at = static_cast<size_t>(i * Tk + j);
        const double dsij = h.weights[at] * (da[static_cast<size_t>(j)] - dot) * h.capping[at] * p.scale;
        for (int64_t e = 0; e < D; ++e) {
          dq_h[static_cast<size_t>(i * D + e)] += dsij * p.kv_row(k, layout.k, bkv, j)[e];
          dk_h[j * D + e] += dsij * p.row(q, layout.q, bh, i)[e];
        }
      }
    }
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t e = 0; e < D; ++e) p.row(dq, layout.q, bh, i)[e] = static_cast<float>(dq_h[static_cast<size_t>(i * D + e)]);
  }
  for (int64_t bkv = 0; bkv < units; ++bkv)
    for (int64_t j = 0; j < Tk; ++j)
      for (int64_t e = 0; e < D; ++e) {
        const size_t at = static_cast<size_t>((bkv * Tk + j) * D + e);
        p.kv_row(dk, layout.k, bkv, j)[e] = static_cast<float>(dk_all[at]);
        p.kv_row(dv, layout.v, bkv, j)[e] = static_cast<float>(dv_all[at]);
      }
}

}  // namespace qkv::kernels
