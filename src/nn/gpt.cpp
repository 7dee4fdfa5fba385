// GPTModel and its parts (see qkv/nn/gpt.hpp), including inference with a KV cache.
#include "qkv/nn/gpt.hpp"

#include <cmath>
#include <cstdlib>

#include "qkv/autograd.hpp"
#include "qkv/kernels.hpp"
#include "qkv/ops.hpp"

namespace qkv::nn {

// ---- configuration ----

void GPTConfig::validate() const {
  require_positive(vocab_size, "GPTConfig", "vocab_size");
  require_positive(context_length, "GPTConfig", "context_length");
  require_positive(emb_dim, "GPTConfig", "emb_dim");
  require_positive(n_heads, "GPTConfig", "n_heads");
  require_positive(n_layers, "GPTConfig", "n_layers");
  if (emb_dim % n_heads != 0) {
    throw ValueError("GPTConfig: emb_dim = " + std::to_string(emb_dim) + " is not divisible by n_heads = " +
                     std::to_string(n_heads));
  }
  if (!(drop_rate >= 0.0 && drop_rate < 1.0)) throw ValueError("GPTConfig: drop_rate must lie in [0, 1)");
}

std::map<std::string, std::string> GPTConfig::to_strings() const {
  char rate[32];
  std::snprintf(rate, sizeof rate, "%.17g", drop_rate);
  return {{"vocab_size", std::to_string(vocab_size)}, {"context_length", std::to_string(context_length)},
          {"emb_dim", std::to_string(emb_dim)},       {"n_heads", std::to_string(n_heads)},
          {"n_layers", std::to_string(n_layers)},     {"drop_rate", rate},
          {"qkv_bias", qkv_bias ? "true" : "false"},  {"tie_weights", tie_weights ? "true" : "false"}};
}

GPTConfig GPTConfig::from_strings(const std::map<std::string, std::string>& values) {
  GPTConfig c;
  auto get = [&](const char* key) -> const std::string& {
    auto it = values.find(key);
    if (it == values.end()) throw ValueError(std::string("GPT configuration lacks \"") + key + "\"");
    return it->second;
  };
  auto integer = [&](const char* key) {
    const std::string& v = get(key);
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end) throw ValueError(std::string("GPT configuration: ") + key + " = \"" + v + "\" is not an integer");
    return static_cast<int64_t>(n);
  };
  auto flag = [&](const char* key) {
    const std::string& v = get(key);
    if (v != "true" && v != "false") throw ValueError(std::string("GPT configuration: ") + key + " must be true or false");
    return v == "true";
  };
  c.vocab_size = integer("vocab_size");
  c.context_length = integer("context_length");
  c.emb_dim = integer("emb_dim");
  c.n_heads = integer("n_heads");
  c.n_layers = integer("n_layers");
  c.drop_rate = std::strtod(get("drop_rate").c_str(), nullptr);
  c.qkv_bias = flag("qkv_bias");
  c.tie_weights = flag("tie_weights");
  c.validate();
  return c;
}

// ---- parts ----

Embedding::Embedding(int64_t num, int64_t dim, Generator& gen) {
  require_positive(num, "Embedding", "num_embeddings");
  require_positive(dim, "Embedding", "embedding_dim");
  weight = register_parameter("weight", gen.randn({num, dim}));
}

Tensor Embedding::forward(std::span<const int64_t> ids, const Shape& ids_shape) const {
  return embedding(weight, ids, ids_shape);
}

LayerNorm::LayerNorm(int64_t emb_dim, float eps_) : eps(eps_) {
  require_positive(emb_dim, "LayerNorm", "emb_dim");
  scale = register_parameter("scale", Tensor::ones({emb_dim}));
  shift = register_parameter("shift", Tensor::zeros({emb_dim}));
}

Tensor LayerNorm::forward(const Tensor& x) const { return layer_norm(x, scale, shift, eps); }

FeedForward::FeedForward(int64_t emb_dim, Generator& gen) : fc(emb_dim, 4 * emb_dim, true, gen), proj(4 * emb_dim, emb_dim, true, gen) {
  register_module("layers.0", fc);
  register_module("layers.2", proj);
}

Tensor FeedForward::forward(const Tensor& x) const { return proj(gelu(fc(x))); }

TransformerBlock::TransformerBlock(const GPTConfig& c, Generator& gen)
    : att(c.emb_dim, c.emb_dim, c.context_length, c.drop_rate, c.n_heads, c.qkv_bias, gen),
      ff(c.emb_dim, gen),
      norm1(c.emb_dim),
      norm2(c.emb_dim),
      drop_rate(c.drop_rate),
      gen_(&gen) {
  register_module("att", att);
  register_module("ff", ff);
  register_module("norm1", norm1);
  register_module("norm2", norm2);
}

// x + dropout(att(norm1(x))), then the same with ff and norm2.
Tensor TransformerBlock::forward(const Tensor& x) const {
  const Tensor attended = add(x, hashed_dropout(att(norm1(x)), drop_rate, is_training(), *gen_));
  return add(attended, hashed_dropout(ff(norm2(attended)), drop_rate, is_training(), *gen_));
}

// ---- the model ----

GPTModel::GPTModel(const GPTConfig& c, Generator& gen)
    : config((c.validate(), c)),
      tok_emb(c.vocab_size, c.emb_dim, gen),
      pos_emb(c.context_length, c.emb_dim, gen),
      final_norm(c.emb_dim),
      out_head(c.emb_dim, c.vocab_size, false, NoInit{}),
      gen_(&gen) {
  // PyTorch's creation order: tok_emb, pos_emb, the blocks, final_norm, out_head. To draw the same random
  // numbers, out_head is built without drawing and initialised here, after the blocks.
  register_module("tok_emb", tok_emb);
  register_module("pos_emb", pos_emb);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    trf_blocks.push_back(std::make_unique<TransformerBlock>(c, gen));
    register_module("trf_blocks." + std::to_string(i), *trf_blocks.back());
  }
  register_module("final_norm", final_norm);
  kaiming_uniform_(out_head.weight, std::sqrt(5.0), gen);
  register_module("out_head", out_head);
  if (c.tie_weights) out_head.tie_weight(tok_emb.weight);
}

Tensor GPTModel::forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens) const {
  if (batch <= 0 || tokens <= 0 || batch * tokens != static_cast<int64_t>(ids.size())) {
    throw ShapeError("GPTModel: " + std::to_string(ids.size()) + " token ids do not form a (" + std::to_string(batch) +
                     ", " + std::to_string(tokens) + ") batch");
  }
  if (tokens > config.context_length) {
    throw ShapeError("GPTModel: a sequence of " + std::to_string(tokens) + " tokens is longer than context_length = " +
                     std::to_string(config.context_length) + "; use at most the last context_length tokens");
  }
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) positions[static_cast<size_t>(t)] = t;
  // (B, T, C) + (T, C): the position embeddings broadcast over the batch.
  Tensor x = add(tok_emb.forward(ids, {batch, tokens}), pos_emb.forward(positions, {tokens}));
  x = hashed_dropout(x, config.drop_rate, is_training(), *gen_);
  for (const auto& block : trf_blocks) x = block->forward(x);
  return out_head(final_norm(x));
}

KVCache GPTModel::make_cache(int64_t batch) const {
  KVCache cache;
  cache.batch = batch;
  cache.capacity = config.context_length;
  for (int64_t i = 0; i < config.n_layers; ++i) {
    cache.keys.push_back(Tensor::zeros({batch, cache.capacity, config.emb_dim}));
    cache.values.push_back(Tensor::zeros({batch, cache.capacity, config.emb_dim}));
  }
  return cache;
}

// The same computation as forward() for the new positions only, attending over the cached keys and
// values: per layer, project the new tokens, append their K and V, and run the fused kernel with
// Tq = new tokens and Tk = all tokens so far (its causal mask shifts by Tk − Tq).
Tensor GPTModel::forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const {
  NoGradGuard no_grad;
  const int64_t C = config.emb_dim, H = config.n_heads, start = cache.length;
  if (batch != cache.batch || batch * tokens != static_cast<int64_t>(ids.size()) || tokens <= 0) {
    throw ShapeError("GPTModel::forward_cached: ids do not form a (" + std::to_string(cache.batch) + ", T) batch");
  }
  if (start + tokens > cache.capacity) {
    throw ShapeError("GPTModel::forward_cached: " + std::to_string(start + tokens) +
                     " tokens exceed context_length = " + std::to_string(cache.capacity));
  }
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) positions[static_cast<size_t>(t)] = start + t;
  Tensor x = add(tok_emb.forward(ids, {batch, tokens}), pos_emb.forward(positions, {tokens}));
  const kernels::AttentionDims dims{batch, H, tokens, start + tokens, C / H};
  kernels::AttentionLayout layout;
  layout.q = layout.o = kernels::AttentionStrides::btc(dims, tokens);
  layout.k = layout.v = {cache.capacity * C, C / H, C};
  Tensor lse = Tensor::empty({batch, H, tokens});
  for (size_t layer = 0; layer < trf_blocks.size(); ++layer) {
    const TransformerBlock& block = *trf_blocks[layer];
    const Tensor h = block.norm1(x);
    const Tensor q = block.att.W_query(h), k = block.att.W_key(h), v = block.att.W_value(h);
    for (int64_t b = 0; b < batch; ++b) {
      std::copy_n(k.data() + b * tokens * C, tokens * C, cache.keys[layer].data() + (b * cache.capacity + start) * C);
      std::copy_n(v.data() + b * tokens * C, tokens * C, cache.values[layer].data() + (b * cache.capacity + start) * C);
    }
    Tensor context = Tensor::empty(q.shape());
    kernels::AttentionOptions options;
    options.causal = true;
    kernels::attention_forward(dims, layout, options, q.data(), cache.keys[layer].data(), cache.values[layer].data(),
                               context.data(), lse.data());
    x = add(x, block.att.out_proj(context));
    x = add(x, block.ff(block.norm2(x)));
  }
  cache.length = start + tokens;
  // Only the last position's logits are needed to pick the next token.
  Tensor last = Tensor::empty({batch, C});
  for (int64_t b = 0; b < batch; ++b) std::copy_n(x.data() + (b * tokens + tokens - 1) * C, C, last.data() + b * C);
  return out_head(final_norm(last));
}

Tensor language_model_loss(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index) {
  if (logits.rank() != 3) throw ShapeError("language_model_loss: logits must be (B, T, V), got " + logits.shape().str());
  return cross_entropy(reshape(logits, {logits.size(0) * logits.size(1), logits.size(2)}), targets, ignore_index);
}

}  // namespace qkv::nn
