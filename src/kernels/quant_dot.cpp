// One stored weight row times one row of quantized activations (see quant_dot.hpp): integer dot products per block,
// scaled in float. Three builds of each kernel: AVX-512 with VNNI (vpdpbusd, vpdpwssd; Zen 4/5, Ice Lake and later
// Xeons), AVX2 (vpmaddubsw + vpmaddwd, or the 256-bit vpdpbusd of AVX512-VL or AVX-VNNI on Intel client cores where the
// build has it), and plain C++ for other CPUs. Generation reads every weight once per token, so these run at the
// memory's rate only if the work per byte stays small: the activations are laid out once per row in the order and
// with the per-lane scales and offsets each kernel consumes, so the loop over the weight row does loads, the unpacking
// of its bits, one integer product per 32–64 values and one float multiply-add per group of blocks. (Q4_0 and Q8_0 in
// the AVX-512 VNNI and AVX2 builds go to quant_lanes.cpp instead: one row of W at a time for few rows of X, 16 or 8
// rows of W at a time, one per lane, for more. So do Q4_K and Q5_K from kKTileRows rows of X.)
#include "quant_dot.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "quant_blocks.hpp"
#include "simd.hpp"

namespace qkv::kernels::quant {

namespace {

// The weight stream a thread reads is contiguous (its rows one after another): each step asks for the line this far
// ahead, as gemm_bf16's row kernel does (the hardware prefetcher alone leaves a 2-thread stream short of the read rate).
constexpr int64_t kPrefetchBytes = 8192;

// ---- the activation layouts ----
// Every block in natural order first (Q8Block per 32, Q8KBlock per 256): the references, the tails and the kernels
// without a packed layout read these (Q8Block and Q8KBlock: quant_dot.hpp). Then, for Q4_0 and MXFP4, the packed
// groups.

#if defined(QKV_DOT512)
// AVX-512 Q4_0 and MXFP4: Q4_0Quad (quant_dot.hpp). (Q8_0 reads the natural blocks.)
constexpr int kQ4_0Group = 4;
using Q4_0Group = Q4_0Quad;
#elif defined(QKV_DOT256)
// AVX2 Q4_0 and MXFP4: Q4_0Pair (quant_dot.hpp). (Q8_0 reads the natural blocks.)
constexpr int kQ4_0Group = 2;
using Q4_0Group = Q4_0Pair;
#else
constexpr int kQ4_0Group = 1;
struct Q4_0Group {};
#endif

// The order in which the kernel reads a K-quant block's sub-blocks of 32 values. The 512-bit Q4_K/Q5_K kernels take
// 64 bytes of nibbles at a time, whose low nibbles are sub-blocks 0 and 2 (and the high ones 1 and 3).
const int* k_order(WeightType type) {
  static const int natural[8] = {0, 1, 2, 3, 4, 5, 6, 7};
#if defined(QKV_DOT512)
  if (type == WeightType::Q4_K || type == WeightType::Q5_K) return kKOrder512;
#endif
  (void)type;
  return natural;
}

bool is_k_quant(WeightType type) {
  return type == WeightType::Q4_K || type == WeightType::Q5_K || type == WeightType::Q6_K;
}

// Bytes of the natural blocks, and where the packed groups start.
int64_t natural_bytes(WeightType type, int64_t K) {
  return is_k_quant(type) ? K / kQK_K * int64_t{sizeof(Q8KBlock)} : K / kQK * int64_t{sizeof(Q8Block)};
}

#if defined(QKV_DOT256)
// The quantized activations are computed once per row, but generation multiplies ~200 matrices a token, the small ones
// (1024 × 1024 in Q4_0: 576 KiB, ~20 µs) with a row of 1024 activations: their quantization in scalar code took 2.5–3
// µs of each product. These vector versions give the same bytes (the same operations on each value; maxima and sums
// do not depend on the order).
float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
float min8(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}
int32_t sum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
// 32 int32 levels (four vectors, in order) as 32 int8 in order (they fit: |q| ≤ 127).
__m256i pack_levels(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// Lanes holding NaN or ±Inf: x − x is NaN exactly there.
__m256 non_finite(__m256 x) { return _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ); }
#endif

// Absmax quantization of 32 values, ggml's q8_0 (rounded to nearest even as its vector builds do).
void quantize_q8_block(const float* x, Q8Block* out) {
  std::memset(out, 0, sizeof *out);
#if defined(QKV_DOT256)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax8 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    bad = _mm256_or_ps(bad, non_finite(v[i]));
  }
  if (_mm256_movemask_ps(bad)) {
    out->dx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float amax = max8(amax8);
#else
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < 32; ++j) {
    finite &= std::isfinite(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  if (!finite) {
    out->dx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
#endif
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  out->dx = d;
#if defined(QKV_DOT256)
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // to nearest even
  _mm256_store_si256(reinterpret_cast<__m256i*>(out->q), pack_levels(q[0], q[1], q[2], q[3]));
  out->sum = sum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
#else
  for (int j = 0; j < 32; ++j) {
    out->q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    out->sum += out->q[j];
  }
#endif
  out->q4_bias = -8 * out->sum;
  out->q8_bias = -128 * out->sum;
}

// ggml's quantize_row_q8_K_ref: the signed largest value maps to −127, levels rounded by nearest_int (to even). Where +a
// and −a are both the largest magnitude, +a is taken (ggml takes the first): the scale and all levels change sign
// together, so no product does.
void quantize_q8k_block(const float* x, const int* order, Q8KBlock* out) {
  std::memset(out, 0, sizeof *out);
#if defined(QKV_DOT256)
  __m256 hi = _mm256_set1_ps(-INFINITY), lo = _mm256_set1_ps(INFINITY), bad = _mm256_setzero_ps();
  for (int j = 0; j < kQK_K; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    hi = _mm256_max_ps(hi, v);
    lo = _mm256_min_ps(lo, v);
    bad = _mm256_or_ps(bad, non_finite(v));
  }
  if (_mm256_movemask_ps(bad)) {
    out->d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float largest = max8(hi), smallest = min8(lo);
  const float max = largest >= -smallest ? largest : smallest;
  if (max == 0.0f) return;
  const float iscale = -127.0f / max;
  const __m256 scale = _mm256_set1_ps(iscale);
  const __m256i top = _mm256_set1_epi32(127);
  for (int s = 0; s < 8; ++s) {  // sub-block s of 32 values
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + 32 * s + 8 * i))), top);
    out->bsums[2 * s] = static_cast<int16_t>(sum8i(_mm256_add_epi32(q[0], q[1])));
    out->bsums[2 * s + 1] = static_cast<int16_t>(sum8i(_mm256_add_epi32(q[2], q[3])));
    out->sums32[s] = static_cast<int16_t>(out->bsums[2 * s] + out->bsums[2 * s + 1]);
    int slot = 0;
    while (order[slot] != s) ++slot;
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->q + 32 * slot), pack_levels(q[0], q[1], q[2], q[3]));
  }
#else
  float largest = -INFINITY, smallest = INFINITY;
  bool finite = true;
  for (int j = 0; j < kQK_K; ++j) {
    finite &= std::isfinite(x[j]);
    largest = std::max(largest, x[j]);
    smallest = std::min(smallest, x[j]);
  }
  if (!finite) {
    out->d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float max = largest >= -smallest ? largest : smallest;
  if (max == 0.0f) return;
  const float iscale = -127.0f / max;
  int8_t q[kQK_K];
  for (int j = 0; j < kQK_K; ++j) q[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * x[j]))));
  for (int j = 0; j < 16; ++j) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[16 * j + i];
    out->bsums[j] = static_cast<int16_t>(sum);
  }
  for (int j = 0; j < 8; ++j) out->sums32[j] = static_cast<int16_t>(out->bsums[2 * j] + out->bsums[2 * j + 1]);
  for (int s = 0; s < 8; ++s) std::memcpy(out->q + 32 * s, q + 32 * order[s], 32);
#endif
  out->d = 1.0f / iscale;
}

// ---- horizontal sums in a fixed order ----
#if defined(QKV_DOT256) && !defined(QKV_DOT512)  // (the 256-bit kernels')
// ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)), in registers (a store and scalar adds cost a tenth of a row)
float sum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // q[i] = v[i] + v[i + 4]
  const __m128 p = _mm_add_ps(q, _mm_movehdup_ps(q));                                    // q0 + q1, ·, q2 + q3, ·
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehl_ps(p, p)));
}
#endif
#if defined(QKV_DOT512)
float sum16(__m512 v) { return simd::reduce_add(v); }
#endif

// ---- the plain C++ products of one block (tails of the vector loops, builds without AVX2) ----

float dot_q8_0_block(const BlockQ8_0& w, const Q8Block& x) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) s += w.qs[j] * x.q[j];
  return static_cast<float>(s) * (half_to_float(w.d) * x.dx);
}

float dot_q4_0_block(const BlockQ4_0& w, const Q8Block& x) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += ((w.qs[j] & 0xf) - 8) * x.q[j] + ((w.qs[j] >> 4) - 8) * x.q[j + 16];
  return static_cast<float>(s) * (half_to_float(w.d) * x.dx);
}

float dot_mxfp4_block(const unsigned char* w, const Q8Block& x) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += kMxfp4Values[w[1 + j] & 0xf] * x.q[j] + kMxfp4Values[w[1 + j] >> 4] * x.q[j + 16];
  return static_cast<float>(s) * (e8m0_half(w[0]) * x.dx);
}

// Sub-block sums Σ q_w·q_x of a K-quant block in the natural order of the activations.
template <class Block>
float dot_k_block_scalar(const Block& w, const Q8KBlock& x, const int* order, WeightType type) {
  // natural position of activation value k within x.q
  auto xq = [&](int k) {
    const int s = k / 32;
    int slot = 0;
    while (order[slot] != s) ++slot;
    return static_cast<int32_t>(x.q[32 * slot + k % 32]);
  };
  if constexpr (std::is_same_v<Block, BlockQ6_K>) {
    int32_t total = 0;
    for (int n = 0; n < kQK_K; n += 128)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* ql = w.ql + n / 2;
        const uint8_t* qh = w.qh + n / 4;
        const int q[4] = {((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32, ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32,
                          ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32, ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32};
        for (int i = 0; i < 4; ++i) {
          const int k = n + l + 32 * i;
          total += w.scales[k / 16] * q[i] * xq(k);
        }
      }
    return static_cast<float>(total) * (half_to_float(w.d) * x.d);
  } else {
    int32_t scaled = 0, mins = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      scale_min_k4(j, w.scales, &sc, &m);
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) {
        const int k = 32 * j + i;
        int q = (j % 2 ? w.qs[32 * (j / 2) + i] >> 4 : w.qs[32 * (j / 2) + i] & 0xf);
        if (type == WeightType::Q5_K) {
          if constexpr (std::is_same_v<Block, BlockQ5_K>) q += (w.qh[i] >> j) & 1 ? 16 : 0;
        }
        s += q * xq(k);
      }
      scaled += sc * s;
      mins += m * (x.bsums[2 * j] + x.bsums[2 * j + 1]);
    }
    return static_cast<float>(scaled) * (half_to_float(w.d) * x.d) - static_cast<float>(mins) * (half_to_float(w.dmin) * x.d);
  }
}

// ---- the kernels: one weight row against R ≤ 4 rows of activations ----
// Each block's bits are unpacked once and multiplied with every row (generation of a few sequences at once, and the
// prompts and batches). Two accumulators per row alternate so the float multiply-adds of consecutive groups do not
// wait on each other — for every R alike: a row's sums must run in the same order whether it is alone or one of 4
// (one set for R > 1 made a row's value depend on the rows beside it).

template <int R>
struct Accumulators {
  static constexpr int kSets = 2;
};

// ---- Q8_0 ----
// (The SIMD builds take Q8_0 to quant_lanes.cpp: this is the plain C++ build's.)
template <int R>
[[gnu::always_inline]] inline void dot_q8_0(const BlockQ8_0* w, const unsigned char* const* act, int64_t blocks, float* out) {
  const Q8Block* natural[R];
  for (int r = 0; r < R; ++r) natural[r] = reinterpret_cast<const Q8Block*>(act[r]);
  float total[R] = {};
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < R; ++r) total[r] += dot_q8_0_block(w[b], natural[r][b]);
  for (int r = 0; r < R; ++r) out[r] = total[r];
}

// ---- Q4_0 and MXFP4: their unsigned 4-bit-indexed weights against Q4_0's activation groups ----
// One group of blocks of R rows' products added to their accumulators: the int32 lanes start from each block's bias
// (−offset·Σq), take the low and the high halves' products, and are scaled by the weight's and the activation's
// scales of their block.
#if defined(QKV_DOT512)
template <int R>
[[gnu::always_inline]] inline void accumulate_quad(__m512* a, const Q4_0Quad* const* quads, int64_t g, __m512i low,
                                                   __m512i high, __m512 w_scale) {
  for (int r = 0; r < R; ++r) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(quads[r][g].bias), low, _mm512_load_si512(quads[r][g].low));
    s = _mm512_dpbusd_epi32(s, high, _mm512_load_si512(quads[r][g].high));
    a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w_scale, _mm512_load_ps(quads[r][g].xs)), a[r]);
  }
}
#elif defined(QKV_DOT256)
template <int R>
[[gnu::always_inline]] inline void accumulate_pair(__m256* a, const Q4_0Pair* const* pairs, int64_t p, __m256i low,
                                                   __m256i high, __m128 w_scales, __m256i spread) {
  for (int r = 0; r < R; ++r) {
    const Q4_0Pair& x = pairs[r][p];
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    __m256i s = dot_u8s8(_mm256_load_si256(reinterpret_cast<const __m256i*>(x.bias)), low,
                         _mm256_load_si256(reinterpret_cast<const __m256i*>(x.low)));
    s = dot_u8s8(s, high, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.high)));
#else  // weights ≤ 24 (MXFP4's levels + 12; Q4_0's nibbles ≤ 15) × int8: pairs ≤ 2·24·127, the two halves' sum
       // ≤ 12192 < 32768: one vpmaddwd for both
    const __m256i pairs16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.low))),
                         _mm256_maddubs_epi16(high, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.high))));
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(pairs16, _mm256_set1_epi16(1)),
                                       _mm256_load_si256(reinterpret_cast<const __m256i*>(x.bias)));
#endif
    const __m128 scales = _mm_mul_ps(w_scales, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.dx))));
    a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales), spread), a[r]);
  }
}
#endif

// ---- Q4_0 ----

// (The SIMD builds take Q4_0 to quant_lanes.cpp: this is the plain C++ build's.)
template <int R>
[[gnu::always_inline]] inline void dot_q4_0(const BlockQ4_0* w, const unsigned char* const* act, int64_t blocks, float* out) {
  const Q8Block* natural[R];
  for (int r = 0; r < R; ++r) natural[r] = reinterpret_cast<const Q8Block*>(act[r]);
  float total[R] = {};
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < R; ++r) total[r] += dot_q4_0_block(w[b], natural[r][b]);
  for (int r = 0; r < R; ++r) out[r] = total[r];
}

// ---- MXFP4 ----
// Q4_0's activation groups and order (value j low nibble, j + 16 high), the codes looked up (vpshufb) as their
// levels + 12, unsigned for vpdpbusd, the offset taken back by lanes starting from −12·Σq. Blocks of 17 bytes: the
// rows and groups sit at any address, so every load is unaligned.

// The levels + 12 of the 16 codes (kMxfp4Values + 12), a vpshufb table
#define QKV_MXFP4_LEVELS 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

template <int R>
[[gnu::always_inline]] inline void dot_mxfp4(const unsigned char* w, const unsigned char* const* act, int64_t blocks,
                                             float* out) {
  const Q8Block* natural[R];
  for (int r = 0; r < R; ++r) natural[r] = reinterpret_cast<const Q8Block*>(act[r]);
  int64_t b = 0;
  float total[R] = {};
  [[maybe_unused]] constexpr int U = Accumulators<R>::kSets;
#if defined(QKV_DOT512)
  const Q4_0Quad* quads[R];
  for (int r = 0; r < R; ++r) quads[r] = reinterpret_cast<const Q4_0Quad*>(act[r] + blocks * int64_t{sizeof(Q8Block)});
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i levels = _mm512_broadcast_i32x4(_mm_setr_epi8(QKV_MXFP4_LEVELS));
  // the four exponents (bytes 0, 17, 34, 51 of the group: the low byte of word 0, the high of 8, the low of 17, the
  // high of 25), each for its block's 4 lanes
  const __m512i exponent_words = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 25, 25, 25, 25, 17,
                                                  17, 17, 17, 8, 8, 8, 8, 0, 0, 0, 0);
  const __m512i exponent_shift = _mm512_set_epi32(8, 8, 8, 8, 0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0);
  const __m512i byte = _mm512_set1_epi32(0xff), one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
  __m512 acc[U][R];
  for (auto& set : acc)
    for (auto& a : set) a = _mm512_setzero_ps();
  auto step = [&](__m512* a, int64_t g) {
    const unsigned char* wb = w + 68 * g;
    simd::prefetch(wb + kPrefetchBytes, 68);
    auto qs = [&](int k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 17 * k + 1)); };
    const __m512i v = _mm512_inserti32x4(
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(qs(0)), qs(1), 1), qs(2), 2), qs(3), 3);
    const __m512i low = _mm512_shuffle_epi8(levels, _mm512_and_si512(v, nibble));
    const __m512i high = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
    // 2^(e − 128): (e − 1) << 23, or 0x00200000 << e for the subnormal e = 0 and 1
    const __m512i words = _mm512_permutexvar_epi16(exponent_words, _mm512_loadu_si512(wb));
    const __m512i e =
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)), exponent_shift), byte);
    const __m512i bits = _mm512_mask_sllv_epi32(_mm512_slli_epi32(_mm512_sub_epi32(e, one), 23),
                                                _mm512_cmplt_epu32_mask(e, two), _mm512_set1_epi32(0x00200000), e);
    const __m512 w_scale = _mm512_castsi512_ps(bits);
    accumulate_quad<R>(a, quads, g, low, high, w_scale);
  };
  const int64_t full = blocks / 4;
  int64_t g = 0;
  for (; g + U <= full; g += U)
    for (int u = 0; u < U; ++u) step(acc[u], g + u);
  for (; g < full; ++g) step(acc[0], g);
  b = 4 * full;
  for (int r = 0; r < R; ++r) total[r] = sum16(U == 2 ? _mm512_add_ps(acc[0][r], acc[U - 1][r]) : acc[0][r]);
#elif defined(QKV_DOT256)
  const Q4_0Pair* pairs[R];
  for (int r = 0; r < R; ++r) pairs[r] = reinterpret_cast<const Q4_0Pair*>(act[r] + blocks * int64_t{sizeof(Q8Block)});
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i levels = _mm256_setr_epi8(QKV_MXFP4_LEVELS, QKV_MXFP4_LEVELS);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[U][R];
  for (auto& set : acc)
    for (auto& a : set) a = _mm256_setzero_ps();
  auto step = [&](__m256* a, int64_t p) {
    const unsigned char* wb = w + 34 * p;
    simd::prefetch(wb + kPrefetchBytes, 34);
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 1))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 18)), 1);
    const __m256i low = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, nibble));
    const __m256i high = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
    const __m128 w_scales = _mm_setr_ps(e8m0_half(wb[0]), e8m0_half(wb[17]), 0.0f, 0.0f);
    accumulate_pair<R>(a, pairs, p, low, high, w_scales, spread);
  };
  const int64_t full = blocks / 2;
  int64_t p = 0;
  for (; p + U <= full; p += U)
    for (int u = 0; u < U; ++u) step(acc[u], p + u);
  for (; p < full; ++p) step(acc[0], p);
  b = 2 * full;
  for (int r = 0; r < R; ++r) total[r] = sum8(U == 2 ? _mm256_add_ps(acc[0][r], acc[U - 1][r]) : acc[0][r]);
#endif
  for (; b < blocks; ++b)
    for (int r = 0; r < R; ++r) total[r] += dot_mxfp4_block(w + 17 * b, natural[r][b]);
  for (int r = 0; r < R; ++r) out[r] = total[r];
}
#undef QKV_MXFP4_LEVELS

// ---- Q4_K and Q5_K ----

#if defined(QKV_DOT256)
// The K-quants' two chains for R ≤ 4 rows of X (both vector builds; quant_lanes.cpp's tiles take the same steps). Per
// block, from each row's partial sums s[r] (8 int32 lanes) and m[r] (4): the exact S and M, then c_S ← fma(float(S),
// d·d_x, c_S) and c_M ← fma(float(M), dmin·d_x, c_M). One row: c_S and c_M in lanes 0 and 2 of a. More rows: the rows'
// sums reduced together by a tree of vphaddd (three for the S of 4 rows, where one row alone takes two), c_S of row r
// in lane r of a, its c_M in lane r of b.
template <int R>
struct KChains {
  __m128 a = _mm_setzero_ps(), b = _mm_setzero_ps();

  [[gnu::always_inline]] void step(const __m256i* s, const __m128i* m, uint16_t d, uint16_t dmin,
                                   const Q8KBlock* const* x, int64_t blk) {
    if constexpr (R == 1) {  // c_S in lane 0 of a, c_M in lane 2 (a shuffle and an add where a second vphaddd was slower)
      const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(d | static_cast<uint64_t>(dmin) << 32)));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s[0]), _mm256_extracti128_si256(s[0], 1));
      const __m128i t = _mm_hadd_epi32(s4, m[0]);                                    // s0+s1, s2+s3, m0+m1, m2+m3
      const __m128i sm = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));  // S, ·, M, ·
      a = _mm_fmadd_ps(_mm_cvtepi32_ps(sm), _mm_mul_ps(d_dmin, _mm_set1_ps(x[0][blk].d)), a);
    } else {
      const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d | static_cast<uint32_t>(dmin) << 16)));
      const __m256i z = _mm256_setzero_si256();
      const __m128i zm = _mm_setzero_si128();
      // lanes 0–3: rows 0–3's sums of lanes 0–3 of s, lanes 4–7: of lanes 4–7
      const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                          _mm256_hadd_epi32(R > 2 ? s[2] : z, R > 3 ? s[3] : z));
      const __m128i S = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      const __m128i M = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(R > 2 ? m[2] : zm, R > 3 ? m[3] : zm));
      const __m128 dx = _mm_setr_ps(x[0][blk].d, x[1][blk].d, R > 2 ? x[2][blk].d : 0.0f, R > 3 ? x[3][blk].d : 0.0f);
      a = _mm_fmadd_ps(_mm_cvtepi32_ps(S), _mm_mul_ps(_mm_broadcastss_ps(scales), dx), a);
      b = _mm_fmadd_ps(_mm_cvtepi32_ps(M), _mm_mul_ps(_mm_permute_ps(scales, 0x55), dx), b);
    }
  }
  // out[r] = c_S − c_M
  [[gnu::always_inline]] void end(float* out) const {
    if constexpr (R == 1) {
      out[0] = _mm_cvtss_f32(_mm_sub_ss(a, _mm_movehl_ps(a, a)));
    } else {
      alignas(16) float y[4];
      _mm_store_ps(y, _mm_sub_ps(a, b));
      for (int r = 0; r < R; ++r) out[r] = y[r];
    }
  }
};
#endif

// Q4_K and Q5_K in the vector builds, an arithmetic that quant_lanes.cpp's tiles follow bit for bit: per block, the
// exact integers S = Σ_j scale_j·Σ_{32 values of j} q_w·q_x and M = Σ_j min_j·Σ_{32 values of j} q_x, then two float32
// chains over the blocks in order, c_S ← fma(float(S), d·d_x, c_S) and c_M ← fma(float(M), dmin·d_x, c_M); y = c_S − c_M
// (KChains). The plain C++ build sums each block's float value instead (dot_k_block_scalar).
template <bool five_bits, int R>
[[gnu::always_inline]] inline void dot_q45_K(const void* w_row, const unsigned char* const* act, int64_t blocks, float* out) {
  using Block = std::conditional_t<five_bits, BlockQ5_K, BlockQ4_K>;
  const Block* w = static_cast<const Block*>(w_row);
  const Q8KBlock* x[R];
  for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const Q8KBlock*>(act[r]);
#if defined(QKV_DOT512)
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  // vpshufb patterns, 32 int16 lanes per vector: the first 16 take sub-block a's scale, the last 16 sub-block c's (byte
  // a or c of each 64-bit lane, and a zero byte)
  auto pattern = [](int a, int c) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(a | 0x8000))),
                              _mm256_set1_epi16(static_cast<short>(c | 0x8000)), 1);
  };
  const __m512i pick02 = pattern(0, 2), pick13 = pattern(1, 3), pick46 = pattern(4, 6), pick57 = pattern(5, 7);
  // Q5_K: the fifth bit of each byte of the four vectors (lo/hi nibbles of the two 64-byte halves), one bit per half
  auto bits = [](int a, int c) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8(static_cast<char>(a))),
                              _mm256_set1_epi8(static_cast<char>(c)), 1);
  };
  const __m512i bit02 = bits(0x01, 0x04), bit13 = bits(0x02, 0x08), bit46 = bits(0x10, 0x40), bit57 = bits(0x20, 0x80);
  const __m512i sixteen = _mm512_set1_epi8(16);
  KChains<R> chains;
  for (int64_t b = 0; b < blocks; ++b) {
    const Block& blk = w[b];
    simd::prefetch(reinterpret_cast<const unsigned char*>(&blk) + kPrefetchBytes, sizeof(Block));
    const KScalesMins words = scales_mins_words(blk.scales);
    const __m512i scale_bytes = _mm512_set1_epi64(static_cast<long long>(words.scales));
    const __m512i a = _mm512_loadu_si512(blk.qs), c = _mm512_loadu_si512(blk.qs + 64);
    __m512i v[4] = {_mm512_and_si512(a, nibble), _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble),
                    _mm512_and_si512(c, nibble), _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble)};
    if constexpr (five_bits) {
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh)));
      const __m512i bit[4] = {bit02, bit13, bit46, bit57};
      for (int i = 0; i < 4; ++i) v[i] = _mm512_mask_add_epi8(v[i], _mm512_test_epi8_mask(h, bit[i]), v[i], sixteen);
    }
    const __m512i scale[4] = {_mm512_shuffle_epi8(scale_bytes, pick02), _mm512_shuffle_epi8(scale_bytes, pick13),
                              _mm512_shuffle_epi8(scale_bytes, pick46), _mm512_shuffle_epi8(scale_bytes, pick57)};
    const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(words.mins)));
    __m256i s[R];
    __m128i m[R];
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i)  // nibble (or 5-bit) × int8 pairs ≤ 2·31·127: int16 is enough
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(v[i], _mm512_load_si512(x[r][b].q + 64 * i)), scale[i]);
      s[r] = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
      m[r] = _mm_madd_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(x[r][b].sums32)), mins);
    }
    chains.step(s, m, blk.d, blk.dmin, x, b);
  }
  chains.end(out);
#elif defined(QKV_DOT256)
  // Per block: the scales and mins unpacked in general-purpose registers (scales_mins_words), the scales of sub-blocks
  // 2p and 2p + 1 picked from their broadcast bytes by vpshufb, the fifth bits moved to bit 4
  // by one shift each (ggml's AVX2 kernel is built the same way; a scalar loop over the mins and per-value compares ran
  // ~25% slower than it); S and M reduced by KChains (the float work per block was as much before, on 8 lanes each,
  // and then a row took two horizontal sums).
  const __m256i nibble = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
  // vpshufb patterns: the int16 scale j (byte j of each 64-bit lane, and a zero byte) in every lane
  auto scale_pattern = [](int j) { return _mm256_set1_epi16(static_cast<short>(j | 0x8000)); };
  const __m256i pick[8] = {scale_pattern(0), scale_pattern(1), scale_pattern(2), scale_pattern(3),
                           scale_pattern(4), scale_pattern(5), scale_pattern(6), scale_pattern(7)};
  // bit b of each byte of h moved to bit 4 (16-bit shifts by at most 4 keep each byte's bits in the byte that matters)
  auto fifth_bit = [&](__m256i h, int b) {
    const __m256i moved = b < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - b)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(b - 4));
    return _mm256_and_si256(moved, bit4);
  };
  KChains<R> chains;
  for (int64_t b = 0; b < blocks; ++b) {
    const Block& blk = w[b];
    simd::prefetch(reinterpret_cast<const unsigned char*>(&blk) + kPrefetchBytes, sizeof(Block));
    const KScalesMins words = scales_mins_words(blk.scales);
    const __m256i scales = _mm256_set1_epi64x(static_cast<long long>(words.scales));
    const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(words.mins)));
    __m256i sum[R], h = _mm256_setzero_si256();
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    if constexpr (five_bits) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh));
    for (int p = 0; p < 4; ++p) {  // 64 values: sub-blocks 2p (low nibbles) and 2p + 1 (high)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32 * p));
      __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      if constexpr (five_bits) {
        low = _mm256_or_si256(low, fifth_bit(h, 2 * p));
        high = _mm256_or_si256(high, fifth_bit(h, 2 * p + 1));
      }
      const __m256i scale_low = _mm256_shuffle_epi8(scales, pick[2 * p]), scale_high = _mm256_shuffle_epi8(scales, pick[2 * p + 1]);
      for (int r = 0; r < R; ++r) {
        const __m256i pl = _mm256_maddubs_epi16(low, _mm256_load_si256(reinterpret_cast<const __m256i*>(x[r][b].q + 64 * p)));
        const __m256i ph = _mm256_maddubs_epi16(high, _mm256_load_si256(reinterpret_cast<const __m256i*>(x[r][b].q + 64 * p + 32)));
        sum[r] = dot_i16(dot_i16(sum[r], pl, scale_low), ph, scale_high);
      }
    }
    __m128i m[R];
    for (int r = 0; r < R; ++r) m[r] = _mm_madd_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(x[r][b].sums32)), mins);
    chains.step(sum, m, blk.d, blk.dmin, x, b);
  }
  chains.end(out);
#else
  const WeightType type = five_bits ? WeightType::Q5_K : WeightType::Q4_K;
  for (int r = 0; r < R; ++r) {
    out[r] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) out[r] += dot_k_block_scalar(w[b], x[r][b], k_order(type), type);
  }
#endif
}

// ---- Q6_K ----

template <int R>
[[gnu::always_inline]] inline void dot_q6_K(const BlockQ6_K* w, const unsigned char* const* act, int64_t blocks, float* out) {
  const Q8KBlock* x[R];
  for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const Q8KBlock*>(act[r]);
#if defined(QKV_DOT512)
  const __m512i nibble = _mm512_set1_epi8(0x0f), two_bits = _mm512_set1_epi8(0x30);
  // The high bits of values j and j + 32 (low nibbles) sit in bits 0–1 and 2–3 of qh[j]; of j + 64 and j + 96 (high
  // nibbles) in bits 4–5 and 6–7: shifted per 256-bit half to bits 4–5 of each byte.
  const __m512i up_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down_high = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  auto pattern = [](int first) {  // 8 int16 lanes (16 values) per scale: scales first … first + 3
    const auto s = [](int i) { return static_cast<short>(i); };
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setr_epi16(s(first), s(first), s(first), s(first), s(first), s(first), s(first),
                                                 s(first), s(first + 1), s(first + 1), s(first + 1), s(first + 1),
                                                 s(first + 1), s(first + 1), s(first + 1), s(first + 1))),
        _mm256_setr_epi16(s(first + 2), s(first + 2), s(first + 2), s(first + 2), s(first + 2), s(first + 2), s(first + 2),
                          s(first + 2), s(first + 3), s(first + 3), s(first + 3), s(first + 3), s(first + 3), s(first + 3),
                          s(first + 3), s(first + 3)),
        1);
  };
  const __m512i pick[4] = {pattern(0), pattern(4), pattern(8), pattern(12)};
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const BlockQ6_K& blk = w[b];
    simd::prefetch(reinterpret_cast<const unsigned char*>(&blk) + kPrefetchBytes, sizeof(BlockQ6_K));
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales)));
    const __m512i scales512 = _mm512_castsi256_si512(scales16);
    __m512i level[4], scale[4];
    for (int g = 0; g < 2; ++g) {  // 128 values: 64 bytes of low bits, 32 of high bits
      const __m512i a = _mm512_loadu_si512(blk.ql + 64 * g);
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * g)));
      // (a & 0x0f) | high bits: vpternlogd 0xEC is (A & C) | B
      level[2 * g] = _mm512_ternarylogic_epi32(a, _mm512_and_si512(_mm512_sllv_epi16(h, up_low), two_bits), nibble, 0xEC);
      level[2 * g + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 4),
                                                   _mm512_and_si512(_mm512_srlv_epi16(h, down_high), two_bits), nibble, 0xEC);
      scale[2 * g] = _mm512_permutexvar_epi16(pick[2 * g], scales512);
      scale[2 * g + 1] = _mm512_permutexvar_epi16(pick[2 * g + 1], scales512);
    }
    const float d = _cvtsh_ss(blk.d);
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i)  // levels 0…63 × int8 pairs ≤ 2·63·127 < 32768
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(level[i], _mm512_load_si512(x[r][b].q + 64 * i)), scale[i]);
      // the levels are q + 32: take back 32·Σ scale_j·Σ_{16 values of j} x
      const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][b].bsums)));
      sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_slli_epi32(offset, 5)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * x[r][b].d), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum16(acc[r]);
#elif defined(QKV_DOT256)
  const __m256i nibble = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
  // vpshufb patterns over a register holding 8 int16 scales in each 128-bit lane: scale j in the low lane's 8 int16 and
  // scale j + 1 in the high lane's (the 16 values each covers)
  auto scale_pair = [](int j) {
    const short low = static_cast<short>((2 * j) | ((2 * j + 1) << 8)), high = static_cast<short>((2 * j + 2) | ((2 * j + 3) << 8));
    return _mm256_setr_epi16(low, low, low, low, low, low, low, low, high, high, high, high, high, high, high, high);
  };
  const __m256i pick[4] = {scale_pair(0), scale_pair(2), scale_pair(4), scale_pair(6)};
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const BlockQ6_K& blk = w[b];
    simd::prefetch(reinterpret_cast<const unsigned char*>(&blk) + kPrefetchBytes, sizeof(BlockQ6_K));
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales)));
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 2; ++g) {
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * g));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * g + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * g));
      // the 8 scales of these 128 values in both lanes
      const __m256i scales = g == 0 ? _mm256_permute2x128_si256(scales16, scales16, 0x00)
                                    : _mm256_permute2x128_si256(scales16, scales16, 0x11);
      // values 32i … 32i + 31 of the 128: nibbles of a0/a1, high bits 2i … 2i + 1 of h moved to bits 4–5 by one
      // 16-bit shift each (what crosses into the byte beside is masked off)
      const __m256i level[4] = {
          _mm256_or_si256(_mm256_and_si256(a0, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45)),
          _mm256_or_si256(_mm256_and_si256(a1, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a0, 4), nibble), _mm256_and_si256(h, bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a1, 4), nibble),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45))};
      for (int i = 0; i < 4; ++i) {
        const __m256i scale = _mm256_shuffle_epi8(scales, pick[i]);  // scales 2i, 2i + 1 of the 8
        for (int r = 0; r < R; ++r)
          sum[r] = dot_i16(sum[r], _mm256_maddubs_epi16(level[i], _mm256_load_si256(reinterpret_cast<const __m256i*>(
                                                                   x[r][b].q + 128 * g + 32 * i))),
                           scale);
      }
    }
    const float d = _cvtsh_ss(blk.d);
    for (int r = 0; r < R; ++r) {
      // the levels are q + 32: take back 32·Σ scale_j·Σ_{16 values of j} x, lane by lane (only the total counts)
      const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][b].bsums)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[r], _mm256_slli_epi32(offset, 5))),
                               _mm256_set1_ps(d * x[r][b].d), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum8(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    out[r] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) out[r] += dot_k_block_scalar(w[b], x[r][b], k_order(WeightType::Q6_K), WeightType::Q6_K);
  }
#endif
}

// out[r·ld + n] = W_n·x_r (+ beta·out) for the weight rows n < rows, `bytes` apart: the kernel inlined into the loop
// over rows, so its constants stay in registers and a row costs only its blocks (at K = 1024 a Q4_0 row is 576 bytes,
// ~20 ns of memory: a call and a dispatch per row were a fifth of that).
template <int R, class Kernel>
[[gnu::always_inline]] inline void over_rows(Kernel&& kernel, const unsigned char* w, int64_t bytes, int64_t rows,
                                             float beta, float* out, int64_t ld) {
  for (int64_t n = 0; n < rows; ++n) {
    float dots[R];
    kernel(w + n * bytes, dots);
    for (int r = 0; r < R; ++r) out[r * ld + n] = beta == 0.0f ? dots[r] : dots[r] + beta * out[r * ld + n];
  }
}

template <int R>
void dot_rows_of(WeightType type, const unsigned char* w, int64_t bytes, int64_t rows, const unsigned char* const* act,
                 int64_t K, float beta, float* out, int64_t ld) {
  switch (type) {
    case WeightType::Q8_0:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_q8_0<R>(reinterpret_cast<const BlockQ8_0*>(row), act, K / kQK, d); },
                   w, bytes, rows, beta, out, ld);
      break;
    case WeightType::Q4_0:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_q4_0<R>(reinterpret_cast<const BlockQ4_0*>(row), act, K / kQK, d); },
                   w, bytes, rows, beta, out, ld);
      break;
    case WeightType::MXFP4:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_mxfp4<R>(row, act, K / kQK, d); }, w, bytes, rows, beta,
                   out, ld);
      break;
    case WeightType::Q4_K:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_q45_K<false, R>(row, act, K / kQK_K, d); }, w, bytes, rows,
                   beta, out, ld);
      break;
    case WeightType::Q5_K:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_q45_K<true, R>(row, act, K / kQK_K, d); }, w, bytes, rows,
                   beta, out, ld);
      break;
    case WeightType::Q6_K:
      over_rows<R>([&](const unsigned char* row, float* d) { dot_q6_K<R>(reinterpret_cast<const BlockQ6_K*>(row), act, K / kQK_K, d); },
                   w, bytes, rows, beta, out, ld);
      break;
    default: break;  // the float types never come here (weights.cpp)
  }
}

// One row of halves or bfloat16 widened to float32 once (vcvtph2ps, or zero-extension and a 16-bit shift) and multiplied
// with R rows of float32 activations. (Reading a bfloat16 pair as one 32-bit lane, its even value shifted left and its
// odd one masked, with the activations split to match, saves two operations per 32 values and ran 25% slower on a
// Zen 5: 41 against 55 GB/s from the L2 cache.)
template <bool half, int R>
[[gnu::always_inline]] inline void dot_16bit(const uint16_t* w, const float* const* x, int64_t K, float* out) {
  int64_t k = 0;
  float total[R] = {};
#if defined(QKV_AVX512)
  auto widen = [&](int64_t at) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at));
    if constexpr (half) return _mm512_cvtph_ps(bits);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    simd::prefetch(w + k + kPrefetchBytes / 2, 64);
    const __m512 w0 = widen(k), w1 = widen(k + 16);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + k), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + k + 16), acc1[r]);
    }
  }
  if (k + 16 <= K) {
    const __m512 w0 = widen(k);
    for (int r = 0; r < R; ++r) acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + k), acc0[r]);
    k += 16;
  }
  for (int r = 0; r < R; ++r) total[r] = sum16(_mm512_add_ps(acc0[r], acc1[r]));
#elif defined(QKV_DOT256)
  auto widen = [&](int64_t at) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at));
    if constexpr (half) return _mm256_cvtph_ps(bits);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  };
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    simd::prefetch(w + k + kPrefetchBytes / 2, 32);
    const __m256 w0 = widen(k), w1 = widen(k + 8);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), acc1[r]);
    }
  }
  if (k + 8 <= K) {
    const __m256 w0 = widen(k);
    for (int r = 0; r < R; ++r) acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), acc0[r]);
    k += 8;
  }
  for (int r = 0; r < R; ++r) total[r] = sum8(_mm256_add_ps(acc0[r], acc1[r]));
#endif
  for (; k < K; ++k) {
    const float v = half ? f16_to_f32_reference(w[k]) : bf16_to_f32_reference(w[k]);
    for (int r = 0; r < R; ++r) total[r] += v * x[r][k];
  }
  for (int r = 0; r < R; ++r) out[r] = total[r];
}

template <int R>
void dot_rows_16bit_of(bool half, const unsigned char* w, int64_t bytes, int64_t rows, const float* const* x, int64_t K,
                       float beta, float* out, int64_t ld) {
  if (half)
    over_rows<R>([&](const unsigned char* row, float* d) { dot_16bit<true, R>(reinterpret_cast<const uint16_t*>(row), x, K, d); },
                 w, bytes, rows, beta, out, ld);
  else
    over_rows<R>([&](const unsigned char* row, float* d) { dot_16bit<false, R>(reinterpret_cast<const uint16_t*>(row), x, K, d); },
                 w, bytes, rows, beta, out, ld);
}

}  // namespace

void ActivationRow::quantize(WeightType type, const float* x, int64_t K) {
  type_ = type;
  K_ = K;
  const bool k_quant = is_k_quant(type);
  const int64_t blocks = K / (k_quant ? kQK_K : kQK), base = natural_bytes(type, K);
  int64_t packed = 0;
  // MXFP4 takes Q4_0's groups (the same order of values), with its own offset in the bias (Q4_0's few-rows kernels
  // read the groups, its tiles the natural blocks)
  [[maybe_unused]] const bool q4_groups = type == WeightType::Q4_0 || type == WeightType::MXFP4;
  [[maybe_unused]] const int32_t offset = type == WeightType::MXFP4 ? 12 : 8;  // the kernel's unsigned weight levels are q + offset
  if (q4_groups && kQ4_0Group > 1) packed = blocks / kQ4_0Group * int64_t{sizeof(Q4_0Group)};
  const size_t needed = static_cast<size_t>(base + packed + 64);
  if (storage_.size() < needed) storage_.resize(needed);
  const uintptr_t at = reinterpret_cast<uintptr_t>(storage_.data());
  data_ = storage_.data() + ((64 - at % 64) % 64);
  if (k_quant) {
    Q8KBlock* out = reinterpret_cast<Q8KBlock*>(data_);
    for (int64_t b = 0; b < blocks; ++b) quantize_q8k_block(x + b * kQK_K, k_order(type), out + b);
    return;
  }
  Q8Block* natural = reinterpret_cast<Q8Block*>(data_);
  for (int64_t b = 0; b < blocks; ++b) quantize_q8_block(x + b * kQK, natural + b);
#if defined(QKV_DOT512)
  if (q4_groups) {
    Q4_0Quad* quads = reinterpret_cast<Q4_0Quad*>(data_ + base);
    for (int64_t g = 0; g < blocks / 4; ++g) {
      std::memset(&quads[g], 0, sizeof quads[g]);
      for (int k = 0; k < 4; ++k) {
        const Q8Block& blk = natural[4 * g + k];
        std::memcpy(quads[g].low + 16 * k, blk.q, 16);
        std::memcpy(quads[g].high + 16 * k, blk.q + 16, 16);
        quads[g].bias[4 * k] = -offset * blk.sum;
        std::fill_n(quads[g].xs + 4 * k, 4, blk.dx);
      }
    }
  }
#elif defined(QKV_DOT256)
  if (q4_groups) {
    Q4_0Pair* pairs = reinterpret_cast<Q4_0Pair*>(data_ + base);
    for (int64_t p = 0; p < blocks / 2; ++p) {
      std::memset(&pairs[p], 0, sizeof pairs[p]);
      for (int k = 0; k < 2; ++k) {
        const Q8Block& blk = natural[2 * p + k];
        std::memcpy(pairs[p].low + 16 * k, blk.q, 16);
        std::memcpy(pairs[p].high + 16 * k, blk.q + 16, 16);
        pairs[p].bias[4 * k] = -offset * blk.sum;
        pairs[p].dx[k] = blk.dx;
      }
    }
  }
#endif
}

float ActivationRow::block_scale(int64_t b) const {
  return is_k_quant(type_) ? reinterpret_cast<const Q8KBlock*>(data_)[b].d : reinterpret_cast<const Q8Block*>(data_)[b].dx;
}

int ActivationRow::level(int64_t k) const {
  if (!is_k_quant(type_)) return reinterpret_cast<const Q8Block*>(data_)[k / kQK].q[k % kQK];
  const Q8KBlock& blk = reinterpret_cast<const Q8KBlock*>(data_)[k / kQK_K];
  const int* order = k_order(type_);
  const int s = static_cast<int>(k % kQK_K) / 32;
  int slot = 0;
  while (order[slot] != s) ++slot;
  return blk.q[32 * slot + k % 32];
}

void dot_rows(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count, float beta,
              float* out, int64_t ld) {
#if defined(QKV_DOT512) || defined(QKV_DOT256)
  // (Q4_K and Q5_K: fewer than kKTileRows rows here, one row of W at a time)
  if (count > 0 && takes_all_rows(x[0]->type()) && (count >= kKTileRows || !is_k_quant(x[0]->type())))
    return dot_rows_in_lanes(w, row_bytes, rows, x, count, beta, out, ld);
#endif
  const unsigned char* base = static_cast<const unsigned char*>(w);
  if (count <= 0) return;
  const WeightType type = x[0]->type();
  const int64_t K = x[0]->size();
  const int64_t chunk = dot_chunk_rows(count, rows, row_bytes, 8);
  for (int64_t n0 = 0; n0 < rows; n0 += chunk) {
    const unsigned char* at = base + n0 * row_bytes;
    const int64_t chunk_rows = std::min(chunk, rows - n0);
    for (int first = 0; first < count; first += kMaxDotRows) {
      const int n = std::min(kMaxDotRows, count - first);
      const unsigned char* act[kMaxDotRows];
      for (int r = 0; r < n; ++r) act[r] = x[first + r]->data();
      float* o = out + first * ld + n0;
      switch (n) {
        case 1: dot_rows_of<1>(type, at, row_bytes, chunk_rows, act, K, beta, o, ld); break;
        case 2: dot_rows_of<2>(type, at, row_bytes, chunk_rows, act, K, beta, o, ld); break;
        case 3: dot_rows_of<3>(type, at, row_bytes, chunk_rows, act, K, beta, o, ld); break;
        default: dot_rows_of<4>(type, at, row_bytes, chunk_rows, act, K, beta, o, ld); break;
      }
    }
  }
}

void dot_rows_16bit(WeightType type, const void* w, int64_t row_bytes, int64_t rows, const float* const* x, int count,
                    int64_t K, float beta, float* out, int64_t ld) {
  const unsigned char* at = static_cast<const unsigned char*>(w);
  const bool half = type == WeightType::F16;
  for (int first = 0; first < count; first += kMaxDotRows) {
    const int n = std::min(kMaxDotRows, count - first);
    float* o = out + first * ld;
    switch (n) {
      case 1: dot_rows_16bit_of<1>(half, at, row_bytes, rows, x + first, K, beta, o, ld); break;
      case 2: dot_rows_16bit_of<2>(half, at, row_bytes, rows, x + first, K, beta, o, ld); break;
      case 3: dot_rows_16bit_of<3>(half, at, row_bytes, rows, x + first, K, beta, o, ld); break;
      default: dot_rows_16bit_of<4>(half, at, row_bytes, rows, x + first, K, beta, o, ld); break;
    }
  }
}

const char* dot_backend() {
#if defined(QKV_DOT512)
  return "AVX-512 VNNI (vpdpbusd, vpdpwssd), 512-bit";
#elif defined(QKV_DOT256) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "AVX2 with 256-bit AVX512-VNNI (vpdpbusd, vpdpwssd)";
#elif defined(QKV_DOT256) && defined(__AVXVNNI__)
  return "AVX2 with AVX-VNNI (vpdpbusd, vpdpwssd)";
#elif defined(QKV_DOT256)
  return "AVX2 (vpmaddubsw, vpmaddwd)";
#else
  return "plain C++ (no AVX2 in this build)";
#endif
}

}  // namespace qkv::kernels::quant
