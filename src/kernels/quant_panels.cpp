// Q4_0 weights times 8-bit activations with the weight rows in the lanes (AVX-512 VNNI builds; see quant_dot.hpp).
//
// The one-row kernels of quant_dot.cpp give each block of a weight row 4 of a vector's 16 int32 lanes, so every 128
// values of a row of W against a row of X cost two vpdpbusd and three float operations (convert, scale, add), and a
// horizontal sum at the end: at 512 rows of X they ran at ~30 products per cycle, short of llama.cpp's. Here 16 rows
// of W (a panel) share each vector, one lane each: block b of the panel is 8 vectors of unsigned levels (vector c,
// lane n: values 4c … 4c + 3 of row n, as their nibbles q + 8), so the 32 values of a block against a row of X are
// 8 vpdpbusd with that row's 4 bytes broadcast, and one float multiply-add per block serves 16 rows of W.
//
// A row of Y is y[n] = acc after acc ← fma(float(Σ_j nib_j·q_j − 8·Σ_j q_j), d_w·d_x, acc) over the blocks in order
// (from 0; the integer sum is exact): the same whatever the number of rows of X, their place among the others or the
// threads, so a batch gives each sequence the values it gets alone.
//   few rows of X (generation): each block of a panel is unpacked from the rows as they lie in the file (a 4-byte
//     transpose of the 16 rows' 16 bytes of nibbles, the 16 scales merged four blocks at a time) and multiplied at
//     once, in registers;
//   more rows: the panel is unpacked once into a buffer (576 bytes per block: 27 KiB at K = 1024, in L1 or L2) and
//     every group of 4 rows of X passes over it.
// Against the one-row kernels at 512 rows (Qwen3-0.6B's shapes, one Zen 5 thread): 174–182 → 354–444 GFLOP/s. In
// generation the transposes cost about what the old kernel's per-row float work did (within the machine's noise on 2
// threads; ~10% slower on 1).
#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_blocks.hpp"
#include "quant_dot.hpp"
#include "simd.hpp"

namespace qkv::kernels::quant {

#if defined(QKV_DOT512)

namespace {

constexpr int kPanel = 16;  // rows of W per panel: one per int32 lane
constexpr int kGroup = 4;   // rows of X multiplied together with a panel's block (8 ran 10% slower at 512 rows)

// Block b of a panel, unpacked: v[c] lane n holds values 4c … 4c + 3 of row n as nibble levels (0–15); d its scales.
struct alignas(64) PanelBlock {
  __m512i v[8];
  __m512 d;
};
static_assert(sizeof(PanelBlock) == 576, "a panel block is 9 cache lines");

int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 16 rows of a panel: rows 4j … 4j + 3 at quarter[j] + {0, 1, 2, 3}·bytes, each address one base register and
// one index register (bytes, 2·bytes as a scaled index, 3·bytes). With the 16 addresses written plainly, GCC kept 16
// row pointers, which do not fit in the registers (it moved them through vector registers: a third of the loop).
struct PanelRows {
  const unsigned char* quarter[4];
  int64_t bytes, bytes3;
  const unsigned char* row(int n, int64_t at) const {
    const int k = n % 4;
    return quarter[n / 4] + at + (k == 0 ? 0 : k == 1 ? bytes : k == 2 ? 2 * bytes : bytes3);
  }
};

PanelRows panel_rows(const unsigned char* first, int64_t bytes) {
  PanelRows rows{{first, first + 4 * bytes, first + 8 * bytes, first + 12 * bytes}, bytes, 3 * bytes};
  // hidden from the compiler, so that it computes each address from these rather than keeping one per row
  asm("" : "+r"(rows.bytes), "+r"(rows.bytes3));
  return rows;
}

// Block b of the 16 rows `bytes` apart from `first`: each row's 16 bytes of nibbles as 4 int32 lanes, transposed so
// that vector k holds bytes 4k … 4k + 3 of every row (byte j of a row: value j in the low nibble, j + 16 in the high
// one), then split into low and high nibbles.
[[gnu::always_inline]] inline void unpack_levels(const PanelRows& rows, int64_t b, __m512i* v) {
  const int64_t at = b * int64_t{sizeof(BlockQ4_0)} + 2;
  auto qs = [&](int n) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.row(n, at))); };
  __m512i rows4[4];  // rows4[k], 128-bit lane j: row k + 4j
  for (int k = 0; k < 4; ++k)
    rows4[k] = _mm512_inserti32x4(
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(qs(k)), qs(k + 4), 1), qs(k + 8), 2), qs(k + 12), 3);
  const __m512i t0 = _mm512_unpacklo_epi32(rows4[0], rows4[1]), t1 = _mm512_unpackhi_epi32(rows4[0], rows4[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(rows4[2], rows4[3]), t3 = _mm512_unpackhi_epi32(rows4[2], rows4[3]);
  const __m512i words[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                            _mm512_unpackhi_epi64(t1, t3)};  // words[k] lane n: bytes 4k … 4k + 3 of row n
  // the high nibbles stay in place, 16 times their level (the product is taken back by a shift of the sum): one
  // operation each instead of a shift and a mask
  const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(static_cast<char>(0xf0));
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm512_and_si512(words[k], low);
    v[k + 4] = _mm512_and_si512(words[k], high);
  }
}

// The scales of block b of the 16 rows, gathered (the blocks after the last group of 4; see scales4)
[[gnu::always_inline]] inline __m512 gather_scales(const unsigned char* first, int64_t bytes, int64_t b) {
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int32_t>(bytes)),
                                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const unsigned char* at = first + b * int64_t{sizeof(BlockQ4_0)};
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(row_offsets, at, 1)));
}

// The scales of blocks b … b + 3 of the 16 rows, d[k] lane n: block b + k of row n. A gather of 16 halves per block
// took as long as the rest of the block's work; here each row's 64 bytes from block b (whose 16-bit words 0, 9, 18 and
// 27 are the four scales) are merged in a tree of two-source word permutes, 2 rows, 4, 8, then the halves by block.
[[gnu::always_inline]] inline void scales4(const PanelRows& rows, int64_t b, __m512* d) {
  const int64_t at = b * int64_t{sizeof(BlockQ4_0)};
  auto row = [&](int n) { return _mm512_loadu_si512(rows.row(n, at)); };
  // word 2k + j of a pair: block k of its row j (of 2); of a quad 4k + j; of an octet 8k + j
  const __m512i pair = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        59, 27, 50, 18, 41, 9, 32, 0);
  const __m512i quad = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 39, 38, 7, 6, 37, 36, 5, 4,
                                        35, 34, 3, 2, 33, 32, 1, 0);
  const __m512i octet = _mm512_set_epi16(47, 46, 45, 44, 15, 14, 13, 12, 43, 42, 41, 40, 11, 10, 9, 8, 39, 38, 37, 36,
                                         7, 6, 5, 4, 35, 34, 33, 32, 3, 2, 1, 0);
  // the two octets (rows 0–7, 8–15) as blocks 0 and 1 of all 16 rows, and blocks 2 and 3
  const __m512i first_half = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8, 39, 38, 37,
                                              36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
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

// acc[r] lane n += the product of block b of panel row n with block b of X's row r, for R rows of X.
// high16: v[4 … 7] hold the high nibbles in place (16 times their level), as unpack_levels leaves them; else their
// levels (an unpacked panel's). The integer sum is the same either way.
template <int R, bool high16>
[[gnu::always_inline]] inline void multiply_block(const __m512i* v, __m512 d, const Q8Block* const* x, int64_t b, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const Q8Block& xb = x[r][b];
    // two chains of integer sums, the low nibbles' and the high ones' (times 16: see unpack_levels), so each
    // vpdpbusd waits on the one before last; exact in int32 (|Σ| ≤ 16·16·15·127)
    __m512i low = _mm512_set1_epi32(xb.q4_bias), high = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      low = _mm512_dpbusd_epi32(low, v[c], _mm512_set1_epi32(load_i32(xb.q + 4 * c)));
      high = _mm512_dpbusd_epi32(high, v[c + 4], _mm512_set1_epi32(load_i32(xb.q + 16 + 4 * c)));
    }
    const __m512i sum = _mm512_add_epi32(low, high16 ? _mm512_srai_epi32(high, 4) : high);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(xb.dx)), acc[r]);
  }
}

// out[r·ld + n] = dots[r][n] (+ beta·out) for the panel's `valid` rows: the scalar expression of quant_dot.cpp's
// over_rows, so a row's value is the same whichever path wrote it.
template <int R>
[[gnu::always_inline]] inline void store(const __m512* acc, int valid, float beta, float* out, int64_t ld) {
  alignas(64) float dots[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(dots, acc[r]);
    float* o = out + r * ld;
    for (int n = 0; n < valid; ++n) o[n] = beta == 0.0f ? dots[n] : dots[n] + beta * o[n];
  }
}

// Each block of a panel, unpacked (scales four blocks at a time), handed to `use(b, v, d)`.
template <class Use>
[[gnu::always_inline]] inline void for_each_block(const unsigned char* first, int64_t bytes, int64_t blocks, Use&& use) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const PanelRows rows = panel_rows(first, bytes);
    __m512 d[4];
    scales4(rows, b, d);
    for (int k = 0; k < 4; ++k) {
      __m512i v[8];
      unpack_levels(rows, b + k, v);
      use(b + k, v, d[k]);
    }
  }
  for (; b < blocks; ++b) {
    __m512i v[8];
    unpack_levels(panel_rows(first, bytes), b, v);
    use(b, v, gather_scales(first, bytes, b));
  }
}

// A panel against R ≤ 4 rows of X, unpacked block by block as it is read. The next panel's rows are asked for
// meanwhile, into the L2 cache, in the order they will be read: every third block (54 bytes: no line skipped), the
// line of each of its rows at this block (its first rows' lines asked for first, all of them, left the last rows'
// for the next panel's start; into L1, two panels of 27 KiB at K = 3072 did not fit).
template <int R>
void panel_direct(const unsigned char* first, int64_t bytes, int64_t blocks, const Q8Block* const* x, int valid,
                  const unsigned char* next, int next_rows, float beta, float* out, int64_t ld) {
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for_each_block(first, bytes, blocks, [&](int64_t b, const __m512i* v, __m512 d) {
    if (next_rows > 0 && b % 3 == 0) {  // all 16 (a prefetch past the matrix's end does not fault)
      const PanelRows ahead = panel_rows(next, bytes);
      for (int n = 0; n < kPanel; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(ahead.row(n, b * int64_t{sizeof(BlockQ4_0)})), _MM_HINT_T1);
    }
    multiply_block<R, true>(v, d, x, b, acc);
  });
  store<R>(acc, valid, beta, out, ld);
}

void unpack_panel(const unsigned char* first, int64_t bytes, int64_t blocks, PanelBlock* panel) {
  for_each_block(first, bytes, blocks, [&](int64_t b, const __m512i* v, __m512 d) {
    for (int c = 0; c < 4; ++c) _mm512_store_si512(panel[b].v + c, v[c]);
    for (int c = 4; c < 8; ++c) _mm512_store_si512(panel[b].v + c, _mm512_srli_epi16(v[c], 4));  // levels, once
    _mm512_store_ps(&panel[b].d, d);
  });
}

template <int R>
void panel_unpacked(const PanelBlock* panel, int64_t blocks, const Q8Block* const* x, int valid, float beta, float* out,
                    int64_t ld) {
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) multiply_block<R, false>(panel[b].v, panel[b].d, x, b, acc);
  store<R>(acc, valid, beta, out, ld);
}

}  // namespace

void dot_rows_q4_0_panels(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                          float beta, float* out, int64_t ld) {
  const int64_t blocks = x[0]->size() / kQK;
  thread_local std::vector<const Q8Block*> natural;  // kept: generation calls this ~200 times a token
  natural.resize(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) natural[r] = reinterpret_cast<const Q8Block*>(x[r]->data());
  const auto* base = static_cast<const unsigned char*>(w);
  // The last panel of fewer than 16 rows is copied beside zero rows, so every panel reads 16 rows `row_bytes` apart.
  thread_local std::vector<unsigned char> tail;
  thread_local std::vector<PanelBlock> unpacked;
  if (count > kGroup && unpacked.size() < static_cast<size_t>(blocks)) unpacked.resize(static_cast<size_t>(blocks));
  for (int64_t n0 = 0; n0 < rows; n0 += kPanel) {
    const int valid = static_cast<int>(std::min<int64_t>(kPanel, rows - n0));
    const unsigned char* first = base + n0 * row_bytes;
    if (valid < kPanel) {
      tail.assign(static_cast<size_t>(kPanel * row_bytes), 0);
      std::memcpy(tail.data(), first, static_cast<size_t>(valid * row_bytes));
      first = tail.data();
    }
    const int next_rows = static_cast<int>(std::clamp<int64_t>(rows - n0 - valid, 0, kPanel));
    const unsigned char* next = base + (n0 + valid) * row_bytes;
    float* o = out + n0;
    if (count <= kGroup) {
      switch (count) {
        case 1: panel_direct<1>(first, row_bytes, blocks, natural.data(), valid, next, next_rows, beta, o, ld); break;
        case 2: panel_direct<2>(first, row_bytes, blocks, natural.data(), valid, next, next_rows, beta, o, ld); break;
        case 3: panel_direct<3>(first, row_bytes, blocks, natural.data(), valid, next, next_rows, beta, o, ld); break;
        default: panel_direct<4>(first, row_bytes, blocks, natural.data(), valid, next, next_rows, beta, o, ld); break;
      }
      continue;
    }
    unpack_panel(first, row_bytes, blocks, unpacked.data());
    for (int m0 = 0; m0 < count; m0 += kGroup) {
      const Q8Block* const* xs = natural.data() + m0;
      float* om = o + m0 * ld;
      switch (std::min(kGroup, count - m0)) {
        case 1: panel_unpacked<1>(unpacked.data(), blocks, xs, valid, beta, om, ld); break;
        case 2: panel_unpacked<2>(unpacked.data(), blocks, xs, valid, beta, om, ld); break;
        case 3: panel_unpacked<3>(unpacked.data(), blocks, xs, valid, beta, om, ld); break;
        default: panel_unpacked<4>(unpacked.data(), blocks, xs, valid, beta, om, ld); break;
      }
    }
  }
}

#endif

}  // namespace qkv::kernels::quant
