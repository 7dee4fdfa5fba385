// One query row per head over a paged KV cache read in place (see qkv/kernels/attention_decode.hpp), beside its
// double-precision reference.
#include "qkv/kernels/attention_decode.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "simd.hpp"

namespace qkv::kernels {

namespace {

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

#if defined(QKV_AVX2)
#if defined(QKV_AVX512)
struct Lanes {
  using T = __m512;
  static constexpr int64_t W = 16;
  static __mmask16 mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
  static T load(const float* p, int64_t n) { return n >= W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask(n), p); }
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

// out[i] = q_i · k for the c ≤ 4 query heads q + i·D: k's vectors loaded once for all of them
inline void dots(const float* q, int64_t c, const float* k, int64_t D, float* out) {
  using L = Lanes;
  L::T acc[4] = {L::zero(), L::zero(), L::zero(), L::zero()};
  for (int64_t e = 0; e < D; e += L::W) {
    const L::T kv = L::load(k + e, D - e);
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
inline void add_weighted(const float* w, int64_t Tk, int64_t c, const float* v, int64_t D, float* o) {
  using L = Lanes;
  L::T wi[4];
  for (int64_t i = 0; i < c; ++i) wi[i] = L::set1(w[i * Tk]);
  for (int64_t e = 0; e < D; e += L::W) {
    const L::T vv = L::load(v + e, D - e);
    for (int64_t i = 0; i < c; ++i) L::store(o + i * D + e, L::fma(wi[i], vv, L::load(o + i * D + e, D - e)), D - e);
  }
}
#else  // plain C++
inline void dots(const float* q, int64_t c, const float* k, int64_t D, float* out) {
  for (int64_t i = 0; i < c; ++i) {
    float acc = 0.0f;
    for (int64_t e = 0; e < D; ++e) acc = std::fma(q[i * D + e], k[e], acc);
    out[i] = acc;
  }
}
inline void add_weighted(const float* w, int64_t Tk, int64_t c, const float* v, int64_t D, float* o) {
  for (int64_t i = 0; i < c; ++i)
    for (int64_t e = 0; e < D; ++e) o[i * D + e] = std::fma(w[i * Tk], v[e], o[i * D + e]);
}
#endif

// A thread's buffers, kept between calls (generation makes one per layer and token)
struct Scratch {
  std::vector<float> scores;        // (the unit's query heads) × Tk
  std::vector<float> keys, values;  // the unit's rows widened, for caches not stored as float32
  std::vector<float> inverse;       // per query head, 1 / its softmax's sum
};

// One thread's share: K/V heads [g0, g1), and of each the query heads [part·G/splits, (part + 1)·G/splits) of its
// group. Positions run in the outer loop, so each row's slice for these heads is read in one sequential piece (a
// head's 512 bytes of every 4 KiB row, read head by head, missed the cache at every row: no prefetcher crosses the page).
void decode_unit(const AttentionDims& dims, const AttentionOptions& options, float scale, const float* q,
                 const KVPages& kv, int64_t Tk, int64_t g0, int64_t g1, int64_t part, int64_t splits, float* o,
                 Scratch& scratch) {
  const int64_t D = dims.D, G = dims.group();
  const int64_t a = part * G / splits, b = (part + 1) * G / splits, per = b - a, n = (g1 - g0) * per;
  // the rows: in place (float32), or this unit's heads widened once into the scratch
  const int64_t first = row_bytes(kv.type, g0 * D);
  std::span<const KVPage> pages = kv.pages;
  int64_t stride = kv.row_bytes, offset = first;
  KVPage widened;
  if (kv.type != WeightType::F32) {
    const int64_t width = (g1 - g0) * D;
    scratch.keys.resize(static_cast<size_t>(Tk * width));
    scratch.values.resize(static_cast<size_t>(Tk * width));
    int64_t t = 0;
    for (const KVPage& page : kv.pages)
      for (int64_t r = 0; r < page.positions; ++r, ++t) {
        const int64_t at = r * kv.row_bytes + first;
        dequantize_rows(kv.type, static_cast<const unsigned char*>(page.keys) + at, scratch.keys.data() + t * width, 1, width);
        dequantize_rows(kv.type, static_cast<const unsigned char*>(page.values) + at, scratch.values.data() + t * width, 1, width);
      }
    widened = {scratch.keys.data(), scratch.values.data(), Tk};
    pages = std::span<const KVPage>(&widened, 1);
    stride = width * int64_t{sizeof(float)}, offset = 0;
  }
  auto row = [&](const void* base, int64_t r) {
    return reinterpret_cast<const float*>(static_cast<const unsigned char*>(base) + r * stride + offset);
  };
  const int64_t piece = (g1 - g0) * D * int64_t{sizeof(float)};  // bytes of a row this unit reads
  constexpr int64_t kAhead = 2;                                    // rows prefetched ahead
  std::vector<float>& scores = scratch.scores;  // unit head j = (g − g0)·per + i: query head g·G + a + i
  scores.resize(static_cast<size_t>(n * Tk));
  int64_t t = 0;
  float four[4];
  for (const KVPage& page : pages)
    for (int64_t r = 0; r < page.positions; ++r, ++t) {
      if (r + kAhead < page.positions) simd::prefetch(row(page.keys, r + kAhead), piece);
      const float* k = row(page.keys, r);
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t i = 0; i < per; i += 4) {
          const int64_t c = std::min<int64_t>(4, per - i), j = (g - g0) * per + i;
          dots(q + (g * G + a + i) * D, c, k + (g - g0) * D, D, four);
          for (int64_t l = 0; l < c; ++l) scores[static_cast<size_t>((j + l) * Tk + t)] = scale * four[l];
        }
    }
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
  t = 0;
  for (const KVPage& page : pages)
    for (int64_t r = 0; r < page.positions; ++r, ++t) {
      if (r + kAhead < page.positions) simd::prefetch(row(page.values, r + kAhead), piece);
      const float* v = row(page.values, r);
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t i = 0; i < per; i += 4) {
          const int64_t j = (g - g0) * per + i;
          add_weighted(scores.data() + j * Tk + t, Tk, std::min<int64_t>(4, per - i), v + (g - g0) * D, D,
                       o + (g * G + a + i) * D);
        }
    }
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
