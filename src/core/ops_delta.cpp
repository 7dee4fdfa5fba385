// The gated delta rule as a differentiable op (kernels::delta_rule_forward / delta_rule_backward): the forward keeps
// nothing but its inputs, the backward rebuilds the state from them.
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/delta_rule.hpp"

namespace qkv {

Tensor gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta) {
  if (q.rank() != 4 || !(k.shape() == q.shape()) || v.rank() != 4 || g.rank() != 3 || !(beta.shape() == g.shape()) ||
      v.size(0) != q.size(0) || v.size(1) != q.size(1) || v.size(2) != q.size(2) ||
      !(g.shape() == Shape{q.size(0), q.size(1), q.size(2)}))
    throw ShapeError("gated_delta_rule: q and k must be (B, T, H, Dk), v (B, T, H, Dv), g and beta (B, T, H); got q " +
                     q.shape().str() + ", k " + k.shape().str() + ", v " + v.shape().str() + ", g " + g.shape().str() +
                     ", beta " + beta.shape().str());
  const kernels::DeltaRuleDims dims{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
  Tensor out = Tensor::empty(v.shape());
  kernels::delta_rule_forward(dims, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, out.data(), nullptr);
  if (detail::needs_grad({&q, &k, &v, &g, &beta})) {
    detail::record(out, "GatedDeltaRuleBackward", {q, k, v, g, beta}, [q, k, v, g, beta, dims](const Tensor& dout) {
      Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()), dv = Tensor::empty(v.shape());
      Tensor dg = Tensor::empty(g.shape()), dbeta = Tensor::empty(beta.shape());
      kernels::delta_rule_backward(dims, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr, dout.data(),
                                   dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data());
      detail::add_grad(q, std::move(dq));
      detail::add_grad(k, std::move(dk));
      detail::add_grad(v, std::move(dv));
      detail::add_grad(g, std::move(dg));
      detail::add_grad(beta, std::move(dbeta));
    });
  }
  return out;
}

}  // namespace qkv
