// Embedding lookup, LayerNorm and GELU: the pieces of a GPT block besides attention and Linear.
// Each backward sits under its forward; the loops are kernels (qkv/kernels/embedding.hpp, norms.hpp, activations.hpp).
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/embedding.hpp"
#include "qkv/kernels/norms.hpp"
#include "qkv/core/ops.hpp"

namespace qkv {

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
  if (weight.dtype() == DType::BF16) {  // an inference weight: rows widened as they are read
    if (detail::needs_grad({&weight}))
      throw ValueError("embedding: a bfloat16 weight " + weight.shape().str() + " cannot be trained; load the model in "
                       "float32 (train with --precision bf16 keeps float32 weights)");
    kernels::embedding_forward_bf16(weight.bf16(), ids.data(), n, C, out.data());
    return out;
  }
  kernels::embedding_forward(weight.data(), ids.data(), n, C, out.data());
  if (detail::needs_grad({&weight})) {
    std::vector<int64_t> kept(ids.begin(), ids.end());
    detail::record(out, "EmbeddingBackward", {weight}, [weight, kept = std::move(kept), C](const Tensor& dout) {
      kernels::embedding_backward(kept.data(), static_cast<int64_t>(kept.size()), C, dout.data(),
                                  detail::grad_buffer(weight));
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
  kernels::layer_norm_forward(x.data(), scale.data(), shift.data(), out.data(), mean.data(), rstd.data(), rows, C, eps);
  if (detail::needs_grad({&x, &scale, &shift})) {
    detail::record(out, "LayerNormBackward", {x, scale, shift}, [x, scale, shift, mean, rstd, rows, C](const Tensor& dout) {
      const auto dx = detail::grad_target(x);
      kernels::layer_norm_backward(x.data(), scale.data(), mean.data(), rstd.data(), dout.data(), dx.data,
                                   detail::grad_buffer(scale), detail::grad_buffer(shift), rows, C, dx.accumulate);
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
      if (const auto dx = detail::grad_target(x); dx.data)
        kernels::gelu_backward(x.data(), dout.data(), dx.data, x.numel(), dx.accumulate);
    });
  }
  return out;
}

}  // namespace qkv
