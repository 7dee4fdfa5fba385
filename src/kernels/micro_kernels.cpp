// The micro-kernels and the block products built from them (see micro_kernels.hpp): FMA (6 × 16 with AVX2, 8 × 32
// with AVX-512, plain loops without AVX2), VDPBF16PS (8 × 32 over bf16 pairs) and AMX tiles, each strip's k range
// trimmed to what its rows see. Not here: packing operands into the layouts these read (attention_packs.cpp).
#include "micro_kernels.hpp"

#include <algorithm>
#include <cstring>

#include "qkv/kernels/gemm.hpp"  // amx_bf16_ready

namespace qkv::kernels {

namespace {

// ---- the micro-kernel: C (MR × 16) (+)= A (MR × K) · B (K × 16) ----
// A element (r, k) sits at A[r·lda + k·ak] (ak = 1 for row-major, lda = 1 for a transposed read);
// B row k at B[k·ldb]. One broadcast of A per row and two B vectors per k feed 2·MR FMAs.

#ifdef QKV_AVX2
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

#ifdef QKV_ATTENTION_BF16
// ---- bf16 products (VDPBF16PS): C (float32) (+)= A · B with bf16 operands ----
// (A read a pair of k at a time, B in pair rows: micro_kernels.hpp)

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

#endif

}  // namespace

void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb,
                float* C, int64_t ldc, bool accumulate, Trim trim, int64_t diag, int64_t window) {
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
void block_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, int64_t ak2, const uint16_t* B,
                     int64_t ldb, float* C, int64_t ldc, bool accumulate, Trim trim, int64_t diag, int64_t window) {
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
#endif

#ifdef QKV_ATTENTION_AMX
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

}  // namespace qkv::kernels
