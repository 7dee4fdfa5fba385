// Embedding lookup, LayerNorm and GELU: the pieces of a GPT block besides attention and Linear.
// Each backward sits under its forward; rows run in parallel, and reductions over rows go through
// fixed-size chunks summed in order, so results do not depend on the number of threads.
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "qkv/autograd.hpp"
#include "qkv/kernels.hpp"
#include "qkv/ops.hpp"

namespace qkv {

namespace {
constexpr int64_t kChunkRows = 64;  // reduction chunk: independent of the thread count
}

// embedding: out[n, :] = weight[ids[n], :]. Backward: dweight[ids[n], :] += g[n, :], in id order.
Tensor embedding(const Tensor& weight, std::span<const int64_t> ids, const Shape& ids_shape) {
  if (weight.rank() != 2) throw ShapeError("embedding: weight must be (V, C), got " + weight.shape().str());
  if (ids_shape.numel() != static_cast<int64_t>(ids.size())) {
    throw ShapeError("embedding: " + std::to_string(ids.size()) + " ids do not fill shape " + ids_shape.str());
  }
  const int64_t V = weight.size(0), C = weight.size(1), n = static_cast<int64_t>(ids.size());
  for (int64_t i = 0; i < n; ++i) {
    if (ids[static_cast<size_t>(i)] < 0 || ids[static_cast<size_t>(i)] >= V) {
      throw ValueError("embedding: token id " + std::to_string(ids[static_cast<size_t>(i)]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
  }
  std::vector<int64_t> dims(ids_shape.dims().begin(), ids_shape.dims().end());
  dims.push_back(C);
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(dims)));
  const float* w = weight.data();
  float* y = out.data();
#pragma omp parallel for schedule(static) if (n * C > (1 << 16))
  for (int64_t i = 0; i < n; ++i) std::copy_n(w + ids[static_cast<size_t>(i)] * C, C, y + i * C);
  if (detail::needs_grad({&weight})) {
    std::vector<int64_t> kept(ids.begin(), ids.end());
    detail::record(out, "EmbeddingBackward", {weight}, [weight, kept = std::move(kept), C](const Tensor& dout) {
      float* dw = detail::grad_buffer(weight);
      const float* g = dout.data();
      for (size_t i = 0; i < kept.size(); ++i)
        for (int64_t c = 0; c < C; ++c) dw[kept[i] * C + c] += g[static_cast<int64_t>(i) * C + c];
    });
  }
  return out;
}

// layer_norm, per row of C: x̂ = (x − μ)·rstd, rstd = 1/√(σ² + eps); y = x̂·scale + shift.
// Backward (llm.c's derivation): with d = dy·scale,
//   dx = rstd · (d − mean(d) − x̂ · mean(d · x̂));  dscale = Σ_rows dy·x̂;  dshift = Σ_rows dy.
Tensor layer_norm(const Tensor& x, const Tensor& scale, const Tensor& shift, float eps) {
  if (x.rank() < 1) throw ShapeError("layer_norm: needs at least one dimension");
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (!(scale.shape() == Shape{C}) || !(shift.shape() == Shape{C})) {
    throw ShapeError("layer_norm: scale and shift must be (" + std::to_string(C) + ") for input " + x.shape().str() +
                     ", got " + scale.shape().str() + " and " + shift.shape().str());
  }
  Tensor out = Tensor::empty(x.shape());
  Tensor mean = Tensor::empty({rows}), rstd = Tensor::empty({rows});
  const float *px = x.data(), *w = scale.data(), *b = shift.data();
  float *y = out.data(), *pm = mean.data(), *pr = rstd.data();
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * C;
    float m = 0.0f;
    for (int64_t c = 0; c < C; ++c) m += xr[c];
    m /= static_cast<float>(C);
    float v = 0.0f;
    for (int64_t c = 0; c < C; ++c) v += (xr[c] - m) * (xr[c] - m);
    v /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + eps);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = (xr[c] - m) * s * w[c] + b[c];
    pm[r] = m;
    pr[r] = s;
  }
  if (detail::needs_grad({&x, &scale, &shift})) {
    detail::record(out, "LayerNormBackward", {x, scale, shift}, [x, scale, shift, mean, rstd, rows, C](const Tensor& dout) {
      const float *px = x.data(), *w = scale.data(), *g = dout.data(), *pm = mean.data(), *pr = rstd.data();
      if (float* dx = detail::grad_buffer(x)) {
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = px + r * C;
          const float* gr = g + r * C;
          float mean_d = 0.0f, mean_dx = 0.0f;
          for (int64_t c = 0; c < C; ++c) {
            const float d = gr[c] * w[c];
            mean_d += d;
            mean_dx += d * (xr[c] - pm[r]) * pr[r];
          }
          mean_d /= static_cast<float>(C);
          mean_dx /= static_cast<float>(C);
          for (int64_t c = 0; c < C; ++c) {
            const float xhat = (xr[c] - pm[r]) * pr[r];
            dx[r * C + c] += pr[r] * (gr[c] * w[c] - mean_d - xhat * mean_dx);
          }
        }
      }
      float* dscale = detail::grad_buffer(scale);
      float* dshift = detail::grad_buffer(shift);
      if (!dscale && !dshift) return;
      const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
      std::vector<float> partial(static_cast<size_t>(chunks * 2 * C), 0.0f);
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
      for (int64_t k = 0; k < chunks; ++k) {
        float* ps = partial.data() + k * 2 * C;
        for (int64_t r = k * kChunkRows; r < std::min(rows, (k + 1) * kChunkRows); ++r)
          for (int64_t c = 0; c < C; ++c) {
            ps[c] += g[r * C + c] * (px[r * C + c] - pm[r]) * pr[r];
            ps[C + c] += g[r * C + c];
          }
      }
      for (int64_t k = 0; k < chunks; ++k)
        for (int64_t c = 0; c < C; ++c) {
          if (dscale) dscale[c] += partial[static_cast<size_t>(k * 2 * C + c)];
          if (dshift) dshift[c] += partial[static_cast<size_t>(k * 2 * C + C + c)];
        }
    });
  }
  return out;
}

// gelu: forward and backward are kernels::gelu_forward / gelu_backward (AVX2, parallel).
Tensor gelu(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape());
  kernels::gelu_forward(x.data(), out.data(), x.numel());
  if (detail::needs_grad({&x})) {
    detail::record(out, "GeluBackward", {x}, [x](const Tensor& dout) {
      kernels::gelu_backward(x.data(), dout.data(), detail::grad_buffer(x), x.numel());
    });
  }
  return out;
}

}  // namespace qkv
