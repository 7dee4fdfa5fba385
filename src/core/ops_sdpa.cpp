// The fused attention kernel as a differentiable op: forward saves the log-sum-exp per row, backward
// recomputes the weights tile by tile (kernels::attention_backward).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/core/random.hpp"

namespace qkv {

namespace {

struct Resolved {
  kernels::AttentionDims dims;
  kernels::AttentionLayout layout;
};

Resolved resolve(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads, int64_t num_kv_heads,
                 int64_t kv_tokens) {
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
    if (q.size(0) != k.size(0)) fail("batch sizes of q and k differ");
    const int64_t D = q.size(2) / num_heads;
    if (D == 0 ? k.size(2) != 0 : k.size(2) % D != 0) {
      fail("k's channels are not a whole number of heads of " + std::to_string(D));
    }
    d = {q.size(0), num_heads, q.size(1), k.size(1), D, D == 0 ? num_heads : k.size(2) / D};
  } else if (q.rank() == 4) {
    if (q.size(0) != k.size(0) || q.size(3) != k.size(3)) fail("batch and head-dim sizes of q and k differ");
    d = {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), k.size(1)};
  } else {
    fail("inputs must be (B, T, H·D) or (B, H, T, D)");
  }
  if (d.H_kv <= 0 || d.H % d.H_kv != 0) {
    fail("k and v have " + std::to_string(d.H_kv) + " heads, which does not divide the " + std::to_string(d.H) +
         " query heads (grouped-query attention needs H_kv | H)");
  }
  if (num_kv_heads > 0 && num_kv_heads != d.H_kv) {
    fail("k and v have " + std::to_string(d.H_kv) + " heads, num_kv_heads says " + std::to_string(num_kv_heads));
  }
  if (q.rank() == 3) {
    r.layout.q = r.layout.o = kernels::AttentionStrides::btc(d.H, d.D, d.Tq);
    r.layout.k = r.layout.v = kernels::AttentionStrides::btc(d.H_kv, d.D, d.Tk);  // strides of the whole buffer
  } else {
    r.layout.q = r.layout.o = kernels::AttentionStrides::bhtd(d.H, d.D, d.Tq);
    r.layout.k = r.layout.v = kernels::AttentionStrides::bhtd(d.H_kv, d.D, d.Tk);
  }
  if (kv_tokens < 0 || kv_tokens > d.Tk) {
    fail("kv_tokens = " + std::to_string(kv_tokens) + " is outside [0, " + std::to_string(d.Tk) + "]");
  }
  if (kv_tokens > 0) d.Tk = kv_tokens;
  return r;
}

// The kernel's options from an op's config (dropout's seed is drawn by the caller, only when it is used).
kernels::AttentionOptions kernel_options(const AttentionConfig& config) {
  if (config.window < 0) throw ValueError("scaled_dot_product_attention: window must be ≥ 0, got " + std::to_string(config.window));
  if (!(config.softcap >= 0.0f)) throw ValueError("scaled_dot_product_attention: softcap must be ≥ 0");
  kernels::AttentionOptions options;
  options.causal = config.causal;
  options.window = config.window;
  options.scale = config.scale;
  options.softcap = config.softcap;
  return options;
}

// Q, K and V as (input, element offset) pairs: three tensors, or one packed tensor read at three offsets.
struct Operands {
  std::vector<Tensor> inputs;
  std::array<size_t, 3> input{0, 1, 2};
  std::array<int64_t, 3> offset{0, 0, 0};
  const float* operand(int which) const { return inputs[input[which]].data() + offset[which]; }
};

// The sinks' tensor checked against the heads: (H) float32, or undefined.
const float* checked_sinks(const AttentionConfig& config, const kernels::AttentionDims& dims) {
  if (!config.sinks.defined()) return nullptr;
  if (!(config.sinks.shape() == Shape{dims.H}) || config.sinks.dtype() != DType::F32) {
    throw ShapeError("scaled_dot_product_attention: sinks must be float32 of shape (" + std::to_string(dims.H) +
                     "), one logit per query head, got " + config.sinks.shape().str());
  }
  return config.sinks.data();
}

Tensor attend(const Resolved& r, const AttentionConfig& config, Operands ops, const Shape& out_shape) {
  if (!(config.dropout_p >= 0.0 && config.dropout_p <= 1.0)) {
    throw ValueError("scaled_dot_product_attention: dropout must lie in [0, 1], got " + std::to_string(config.dropout_p));
  }
  kernels::AttentionOptions options = kernel_options(config);
  options.sinks = checked_sinks(config, r.dims);
  if (options.sinks) ops.inputs.push_back(config.sinks);  // the last input: its gradient is the sinks'
  // Autocast: under Precision::BF16 the kernel's products take bf16 operands (softmax, sums and lse stay float32);
  // the backward runs as the forward did.
  options.bf16 = precision() == Precision::BF16;
  if (config.training && config.dropout_p > 0.0) {
    options.dropout_p = static_cast<float>(config.dropout_p);
    options.seed = (config.generator ? *config.generator : default_generator()).next_u64();
  }
  Tensor out = Tensor::empty(out_shape);
  Tensor lse = Tensor::empty({r.dims.B, r.dims.H, r.dims.Tq});
  kernels::attention_forward(r.dims, r.layout, options, ops.operand(0), ops.operand(1), ops.operand(2), out.data(),
                             lse.data());
  if (config.lse) *config.lse = lse;
  if (grad_enabled() &&
      std::any_of(ops.inputs.begin(), ops.inputs.end(), [](const Tensor& t) { return t.requires_grad(); })) {
    detail::record(out, "ScaledDotProductAttentionBackward", ops.inputs,
                   [ops, o = out.detach(), lse, r, options](const Tensor& dout) {
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
                     };
                     std::vector<Sink> sinks;
                     sinks.reserve(ops.inputs.size());
                     for (const Tensor& t : ops.inputs) sinks.emplace_back(t);
                     auto grad = [&](int which) { return sinks[ops.input[which]].data() + ops.offset[which]; };
                     kernels::attention_backward(r.dims, r.layout, options, ops.operand(0), ops.operand(1), ops.operand(2),
                                                 o.data(), lse.data(), dout.data(), grad(0), grad(1), grad(2));
                     if (options.sinks)
                       kernels::attention_sink_backward(r.dims, r.layout, options.sinks, o.data(), lse.data(),
                                                        dout.data(), sinks.back().data());
                     for (Sink& sink : sinks) sink.finish();
                   });
  }
  return out;
}

// Keys and values held in bf16 (a bf16 KV cache): read as they are by the kernel's bf16 products. Inference only.
Tensor attend_bf16_cache(const Resolved& r, const AttentionConfig& config, const Tensor& q, const Tensor& k,
                         const Tensor& v) {
  if (k.dtype() != DType::BF16 || v.dtype() != DType::BF16 || q.dtype() != DType::F32) {
    throw ValueError(std::string("scaled_dot_product_attention: keys and values must both be bfloat16 (a bf16 KV "
                                 "cache) or both float32, and queries float32; got q ") + dtype_name(q.dtype()) +
                     ", k " + dtype_name(k.dtype()) + ", v " + dtype_name(v.dtype()));
  }
  if (detail::needs_grad({&q, &k, &v})) {
    throw ValueError("scaled_dot_product_attention: bfloat16 keys and values (a bf16 KV cache) are for inference; run "
                     "it under NoGradGuard");
  }
  if (config.training && config.dropout_p > 0.0) {
    throw ValueError("scaled_dot_product_attention: no dropout with bfloat16 keys and values (inference only)");
  }
  kernels::AttentionOptions options = kernel_options(config);
  options.sinks = checked_sinks(config, r.dims);
  options.bf16 = true;
  Tensor out = Tensor::empty(q.shape());
  Tensor lse = Tensor::empty({r.dims.B, r.dims.H, r.dims.Tq});
  kernels::attention_forward_bf16_kv(r.dims, r.layout, options, q.data(), k.bf16(), v.bf16(), out.data(), lse.data());
  if (config.lse) *config.lse = lse;
  return out;
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionConfig& config) {
  const Resolved r = resolve(q, k, v, config.num_heads, config.num_kv_heads, config.kv_tokens);
  if (config.kv_tokens > 0 && config.kv_tokens < (q.rank() == 3 ? k.size(1) : k.size(2)) &&
      detail::needs_grad({&q, &k, &v})) {
    throw ValueError("scaled_dot_product_attention: a partly filled key/value cache is for inference; run it "
                     "under NoGradGuard");
  }
  if (k.dtype() == DType::BF16 || v.dtype() == DType::BF16) return attend_bf16_cache(r, config, q, k, v);
  return attend(r, config, Operands{.inputs = {q, k, v}}, q.shape());
}

Tensor scaled_dot_product_attention(const Tensor& qkv, const AttentionConfig& config) {
  const int64_t H = config.num_heads, H_kv = config.num_kv_heads > 0 ? config.num_kv_heads : H;
  const int64_t heads = H + 2 * H_kv;
  if (qkv.rank() != 3 || H <= 0 || H % H_kv != 0 || qkv.size(2) % heads != 0) {
    throw ShapeError("scaled_dot_product_attention: packed input must be (B, T, (H + 2·H_kv)·D) with num_heads = H > 0 "
                     "and num_kv_heads = H_kv dividing it, got " + qkv.shape().str() + " with num_heads = " +
                     std::to_string(H) + ", num_kv_heads = " + std::to_string(H_kv));
  }
  if (config.kv_tokens != 0) {
    throw ValueError("scaled_dot_product_attention: a packed (B, T, 3·H·D) input attends over its own T tokens; pass "
                     "q, k and v separately to read a key/value cache");
  }
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / heads, width = qkv.size(2);
  Resolved r;
  r.dims = {B, H, T, T, D, H_kv};
  const kernels::AttentionStrides packed{T * width, D, width};
  r.layout = {packed, packed, packed, kernels::AttentionStrides::btc(H, D, T)};
  return attend(r, config, Operands{.inputs = {qkv}, .input = {0, 0, 0}, .offset = {0, H * D, (H + H_kv) * D}},
                {B, T, H * D});
}

Tensor attention_weights(const Tensor& q, const Tensor& k, const Tensor& lse, const AttentionConfig& config, int64_t b,
                         int64_t h) {
  const Resolved r = resolve(q, k, k, config.num_heads, config.num_kv_heads, config.kv_tokens);
  if (!(lse.shape() == Shape{r.dims.B, r.dims.H, r.dims.Tq})) {
    throw ShapeError("attention_weights: lse has shape " + lse.shape().str() + ", expected (" + std::to_string(r.dims.B) +
                     ", " + std::to_string(r.dims.H) + ", " + std::to_string(r.dims.Tq) + ") from the same forward call");
  }
  if (b < 0 || b >= r.dims.B || h < 0 || h >= r.dims.H) {
    throw ShapeError("attention_weights: no batch row " + std::to_string(b) + " / head " + std::to_string(h) + " in " +
                     std::to_string(r.dims.B) + " rows of " + std::to_string(r.dims.H) + " heads");
  }
  const kernels::AttentionOptions options = kernel_options(config);
  Tensor keys = k;
  if (k.dtype() == DType::BF16) {  // a bf16 KV cache's keys, widened exactly
    keys = Tensor::empty(k.shape());
    kernels::bf16_to_f32(k.bf16(), keys.data(), k.numel());
  }
  Tensor out = Tensor::empty({r.dims.Tq, r.dims.Tk});
  kernels::attention_probabilities(r.dims, r.layout, options, q.data(), keys.data(), lse.data(), b, h, out.data());
  return out;
}

Tensor attention_output_gate(const Tensor& context, const Tensor& q_and_gate, int64_t num_heads) {
  const int64_t H = num_heads;
  if (context.rank() != 3 || q_and_gate.rank() != 3 || H <= 0 || context.size(2) % H != 0 ||
      !(q_and_gate.shape() == Shape{context.size(0), context.size(1), 2 * context.size(2)})) {
    throw ShapeError("attention_output_gate: context must be (B, T, H·D) and q_and_gate (B, T, H·2D) with H = "
                     "num_heads = " + std::to_string(H) + ", got " + context.shape().str() + " and " +
                     q_and_gate.shape().str());
  }
  const int64_t rows = context.size(0) * context.size(1), D = context.size(2) / H;
  Tensor out = Tensor::empty(context.shape());
  kernels::attention_gate_forward(rows, H, D, context.data(), q_and_gate.data() + D, 2 * H * D, 2 * D, out.data());
  if (detail::needs_grad({&context, &q_and_gate})) {
    detail::record(out, "AttentionOutputGateBackward", {context, q_and_gate},
                   [context, q_and_gate, rows, H, D](const Tensor& dout) {
                     Tensor d_context = Tensor::empty(context.shape());
                     Tensor d_both = Tensor::zeros(q_and_gate.shape());  // the query halves get nothing from here
                     kernels::attention_gate_backward(rows, H, D, context.data(), q_and_gate.data() + D, 2 * H * D,
                                                      2 * D, dout.data(), d_context.data(), d_both.data() + D);
                     detail::add_grad(context, std::move(d_context));
                     detail::add_grad(q_and_gate, std::move(d_both));
                   });
  }
  return out;
}

}  // namespace qkv
