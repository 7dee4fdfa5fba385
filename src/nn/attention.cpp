// SelfAttention_v1 and _v2: the seed's trainable scaled dot-product attention.
#include "qkv/nn/attention.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/precision.hpp"

namespace qkv::nn {

void check_attention_input(const Tensor& x, int64_t d_in, const char* layer) {
  if (x.rank() != 2 && x.rank() != 3) {
    throw ShapeError(std::string(layer) + ": input must be (T, d_in) or (B, T, d_in) with d_in = " +
                     std::to_string(d_in) + ", got shape " + x.shape().str());
  }
  if (x.size(-1) != d_in) {
    throw ShapeError(std::string(layer) + ": input's last dimension is " + std::to_string(x.size(-1)) +
                     " but the layer was built with d_in = " + std::to_string(d_in) + " (input shape " +
                     x.shape().str() + ")");
  }
}

AttentionTrace scaled_dot_product_trace(Tensor queries, Tensor keys, Tensor values, bool causal, double dropout_p,
                                        bool training, Generator& gen) {
  AttentionTrace t;
  t.scores = matmul(queries, transpose(keys, -2, -1));                       // Ω = QKᵀ (.., T, T)
  Tensor masked = causal ? masked_fill(t.scores, causal_mask(t.scores.size(-1)), -INFINITY) : t.scores;
  const float scale = std::sqrt(static_cast<float>(keys.size(-1)));          // √d_out
  t.weights = dropout(softmax(div(masked, scale)), dropout_p, training, gen);  // A, rows sum to 1
  t.context = matmul(t.weights, values);                                     // C = AV (.., T, d_out)
  t.queries = std::move(queries);
  t.keys = std::move(keys);
  t.values = std::move(values);
  return t;
}

SelfAttentionV1::SelfAttentionV1(int64_t d_in_, int64_t d_out_, Generator& gen) : d_in(d_in_), d_out(d_out_) {
  require_positive(d_in, "SelfAttention_v1", "d_in");
  require_positive(d_out, "SelfAttention_v1", "d_out");
  // torch.rand(d_in, d_out) three times, in the book's order.
  W_query = register_parameter("W_query", gen.rand({d_in, d_out}));
  W_key = register_parameter("W_key", gen.rand({d_in, d_out}));
  W_value = register_parameter("W_value", gen.rand({d_in, d_out}));
}

AttentionTrace SelfAttentionV1::trace(const Tensor& x) const {
  check_attention_input(x, d_in, "SelfAttention_v1");
  Tensor keys = matmul(x, W_key);  // the book computes keys, queries, values in this order
  Tensor queries = matmul(x, W_query);
  Tensor values = matmul(x, W_value);
  return scaled_dot_product_trace(std::move(queries), std::move(keys), std::move(values));
}

AttentionArgs AttentionArgs::validated(const char* layer) const {
  require_positive(d_in, layer, "d_in");
  require_positive(d_out, layer, "d_out");
  require_positive(num_heads, layer, "num_heads");
  if (causal) require_positive(context_length, layer, "context_length");
  if (!(dropout >= 0.0 && dropout <= 1.0)) {
    throw ValueError(std::string(layer) + ": dropout must lie in [0, 1], got " + std::to_string(dropout));
  }
  if (d_out % num_heads != 0) {
    throw ValueError(std::string(layer) + ": d_out = " + std::to_string(d_out) + " is not divisible by num_heads = " +
                     std::to_string(num_heads) + "; choose d_out as a multiple of num_heads");
  }
  return *this;
}

ProjectedAttention::ProjectedAttention(const AttentionArgs& a, Generator& gen)
    : d_in(a.d_in),
      d_out(a.d_out),
      context_length(a.causal ? a.context_length : 0),
      qkv_weight(Tensor::empty({3 * a.d_out, a.d_in})),
      qkv_bias(a.qkv_bias ? Tensor::empty({3 * a.d_out}) : Tensor()),
      W_query(a.d_in, a.d_out, a.qkv_bias, gen, part_of(qkv_weight, 0), part_of(qkv_bias, 0)),
      W_key(a.d_in, a.d_out, a.qkv_bias, gen, part_of(qkv_weight, 1), part_of(qkv_bias, 1)),
      W_value(a.d_in, a.d_out, a.qkv_bias, gen, part_of(qkv_weight, 2), part_of(qkv_bias, 2)) {
  register_module("W_query", W_query);
  register_module("W_key", W_key);
  register_module("W_value", W_value);
  W_query.lora_roles = kLoraQuery;
  W_key.lora_roles = kLoraKey;
  W_value.lora_roles = kLoraValue;
}

Tensor ProjectedAttention::part_of(const Tensor& whole, int64_t i) {
  if (!whole.defined()) return {};
  Shape shape = whole.shape();
  shape[0] /= 3;
  return whole.view_at(i * shape.numel(), shape);
}

void ProjectedAttention::check_input(const Tensor& x) const {
  const std::string layer = type_name();
  check_attention_input(x, d_in, layer.c_str());
  if (context_length > 0) check_context_length(x.size(-2), context_length, layer.c_str());
}

ProjectedAttention::Projections ProjectedAttention::project(const Tensor& x) const {
  check_input(x);
  Projections p;
  p.keys = W_key(x);
  p.queries = W_query(x);
  p.values = W_value(x);
  return p;
}

Tensor ProjectedAttention::project_packed(const Tensor& x) const {
  check_input(x);
  const Tensor weights[] = {W_query.weight, W_key.weight, W_value.weight};
  const Tensor biases[] = {W_query.bias, W_key.bias, W_value.bias};
  // LoRA adapters go into the same product's columns: q, k and v stay one tensor.
  const LowRankUpdate updates[] = {W_query.lora, W_key.lora, W_value.lora};
  const bool adapted = W_query.has_lora() || W_key.has_lora() || W_value.has_lora();
  return linear_concat(x, weights, W_query.bias.defined() ? std::span<const Tensor>(biases) : std::span<const Tensor>(),
                       adapted ? std::span<const LowRankUpdate>(updates) : std::span<const LowRankUpdate>());
}

SelfAttentionV2::SelfAttentionV2(int64_t d_in_, int64_t d_out_, bool qkv_bias, Generator& gen)
    : ProjectedAttention(
          AttentionArgs{.d_in = d_in_, .d_out = d_out_, .qkv_bias = qkv_bias}.validated("SelfAttention_v2"), gen) {}

void check_context_length(int64_t T, int64_t context_length, const char* layer) {
  if (T > context_length) {
    throw ShapeError(std::string(layer) + ": the input has " + std::to_string(T) +
                     " tokens but context_length is " + std::to_string(context_length) +
                     "; shorten the sequence or build the layer with a larger context_length");
  }
}

namespace {
// (B, T, H·D) → (B, H, T, D): the book's .view(b, T, H, D).transpose(1, 2).
Tensor split_heads(const Tensor& x, int64_t heads, int64_t head_dim) {
  return transpose(reshape(x, {x.size(0), x.size(1), heads, head_dim}), 1, 2);
}
}  // namespace

CausalAttention::CausalAttention(int64_t d_in_, int64_t d_out_, int64_t context_length_, double dropout_,
                                 bool qkv_bias, Generator& gen)
    : ProjectedAttention(AttentionArgs{.d_in = d_in_, .d_out = d_out_, .causal = true, .context_length = context_length_,
                                       .dropout = dropout_, .qkv_bias = qkv_bias}
                             .validated("CausalAttention"),
                         gen),
      dropout(dropout_),
      gen_(&gen) {
  register_derived_buffer("mask", Shape{context_length, context_length},
                          [n = context_length] { return causal_mask(n); });
}

AttentionTrace SelfAttentionV2::trace(const Tensor& x) const {
  Projections p = project(x);
  return scaled_dot_product_trace(std::move(p.queries), std::move(p.keys), std::move(p.values));
}

AttentionTrace CausalAttention::trace(const Tensor& x) const {
  Projections p = project(x);
  return scaled_dot_product_trace(std::move(p.queries), std::move(p.keys), std::move(p.values), /*causal=*/true,
                                  dropout, is_training(), *gen_);
}

namespace {
// The fused kernel on the projections as they come out of Linear: (B, T, H·D), no transposes.
Tensor fused_causal_attention(const Tensor& queries, const Tensor& keys, const Tensor& values, int64_t heads,
                              double dropout_p, bool training, Generator& gen) {
  const bool unbatched = queries.rank() == 2;
  auto batch = [&](const Tensor& t) { return unbatched ? reshape(t, {1, t.size(0), t.size(1)}) : t; };
  AttentionConfig config;
  config.num_heads = heads;
  config.causal = true;
  config.dropout_p = dropout_p;
  config.training = training;
  config.generator = &gen;
  Tensor context = scaled_dot_product_attention(batch(queries), batch(keys), batch(values), config);
  return unbatched ? reshape(context, queries.shape()) : context;
}
}  // namespace

Tensor CausalAttention::forward(const Tensor& x) const {
  if (attention_path() == AttentionPath::Plain) return trace(x).context;
  const Projections p = project(x);
  return fused_causal_attention(p.queries, p.keys, p.values, 1, dropout, is_training(), *gen_);
}

MultiHeadAttentionWrapper::MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out, int64_t context_length,
                                                     double dropout, int64_t num_heads, bool qkv_bias,
                                                     Generator& gen) {
  require_positive(num_heads, "MultiHeadAttentionWrapper", "num_heads");
  for (int64_t i = 0; i < num_heads; ++i) {
    heads.push_back(std::make_unique<CausalAttention>(d_in, d_out, context_length, dropout, qkv_bias, gen));
    register_module("heads." + std::to_string(i), *heads.back());
  }
}

Tensor MultiHeadAttentionWrapper::forward(const Tensor& x) const {
  std::vector<Tensor> outputs;
  for (const auto& head : heads) outputs.push_back(head->forward(x));
  return concat(outputs, -1);
}

MultiHeadAttention::MultiHeadAttention(int64_t d_in_, int64_t d_out_, int64_t context_length_, double dropout_,
                                       int64_t num_heads_, bool qkv_bias, Generator& gen)
    : ProjectedAttention(AttentionArgs{.d_in = d_in_, .d_out = d_out_, .causal = true, .context_length = context_length_,
                                       .dropout = dropout_, .num_heads = num_heads_, .qkv_bias = qkv_bias}
                             .validated("MultiHeadAttention"),
                         gen),
      num_heads(num_heads_),
      head_dim(d_out_ / num_heads_),
      dropout(dropout_),
      out_proj(d_out_, d_out_, true, gen),
      gen_(&gen) {
  register_module("out_proj", out_proj);
  out_proj.lora_roles = kLoraOutput;
  register_derived_buffer("mask", Shape{context_length, context_length},
                          [n = context_length] { return causal_mask(n); });
}

AttentionTrace MultiHeadAttention::trace(const Tensor& input) const {
  const Projections p = project(input);
  const bool unbatched = input.rank() == 2;
  const Tensor x = unbatched ? reshape(input, {1, input.size(0), input.size(1)}) : input;
  auto heads = [&](const Tensor& t) {  // (B, T, d_out) → (B, H, T, D)
    return split_heads(unbatched ? reshape(t, {1, t.size(0), t.size(1)}) : t, num_heads, head_dim);
  };
  AttentionTrace t = scaled_dot_product_trace(heads(p.queries), heads(p.keys), heads(p.values), true, dropout,
                                              is_training(), *gen_);
  // (B, H, T, D) → (B, T, H, D) → (B, T, d_out), then the output projection.
  Tensor merged = reshape(transpose(t.context, 1, 2), {x.size(0), x.size(1), d_out});
  t.context = out_proj(merged);
  if (unbatched) t.context = reshape(t.context, {input.size(0), d_out});
  return t;
}

KVCacheLayer MultiHeadAttention::make_cache(int64_t batch, int64_t capacity) const {
  require_positive(batch, "MultiHeadAttention::make_cache", "batch");
  if (capacity <= 0 || capacity > context_length) capacity = context_length;
  return KVCacheLayer::make(batch, capacity, d_out);
}

KVCacheLayer KVCacheLayer::make(int64_t batch, int64_t rows, int64_t width) {
  auto buffer = [&] {
    if (precision() != Precision::BF16) return Tensor::zeros({batch, rows, width});
    Tensor t = Tensor::empty({batch, rows, width});
    t.to_bf16_(false);
    std::fill_n(t.bf16_data(), t.numel(), uint16_t{0});
    return t;
  };
  return {buffer(), buffer()};
}

Tensor MultiHeadAttention::forward(const Tensor& x, const AttentionStep& step) const {
  if (attention_path() == AttentionPath::Plain && !step.cache && !step.record) return trace(x).context;
  AttentionConfig config;
  config.num_heads = num_heads;
  config.causal = true;
  config.dropout_p = dropout;
  config.training = is_training();
  config.generator = gen_;
  if (!step.cache && !step.record) {
    // Training and plain inference: one product for Q, K and V, read by the kernel in place, whose gradient
    // comes back as one tensor for one backward product.
    const Tensor qkv = project_packed(x);
    const bool unbatched = x.rank() == 2;
    Tensor context = scaled_dot_product_attention(unbatched ? reshape(qkv, {1, qkv.size(0), qkv.size(1)}) : qkv, config);
    if (unbatched) context = reshape(context, {context.size(1), context.size(2)});
    return out_proj(context);
  }
  // (B, T, H·D) as Linear gives it: the kernel reads each head with strides.
  const Projections p = project(x);
  const bool unbatched = x.rank() == 2;
  auto batch = [&](const Tensor& t) { return unbatched ? reshape(t, {1, t.size(0), t.size(1)}) : t; };
  Tensor lse;
  if (step.record) config.lse = &lse;
  Tensor queries = batch(p.queries), keys = batch(p.keys), values = batch(p.values);
  if (step.cache) {
    // Append this call's keys and values at [position, position + T), then attend over everything so far.
    KVCacheLayer& cache = *step.cache;
    const int64_t B = queries.size(0), T = queries.size(1), capacity = cache.keys.size(1);
    if (!(cache.keys.shape() == Shape{B, capacity, d_out})) {
      throw ShapeError("MultiHeadAttention: the KV cache holds " + cache.keys.shape().str() + ", not (" +
                       std::to_string(B) + ", capacity, " + std::to_string(d_out) + ")");
    }
    if (step.position < 0 || step.position + T > capacity) {
      throw ShapeError("MultiHeadAttention: " + std::to_string(step.position + T) + " tokens exceed the KV cache's " +
                       std::to_string(capacity));
    }
    NoGradGuard no_grad;
    write_tokens(keys, cache.keys, step.position);
    write_tokens(values, cache.values, step.position);
    keys = cache.keys;
    values = cache.values;
    config.kv_tokens = step.position + T;
  }
  Tensor context = scaled_dot_product_attention(queries, keys, values, config);
  if (step.record) {
    step.record->queries = queries.detach();
    step.record->keys = keys.detach();
    step.record->kv_tokens = config.kv_tokens > 0 ? config.kv_tokens : keys.size(1);
    step.record->lse = lse;
  }
  if (unbatched) context = reshape(context, p.queries.shape());
  return out_proj(context);
}

Tensor MultiHeadAttention::weights(const AttentionStep::Record& record, int64_t b, int64_t h) const {
  if (!record.lse.defined()) throw ValueError("MultiHeadAttention::weights: the record is empty; run forward with it first");
  AttentionConfig config;
  config.num_heads = num_heads;
  config.causal = true;
  config.kv_tokens = record.kv_tokens;
  return attention_weights(record.queries, record.keys, record.lse, config, b, h);
}

}  // namespace qkv::nn
