// RMSNorm, SiLU and rotary embeddings as differentiable ops: the pieces of Llama-, Qwen- and Gemma-style blocks.
// Each backward sits under its forward; the loops are kernels (qkv/kernels/norms.hpp, activations.hpp, rope.hpp).
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/norms.hpp"
#include "qkv/kernels/rope.hpp"

namespace qkv {

// rms_norm, per row of C: rstd = 1/√(mean(x²) + eps); y = x·rstd·(w + offset).
// Backward: with x̂ = x·rstd, d = dy·(w + offset): dx = rstd·(d − x̂·mean(d·x̂)); dw = Σ_rows dy·x̂.
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps, float offset) {
  if (x.rank() < 1) throw ShapeError("rms_norm: needs at least one dimension");
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  if (!(weight.shape() == Shape{C})) {
    throw ShapeError("rms_norm: weight must be (" + std::to_string(C) + ") for input " + x.shape().str() + ", got " +
                     weight.shape().str());
  }
  Tensor out = Tensor::empty(x.shape());
  Tensor rstd = Tensor::empty({rows});
  kernels::rms_norm_forward(x.data(), weight.data(), offset, out.data(), rstd.data(), rows, C, eps);
  if (detail::needs_grad({&x, &weight})) {
    detail::record(out, "RMSNormBackward", {x, weight}, [x, weight, rstd, rows, C, offset](const Tensor& dout) {
      const auto dx = detail::grad_target(x);
      kernels::rms_norm_backward(x.data(), weight.data(), offset, rstd.data(), dout.data(), dx.data,
                                 detail::grad_buffer(weight), rows, C, dx.accumulate);
    });
  }
  return out;
}

// silu: y = x·σ(x); dx = g·σ(x)·(1 + x·(1 − σ(x))).
Tensor silu(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape());
  kernels::silu_forward(x.data(), out.data(), x.numel());
  if (detail::needs_grad({&x})) {
    detail::record(out, "SiluBackward", {x}, [x](const Tensor& dout) {
      const auto dx = detail::grad_target(x);
      kernels::silu_backward(x.data(), dout.data(), dx.data, x.numel(), dx.accumulate);
    });
  }
  return out;
}

// rope: each head's pairs rotated by position·inv_freq. A rotation's inverse is its transpose, so the backward rotates
// the gradient back: dx = R(−θ) dy.
Tensor rope(const Tensor& x, std::shared_ptr<const kernels::RopeTable> table, kernels::RopeLayout layout,
            int64_t num_heads, int64_t position, int64_t rotated_heads) {
  if (!table) throw ValueError("rope: no rotation table");
  if (x.rank() != 3 || num_heads <= 0 || x.size(2) % num_heads != 0) {
    throw ShapeError("rope: input must be (B, T, H·D) with num_heads = H > 0 dividing its channels, got " +
                     x.shape().str() + " with num_heads = " + std::to_string(num_heads));
  }
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2) / num_heads;
  if (rotated_heads < 0 || rotated_heads > num_heads) {
    throw ShapeError("rope: cannot rotate " + std::to_string(rotated_heads) + " of " + std::to_string(num_heads) + " heads");
  }
  const int64_t rotated = rotated_heads > 0 ? rotated_heads : num_heads, width = x.size(2);
  if (2 * table->P > D) {  // fewer is a partial rotation: the rest of each head passes
    throw ShapeError("rope: heads of " + std::to_string(D) + " values, but the table rotates " +
                     std::to_string(2 * table->P));
  }
  if (position < 0 || position + T > table->positions) {
    throw ShapeError("rope: positions [" + std::to_string(position) + ", " + std::to_string(position + T) +
                     ") are beyond the rotation table's " + std::to_string(table->positions) +
                     " (the model's max_position_embeddings); use a shorter sequence or context");
  }
  Tensor out = Tensor::empty(x.shape());
  kernels::rope_apply(*table, layout, x.data(), out.data(), B * T, T, width, rotated, D, position, false);
  if (detail::needs_grad({&x})) {
    detail::record(out, "RopeBackward", {x}, [x, table, layout, rotated, width, position, B, T, D](const Tensor& dout) {
      Tensor g = Tensor::empty(dout.shape());
      kernels::rope_apply(*table, layout, dout.data(), g.data(), B * T, T, width, rotated, D, position, true);
      detail::add_grad(x, g);
    });
  }
  return out;
}

}  // namespace qkv
