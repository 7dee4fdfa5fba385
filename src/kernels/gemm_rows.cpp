// Row-independent products C = α·A·Bᵀ + β·C for inference on batches of sequences (see gemm.hpp's gemm_rows_nt).
// Not for training: OpenBLAS's sgemm is faster on large products, but its value for a row depends on how many rows
// are multiplied with it (measured: every row of a 40-row product differs in its last bits from the same rows
// multiplied 1, 2, …, 33 at a time, and sgemv from both), so a sequence decoded beside others would drift from the
// same sequence decoded alone.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qkv/kernels/gemm.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {

thread_local int g_row_independent = 0;

// Every element is Σ_k a[k]·b[k] in simd::dot's order: term k goes to lane k mod 16 (one fused multiply-add per
// term), the 16 lanes are added pairwise (8, 4, 2, 1). AVX-512 holds the 16 lanes in one register (Lanes), AVX2 in
// two (halves_tile); both give simd::dot's bits, whatever the tile an element is computed in.
#if defined(QKV_AVX512)
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Lanes load_tail(const float* p, int64_t n) {
    return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p)};
  }
  void fma(const Lanes& a, const Lanes& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  // Keeps a loaded value in a register: without it GCC folds the load into each multiply-add that uses it, and a
  // 4 × 4 tile made 20 loads for its 16 multiply-adds instead of 8.
  void keep() { asm("" : "+v"(v)); }
  float sum() const {
    alignas(64) float l[16];
    _mm512_store_ps(l, v);
    for (int width = 8; width > 0; width /= 2)
      for (int k = 0; k < width; ++k) l[k] += l[k + width];
    return l[0];
  }
};
#endif

// α·dot, or α·dot + β·c as one fused multiply-add (written out, so the vector tiles below give the same bits).
inline float finish(float dot, float alpha, float beta, float c) {
  return beta == 0.0f ? alpha * dot : std::fma(alpha, dot, beta * c);
}

// The next column tile's rows of B (decoding), asked for into L1 while a tile runs: by row group `group` of `groups`
// at one step in `groups`, so a column tile's requests are spread over the time all its row groups take.
struct NextTile {
  const float* rows = nullptr;
  int64_t count = 0;
  int group = 0, groups = 1;
};

// A tile's requests for NextTile's lines: at(k, ldb) at every step k. (Its fields copied into the tile's locals: read
// through a reference at every step, AVX2's 4 and 8 rows ran ~10% slower.)
class NextRequests {
 public:
  explicit NextRequests(const NextTile& t) : rows_(t.rows), count_(t.count), groups_(t.groups), wait_(t.group) {}
  void at(int64_t k, int64_t ldb) {
    if (rows_ == nullptr || wait_-- != 0) return;
    wait_ = groups_ - 1;
    for (int64_t r = 0; r < count_; ++r) __builtin_prefetch(rows_ + r * ldb + k, 0, 3);  // into L1
  }

 private:
  const float* rows_;
  int64_t count_;
  int groups_, wait_;
};

#if defined(QKV_AVX512)
constexpr int kMR = 4, kNR = 4;  // 16 accumulators of 32 registers
// Decoding a batch of 8: 8 rows × 2 columns, so each vector of B read from memory serves 8 multiply-adds
// (a 4 × 4 tile read it again from cache for the second 4 rows).
constexpr int kDecodeMR = 8, kDecodeNR = 2;
// Its prefetch distance (floats): each value of B now takes 8 multiply-adds, so B is read slower and lines must be
// asked for further ahead to keep enough in flight. 8 rows × 1024 by 3072 × 1024, 2 threads, medians of 3: 256 gave
// 118 GFLOP/s, 2048 gave 142 (512, 1024 and 4096 were no better than 256).
constexpr int64_t kDecodePrefetch = 2048;

// A full tile's sums, added as Lanes::sum adds each (lane k + lane k+8, then +4, +2, +1: the same two numbers meet
// in every addition, so the bits are the same), but for all the tile's elements at once: one shuffle and one vector
// add serve 16 (AVX-512) or 8 (AVX2) additions. With K = 1024 the element-by-element sums took longer than the
// multiply-adds of a 4 × 4 tile.
// Element e of a 16-element tile is acc[e % MR][e / MR]: row e % MR, column e / MR (4 × 4 for prompts, 8 × 2 for a
// decoding batch of 8).
template <int MR, int NR>
void store_sums(const Lanes (&acc)[MR][NR], float alpha, float beta, float* C, int64_t ldc) {
  static_assert(MR * NR == 16);
  auto element = [&](int e) { return acc[e % MR][e / MR].v; };
  // Element e's sum ends in lane 4·(e mod 4) + e / 4 of the final vector.
  __m512 p[8], q[4], r[2];
  for (int j = 0; j < 8; ++j) {  // + 8: element pairs (2j, 2j+1), each half a vector of 8 partial sums
    const __m512 a = element(2 * j), b = element(2 * j + 1);
    p[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // + 4: elements 4i … 4i+3, one 128-bit quarter each
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int h = 0; h < 2; ++h)  // + 2: quarter j holds elements 8h + j and 8h + 4 + j, two partials each
    r[h] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * h], q[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * h], q[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 1: quarter j holds elements j, 4 + j, 8 + j, 12 + j
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float out[16];
  _mm512_store_ps(out, sums);
  for (int e = 0; e < 16; ++e) {
    float& c = C[(e % MR) * ldc + e / MR];
    c = finish(out[4 * (e % 4) + e / 4], alpha, beta, c);
  }
}

// How far ahead (in floats) the tiles ask for B's cache lines. Decoding streams B from memory once per step, and a
// tile does MR multiply-adds per value of B: with MR = 4 the out-of-order window held too few of B's loads in flight
// to cover memory's latency (gemm_rows_nt with 4 rows of A read B at 27 GB/s where 1 row read it at 50).
#ifndef QKV_ROWS_PREFETCH
#define QKV_ROWS_PREFETCH 256
#endif
constexpr int64_t kPrefetch = QKV_ROWS_PREFETCH;

// An MR × NR tile: rows m0… of A against rows n0… of B, each pair one chain of fused multiply-adds over K. With
// Spread, it asks for `next`'s lines as it goes.
template <int MR, int NR, int64_t Ahead = kPrefetch, bool Spread = false>
void tile(int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
          int64_t ldc, const NextTile& next = {}) {
  Lanes acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = Lanes::zero();
  int64_t k = 0;
  NextRequests requests(next);
  for (; k + 16 <= K; k += 16) {
    if constexpr (Spread) requests.at(k, ldb);
    Lanes b[NR];
    for (int n = 0; n < NR; ++n) {
      if constexpr (Ahead > 0) {
        _mm_prefetch(reinterpret_cast<const char*>(B + n * ldb + k + Ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(B + (n + NR) * ldb + k), _MM_HINT_T1);  // the next tile's, into L2
      }
      b[n] = Lanes::load(B + n * ldb + k);
      b[n].keep();
    }
    for (int m = 0; m < MR; ++m) {
      Lanes a = Lanes::load(A + m * lda + k);
      a.keep();
      for (int n = 0; n < NR; ++n) acc[m][n].fma(a, b[n]);
    }
  }
  if (k < K) {  // zeros beyond K add nothing: the lanes still hold term k in lane k mod 16
    Lanes b[NR];
    for (int n = 0; n < NR; ++n) b[n] = Lanes::load_tail(B + n * ldb + k, K - k);
    for (int m = 0; m < MR; ++m) {
      const Lanes a = Lanes::load_tail(A + m * lda + k, K - k);
      for (int n = 0; n < NR; ++n) acc[m][n].fma(a, b[n]);
    }
  }
  if constexpr ((MR == kMR && NR == kNR) || (MR == kDecodeMR && NR == kDecodeNR)) {
    store_sums(acc, alpha, beta, C, ldc);  // a full tile: all its sums at once
  } else {
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) C[m * ldc + n] = finish(acc[m][n].sum(), alpha, beta, C[m * ldc + n]);
  }
}

template <int MR, int64_t Ahead = kPrefetch, bool Spread = false>
void tile_rows(int64_t nr, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
               float beta, float* C, int64_t ldc, const NextTile& next = {}) {
  switch (nr) {
    case 1: tile<MR, 1, Ahead, Spread>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    case 2: tile<MR, 2, Ahead, Spread>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    case 3: if constexpr (kNR >= 3) tile<MR, 3, Ahead, Spread>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    default: if constexpr (kNR >= 4) tile<MR, 4, Ahead, Spread>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
  }
}

// An mr × nr tile (up to kMR × kNR). With Ahead = 0, B's lines are not asked for ahead in its own columns: a tile
// after the first of a column's row groups finds them in L1 already (and with Spread it asks for the next tile's).
template <int64_t Ahead = kPrefetch, bool Spread = false>
void any_tile(int64_t mr, int64_t nr, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
              int64_t ldb, float beta, float* C, int64_t ldc, const NextTile& next = {}) {
  switch (mr) {
    case 1: tile_rows<1, Ahead, Spread>(nr, K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    case 2: tile_rows<2, Ahead, Spread>(nr, K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    case 3: if constexpr (kMR >= 3) tile_rows<3, Ahead, Spread>(nr, K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    default: if constexpr (kMR >= 4) tile_rows<4, Ahead, Spread>(nr, K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
  }
}

// Columns [begin, end) of C for fewer decoding rows than the 8-row tile takes, their rows of A in L1 (40 KiB): row
// groups of 4 over tiles of 4 columns, every group asking for the next tile's lines as it goes (NextTile), as AVX2's
// tiles do. `qkv_session_bench --products`, B from memory, 2 threads, Zen 5, against the first group's requests
// (256 floats ahead, the next tile into L2): one row read B 3072 × 1024 at 36 → 45 GB/s, 1024 × 3072 at 35 → 42; 4
// rows ran 66 → 78 GFLOP/s. (For 8 rows it measured 80 → 90 there, but batches of 8 in the sessions bench decoded
// 5-10% slower than with the 8 × 2 tile, which they keep.) Not inlined, so gemm_rows_nt's other tiles compile as they
// did (inlined there, the tiles for 24 rows ran 0.6× as fast).
[[gnu::noinline]] void decode_spread(int64_t M, int64_t begin, int64_t end, int64_t K, float alpha, const float* A,
                                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int groups = static_cast<int>((M + kMR - 1) / kMR);
  for (int64_t n = begin; n < end; n += kNR) {
    const int64_t nr = std::min<int64_t>(kNR, end - n), following = std::min<int64_t>(kNR, end - n - nr);
    for (int64_t m = 0; m < M; m += kMR)
      any_tile<0, true>(std::min<int64_t>(kMR, M - m), nr, K, alpha, A + m * lda, lda, B + n * ldb, ldb, beta,
                        C + m * ldc + n, ldc,
                        NextTile{following > 0 ? B + (n + nr) * ldb : nullptr, following, static_cast<int>(m / kMR), groups});
  }
}
#elif defined(QKV_AVX2)
constexpr int kNR = 6;  // threads' slices of columns: whole tiles of 2 and of 3 columns

// ---- AVX2: fewer rows than a packed product takes (decoding), tiles that take each step's lanes half at a time ----
//
// A tile of whole 16-lane accumulators needs two registers for each of them and for each value of B and of A: of
// AVX2's 16 registers a 2 × 2 tile fills 14 and loads a vector for every multiply-add. Taking lanes 0-7 of a step for
// every element of the tile, then lanes 8-15, needs one register for each of B's NR vectors and one for A's: a 3 × 2
// tile holds its 12 accumulators in 15 registers and loads 5 vectors for 6 multiply-adds. Each accumulator still takes
// its terms in simd::dot's order (lane l: k = l, l + 16, …), so the bits are the same.
//
// The tiles of a column pair run one after the other (row groups of 3) with B in L1 after the first; meanwhile every
// tile asks for the next pair's lines, each group one step in `groups`, so the requests are spread over the whole
// time the pair takes instead of made by the first tile alone. Against the 2 × 2 tiles (whose first row group asked
// for lines 256 floats ahead into L1 and for the next pair's into L2), `qkv_session_bench --products` built for AVX2
// on Zen 5, B 3072 × 1024 from memory, two alternating runs each: one row read B at 17.0-17.9 → 22.5-25.9 GB/s on
// one thread and 30-32 → 48 on two (read bandwidth 25-30 and 51); 8 rows ran 50-52 → 52-67 GFLOP/s on one thread,
// 88-97 → 90-93 on two, and 104-112 on two once the sums went four at a time (lane_sums4).

// Four elements' 16-lane sums (lanes 0-7 in lo, 8-15 in hi), added as simd::dot adds its lanes (lane k + lane k+8,
// then +4, +2, +1: the same two numbers meet in every addition, so the bits are the same) with one vector addition
// serving four or eight of them.
inline void lane_sums4(const __m256 (&lo)[4], const __m256 (&hi)[4], float (&out)[4]) {
  __m256 e[4];  // + 8: each element's 8 partial sums
  for (int i = 0; i < 4; ++i) e[i] = _mm256_add_ps(lo[i], hi[i]);
  __m256 q[2];  // + 4: elements 2i (low half) and 2i + 1 (high half), 4 partials each
  for (int i = 0; i < 2; ++i)
    q[i] = _mm256_add_ps(_mm256_permute2f128_ps(e[2 * i], e[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(e[2 * i], e[2 * i + 1], 0x31));
  // + 2: the low half holds elements 0 and 2, the high half 1 and 3, two partials each; + 1 by pairs
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_hadd_ps(r, r));  // [e0, e2, e0, e2 | e1, e3, e1, e3]
  out[0] = s[0], out[1] = s[4], out[2] = s[1], out[3] = s[5];
}

// Not inlined: inlined into decode_columns (which GCC chose for some shapes and not others as the code around moved),
// 4 and 8 rows ran 10-20% slower.
template <int MR, int NR>
[[gnu::noinline]] void halves_tile(int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                 float* C, int64_t ldc, const NextTile& next) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) lo[m][n] = hi[m][n] = _mm256_setzero_ps();
  NextRequests requests(next);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    requests.at(k, ldb);
    __m256 b[NR];
    for (int n = 0; n < NR; ++n) {
      b[n] = _mm256_loadu_ps(B + n * ldb + k);
      asm("" : "+x"(b[n]));  // kept in a register (see the AVX-512 Lanes::keep)
    }
    for (int m = 0; m < MR; ++m) {
      __m256 a = _mm256_loadu_ps(A + m * lda + k);
      asm("" : "+x"(a));
      for (int n = 0; n < NR; ++n) lo[m][n] = _mm256_fmadd_ps(a, b[n], lo[m][n]);
    }
    for (int n = 0; n < NR; ++n) {
      b[n] = _mm256_loadu_ps(B + n * ldb + k + 8);
      asm("" : "+x"(b[n]));
    }
    for (int m = 0; m < MR; ++m) {
      __m256 a = _mm256_loadu_ps(A + m * lda + k + 8);
      asm("" : "+x"(a));
      for (int n = 0; n < NR; ++n) hi[m][n] = _mm256_fmadd_ps(a, b[n], hi[m][n]);
    }
  }
  if (k < K)  // zeros beyond K add nothing: the lanes still hold term k in lane k mod 16
    for (int n = 0; n < NR; ++n) {
      alignas(32) float b[16] = {};
      std::copy(B + n * ldb + k, B + n * ldb + K, b);
      for (int m = 0; m < MR; ++m) {
        alignas(32) float a[16] = {};
        std::copy(A + m * lda + k, A + m * lda + K, a);
        lo[m][n] = _mm256_fmadd_ps(_mm256_load_ps(a), _mm256_load_ps(b), lo[m][n]);
        hi[m][n] = _mm256_fmadd_ps(_mm256_load_ps(a + 8), _mm256_load_ps(b + 8), hi[m][n]);
      }
    }
  // The sums, four elements at a time (lane_sums4; a 3 × 2 tile's six one by one took about a fifth of its time)
  constexpr int E = MR * NR;
  for (int e0 = 0; e0 < E; e0 += 4) {
    __m256 l4[4], h4[4];
    for (int i = 0; i < 4; ++i) {
      const int e = std::min(e0 + i, E - 1);  // (past the tile: an element again, its sum not stored)
      l4[i] = lo[e / NR][e % NR];
      h4[i] = hi[e / NR][e % NR];
    }
    float sums[4];
    lane_sums4(l4, h4, sums);
    for (int i = 0; i < 4 && e0 + i < E; ++i) {
      float& c = C[(e0 + i) / NR * ldc + (e0 + i) % NR];
      c = finish(sums[i], alpha, beta, c);
    }
  }
}

template <int MR>
void halves_tile_columns(int64_t nr, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                         int64_t ldb, float beta, float* C, int64_t ldc, const NextTile& next) {
  switch (nr) {
    case 1: halves_tile<MR, 1>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    case 2: halves_tile<MR, 2>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
    default: if constexpr (MR <= 2) halves_tile<MR, 3>(K, alpha, A, lda, B, ldb, beta, C, ldc, next); break;
  }
}

// Columns [begin, end) of C for fewer rows than the packed products take (not inlined: inlined in gemm_rows_nt it
// made GCC inline the other tiles there, and 24 rows ran 0.6× as fast): one or two rows in 1 × 3 and 2 × 3 tiles (one
// group, so its own requests for the next columns), more in row groups of 3 over column pairs.
[[gnu::noinline]] void decode_columns(int64_t M, int64_t begin, int64_t end, int64_t K, float alpha, const float* A,
                                      int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t NR = M <= 2 ? 3 : 2;
  const int groups = static_cast<int>((M + 2) / 3);
  for (int64_t n = begin; n < end; n += NR) {
    const int64_t nr = std::min(NR, end - n), following = std::min(NR, end - n - nr);
    for (int64_t m = 0; m < M; m += 3) {
      const float* a = A + m * lda;
      float* c = C + m * ldc + n;
      const NextTile next{following > 0 ? B + (n + nr) * ldb : nullptr, following, static_cast<int>(m / 3), groups};
      switch (std::min<int64_t>(3, M - m)) {
        case 1: halves_tile_columns<1>(nr, K, alpha, a, lda, B + n * ldb, ldb, beta, c, ldc, next); break;
        case 2: halves_tile_columns<2>(nr, K, alpha, a, lda, B + n * ldb, ldb, beta, c, ldc, next); break;
        default: halves_tile_columns<3>(nr, K, alpha, a, lda, B + n * ldb, ldb, beta, c, ldc, next); break;
      }
    }
  }
}
#else
constexpr int kMR = 1, kNR = 1;
template <int64_t = 0, bool = false>  // (the vector tiles' prefetch distance and requests: none here)
void any_tile(int64_t, int64_t, int64_t K, float alpha, const float* A, int64_t, const float* B, int64_t, float beta,
              float* C, int64_t, const NextTile& = {}) {
  C[0] = finish(simd::dot(A, B, K), alpha, beta, C[0]);
}
#endif


#if defined(QKV_AVX2)
// ---- many rows (prompts): packed operands, vectors along the columns ----
//
// The tiles above hold one 16-lane accumulator per element, so each multiply-add serves one element and a 4 × 4 tile
// needs a load of A or B for every two multiply-adds; prompts ran at about a third of the FMA peak. Here a vector
// holds W elements of a row of C instead (W columns), and lane l of simd::dot — the chain of fused multiply-adds over
// k = l, l + 16, l + 32, … in that order — is computed for those W columns at once: one value of A, broadcast, and
// one vector of B serve W multiply-adds. The 16 lane chains of a tile run one after another and are added pairwise
// as simd::dot adds them (8, 4, 2, 1), so every element has simd::dot's bits.
//
// Both operands are packed by lane: A's panel of PR rows as [lane][j][row], B's panel of PC columns as
// [lane][j][column], term k = lane + 16·j, zero past K (0 · 0 adds +0, which leaves every partial sum as it is: a
// chain that starts at +0 never holds −0).
namespace packed {
#if defined(QKV_AVX512)
using V = __m512;
constexpr int W = 16, PR = 8;  // 8 rows × 32 columns: 16 accumulators
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vset(float x) { return _mm512_set1_ps(x); }
#else
using V = __m256;
constexpr int W = 8, PR = 6;  // 6 rows × 16 columns: 12 accumulators of 16 registers
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vset(float x) { return _mm256_set1_ps(x); }
#endif
constexpr int PC = 2 * W;   // columns of a panel of B: two vectors
constexpr int kLanes = 16;  // simd::dot's lanes

#if defined(QKV_AVX512)
// Transposes 16 × 16 in registers: r[i] lane c becomes r[c] lane i.
inline void transpose(V (&r)[W]) {
  V t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane s: rows i, i+1 of columns 4s, 4s+1 (lo) and 4s+2, 4s+3 (hi)
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + q], 128-bit lane s: rows i … i+3 of column 4s + q
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int q = 0; q < 4; ++q) {  // gather the 128-bit lanes: column 4s + q from r[q], r[4+q], r[8+q], r[12+q]
    const V a = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88), b = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xDD);
    const V c = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88), d = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xDD);
    t[q] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + q] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[4 + q] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#else
// Transposes 8 × 8 in registers: r[i] lane c becomes r[c] lane i.
inline void transpose(V (&r)[W]) {
  V t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + q], 128-bit lane s: rows i … i+3 of column 4s + q
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
    r[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
  }
}
#endif

// A's rows m0 … m0 + PR (zero past M) as [lane][j][row]: J·16·PR floats. A is small beside B (M·K against N·K).
void pack_a(int64_t M, int64_t K, int64_t J, const float* A, int64_t lda, int64_t m0, float* out) {
  for (int r = 0; r < PR; ++r) {
    const int64_t m = m0 + r;
    for (int64_t j = 0; j < J; ++j)
      for (int l = 0; l < kLanes; ++l) {
        const int64_t k = j * kLanes + l;
        out[(l * J + j) * PR + r] = m < M && k < K ? A[m * lda + k] : 0.0f;
      }
  }
}

// B's rows (C's columns) n0 … n0 + PC (zero past N) as [lane][j][column]: J·16·PC floats. Each W × W block of
// (columns, lanes) is one transpose in registers; blocks cut short by N or K are copied one by one.
void pack_b(int64_t N, int64_t K, int64_t J, const float* B, int64_t ldb, int64_t n0, float* out) {
  for (int64_t j = 0; j < J; ++j)
    for (int l0 = 0; l0 < kLanes; l0 += W)
      for (int c0 = 0; c0 < PC; c0 += W) {
        const int64_t k0 = j * kLanes + l0;
        if (n0 + c0 + W <= N && k0 + W <= K) {
          V r[W];
          for (int c = 0; c < W; ++c) r[c] = vload(B + (n0 + c0 + c) * ldb + k0);
          transpose(r);
          for (int l = 0; l < W; ++l) vstore(out + ((l0 + l) * J + j) * PC + c0, r[l]);
        } else {
          for (int l = 0; l < W; ++l)
            for (int c = 0; c < W; ++c) {
              const int64_t n = n0 + c0 + c, k = k0 + l;
              out[((l0 + l) * J + j) * PC + c0 + c] = n < N && k < K ? B[n * ldb + k] : 0.0f;
            }
        }
      }
}

// One lane's chains for a PR × PC tile: out[r][v] over j = 0 … J − 1, in order. (In locals: the vector types may
// alias the packed floats, and GCC stored accumulators held in `out` at every step, half the speed built for AVX2.)
inline void lane_chains(int64_t J, const float* a, const float* b, V (&out)[PR][2]) {
  V acc[PR][2];
  for (int r = 0; r < PR; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t j = 0; j < J; ++j) {
    const V b0 = vload(b + j * PC), b1 = vload(b + j * PC + W);
    for (int r = 0; r < PR; ++r) {
      const V x = vbroadcast(a + j * PR + r);
      acc[r][0] = vfma(x, b0, acc[r][0]);
      acc[r][1] = vfma(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < PR; ++r) out[r][0] = acc[r][0], out[r][1] = acc[r][1];
}

// A tile: the 16 lanes' chains, added as simd::dot adds them. Lane order 0, 8, 4, 12, 2, 10, … visits the pairwise
// tree depth first: ((l0 + l8) + (l4 + l12)) + … ; a finished subtree waits on a stack until its sibling is done.
void tile(int64_t rows, int64_t cols, int64_t J, const float* a, const float* b, float alpha, float beta, float* C,
          int64_t ldc) {
  static constexpr int order[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  alignas(64) float stack[5][PR][PC];
  int level[5], depth = 0;
  V acc[PR][2];
  for (int i = 0; i < kLanes; ++i) {
    const int l = order[i];
    lane_chains(J, a + l * J * PR, b + l * J * PC, acc);
    int lv = 0;
    while (depth > 0 && level[depth - 1] == lv) {  // its left sibling is done: add them (a + b = b + a, bit for bit)
      --depth;
      for (int r = 0; r < PR; ++r)
        for (int v = 0; v < 2; ++v) acc[r][v] = vadd(vload(stack[depth][r] + v * W), acc[r][v]);
      ++lv;
    }
    if (i + 1 < kLanes) {
      for (int r = 0; r < PR; ++r)
        for (int v = 0; v < 2; ++v) vstore(stack[depth][r] + v * W, acc[r][v]);
      level[depth++] = lv;
    }
  }
  // α·dot, or α·dot + β·c as one fused multiply-add: finish()'s arithmetic, W elements at a time
  alignas(64) float out[PR][PC];
  const V va = vset(alpha), vb = vset(beta);
  for (int r = 0; r < PR; ++r)
    for (int v = 0; v < 2; ++v) {
      V s = vmul(va, acc[r][v]);
      if (beta != 0.0f) {
        alignas(64) float c[W] = {};
        for (int e = 0; e < W && v * W + e < cols && r < rows; ++e) c[e] = C[r * ldc + v * W + e];
        s = vfma(va, acc[r][v], vmul(vb, vload(c)));
      }
      vstore(out[r] + v * W, s);
    }
  for (int64_t r = 0; r < rows; ++r) std::copy(out[r], out[r] + cols, C + r * ldc);
}

// Columns of B packed at once by a thread: their panels stay in L2 while every panel of A passes over them (half of
// Zen 3's 512 KiB; 128 KiB to 512 KiB ran the same on Zen 5)
constexpr int64_t kBlockBytes = 256 * 1024;

void product(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float beta, float* C, int64_t ldc, int threads) {
  const int64_t J = (K + kLanes - 1) / kLanes, apanel = J * kLanes * PR, bpanel = J * kLanes * PC;
  const int64_t apanels = (M + PR - 1) / PR;
  static thread_local std::vector<float> packed_a;
  packed_a.resize(static_cast<size_t>(apanels * apanel));
  float* pa = packed_a.data();
  const int parts = std::max(1, threads);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int64_t p = 0; p < apanels; ++p) pack_a(M, K, J, A, lda, p * PR, pa + p * apanel);
  const int64_t panels = (N + PC - 1) / PC;
  const int64_t per_block = std::max<int64_t>(1, kBlockBytes / (bpanel * int64_t{sizeof(float)}));
#pragma omp parallel num_threads(parts) if (parts > 1)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = panels * t / nt, end = panels * (t + 1) / nt;  // this thread's columns, in panels
    static thread_local std::vector<float> packed_b;
    packed_b.resize(static_cast<size_t>(per_block * bpanel));
    for (int64_t q0 = begin; q0 < end; q0 += per_block) {
      const int64_t q1 = std::min(end, q0 + per_block);
      for (int64_t q = q0; q < q1; ++q) pack_b(N, K, J, B, ldb, q * PC, packed_b.data() + (q - q0) * bpanel);
      for (int64_t p = 0; p < apanels; ++p)
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t m0 = p * PR, n0 = q * PC;
          tile(std::min<int64_t>(PR, M - m0), std::min<int64_t>(PC, N - n0), J, pa + p * apanel,
               packed_b.data() + (q - q0) * bpanel, alpha, beta, C + m0 * ldc + n0, ldc);
        }
    }
  }
}
}  // namespace packed

// From this many rows of A on, the packed products (prompts); fewer rows (decoding) run the tiles. Packing B costs
// N·K whatever M. 3072 × 1024 on Zen 5, 2 threads: the tiles ran 150 GFLOP/s at 24–208 rows, the packed products
// 110–125 at 24, 135–140 at 32, 175–200 at 64, 220–250 at 208 (AVX-512); built for AVX2, 70 against 70 at 24 rows
// and 140 against 74 at 208.
#if defined(QKV_AVX512)
constexpr int64_t kPackedRows = 48;
#else
constexpr int64_t kPackedRows = 32;
#endif
#endif

}  // namespace

RowIndependentProducts::RowIndependentProducts() { ++g_row_independent; }
RowIndependentProducts::~RowIndependentProducts() { --g_row_independent; }
bool RowIndependentProducts::active() { return g_row_independent > 0; }

void gemm_rows_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                  int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
#if defined(QKV_AVX2)
  if (M >= kPackedRows) {
    packed::product(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, omp_in_parallel() ? 1 : omp_get_max_threads());
    return;
  }
#endif
  // Threads own slices of columns (rows of B, read once per slice); within a slice (AVX-512 and scalar), blocks of
  // columns small enough to stay in L2 (≈ 192 KiB of B) are multiplied with every row of A in turn.
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int parts = static_cast<double>(M) * N * K < 65536.0 ? 1 : std::max(1, threads);
  const int64_t slice = ((N + parts - 1) / parts + kNR - 1) / kNR * kNR;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int p = 0; p < parts; ++p) {
    const int64_t begin = std::min(N, p * slice), end = std::min(N, begin + slice);
#if defined(QKV_AVX2) && !defined(QKV_AVX512)
    decode_columns(M, begin, end, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
#if defined(QKV_AVX512)
    if (M < kDecodeMR && M * K * int64_t{sizeof(float)} <= 40 * 1024) {
      decode_spread(M, begin, end, K, alpha, A, lda, B, ldb, beta, C, ldc);
      continue;
    }
#endif
    const int64_t block = std::max<int64_t>(kNR, (int64_t{48} * 1024 / std::max<int64_t>(K, 1)) / kNR * kNR);
    for (int64_t n0 = begin; n0 < end; n0 += block) {
      const int64_t n1 = std::min(end, n0 + block);
#if defined(QKV_AVX512)
      // Decoding a batch whose rows of A stay in L1 (8 rows of K ≤ 1280): 8-row tiles, then any row left in smaller
      // ones. With more rows, or longer ones, each pass over 2 columns would fetch A again from L2: 12 and 16 rows of
      // K = 1024 ran 0.8–0.9× the 4 × 4 tiles below.
      if (M >= kDecodeMR && M * K * int64_t{sizeof(float)} <= 40 * 1024) {
        for (int64_t n = n0; n < n1; n += kDecodeNR) {
          const int64_t nr = std::min<int64_t>(kDecodeNR, n1 - n);
          int64_t m = 0;
          for (; m + kDecodeMR <= M; m += kDecodeMR) {
            if (nr == kDecodeNR)
              tile<kDecodeMR, kDecodeNR, kDecodePrefetch>(K, alpha, A + m * lda, lda, B + n * ldb, ldb, beta, C + m * ldc + n, ldc);
            else
              tile<kDecodeMR, 1, kDecodePrefetch>(K, alpha, A + m * lda, lda, B + n * ldb, ldb, beta, C + m * ldc + n, ldc);
          }
          for (; m < M; m += kMR)
            any_tile(std::min<int64_t>(kMR, M - m), nr, K, alpha, A + m * lda, lda, B + n * ldb, ldb, beta,
                     C + m * ldc + n, ldc);
        }
        continue;
      }
#endif
      if (M <= 16) {  // decoding: each tile of B serves every row group while it is in L1
        for (int64_t n = n0; n < n1; n += kNR)
          for (int64_t m = 0; m < M; m += kMR)
            (m == 0 ? any_tile<> : any_tile<0>)(std::min<int64_t>(kMR, M - m), std::min<int64_t>(kNR, n1 - n), K, alpha,
                                                 A + m * lda, lda, B + n * ldb, ldb, beta, C + m * ldc + n, ldc,
                                                 NextTile{});
        continue;
      }
      for (int64_t m = 0; m < M; m += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m);
        for (int64_t n = n0; n < n1; n += kNR)
          any_tile(mr, std::min<int64_t>(kNR, n1 - n), K, alpha, A + m * lda, lda, B + n * ldb, ldb, beta,
                   C + m * ldc + n, ldc);
      }
    }
#endif
  }
}

void gemm_rows_nt_reference(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      C[m * ldc + n] = finish(simd::dot(A + m * lda, B + n * ldb, K), alpha, beta, C[m * ldc + n]);
}

}  // namespace qkv::kernels
