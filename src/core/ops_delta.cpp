// The gated delta rule as a differentiable op (kernels::delta_rule_forward / delta_rule_backward): the forward keeps
// nothing but its inputs, the backward rebuilds the state from them. A chunk of tokens or more in heads of 64 values or
// more runs the chunked form (kernels::delta_rule_forward_chunked / delta_rule_backward_chunked), else the recurrent one.
#include <algorithm>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/conv1d.hpp"
#include "qkv/kernels/delta_rule.hpp"

namespace qkv {

Tensor gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& initial, Tensor* final_state) {
  if (q.rank() != 4 || !(k.shape() == q.shape()) || v.rank() != 4 || g.rank() != 3 || !(beta.shape() == g.shape()) ||
      v.size(0) != q.size(0) || v.size(1) != q.size(1) || v.size(2) != q.size(2) ||
      !(g.shape() == Shape{q.size(0), q.size(1), q.size(2)}))
    throw ShapeError("gated_delta_rule: q and k must be (B, T, H, Dk), v (B, T, H, Dv), g and beta (B, T, H); got q " +
                     q.shape().str() + ", k " + k.shape().str() + ", v " + v.shape().str() + ", g " + g.shape().str() +
                     ", beta " + beta.shape().str());
  const kernels::DeltaRuleDims dims{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
  const Shape state_shape{dims.B, dims.H, dims.Dk, dims.Dv};
  if (initial.defined() && !(initial.shape() == state_shape))
    throw ShapeError("gated_delta_rule: the initial state must be (B, H, Dk, Dv) = " + state_shape.str() + ", got " +
                     initial.shape().str());
  Tensor out = Tensor::empty(v.shape());
  if (final_state) *final_state = Tensor::empty(state_shape);
  const float* init = initial.defined() ? initial.data() : nullptr;
  const bool grad = detail::needs_grad({&q, &k, &v, &g, &beta});
  // From a chunk of tokens on (prompts, training) and heads of 64 values or more, the chunked form: its products are
  // faster there; decoding's single tokens and narrow heads, the recurrent form. Forward + backward, chunked against
  // recurrent (Zen 5, 2 threads, T 256): heads of 16 values 0.48×, 32 0.75×, 64 1.46×, 128 2.75×. The backward takes
  // the same form as the forward.
  const bool chunked = dims.T >= kernels::kDeltaRuleChunk && std::min(dims.Dk, dims.Dv) >= 64;
  if (chunked)
    kernels::delta_rule_forward_chunked(dims, q.data(), k.data(), v.data(), g.data(), beta.data(), init, out.data(),
                                        final_state ? final_state->data() : nullptr);
  else
    kernels::delta_rule_forward(dims, q.data(), k.data(), v.data(), g.data(), beta.data(), init, out.data(),
                                final_state ? final_state->data() : nullptr);
  if (grad) {
    detail::record(out, "GatedDeltaRuleBackward", {q, k, v, g, beta}, [q, k, v, g, beta, initial, dims, chunked](const Tensor& dout) {
      Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()), dv = Tensor::empty(v.shape());
      Tensor dg = Tensor::empty(g.shape()), dbeta = Tensor::empty(beta.shape());
      (chunked ? kernels::delta_rule_backward_chunked : kernels::delta_rule_backward)(
          dims, q.data(), k.data(), v.data(), g.data(), beta.data(), initial.defined() ? initial.data() : nullptr,
          dout.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data());
      detail::add_grad(q, std::move(dq));
      detail::add_grad(k, std::move(dk));
      detail::add_grad(v, std::move(dv));
      detail::add_grad(g, std::move(dg));
      detail::add_grad(beta, std::move(dbeta));
    });
  }
  return out;
}

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& state) {
  if (x.rank() != 3 || weight.rank() != 2 || weight.size(0) != x.size(2) || weight.size(1) < 1)
    throw ShapeError("causal_conv1d: x must be (B, T, C) and the weight (C, K); got x " + x.shape().str() +
                     ", weight " + weight.shape().str());
  const kernels::CausalConvDims dims{x.size(0), x.size(1), x.size(2), weight.size(1)};
  if (state.defined() && !(state.shape() == Shape{dims.B, dims.K - 1, dims.C}))
    throw ShapeError("causal_conv1d: the state must hold the K - 1 inputs before x, (B, K - 1, C) = " +
                     Shape{dims.B, dims.K - 1, dims.C}.str() + ", got " + state.shape().str());
  Tensor out = Tensor::empty(x.shape());
  const float* before = state.defined() ? state.data() : nullptr;
  kernels::causal_conv1d_forward(dims, x.data(), weight.data(), before, out.data());
  if (detail::needs_grad({&x, &weight})) {
    detail::record(out, "CausalConv1dBackward", {x, weight}, [x, weight, state, dims](const Tensor& dout) {
      const bool want_x = x.requires_grad(), want_w = weight.requires_grad();
      Tensor dx = want_x ? Tensor::empty(x.shape()) : Tensor(), dw = want_w ? Tensor::empty(weight.shape()) : Tensor();
      kernels::causal_conv1d_backward(dims, x.data(), weight.data(), state.defined() ? state.data() : nullptr,
                                      dout.data(), want_x ? dx.data() : nullptr, want_w ? dw.data() : nullptr);
      if (want_x) detail::add_grad(x, std::move(dx));
      if (want_w) detail::add_grad(weight, std::move(dw));
    });
  }
  return out;
}

}  // namespace qkv
