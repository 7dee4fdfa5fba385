// One query row per head over a paged KV cache read in place (see qkv/kernels/attention_decode.hpp), beside its
// double-precision reference.
#include "qkv/kernels/attention_decode.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "quant_blocks.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {

using quant::BlockQ8_0;
using quant::kQK;

void check(const AttentionDims& dims, const KVPages& kv, const char* who) {
  if (dims.H <= 0 || dims.D <= 0 || dims.kv_heads() <= 0 || dims.H % dims.kv_heads() != 0)
    throw std::invalid_argument(std::string(who) + ": heads and head width must be positive, H a multiple of H_kv");
  if (!attention_decode_supports(kv.type, dims.D))
    throw std::invalid_argument(std::string(who) + ": keys and values of type " +
                                std::string(weight_type_info(kv.type).name) + " with heads of " +
                                std::to_string(dims.D) + " values are not read in place (F32, F16, BF16; Q8_0 in whole blocks)");
  if (kv.row_bytes < row_bytes(kv.type, dims.kv_heads() * dims.D))
    throw std::invalid_argument(std::string(who) + ": rows of " + std::to_string(kv.row_bytes) +
                                " bytes cannot hold H_kv·D values");
  if (kv.positions() <= 0) throw std::invalid_argument(std::string(who) + ": no keys to attend over");
}

float scale_of(const AttentionDims& dims, const AttentionOptions& options) {
  return options.scale != 0.0f ? options.scale : 1.0f / std::sqrt(static_cast<float>(dims.D));
}

// Keys and values stored as halves, bfloat16 or Q8_0 blocks are read as such and widened in registers (exactly as
// dequantize_rows widens them: a half or bfloat16 is exact in float32, a Q8_0 value is float(q)·d), so they cost their
// own bytes. The plain C++ build widens a chunk of positions at a time instead (chunk_positions).
struct Half {
  uint16_t bits;
};
struct Brain {
  uint16_t bits;
};

#if defined(QKV_AVX2)
// A vector V of 16-bit values from p, the lanes past the first n zero (a short tail is copied: AVX2 has no 16-bit
// masked load, and AVX-512's needs AVX512BW, which QKV_AVX512 does not ask for)
template <class V>
inline V load_u16(const void* p, int64_t n) {
  constexpr int64_t kValues = sizeof(V) / sizeof(uint16_t);
  V v;
  if (n >= kValues) {
    std::memcpy(&v, p, sizeof v);  // (one unaligned load)
    return v;
  }
  alignas(sizeof(V)) uint16_t values[kValues] = {};
  std::memcpy(values, p, static_cast<size_t>(n) * sizeof(uint16_t));
  std::memcpy(&v, values, sizeof v);
  return v;
}

#if defined(QKV_AVX512)
struct Lanes {
  using T = __m512;
  static constexpr int64_t W = 16;
  static __mmask16 mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
  static T load(const float* p, int64_t n) { return n >= W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask(n), p); }
  static __m256i load16(const void* p, int64_t n) { return load_u16<__m256i>(p, n); }
  static T load(const Half* p, int64_t n) { return _mm512_cvtph_ps(load16(p, n)); }
  static T load(const Brain* p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(p, n)), 16));
  }
  // values within … within + 15 of a block (a head is whole blocks, so never a tail)
  static T load(const BlockQ8_0& b, int64_t within) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + within));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(_cvtsh_ss(b.d)));
  }
  static void store(float* p, T v, int64_t n) {
    if (n >= W) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, mask(n), v);
  }
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(T a) {  // 16 lanes to 8: high half + low half
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
};
#else
struct Lanes {
  using T = __m256;
  static constexpr int64_t W = 8;
  static __m256i mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static T load(const float* p, int64_t n) { return n >= W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask(n)); }
  static __m128i load16(const void* p, int64_t n) { return load_u16<__m128i>(p, n); }
  static T load(const Half* p, int64_t n) { return _mm256_cvtph_ps(load16(p, n)); }
  static T load(const Brain* p, int64_t n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(p, n)), 16));
  }
  static T load(const BlockQ8_0& b, int64_t within) {  // values within … within + 7 of a block
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + within));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(_cvtsh_ss(b.d)));
  }
  static void store(float* p, T v, int64_t n) {
    if (n >= W) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, mask(n), v);
  }
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold(T a) { return a; }
};
#endif

// Values e … e + W − 1 (fewer at a row's end) of a head's row of keys or values, widened
template <class E>
inline Lanes::T at(const E* row, int64_t e, int64_t n) {
  return Lanes::load(row + e, n);
}
inline Lanes::T at(const BlockQ8_0* row, int64_t e, int64_t) { return Lanes::load(row[e / kQK], e % kQK); }

// out[i] = q_i · k for the c ≤ 4 query heads q + i·D: k's vectors loaded once for all of them
template <class E>
inline void dots(const float* q, int64_t c, const E* k, int64_t D, float* out) {
  using L = Lanes;
  L::T acc[4] = {L::zero(), L::zero(), L::zero(), L::zero()};
  for (int64_t e = 0; e < D; e += L::W) {
    const L::T kv = at(k, e, D - e);
    for (int64_t i = 0; i < c; ++i) acc[i] = L::fma(L::load(q + i * D + e, D - e), kv, acc[i]);
  }
  // the four sums at once: two rounds of horizontal additions, then the halves
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(L::fold(acc[0]), L::fold(acc[1])),
                                  _mm256_hadd_ps(L::fold(acc[2]), L::fold(acc[3])));
  alignas(16) float sums[4];
  _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int64_t i = 0; i < c; ++i) out[i] = sums[i];
}

// o_i[e] += w[i·Tk] · v[e] for the c ≤ 4 heads o + i·D: v's vectors loaded once for all of them
template <class E>
inline void add_weighted(const float* w, int64_t Tk, int64_t c, const E* v, int64_t D, float* o) {
  using L = Lanes;
  L::T wi[4];
  for (int64_t i = 0; i < c; ++i) wi[i] = L::set1(w[i * Tk]);
  for (int64_t e = 0; e < D; e += L::W) {
    const L::T vv = at(v, e, D - e);
    for (int64_t i = 0; i < c; ++i) L::store(o + i * D + e, L::fma(wi[i], vv, L::load(o + i * D + e, D - e)), D - e);
  }
}

// Keys P at a time (P = 4, or 2 where 16 registers would not hold 4 × c accumulators): s_i[p] = scale · q_i · k_p for
// the c ≤ 4 query heads, stored at s + i·Tk + p. Each sum is the same tree of the same values as dots' (one FMA chain
// per 16 or 8 lanes, then the lanes halved, paired and paired again), so a score has the same bits either way; the P
// sums of a head leave in one vector instead of one per call, and each query vector is loaded once for P keys.
template <int P, class E>
inline void dots_of_keys(const float* q, int64_t c, const E* const* k, int64_t D, float scale, float* s, int64_t Tk) {
  using L = Lanes;
  L::T acc[4][P];
  for (int64_t i = 0; i < c; ++i)
    for (int p = 0; p < P; ++p) acc[i][p] = L::zero();
  for (int64_t e = 0; e < D; e += L::W) {
    L::T kv[P];
    for (int p = 0; p < P; ++p) kv[p] = at(k[p], e, D - e);
    for (int64_t i = 0; i < c; ++i) {
      const L::T qv = L::load(q + i * D + e, D - e);
      for (int p = 0; p < P; ++p) acc[i][p] = L::fma(qv, kv[p], acc[i][p]);
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    const __m256 z = _mm256_setzero_ps();
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(L::fold(acc[i][0]), L::fold(acc[i][1])),
                                    P == 4 ? _mm256_hadd_ps(L::fold(acc[i][P > 2 ? 2 : 0]), L::fold(acc[i][P > 3 ? 3 : 0])) : z);
    const __m128 sums = _mm_mul_ps(_mm_set1_ps(scale), _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    if (P == 4) {
      _mm_storeu_ps(s + i * Tk, sums);
    } else {
      alignas(16) float two[4];
      _mm_store_ps(two, sums);
      s[i * Tk] = two[0];
      s[i * Tk + 1] = two[1];
    }
  }
}

// Values P at a time: o_i += w_i[p] · v_p for p in order, for the c ≤ 4 heads o + i·D: o loaded and stored once per P
// positions (the same multiply-adds in the same order as add_weighted's, so the same bits).
template <int P, class E>
inline void add_weighted_values(const float* w, int64_t Tk, int64_t c, const E* const* v, int64_t D, float* o) {
  using L = Lanes;
  for (int64_t e = 0; e < D; e += L::W) {
    L::T vv[P];
    for (int p = 0; p < P; ++p) vv[p] = at(v[p], e, D - e);
    for (int64_t i = 0; i < c; ++i) {
      L::T acc = L::load(o + i * D + e, D - e);
      for (int p = 0; p < P; ++p) acc = L::fma(L::set1(w[i * Tk + p]), vv[p], acc);
      L::store(o + i * D + e, acc, D - e);
    }
  }
}
constexpr int64_t kLanes = Lanes::W;
constexpr bool kReadsInPlace = true;  // F16, BF16 and Q8_0 rows read where they lie
#else  // plain C++ (every type but F32 widened a chunk at a time)
template <class E>
inline void dots(const float* q, int64_t c, const E* k, int64_t D, float* out) {
  for (int64_t i = 0; i < c; ++i) {
    float acc = 0.0f;
    for (int64_t e = 0; e < D; ++e) acc = std::fma(q[i * D + e], k[e], acc);
    out[i] = acc;
  }
}
template <class E>
inline void add_weighted(const float* w, int64_t Tk, int64_t c, const E* v, int64_t D, float* o) {
  for (int64_t i = 0; i < c; ++i)
    for (int64_t e = 0; e < D; ++e) o[i * D + e] = std::fma(w[i * Tk], v[e], o[i * D + e]);
}
template <int P, class E>
inline void dots_of_keys(const float* q, int64_t c, const E* const* k, int64_t D, float scale, float* s, int64_t Tk) {
  float sums[4];
  for (int p = 0; p < P; ++p) {
    dots(q, c, k[p], D, sums);
    for (int64_t i = 0; i < c; ++i) s[i * Tk + p] = scale * sums[i];
  }
}
template <int P, class E>
inline void add_weighted_values(const float* w, int64_t Tk, int64_t c, const E* const* v, int64_t D, float* o) {
  for (int p = 0; p < P; ++p) add_weighted(w + p, Tk, c, v[p], D, o);
}
constexpr int64_t kLanes = 1;
constexpr bool kReadsInPlace = false;
#endif

// A thread's buffers, kept between calls (generation makes one per layer and token)
struct Scratch {
  std::vector<float> scores;                       // (the unit's query heads) × Tk
  std::vector<float> chunk;                        // a chunk of positions' rows widened, for caches not stored as float32
  std::vector<float> inverse;                      // per query head, 1 / its softmax's sum
  std::vector<const void*> key_rows, value_rows;  // each position's row as stored, from the unit's first head
  std::vector<const void*> widened;               // a chunk's rows widened (caches the products do not read in place)
};

// Positions widened at a time for caches not stored as float32: their rows stay in L1 or L2 between the widening and
// the products (the whole sequence widened at once, 416 positions × 4 heads of 128 was 850 KB per K and per V, written
// to memory and read back for every token: an F16 cache decoded slower than an F32 one). A multiple of 4, so the
// products' steps of P positions never straddle two chunks.
int64_t chunk_positions(int64_t width) {
  return std::max<int64_t>(4, (int64_t{32} * 1024 / (width * int64_t{sizeof(float)})) / 4 * 4);
}

// One thread's share: K/V heads [g0, g1), and of each the query heads [part·G/splits, (part + 1)·G/splits) of its
// group. Positions run in the outer loop, so each row's slice for these heads is read in one sequential piece (a
// head's 512 bytes of every 4 KiB row, read head by head, missed the cache at every row: no prefetcher crosses the page).
void decode_unit(const AttentionDims& dims, const AttentionOptions& options, float scale, const float* q,
                 const KVPages& kv, int64_t Tk, int64_t g0, int64_t g1, int64_t part, int64_t splits, float* o,
                 Scratch& scratch) {
  const int64_t D = dims.D, G = dims.group();
  const int64_t a = part * G / splits, b = (part + 1) * G / splits, per = b - a, n = (g1 - g0) * per;
  // Every position's key and value row as stored, from this unit's first head on, in order, whatever page holds it
  const int64_t first = row_bytes(kv.type, g0 * D), width = (g1 - g0) * D;
  scratch.key_rows.resize(static_cast<size_t>(Tk));
  scratch.value_rows.resize(static_cast<size_t>(Tk));
  {
    int64_t t = 0;
    for (const KVPage& page : kv.pages)
      for (int64_t r = 0; r < page.positions; ++r, ++t) {
        scratch.key_rows[static_cast<size_t>(t)] = static_cast<const unsigned char*>(page.keys) + r * kv.row_bytes + first;
        scratch.value_rows[static_cast<size_t>(t)] = static_cast<const unsigned char*>(page.values) + r * kv.row_bytes + first;
      }
  }
  // Rows [t0, t1) of `stored` as the products read them: in place (F32; every type in the vector builds), or widened
  // to float32 into the chunk exactly as dequantize_rows widens them
  const bool in_place = kv.type == WeightType::F32 || kReadsInPlace;
  const int64_t chunk = in_place ? Tk : chunk_positions(width);
  if (!in_place) scratch.chunk.resize(static_cast<size_t>(chunk * width));
  if (!in_place) scratch.widened.resize(static_cast<size_t>(Tk));
  auto widen = [&](const std::vector<const void*>& stored, int64_t t0, int64_t t1) -> const void* const* {
    if (in_place) return stored.data();
    for (int64_t t = t0; t < t1; ++t) {
      float* out = scratch.chunk.data() + (t - t0) * width;
      dequantize_rows(kv.type, stored[static_cast<size_t>(t)], out, 1, width);
      scratch.widened[static_cast<size_t>(t)] = out;
    }
    return scratch.widened.data();
  };
  // The first line of each row's slice is prefetched this many positions ahead (as data read once: NTA), which starts
  // the hardware's prefetcher on that row (a 4 KiB row is a page of its own, and no prefetcher crosses a page). 28
  // layers' keys and values of 2,048 positions from memory on one Zen 5 thread: 13.4–14.0 GB/s so; 10.1–11.6 with
  // every line prefetched 16 positions ahead (the misses in flight fill the core's miss buffers); 9–11 with the
  // hardware's prefetchers alone. A plain sum of the same pages reads 18–22 GB/s.
  constexpr int64_t kAhead = 8;
  std::vector<float>& scores = scratch.scores;  // unit head j = (g − g0)·per + i: query head g·G + a + i
  scores.resize(static_cast<size_t>(n * Tk));
  // Positions go P at a time (the sums are the same as one at a time: see dots_of_keys); 4 × 4 accumulators need
  // AVX-512's 32 registers, so AVX2 takes 2 keys at a time for groups of more than 2 query heads. Rows are
  // prefetched across the pages' ends.
  const int64_t P = kLanes == 16 || std::min<int64_t>(per, 4) <= 2 ? 4 : 2;
  auto prefetch_rows = [&](const std::vector<const void*>& rows, int64_t t) {
    for (int64_t p = t + kAhead; p < std::min(Tk, t + kAhead + P); ++p) __builtin_prefetch(rows[static_cast<size_t>(p)], 0, 0);
  };
  // Head g's slice of a row the products read, as E (a Q8_0 head is D / 32 blocks)
  auto head = [&]<class E>(const void* row, int64_t g, E*) {
    if constexpr (std::is_same_v<E, BlockQ8_0>) return static_cast<const E*>(row) + (g - g0) * (D / kQK);
    else return static_cast<const E*>(row) + (g - g0) * D;
  };
  // Every position of `stored`, a chunk at a time, n_here (P, or 1 at the end) positions a step: for each K/V head g and
  // each group of c ≤ 4 of its query heads (unit head j = its first), body(r, n_here, t, g, i, j, c) with r[p] head g's
  // slice of position t + p as E
  auto walk = [&]<class E>(const std::vector<const void*>& stored, E* tag, auto&& body) {
    for (int64_t c0 = 0; c0 < Tk; c0 += chunk) {
      const int64_t c1 = std::min(Tk, c0 + chunk);
      const void* const* rows = widen(stored, c0, c1);
      for (int64_t t = c0; t < c1;) {
        const int64_t n_here = c1 - t >= P ? P : 1;
        prefetch_rows(stored, t);
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t i = 0; i < per; i += 4) {
            const E* r[4];
            for (int64_t p = 0; p < n_here; ++p) r[p] = head(rows[t + p], g, tag);
            body(r, n_here, t, g, i, (g - g0) * per + i, std::min<int64_t>(4, per - i));
          }
        t += n_here;
      }
    }
  };
  auto score_keys = [&]<class E>(E* tag) {
    walk(scratch.key_rows, tag, [&](const E* const* k, int64_t n_here, int64_t t, int64_t g, int64_t i, int64_t j, int64_t c) {
      const float* qi = q + (g * G + a + i) * D;
      if (n_here == 1) {
        float four[4];
        dots(qi, c, k[0], D, four);
        for (int64_t l = 0; l < c; ++l) scores[static_cast<size_t>((j + l) * Tk + t)] = scale * four[l];
        return;
      }
      float* out = scores.data() + j * Tk + t;
      if (n_here == 4) dots_of_keys<4>(qi, c, k, D, scale, out, Tk);
      else dots_of_keys<2>(qi, c, k, D, scale, out, Tk);
    });
  };
  auto add_values = [&]<class E>(E* tag) {
    walk(scratch.value_rows, tag, [&](const E* const* v, int64_t n_here, int64_t t, int64_t g, int64_t i, int64_t j, int64_t c) {
      float* oi = o + (g * G + a + i) * D;
      const float* w = scores.data() + j * Tk + t;
      if (n_here == 1) add_weighted(w, Tk, c, v[0], D, oi);
      else if (n_here == 4) add_weighted_values<4>(w, Tk, c, v, D, oi);
      else add_weighted_values<2>(w, Tk, c, v, D, oi);
    });
  };
  // What the products read: float32 (in place or widened), or halves, bfloat16 or Q8_0 blocks in place
  auto each = [&](auto&& step) {
    if constexpr (kReadsInPlace) {
      if (kv.type == WeightType::F16) return step(static_cast<Half*>(nullptr));
      if (kv.type == WeightType::BF16) return step(static_cast<Brain*>(nullptr));
      if (kv.type == WeightType::Q8_0) return step(static_cast<BlockQ8_0*>(nullptr));
    }
    step(static_cast<float*>(nullptr));
  };
  each(score_keys);
  std::vector<float>& inverse = scratch.inverse;
  inverse.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t h = (g0 + j / per) * G + a + j % per;
    float* s = scores.data() + j * Tk;
    if (options.softcap != 0.0f)
      for (int64_t l = 0; l < Tk; ++l) s[l] = options.softcap * std::tanh(s[l] / options.softcap);
    float mx = *std::max_element(s, s + Tk);
    const bool sink = options.sinks != nullptr;
    if (sink) mx = std::max(mx, options.sinks[h]);
    float sum = simd::exp_shifted_sum(s, s, Tk, mx);
    if (sink) sum += simd::exp_flushed(options.sinks[h] - mx);
    inverse[static_cast<size_t>(j)] = 1.0f / sum;
    std::fill_n(o + h * D, D, 0.0f);
  }
  each(add_values);
  for (int64_t j = 0; j < n; ++j) {
    float* out = o + ((g0 + j / per) * G + a + j % per) * D;
    for (int64_t e = 0; e < D; ++e) out[e] *= inverse[static_cast<size_t>(j)];
  }
}

}  // namespace

int64_t KVPages::positions() const {
  int64_t total = 0;
  for (const KVPage& page : pages) total += page.positions;
  return total;
}

bool attention_decode_supports(WeightType type, int64_t D) {
  switch (type) {
    case WeightType::F32:
    case WeightType::F16:
    case WeightType::BF16: return D > 0;
    case WeightType::Q8_0: return D > 0 && D % 32 == 0;
    default: return false;
  }
}

void attention_decode(const AttentionDims& dims, const AttentionOptions& options, const float* q, const KVPages& kv,
                      float* o) {
  check(dims, kv, "attention_decode");
  const int64_t H_kv = dims.kv_heads(), G = dims.group(), Tk = kv.positions();
  const float scale = scale_of(dims, options);
  const int threads = options.threads > 0 ? options.threads : (omp_in_parallel() ? 1 : omp_get_max_threads());
  // Below ~64 K multiply-adds a parallel region costs more than it saves
  const int64_t team = dims.H * Tk * dims.D < (int64_t{1} << 16) ? 1 : threads;
  // Work units: contiguous runs of K/V heads with all their query heads, or, with fewer K/V heads than threads
  // (multi-query and latent caches), one K/V head's query heads split between threads
  const int64_t splits = std::min<int64_t>(G, std::max<int64_t>(1, (team + H_kv - 1) / H_kv));
  const int64_t units = splits > 1 ? H_kv * splits : std::min<int64_t>(team, H_kv);
  auto unit = [&](int64_t u, Scratch& scratch) {
    if (splits > 1) decode_unit(dims, options, scale, q, kv, Tk, u / splits, u / splits + 1, u % splits, splits, o, scratch);
    else decode_unit(dims, options, scale, q, kv, Tk, H_kv * u / units, H_kv * (u + 1) / units, 0, 1, o, scratch);
  };
  if (units == 1) {
    thread_local Scratch scratch;
    unit(0, scratch);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(team, units)))
  {
    thread_local Scratch scratch;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) unit(u, scratch);
  }
}

void attention_decode_reference(const AttentionDims& dims, const AttentionOptions& options, const float* q,
                                const KVPages& kv, float* o) {
  check(dims, kv, "attention_decode_reference");
  const int64_t H_kv = dims.kv_heads(), G = dims.group(), D = dims.D, W = H_kv * D, Tk = kv.positions();
  std::vector<float> keys(static_cast<size_t>(Tk * W)), values(static_cast<size_t>(Tk * W));
  int64_t t = 0;
  for (const KVPage& page : kv.pages)
    for (int64_t r = 0; r < page.positions; ++r, ++t) {
      dequantize_rows(kv.type, static_cast<const unsigned char*>(page.keys) + r * kv.row_bytes, keys.data() + t * W, 1, W);
      dequantize_rows(kv.type, static_cast<const unsigned char*>(page.values) + r * kv.row_bytes, values.data() + t * W, 1, W);
    }
  const double scale = scale_of(dims, options);
  std::vector<double> s(static_cast<size_t>(Tk));
  for (int64_t h = 0; h < dims.H; ++h) {
    const int64_t g = h / G;
    double mx = -INFINITY;
    for (int64_t j = 0; j < Tk; ++j) {
      double acc = 0.0;
      for (int64_t e = 0; e < D; ++e) acc += static_cast<double>(q[h * D + e]) * keys[static_cast<size_t>(j * W + g * D + e)];
      acc *= scale;
      if (options.softcap != 0.0f) acc = options.softcap * std::tanh(acc / options.softcap);
      s[static_cast<size_t>(j)] = acc;
      mx = std::max(mx, acc);
    }
    if (options.sinks) mx = std::max(mx, static_cast<double>(options.sinks[h]));
    double sum = options.sinks ? std::exp(options.sinks[h] - mx) : 0.0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (int64_t e = 0; e < D; ++e) {
      double acc = 0.0;
      for (int64_t j = 0; j < Tk; ++j) acc += s[static_cast<size_t>(j)] * values[static_cast<size_t>(j * W + g * D + e)];
      o[h * D + e] = static_cast<float>(acc / sum);
    }
  }
}

}  // namespace qkv::kernels
