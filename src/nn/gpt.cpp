// GPTModel and its parts (see qkv/nn/gpt.hpp), including inference with a KV cache.
#include "qkv/nn/gpt.hpp"

#include <cmath>
#include <algorithm>
#include <cstdlib>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"

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
  (void)parameter_count();  // overflow, or beyond any machine, is a ValueError here
}

DecoderConfig GPTConfig::decoder_config() const {
  DecoderConfig c;
  c.family = "gpt2";
  c.vocab_size = vocab_size;
  c.hidden_size = emb_dim;
  c.num_layers = n_layers;
  c.num_heads = c.num_kv_heads = n_heads;
  c.head_dim = n_heads > 0 ? emb_dim / n_heads : 0;
  c.max_positions = context_length;
  c.norm = NormKind::LayerNorm;
  c.norm_eps = 1e-5;
  c.mlp = MlpKind::GELU;
  c.mlp_bias = c.o_bias = c.learned_positions = true;
  c.qkv_bias = qkv_bias;
  c.tie_word_embeddings = tie_weights;
  c.drop_rate = drop_rate;
  c.layers.assign(static_cast<size_t>(std::max<int64_t>(std::min<int64_t>(n_layers, 65536), 0)), {});
  // 4·C, or the overflow the table's size checks report
  if (__builtin_mul_overflow(emb_dim, int64_t{4}, &c.intermediate_size)) c.intermediate_size = kMaxElements + 1;
  return c;
}

namespace {
// The decoder's size checks, with GPTConfig's words: its messages say which of the book's fields to shrink.
template <typename F>
auto as_gpt_config(F&& f) {
  try {
    return f();
  } catch (const ValueError& e) {
    std::string what = e.what();
    const std::string prefix = "decoder config: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    throw ValueError("GPTConfig: " + what + "; choose smaller vocab_size, emb_dim, context_length or fewer n_layers");
  }
}
}  // namespace

std::vector<std::pair<std::string, Shape>> GPTConfig::parameter_shapes() const {
  return as_gpt_config([&] {
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& p : decoder_config().layout()) out.emplace_back(p.name, p.shape);
    return out;
  });
}

int64_t GPTConfig::parameter_count() const {
  if (n_layers > 65536) {
    throw ValueError("GPTConfig: " + std::to_string(n_layers) + " layers of emb_dim " + std::to_string(emb_dim) +
                     " are more parameters than any machine holds; choose fewer or smaller layers");
  }
  return as_gpt_config([&] { return decoder_config().parameter_count(); });
}

const std::vector<Setting<GPTConfig>>& gpt_config_schema() {
  using settings::field;
  static const std::vector<Setting<GPTConfig>> schema = {
      field("vocab_size", "--vocab-size", "Model vocabulary (at least the tokenizer's)", &GPTConfig::vocab_size),
      field("context_length", "--context-length", "Tokens per training window (the longest context)",
            &GPTConfig::context_length),
      field("emb_dim", "--emb-dim", "Embedding width", &GPTConfig::emb_dim),
      field("n_heads", "--n-heads", "Attention heads", &GPTConfig::n_heads),
      field("n_layers", "--n-layers", "Transformer blocks", &GPTConfig::n_layers),
      field("drop_rate", "--drop-rate", "Dropout", &GPTConfig::drop_rate),
      field("qkv_bias", "--qkv-bias", "Biases in the Q, K, V projections", &GPTConfig::qkv_bias),
      field("tie_weights", "--tie-weights", "Share the token embedding with the output head", &GPTConfig::tie_weights),
  };
  return schema;
}

std::map<std::string, std::string> GPTConfig::to_strings() const { return settings::to_strings(gpt_config_schema(), *this); }

GPTConfig GPTConfig::from_strings(const std::map<std::string, std::string>& values) {
  const GPTConfig c = settings::from_strings(gpt_config_schema(), values, GPTConfig{}, "GPT configuration");
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
Tensor TransformerBlock::forward(const Tensor& x, const AttentionStep& step) const {
  const Tensor attended = add(x, hashed_dropout(att.forward(norm1(x), step), drop_rate, is_training(), *gen_));
  return add(attended, hashed_dropout(ff(norm2(attended)), drop_rate, is_training(), *gen_));
}

// ---- the model ----

GPTModel::GPTModel(const GPTConfig& c, Generator& gen)
    : config(c.validated()),
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

std::unique_ptr<GPTModel> GPTModel::uninitialised(const GPTConfig& config, uint64_t seed) {
  auto generator = std::make_shared<Generator>(Generator::drawing_nothing(seed));
  auto model = std::make_unique<GPTModel>(config, *generator);
  generator->set_drawing(true);  // from now on it serves dropout, like any generator
  model->owned_generator_ = std::move(generator);
  return model;
}

// Token embeddings plus the position embeddings of positions [position, position + tokens), then dropout.
Tensor GPTModel::embed(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t position) const {
  check_token_batch(ids, batch, tokens, "GPTModel");
  if (position + tokens > config.context_length) {
    throw ShapeError("GPTModel: a sequence of " + std::to_string(position + tokens) +
                     " tokens is longer than context_length = " + std::to_string(config.context_length) +
                     "; use at most the last context_length tokens");
  }
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) positions[static_cast<size_t>(t)] = position + t;
  // (B, T, C) + (T, C): the position embeddings broadcast over the batch.
  const Tensor x = add(tok_emb.forward(ids, {batch, tokens}), pos_emb.forward(positions, {tokens}));
  return hashed_dropout(x, config.drop_rate, is_training(), *gen_);
}

Tensor GPTModel::hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                        std::vector<AttentionStep::Record>* records) const {
  Tensor x = embed(ids, batch, tokens, 0);
  if (records) records->assign(trf_blocks.size(), {});
  for (size_t i = 0; i < trf_blocks.size(); ++i) {
    AttentionStep step;
    if (records) step.record = &(*records)[i];
    x = trf_blocks[i]->forward(x, step);
  }
  return final_norm(x);
}

Tensor GPTModel::residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const {
  if (layer < 0 || layer > config.n_layers) throw ValueError("GPTModel: no block " + std::to_string(layer));
  Tensor x = embed(ids, batch, tokens, 0);
  for (int64_t i = 0; i < layer; ++i) x = trf_blocks[static_cast<size_t>(i)]->forward(x, {});
  return x;
}

Tensor GPTModel::hidden_from(const Tensor& residual, int64_t layer) const {
  if (layer < 0 || layer > config.n_layers) throw ValueError("GPTModel: no block " + std::to_string(layer));
  Tensor x = residual;
  for (int64_t i = layer; i < config.n_layers; ++i) x = trf_blocks[static_cast<size_t>(i)]->forward(x, {});
  return final_norm(x);
}

Tensor GPTModel::forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                         std::vector<AttentionStep::Record>* records) const {
  return out_head(hidden(ids, batch, tokens, records));
}

Tensor GPTModel::loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
                      int64_t ignore_index) const {
  if (static_cast<int64_t>(targets.size()) != batch * tokens) {
    throw ShapeError("GPTModel::loss: " + std::to_string(targets.size()) + " targets for " + std::to_string(batch) +
                     " × " + std::to_string(tokens) + " tokens");
  }
  const Tensor h = hidden(ids, batch, tokens, nullptr);
  // A head with a LoRA adapter goes through its own fused product and the plain loss.
  if (out_head.has_lora()) return cross_entropy(reshape(out_head(h), {-1, config.vocab_size}), targets, ignore_index);
  return linear_cross_entropy(h, out_head.weight, out_head.bias, targets, ignore_index);
}

Tensor GPTModel::attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers, std::vector<int64_t> heads) const {
  NoGradGuard no_grad;
  const int64_t T = static_cast<int64_t>(ids.size());
  Tensor x = embed(ids, 1, T, 0);
  return gather_attention_maps(
      config.n_layers, config.n_heads, T, std::move(layers), std::move(heads),
      [&](int64_t i, AttentionStep::Record& record) {
        AttentionStep step;
        step.record = &record;
        x = trf_blocks[static_cast<size_t>(i)]->forward(x, step);
      },
      [&](int64_t l, const AttentionStep::Record& record, int64_t h) { return trf_blocks[static_cast<size_t>(l)]->att.weights(record, 0, h); });
}

KVCache GPTModel::make_cache(int64_t batch, int64_t max_tokens) const {
  if (max_tokens < 0 || max_tokens > config.context_length) {
    throw ShapeError("GPTModel::make_cache: " + std::to_string(max_tokens) + " positions, but context_length is " +
                     std::to_string(config.context_length));
  }
  KVCache cache;
  cache.batch = batch;
  cache.capacity = max_tokens > 0 ? max_tokens : config.context_length;
  for (const auto& block : trf_blocks) cache.layers.push_back(block->att.make_cache(batch, cache.capacity));
  cache.filled.assign(trf_blocks.size(), 0);
  return cache;
}

// The same computation as forward() for the new positions only: every block appends their keys and values
// to its cache layer and attends over all tokens so far (TransformerBlock::forward with a cache).
Tensor GPTModel::forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const {
  NoGradGuard no_grad;
  if (batch != cache.batch) {
    throw ShapeError("GPTModel::forward_cached: a batch of " + std::to_string(batch) + " rows for a cache made for " +
                     std::to_string(cache.batch));
  }
  const int64_t start = cache.length;
  Tensor x = embed(ids, batch, tokens, start);
  for (size_t i = 0; i < trf_blocks.size(); ++i) x = trf_blocks[i]->forward(x, {&cache.layers[i], start});
  cache.length = start + tokens;
  std::fill(cache.filled.begin(), cache.filled.end(), cache.length);
  // Only the last position's logits are needed to pick the next token.
  return out_head(final_norm(select_token(x, tokens - 1)));
}

}  // namespace qkv::nn
