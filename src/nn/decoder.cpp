// The decoder composed from its config (see qkv/nn/decoder.hpp): the parameter table, the module built from it, and
// the forward pass, loss, attention pictures and KV-cache inference.
#include "qkv/nn/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/nn/linear.hpp"

namespace qkv::nn {

namespace {

using Role = DecoderConfig::Role;

const std::vector<std::string> kFamilies = {"llama", "qwen2", "qwen3", "gemma3", "gpt2"};

bool is_family(const std::string& f) { return std::find(kFamilies.begin(), kFamilies.end(), f) != kFamilies.end(); }

[[noreturn]] void invalid(const std::string& what) { throw ValueError("decoder config: " + what); }

void positive(int64_t v, const char* name) {
  if (v <= 0) invalid(std::string(name) + " must be positive, got " + std::to_string(v));
}

// a·b·…, or ValueError when it overflows or exceeds what a tensor may hold.
int64_t product(std::initializer_list<int64_t> factors) {
  int64_t n = 1;
  for (int64_t f : factors)
    if (__builtin_mul_overflow(n, f, &n) || n > kMaxElements)
      invalid("the sizes are too large (a weight would exceed " + std::to_string(kMaxElements) + " elements)");
  return n;
}

}  // namespace

const std::vector<std::string>& decoder_families() { return kFamilies; }

void DecoderConfig::validate() const {
  if (!is_family(family)) {
    std::string all;
    for (const auto& f : kFamilies) all += (all.empty() ? "" : ", ") + f;
    invalid("unknown family '" + family + "'; qkv has " + all);
  }
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_layers, "num_hidden_layers");
  if (num_layers > 65536) invalid("num_hidden_layers = " + std::to_string(num_layers) + " is more than qkv takes (65536)");
  positive(num_heads, "num_attention_heads");
  positive(num_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(max_positions, "max_position_embeddings");
  if (num_heads % num_kv_heads != 0) {
    invalid("num_key_value_heads = " + std::to_string(num_kv_heads) + " does not divide num_attention_heads = " +
            std::to_string(num_heads) + " (grouped-query attention shares each K/V head among a whole group)");
  }
  if (!(norm_eps > 0.0 && norm_eps < 1.0)) invalid("the norm epsilon must lie in (0, 1), got " + std::to_string(norm_eps));
  if (!(drop_rate >= 0.0 && drop_rate < 1.0)) invalid("drop_rate must lie in [0, 1)");
  if (!(attention_dropout >= 0.0 && attention_dropout < 1.0)) invalid("attention_dropout must lie in [0, 1)");
  if (!(attention_scale >= 0.0) || !(embedding_scale >= 0.0) || !(attn_softcap >= 0.0) || !std::isfinite(attention_scale) ||
      !std::isfinite(embedding_scale) || !std::isfinite(attn_softcap)) {
    invalid("attention_scale, embedding_scale and attn_softcap must be finite and ≥ 0");
  }
  if (static_cast<int64_t>(layers.size()) != num_layers) {
    invalid(std::to_string(layers.size()) + " layer settings for " + std::to_string(num_layers) + " layers");
  }
  if (learned_positions != ropes.empty()) invalid("a decoder has either learned positions or RoPE frequencies");
  if (!learned_positions && head_dim % 2 != 0) invalid("RoPE needs an even head_dim, got " + std::to_string(head_dim));
  for (const auto& r : ropes) {
    if (!(r.theta > 1.0) || !std::isfinite(r.theta)) invalid("rope_theta must be a finite number above 1, got " + std::to_string(r.theta));
    if (!(r.factor > 0.0) || !std::isfinite(r.factor)) invalid("the RoPE scaling factor must be positive");
    if (r.scaling == RopeFrequencies::Scaling::Llama3 &&
        (!(r.high_freq_factor > r.low_freq_factor) || !(r.low_freq_factor > 0) || !(r.original_max_position_embeddings > 0))) {
      invalid("llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0");
    }
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].window < 0) invalid("layer " + std::to_string(i) + " has a negative sliding window");
    if (!learned_positions && (layers[i].rope < 0 || layers[i].rope >= static_cast<int64_t>(ropes.size())))
      invalid("layer " + std::to_string(i) + " names RoPE " + std::to_string(layers[i].rope) + " of " + std::to_string(ropes.size()));
  }
  for (int64_t id : eos_token_ids)
    if (id < 0 || id >= vocab_size) invalid("eos_token_id " + std::to_string(id) + " is outside the vocabulary");
  if (family == "gpt2" && !(learned_positions && norm == NormKind::LayerNorm && mlp == MlpKind::GELU && o_bias &&
                            mlp_bias && q_width() == hidden_size && num_kv_heads == num_heads && !qk_norm && !sandwich_norms)) {
    invalid("the gpt2 family is learned positions, LayerNorm, a GELU MLP with biases and full multi-head attention");
  }
  if (family != "gpt2" && norm == NormKind::LayerNorm) invalid("family " + family + " has no LayerNorm names");
  (void)parameter_count();
}

std::vector<DecoderConfig::Parameter> DecoderConfig::layout() const {
  const int64_t C = hidden_size, F = intermediate_size, Q = q_width(), KV = kv_width(), D = head_dim, V = vocab_size;
  product({V, C});
  product({max_positions, C});
  product({std::max(Q, KV), C});
  product({F, C});
  std::vector<Parameter> out;
  auto add = [&](std::string name, Shape shape, Role role, int64_t layer = -1) {
    out.push_back({std::move(name), std::move(shape), role, layer});
  };
  if (family == "gpt2") {  // the book's names (chapter 4's GPTModel), in its registration order
    add("tok_emb.weight", {V, C}, Role::TokenEmbedding);
    add("pos_emb.weight", {max_positions, C}, Role::PositionEmbedding);
    for (int64_t i = 0; i < num_layers; ++i) {
      const std::string b = "trf_blocks." + std::to_string(i) + ".";
      const std::pair<const char*, std::pair<Role, Role>> qkv[] = {{"W_query", {Role::Query, Role::QueryBias}},
                                                                  {"W_key", {Role::Key, Role::KeyBias}},
                                                                  {"W_value", {Role::Value, Role::ValueBias}}};
      for (const auto& [w, roles] : qkv) {
        add(b + "att." + w + ".weight", {C, C}, roles.first, i);
        if (qkv_bias) add(b + "att." + w + ".bias", {C}, roles.second, i);
      }
      add(b + "att.out_proj.weight", {C, C}, Role::Output, i);
      add(b + "att.out_proj.bias", {C}, Role::OutputBias, i);
      add(b + "ff.layers.0.weight", {F, C}, Role::Up, i);
      add(b + "ff.layers.0.bias", {F}, Role::UpBias, i);
      add(b + "ff.layers.2.weight", {C, F}, Role::Down, i);
      add(b + "ff.layers.2.bias", {C}, Role::DownBias, i);
      add(b + "norm1.scale", {C}, Role::AttnNorm, i);
      add(b + "norm1.shift", {C}, Role::AttnNormBias, i);
      add(b + "norm2.scale", {C}, Role::MlpNorm, i);
      add(b + "norm2.shift", {C}, Role::MlpNormBias, i);
    }
    add("final_norm.scale", {C}, Role::FinalNorm);
    add("final_norm.shift", {C}, Role::FinalNormBias);
    if (!tie_word_embeddings) add("out_head.weight", {V, C}, Role::Head);
    return out;
  }
  // Hugging Face's names (LlamaForCausalLM, Qwen2/Qwen3ForCausalLM, Gemma3ForCausalLM), in their registration order:
  // per layer self_attn (q, k, v, o, then q_norm, k_norm), mlp (gate, up, down), then the norms.
  add("model.embed_tokens.weight", {V, C}, Role::TokenEmbedding);
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string b = "model.layers." + std::to_string(i) + ".";
    add(b + "self_attn.q_proj.weight", {Q, C}, Role::Query, i);
    if (qkv_bias) add(b + "self_attn.q_proj.bias", {Q}, Role::QueryBias, i);
    add(b + "self_attn.k_proj.weight", {KV, C}, Role::Key, i);
    if (qkv_bias) add(b + "self_attn.k_proj.bias", {KV}, Role::KeyBias, i);
    add(b + "self_attn.v_proj.weight", {KV, C}, Role::Value, i);
    if (qkv_bias) add(b + "self_attn.v_proj.bias", {KV}, Role::ValueBias, i);
    add(b + "self_attn.o_proj.weight", {C, Q}, Role::Output, i);
    if (o_bias) add(b + "self_attn.o_proj.bias", {C}, Role::OutputBias, i);
    if (qk_norm) {
      add(b + "self_attn.q_norm.weight", {D}, Role::QueryNorm, i);
      add(b + "self_attn.k_norm.weight", {D}, Role::KeyNorm, i);
    }
    if (mlp != MlpKind::GELU) {
      add(b + "mlp.gate_proj.weight", {F, C}, Role::Gate, i);
      if (mlp_bias) add(b + "mlp.gate_proj.bias", {F}, Role::GateBias, i);
    }
    add(b + "mlp.up_proj.weight", {F, C}, Role::Up, i);
    if (mlp_bias) add(b + "mlp.up_proj.bias", {F}, Role::UpBias, i);
    add(b + "mlp.down_proj.weight", {C, F}, Role::Down, i);
    if (mlp_bias) add(b + "mlp.down_proj.bias", {C}, Role::DownBias, i);
    add(b + "input_layernorm.weight", {C}, Role::AttnNorm, i);
    if (sandwich_norms) {  // Gemma 3: post_attention_layernorm is the norm after attention; a pre-MLP norm follows
      add(b + "post_attention_layernorm.weight", {C}, Role::PostAttnNorm, i);
      add(b + "pre_feedforward_layernorm.weight", {C}, Role::MlpNorm, i);
      add(b + "post_feedforward_layernorm.weight", {C}, Role::PostMlpNorm, i);
    } else {  // Llama, Qwen: post_attention_layernorm is the norm before the MLP
      add(b + "post_attention_layernorm.weight", {C}, Role::MlpNorm, i);
    }
  }
  add("model.norm.weight", {C}, Role::FinalNorm);
  if (!tie_word_embeddings) add("lm_head.weight", {V, C}, Role::Head);
  return out;
}

int64_t DecoderConfig::parameter_count() const {
  int64_t total = 0;
  for (const Parameter& p : layout())
    if (__builtin_add_overflow(total, p.shape.numel(), &total) || total > kMaxElements)
      invalid(std::to_string(num_layers) + " layers of hidden_size " + std::to_string(hidden_size) +
              " are more parameters than any machine holds");
  return total;
}

// ---- the module ----

namespace {

Tensor* slot(DecoderBlock& b, Role role) {
  switch (role) {
    case Role::AttnNorm: return &b.attn_norm;
    case Role::AttnNormBias: return &b.attn_norm_bias;
    case Role::Query: return &b.wq;
    case Role::QueryBias: return &b.bq;
    case Role::Key: return &b.wk;
    case Role::KeyBias: return &b.bk;
    case Role::Value: return &b.wv;
    case Role::ValueBias: return &b.bv;
    case Role::Output: return &b.wo;
    case Role::OutputBias: return &b.bo;
    case Role::QueryNorm: return &b.q_norm;
    case Role::KeyNorm: return &b.k_norm;
    case Role::PostAttnNorm: return &b.post_attn_norm;
    case Role::MlpNorm: return &b.mlp_norm;
    case Role::MlpNormBias: return &b.mlp_norm_bias;
    case Role::PostMlpNorm: return &b.post_mlp_norm;
    case Role::Gate: return &b.gate;
    case Role::GateBias: return &b.gate_bias;
    case Role::Up: return &b.up;
    case Role::UpBias: return &b.up_bias;
    case Role::Down: return &b.down;
    case Role::DownBias: return &b.down_bias;
    default: return nullptr;
  }
}

bool is_norm(Role r) {
  return r == Role::AttnNorm || r == Role::MlpNorm || r == Role::PostAttnNorm || r == Role::PostMlpNorm ||
         r == Role::FinalNorm || r == Role::QueryNorm || r == Role::KeyNorm;
}
bool is_bias(Role r) {
  return r == Role::AttnNormBias || r == Role::MlpNormBias || r == Role::FinalNormBias || r == Role::QueryBias ||
         r == Role::KeyBias || r == Role::ValueBias || r == Role::OutputBias || r == Role::GateBias ||
         r == Role::UpBias || r == Role::DownBias;
}

}  // namespace

// The rotation tables, built on first use for the positions asked and regrown by doubling: a model with 128 Ki
// positions need not hold 128 Ki × head_dim cosines to run 100 tokens.
struct RopeTables {
  std::mutex mutex;
  std::vector<std::vector<float>> inverse_frequencies;
  std::vector<std::shared_ptr<const RopeTable>> tables;
};

Decoder::Decoder(const DecoderConfig& c, Generator& gen) : Decoder(c, &gen) {}

std::unique_ptr<Decoder> Decoder::uninitialised(const DecoderConfig& config, uint64_t seed) {
  auto generator = std::make_shared<Generator>(Generator::drawing_nothing(seed));
  std::unique_ptr<Decoder> model(new Decoder(config, generator.get()));
  generator->set_drawing(true);
  model->owned_generator_ = std::move(generator);
  return model;
}

std::unique_ptr<Decoder> Decoder::for_loading(const DecoderConfig& config) {
  auto generator = std::make_shared<Generator>(0);
  std::unique_ptr<Decoder> model(new Decoder(config, generator.get(), false));
  model->owned_generator_ = std::move(generator);
  return model;
}

Decoder::Decoder(const DecoderConfig& c, Generator* gen, bool fill) : config((c.validate(), c)), gen_(gen) {
  blocks.resize(static_cast<size_t>(c.num_layers));
  const float norm_identity = c.norm == NormKind::GemmaRMSNorm ? 0.0f : 1.0f;
  // Each layer's W_q, W_k, W_v (and their biases) live back to back in one buffer, so one product reads all three
  // in place (linear_concat).
  std::vector<Tensor> qkv_home(blocks.size()), qkv_bias_home(blocks.size());
  const int64_t qkv_rows = c.q_width() + 2 * c.kv_width();
  auto make = [fill](const Shape& shape) { return fill ? Tensor::zeros(shape) : Tensor::empty(shape); };
  // gpt2: torch.nn.Embedding and torch.nn.Linear's initialisation, in the book's order (the layout's): a Linear's
  // weight, then its bias uniform in ±1/√(its fan-in).
  const bool book = c.family == "gpt2";
  int64_t fan_in = 0;
  auto book_draw = [&](const DecoderConfig::Parameter& p, Tensor& t) {
    if (p.role == Role::TokenEmbedding || p.role == Role::PositionEmbedding) {
      gen->normal_(t, 0.0, 1.0);
    } else if (p.shape.rank() == 2) {
      kaiming_uniform_(t, std::sqrt(5.0), *gen);
      fan_in = p.shape[1];
    } else if (is_bias(p.role) && p.role != Role::AttnNormBias && p.role != Role::MlpNormBias &&
               p.role != Role::FinalNormBias) {  // a Linear's bias; a LayerNorm's shift stays 0
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      gen->uniform_(t, -bound, bound);
    }
  };
  for (size_t i = 0; i < blocks.size(); ++i) {
    qkv_home[i] = make({qkv_rows, c.hidden_size});
    if (c.qkv_bias) qkv_bias_home[i] = make({qkv_rows});
  }
  for (const DecoderConfig::Parameter& p : c.layout()) {
    Tensor t;
    const bool in_qkv = p.role == Role::Query || p.role == Role::Key || p.role == Role::Value ||
                        p.role == Role::QueryBias || p.role == Role::KeyBias || p.role == Role::ValueBias;
    if (in_qkv) {
      const bool bias = is_bias(p.role);
      const int64_t row0 = p.role == Role::Query || p.role == Role::QueryBias ? 0
                           : p.role == Role::Key || p.role == Role::KeyBias   ? c.q_width()
                                                                              : c.q_width() + c.kv_width();
      const Tensor& home = bias ? qkv_bias_home[static_cast<size_t>(p.layer)] : qkv_home[static_cast<size_t>(p.layer)];
      t = home.view_at(row0 * (bias ? 1 : c.hidden_size), p.shape);
    } else {
      t = make(p.shape);
    }
    if (!fill) {
    } else if (is_norm(p.role)) {
      t.fill_(norm_identity);
    } else if (book) {
      book_draw(p, t);
    } else if (!is_bias(p.role)) {
      gen->normal_(t, 0.0, 0.02);
    }
    // The book's MultiHeadAttention keeps its causal mask as a buffer: its state dict (and .pth files) name one per
    // block, recomputed here rather than stored.
    if (book && p.role == Role::Query)
      register_derived_buffer(block_prefix(p.layer) + "att.mask", Shape{c.max_positions, c.max_positions},
                              [n = c.max_positions] { return causal_mask(n); });
    Tensor& registered = register_parameter(p.name, t);
    if (p.layer >= 0) {
      *slot(blocks[static_cast<size_t>(p.layer)], p.role) = registered;
      continue;
    }
    switch (p.role) {
      case Role::TokenEmbedding: tok_emb = registered; break;
      case Role::PositionEmbedding: pos_emb = registered; break;
      case Role::FinalNorm: final_norm = registered; break;
      case Role::FinalNormBias: final_norm_bias = registered; break;
      case Role::Head: head = registered; break;
      default: break;
    }
  }
  if (c.tie_word_embeddings) {
    head = tok_emb;
    // The book's GPTModel draws its out_head before tying it: the draws that follow (dropout) stay the same.
    if (book && fill && gen->draws()) {
      Tensor discarded = Tensor::empty({c.vocab_size, c.hidden_size});
      kaiming_uniform_(discarded, std::sqrt(5.0), *gen);
    }
  }
  auto ropes = std::make_shared<RopeTables>();
  for (const auto& r : c.ropes) {
    ropes->inverse_frequencies.push_back(r.inverse_frequencies(c.head_dim));
    ropes->tables.emplace_back();
  }
  rope_tables_ = std::move(ropes);
}

std::vector<LoraSite> Decoder::own_lora_sites() {
  std::vector<LoraSite> out;
  for (const DecoderConfig::Parameter& p : config.layout()) {
    if (p.layer < 0) continue;
    DecoderBlock& b = blocks[static_cast<size_t>(p.layer)];
    LoraWeights* lora = p.role == Role::Query ? &b.lora_q : p.role == Role::Key ? &b.lora_k : p.role == Role::Value ? &b.lora_v
                        : p.role == Role::Output ? &b.lora_o : p.role == Role::Gate ? &b.lora_gate : p.role == Role::Up ? &b.lora_up
                        : p.role == Role::Down ? &b.lora_down : nullptr;
    if (!lora) continue;
    const std::string name = p.name.substr(0, p.name.size() - std::string(".weight").size());
    out.push_back({name, *slot(b, p.role), lora, this, name + "."});
  }
  return out;
}

std::string Decoder::block_prefix(int64_t layer) const {
  return (config.family == "gpt2" ? "trf_blocks." : "model.layers.") + std::to_string(layer) + ".";
}
std::string Decoder::final_norm_prefix() const { return config.family == "gpt2" ? "final_norm." : "model.norm."; }
std::string Decoder::head_prefix() const {
  if (config.tie_word_embeddings) return config.family == "gpt2" ? "tok_emb." : "model.embed_tokens.";
  return config.family == "gpt2" ? "out_head." : "lm_head.";
}

Tensor& Decoder::parameter(Role role, int64_t layer) {
  Tensor* t = nullptr;
  if (layer >= 0 && layer < config.num_layers) {
    t = slot(blocks[static_cast<size_t>(layer)], role);
  } else if (layer < 0) {
    switch (role) {
      case Role::TokenEmbedding: t = &tok_emb; break;
      case Role::PositionEmbedding: t = &pos_emb; break;
      case Role::FinalNorm: t = &final_norm; break;
      case Role::FinalNormBias: t = &final_norm_bias; break;
      case Role::Head: t = &head; break;
      default: break;
    }
  }
  if (!t || !t->defined()) throw ValueError("Decoder: this " + config.family + " model has no such parameter");
  return *t;
}

std::shared_ptr<const RopeTable> Decoder::rope_table(int64_t which, int64_t positions) const {
  std::lock_guard<std::mutex> lock(rope_tables_->mutex);
  auto& table = rope_tables_->tables[static_cast<size_t>(which)];
  if (!table || table->positions < positions) {
    const int64_t grown = std::min(config.max_positions, std::max<int64_t>(positions, table ? 2 * table->positions : 1024));
    table = std::make_shared<const RopeTable>(
        RopeTable::make(rope_tables_->inverse_frequencies[static_cast<size_t>(which)], std::max(grown, positions)));
  }
  return table;
}

// ---- forward ----

Tensor Decoder::norm(const Tensor& x, const Tensor& weight, const Tensor& bias) const {
  const float eps = static_cast<float>(config.norm_eps);
  switch (config.norm) {
    case NormKind::LayerNorm: return layer_norm(x, weight, bias, eps);
    case NormKind::RMSNorm: return rms_norm(x, weight, eps);
    case NormKind::GemmaRMSNorm: return rms_norm(x, weight, eps, 1.0f);
  }
  return x;
}

Tensor Decoder::embed(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t position) const {
  check_token_batch(ids, batch, tokens, "Decoder");
  if (position + tokens > config.max_positions) {
    throw ShapeError("Decoder: a sequence of " + std::to_string(position + tokens) + " tokens is longer than the " +
                     std::to_string(config.max_positions) +
                     " positions the model has (max_position_embeddings); use at most the last that many tokens");
  }
  Tensor x = embedding(tok_emb, ids, {batch, tokens});
  if (config.embedding_scale > 0.0) x = mul(x, static_cast<float>(config.embedding_scale));
  if (config.learned_positions) {
    std::vector<int64_t> positions(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) positions[static_cast<size_t>(t)] = position + t;
    x = add(x, embedding(pos_emb, positions, {tokens}));
  }
  return hashed_dropout(x, config.drop_rate, is_training(), *gen_);
}

std::vector<Decoder::SparseGradient> Decoder::sparse_gradients(std::span<const int64_t> ids, int64_t tokens) const {
  std::vector<SparseGradient> tables;
  if (!config.tie_word_embeddings) {
    std::vector<int64_t> rows(ids.begin(), ids.end());
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    tables.push_back({tok_emb, std::move(rows)});
  }
  if (config.learned_positions) {
    std::vector<int64_t> rows(static_cast<size_t>(ids.empty() ? 0 : std::min(tokens, config.max_positions)));
    std::iota(rows.begin(), rows.end(), int64_t{0});
    tables.push_back({pos_emb, std::move(rows)});
  }
  return tables;
}

namespace {

// A (B, T, heads·D) tensor with RMSNorm over each head's D values.
Tensor head_norm(const Tensor& x, int64_t heads, const Tensor& weight, float eps, float offset) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2) / heads;
  return reshape(rms_norm(reshape(x, {B, T, heads, D}), weight, eps, offset), {B, T, heads * D});
}

// Appends (B, T, W) rows to one layer's cache buffers, which hold `filled` rows; a sliding-window layer's buffer
// keeps only its last window − 1 rows when the new ones would not fit. Returns the rows now filled.
int64_t append_to_cache(KVCacheLayer& cache, int64_t filled, int64_t window, const Tensor& keys, const Tensor& values) {
  const int64_t B = keys.size(0), T = keys.size(1), W = keys.size(2), capacity = cache.keys.size(1);
  if (filled + T > capacity) {
    if (window <= 0) {
      throw ShapeError("Decoder: " + std::to_string(filled + T) + " tokens exceed the KV cache's " +
                       std::to_string(capacity) + "; make the cache for more tokens");
    }
    const int64_t keep = std::min(filled, window - 1);
    if (keep + T > capacity) throw ShapeError("Decoder: a chunk of " + std::to_string(T) + " tokens exceeds the sliding-window cache");
    for (Tensor* buffer : {&cache.keys, &cache.values}) {
      const bool bf16 = buffer->dtype() == DType::BF16;  // a bf16 cache: 2 bytes a value
      char* base = bf16 ? reinterpret_cast<char*>(buffer->bf16_data()) : reinterpret_cast<char*>(buffer->data());
      const size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
      for (int64_t b = 0; b < B; ++b) {
        char* row0 = base + static_cast<size_t>(b * capacity * W) * size;
        std::memmove(row0, row0 + static_cast<size_t>((filled - keep) * W) * size, static_cast<size_t>(keep * W) * size);
      }
    }
    filled = keep;
  }
  write_tokens(keys, cache.keys, filled);
  write_tokens(values, cache.values, filled);
  return filled + T;
}

}  // namespace

Tensor Decoder::attend(size_t i, const Tensor& x, int64_t position, KVCache* cache, AttentionStep::Record* record) const {
  const DecoderBlock& b = blocks[i];
  const DecoderLayerSettings& layer = config.layers[i];
  const int64_t H = config.num_heads, H_kv = config.num_kv_heads, B = x.size(0), T = x.size(1);
  const float norm_offset = config.norm == NormKind::GemmaRMSNorm ? 1.0f : 0.0f;
  const float eps = static_cast<float>(config.norm_eps);
  AttentionConfig attention;
  attention.num_heads = H;
  attention.num_kv_heads = H_kv;
  attention.causal = true;
  attention.window = layer.window;
  attention.scale = static_cast<float>(config.attention_scale);
  attention.softcap = static_cast<float>(config.attn_softcap);
  attention.dropout_p = config.attention_dropout;
  attention.training = is_training();
  attention.generator = gen_;
  const std::vector<Tensor> weights = {b.wq, b.wk, b.wv};
  const std::vector<Tensor> biases = b.bq.defined() ? std::vector<Tensor>{b.bq, b.bk, b.bv} : std::vector<Tensor>{};
  Tensor context;
  const std::vector<LowRankUpdate> updates = b.lora_q.defined() || b.lora_k.defined() || b.lora_v.defined()
                                                  ? std::vector<LowRankUpdate>{b.lora_q, b.lora_k, b.lora_v}
                                                  : std::vector<LowRankUpdate>{};
  if (!cache && !record && !config.qk_norm) {
    // Training and plain inference: one product for Q, K and V (LoRA updates in their columns), rotated in place of a
    // copy and read by the kernel with strides; its gradient comes back as one tensor for one backward product.
    Tensor packed = linear_concat(x, weights, biases, updates);
    if (!config.learned_positions)
      packed = rope(packed, rope_table(layer.rope, position + T), config.rope_layout, H + 2 * H_kv, position, H + H_kv);
    context = scaled_dot_product_attention(packed, attention);
  } else {
    Tensor q = linear_with_lora(x, b.wq, b.bq, b.lora_q), k = linear_with_lora(x, b.wk, b.bk, b.lora_k),
           v = linear_with_lora(x, b.wv, b.bv, b.lora_v);
    if (config.qk_norm) {
      q = head_norm(q, H, b.q_norm, eps, norm_offset);
      k = head_norm(k, H_kv, b.k_norm, eps, norm_offset);
    }
    if (!config.learned_positions) {
      const auto table = rope_table(layer.rope, position + T);
      q = rope(q, table, config.rope_layout, H, position);
      k = rope(k, table, config.rope_layout, H_kv, position);
    }
    Tensor keys = k, values = v;
    if (cache) {
      NoGradGuard no_grad;
      KVCacheLayer& layer_cache = cache->layers[i];
      int64_t& filled = cache->filled[i];
      filled = append_to_cache(layer_cache, filled, layer.window, k, v);
      keys = layer_cache.keys;
      values = layer_cache.values;
      attention.kv_tokens = filled;
    }
    Tensor lse;
    if (record) attention.lse = &lse;
    context = scaled_dot_product_attention(q, keys, values, attention);
    if (record) {
      record->queries = q.detach();
      record->keys = keys.detach();
      record->kv_tokens = attention.kv_tokens > 0 ? attention.kv_tokens : keys.size(1);
      record->lse = lse;
    }
  }
  (void)B;
  return linear_with_lora(context, b.wo, b.bo, b.lora_o);
}

Tensor Decoder::mlp(const DecoderBlock& b, const Tensor& x) const {
  switch (config.mlp) {
    case MlpKind::GELU:
      return linear_with_lora(gelu(linear_with_lora(x, b.up, b.up_bias, b.lora_up)), b.down, b.down_bias, b.lora_down);
    case MlpKind::SwiGLU:
      return linear_with_lora(mul(silu(linear_with_lora(x, b.gate, b.gate_bias, b.lora_gate)), linear_with_lora(x, b.up, b.up_bias, b.lora_up)),
                              b.down, b.down_bias, b.lora_down);
    case MlpKind::GeGLU:
      return linear_with_lora(mul(gelu(linear_with_lora(x, b.gate, b.gate_bias, b.lora_gate)), linear_with_lora(x, b.up, b.up_bias, b.lora_up)),
                              b.down, b.down_bias, b.lora_down);
  }
  return x;
}

Tensor Decoder::block_forward(size_t i, const Tensor& x, int64_t position, KVCache* cache,
                              AttentionStep::Record* record) const {
  const DecoderBlock& b = blocks[i];
  Tensor a = attend(i, norm(x, b.attn_norm, b.attn_norm_bias), position, cache, record);
  if (config.sandwich_norms) a = norm(a, b.post_attn_norm, Tensor());
  const Tensor h = add(x, hashed_dropout(a, config.drop_rate, is_training(), *gen_));
  Tensor m = mlp(b, norm(h, b.mlp_norm, b.mlp_norm_bias));
  if (config.sandwich_norms) m = norm(m, b.post_mlp_norm, Tensor());
  return add(h, hashed_dropout(m, config.drop_rate, is_training(), *gen_));
}

Tensor Decoder::hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                       std::vector<AttentionStep::Record>* records) const {
  Tensor x = embed(ids, batch, tokens, 0);
  if (records) records->assign(blocks.size(), {});
  for (size_t i = 0; i < blocks.size(); ++i) x = block_forward(i, x, 0, nullptr, records ? &(*records)[i] : nullptr);
  return norm(x, final_norm, final_norm_bias);
}

Tensor Decoder::residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const {
  if (layer < 0 || layer > config.num_layers) throw ValueError("Decoder: no block " + std::to_string(layer));
  Tensor x = embed(ids, batch, tokens, 0);
  for (int64_t i = 0; i < layer; ++i) x = block_forward(static_cast<size_t>(i), x, 0, nullptr, nullptr);
  return x;
}

Tensor Decoder::hidden_from(const Tensor& residual, int64_t layer) const {
  if (layer < 0 || layer > config.num_layers) throw ValueError("Decoder: no block " + std::to_string(layer));
  Tensor x = residual;
  for (int64_t i = layer; i < config.num_layers; ++i) x = block_forward(static_cast<size_t>(i), x, 0, nullptr, nullptr);
  return norm(x, final_norm, final_norm_bias);
}

Tensor Decoder::forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                        std::vector<AttentionStep::Record>* records) const {
  return linear(hidden(ids, batch, tokens, records), head, Tensor());
}

Tensor Decoder::loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
                     int64_t ignore_index) const {
  if (static_cast<int64_t>(targets.size()) != batch * tokens) {
    throw ShapeError("Decoder::loss: " + std::to_string(targets.size()) + " targets for " + std::to_string(batch) +
                     " × " + std::to_string(tokens) + " tokens");
  }
  return linear_cross_entropy(hidden(ids, batch, tokens, nullptr), head, Tensor(), targets, ignore_index);
}

Tensor Decoder::weights(int64_t layer, const AttentionStep::Record& record, int64_t b, int64_t h) const {
  if (!record.lse.defined()) throw ValueError("Decoder::weights: the record is empty; run forward with it first");
  AttentionConfig attention;
  attention.num_heads = config.num_heads;
  attention.num_kv_heads = config.num_kv_heads;
  attention.causal = true;
  attention.window = config.layers[static_cast<size_t>(layer)].window;
  attention.scale = static_cast<float>(config.attention_scale);
  attention.softcap = static_cast<float>(config.attn_softcap);
  attention.kv_tokens = record.kv_tokens;
  return attention_weights(record.queries, record.keys, record.lse, attention, b, h);
}

Tensor Decoder::attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers, std::vector<int64_t> heads) const {
  NoGradGuard no_grad;
  const int64_t T = static_cast<int64_t>(ids.size());
  Tensor x = embed(ids, 1, T, 0);
  return gather_attention_maps(
      config.num_layers, config.num_heads, T, std::move(layers), std::move(heads),
      [&](int64_t i, AttentionStep::Record& record) { x = block_forward(static_cast<size_t>(i), x, 0, nullptr, &record); },
      [&](int64_t l, const AttentionStep::Record& record, int64_t h) { return weights(l, record, 0, h); });
}

KVCache Decoder::make_cache(int64_t batch, int64_t max_tokens) const {
  require_positive(batch, "Decoder::make_cache", "batch");
  if (max_tokens < 0 || max_tokens > config.max_positions) {
    throw ShapeError("Decoder::make_cache: " + std::to_string(max_tokens) + " positions, but the model has " +
                     std::to_string(config.max_positions));
  }
  KVCache cache;
  cache.batch = batch;
  cache.capacity = max_tokens > 0 ? max_tokens : config.max_positions;
  for (const DecoderLayerSettings& layer : config.layers) {
    const int64_t rows =
        layer.window > 0 ? std::min(cache.capacity, layer.window - 1 + kCacheChunk) : cache.capacity;
    product({batch, rows, config.kv_width()});
    cache.layers.push_back(KVCacheLayer::make(batch, rows, config.kv_width()));
    cache.filled.push_back(0);
  }
  return cache;
}

// The same computation as forward() for the new positions only, in chunks of at most kCacheChunk tokens: every
// block appends their keys and values to its cache layer and attends over what it holds.
Tensor Decoder::forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const {
  NoGradGuard no_grad;
  if (batch != cache.batch || cache.layers.size() != blocks.size()) {
    throw ShapeError("Decoder::forward_cached: a batch of " + std::to_string(batch) + " rows for a cache made for " +
                     std::to_string(cache.batch) + " (or for another model)");
  }
  check_token_batch(ids, batch, tokens, "Decoder");
  if (cache.length + tokens > cache.capacity) {
    throw ShapeError("Decoder: " + std::to_string(cache.length + tokens) + " tokens exceed the KV cache's " +
                     std::to_string(cache.capacity) + " positions; make the cache for more tokens");
  }
  Tensor x;
  for (int64_t t0 = 0; t0 < tokens; t0 += kCacheChunk) {
    const int64_t n = std::min(kCacheChunk, tokens - t0);
    std::vector<int64_t> chunk;
    chunk.reserve(static_cast<size_t>(batch * n));
    for (int64_t b = 0; b < batch; ++b)
      chunk.insert(chunk.end(), ids.begin() + b * tokens + t0, ids.begin() + b * tokens + t0 + n);
    x = embed(chunk, batch, n, cache.length);
    for (size_t i = 0; i < blocks.size(); ++i) x = block_forward(i, x, cache.length, &cache, nullptr);
    cache.length += n;
  }
  return linear(norm(select_token(x, x.size(1) - 1), final_norm, final_norm_bias), head, Tensor());
}

}  // namespace qkv::nn
