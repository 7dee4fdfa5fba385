// Layer norm and RMSNorm (see qkv/kernels/norms.hpp), each beside its reference.
#include "qkv/kernels/norms.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "parallel.hpp"
#include "qkv/kernels/memory.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {
constexpr int64_t kChunkRows = 64;  // reduction chunk for the weight gradients: independent of the thread count
}  // namespace

// ---- layer norm ----

void layer_norm_forward(const float* x, const float* scale, const float* shift, float* y, float* mean, float* rstd,
                        int64_t rows, int64_t C, float eps) {
  parallel_for(rows, worth_parallel(rows * C), [&](int64_t r) {
    const float* xr = x + r * C;
    const float m = simd::lane_sum<float>(C, [&](int64_t c) { return xr[c]; }) / static_cast<float>(C);
    const float v = simd::lane_sum<float>(C, [&](int64_t c) { return (xr[c] - m) * (xr[c] - m); }) / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + eps);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = (xr[c] - m) * s * scale[c] + shift[c];
    mean[r] = m;
    rstd[r] = s;
  });
}

void layer_norm_backward(const float* x, const float* scale, const float* mean, const float* rstd, const float* dy,
                         float* dx, float* dscale, float* dshift, int64_t rows, int64_t C, bool accumulate) {
  if (dx) {
    parallel_for(rows, worth_parallel(rows * C), [&](int64_t r) {
      const float* xr = x + r * C;
      const float* gr = dy + r * C;
      const float mu = mean[r], s = rstd[r];
      const float mean_d = simd::lane_sum<float>(C, [&](int64_t c) { return gr[c] * scale[c]; }) / static_cast<float>(C);
      const float mean_dx =
          simd::lane_sum<float>(C, [&](int64_t c) { return gr[c] * scale[c] * (xr[c] - mu) * s; }) / static_cast<float>(C);
      float* dxr = dx + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const float xhat = (xr[c] - mu) * s;
        dxr[c] = (accumulate ? dxr[c] : 0.0f) + s * (gr[c] * scale[c] - mean_d - xhat * mean_dx);
      }
    });
  }
  if (!dscale && !dshift) return;
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  memory::Buffer<float> partial(static_cast<size_t>(chunks * 2 * C));
  std::fill_n(partial.data(), chunks * 2 * C, 0.0f);
  parallel_for(chunks, worth_parallel(rows * C), [&](int64_t k) {
    float* ps = partial.data() + k * 2 * C;
    for (int64_t r = k * kChunkRows; r < std::min(rows, (k + 1) * kChunkRows); ++r)
      for (int64_t c = 0; c < C; ++c) {
        ps[c] += dy[r * C + c] * (x[r * C + c] - mean[r]) * rstd[r];
        ps[C + c] += dy[r * C + c];
      }
  });
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < C; ++c) {
      if (dscale) dscale[c] += partial[static_cast<size_t>(k * 2 * C + c)];
      if (dshift) dshift[c] += partial[static_cast<size_t>(k * 2 * C + C + c)];
    }
}

namespace {
// Mean and 1/√(var + eps) of one row, in double.
std::pair<double, double> moments(const float* x, int64_t C, float eps) {
  double m = 0.0, v = 0.0;
  for (int64_t c = 0; c < C; ++c) m += x[c];
  m /= static_cast<double>(C);
  for (int64_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
  v /= static_cast<double>(C);
  return {m, 1.0 / std::sqrt(v + eps)};
}
}  // namespace

void layer_norm_forward_reference(const float* x, const float* scale, const float* shift, float* y, int64_t rows,
                                  int64_t C, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto [m, s] = moments(x + r * C, C, eps);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = static_cast<float>((x[r * C + c] - m) * s * scale[c] + shift[c]);
  }
}

void layer_norm_backward_reference(const float* x, const float* scale, const float* dy, float* dx, float* dscale,
                                   float* dshift, int64_t rows, int64_t C, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto [m, s] = moments(x + r * C, C, eps);
    double mean_d = 0.0, mean_dx = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double d = static_cast<double>(dy[r * C + c]) * scale[c];
      mean_d += d;
      mean_dx += d * (x[r * C + c] - m) * s;
    }
    mean_d /= static_cast<double>(C);
    mean_dx /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (x[r * C + c] - m) * s;
      if (dx) dx[r * C + c] += static_cast<float>(s * (static_cast<double>(dy[r * C + c]) * scale[c] - mean_d - xhat * mean_dx));
      if (dscale) dscale[c] += static_cast<float>(dy[r * C + c] * xhat);
      if (dshift) dshift[c] += dy[r * C + c];
    }
  }
}

// ---- RMSNorm ----

void rms_norm_forward(const float* x, const float* weight, float offset, float* y, float* rstd, int64_t rows, int64_t C,
                      float eps) {
  parallel_for(rows, worth_parallel(rows * C), [&](int64_t r) {
    const float* xr = x + r * C;
    const float ms = simd::lane_sum<float>(C, [&](int64_t c) { return xr[c] * xr[c]; }) / static_cast<float>(C);
    const float s = 1.0f / std::sqrt(ms + eps);
    float* yr = y + r * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * s * (weight[c] + offset);
    rstd[r] = s;
  });
}

void rms_norm_backward(const float* x, const float* weight, float offset, const float* rstd, const float* dy, float* dx,
                       float* dweight, int64_t rows, int64_t C, bool accumulate) {
  if (dx) {
    parallel_for(rows, worth_parallel(rows * C), [&](int64_t r) {
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
    });
  }
  if (!dweight) return;
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  memory::Buffer<float> partial(static_cast<size_t>(chunks * C));
  std::fill_n(partial.data(), chunks * C, 0.0f);
  parallel_for(chunks, worth_parallel(rows * C), [&](int64_t k) {
    float* ps = partial.data() + k * C;
    for (int64_t r = k * kChunkRows; r < std::min(rows, (k + 1) * kChunkRows); ++r)
      for (int64_t c = 0; c < C; ++c) ps[c] += dy[r * C + c] * x[r * C + c] * rstd[r];
  });
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

}  // namespace qkv::kernels
