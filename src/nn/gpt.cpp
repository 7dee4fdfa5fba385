// The book's GPT configuration (see qkv/nn/gpt.hpp) and the decoder built from it.
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
  c.family = &family("gpt2");
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
  c.drop_rate = c.attention_dropout = drop_rate;
  c.layers.assign(static_cast<size_t>(std::max<int64_t>(std::min<int64_t>(n_layers, 65536), 0)), {});
  // 4·C, or the overflow the table's size checks report
  if (__builtin_mul_overflow(emb_dim, int64_t{4}, &c.intermediate_size)) c.intermediate_size = kMaxElements + 1;
  return c;
}

GPTConfig GPTConfig::of(const DecoderConfig& d) {
  if (d.family->naming != Naming::Book)
    throw ValueError("GPTConfig: a " + d.family->name + " model is not the book's GPTModel (family gpt2)");
  GPTConfig c;
  c.vocab_size = d.vocab_size;
  c.context_length = d.max_positions;
  c.emb_dim = d.hidden_size;
  c.n_heads = d.num_heads;
  c.n_layers = d.num_layers;
  c.drop_rate = d.drop_rate;
  c.qkv_bias = d.qkv_bias;
  c.tie_weights = d.tie_word_embeddings;
  return c;
}

Decoder::Decoder(const GPTConfig& config, Generator& gen) : Decoder(config.validated().decoder_config(), gen) {}

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

}  // namespace qkv::nn
