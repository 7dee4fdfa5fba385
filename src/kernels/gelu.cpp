// GELU (tanh form) with AVX2: y = 0.5·x·(1 + tanh u), u = k(x + 0.044715·x³), k = √(2/π);
// dy/dx = 0.5(1 + t) + 0.5·x·(1 − t²)·k·(1 + 3·0.044715·x²).
#include <cmath>

#include "qkv/kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {
constexpr float kK = 0.7978845608028654f, kC = 0.044715f;
constexpr int64_t kParallelAbove = 1 << 15;
}  // namespace

void gelu_reference(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    y[i] = static_cast<float>(0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  }
}

void gelu_forward(const float* x, float* y, int64_t n) {
  const int64_t blocks = (n + 255) / 256;
#pragma omp parallel for schedule(static) if (n > kParallelAbove)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t i = b * 256;
    const int64_t end = std::min(n, i + 256);
#ifdef QKV_AVX2
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
      const __m256 t = simd::tanh(_mm256_mul_ps(_mm256_set1_ps(kK), _mm256_fmadd_ps(_mm256_set1_ps(kC), v3, v)));
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.0f), t)));
    }
#endif
    for (; i < end; ++i) {
      const float v = x[i];
      y[i] = 0.5f * v * (1.0f + std::tanh(kK * (v + kC * v * v * v)));
    }
  }
}

void gelu_backward(const float* x, const float* g, float* dx, int64_t n) {
  const int64_t blocks = (n + 255) / 256;
#pragma omp parallel for schedule(static) if (n > kParallelAbove)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t i = b * 256;
    const int64_t end = std::min(n, i + 256);
#ifdef QKV_AVX2
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 v2 = _mm256_mul_ps(v, v);
      const __m256 t = simd::tanh(_mm256_mul_ps(_mm256_set1_ps(kK), _mm256_fmadd_ps(_mm256_set1_ps(kC), _mm256_mul_ps(v2, v), v)));
      const __m256 left = _mm256_mul_ps(half, _mm256_add_ps(one, t));
      const __m256 sech2 = _mm256_fnmadd_ps(t, t, one);
      const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kK), _mm256_fmadd_ps(_mm256_set1_ps(3.0f * kC), v2, one));
      const __m256 d = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, v), sech2), inner, left);
      _mm256_storeu_ps(dx + i, _mm256_fmadd_ps(_mm256_loadu_ps(g + i), d, _mm256_loadu_ps(dx + i)));
    }
#endif
    for (; i < end; ++i) {
      const float v = x[i];
      const float t = std::tanh(kK * (v + kC * v * v * v));
      const float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kK * (1.0f + 3.0f * kC * v * v);
      dx[i] += g[i] * d;
    }
  }
}

}  // namespace qkv::kernels
