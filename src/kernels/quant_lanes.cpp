// Q4_0, Q8_0, Q4_K and Q5_K weights times 8-bit activations with the rows of W in the lanes (AVX-512 VNNI builds;
// AVX2 builds at the end; the K-quants' unpacking, shared, before both; see quant_dot.hpp).
//
// The one-row kernels of quant_dot.cpp give each block of a weight row 4 (Q4_0) or 8 (Q8_0) of a vector's 16 int32
// lanes, so every 64–128 values of a row of W against a row of X cost one or two vpdpbusd and three float operations
// (convert, scale, add), and a horizontal sum at the end: at 512 rows of X they ran at ~30 products per cycle, short
// of llama.cpp's. Here 16 rows of W (a tile) share each vector, one lane each: block b of the tile is 8 vectors of
// unsigned levels (vector c, lane n: values 4c … 4c + 3 of row n; Q4_0's nibbles q + 8, Q8_0's q + 128), so the 32
// values of a block against a row of X are 8 vpdpbusd with that row's 4 bytes broadcast, and one float multiply-add
// per block serves 16 rows of W.
//
// A row of Y is the sum of 8 chains of its blocks' products (below, "few rows of X"): the same whatever the number of
// rows of X, their place among the others or the threads, so a batch gives each sequence the values it gets alone,
// and computed the same way in both builds.
//   few rows of X (generation): each row of W read alone, one stream, as the one-row kernels read it;
//   more rows: a tile of rows of W is unpacked once into a buffer (AVX-512: 576 bytes per block, 18 KiB at K = 1024,
//     in L1 or L2) and every group of 4 rows of X passes over it, each block into its chain.
// Against the one-row kernels (Qwen3-0.6B's shapes, one Zen 5 thread, alternating builds): 512 rows of X, Q4_0 and
// Q8_0 products ~2.5–3× faster (Q8_0 3072 × 1024: 148 → 410–459 GFLOP/s, with one chain per row; 8 chains cost the
// tiles 5–10%).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_blocks.hpp"
#include "quant_dot.hpp"
#include "simd.hpp"

namespace qkv::kernels::quant {

namespace {

[[maybe_unused]] int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

[[maybe_unused]] uint16_t load_u16(const void* p) {  // (the AVX2 build's)
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Both builds' walks over W and X (their tiles differ in width and vectors, not in these loops).

// The rows of a tile of Rows rows of W: rows 4j … 4j + 3 at base[j] + {0, 1, 2, 3}·bytes, each address one base
// register and one index register (bytes, 2·bytes as a scaled index, 3·bytes). With the 16 addresses written plainly,
// GCC kept 16 row pointers, which do not fit in the registers (it moved them through vector registers: a third of the
// loop).
template <int Rows>
struct TileRows {
  const unsigned char* base[Rows / 4];
  int64_t bytes, bytes3;
  const unsigned char* row(int n, int64_t at) const {
    const int k = n % 4;
    return base[n / 4] + at + (k == 0 ? 0 : k == 1 ? bytes : k == 2 ? 2 * bytes : bytes3);
  }
};

template <int Rows>
TileRows<Rows> tile_rows(const unsigned char* first, int64_t bytes) {
  TileRows<Rows> rows;
  for (int j = 0; j < Rows / 4; ++j) rows.base[j] = first + 4 * j * bytes;
  rows.bytes = bytes;
  rows.bytes3 = 3 * bytes;
  // hidden from the compiler, so that it computes each address from these rather than keeping one per row
  asm("" : "+r"(rows.bytes), "+r"(rows.bytes3));
  return rows;
}

// Calls f(first, valid, n0) for each tile of `tile` rows of W from row n0: `valid` of them real, the last partial
// tile copied into `tail` beside zero rows, so that every tile reads `tile` rows `row_bytes` apart.
template <class F>
void each_tile(const unsigned char* base, int64_t row_bytes, int64_t rows, int64_t tile, std::vector<unsigned char>& tail,
               F&& f) {
  for (int64_t n0 = 0; n0 < rows; n0 += tile) {
    const int valid = static_cast<int>(std::min<int64_t>(tile, rows - n0));
    const unsigned char* first = base + n0 * row_bytes;
    if (valid < tile) {
      tail.assign(static_cast<size_t>(tile * row_bytes), 0);
      std::memcpy(tail.data(), first, static_cast<size_t>(valid * row_bytes));
      first = tail.data();
    }
    f(first, valid, n0);
  }
}

// Calls f(std::integral_constant<int, R>{}, m0) for rows m0 … m0 + R − 1 of X, R ≤ 4, over `count` rows. (Groups of 8
// rows ran 10% slower at 512 rows in the AVX-512 tiles.)
template <class F>
void each_group(int count, F&& f) {
  for (int m0 = 0; m0 < count; m0 += 4) {
    switch (std::min(4, count - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      default: f(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

#if defined(QKV_DOT256)  // (both builds: the AVX-512 one has AVX2 too)

// The 32 bytes at `at` of each of the tile's 8 rows as the rows of an 8 × 8 matrix of dwords, transposed: v[c] lane n
// holds bytes 4c … 4c + 3 of row n.
[[gnu::always_inline]] inline void transpose_rows(const TileRows<8>& rows, int64_t at, __m256i* v) {
  for (int n = 0; n < 8; ++n) v[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.row(n, at)));
  __m256i t[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]);
    t[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
    v[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
  }
}

// ---- Q4_K and Q5_K blocks with the rows of W in the lanes (both builds' tiles) ----
// 8 rows of W per vector, their blocks unpacked once: levels, scales and mins side by side, one row per int32 lane.

template <bool five_bits>
struct alignas(32) KTileBlock {
  static constexpr bool kFiveBits = five_bits;
  __m256i q[64];     // q[8j + c] lane n: values 32j + 4c … 32j + 4c + 3 of row n (levels 0 … 15, Q5_K's 0 … 31)
  __m256i scale[8];  // lane n: sub-block j's scale in row n, in both int16 halves
  __m256i mins[4];   // lane n: the mins of sub-blocks 2p (low int16) and 2p + 1 (high int16) of row n
  __m256 d, dmin;    // lane n: row n's
};
static_assert(sizeof(KTileBlock<false>) == 2496, "a K tile block is 39 cache lines");

// The block at `at` of 8 rows of Q4_K or Q5_K, unpacked.
template <bool five_bits>
void unpack_k_block(const TileRows<8>& rows, int64_t at, KTileBlock<five_bits>& t) {
  using Block = std::conditional_t<five_bits, BlockQ5_K, BlockQ4_K>;
  constexpr int64_t kQs = offsetof(Block, qs);
  const __m256i nibble = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
  __m256i high_bits[8];  // Q5_K: bit 2p (2p + 1) of byte l is the fifth bit of value 64p + l (64p + 32 + l)
  if constexpr (five_bits) transpose_rows(rows, at + offsetof(BlockQ5_K, qh), high_bits);
  for (int p = 0; p < 4; ++p) {  // 64 values: sub-blocks 2p (low nibbles) and 2p + 1 (high)
    __m256i v[8];
    transpose_rows(rows, at + kQs + 32 * p, v);
    for (int c = 0; c < 8; ++c) {
      __m256i low = _mm256_and_si256(v[c], nibble), high = _mm256_and_si256(_mm256_srli_epi16(v[c], 4), nibble);
      if constexpr (five_bits) {  // (16-bit shifts by at most 4: each byte's bit stays in its byte)
        const __m256i h = high_bits[c];
        const auto moved = [&](int bit) {
          return bit < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - bit)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(bit - 4));
        };
        low = _mm256_or_si256(low, _mm256_and_si256(moved(2 * p), bit4));
        high = _mm256_or_si256(high, _mm256_and_si256(moved(2 * p + 1), bit4));
      }
      _mm256_store_si256(t.q + 8 * (2 * p) + c, low);
      _mm256_store_si256(t.q + 8 * (2 * p + 1) + c, high);
    }
  }
  // The 8 rows' scales and mins (16 bytes each: scales 0–7, mins 0–7), a byte transpose: after three rounds of
  // interleaving, e[k] holds scale 2k of rows 0–7, then scale 2k + 1 of rows 0–7 (and then the same for the mins).
  __m128i sm[8];
  for (int n = 0; n < 8; ++n) sm[n] = unpack_scales_mins(rows.row(n, at + 4));
  __m128i a[8], c[8];
  for (int k = 0; k < 4; ++k) {
    a[k] = _mm_unpacklo_epi8(sm[2 * k], sm[2 * k + 1]);      // scales of rows 2k, 2k + 1 interleaved
    a[k + 4] = _mm_unpackhi_epi8(sm[2 * k], sm[2 * k + 1]);  // their mins
  }
  for (int k = 0; k < 8; k += 4) {
    c[k] = _mm_unpacklo_epi16(a[k], a[k + 1]);  // values 0–3 of rows 0–3
    c[k + 1] = _mm_unpackhi_epi16(a[k], a[k + 1]);  // values 4–7 of rows 0–3
    c[k + 2] = _mm_unpacklo_epi16(a[k + 2], a[k + 3]);  // values 0–3 of rows 4–7
    c[k + 3] = _mm_unpackhi_epi16(a[k + 2], a[k + 3]);
  }
  const auto pair_of = [](__m128i e) {  // 8 bytes, one per row, as int32 lanes; then the next 8
    return std::pair{_mm256_cvtepu8_epi32(e), _mm256_cvtepu8_epi32(_mm_srli_si128(e, 8))};
  };
  for (int half = 0; half < 2; ++half) {  // the scales, then the mins
    const __m128i* cc = c + 4 * half;
    const __m128i e[4] = {_mm_unpacklo_epi32(cc[0], cc[2]), _mm_unpackhi_epi32(cc[0], cc[2]),
                          _mm_unpacklo_epi32(cc[1], cc[3]), _mm_unpackhi_epi32(cc[1], cc[3])};
    for (int k = 0; k < 4; ++k) {
      const auto [even, odd] = pair_of(e[k]);  // values 2k and 2k + 1 of the 8 rows
      if (half == 0) {
        _mm256_store_si256(t.scale + 2 * k, _mm256_or_si256(even, _mm256_slli_epi32(even, 16)));
        _mm256_store_si256(t.scale + 2 * k + 1, _mm256_or_si256(odd, _mm256_slli_epi32(odd, 16)));
      } else {
        _mm256_store_si256(t.mins + k, _mm256_or_si256(even, _mm256_slli_epi32(odd, 16)));
      }
    }
  }
  alignas(16) uint16_t halves[16];
  for (int n = 0; n < 8; ++n) {
    halves[n] = load_u16(rows.row(n, at));
    halves[8 + n] = load_u16(rows.row(n, at + 2));
  }
  _mm256_store_ps(reinterpret_cast<float*>(&t.d), _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves))));
  _mm256_store_ps(reinterpret_cast<float*>(&t.dmin),
                  _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves + 8))));
}

// ---- Q4_0 and Q8_0, few rows of X: each row of W read alone, its blocks in 8 chains (both builds) ----
// A row of Y is y = ((c₀ + c₁) + (c₄ + c₅)) + ((c₂ + c₃) + (c₆ + c₇)), where chain c_j ← fma(float(Σ w·q), d_w·d_x,
// c_j) over the blocks b ≡ j (mod 8) in order, from +0 (the integer sums exact; Q4_0's w the nibble − 8): the same
// whatever the number of rows of X, their place among the others or the threads, and computed the same way in both
// builds. For few rows of X (generation, and batches of up to kLanesDirectRows rows: groups of 4 rows of X in turn
// over chunks of W that stay in the caches) each row of W is read alone, one sequential stream; a tree of vphaddd
// turns 8 blocks' partial sums into their exact sums, one per lane, so one multiply-add per 8 blocks advances all 8
// chains. The tiles for more rows (each build's, below) add each block into the same chains.
//
// Why not the tiles for few rows too: to multiply as it reads, a tile must read its 8 or 16 rows side by side, and
// that many streams a row's width apart read memory slower than one (software prefetches and all). The AVX-512 build
// did so (one chain per row, 16 rows transposed as read) until a later stop: its one-row products read W at 61–84% of
// one thread's read bandwidth, where this kernel reads 100–114% (docs/performance.md, "One stream per row of W on
// AVX-512 too").

constexpr int64_t kRowPrefetchBytes = 8192;  // quant_dot.cpp's distance for a thread's one stream of W

// The lane of block k of a group of 8 in the few-rows kernel's vectors: the even blocks in the low half.
constexpr int lane_of(int k) { return (k % 2) * 4 + k / 2; }

// The sum of the 8 chains, held as lane_of places them: the halves added, then lanes 2, 3 to 0, 1, then those two.
[[gnu::always_inline]] inline float sum_chains(__m256 c) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));  // c0+c1, c2+c3, c4+c5, c6+c7
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (c0+c1)+(c4+c5), (c2+c3)+(c6+c7)
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The end of a row of W for the few-rows kernels: its last blocks in plain C++ (rows whose length is not a multiple of
// 256; exact(r, b) is block b's exact integer sum against row r of X), whose lanes past the end multiply 0 by 0 and
// leave their chains as they are; then out[r·ld] = the chains' sum (+ beta·out).
template <int R, class Exact>
[[gnu::always_inline]] inline void finish_row(const unsigned char* row, int64_t block_bytes, int64_t blocks,
                                              const __m256* dx, int64_t groups, __m256* acc, Exact&& exact, float beta,
                                              float* out, int64_t ld) {
  const int64_t full = blocks / 8;
  if (full < groups) {
    alignas(32) float d[8] = {};
    for (int64_t b = 8 * full; b < blocks; ++b)
      d[lane_of(static_cast<int>(b - 8 * full))] = half_to_float(load_u16(row + b * block_bytes));
    for (int r = 0; r < R; ++r) {
      alignas(32) int32_t sums[8] = {};
      for (int64_t b = 8 * full; b < blocks; ++b) sums[lane_of(static_cast<int>(b - 8 * full))] = exact(r, b);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums))),
                               _mm256_mul_ps(_mm256_load_ps(d), dx[r * groups + full]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float y = sum_chains(acc[r]);
    out[r * ld] = beta == 0.0f ? y : y + beta * out[r * ld];
  }
}

// Rows of W against R ≤ 4 rows of X; dx[r·groups + g] lane lane_of(k): row r's scale of block 8g + k (0 past the end).
// Each group of 8 blocks is one loop step: the rows' exact block sums, then one multiply-add per row of X.
template <int R>
void rows_q4_0(const unsigned char* w, int64_t bytes, int64_t rows, int64_t blocks, const Q8Block* const* x,
               const __m256* dx, float beta, float* out, int64_t ld) {
  constexpr int64_t kBlockBytes = sizeof(BlockQ4_0);
  const int64_t full = blocks / 8, groups = (blocks + 7) / 8;
#if defined(QKV_DOT512)
  const Q4_0Quad* quads[R];
  for (int r = 0; r < R; ++r) quads[r] = reinterpret_cast<const Q4_0Quad*>(x[r] + blocks);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  auto q16 = [](const unsigned char* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  // block k's exact sums against every row of X: 4 blocks per vector (block k's 16 bytes in its 128-bit lane k),
  // their int32 lanes 4k … 4k + 3 from Q4_0Quad's bias; the halves of the two vectors are then the AVX2 build's four
  // pairs of blocks, summed by the same tree
  auto group_sums = [&](const unsigned char* at, int64_t g, __m256i* sums) {
    __m512i low[2], high[2];
    for (int h = 0; h < 2; ++h) {
      const unsigned char* q = at + 4 * h * kBlockBytes + 2;
      const __m512i v = _mm512_inserti32x4(
          _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q16(q)), q16(q + kBlockBytes), 1),
                             q16(q + 2 * kBlockBytes), 2),
          q16(q + 3 * kBlockBytes), 3);
      low[h] = _mm512_and_si512(v, nibble);
      high[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    for (int r = 0; r < R; ++r) {
      __m256i s[4];  // block 2p in the low 4 lanes of s[p], 2p + 1 in the high 4
      for (int h = 0; h < 2; ++h) {
        const Q4_0Quad& xq = quads[r][2 * g + h];
        __m512i v = _mm512_dpbusd_epi32(_mm512_load_si512(xq.bias), low[h], _mm512_load_si512(xq.low));
        v = _mm512_dpbusd_epi32(v, high[h], _mm512_load_si512(xq.high));
        s[2 * h] = _mm512_castsi512_si256(v);
        s[2 * h + 1] = _mm512_extracti64x4_epi64(v, 1);
      }
      // in-lane pair sums twice: block k's exact sum in lane lane_of(k)
      sums[r] = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    }
  };
#else
  const Q4_0Pair* pairs[R];
  for (int r = 0; r < R; ++r) pairs[r] = reinterpret_cast<const Q4_0Pair*>(x[r] + blocks);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  // two blocks per vector (block 2p in the low half, 2p + 1 in the high), against Q4_0Pair's activations
  auto group_sums = [&](const unsigned char* at, int64_t g, __m256i* sums) {
    __m256i low[4], high[4];
    for (int p = 0; p < 4; ++p) {
      const unsigned char* wb = at + 2 * p * kBlockBytes;
      const __m256i v = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 2))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + kBlockBytes + 2)), 1);
      low[p] = _mm256_and_si256(v, nibble);
      high[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    for (int r = 0; r < R; ++r) {
      __m256i s[4];  // block 2p in the low 4 lanes of s[p], 2p + 1 in the high 4
      for (int p = 0; p < 4; ++p) {
        const Q4_0Pair& xp = pairs[r][4 * g + p];
        const __m256i bias = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp.bias));
        const __m256i xl = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp.low));
        const __m256i xh = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp.high));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
        s[p] = dot_u8s8(dot_u8s8(bias, low[p], xl), high[p], xh);
#else  // pairs ≤ 2·15·127; the two halves' sum ≤ 7620 < 32768: one vpmaddwd for both
        const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(low[p], xl), _mm256_maddubs_epi16(high[p], xh));
        s[p] = _mm256_add_epi32(_mm256_madd_epi16(sum16, _mm256_set1_epi16(1)), bias);
#endif
      }
      // in-lane pair sums twice: block k's exact sum in lane lane_of(k)
      sums[r] = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    }
  };
#endif
  // The scales of a group's 8 blocks (144 bytes), in the lanes of their sums: the half of block 2i at byte 36i, of
  // 2i + 1 at 36i + 18, so dword i of the 32 bytes from 32i holds the first in its low half (low 128 bits) and the
  // second in its high half (high 128 bits). Four loads, three blends and two shuffles: a vpgatherdd took as long as
  // the rest of the group's work.
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  auto scales = [&](const unsigned char* at) {
    auto chunk = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * i)); };
    __m256i v = _mm256_blend_epi32(chunk(0), chunk(1), 0x22);
    v = _mm256_blend_epi32(_mm256_blend_epi32(v, chunk(2), 0x44), chunk(3), 0x88);
    v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);  // qwords 0 and 2 to 0 and 1
    return _mm256_cvtph_ps(_mm256_castsi256_si128(v));
  };
  for (int64_t n = 0; n < rows; ++n) {
    const unsigned char* row = w + n * bytes;
    __m256 acc[R];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; ++g) {
      const unsigned char* at = row + 8 * g * kBlockBytes;
      simd::prefetch(at + kRowPrefetchBytes, 8 * kBlockBytes);
      const __m256 d = scales(at);
      __m256i sums[R];
      group_sums(at, g, sums);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, dx[r * groups + g]), acc[r]);
    }
    finish_row<R>(row, kBlockBytes, blocks, dx, groups, acc, [&](int r, int64_t b) {
      const unsigned char* qs = row + b * kBlockBytes + 2;
      const Q8Block& xb = x[r][b];
      int32_t s = xb.q4_bias;
      for (int j = 0; j < 16; ++j) s += (qs[j] & 0xf) * xb.q[j] + (qs[j] >> 4) * xb.q[j + 16];
      return s;
    }, beta, out + n, ld);
  }
}

// The same for Q8_0: |w| times x with w's sign per block (unsigned × signed for vpmaddubsw, pairs ≤ 2·128·127 <
// 32768). A block fills a whole vector, so its 8 partial sums take a deeper tree: in-lane pair sums of blocks 0 and 2,
// 4 and 6 (then 1 and 3, 5 and 7), once more, and the two halves added, which leaves block k in lane lane_of(k).
template <int R>
void rows_q8_0(const unsigned char* w, int64_t bytes, int64_t rows, int64_t blocks, const Q8Block* const* x,
               const __m256* dx, float beta, float* out, int64_t ld) {
  constexpr int64_t kBytes = sizeof(BlockQ8_0);
  const int64_t full = blocks / 8, groups = (blocks + 7) / 8;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t n = 0; n < rows; ++n) {
    const unsigned char* row = w + n * bytes;
    __m256 acc[R];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; ++g) {
      const unsigned char* at = row + 8 * g * kBytes;
      simd::prefetch(at + kRowPrefetchBytes, 8 * kBytes);
      // blocks k0 and k1's pair sums, in-lane (k0's in lanes 0, 1 and 4, 5; k1's in 2, 3 and 6, 7)
      auto pair = [&](int k0, int k1, __m256i* to) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + k0 * kBytes + 2));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + k1 * kBytes + 2));
        const __m256i m0 = _mm256_abs_epi8(w0), m1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x[r][8 * g + k0].q));
          const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x[r][8 * g + k1].q));
          to[r] = _mm256_hadd_epi32(dot_u8s8(zero, m0, _mm256_sign_epi8(x0, w0)),
                                    dot_u8s8(zero, m1, _mm256_sign_epi8(x1, w1)));
        }
      };
      __m256i a[R], b[R], even[R], odd[R];  // even: blocks 0, 2, 4, 6 (their low halves' sums, then the high ones')
      pair(0, 2, a);
      pair(4, 6, b);
      for (int r = 0; r < R; ++r) even[r] = _mm256_hadd_epi32(a[r], b[r]);
      pair(1, 3, a);
      pair(5, 7, b);
      for (int r = 0; r < R; ++r) odd[r] = _mm256_hadd_epi32(a[r], b[r]);
      // The scales: block k's half is word lane_of(k) of the 16 bytes from 34k − 2·lane_of(k).
      auto at16 = [&](int64_t offset) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + offset)); };
      __m128i h = at16(0);
      h = _mm_blend_epi16(h, at16(1 * kBytes - 8), 0x10);
      h = _mm_blend_epi16(h, at16(2 * kBytes - 2), 0x02);
      h = _mm_blend_epi16(h, at16(3 * kBytes - 10), 0x20);
      h = _mm_blend_epi16(h, at16(4 * kBytes - 4), 0x04);
      h = _mm_blend_epi16(h, at16(5 * kBytes - 12), 0x40);
      h = _mm_blend_epi16(h, at16(6 * kBytes - 6), 0x08);
      h = _mm_blend_epi16(h, at16(7 * kBytes - 14), 0x80);
      const __m256 d = _mm256_cvtph_ps(h);
      for (int r = 0; r < R; ++r) {
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(even[r], odd[r], 0x20),
                                              _mm256_permute2x128_si256(even[r], odd[r], 0x31));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx[r * groups + g]), acc[r]);
      }
    }
    finish_row<R>(row, kBytes, blocks, dx, groups, acc, [&](int r, int64_t b) {
      const auto* qs = reinterpret_cast<const int8_t*>(row + b * kBytes + 2);
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += qs[j] * x[r][b].q[j];
      return s;
    }, beta, out + n, ld);
  }
}

// out[r·ld + n] for the `count` ≤ kLanesDirectRows rows of X: groups of 4 rows of X in turn over chunks of W.
void few_rows(const unsigned char* base, int64_t row_bytes, int64_t rows, int64_t blocks, bool q8,
              const Q8Block* const* xs, int count, float beta, float* out, int64_t ld) {
  struct alignas(32) Lanes {
    float v[8];
  };
  thread_local std::vector<Lanes> dx;  // [r·groups + g]: as the few-rows kernels read them
  const int64_t groups = (blocks + 7) / 8;
  dx.assign(static_cast<size_t>(count * groups), Lanes{});
  for (int r = 0; r < count; ++r)
    for (int64_t b = 0; b < blocks; ++b) dx[r * groups + b / 8].v[lane_of(static_cast<int>(b % 8))] = xs[r][b].dx;
  const __m256* d = reinterpret_cast<const __m256*>(dx.data());
  const int64_t chunk = dot_chunk_rows(count, rows, row_bytes, kLanesTileRows);
  for (int64_t n0 = 0; n0 < rows; n0 += chunk) {
    const unsigned char* at = base + n0 * row_bytes;
    const int64_t n = std::min(chunk, rows - n0);
    each_group(count, [&](auto R, int m0) {
      if (q8) rows_q8_0<R>(at, row_bytes, n, blocks, xs + m0, d + m0 * groups, beta, out + n0 + m0 * ld, ld);
      else rows_q4_0<R>(at, row_bytes, n, blocks, xs + m0, d + m0 * groups, beta, out + n0 + m0 * ld, ld);
    });
  }
}

// The row of Y from its 8 chains (each a vector of the tile's rows), in the order above.
template <class V, class Add>
[[gnu::always_inline]] inline V sum_tile_chains(const V* c, Add&& add) {
  return add(add(add(c[0], c[1]), add(c[4], c[5])), add(add(c[2], c[3]), add(c[6], c[7])));
}
#endif

}  // namespace

#if defined(QKV_DOT512)

namespace {

constexpr int kTile = 16;  // rows of W per tile: one per int32 lane

// Block b of a tile, unpacked: v[c] lane n holds values 4c … 4c + 3 of row n as unsigned levels; d its scales.
struct alignas(64) TileBlock {
  __m512i v[8];
  __m512 d;
};
static_assert(sizeof(TileBlock) == 576, "a tile block is 9 cache lines");

// ---- Q4_0: blocks of 18 bytes, a half and 16 bytes of nibbles (value j low, j + 16 high) ----
struct Q4_0Tiles {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ4_0);
  static constexpr int kScaleGroup = 4;  // blocks whose scales one 64-byte load per row holds (words 0, 9, 18, 27)

  // Block b of the rows: each row's 16 bytes of nibbles as 4 int32 lanes, transposed so that vector k holds bytes
  // 4k … 4k + 3 of every row, then split into low nibbles (v[k]: values 4k … 4k + 3) and high ones (v[k + 4]: values
  // 16 + 4k …), the high ones left in place, 16 times their level (store shifts them
  // down, once per tile).
  [[gnu::always_inline]] static void unpack(const TileRows<kTile>& rows, int64_t b, __m512i* v) {
    const int64_t at = b * kBlockBytes + 2;
    auto qs = [&](int n) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.row(n, at))); };
    __m512i rows4[4];  // rows4[k], 128-bit lane j: row k + 4j
    for (int k = 0; k < 4; ++k)
      rows4[k] = _mm512_inserti32x4(
          _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(qs(k)), qs(k + 4), 1), qs(k + 8), 2), qs(k + 12), 3);
    const __m512i t0 = _mm512_unpacklo_epi32(rows4[0], rows4[1]), t1 = _mm512_unpackhi_epi32(rows4[0], rows4[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(rows4[2], rows4[3]), t3 = _mm512_unpackhi_epi32(rows4[2], rows4[3]);
    const __m512i words[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                              _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(static_cast<char>(0xf0));
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm512_and_si512(words[k], low);
      v[k + 4] = _mm512_and_si512(words[k], high);
    }
  }
  // An unpacked tile keeps the high nibbles' levels (shifted once, not per row of X).
  [[gnu::always_inline]] static void store(const __m512i* v, __m512i* to) {
    for (int c = 0; c < 4; ++c) _mm512_store_si512(to + c, v[c]);
    for (int c = 4; c < 8; ++c) _mm512_store_si512(to + c, _mm512_srli_epi16(v[c], 4));
  }
  // The exact integer Σ_j nib_j·q_j − 8·Σ q of each lane of an unpacked tile's block: the low nibbles' and the high
  // ones' products in two chains (each vpdpbusd waits on the one before last); |Σ| ≤ 16·16·15·127, exact in int32.
  [[gnu::always_inline]] static __m512i sum(const __m512i* v, const Q8Block& x) {
    __m512i low = _mm512_set1_epi32(x.q4_bias), high = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      low = _mm512_dpbusd_epi32(low, v[c], _mm512_set1_epi32(load_i32(x.q + 4 * c)));
      high = _mm512_dpbusd_epi32(high, v[c + 4], _mm512_set1_epi32(load_i32(x.q + 16 + 4 * c)));
    }
    return _mm512_add_epi32(low, high);
  }
  // The scales of blocks b … b + 3, d[k] lane n: block b + k of row n. Each row's 64 bytes from block b are merged
  // in a tree of two-source word permutes, 2 rows, 4, 8, then the halves by block (a gather of 16 halves per block
  // took as long as the rest of the block's work).
  [[gnu::always_inline]] static void scales(const TileRows<kTile>& rows, int64_t b, __m512* d) {
    const int64_t at = b * kBlockBytes;
    auto row = [&](int n) { return _mm512_loadu_si512(rows.row(n, at)); };
    // word 2k + j of a pair: block k of its row j (of 2); of a quad 4k + j; of an octet 8k + j
    const __m512i pair = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          59, 27, 50, 18, 41, 9, 32, 0);
    const __m512i quad = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 39, 38, 7, 6, 37, 36, 5, 4,
                                          35, 34, 3, 2, 33, 32, 1, 0);
    const __m512i octet = _mm512_set_epi16(47, 46, 45, 44, 15, 14, 13, 12, 43, 42, 41, 40, 11, 10, 9, 8, 39, 38, 37,
                                           36, 7, 6, 5, 4, 35, 34, 33, 32, 3, 2, 1, 0);
    // the two octets (rows 0–7, 8–15) as blocks 0 and 1 of all 16 rows, and blocks 2 and 3
    const __m512i first_half = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8, 39, 38,
                                                37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i second_half = _mm512_set_epi16(63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24, 55, 54,
                                                 53, 52, 51, 50, 49, 48, 23, 22, 21, 20, 19, 18, 17, 16);
    __m512i pairs[8], quads[4], octets[2];
    for (int p = 0; p < 8; ++p) pairs[p] = _mm512_permutex2var_epi16(row(2 * p), pair, row(2 * p + 1));
    for (int q = 0; q < 4; ++q) quads[q] = _mm512_permutex2var_epi16(pairs[2 * q], quad, pairs[2 * q + 1]);
    for (int o = 0; o < 2; ++o) octets[o] = _mm512_permutex2var_epi16(quads[2 * o], octet, quads[2 * o + 1]);
    const __m512i blocks01 = _mm512_permutex2var_epi16(octets[0], first_half, octets[1]);
    const __m512i blocks23 = _mm512_permutex2var_epi16(octets[0], second_half, octets[1]);
    d[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(blocks01));
    d[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(blocks01, 1));
    d[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(blocks23));
    d[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(blocks23, 1));
  }
};

// ---- Q8_0: blocks of 34 bytes, a half and 32 int8 ----
struct Q8_0Tiles {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ8_0);
  static constexpr int kScaleGroup = 2;  // words 0 and 17 of a row's 64 bytes from block b

  // Block b of the rows: each row's 32 int8 as 8 int32 lanes (rows k and k + 8 in the halves of a vector), transposed
  // so that v[c] lane n holds values 4c … 4c + 3 of row n, made unsigned by adding 128 (an xor; see sum).
  [[gnu::always_inline]] static void unpack(const TileRows<kTile>& rows, int64_t b, __m512i* v) {
    const int64_t at = b * kBlockBytes + 2;
    auto qs = [&](int n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.row(n, at))); };
    __m512i r[8];  // r[k]: row k in the low half, row k + 8 in the high one
    for (int k = 0; k < 8; ++k) r[k] = _mm512_inserti64x4(_mm512_castsi256_si512(qs(k)), qs(k + 8), 1);
    __m512i t[8];  // 128-bit lanes: t[2i] dwords (0, 1 | 4, 5) of rows 2i, 2i + 1 interleaved, t[2i + 1] (2, 3 | 6, 7)
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[h][c], c < 4: lanes (dword c | dword c + 4) of rows 4h … 4h + 3, then the same of rows 8 + 4h …
    __m512i u[2][4];
    for (int h = 0; h < 2; ++h) {
      const __m512i* q = t + 4 * h;
      u[h][0] = _mm512_unpacklo_epi64(q[0], q[2]);
      u[h][1] = _mm512_unpackhi_epi64(q[0], q[2]);
      u[h][2] = _mm512_unpacklo_epi64(q[1], q[3]);
      u[h][3] = _mm512_unpackhi_epi64(q[1], q[3]);
    }
    // dword c of rows 0–3, 4–7, 8–11, 12–15: lanes 0 and 2 of u[0][c] and u[1][c]; dword c + 4: lanes 1 and 3
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[0][c], first, u[1][c]), flip);
      v[c + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[0][c], second, u[1][c]), flip);
    }
  }
  [[gnu::always_inline]] static void store(const __m512i* v, __m512i* to) {
    for (int c = 0; c < 8; ++c) _mm512_store_si512(to + c, v[c]);
  }
  // Σ_j (w_j + 128)·q_j − 128·Σ q = Σ_j w_j·q_j, exact in int32 (|Σ| ≤ 32·255·127 + 128·32·127).
  [[gnu::always_inline]] static __m512i sum(const __m512i* v, const Q8Block& x) {
    __m512i s[2] = {_mm512_set1_epi32(x.q8_bias), _mm512_setzero_si512()};
    for (int c = 0; c < 8; ++c) s[c % 2] = _mm512_dpbusd_epi32(s[c % 2], v[c], _mm512_set1_epi32(load_i32(x.q + 4 * c)));
    return _mm512_add_epi32(s[0], s[1]);
  }
  // The scales of blocks b and b + 1: the same tree as Q4_0's over each row's words 0 and 17.
  [[gnu::always_inline]] static void scales(const TileRows<kTile>& rows, int64_t b, __m512* d) {
    const int64_t at = b * kBlockBytes;
    auto row = [&](int n) { return _mm512_loadu_si512(rows.row(n, at)); };
    // word 2k + j of a pair (k < 2: block, j: row), 4k + j of a quad, 8k + j of an octet, 16k + j of all 16 rows
    const __m512i pair = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          0, 0, 49, 17, 32, 0);
    const __m512i quad = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 35,
                                          34, 3, 2, 33, 32, 1, 0);
    const __m512i octet = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 39, 38, 37, 36, 7, 6, 5, 4,
                                           35, 34, 33, 32, 3, 2, 1, 0);
    const __m512i all = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8, 39, 38, 37, 36,
                                         35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i pairs[8], quads[4], octets[2];
    for (int p = 0; p < 8; ++p) pairs[p] = _mm512_permutex2var_epi16(row(2 * p), pair, row(2 * p + 1));
    for (int q = 0; q < 4; ++q) quads[q] = _mm512_permutex2var_epi16(pairs[2 * q], quad, pairs[2 * q + 1]);
    for (int o = 0; o < 2; ++o) octets[o] = _mm512_permutex2var_epi16(quads[2 * o], octet, quads[2 * o + 1]);
    const __m512i both = _mm512_permutex2var_epi16(octets[0], all, octets[1]);
    d[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(both));
    d[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(both, 1));
  }
};

// The scales of block b of the 16 rows, one at a time (the blocks after the last whole group of scales; a gather's
// 32-bit offsets would overflow for rows wider than 143 MB)
template <class Type>
[[gnu::always_inline]] inline __m512 tail_scales(const unsigned char* first, int64_t bytes, int64_t b) {
  alignas(32) uint16_t halves[kTile];
  for (int n = 0; n < kTile; ++n) std::memcpy(&halves[n], first + n * bytes + b * Type::kBlockBytes, 2);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(halves)));
}

// acc[r] lane n += the product of block b of tile row n with block b of X's row r, for R rows of X.
template <class Type, int R>
[[gnu::always_inline]] inline void multiply_block(const __m512i* v, __m512 d, const Q8Block* const* x, int64_t b, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const Q8Block& xb = x[r][b];
    const __m512i sum = Type::sum(v, xb);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(xb.dx)), acc[r]);
  }
}

// out[r·ld + n] = dots[r][n] (+ beta·out) for the tile's `valid` rows: the scalar expression of quant_dot.cpp's
// over_rows, so a row's value is the same whichever path wrote it.
template <int R>
[[gnu::always_inline]] inline void store(const __m512* acc, int valid, float beta, float* out, int64_t ld) {
  alignas(64) float dots[kTile];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(dots, acc[r]);
    float* o = out + r * ld;
    for (int n = 0; n < valid; ++n) o[n] = beta == 0.0f ? dots[n] : dots[n] + beta * o[n];
  }
}

// Each block of a tile, unpacked (its scales a group of blocks at a time), handed to `use(b, v, d)`.
template <class Type, class Use>
[[gnu::always_inline]] inline void for_each_block(const unsigned char* first, int64_t bytes, int64_t blocks, Use&& use) {
  constexpr int G = Type::kScaleGroup;
  int64_t b = 0;
  for (; b + G <= blocks; b += G) {
    const TileRows<kTile> rows = tile_rows<kTile>(first, bytes);
    __m512 d[G];
    Type::scales(rows, b, d);
    for (int k = 0; k < G; ++k) {
      __m512i v[8];
      Type::unpack(rows, b + k, v);
      use(b + k, v, d[k]);
    }
  }
  for (; b < blocks; ++b) {
    __m512i v[8];
    Type::unpack(tile_rows<kTile>(first, bytes), b, v);
    use(b, v, tail_scales<Type>(first, bytes, b));
  }
}

template <class Type>
void unpack_tile(const unsigned char* first, int64_t bytes, int64_t blocks, TileBlock* tile) {
  for_each_block<Type>(first, bytes, blocks, [&](int64_t b, const __m512i* v, __m512 d) {
    Type::store(v, tile[b].v);
    _mm512_store_ps(&tile[b].d, d);
  });
}

// The tile against R ≤ 4 rows of X: chain j over the blocks b ≡ j (mod 8), in order.
template <class Type, int R>
// (not inlined into the walk over tiles: the four of them inlined there ran 7–12% slower at 8–64 rows of X)
[[gnu::noinline]] void tile_unpacked(const TileBlock* tile, int64_t blocks, const Q8Block* const* x, int valid, float beta, float* out,
                    int64_t ld) {
  // Each block into its chain, in order (the chains walked one after another, each 4–12 blocks long at K = 1024–3072,
  // ran 5–10% slower at 512 rows of X; chains 0–3 and then 4–7, their 16 accumulators in registers, 10–20% slower)
  __m512 chain[R][kLanesChains];
  for (int r = 0; r < R; ++r)
    for (auto& c : chain[r]) c = _mm512_setzero_ps();
  auto block = [&](int64_t b, int j) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = chain[r][j];
    multiply_block<Type, R>(tile[b].v, tile[b].d, x, b, acc);
    for (int r = 0; r < R; ++r) chain[r][j] = acc[r];
  };
  int64_t b = 0;
  for (; b + kLanesChains <= blocks; b += kLanesChains)
    for (int j = 0; j < kLanesChains; ++j) block(b + j, j);
  for (; b < blocks; ++b) block(b, static_cast<int>(b % kLanesChains));
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = sum_tile_chains(chain[r], [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  store<R>(y, valid, beta, out, ld);
}

// ---- Q4_K and Q5_K: 16 rows of W in the lanes, from kKTileRows rows of X ----
// The arithmetic of quant_dot.cpp's dot_q45_K (see the AVX2 build's tiles below). Each sub-block's 32 values are 8
// vpdpbusd against 4 broadcast activations into a fresh int32 sum (≤ 32·31·127), which one vpmulld scales.

struct alignas(64) K16Block {
  __m512i q[64];     // q[8s + c] lane n: values 4c … 4c + 3 of row n's sub-block kKOrder512[s] (the activations' order)
  __m512i scale[8];  // lane n: the scale of row n's sub-block kKOrder512[s], int32
  __m512i mins[4];   // lane n: the mins of sub-blocks 2p (low int16) and 2p + 1 (high int16) of row n
  __m512 d, dmin;
};

// The tile's blocks: each the blocks of rows 0–7 and 8–15 unpacked as the AVX2 build's tiles (unpack_k_block), joined.
template <bool five_bits>
void unpack_k16(const unsigned char* first, int64_t bytes, int64_t blocks, K16Block* tile) {
  constexpr int64_t kBytes = sizeof(std::conditional_t<five_bits, BlockQ5_K, BlockQ4_K>);
  const TileRows<8> low = tile_rows<8>(first, bytes), high = tile_rows<8>(first + 8 * bytes, bytes);
  const auto join = [](__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); };
  const __m512i word = _mm512_set1_epi32(0xffff);
  KTileBlock<five_bits> a, b;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    unpack_k_block(low, blk * kBytes, a);
    unpack_k_block(high, blk * kBytes, b);
    K16Block& t = tile[blk];
    for (int s = 0; s < 8; ++s) {
      const int j = kKOrder512[s];
      for (int c = 0; c < 8; ++c) _mm512_store_si512(t.q + 8 * s + c, join(a.q[8 * j + c], b.q[8 * j + c]));
      _mm512_store_si512(t.scale + s, _mm512_and_si512(join(a.scale[j], b.scale[j]), word));
    }
    for (int p = 0; p < 4; ++p) _mm512_store_si512(t.mins + p, join(a.mins[p], b.mins[p]));
    t.d = _mm512_insertf32x8(_mm512_castps256_ps512(a.d), b.d, 1);
    t.dmin = _mm512_insertf32x8(_mm512_castps256_ps512(a.dmin), b.dmin, 1);
  }
}

template <int R>
[[gnu::noinline]] void k16_tile_unpacked(const K16Block* tile, int64_t blocks, const Q8KBlock* const* x, int valid,
                                         float beta, float* out, int64_t ld) {
  __m512 cs[R], cm[R];
  for (int r = 0; r < R; ++r) cs[r] = cm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const K16Block& t = tile[b];
    __m512i S[R];
    for (auto& v : S) v = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i sum[R];
      for (auto& v : sum) v = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i w = _mm512_load_si512(t.q + 8 * s + c);
        for (int r = 0; r < R; ++r)
          sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(load_i32(x[r][b].q + 32 * s + 4 * c)));
      }
      for (int r = 0; r < R; ++r) S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(sum[r], t.scale[s]));
    }
    for (int r = 0; r < R; ++r) {
      const Q8KBlock& xb = x[r][b];
      __m512i M = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) M = _mm512_dpwssd_epi32(M, t.mins[p], _mm512_set1_epi32(load_i32(xb.sums32 + 2 * p)));
      const __m512 dx = _mm512_set1_ps(xb.d);
      cs[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(t.d, dx), cs[r]);
      cm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(t.dmin, dx), cm[r]);
    }
  }
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_sub_ps(cs[r], cm[r]);
  store<R>(y, valid, beta, out, ld);
}

template <bool five_bits>
void k_tiles(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count, float beta,
             float* out, int64_t ld) {
  const int64_t blocks = x[0]->size() / kQK_K;
  thread_local std::vector<const Q8KBlock*> xs;
  xs.resize(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) xs[r] = reinterpret_cast<const Q8KBlock*>(x[r]->data());
  const auto* base = static_cast<const unsigned char*>(w);
  thread_local std::vector<unsigned char> tail;
  thread_local std::vector<K16Block> unpacked;
  if (unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  each_tile(base, row_bytes, rows, kTile, tail, [&](const unsigned char* first, int valid, int64_t n0) {
    unpack_k16<five_bits>(first, row_bytes, blocks, unpacked.data());
    const int64_t next = std::clamp<int64_t>(rows - n0 - valid, 0, kTile);
    for (int64_t n = 0; n < next; ++n) simd::prefetch(base + (n0 + valid + n) * row_bytes, row_bytes);
    each_group(count, [&](auto R, int m0) {
      k16_tile_unpacked<R>(unpacked.data(), blocks, xs.data() + m0, valid, beta, out + n0 + m0 * ld, ld);
    });
  });
}

template <class Type>
void tiles_of(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld) {
  const int64_t blocks = x[0]->size() / kQK;
  thread_local std::vector<const Q8Block*> natural;  // kept: generation calls this ~200 times a token
  natural.resize(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) natural[r] = reinterpret_cast<const Q8Block*>(x[r]->data());
  const auto* base = static_cast<const unsigned char*>(w);
  thread_local std::vector<unsigned char> tail;
  const Q8Block* const* xs = natural.data();
  if (count <= kLanesDirectRows) return few_rows(base, row_bytes, rows, blocks, std::is_same_v<Type, Q8_0Tiles>, xs, count, beta, out, ld);
  thread_local std::vector<TileBlock> unpacked;
  if (unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  each_tile(base, row_bytes, rows, kTile, tail, [&](const unsigned char* first, int valid, int64_t n0) {
    const int next_rows = static_cast<int>(std::clamp<int64_t>(rows - n0 - valid, 0, kTile));
    const unsigned char* next = base + (n0 + valid) * row_bytes;
    float* o = out + n0;
    unpack_tile<Type>(first, row_bytes, blocks, unpacked.data());
    for (int n = 0; n < next_rows; ++n) simd::prefetch(next + n * row_bytes, row_bytes);  // (see the AVX2 tiles)
    each_group(count, [&](auto R, int m0) {
      tile_unpacked<Type, R>(unpacked.data(), blocks, xs + m0, valid, beta, o + m0 * ld, ld);
    });
  });
}

}  // namespace

void dot_rows_in_lanes(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld) {
  switch (x[0]->type()) {
    case WeightType::Q8_0: tiles_of<Q8_0Tiles>(w, row_bytes, rows, x, count, beta, out, ld); break;
    case WeightType::Q4_K: k_tiles<false>(w, row_bytes, rows, x, count, beta, out, ld); break;  // (from kKTileRows rows)
    case WeightType::Q5_K: k_tiles<true>(w, row_bytes, rows, x, count, beta, out, ld); break;
    default: tiles_of<Q4_0Tiles>(w, row_bytes, rows, x, count, beta, out, ld); break;
  }
}

#elif defined(QKV_DOT256)

// ---- AVX2: Q4_0 and Q8_0, more rows of X ----
// The chains of the few-rows kernels above (one row of W at a time: with one chain, the sums had to be transposed so
// that rows of W own the lanes, 20–30% more instructions than the one-row kernel, which runs close to its instruction
// rate; reading 8 rows side by side instead made a thread's slice 8 streams: two threads lost 5–14% of their
// tokens/s). More rows: 8 rows of W in the lanes of each vector (unpacked once into a buffer that stays in L1 or L2),
// every chain walked in turn for groups of 4 rows of X. Without vpdpbusd the products are vpmaddubsw's. Q4_0: a nibble
// (≤ 15) times an int8 activation, pairs ≤ 2·15·127, so a block's 8 vectors (32 values) are summed in 16 bits
// (≤ 8·2·15·127 = 30,480 < 32,768) and widened once by a vpmaddwd: 17 integer operations per block of 8 rows and a
// row of X, where the one-row kernel took ~5 per block and row. Q8_0: |w| times x with w's sign, pairs up to
// 2·128·127, each vector widened: 32 per block of 8 rows, where the one-row kernel took ~7 per block and row.

namespace {

constexpr int kTile = kLanesTileRows;  // rows of W per tile: one per int32 lane
constexpr int kChains = kLanesChains;  // 8
constexpr int64_t kBlockBytes = sizeof(BlockQ4_0);

struct alignas(32) TileBlock {
  __m256i v[8];  // v[c] lane n: values 4c … 4c + 3 of row n (c < 4: the low nibbles, values 16 + 4(c − 4) … after)
  __m256 d;      // lane n: the block's scale in row n
};
static_assert(sizeof(TileBlock) == 288, "a tile block is 9 half cache lines");
struct alignas(32) Q8TileBlock {
  __m256i magnitude[8];  // magnitude[c] lane n: |values| 4c … 4c + 3 of row n
  __m256i value[8];      // the values themselves (their signs)
  __m256 d;
};

// Block b of the tile's 8 rows, unpacked: levels 0 … 15 and the 8 scales.
[[gnu::always_inline]] inline void unpack_q4_0(const TileRows<kTile>& rows, int64_t b, __m256i* v, __m256* d) {
  const int64_t at = b * kBlockBytes;
  auto qs = [&](int n) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.row(n, at + 2))); };
  __m256i rows2[4];  // rows2[k]: row k in the low 128 bits, row k + 4 in the high
  for (int k = 0; k < 4; ++k) rows2[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(qs(k)), qs(k + 4), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(rows2[0], rows2[1]), t1 = _mm256_unpackhi_epi32(rows2[0], rows2[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(rows2[2], rows2[3]), t3 = _mm256_unpackhi_epi32(rows2[2], rows2[3]);
  const __m256i words[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                            _mm256_unpackhi_epi64(t1, t3)};
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_and_si256(words[k], low);
    v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(words[k], 4), low);
  }
  __m128i halves = _mm_cvtsi32_si128(load_u16(rows.row(0, at)));
  halves = _mm_insert_epi16(halves, load_u16(rows.row(1, at)), 1);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(2, at)), 2);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(3, at)), 3);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(4, at)), 4);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(5, at)), 5);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(6, at)), 6);
  halves = _mm_insert_epi16(halves, load_u16(rows.row(7, at)), 7);
  *d = _mm256_cvtph_ps(halves);
}

// The exact Σ_j nib_j·q_j − 8·Σ q of each lane.
[[gnu::always_inline]] inline __m256i sum_q4_0(const __m256i* v, const Q8Block& x) {
  __m256i s = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(load_i32(x.q)));
  for (int c = 1; c < 4; ++c) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[c], _mm256_set1_epi32(load_i32(x.q + 4 * c))));
  for (int c = 0; c < 4; ++c)
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[c + 4], _mm256_set1_epi32(load_i32(x.q + 16 + 4 * c))));
  return _mm256_add_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), _mm256_set1_epi32(x.q4_bias));
}

// Q8_0: block b of the tile's 8 rows, each row's 32 bytes a row of an 8 × 8 matrix of dwords, transposed.
void unpack_tile(const unsigned char* first, int64_t bytes, int64_t blocks, Q8TileBlock* tile) {
  constexpr int64_t kBytes = sizeof(BlockQ8_0);
  const TileRows<kTile> rows = tile_rows<kTile>(first, bytes);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kBytes;
    __m256i v[8];
    transpose_rows(rows, at + 2, v);
    for (int c = 0; c < 8; ++c) {
      _mm256_store_si256(tile[b].value + c, v[c]);
      _mm256_store_si256(tile[b].magnitude + c, _mm256_abs_epi8(v[c]));
    }
    alignas(16) uint16_t halves[8];
    for (int n = 0; n < kTile; ++n) halves[n] = load_u16(rows.row(n, at));
    _mm256_store_ps(reinterpret_cast<float*>(&tile[b].d),
                    _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves))));
  }
}

// The exact Σ_j w_j·q_j of each lane (products in pairs ≤ 2·128·127, widened per vector).
[[gnu::always_inline]] inline __m256i block_sum(const Q8TileBlock& t, const Q8Block& x) {
  __m256i s = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c)
    s = dot_u8s8(s, t.magnitude[c], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(x.q + 4 * c)), t.value[c]));
  return s;
}
[[gnu::always_inline]] inline __m256i block_sum(const TileBlock& t, const Q8Block& x) { return sum_q4_0(t.v, x); }

void unpack_tile(const unsigned char* first, int64_t bytes, int64_t blocks, TileBlock* tile) {
  const TileRows<kTile> rows = tile_rows<kTile>(first, bytes);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i v[8];
    __m256 d;
    unpack_q4_0(rows, b, v, &d);
    for (int c = 0; c < 8; ++c) _mm256_store_si256(tile[b].v + c, v[c]);
    _mm256_store_ps(reinterpret_cast<float*>(&tile[b].d), d);
  }
}

// ---- Q4_K and Q5_K: 8 rows of W in the lanes (from kKTileRows rows of X) ----
// The arithmetic of quant_dot.cpp's dot_q45_K, here in 8 lanes: per block and row of X, the exact integers
// S = Σ_j scale_j·Σ q_w·q_x and M = Σ_j min_j·Σ q_x, then c_S ← fma(float(S), d·d_x, c_S), c_M ← fma(float(M),
// dmin·d_x, c_M); y = c_S − c_M. Each sub-block j's 32 values are 8 vpmaddubsw against 4 broadcast activations, summed
// in int16 (Q4_K pairs ≤ 2·15·127, 8 of them ≤ 30,480; Q5_K's ≤ 2·31·127, so 4 at a time) and widened by one
// vpmaddwd with the scale: ~2.3 integer operations per 32 products of 8 rows, where the one-row kernel takes ~6 per 32
// products of one row (its scale picking and unpacking shared by at most 4 rows of X).

template <bool five_bits>
void unpack_tile(const unsigned char* first, int64_t bytes, int64_t blocks, KTileBlock<five_bits>* tile) {
  const TileRows<kTile> rows = tile_rows<kTile>(first, bytes);
  for (int64_t b = 0; b < blocks; ++b)
    unpack_k_block(rows, b * int64_t{sizeof(std::conditional_t<five_bits, BlockQ5_K, BlockQ4_K>)}, tile[b]);
}

// The K tile against R ≤ 4 rows of X; out[r·ld + n] = the tile's sums (+ beta·out) for its `valid` rows.
template <class Block, int R>
[[gnu::noinline]] void k_tile_unpacked(const Block* tile, int64_t blocks, const Q8KBlock* const* x, int valid, float beta,
                                       float* out, int64_t ld) {
  constexpr int kRun = Block::kFiveBits ? 4 : 8;  // vpmaddubsw sums added in int16 before a widening
  __m256 cs[R], cm[R];
  for (int r = 0; r < R; ++r) cs[r] = cm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Block& t = tile[b];
    __m256i S[R];
    for (auto& v : S) v = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j)
      for (int c0 = 0; c0 < 8; c0 += kRun) {
        __m256i s16[R];
        for (int c = c0; c < c0 + kRun; ++c) {
          const __m256i w = _mm256_load_si256(t.q + 8 * j + c);
          for (int r = 0; r < R; ++r) {
            const __m256i p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(load_i32(x[r][b].q + 32 * j + 4 * c)));
            s16[r] = c == c0 ? p : _mm256_add_epi16(s16[r], p);
          }
        }
        for (int r = 0; r < R; ++r) S[r] = dot_i16(S[r], s16[r], t.scale[j]);
      }
    for (int r = 0; r < R; ++r) {
      const Q8KBlock& xb = x[r][b];
      __m256i M = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) M = dot_i16(M, t.mins[p], _mm256_set1_epi32(load_i32(xb.sums32 + 2 * p)));
      const __m256 dx = _mm256_set1_ps(xb.d);
      cs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[r]), _mm256_mul_ps(t.d, dx), cs[r]);
      cm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(t.dmin, dx), cm[r]);
    }
  }
  alignas(32) float dots[kTile];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(dots, _mm256_sub_ps(cs[r], cm[r]));
    float* o = out + r * ld;
    for (int n = 0; n < valid; ++n) o[n] = beta == 0.0f ? dots[n] : dots[n] + beta * o[n];
  }
}

// The tile against R ≤ 4 rows of X, each block into its chain (b mod 8), in order; out[r·ld + n] = the tile's sums
// (+ beta·out) for its `valid` rows. (The chains walked one after another, 4–12 blocks each at K = 1024–3072, ran
// 512 rows of X 1.35–1.45× slower: 123–138 against 180–198 GFLOP/s for Q4_0, 94–103 against 128–140 for Q8_0.)
template <class Block, int R>
// (not inlined into the walk over tiles: the four of them inlined there ran 7–12% slower at 8–64 rows of X)
[[gnu::noinline]] void tile_unpacked(const Block* tile, int64_t blocks, const Q8Block* const* x, int valid, float beta, float* out,
                    int64_t ld) {
  __m256 chain[R][kChains];
  for (int r = 0; r < R; ++r)
    for (auto& c : chain[r]) c = _mm256_setzero_ps();
  auto block = [&](int64_t b, int j) {
    for (int r = 0; r < R; ++r) {
      const Q8Block& xb = x[r][b];
      chain[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sum(tile[b], xb)), _mm256_mul_ps(tile[b].d, _mm256_set1_ps(xb.dx)),
                                    chain[r][j]);
    }
  };
  int64_t b = 0;
  for (; b + kChains <= blocks; b += kChains)
    for (int j = 0; j < kChains; ++j) block(b + j, j);
  for (; b < blocks; ++b) block(b, static_cast<int>(b % kChains));
  alignas(32) float dots[kTile];
  for (int r = 0; r < R; ++r) {
    const __m256 y = sum_tile_chains(chain[r], [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
    _mm256_store_ps(dots, y);
    float* o = out + r * ld;
    for (int n = 0; n < valid; ++n) o[n] = beta == 0.0f ? dots[n] : dots[n] + beta * o[n];
  }
}

// More rows of X: every tile of W unpacked once, then multiplied by each group of 4 rows of X.
template <class Block, class X>
void tiles(const unsigned char* base, int64_t row_bytes, int64_t rows, int64_t blocks, const X* const* xs,
           int count, float beta, float* out, int64_t ld) {
  thread_local std::vector<unsigned char> tail;
  thread_local std::vector<Block> unpacked;
  if (unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  each_tile(base, row_bytes, rows, kTile, tail, [&](const unsigned char* first, int valid, int64_t n0) {
    unpack_tile(first, row_bytes, blocks, unpacked.data());
    // the next tile's rows asked for now, read while this one is multiplied (unasked, 5–32 rows of X spent as long
    // waiting for the 8 rows' lines as multiplying them)
    const int64_t next = std::min<int64_t>(kTile, rows - (n0 + kTile));
    for (int64_t n = 0; n < next; ++n) simd::prefetch(base + (n0 + kTile + n) * row_bytes, row_bytes);
    each_group(count, [&](auto R, int m0) {
      if constexpr (std::is_same_v<X, Q8KBlock>)
        k_tile_unpacked<Block, R>(unpacked.data(), blocks, xs + m0, valid, beta, out + n0 + m0 * ld, ld);
      else
        tile_unpacked<Block, R>(unpacked.data(), blocks, xs + m0, valid, beta, out + n0 + m0 * ld, ld);
    });
  });
}

}  // namespace

void dot_rows_in_lanes(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld) {
  const WeightType type = x[0]->type();
  const auto* base = static_cast<const unsigned char*>(w);
  if (type == WeightType::Q4_K || type == WeightType::Q5_K) {  // (from kKTileRows rows: fewer go to quant_dot.cpp)
    thread_local std::vector<const Q8KBlock*> k_rows;
    k_rows.resize(static_cast<size_t>(count));
    for (int r = 0; r < count; ++r) k_rows[r] = reinterpret_cast<const Q8KBlock*>(x[r]->data());
    const int64_t k_blocks = x[0]->size() / kQK_K;
    if (type == WeightType::Q4_K) tiles<KTileBlock<false>>(base, row_bytes, rows, k_blocks, k_rows.data(), count, beta, out, ld);
    else tiles<KTileBlock<true>>(base, row_bytes, rows, k_blocks, k_rows.data(), count, beta, out, ld);
    return;
  }
  const int64_t blocks = x[0]->size() / kQK;
  const bool q8 = type == WeightType::Q8_0;
  thread_local std::vector<const Q8Block*> natural;  // kept: generation calls this ~200 times a token
  natural.resize(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) natural[r] = reinterpret_cast<const Q8Block*>(x[r]->data());
  const Q8Block* const* xs = natural.data();
  if (count > kLanesDirectRows) {
    if (q8) tiles<Q8TileBlock>(base, row_bytes, rows, blocks, xs, count, beta, out, ld);
    else tiles<TileBlock>(base, row_bytes, rows, blocks, xs, count, beta, out, ld);
    return;
  }
  few_rows(base, row_bytes, rows, blocks, q8, xs, count, beta, out, ld);
}

#endif

}  // namespace qkv::kernels::quant
