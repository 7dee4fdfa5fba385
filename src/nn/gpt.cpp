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
  const bool book = attention == "book";
  if (!book && attention != "mha" && attention != "gqa" && attention != "mla" && attention != "deltanet-hybrid")
    throw ValueError("GPTConfig: attention = \"" + attention + "\"; use book, mha, gqa, mla or deltanet-hybrid");
  if (experts < 0 || experts > 1024) throw ValueError("GPTConfig: experts must lie in 0…1024 (0: a dense MLP)");
  if (experts > 0 && (experts_per_token < 1 || experts_per_token > experts))
    throw ValueError("GPTConfig: experts_per_token = " + std::to_string(experts_per_token) + " must lie in 1…experts (" +
                     std::to_string(experts) + ")");
  if (book && experts > 0)
    throw ValueError("GPTConfig: experts are built into today's decoder; choose an attention (--attention mha, gqa, mla "
                     "or deltanet-hybrid) to go with them");
  if (!book && qkv_bias) throw ValueError("GPTConfig: qkv_bias is the book's GPT's; today's decoders here have no biases");
  if (attention == "mla" && (emb_dim / n_heads) % 4 != 0)
    throw ValueError("GPTConfig: mla rotates half of each head's " + std::to_string(emb_dim / n_heads) +
                     " values in pairs; choose emb_dim / n_heads a multiple of 4");
  (void)parameter_count();  // overflow, or beyond any machine, is a ValueError here
}

namespace {
// Today's decoder of the book's widths with `attention` (GPTConfig::attention): see gpt.hpp
DecoderConfig todays_decoder(const GPTConfig& g) {
  DecoderConfig c;
  const std::string& a = g.attention;
  const bool experts = g.experts > 0;
  c.family = &family(a == "mla" ? "deepseek_v3" : a == "deltanet-hybrid" ? "qwen3_next" : experts ? "qwen3_moe" : "qwen3");
  c.norm = c.family->norm;
  c.placement = c.family->placement;
  c.qk_norm = a == "mla" ? QkNorm::None : c.family->qk_norm;
  c.mlp = MlpKind::SwiGLU;
  c.vocab_size = g.vocab_size;
  c.hidden_size = g.emb_dim;
  c.num_layers = g.n_layers;
  c.num_heads = c.num_kv_heads = g.n_heads;
  c.head_dim = g.n_heads > 0 ? g.emb_dim / g.n_heads : 0;
  c.max_positions = g.context_length;
  c.norm_eps = 1e-6;
  c.tie_word_embeddings = g.tie_weights;
  c.drop_rate = c.attention_dropout = g.drop_rate;
  c.layers.assign(static_cast<size_t>(std::max<int64_t>(std::min<int64_t>(g.n_layers, 65536), 0)), {});
  // SwiGLU of 8·C/3 (to a multiple of 8): its three matrices hold what GELU's two of 4·C do
  int64_t eight = 0;
  if (__builtin_mul_overflow(g.emb_dim, int64_t{8}, &eight)) eight = 3 * (kMaxElements + 1);
  c.intermediate_size = (eight / 3 + 7) / 8 * 8;
  RopeFrequencies rope;
  rope.theta = 10000.0;
  if (a == "gqa") c.num_kv_heads = g.n_heads % 4 == 0 ? g.n_heads / 4 : g.n_heads % 2 == 0 ? g.n_heads / 2 : 1;
  if (a == "mla") {  // the book's MLA bonus: a latent of C/2; half of each head rotated, shared by all heads
    const int64_t d = c.head_dim;
    c.kv_lora_rank = g.emb_dim / 2;
    c.qk_nope_head_dim = d;
    c.v_head_dim = d;
    c.head_dim = d / 2;  // what RoPE rotates (qk_rope_head_dim)
  }
  if (a == "deltanet-hybrid") {  // Qwen3-Next's pattern: every fourth layer (and the last) attention
    c.gated_attention = true;
    c.linear_value_heads = g.n_heads;
    c.linear_key_heads = g.n_heads % 2 == 0 ? g.n_heads / 2 : g.n_heads;
    c.linear_key_dim = c.linear_value_dim = c.head_dim;
    c.linear_conv_kernel = 4;
    for (size_t i = 0; i < c.layers.size(); ++i) c.layers[i].linear = (i + 1) % 4 != 0 && i + 1 != c.layers.size();
    rope.rotary_dim = std::max<int64_t>(2, c.head_dim / 4 / 2 * 2);  // a quarter of each head
    if (rope.rotary_dim >= c.head_dim) rope.rotary_dim = 0;
  }
  c.ropes = {rope};
  if (experts) {
    c.num_experts = g.experts;
    c.experts_per_token = g.experts_per_token;
    c.expert_intermediate_size = std::max<int64_t>(1, c.intermediate_size / g.experts);
    c.norm_topk_prob = true;
    c.router_aux_loss_coef = 0.01;
    for (auto& l : c.layers) l.experts = true;
    if (a == "deltanet-hybrid") {  // and Qwen3-Next's gated shared expert, as wide as one expert
      c.shared_expert_intermediate_size = c.expert_intermediate_size;
      c.shared_expert_gate = true;
    }
  }
  return c;
}
}  // namespace

DecoderConfig GPTConfig::decoder_config() const {
  if (attention != "book") return todays_decoder(*this);
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
  GPTConfig c;
  c.vocab_size = d.vocab_size;
  c.context_length = d.max_positions;
  c.emb_dim = d.hidden_size;
  c.n_heads = d.num_heads;
  c.n_layers = d.num_layers;
  c.drop_rate = d.drop_rate;
  c.tie_weights = d.tie_word_embeddings;
  if (d.family->naming == Naming::Book) {
    c.qkv_bias = d.qkv_bias;
    return c;
  }
  // A model qkv train built with --attention, or none of its: the settings that would build it, if they build it
  c.attention = d.latent() ? "mla" : d.has_linear_layers() ? "deltanet-hybrid" : d.num_kv_heads < d.num_heads ? "gqa" : "mha";
  c.experts = d.num_experts;
  if (d.num_experts > 0) c.experts_per_token = d.experts_per_token;
  bool same = false;
  try {
    DecoderConfig back = c.decoder_config();
    back.source = d.source;  // what a folder's config.json adds beside the architecture
    back.eos_token_ids = d.eos_token_ids;
    back.bos_token_id = d.bos_token_id;
    back.pad_token_id = d.pad_token_id;
    same = back == d;
  } catch (const ValueError&) {
  }
  if (!same)
    throw ValueError("GPTConfig: this " + d.family->name + " model is not the book's GPTModel (family gpt2) nor one "
                     "qkv train builds with --attention");
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

namespace {
// A setting added after checkpoints were written without it: what its absence in one means
Setting<GPTConfig> absent_means(const char* value, Setting<GPTConfig> s) {
  s.absent = value;
  return s;
}
}  // namespace

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
      absent_means("book", field("attention", "--attention",
                                 "book (the book's GPT), or today's decoder (RMSNorm, RoPE, SwiGLU) with mha, gqa, mla "
                                 "or deltanet-hybrid attention",
                                 &GPTConfig::attention)),
      absent_means("0", field("experts", "--experts", "Mixture-of-experts MLPs of this many experts (0: dense; with an "
                                                       "--attention other than book)", &GPTConfig::experts)),
      absent_means("2", field("experts_per_token", "--experts-per-token", "Experts each token goes through",
                              &GPTConfig::experts_per_token)),
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
