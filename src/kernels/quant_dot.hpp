// The one-row products of a stored weight row with a row of activations (internal to src/kernels/): the activations
// quantized once to 8-bit blocks, every block of the weight row multiplied in integers (vpdpbusd / vpmaddubsw), scaled
// in float. Used by weights.cpp's gemm_weight for generation's few rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "qkv/kernels/quant.hpp"
#include "simd.hpp"

// The builds of the integer kernels: AVX-512 with VNNI, AVX2 (with F16C), or plain C++.
#if defined(QKV_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QKV_DOT512 1
#endif
#if defined(QKV_AVX2) && defined(__F16C__)
#define QKV_DOT256 1
#endif

namespace qkv::kernels::quant {

// A block of 32 activations as the Q8_0 and Q4_0 products read it: x ≈ dx·q (the first part of an ActivationRow's
// bytes for those types, one per 32 values, in order).
struct alignas(64) Q8Block {
  int8_t q[32];
  float dx;
  int32_t sum;      // Σ q
  int32_t q4_bias;  // −8·Σ q: a Q4_0 product starts here, its weights read as their nibbles q + 8
  int32_t q8_bias;  // −128·Σ q: a Q8_0 product starts here, its weights read as q + 128
  int32_t pad[4];
};
static_assert(sizeof(Q8Block) == 64, "activation blocks stay 64-byte multiples");

// A block of 256 activations as the K-quant products read it: ggml's block_q8_K (x ≈ d·q), q in the kernel's order
// (natural in the AVX2 build; see quant_dot.cpp's k_order), with the sums of its levels per 16 and per 32 values.
struct alignas(64) Q8KBlock {
  int8_t q[256];
  int16_t bsums[16];   // Σ q over each 16 values, natural order
  int16_t sums32[8];   // Σ q over each 32 values (bsums[2j] + bsums[2j + 1]), natural order
  float d;
  int32_t pad[3];
};
static_assert(sizeof(Q8KBlock) == 320, "activation blocks stay 64-byte multiples");
#if defined(QKV_DOT512)
// The AVX-512 build's order of a Q4_K or Q5_K activation block's sub-blocks of 32 (Q8KBlock::q): its one-row kernels
// take 64 bytes of nibbles at a time, whose low nibbles are sub-blocks 0 and 2 (the high ones 1 and 3).
inline constexpr int kKOrder512[8] = {0, 2, 1, 3, 4, 6, 5, 7};
#endif

// One row of K activations quantized for the products with one weight type, as the kernels of this build read it.
// Q8_0 and Q4_0 weights: per 32 values a scale dx = max|x|/127 and q = x/dx rounded to nearest even (|q| ≤ 127) —
// ggml's q8_0 activations; the K-quants: per 256 values ggml's q8_K (dx = −max/127 for the signed largest value,
// q = nearest_int(x/dx), with the sums of each 16 q). A block holding a NaN or ±Inf gets dx = NaN: its products are NaN,
// as a float product's would be. The bytes are laid out for the kernel (see quant_dot.cpp); block_scale and value
// read them back in the natural order, for references and tests.
class ActivationRow {
 public:
  void quantize(WeightType type, const float* x, int64_t K);
  WeightType type() const { return type_; }
  int64_t size() const { return K_; }
  // The scale of block b (of 32 values for Q8_0/Q4_0, 256 for the K-quants) and the level of value k.
  float block_scale(int64_t b) const;
  int level(int64_t k) const;

  const unsigned char* data() const { return data_; }

 private:
  WeightType type_ = WeightType::Q8_0;
  int64_t K_ = 0;
  std::vector<unsigned char> storage_;
  unsigned char* data_ = nullptr;  // storage_, 64-byte aligned
};

#if defined(QKV_DOT512)
// The AVX-512 build's Q4_0 (and MXFP4) activations, after the natural blocks: four blocks per 512-bit step, the 16 low
// nibbles' partners of each block (values 0 … 15) side by side, then the 16 high ones' (values 16 … 31); block k of
// the quad owns int32 lanes 4k … 4k + 3, which start from bias (−offset·Σq in the first, zeros after: Q4_0's offset
// 8, MXFP4's 12), and xs holds its scale in those lanes. Read by quant_lanes.cpp's Q4_0 kernel for few rows and
// quant_dot.cpp's MXFP4 kernel.
struct alignas(64) Q4_0Quad {
  int8_t low[64];
  int8_t high[64];
  int32_t bias[16];
  float xs[16];
};
#elif defined(QKV_DOT256)
// The AVX2 build's: the same two blocks per 256-bit step (block k of the pair owns lanes 4k … 4k + 3).
struct alignas(64) Q4_0Pair {
  int8_t low[32];
  int8_t high[32];
  int32_t bias[8];
  float dx[2];
  float pad[6];
};
#endif

#if defined(QKV_DOT256)

// acc + Σ of four adjacent u8 × s8 products in each int32 lane: vpdpbusd where the build has a 256-bit one, else
// vpmaddubsw (pairs into int16: callers keep |u·s| pairs below 32768) and vpmaddwd with ones.
[[gnu::always_inline]] inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// acc + the int16 pairs of a (vpmaddubsw's) times the int16 scales in b, summed in pairs.
[[gnu::always_inline]] inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

// The 8 six-bit scales and 8 mins of a Q4_K/Q5_K block as 16 bytes: scales 0–7, then mins 0–7 (ggml's utmp unpacking
// of scale_min_k4's layout, four bytes at a time, here in one vector: the scalar version with its four inserts ran 14%
// slower, measured on a Zen 5). Reads 16 bytes from `packed`: the block's quants follow its 12 bytes of scales.
// Suits the tiles, which take 8 rows' at a time; the one-row kernels take scales_mins_words instead.
#if defined(QKV_DOT256)
inline __m128i unpack_scales_mins(const uint8_t* packed) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));  // u0 u1 u2 (and 4 bytes of quants)
  const __m128i a = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0));               // u0 u2 u1 u2
  const __m128i b = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));               // u0 u0 u1 u1
  // scales 0–3 = u0 & 0x3f…, mins 0–3 = u1 & 0x3f…; scales 4–7 = (u2 & 0x0f…) | (u0 >> 6 & 3…) << 4,
  // mins 4–7 = (u2 >> 4 & 0x0f…) | (u1 >> 6 & 3…) << 4
  const __m128i low6 = _mm_and_si128(a, _mm_set1_epi32(0x3f3f3f3f));
  const __m128i nibbles = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi32(0x0f0f0f0f));
  const __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(b, 6), _mm_set1_epi32(0x03030303)), 4);
  return _mm_blend_epi32(low6, _mm_or_si128(nibbles, top), 0b1010);
}
#endif

// The same unpacking in general-purpose registers, for the one-row kernels: scales 0–7 in the bytes of `scales`
// (byte j: scale j), mins 0–7 in those of `mins`. Their vector ports are busy with the products, while the integer
// ones idle; the scales reach a vector by one broadcast, and vpshufb picks each as an int16 from its byte. The Q4_K
// one-row kernel ran ~25% faster so than with unpack_scales_mins (AVX2, weights from L2, Zen 5: 21–22 → 27–28 GB/s).
// (ggml's four 32-bit words, put into a vector by inserts, had been 14% slower: the inserts are vector work.)
struct KScalesMins {
  uint64_t scales, mins;
};
inline KScalesMins scales_mins_words(const uint8_t* packed) {
  // u0: scales 0–3 (low 6 bits), u1: mins 0–3; their top 2 bits and u2's nibbles: scales and mins 4–7. (Three loads:
  // one copy of the 12 bytes went through the stack, and its reloads stalled the kernel.)
  uint32_t u[3];
  for (int i = 0; i < 3; ++i) std::memcpy(&u[i], packed + 4 * i, 4);
  const uint32_t scales_high = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
  const uint32_t mins_high = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
  return {(u[0] & 0x3f3f3f3fu) | uint64_t{scales_high} << 32, (u[1] & 0x3f3f3f3fu) | uint64_t{mins_high} << 32};
}

// out[r·ld + n] = Σ_k W[n][k]·x_r[k] (+ beta·out[r·ld + n]; beta 0: out is not read) for the weight rows n < rows,
// `row_bytes` apart, of x_r's type (a block type) and size, and the `count` rows of quantized activations x_0 … x_{count−1}.
// Each block of a weight row is unpacked once for up to kMaxDotRows rows of activations.
inline constexpr int kMaxDotRows = 4;
void dot_rows(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count, float beta,
              float* out, int64_t ld);

// Whether dot_rows takes every row of activations at once for this type (and should be given them all: it reads W
// once for all of them, kLanesTileRows rows of W at a time), rather than kMaxDotRows at a time: Q4_0, Q8_0, Q4_K and
// Q5_K in the AVX-512 VNNI build and the AVX2 one (Q4_K and Q5_K from kKTileRows rows of X; fewer go one row of W at
// a time, by the same arithmetic).
constexpr bool takes_all_rows(WeightType type) {
#if defined(QKV_DOT512) || defined(QKV_DOT256)
  return type == WeightType::Q4_0 || type == WeightType::Q8_0 || type == WeightType::Q4_K || type == WeightType::Q5_K;
#else
  (void)type;
  return false;
#endif
}
// The rows of W those kernels take at once (one per int32 lane); a thread's slice of W is a multiple of it. And the
// chains the blocks of Q4_0 and Q8_0 are summed in, in both builds: a row of Y is the sum of kLanesChains float32
// chains, chain j over the blocks b ≡ j (mod kLanesChains) in order (quant_lanes.cpp). (Q4_K and Q5_K: a chain of the
// scaled sums and one of the mins, see quant_dot.cpp's dot_q45_K.)
#if defined(QKV_DOT512)
inline constexpr int64_t kLanesTileRows = 16;
#else
inline constexpr int64_t kLanesTileRows = 8;
#endif
inline constexpr int kLanesChains = 8;
// More than kMaxDotRows rows of X pass over W in chunks of about this many bytes of its rows (at least a tile's), each
// group of kMaxDotRows rows of X in turn, so that W comes from memory once and from the caches for the other groups.
// (Before, each group walked the whole of W: 8 rows of X read it twice from memory.)
inline constexpr int64_t kDotChunkBytes = int64_t{32} << 10;
// The rows of W per chunk for `count` rows of X: all of them for one group, else kDotChunkBytes' worth, at least
// `at_least` (a tile).
constexpr int64_t dot_chunk_rows(int count, int64_t rows, int64_t row_bytes, int64_t at_least) {
  if (count <= kMaxDotRows) return rows;
  const int64_t fit = kDotChunkBytes / row_bytes;
  return fit > at_least ? fit : at_least;
}
// The rows of X from which Q4_K and Q5_K go to the tiles (fewer: the one-row kernel, kMaxDotRows rows of X at a time
// over chunks of W). Unpacking a tile of 16 rows (AVX-512) costs about what 8 rows of X take in the one-row kernel
// (one thread, W from memory: 8 rows 4.9 GB/s of W in the tiles, 7.0 in the one-row kernel's two passes; 16 rows 4.0
// in the tiles). AVX2's 8-row tiles matched the one-row kernel at 8 rows until its Q4_K unpacking moved to integer
// registers; since then, with the chunks, two groups of 4 rows take 0.72–0.83× the tiles' time at 8 rows in
// qkv_quant_bench's streaming table (gate, up 3072 × 1024, one thread) and match them at 16; from memory, 0.88–1.02×
// (docs/performance.md, "Batches of 5–8 rows on AVX2").
inline constexpr int kKTileRows = 9;
// Likewise Q4_0 and Q8_0 run their few-rows kernels (each row of W read alone) up to this many rows of X, in groups
// of 4 over chunks of W; more go to the tiles unpacked once for all. AVX2 build, at 8 rows from memory the groups took
// 0.83–0.97× (Q4_0) and 0.68–0.96× (Q8_0) the tiles' time; at 16, about the same as the tiles. The AVX-512 build's
// 16-row tiles cost less per row of X: at 8 rows they took 0.6–1.2× the groups' time (Q8_0 0.6–0.65×), at 4 rows
// 1.0–1.4×, at 2 rows 1.5–2.7× (qkv_quant_bench's streaming table, 1 and 2 threads).
#if defined(QKV_DOT512)
inline constexpr int kLanesDirectRows = 4;
#else
inline constexpr int kLanesDirectRows = 8;
#endif
#if defined(QKV_DOT512) || defined(QKV_DOT256)
// dot_rows for the types of takes_all_rows, the rows of W in the lanes of a vector (quant_lanes.cpp)
void dot_rows_in_lanes(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld);
#endif

// The same for rows of K halves or bfloat16 (type F16 or BF16) and `count` rows of float32 activations, each row of W
// widened to float32 once in the loop (vcvtph2ps, or a 16-bit shift), products summed in float32.
void dot_rows_16bit(WeightType type, const void* w, int64_t row_bytes, int64_t rows, const float* const* x, int count,
                    int64_t K, float beta, float* out, int64_t ld);

// What dot_rows runs in this build, e.g. "AVX512-VNNI vpdpbusd/vpdpwssd, 512-bit".
const char* dot_backend();

}  // namespace qkv::kernels::quant
