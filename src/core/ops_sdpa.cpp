// The fused attention kernel as a differentiable op: forward saves the log-sum-exp per row, backward
// recomputes the weights tile by tile (kernels::attention_backward).
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/random.hpp"

namespace qkv {

namespace {

struct Resolved {
  kernels::AttentionDims dims;
  kernels::AttentionLayout layout;
};

Resolved resolve(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads, int64_t kv_tokens) {
  auto fail = [&](const std::string& why) {
    throw ShapeError("scaled_dot_product_attention: " + why + " (q " + q.shape().str() + ", k " + k.shape().str() +
                     ", v " + v.shape().str() + ")");
  };
  if (q.rank() != k.rank() || q.rank() != v.rank()) fail("q, k and v must have the same rank");
  if (!(k.shape() == v.shape())) fail("k and v must have the same shape");
  Resolved r;
  auto& d = r.dims;
  if (q.rank() == 3) {
    if (num_heads <= 0) fail("num_heads must be positive");
    if (q.size(2) % num_heads != 0) fail("the channel dimension is not divisible by num_heads = " + std::to_string(num_heads));
    if (q.size(0) != k.size(0) || q.size(2) != k.size(2)) fail("batch and channel sizes of q and k differ");
    d = {q.size(0), num_heads, q.size(1), k.size(1), q.size(2) / num_heads};
    r.layout.q = r.layout.o = kernels::AttentionStrides::btc(d, d.Tq);
    r.layout.k = r.layout.v = kernels::AttentionStrides::btc(d, d.Tk);  // strides of the whole buffer
  } else if (q.rank() == 4) {
    if (q.size(0) != k.size(0) || q.size(1) != k.size(1) || q.size(3) != k.size(3)) {
      fail("batch, head and head-dim sizes of q and k differ");
    }
    d = {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
    r.layout.q = r.layout.o = kernels::AttentionStrides::bhtd(d, d.Tq);
    r.layout.k = r.layout.v = kernels::AttentionStrides::bhtd(d, d.Tk);
  } else {
    fail("inputs must be (B, T, H·D) or (B, H, T, D)");
  }
  if (kv_tokens < 0 || kv_tokens > d.Tk) {
    fail("kv_tokens = " + std::to_string(kv_tokens) + " is outside [0, " + std::to_string(d.Tk) + "]");
  }
  if (kv_tokens > 0) d.Tk = kv_tokens;
  return r;
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionConfig& config) {
  const Resolved r = resolve(q, k, v, config.num_heads, config.kv_tokens);
  if (!(config.dropout_p >= 0.0 && config.dropout_p <= 1.0)) {
    throw ValueError("scaled_dot_product_attention: dropout must lie in [0, 1], got " + std::to_string(config.dropout_p));
  }
  kernels::AttentionOptions options;
  options.causal = config.causal;
  options.scale = config.scale;
  if (config.training && config.dropout_p > 0.0) {
    options.dropout_p = static_cast<float>(config.dropout_p);
    options.seed = (config.generator ? *config.generator : default_generator()).next_u64();
  }
  Tensor out = Tensor::empty(q.shape());
  Tensor lse = Tensor::empty({r.dims.B, r.dims.H, r.dims.Tq});
  kernels::attention_forward(r.dims, r.layout, options, q.data(), k.data(), v.data(), out.data(), lse.data());
  if (config.lse) *config.lse = lse;
  if (detail::needs_grad({&q, &k, &v})) {
    if (config.kv_tokens > 0 && config.kv_tokens < (q.rank() == 3 ? k.size(1) : k.size(2))) {
      throw ValueError("scaled_dot_product_attention: a partly filled key/value cache is for inference; run it "
                       "under NoGradGuard");
    }
    detail::record(out, "ScaledDotProductAttentionBackward", {q, k, v},
                   [q, k, v, o = out.detach(), lse, r, options](const Tensor& dout) {
                     // The kernel overwrites dq, dk, dv: a first gradient is written in place, a later one (or
                     // one nobody needs) goes through a temporary.
                     struct Sink {
                       detail::GradTarget target;
                       Tensor temp;
                       explicit Sink(const Tensor& x) : target(detail::grad_target(x)) {
                         if (!target.data || target.accumulate) temp = Tensor::empty(x.shape());
                       }
                       float* data() { return temp.defined() ? temp.data() : target.data; }
                       void finish() {
                         if (target.accumulate) kernels::accumulate(target.data, temp.data(), temp.numel());
                       }
                     } dq(q), dk(k), dv(v);
                     kernels::attention_backward(r.dims, r.layout, options, q.data(), k.data(), v.data(), o.data(),
                                                 lse.data(), dout.data(), dq.data(), dk.data(), dv.data());
                     dq.finish();
                     dk.finish();
                     dv.finish();
                   });
  }
  return out;
}

Tensor attention_weights(const Tensor& q, const Tensor& k, const Tensor& lse, const AttentionConfig& config, int64_t b,
                         int64_t h) {
  const Resolved r = resolve(q, k, k, config.num_heads, config.kv_tokens);
  if (!(lse.shape() == Shape{r.dims.B, r.dims.H, r.dims.Tq})) {
    throw ShapeError("attention_weights: lse has shape " + lse.shape().str() + ", expected (" + std::to_string(r.dims.B) +
                     ", " + std::to_string(r.dims.H) + ", " + std::to_string(r.dims.Tq) + ") from the same forward call");
  }
  if (b < 0 || b >= r.dims.B || h < 0 || h >= r.dims.H) {
    throw ShapeError("attention_weights: no batch row " + std::to_string(b) + " / head " + std::to_string(h) + " in " +
                     std::to_string(r.dims.B) + " rows of " + std::to_string(r.dims.H) + " heads");
  }
  kernels::AttentionOptions options;
  options.causal = config.causal;
  options.scale = config.scale;
  Tensor out = Tensor::empty({r.dims.Tq, r.dims.Tk});
  kernels::attention_probabilities(r.dims, r.layout, options, q.data(), k.data(), lse.data(), b, h, out.data());
  return out;
}

}  // namespace qkv
