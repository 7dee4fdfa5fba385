// Q4_0 and Q8_0 weights times 8-bit activations with the rows of W in the lanes (AVX-512 VNNI builds; see
// quant_dot.hpp).
//
// The one-row kernels of quant_dot.cpp give each block of a weight row 4 (Q4_0) or 8 (Q8_0) of a vector's 16 int32
// lanes, so every 64–128 values of a row of W against a row of X cost one or two vpdpbusd and three float operations
// (convert, scale, add), and a horizontal sum at the end: at 512 rows of X they ran at ~30 products per cycle, short
// of llama.cpp's. Here 16 rows of W (a tile) share each vector, one lane each: block b of the tile is 8 vectors of
// unsigned levels (vector c, lane n: values 4c … 4c + 3 of row n; Q4_0's nibbles q + 8, Q8_0's q + 128), so the 32
// values of a block against a row of X are 8 vpdpbusd with that row's 4 bytes broadcast, and one float multiply-add
// per block serves 16 rows of W.
//
// A row of Y is y[n] = acc after acc ← fma(float(Σ_j level_j·q_j − offset·Σ_j q_j), d_w·d_x, acc) over the blocks in
// order (from 0; the integer sum is exact): the same whatever the number of rows of X, their place among the others
// or the threads, so a batch gives each sequence the values it gets alone.
//   few rows of X (generation): each block of a tile is unpacked from the rows as they lie in the file (a 4-byte
//     transpose of the 16 rows' bytes, the 16 scales merged a few blocks at a time) and multiplied at once, in
//     registers;
//   more rows: the tile is unpacked once into a buffer (576 bytes per block: 18 KiB at K = 1024, in L1 or L2) and
//     every group of 4 rows of X passes over it.
// Against the one-row kernels (Qwen3-0.6B's shapes, one Zen 5 thread, alternating builds): 512 rows of X, Q4_0 and
// Q8_0 products ~2.5–3× faster (Q8_0 3072 × 1024: 148 → 410–459 GFLOP/s); in generation the transposes cost about
// what the old kernels' per-row float work did (Q8_0 even; Q4_0 within noise on 2 threads, ~5–10% slower on 1).
#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_blocks.hpp"
#include "quant_dot.hpp"
#include "simd.hpp"

namespace qkv::kernels::quant {

#if defined(QKV_DOT512)

namespace {

constexpr int kTile = 16;  // rows of W per tile: one per int32 lane
constexpr int kGroup = 4;   // rows of X multiplied together with a tile's block (8 ran 10% slower at 512 rows)

// Block b of a tile, unpacked: v[c] lane n holds values 4c … 4c + 3 of row n as unsigned levels; d its scales.
struct alignas(64) TileBlock {
  __m512i v[8];
  __m512 d;
};
static_assert(sizeof(TileBlock) == 576, "a tile block is 9 cache lines");

int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 16 rows of a tile: rows 4j … 4j + 3 at quarter[j] + {0, 1, 2, 3}·bytes, each address one base register and
// one index register (bytes, 2·bytes as a scaled index, 3·bytes). With the 16 addresses written plainly, GCC kept 16
// row pointers, which do not fit in the registers (it moved them through vector registers: a third of the loop).
struct TileRows {
  const unsigned char* quarter[4];
  int64_t bytes, bytes3;
  const unsigned char* row(int n, int64_t at) const {
    const int k = n % 4;
    return quarter[n / 4] + at + (k == 0 ? 0 : k == 1 ? bytes : k == 2 ? 2 * bytes : bytes3);
  }
};

TileRows tile_rows(const unsigned char* first, int64_t bytes) {
  TileRows rows{{first, first + 4 * bytes, first + 8 * bytes, first + 12 * bytes}, bytes, 3 * bytes};
  // hidden from the compiler, so that it computes each address from these rather than keeping one per row
  asm("" : "+r"(rows.bytes), "+r"(rows.bytes3));
  return rows;
}

// ---- Q4_0: blocks of 18 bytes, a half and 16 bytes of nibbles (value j low, j + 16 high) ----
struct Q4_0Tiles {
  static constexpr int64_t kBlockBytes = sizeof(BlockQ4_0);
  static constexpr int kScaleGroup = 4;  // blocks whose scales one 64-byte load per row holds (words 0, 9, 18, 27)

  // Block b of the rows: each row's 16 bytes of nibbles as 4 int32 lanes, transposed so that vector k holds bytes
  // 4k … 4k + 3 of every row, then split into low nibbles (v[k]: values 4k … 4k + 3) and high ones (v[k + 4]: values
  // 16 + 4k …), the high ones left in place, 16 times their level (the sum is shifted back: see multiply): one
  // operation each instead of a shift and a mask.
  [[gnu::always_inline]] static void unpack(const TileRows& rows, int64_t b, __m512i* v) {
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
  // The exact integer Σ_j nib_j·q_j − 8·Σ q of each lane: the low nibbles' and the high ones' products in two chains
  // (each vpdpbusd waits on the one before last); |Σ| ≤ 16·16·15·127, exact in int32. high16: v[4 … 7] as unpack
  // leaves them (16 times their level), else levels (an unpacked tile's).
  template <bool high16>
  [[gnu::always_inline]] static __m512i sum(const __m512i* v, const Q8Block& x) {
    __m512i low = _mm512_set1_epi32(x.q4_bias), high = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      low = _mm512_dpbusd_epi32(low, v[c], _mm512_set1_epi32(load_i32(x.q + 4 * c)));
      high = _mm512_dpbusd_epi32(high, v[c + 4], _mm512_set1_epi32(load_i32(x.q + 16 + 4 * c)));
    }
    return _mm512_add_epi32(low, high16 ? _mm512_srai_epi32(high, 4) : high);
  }
  // The scales of blocks b … b + 3, d[k] lane n: block b + k of row n. Each row's 64 bytes from block b are merged
  // in a tree of two-source word permutes, 2 rows, 4, 8, then the halves by block (a gather of 16 halves per block
  // took as long as the rest of the block's work).
  [[gnu::always_inline]] static void scales(const TileRows& rows, int64_t b, __m512* d) {
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
  [[gnu::always_inline]] static void unpack(const TileRows& rows, int64_t b, __m512i* v) {
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
  template <bool>
  [[gnu::always_inline]] static __m512i sum(const __m512i* v, const Q8Block& x) {
    __m512i s[2] = {_mm512_set1_epi32(x.q8_bias), _mm512_setzero_si512()};
    for (int c = 0; c < 8; ++c) s[c % 2] = _mm512_dpbusd_epi32(s[c % 2], v[c], _mm512_set1_epi32(load_i32(x.q + 4 * c)));
    return _mm512_add_epi32(s[0], s[1]);
  }
  // The scales of blocks b and b + 1: the same tree as Q4_0's over each row's words 0 and 17.
  [[gnu::always_inline]] static void scales(const TileRows& rows, int64_t b, __m512* d) {
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
template <class Type, int R, bool unpacked>
[[gnu::always_inline]] inline void multiply_block(const __m512i* v, __m512 d, const Q8Block* const* x, int64_t b, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const Q8Block& xb = x[r][b];
    const __m512i sum = Type::template sum<!unpacked>(v, xb);
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
    const TileRows rows = tile_rows(first, bytes);
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
    Type::unpack(tile_rows(first, bytes), b, v);
    use(b, v, tail_scales<Type>(first, bytes, b));
  }
}

// A tile against R ≤ 4 rows of X, unpacked block by block as it is read. Without prefetches generation ran at two
// thirds of its speed (16 streams a row's width apart are more than the hardware follows). Every block or every third
// (34 or 54 bytes: no line skipped), for each of the 16 rows: the line of the next tile's row at this block into the
// L2 cache (in the order the next tile reads them: all of its first rows' lines first left its last rows late; into
// L1, two tiles of 27 KiB at K = 3072 did not fit), and the line ~108 bytes ahead in this tile into L1 (medians of 11
// alternating Q4_0 generations on one thread: 43.8 tok/s with the first alone, 46.8 with both; 2 threads 49 → 59).
template <class Type, int R>
void tile_direct(const unsigned char* first, int64_t bytes, int64_t blocks, const Q8Block* const* x, int valid,
                  const unsigned char* next, int next_rows, float beta, float* out, int64_t ld) {
  constexpr int64_t every = 64 / Type::kBlockBytes, near = 108 / Type::kBlockBytes;
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for_each_block<Type>(first, bytes, blocks, [&](int64_t b, const __m512i* v, __m512 d) {
    if (b % every == 0) {  // all 16 rows (a prefetch past the matrix's end does not fault)
      if (next_rows > 0) {
        const TileRows ahead = tile_rows(next, bytes);
        for (int n = 0; n < kTile; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(ahead.row(n, b * Type::kBlockBytes)), _MM_HINT_T1);
      }
      const TileRows here = tile_rows(first, bytes);
      for (int n = 0; n < kTile; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(here.row(n, (b + near) * Type::kBlockBytes)), _MM_HINT_T0);
    }
    multiply_block<Type, R, false>(v, d, x, b, acc);
  });
  store<R>(acc, valid, beta, out, ld);
}

template <class Type>
void unpack_tile(const unsigned char* first, int64_t bytes, int64_t blocks, TileBlock* tile) {
  for_each_block<Type>(first, bytes, blocks, [&](int64_t b, const __m512i* v, __m512 d) {
    Type::store(v, tile[b].v);
    _mm512_store_ps(&tile[b].d, d);
  });
}

template <class Type, int R>
void tile_unpacked(const TileBlock* tile, int64_t blocks, const Q8Block* const* x, int valid, float beta, float* out,
                    int64_t ld) {
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) multiply_block<Type, R, true>(tile[b].v, tile[b].d, x, b, acc);
  store<R>(acc, valid, beta, out, ld);
}

template <class Type>
void tiles_of(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld) {
  const int64_t blocks = x[0]->size() / kQK;
  thread_local std::vector<const Q8Block*> natural;  // kept: generation calls this ~200 times a token
  natural.resize(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) natural[r] = reinterpret_cast<const Q8Block*>(x[r]->data());
  const auto* base = static_cast<const unsigned char*>(w);
  // The last tile of fewer than 16 rows is copied beside zero rows, so every tile reads 16 rows `row_bytes` apart.
  thread_local std::vector<unsigned char> tail;
  thread_local std::vector<TileBlock> unpacked;
  if (count > kGroup && unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  for (int64_t n0 = 0; n0 < rows; n0 += kTile) {
    const int valid = static_cast<int>(std::min<int64_t>(kTile, rows - n0));
    const unsigned char* first = base + n0 * row_bytes;
    if (valid < kTile) {
      tail.assign(static_cast<size_t>(kTile * row_bytes), 0);
      std::memcpy(tail.data(), first, static_cast<size_t>(valid * row_bytes));
      first = tail.data();
    }
    const int next_rows = static_cast<int>(std::clamp<int64_t>(rows - n0 - valid, 0, kTile));
    const unsigned char* next = base + (n0 + valid) * row_bytes;
    float* o = out + n0;
    const Q8Block* const* xs = natural.data();
    if (count <= kGroup) {
      switch (count) {
        case 1: tile_direct<Type, 1>(first, row_bytes, blocks, xs, valid, next, next_rows, beta, o, ld); break;
        case 2: tile_direct<Type, 2>(first, row_bytes, blocks, xs, valid, next, next_rows, beta, o, ld); break;
        case 3: tile_direct<Type, 3>(first, row_bytes, blocks, xs, valid, next, next_rows, beta, o, ld); break;
        default: tile_direct<Type, 4>(first, row_bytes, blocks, xs, valid, next, next_rows, beta, o, ld); break;
      }
      continue;
    }
    unpack_tile<Type>(first, row_bytes, blocks, unpacked.data());
    for (int m0 = 0; m0 < count; m0 += kGroup) {
      float* om = o + m0 * ld;
      switch (std::min(kGroup, count - m0)) {
        case 1: tile_unpacked<Type, 1>(unpacked.data(), blocks, xs + m0, valid, beta, om, ld); break;
        case 2: tile_unpacked<Type, 2>(unpacked.data(), blocks, xs + m0, valid, beta, om, ld); break;
        case 3: tile_unpacked<Type, 3>(unpacked.data(), blocks, xs + m0, valid, beta, om, ld); break;
        default: tile_unpacked<Type, 4>(unpacked.data(), blocks, xs + m0, valid, beta, om, ld); break;
      }
    }
  }
}

}  // namespace

void dot_rows_in_lanes(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld) {
  if (x[0]->type() == WeightType::Q8_0) tiles_of<Q8_0Tiles>(w, row_bytes, rows, x, count, beta, out, ld);
  else tiles_of<Q4_0Tiles>(w, row_bytes, rows, x, count, beta, out, ld);
}

#endif

}  // namespace qkv::kernels::quant
