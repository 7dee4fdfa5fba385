// Vector helpers shared by the kernels (internal). QKV_AVX2 is set when the build targets AVX2 + FMA, and
// QKV_AVX512 when it also targets AVX-512F (-march=native on such a CPU);
// every user keeps a scalar path for other CPUs.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves, which -Wmaybe-uninitialized (and,
// for _mm512_inserti64x4 and friends, -Wuninitialized) reports at every inlined use (GCC bug 105593); the warning's
// location is inside the header, so this silences only that.
#if defined(__clang__)
#include <immintrin.h>
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
#define QKV_AVX2 1
#if defined(__AVX512F__)
#define QKV_AVX512 1  // the attention products use 512-bit micro-kernels; everything else stays AVX2
#endif
#endif

namespace qkv::kernels::simd {

// Σ f(i) over i < n, accumulated in Acc: element i goes to accumulator i mod 16 and the 16 are added pairwise at
// the end. Independent chains let the compiler vectorise the loop (one running sum is one 4-cycle add per
// element: measured a third of a layer norm's backward, and a 124M-gradient norm at 180 ms instead of 43). The
// order is fixed, so any thread count gives the same bits, and so does every build with FMA (where f is a
// product the compiler may fuse it into the add; in double, a product of two floats is exact either way).
template <typename Acc, typename F>
Acc lane_sum(int64_t n, F&& f) {
  constexpr int kLanes = 16;
  Acc acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += f(i + k);
  for (int k = 0; i < n; ++i, ++k) acc[k] += f(i);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  return acc[0];
}

// Asks for the cache lines of [p, p + bytes) ahead of their use: a hint, which never faults. Always inlined: GCC
// finds a function whose only effect is a prefetch free of side effects and deletes the calls to it.
[[gnu::always_inline]] inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

// Σ a[i]·b[i], by lane_sum's fixed order. With FMA each term is one fused multiply-add, written out: GCC fuses the
// product into the sum by itself, clang (-ffp-contract=on) does not across the lambda, and its dot then differed from
// gemm_rows_nt's tiles in 70 of 180 shapes.
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__FMA__)
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] = std::fma(a[i + k], b[i + k], acc[k]);
  for (int k = 0; i < n; ++i, ++k) acc[k] = std::fma(a[i], b[i], acc[k]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  return acc[0];
#else
  return lane_sum<float>(n, [&](int64_t i) { return a[i] * b[i]; });
#endif
}

#ifdef QKV_AVX2
// Below this, exp gives exactly 0: e^-80 ≈ 1.8e-35 is far under float's precision next to any sum of
// probabilities, and values this small, once divided by a batch or a row sum, become denormals, which cost ~100×
// per operation in every later product (a tied GPT-2 head at random init ran 15× slower before this).
constexpr float kExpFlushBelow = -80.0f;

// e^x = 2^n · e^r with n = round(x·log₂e), r = x − n·ln2 split in two parts; e^r by a degree-6
// polynomial (Taylor, |r| ≤ ln2/2, relative error < 2e-7). x < kExpFlushBelow gives exactly 0.
inline __m256 exp(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFlushBelow), _CMP_LT_OQ);  // false for NaN
  // Clamp to the normal range; the constant goes first so a NaN in x passes through (maxps/minps return
  // their second operand when either is NaN) and the result is NaN, as it would be in PyTorch.
  x = _mm256_max_ps(_mm256_set1_ps(-87.33f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.37f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

#ifdef QKV_AVX512
// The same e^x on 16 lanes, step for step, so each lane's bits equal the 8-lane version's. 2^n comes from
// vscalefps instead of building the exponent bits (exact and equal wherever 2^n is a normal float, and n ≥ −116
// wherever the result is not flushed), and the low clamp is left to the flush mask: 14 vector operations
// instead of 18, which the attention softmax feels.
inline __m512 exp(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFlushBelow), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_set1_ps(88.37f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}
#endif

// The scalar e^x with the same flush (tails of vector loops, builds without AVX2).
inline float exp_flushed(float x) {
#ifdef QKV_AVX2
  constexpr float flush = kExpFlushBelow;
#else
  constexpr float flush = -80.0f;
#endif
  return x < flush ? 0.0f : std::exp(x);
}

#ifdef QKV_AVX2

// tanh u = 1 − 2 / (e^{2u} + 1); e^{2u} saturates to 0 or ∞ far out, giving exactly ∓1.
inline __m256 tanh(__m256 u) {
  const __m256 e = exp(_mm256_add_ps(u, u));
  return _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
}

// murmur3's 32-bit finalizer on 8 lanes.
inline __m256i mix32(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}
#endif

inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// y[i] = e^(a[i] − b[i]) for i < n, flushed as exp is (e^−∞ = 0).
inline void exp_difference(const float* a, const float* b, float* y, int64_t n) {
  int64_t i = 0;
#ifdef QKV_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp(_mm512_sub_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i))));
#endif
#ifdef QKV_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp(_mm256_sub_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i))));
#endif
  for (; i < n; ++i) y[i] = exp_flushed(a[i] - b[i]);
}

// y[j] = exp(x[j] − shift) for j < n (x and y may alias); returns Σ y.
#ifdef QKV_AVX512
// The sum of 16 lanes in _mm512_reduce_add_ps's order (halves, quarters, pairs), so its bits, in registers (a store
// and scalar adds cost a tenth of a K = 1024 quantized product's row), without GCC 12's -Wuninitialized false alarms
// from inside the AVX-512 lane-extracting intrinsics (their _mm256_undefined_*): the high half comes by a shuffle.
inline float reduce_add(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(_mm512_shuffle_f32x4(v, v, 0xEE)), _mm512_castps512_ps256(v));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));  // q[i] = h[i + 4] + h[i]
  const __m128 p = _mm_add_ps(_mm_movehl_ps(q, q), q);                                   // q[2] + q[0], q[3] + q[1]
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
#endif

inline float exp_shifted_sum(const float* x, float* y, int64_t n, float shift) {
  int64_t j = 0;
  float total = 0.0f;
#ifdef QKV_AVX512
  __m512 sum16 = _mm512_setzero_ps();
  const __m512 s16 = _mm512_set1_ps(shift);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp(_mm512_sub_ps(_mm512_loadu_ps(x + j), s16));
    _mm512_storeu_ps(y + j, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  total = reduce_add(sum16);
#endif
#ifdef QKV_AVX2
  if (j + 8 <= n) {
    __m256 sum = _mm256_setzero_ps();
    const __m256 s = _mm256_set1_ps(shift);
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp(_mm256_sub_ps(_mm256_loadu_ps(x + j), s));
      _mm256_storeu_ps(y + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    for (float v : lanes) total += v;
  }
#endif
  for (; j < n; ++j) {
    y[j] = exp_flushed(x[j] - shift);
    total += y[j];
  }
  return total;
}

// ---- counter-based dropout decisions, shared by the attention kernel and tensor dropout ----
// Element `index` under `key` is kept iff keep_hash(key, index) ≥ threshold, so P(keep) = 1 − p.

inline uint32_t drop_threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

inline uint32_t keep_hash(uint32_t key, uint32_t index) { return mix32(key ^ (index * 0x9E3779B9u)); }

// x[i] · (kept(first + i) ? scale : 0) for i < n, written to y (accumulated into y when `accumulate`).
inline void apply_keep(const float* x, float* y, int64_t n, uint32_t key, uint32_t first, uint32_t threshold, float scale,
                       bool accumulate) {
  int64_t i = 0;
#ifdef QKV_AVX2
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i thr = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(threshold)), sign);
  const __m256i golden = _mm256_set1_epi32(static_cast<int>(0x9E3779B9u));
  const __m256i k = _mm256_set1_epi32(static_cast<int>(key));
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first + static_cast<uint32_t>(i))),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i h = mix32(_mm256_xor_si256(k, _mm256_mullo_epi32(idx, golden)));
    // unsigned h < threshold, via a signed compare after flipping the sign bits
    const __m256 drop = _mm256_castsi256_ps(_mm256_cmpgt_epi32(thr, _mm256_xor_si256(h, sign)));
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_andnot_ps(drop, s));
    _mm256_storeu_ps(y + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(y + i), v) : v);
  }
#endif
  for (; i < n; ++i) {
    const float v = keep_hash(key, first + static_cast<uint32_t>(i)) >= threshold ? x[i] * scale : 0.0f;
    y[i] = accumulate ? y[i] + v : v;
  }
}

}  // namespace qkv::kernels::simd
