// RMSNorm and SiLU (see qkv/kernels/decoder.hpp), each beside its reference.
#include "qkv/kernels/decoder.hpp"

#include <algorithm>
#include <cmath>

#include "parallel.hpp"
#include "qkv/kernels/memory.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {
constexpr int64_t kChunkRows = 64;  // reduction chunk for dweight: independent of the thread count
}  // namespace

// ---- RMSNorm ----

void rms_norm_forward(const float* x, const float* weight, float offset, float* y, float* rstd, int64_t rows, int64_t C,
                      float eps) {
#pragma omp parallel for schedule(static) if (worth_parallel(rows * C))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * C;
    const float ms = simd::lane_sum<float>(C, [&](int64_t c) { return xr[c] * xr[c]; }) / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(ms + eps);
    float* yr = y + r * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * s * (weight[c] + offset);
    rstd[r] = s;
  }
}

void rms_norm_backward(const float* x, const float* weight, float offset, const float* rstd, const float* dy, float* dx,
                       float* dweight, int64_t rows, int64_t C, bool accumulate) {
  if (dx) {
#pragma omp parallel for schedule(static) if (worth_parallel(rows * C))
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * C;
      const float* gr = dy + r * C;
      const float s = rstd[r];
      const float mean_dx =
          simd::lane_sum<float>(C, [&](int64_t c) { return gr[c] * (weight[c] + offset) * xr[c] * s; }) /
          static_cast<float>(C);
      float* dxr = dx + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = xr[c] * s;
        dxr[c] = (accumulate ? dxr[c] : 0.0f) + s * (gr[c] * (weight[c] + offset) - xhat * mean_dx);
      }
    }
  }
  if (!dweight) return;
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  memory::Buffer<float> partial(static_cast<size_t>(chunks * C));
  std::fill_n(partial.data(), chunks * C, 0.0f);
#pragma omp parallel for schedule(static) if (worth_parallel(rows * C))
  for (int64_t k = 0; k < chunks; ++k) {
    float* ps = partial.data() + k * C;
    for (int64_t r = k * kChunkRows; r < std::min(rows, (k + 1) * kChunkRows); ++r)
      for (int64_t c = 0; c < C; ++c) ps[c] += dy[r * C + c] * x[r * C + c] * rstd[r];
  }
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < C; ++c) dweight[c] += partial[static_cast<size_t>(k * C + c)];
}

void rms_norm_forward_reference(const float* x, const float* weight, float offset, float* y, int64_t rows, int64_t C,
                                float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += static_cast<double>(x[r * C + c]) * x[r * C + c];
    const double s = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
    for (int64_t c = 0; c < C; ++c)
      y[r * C + c] = static_cast<float>(x[r * C + c] * s * (static_cast<double>(weight[c]) + offset));
  }
}

void rms_norm_backward_reference(const float* x, const float* weight, float offset, const float* dy, float* dx,
                                 float* dweight, int64_t rows, int64_t C, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += static_cast<double>(x[r * C + c]) * x[r * C + c];
    const double s = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
    double mean_dx = 0.0;
    for (int64_t c = 0; c < C; ++c)
      mean_dx += static_cast<double>(dy[r * C + c]) * (static_cast<double>(weight[c]) + offset) * x[r * C + c] * s;
    mean_dx /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = x[r * C + c] * s;
      if (dx)
        dx[r * C + c] += static_cast<float>(
            s * (static_cast<double>(dy[r * C + c]) * (static_cast<double>(weight[c]) + offset) - xhat * mean_dx));
      if (dweight) dweight[c] += static_cast<float>(dy[r * C + c] * xhat);
    }
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
