// SiLU (see qkv/kernels/decoder.hpp), beside its reference.
#include "qkv/kernels/decoder.hpp"

#include <algorithm>
#include <cmath>

#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

// ---- SiLU ----

// σ(x) = 1 / (1 + e^−x) through the vector exp; e^−x overflows to ∞ far left, giving exactly 0.
void silu_forward(const float* x, float* y, int64_t n) {
  for_blocks(n, [&](int64_t i, int64_t end) {
#ifdef QKV_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 e = simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), v));
      _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < end; ++i) y[i] = x[i] / (1.0f + std::exp(-x[i]));
  });
}

void silu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate) {
  for_blocks(n, [&](int64_t i, int64_t end) {
#ifdef QKV_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), v))));
      const __m256 d = _mm256_mul_ps(sig, _mm256_fmadd_ps(v, _mm256_sub_ps(one, sig), one));
      const __m256 prior = accumulate ? _mm256_loadu_ps(dx + i) : _mm256_setzero_ps();
      _mm256_storeu_ps(dx + i, _mm256_fmadd_ps(_mm256_loadu_ps(g + i), d, prior));
    }
#endif
    for (; i < end; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-x[i]));
      dx[i] = (accumulate ? dx[i] : 0.0f) + g[i] * sig * (1.0f + x[i] * (1.0f - sig));
    }
  });
}

void silu_reference(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] / (1.0 + std::exp(-static_cast<double>(x[i]))));
}

void silu_backward_reference(const float* x, const float* g, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double sig = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
    dx[i] += static_cast<float>(g[i] * sig * (1.0 + x[i] * (1.0 - sig)));
  }
}

}  // namespace qkv::kernels
