// GELU and SiLU (see qkv/kernels/activations.hpp), each beside its reference.
// GELU (tanh form) with AVX2: y = 0.5·x·(1 + tanh u), u = k(x + 0.044715·x³), k = √(2/π);
// dy/dx = 0.5(1 + t) + 0.5·x·(1 − t²)·k·(1 + 3·0.044715·x²).
#include "qkv/kernels/activations.hpp"

#include <algorithm>
#include <cmath>

#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {
constexpr float kK = 0.7978845608028654f, kC = 0.044715f;
}  // namespace

// ---- GELU ----

void gelu_reference(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    y[i] = static_cast<float>(0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  }
}

void gelu_forward(const float* x, float* y, int64_t n) {
  for_blocks(n, [&](int64_t i, int64_t end) {
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
  });
}

void gelu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate) {
  for_blocks(n, [&](int64_t i, int64_t end) {
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
      const __m256 prior = accumulate ? _mm256_loadu_ps(dx + i) : _mm256_setzero_ps();
      _mm256_storeu_ps(dx + i, _mm256_fmadd_ps(_mm256_loadu_ps(g + i), d, prior));
    }
#endif
    for (; i < end; ++i) {
      const float v = x[i];
      const float t = std::tanh(kK * (v + kC * v * v * v));
      const float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kK * (1.0f + 3.0f * kC * v * v);
      dx[i] = (accumulate ? dx[i] : 0.0f) + g[i] * d;
    }
  });
}

void gelu_backward_reference(const float* x, const float* g, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i], k = 0.7978845608028654, c = 0.044715;
    const double t = std::tanh(k * (v + c * v * v * v));
    const double d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * c * v * v);
    dx[i] += static_cast<float>(g[i] * d);
  }
}

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
