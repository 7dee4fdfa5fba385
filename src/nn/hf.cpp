// Hugging Face folders (see qkv/nn/hf.hpp): config.json per family, safetensors shards, and writing both.
// The specification of each family is its modeling and configuration code in transformers (Llama, Qwen2, Qwen3,
// Gemma 3): which keys exist, their defaults, and which settings change the arithmetic.
#include "qkv/nn/hf.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/core/settings.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/ggml_types.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::nn {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kMaxLayers = 4096;  // far beyond any released model; keeps a hostile config from listing 10⁹ layers

// Typed reads of config.json keys with the file and key in every message.
class Keys {
 public:
  Keys(const json& j, std::string source) : j_(j), source_(std::move(source)) {}
  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw IoError(source_ + ": '" + key + "' " + problem);
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  bool present(const std::string& key) const { return j_.contains(key); }  // even as null
  int64_t integer(const std::string& key) const {
    if (!has(key)) fail(key, "is missing");
    return integer_of(key, j_[key]);
  }
  int64_t integer(const std::string& key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_number()) fail(key, "must be a number, got " + printable(j_[key].dump(), 60));
    const double v = j_[key].get<double>();
    if (!std::isfinite(v)) fail(key, "must be finite");
    return v;
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, "must be true or false, got " + printable(j_[key].dump(), 60));
    return j_[key].get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_string()) fail(key, "must be a string, got " + printable(j_[key].dump(), 60));
    return j_[key].get<std::string>();
  }
  const json& raw(const std::string& key) const { return j_[key]; }
  int64_t integer_of(const std::string& key, const json& v) const {
    if (!v.is_number_integer() && !(v.is_number_float() && v.get<double>() == std::trunc(v.get<double>())))
      fail(key, "must be a whole number, got " + printable(v.dump(), 60));
    const double d = v.get<double>();
    if (!(d >= -9.0e15 && d <= 9.0e15)) fail(key, "is out of range: " + printable(v.dump(), 60));
    return v.get<int64_t>();
  }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
};

// A rotation's settings from config.json: rope_theta and rope_scaling (or transformers 5's rope_parameters), with
// `theta` when config.json has no rope_theta. Without `scaled`, the scaling is left out (a sliding layer's plain RoPE).
RopeFrequencies rope_of(const Keys& keys, const Family& f, double theta, bool scaled, int64_t max_positions) {
  RopeFrequencies r;
  r.theta = keys.number("rope_theta", theta);
  const char* key = keys.has("rope_scaling") ? "rope_scaling" : keys.has("rope_parameters") ? "rope_parameters" : nullptr;
  const json none = json::object();
  const json& s = key ? keys.raw(key) : none;
  if (key && !s.is_object()) keys.fail(key, "must be an object or null");
  const Keys scaling(s, keys.source() + (key ? std::string(" ") + key : std::string()));
  if (scaling.has("rope_theta")) r.theta = scaling.number("rope_theta", r.theta);
  // partial_rotary_factor, in the scaling object or (before transformers 5) at the top level, and the head's size
  auto partial_factor = [&](double fallback) {
    const double partial = scaling.has("partial_rotary_factor") ? scaling.number("partial_rotary_factor", fallback)
                                                                : keys.number("partial_rotary_factor", fallback);
    if (!(partial > 0.0 && partial <= 1.0)) keys.fail("partial_rotary_factor", "must lie in (0, 1]");
    return partial;
  };
  auto head_dim = [&] {
    return keys.integer("head_dim", keys.integer("hidden_size") / std::max<int64_t>(keys.integer("num_attention_heads"), 1));
  };
  // partial rotation (Phi-3, Phi-4-mini): the first int(head_dim · factor) values of each head rotate
  if (f.partial_rotary) {
    const double partial = partial_factor(f.partial_rotary_default);
    if (partial < 1.0) r.rotary_dim = static_cast<int64_t>(static_cast<double>(head_dim()) * partial);
  }
  std::string type = scaling.has("rope_type") ? scaling.string("rope_type", "default") : scaling.string("type", "default");
  if (f.su_yarn_are_longrope && (type == "su" || type == "yarn")) type = "longrope";  // Phi-3's old names
  if (type == "default" || !scaled) return r;
  const std::string where = std::string(key) + ".";
  // Llama 3, YaRN and LongRoPE's original context: in the scaling object, or (Phi-3) a top-level key
  auto original_context = [&] {
    const double top = keys.number("original_max_position_embeddings", static_cast<double>(max_positions));
    const double v = scaling.number("original_max_position_embeddings", top);
    if (!(v >= 1.0)) keys.fail(where + "original_max_position_embeddings", "must be positive");
    return v;
  };
  if (type == "linear") {
    r.scaling = RopeFrequencies::Scaling::Linear;
    r.factor = scaling.number("factor", 1.0);
  } else if (type == "llama3") {
    r.scaling = RopeFrequencies::Scaling::Llama3;
    r.factor = scaling.number("factor", 8.0);
    r.low_freq_factor = scaling.number("low_freq_factor", 1.0);
    r.high_freq_factor = scaling.number("high_freq_factor", 4.0);
    r.original_max_position_embeddings = static_cast<double>(scaling.integer("original_max_position_embeddings", 8192));
  } else if (type == "yarn") {  // transformers' _compute_yarn_parameters (version 5)
    r.scaling = RopeFrequencies::Scaling::Yarn;
    r.original_max_position_embeddings = original_context();
    r.factor = scaling.number("factor", static_cast<double>(max_positions) / r.original_max_position_embeddings);
    r.beta_fast = scaling.number("beta_fast", 32.0);
    r.beta_slow = scaling.number("beta_slow", 1.0);
    r.truncate = scaling.boolean("truncate", true);
    auto mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double m = scaling.number("mscale", 0.0), m_all = scaling.number("mscale_all_dim", 0.0);
    r.attention_factor = scaling.has("attention_factor") ? scaling.number("attention_factor", 1.0)
                         : m != 0.0 && m_all != 0.0   ? mscale(r.factor, m) / mscale(r.factor, m_all)
                                                      : mscale(r.factor, 1.0);
  } else if (type == "longrope") {  // transformers' _compute_longrope_parameters
    r.scaling = RopeFrequencies::Scaling::LongRope;
    r.original_max_position_embeddings = original_context();
    r.factor = scaling.number("factor", static_cast<double>(max_positions) / r.original_max_position_embeddings);
    const double L = r.original_max_position_embeddings;
    r.attention_factor = scaling.has("attention_factor") ? scaling.number("attention_factor", 1.0)
                         : r.factor <= 1.0 ? 1.0
                                           : std::sqrt(1.0 + std::log(r.factor) / std::log(L));
    for (auto [name, list] : {std::pair{"short_factor", &r.short_factor}, {"long_factor", &r.long_factor}}) {
      if (!scaling.has(name) || !scaling.raw(name).is_array()) keys.fail(where + name, "must be a list of numbers");
      for (const json& v : scaling.raw(name)) {
        if (!v.is_number()) keys.fail(where + name, "must be a list of numbers, got " + printable(v.dump(), 40));
        list->push_back(v.get<double>());
      }
    }
  } else if (type == "proportional") {  // transformers' _compute_proportional_rope_parameters (Gemma 4)
    r.scaling = RopeFrequencies::Scaling::Proportional;
    r.factor = scaling.number("factor", 1.0);
    const double partial = partial_factor(1.0);
    const int64_t D = head_dim();
    r.rotary_dim = 0;  // the whole head, its pairs (i, i + D/2); the frequencies past rotated_pairs are 0
    r.rotated_pairs = static_cast<int64_t>(std::floor(partial * static_cast<double>(D) / 2.0));
    if (r.rotated_pairs < 1) keys.fail(where + "partial_rotary_factor", "turns no pair of a " + std::to_string(D) + "-value head");
  } else {
    keys.fail(where + "rope_type", "is '" + printable(type, 40) +
                                       "'; qkv supports the RoPE types default, linear, llama3, yarn, longrope and proportional");
  }
  if (!(r.factor > 0.0)) keys.fail(where + "factor", "must be positive");
  return r;
}

std::vector<int64_t> token_ids(const Keys& keys, const std::string& key) {
  std::vector<int64_t> ids;
  if (!keys.has(key)) return ids;
  const json& v = keys.raw(key);
  if (v.is_array()) {
    for (const json& e : v) ids.push_back(keys.integer_of(key, e));
  } else {
    ids.push_back(keys.integer_of(key, v));
  }
  return ids;
}

void require_activation(const Keys& keys, const Family& f) {
  const std::string act = keys.string(f.activation_key, f.activations.front());
  for (const std::string& a : f.activations)
    if (act == a) return;
  std::string list;
  for (const std::string& a : f.activations) list += (list.empty() ? "" : ", ") + a;
  keys.fail(f.activation_key, "is '" + printable(act, 40) + "'; " + f.name + " runs with " + list);
}

// Which layers slide: transformers' layer_types list when given, else the family's own rule.
// linear_attention entries (Qwen3-Next's Gated DeltaNet layers) do not slide; they are read by read_linear.
std::vector<bool> sliding_layers(const Keys& keys, int64_t layers, const std::function<bool(int64_t)>& rule,
                                 bool linear_ok = false) {
  std::vector<bool> sliding(static_cast<size_t>(layers));
  if (keys.has("layer_types")) {
    const json& types = keys.raw("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      keys.fail("layer_types", "must list one type per layer (" + std::to_string(layers) + ")");
    for (int64_t i = 0; i < layers; ++i) {
      const json& t = types[static_cast<size_t>(i)];
      if (t == "sliding_attention") sliding[static_cast<size_t>(i)] = true;
      else if (t != "full_attention" && !(linear_ok && t == "linear_attention"))
        keys.fail("layer_types", "entry " + std::to_string(i) + " is " + printable(t.dump(), 40) + "; qkv knows " +
                                     (linear_ok ? "full_attention and linear_attention" : "full_attention and sliding_attention"));
    }
    return sliding;
  }
  for (int64_t i = 0; i < layers; ++i) sliding[static_cast<size_t>(i)] = rule(i);
  return sliding;
}

// SmolLM3's no_rope_layers: 1 where a layer rotates, 0 where it does not (NoPE); by default every
// no_rope_layer_interval-th layer is NoPE.
std::vector<bool> rotating_layers(const Keys& keys, int64_t layers) {
  std::vector<bool> rotates(static_cast<size_t>(layers), true);
  if (keys.has("no_rope_layers")) {
    const json& list = keys.raw("no_rope_layers");
    if (!list.is_array() || static_cast<int64_t>(list.size()) < layers)
      keys.fail("no_rope_layers", "must list 1 (RoPE) or 0 (no RoPE) for each of the " + std::to_string(layers) + " layers");
    for (int64_t i = 0; i < layers; ++i) {
      const int64_t v = keys.integer_of("no_rope_layers", list[static_cast<size_t>(i)]);
      if (v != 0 && v != 1) keys.fail("no_rope_layers", "entry " + std::to_string(i) + " is " + std::to_string(v) + "; 1 means RoPE, 0 none");
      rotates[static_cast<size_t>(i)] = v == 1;
    }
    return rotates;
  }
  const int64_t interval = keys.integer("no_rope_layer_interval", 4);
  if (interval <= 0) keys.fail("no_rope_layer_interval", "must be positive");
  for (int64_t i = 0; i < layers; ++i) rotates[static_cast<size_t>(i)] = (i + 1) % interval != 0;
  return rotates;
}

}  // namespace

namespace {
// A mixture-of-experts family's keys (Qwen3MoeConfig's, with its defaults): which layers have experts
// (decoder_sparse_step, mlp_only_layers), how many, how wide, how many a token takes and whether their weights are
// renormalised.
// Qwen3-Next's have other defaults (Qwen3NextConfig's) and a shared expert gated by sigmoid(shared_expert_gate x).
void read_experts(const Keys& keys, DecoderConfig& c) {
  const bool next = c.family->linear_attention;
  c.num_experts = keys.integer("num_experts", next ? 512 : 128);
  c.experts_per_token = keys.integer("num_experts_per_tok", next ? 10 : 8);
  c.expert_intermediate_size = keys.integer("moe_intermediate_size", next ? 512 : 768);
  c.norm_topk_prob = keys.boolean("norm_topk_prob", next);
  if (next && c.num_experts > 0) {
    c.shared_expert_intermediate_size = keys.integer("shared_expert_intermediate_size", 512);
    if (c.shared_expert_intermediate_size < 0) keys.fail("shared_expert_intermediate_size", "must not be negative");
    c.shared_expert_gate = c.shared_expert_intermediate_size > 0;
  }
  // The load-balancing loss joins the training loss only when the config asks for the router logits (as transformers)
  if (keys.boolean("output_router_logits", false)) c.router_aux_loss_coef = keys.number("router_aux_loss_coef", 0.001);
  if (c.num_experts < 0 || c.num_experts > 65536) keys.fail("num_experts", "must lie in 0…65536");
  if (c.num_experts > 0 && (c.experts_per_token < 1 || c.experts_per_token > c.num_experts))
    keys.fail("num_experts_per_tok", "is " + std::to_string(c.experts_per_token) + "; it must lie in 1…num_experts (" +
                                         std::to_string(c.num_experts) + ")");
  if (c.num_experts > 0 && c.expert_intermediate_size <= 0) keys.fail("moe_intermediate_size", "must be positive");
  const int64_t step = keys.integer("decoder_sparse_step", 1);
  if (step <= 0) keys.fail("decoder_sparse_step", "must be positive");
  std::set<int64_t> dense;
  if (keys.has("mlp_only_layers")) {
    const json& list = keys.raw("mlp_only_layers");
    if (!list.is_array()) keys.fail("mlp_only_layers", "must be a list of layer numbers");
    for (const json& v : list) {
      const int64_t layer = keys.integer_of("mlp_only_layers", v);
      if (layer < 0 || layer >= c.num_layers) keys.fail("mlp_only_layers", "names layer " + std::to_string(layer) + " of " + std::to_string(c.num_layers));
      dense.insert(layer);
    }
  }
  for (int64_t i = 0; i < c.num_layers; ++i)
    c.layers[static_cast<size_t>(i)].experts = c.num_experts > 0 && !dense.count(i) && (i + 1) % step == 0;
  if (c.num_experts == 0) c.experts_per_token = c.expert_intermediate_size = 0;  // a dense model
}

// Qwen3-Next's hybrid stack (Qwen3NextConfig's keys and defaults): which layers are Gated DeltaNet (layer_types, or
// all but every full_attention_interval-th), their heads and conv, and the full layers' gated attention.
void read_linear(const Keys& keys, DecoderConfig& c) {
  c.gated_attention = true;
  c.linear_conv_kernel = keys.integer("linear_conv_kernel_dim", 4);
  c.linear_key_dim = keys.integer("linear_key_head_dim", 128);
  c.linear_value_dim = keys.integer("linear_value_head_dim", 128);
  c.linear_key_heads = keys.integer("linear_num_key_heads", 16);
  c.linear_value_heads = keys.integer("linear_num_value_heads", 32);
  for (const char* key : {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                          "linear_num_value_heads"})
    if (keys.integer(key, 1) <= 0) keys.fail(key, "must be positive");
  if (c.linear_value_heads % c.linear_key_heads != 0)
    keys.fail("linear_num_value_heads", "is " + std::to_string(c.linear_value_heads) + "; it must be a multiple of "
              "linear_num_key_heads (" + std::to_string(c.linear_key_heads) + ")");
  if (c.linear_conv_kernel > 64) keys.fail("linear_conv_kernel_dim", "is more than qkv takes (64)");
  if (keys.has("layer_types")) {  // checked by sliding_layers: linear_attention or full_attention
    const json& types = keys.raw("layer_types");
    for (int64_t i = 0; i < c.num_layers; ++i) c.layers[static_cast<size_t>(i)].linear = types[static_cast<size_t>(i)] == "linear_attention";
  } else {
    const int64_t interval = keys.integer("full_attention_interval", 4);
    if (interval <= 0) keys.fail("full_attention_interval", "must be positive");
    for (int64_t i = 0; i < c.num_layers; ++i) c.layers[static_cast<size_t>(i)].linear = (i + 1) % interval != 0;
  }
}

// gpt-oss's keys (GptOssConfig's, with its defaults): every layer a mixture of num_local_experts experts of
// intermediate_size, num_experts_per_tok a token, SwiGLU clamped at swiglu_limit.
void read_stacked_experts(const Keys& keys, DecoderConfig& c) {
  c.num_experts = keys.integer("num_local_experts", 128);
  c.experts_per_token = keys.integer("num_experts_per_tok", 4);
  c.expert_intermediate_size = c.intermediate_size;
  c.swiglu_limit = keys.number("swiglu_limit", 7.0);
  if (keys.boolean("output_router_logits", false)) c.router_aux_loss_coef = keys.number("router_aux_loss_coef", 0.9);
  if (c.num_experts <= 0 || c.num_experts > 65536) keys.fail("num_local_experts", "must lie in 1…65536");
  if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts)
    keys.fail("num_experts_per_tok", "is " + std::to_string(c.experts_per_token) + "; it must lie in 1…num_local_experts (" +
                                         std::to_string(c.num_experts) + ")");
  if (c.expert_intermediate_size <= 0) keys.fail("intermediate_size", "must be positive");
  if (!(c.swiglu_limit >= 0.0) || !std::isfinite(c.swiglu_limit)) keys.fail("swiglu_limit", "must be a number ≥ 0");
  for (auto& layer : c.layers) layer.experts = true;
}

// DeepSeek-V3's keys (DeepseekV3Config's, with its defaults): multi-head latent attention and its mixture of experts
// (a sigmoid router over groups, shared experts, the first first_k_dense_replace layers dense).
void read_latent(const Keys& keys, DecoderConfig& c) {
  c.kv_lora_rank = keys.integer("kv_lora_rank", 512);
  if (c.kv_lora_rank <= 0) keys.fail("kv_lora_rank", "is " + std::to_string(c.kv_lora_rank) + "; the latent's rank must be positive");
  c.q_lora_rank = keys.present("q_lora_rank") ? keys.integer("q_lora_rank", 0) : 1536;  // null: a plain q_proj
  if (c.q_lora_rank < 0) keys.fail("q_lora_rank", "must be positive or null");
  if (keys.present("q_lora_rank") && keys.has("q_lora_rank") && c.q_lora_rank == 0)
    keys.fail("q_lora_rank", "is 0; write null for a plain q_proj");
  c.qk_nope_head_dim = keys.integer("qk_nope_head_dim", 128);
  c.head_dim = keys.integer("qk_rope_head_dim", 64);
  c.v_head_dim = keys.integer("v_head_dim", 128);
  for (auto [key, v] : {std::pair{"qk_nope_head_dim", c.qk_nope_head_dim}, {"qk_rope_head_dim", c.head_dim}, {"v_head_dim", c.v_head_dim}})
    if (v <= 0 || v > 65536) keys.fail(key, "is " + std::to_string(v) + "; it must lie in 1…65536");
  if (c.head_dim % 2 != 0) keys.fail("qk_rope_head_dim", "must be even (RoPE rotates pairs)");
  // transformers applies RoPE to q_pe and k_pe after de-interleaving them (apply_rotary_pos_emb_interleave): pairs
  // (2i, 2i + 1) rotate by frequency i, which is the interleaved rotation in the original order, the same scores
  c.rope_layout = keys.boolean("rope_interleave", true) ? RopeLayout::Interleaved : RopeLayout::RotateHalf;
  // softmax scale: qk_head_dim^−½, times mscale² when rope_scaling has mscale_all_dim (DeepseekV3Attention)
  c.attention_scale = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.head_dim));
  const char* rope_key = keys.has("rope_scaling") ? "rope_scaling" : keys.has("rope_parameters") ? "rope_parameters" : nullptr;
  if (rope_key && keys.raw(rope_key).is_object()) {
    const Keys scaling(keys.raw(rope_key), keys.source() + " " + rope_key);
    const double all_dim = scaling.number("mscale_all_dim", 0.0), factor = scaling.number("factor", 1.0);
    if (all_dim != 0.0 && factor > 1.0) {
      const double mscale = 0.1 * all_dim * std::log(factor) + 1.0;
      c.attention_scale *= mscale * mscale;
    }
  }
  // the router: only DeepSeek-V3's (sigmoid scores, noaux_tc selection) is run
  if (keys.string("scoring_func", "sigmoid") != "sigmoid")
    keys.fail("scoring_func", "is '" + printable(keys.string("scoring_func", ""), 40) + "'; qkv runs DeepSeek-V3's sigmoid router only");
  if (keys.string("topk_method", "noaux_tc") != "noaux_tc")
    keys.fail("topk_method", "is '" + printable(keys.string("topk_method", ""), 40) + "'; qkv runs DeepSeek-V3's noaux_tc selection only");
  c.sigmoid_router = true;
  c.num_experts = keys.integer("n_routed_experts", 256);
  c.experts_per_token = keys.integer("num_experts_per_tok", 8);
  c.expert_intermediate_size = keys.integer("moe_intermediate_size", 2048);
  c.norm_topk_prob = keys.boolean("norm_topk_prob", true);
  c.routed_scaling_factor = keys.number("routed_scaling_factor", 2.5);
  c.expert_groups = keys.integer("n_group", 8);
  c.expert_groups_kept = keys.integer("topk_group", 4);
  const int64_t shared = keys.integer("n_shared_experts", 1), dense = keys.integer("first_k_dense_replace", 3);
  if (c.num_experts < 1 || c.num_experts > 65536) keys.fail("n_routed_experts", "must lie in 1…65536");
  if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts)
    keys.fail("num_experts_per_tok", "is " + std::to_string(c.experts_per_token) + "; it must lie in 1…n_routed_experts (" +
                                         std::to_string(c.num_experts) + ")");
  if (c.expert_intermediate_size <= 0) keys.fail("moe_intermediate_size", "must be positive");
  if (c.expert_groups < 1 || c.num_experts % c.expert_groups != 0)
    keys.fail("n_group", "is " + std::to_string(c.expert_groups) + "; it must divide n_routed_experts (" + std::to_string(c.num_experts) + ")");
  if (c.expert_groups > 1 && c.num_experts / c.expert_groups < 2)
    keys.fail("n_group", "leaves fewer than two experts a group; each group is scored by its two best");
  if (c.expert_groups_kept < 1 || c.expert_groups_kept > c.expert_groups)
    keys.fail("topk_group", "is " + std::to_string(c.expert_groups_kept) + "; it must lie in 1…n_group (" + std::to_string(c.expert_groups) + ")");
  if (c.experts_per_token > c.expert_groups_kept * (c.num_experts / c.expert_groups))
    keys.fail("num_experts_per_tok", "is " + std::to_string(c.experts_per_token) + ", more than the topk_group groups hold (" +
                                         std::to_string(c.expert_groups_kept * (c.num_experts / c.expert_groups)) + ")");
  if (!(c.routed_scaling_factor > 0.0)) keys.fail("routed_scaling_factor", "must be positive");
  if (shared < 0 || shared > 65536) keys.fail("n_shared_experts", "must lie in 0…65536");
  c.shared_expert_intermediate_size = shared * c.expert_intermediate_size;
  if (dense < 0) keys.fail("first_k_dense_replace", "must not be negative");
  for (int64_t i = 0; i < c.num_layers; ++i) c.layers[static_cast<size_t>(i)].experts = i >= dense;
}
}  // namespace

DecoderConfig decoder_config_from_hf(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError(source + ": not valid JSON (" + std::string(e.what()) + "); a Hugging Face config.json is a JSON object");
  }
  if (!j.is_object()) throw IoError(source + ": not a JSON object; a Hugging Face config.json is one");
  const Keys keys(j, source);
  const std::string type = keys.string("model_type", "");
  if (type.empty()) keys.fail("model_type", "is missing; qkv reads " + family_list());
  const Family* family = family_of_model_type(type);
  if (type == "gemma3")
    keys.fail("model_type", "is 'gemma3', the multimodal Gemma 3 (4B and larger); qkv runs the text models "
                            "(model_type gemma3_text: Gemma 3 270M and 1B)");
  if (!family) keys.fail("model_type", "is '" + printable(type, 40) + "'; qkv reads " + family_list());
  if (family->naming == Naming::Book)
    keys.fail("model_type", "is '" + type + "': load it as GPT-2 (load_language_model), not as a decoder config");
  const Family& f = *family;
  DecoderConfig c;
  c.family = family;
  c.source.json = text;
  c.norm = f.norm;
  c.placement = f.placement;
  c.qk_norm = f.qk_norm;
  c.mlp = f.mlp;
  c.vocab_size = keys.integer("vocab_size");
  c.hidden_size = keys.integer("hidden_size");
  c.intermediate_size = keys.integer("intermediate_size");
  c.num_layers = keys.integer("num_hidden_layers");
  if (c.num_layers <= 0 || c.num_layers > kMaxLayers)
    keys.fail("num_hidden_layers", "is " + std::to_string(c.num_layers) + "; qkv takes 1 to " + std::to_string(kMaxLayers));
  c.num_heads = keys.integer("num_attention_heads");
  if (c.num_heads <= 0) keys.fail("num_attention_heads", "must be positive");
  c.num_kv_heads = keys.integer("num_key_value_heads", c.num_heads);
  c.head_dim = keys.integer("head_dim", c.hidden_size / c.num_heads);
  c.max_positions = keys.integer("max_position_embeddings", 0);
  if (c.max_positions <= 0) keys.fail("max_position_embeddings", "must be positive");
  c.norm_eps = keys.number(f.norm_eps_key, f.norm_eps_default);
  c.eos_token_ids = token_ids(keys, "eos_token_id");
  if (const auto bos = token_ids(keys, "bos_token_id"); !bos.empty()) c.bos_token_id = bos.front();
  if (const auto pad = token_ids(keys, "pad_token_id"); !pad.empty()) c.pad_token_id = pad.front();
  c.attention_dropout = keys.number("attention_dropout", 0.0);
  if (!(c.attention_dropout >= 0.0 && c.attention_dropout < 1.0)) keys.fail("attention_dropout", "must lie in [0, 1)");
  if (keys.integer("pretraining_tp", 1) != 1) keys.fail("pretraining_tp", "must be 1 (the split only changes rounding)");
  require_activation(keys, f);
  switch (f.bias) {
    case BiasRule::AttentionBias:
      c.qkv_bias = c.o_bias = keys.boolean("attention_bias", false);
      c.mlp_bias = keys.boolean("mlp_bias", false);
      break;
    case BiasRule::QkvAlways: c.qkv_bias = true; break;
    case BiasRule::None: break;
  }
  c.tie_word_embeddings = keys.boolean("tie_word_embeddings", f.tie_default);
  if (f.embedding_scale) c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
  if (f.query_pre_attn_scalar) {
    const double scalar = keys.number("query_pre_attn_scalar", static_cast<double>(c.head_dim));
    if (!(scalar > 0)) keys.fail("query_pre_attn_scalar", "must be positive");
    c.attention_scale = 1.0 / std::sqrt(scalar);
  }
  // Soft-capping: a key set to null means none; a key left out means the family's default (Gemma 2's 50 and 30).
  auto cap = [&](const char* key, double fallback) {
    const double v = keys.present(key) ? keys.number(key, 0.0) : fallback;
    if (v != 0.0 && !f.soft_capping) keys.fail(key, "is set; " + f.name + " has no soft-capping (Gemma 2 has)");
    if (v < 0.0) keys.fail(key, "must be positive or null");
    return v;
  };
  c.attn_softcap = cap("attn_logit_softcapping", f.attn_softcap_default);
  c.final_softcap = cap("final_logit_softcapping", f.final_softcap_default);
  // A *ForSequenceClassification folder: its classes from id2label (or num_labels; transformers' default is 2).
  if (keys.has("architectures")) {
    const json& arch = keys.raw("architectures");
    if (!arch.is_array() || arch.empty() || !arch[0].is_string()) keys.fail("architectures", "must be a list of class names");
    const std::string name = arch[0].get<std::string>();
    const std::string suffix = "ForSequenceClassification";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      if (keys.has("id2label")) {
        const json& names = keys.raw("id2label");
        if (!names.is_object()) keys.fail("id2label", "must map class ids to names");
        std::map<int64_t, std::string> by_id;
        for (const auto& [id, label] : names.items()) {
          int64_t k = -1;
          try {
            k = parse_int(id, "id2label key");
          } catch (const ValueError&) {
          }
          if (k < 0 || k >= static_cast<int64_t>(names.size()) || !label.is_string())
            keys.fail("id2label", "must map the ids 0 … " + std::to_string(names.size() - 1) + " to names, got " +
                                      printable(id, 20) + ": " + printable(label.dump(), 40));
          by_id[k] = label.get<std::string>();
        }
        for (auto& [k, label] : by_id) c.labels.push_back(label);
        c.num_labels = static_cast<int64_t>(c.labels.size());
      } else {
        c.num_labels = keys.integer("num_labels", 2);
      }
      if (c.num_labels < 1 || c.num_labels > 1000000) keys.fail("id2label", "must name at least one class");
    }
  }

  // Sliding windows: layer_types when given, else the family's rule.
  std::vector<bool> sliding(static_cast<size_t>(c.num_layers), false);
  const std::vector<bool> rotates = f.rope == RopeRule::NoRopeLayers ? rotating_layers(keys, c.num_layers)
                                                                     : std::vector<bool>(static_cast<size_t>(c.num_layers), true);
  int64_t window = keys.present("sliding_window") ? keys.integer("sliding_window", 0) : f.default_window;
  switch (f.sliding) {
    case SlidingRule::None:
      if (keys.has("layer_types"))
        sliding = sliding_layers(keys, c.num_layers, [](int64_t) { return false; }, f.linear_attention);
      break;
    case SlidingRule::EveryLayer:  // sliding_window null: none
      sliding = sliding_layers(keys, c.num_layers, [&](int64_t) { return window > 0; });
      break;
    case SlidingRule::QwenLayers:
      if (keys.boolean("use_sliding_window", false)) {
        const int64_t first = keys.integer("max_window_layers", c.num_layers);
        sliding = sliding_layers(keys, c.num_layers, [&](int64_t i) { return i >= first; });
      } else if (keys.has("layer_types")) {
        sliding = sliding_layers(keys, c.num_layers, [](int64_t) { return false; });
      }
      break;
    case SlidingRule::NoRopeLayers:  // SmolLM3: the NoPE layers slide, and only with use_sliding_window
      if (keys.boolean("use_sliding_window", false) && window > 0)
        sliding = sliding_layers(keys, c.num_layers, [&](int64_t i) { return !rotates[static_cast<size_t>(i)]; });
      break;
    case SlidingRule::Pattern: {  // all but every pattern-th layer
      const int64_t pattern = f.pattern_key.empty() ? f.sliding_pattern : keys.integer(f.pattern_key, f.sliding_pattern);
      if (pattern <= 0) keys.fail(f.pattern_key, "must be positive");
      sliding = sliding_layers(keys, c.num_layers, [&](int64_t i) { return (i + 1) % pattern != 0; });
      break;
    }
  }
  if (window < 0) keys.fail("sliding_window", "must not be negative");
  if (std::find(sliding.begin(), sliding.end(), true) != sliding.end() && window <= 0)
    keys.fail("sliding_window", "must be a positive number for the layers layer_types makes sliding");

  // RoPE: one rotation, or a second one for the sliding layers (Gemma 3's local base, OLMo 3's unscaled RoPE).
  c.ropes = {rope_of(keys, f, f.rope_theta_default, true, c.max_positions)};
  const bool split = f.rope == RopeRule::LocalBase || f.rope == RopeRule::ScaledOnFullOnly;
  if (split) {
    c.ropes.push_back(rope_of(keys, f, f.rope_theta_default, false, c.max_positions));
    if (f.rope == RopeRule::LocalBase) c.ropes[1].theta = keys.number("rope_local_base_freq", 10000.0);
  }
  c.layers.resize(sliding.size());
  for (size_t i = 0; i < sliding.size(); ++i) {
    c.layers[i].window = sliding[i] ? window : 0;
    c.layers[i].rope = !rotates[i] ? -1 : split && sliding[i] ? 1 : 0;
  }
  // A quantized checkpoint: gpt-oss's published MXFP4 experts are read (load_hf_decoder keeps them as MXFP4); the
  // tensors of other methods (GPTQ, AWQ, bitsandbytes, FP8 …) are not
  if (keys.has("quantization_config")) {
    const json& q = keys.raw("quantization_config");
    const std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                                   ? q["quant_method"].get<std::string>() : std::string();
    if (!(method == "mxfp4" && f.stacked_experts))
      keys.fail("quantization_config", "names quant_method '" + printable(method, 40) + "', whose tensors qkv does not "
                "read (it reads gpt-oss's mxfp4 experts); use the model's unquantized folder, or a GGUF file of it");
  }
  if (f.latent_attention) read_latent(keys, c);
  else if (f.stacked_experts) read_stacked_experts(keys, c);
  else if (f.experts) read_experts(keys, c);
  if (f.linear_attention) read_linear(keys, c);
  for (const auto& r : c.ropes) {
    const int64_t rotated = r.rotary_dim > 0 ? r.rotary_dim : c.head_dim;
    if (r.scaling == RopeFrequencies::Scaling::LongRope && static_cast<int64_t>(r.short_factor.size()) * 2 != rotated)
      keys.fail("rope_scaling.short_factor", "has " + std::to_string(r.short_factor.size()) + " entries; one per rotated pair (" +
                                                  std::to_string(rotated / 2) + ") is needed");
  }
  try {
    c.validate();
  } catch (const ValueError& e) {
    throw IoError(source + ": " + e.what());
  }
  return c;
}

std::string decoder_config_to_hf(const DecoderConfig& c, HfDType dtype) {
  const Family& f = *c.family;
  if (f.naming != Naming::HuggingFace)
    throw ValueError("decoder_config_to_hf: the " + f.name + " family has no such config.json (save_gpt2 writes GPT-2's files)");
  // What the model was read from, kept: its keys stay, and those qkv knows the value of are written over.
  json j = c.source.json.empty() ? json::object() : json::parse(c.source.json, nullptr, false);
  if (!j.is_object()) j = json::object();
  const bool fresh = c.source.json.empty();
  j["model_type"] = f.model_types.front();
  if (c.num_labels > 0) {  // a classifier: transformers' *ForSequenceClassification reads these
    j["architectures"] = {f.sequence_classifier};
    json id2label = json::object(), label2id = json::object();
    for (int64_t i = 0; i < c.num_labels; ++i) {
      const std::string name = i < static_cast<int64_t>(c.labels.size()) ? c.labels[static_cast<size_t>(i)]
                                                                          : "LABEL_" + std::to_string(i);
      id2label[std::to_string(i)] = name;
      label2id[name] = i;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
  } else if (fresh || !j.contains("architectures")) {
    j["architectures"] = {f.causal_lm};
  }
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  if (j.contains("head_dim") || c.head_dim * c.num_heads != c.hidden_size) j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_positions;
  j[f.norm_eps_key] = c.norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = dtype == HfDType::BF16 ? "bfloat16" : "float32";
  if (c.attention_dropout != 0.0 || j.contains("attention_dropout")) j["attention_dropout"] = c.attention_dropout;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty()) j["eos_token_id"] = c.eos_token_ids;
  if (f.latent_attention) {  // DeepseekV3Config's names
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
    j["qk_nope_head_dim"] = c.qk_nope_head_dim;
    j["qk_rope_head_dim"] = c.head_dim;
    j["v_head_dim"] = c.v_head_dim;
    j["rope_interleave"] = c.rope_layout == RopeLayout::Interleaved;
    j["n_routed_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["moe_intermediate_size"] = c.expert_intermediate_size;
    j["n_shared_experts"] = c.expert_intermediate_size > 0 ? c.shared_expert_intermediate_size / c.expert_intermediate_size : 0;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["routed_scaling_factor"] = c.routed_scaling_factor;
    j["n_group"] = c.expert_groups;
    j["topk_group"] = c.expert_groups_kept;
    int64_t dense = 0;
    while (dense < c.num_layers && !c.layers[static_cast<size_t>(dense)].experts) ++dense;
    j["first_k_dense_replace"] = dense;
  } else if (f.stacked_experts) {  // GptOssConfig's names: intermediate_size is the experts' width
    j["num_local_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["intermediate_size"] = c.expert_intermediate_size;
    j["swiglu_limit"] = c.swiglu_limit;
  } else if (f.experts) {  // the experts, and the layers without them spelled out
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["moe_intermediate_size"] = c.expert_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    std::vector<int64_t> dense;
    for (size_t i = 0; i < c.layers.size(); ++i)
      if (!c.layers[i].experts) dense.push_back(static_cast<int64_t>(i));
    j["mlp_only_layers"] = dense;
    if (f.linear_attention) j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  }
  if (f.linear_attention) {  // Qwen3NextConfig's names; which layers are Gated DeltaNet, spelled out
    j["linear_conv_kernel_dim"] = c.linear_conv_kernel;
    j["linear_key_head_dim"] = c.linear_key_dim;
    j["linear_value_head_dim"] = c.linear_value_dim;
    j["linear_num_key_heads"] = c.linear_key_heads;
    j["linear_num_value_heads"] = c.linear_value_heads;
    json types = json::array();
    for (const auto& l : c.layers) types.push_back(l.linear ? "linear_attention" : "full_attention");
    j["layer_types"] = types;
  }
  if (f.experts && !f.latent_attention && c.router_aux_loss_coef != 0.0) {  // the load-balancing loss, as read
    j["output_router_logits"] = true;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
  if (!fresh) return j.dump(2) + "\n";
  // A model made here: every setting its family reads, so that reading the file back gives this configuration.
  j[f.activation_key] = f.activations.front();
  if (f.bias == BiasRule::AttentionBias) {
    j["attention_bias"] = c.qkv_bias;
    j["mlp_bias"] = c.mlp_bias;
  }
  auto scaling = [&c](const RopeFrequencies& r) -> json {
    using S = RopeFrequencies::Scaling;
    json s;
    switch (r.scaling) {
      case S::None: return nullptr;
      case S::Linear: s = {{"rope_type", "linear"}, {"factor", r.factor}}; break;
      case S::Llama3:
        s = {{"rope_type", "llama3"}, {"factor", r.factor}, {"low_freq_factor", r.low_freq_factor},
             {"high_freq_factor", r.high_freq_factor},
             {"original_max_position_embeddings", static_cast<int64_t>(r.original_max_position_embeddings)}};
        break;
      case S::Yarn:
        s = {{"rope_type", "yarn"}, {"factor", r.factor}, {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow},
             {"truncate", r.truncate}, {"attention_factor", r.attention_factor},
             {"original_max_position_embeddings", static_cast<int64_t>(r.original_max_position_embeddings)}};
        break;
      case S::LongRope:
        s = {{"rope_type", "longrope"}, {"factor", r.factor}, {"attention_factor", r.attention_factor},
             {"short_factor", r.short_factor}, {"long_factor", r.long_factor},
             {"original_max_position_embeddings", static_cast<int64_t>(r.original_max_position_embeddings)}};
        break;
      case S::Proportional:  // 2·pairs / D: read back, floor(p·D / 2) gives the pairs again
        s = {{"rope_type", "proportional"}, {"factor", r.factor},
             {"partial_rotary_factor", 2.0 * static_cast<double>(r.rotated_pairs) / static_cast<double>(c.head_dim)}};
        break;
    }
    return s;
  };
  if (!c.ropes.empty()) {
    j["rope_theta"] = c.ropes[0].theta;
    j["rope_scaling"] = scaling(c.ropes[0]);
    if (c.ropes[0].rotary_dim > 0)
      j["partial_rotary_factor"] = static_cast<double>(c.ropes[0].rotary_dim) / static_cast<double>(c.head_dim);
    else if (f.partial_rotary && f.partial_rotary_default != 1.0)  // all of each head, unlike the family's default
      j["partial_rotary_factor"] = 1.0;
    if (f.rope == RopeRule::LocalBase && c.ropes.size() > 1) j["rope_local_base_freq"] = c.ropes[1].theta;
  }
  if (f.rope == RopeRule::NoRopeLayers) {
    json list = json::array();
    for (const auto& l : c.layers) list.push_back(l.rope >= 0 ? 1 : 0);
    j["no_rope_layers"] = list;
  }
  if (f.query_pre_attn_scalar)
    j["query_pre_attn_scalar"] = c.attention_scale > 0 ? 1.0 / (c.attention_scale * c.attention_scale) : c.head_dim;
  if (f.soft_capping) {
    j["attn_logit_softcapping"] = c.attn_softcap > 0 ? json(c.attn_softcap) : json(nullptr);
    j["final_logit_softcapping"] = c.final_softcap > 0 ? json(c.final_softcap) : json(nullptr);
  }
  int64_t window = 0;
  for (const auto& l : c.layers) window = std::max(window, l.window);
  if (window > 0) {  // which layers slide, spelled out
    json types = json::array();
    for (const auto& l : c.layers) types.push_back(l.window > 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["sliding_window"] = window;
    j["use_sliding_window"] = true;
  } else if (f.sliding != SlidingRule::None) {
    j["sliding_window"] = nullptr;
    j["use_sliding_window"] = false;
    if (f.sliding == SlidingRule::Pattern) j["layer_types"] = std::vector<std::string>(c.layers.size(), "full_attention");
  }
  return j.dump(2) + "\n";
}

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

namespace {
std::string read_text(const fs::path& p) {
  const std::vector<std::byte> bytes = io::read_file(p.string());
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// The folder's safetensors files and which holds each tensor: model.safetensors, or the shards the index names.
struct Shards {
  std::vector<io::SafetensorsFile> files;
  std::map<std::string, size_t> where;  // tensor name → files index
};

Shards open_shards(const fs::path& dir) {
  Shards s;
  const fs::path index = dir / "model.safetensors.index.json", single = dir / "model.safetensors";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    json j;
    try {
      j = json::parse(read_text(index));
    } catch (const json::exception& e) {
      throw IoError(index.string() + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw IoError(index.string() + ": has no 'weight_map' object naming each tensor's shard");
    std::map<std::string, size_t> shard_of;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw IoError(index.string() + ": weight_map['" + printable(name, 80) + "'] is not a file name");
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..")
        throw IoError(index.string() + ": shard name '" + printable(f, 80) + "' is not a plain file name in the folder");
      if (!shard_of.count(f)) {
        const fs::path shard = dir / f;
        if (!fs::exists(shard, ec))
          throw IoError(index.string() + ": names shard '" + printable(f, 80) + "', which is not in " + dir.string() +
                        "; download the whole folder again");
        shard_of[f] = s.files.size();
        s.files.push_back(io::SafetensorsFile::open(shard.string()));
      }
      s.where[name] = shard_of[f];
    }
    for (const auto& [name, i] : s.where)
      if (!s.files[i].contains(name))
        throw IoError(s.files[i].path() + ": has no tensor '" + printable(name, 80) + "', which " + index.string() + " puts there");
    return s;
  }
  if (!fs::exists(single, ec))
    throw IoError(dir.string() + ": has neither model.safetensors nor model.safetensors.index.json");
  s.files.push_back(io::SafetensorsFile::open(single.string()));
  for (const auto& t : s.files[0].tensors()) s.where[t.name] = 0;
  return s;
}

// Tensors a checkpoint may carry that the model does not need: a tied head saved anyway, old rotary buffers.
bool ignorable(const std::string& name, const DecoderConfig& c) {
  if (c.tie_word_embeddings && name == "lm_head.weight") return true;
  // DeepSeek-V3's multi-token-prediction layers follow the last block (model.layers.61 …): transformers skips them on
  // load (_keys_to_ignore_on_load_unexpected), and so does qkv
  if (c.family->latent_attention && name.rfind("model.layers.", 0) == 0) {
    const size_t end = name.find('.', 13);
    const std::string layer = name.substr(13, end == std::string::npos ? std::string::npos : end - 13);
    if (!layer.empty() && layer.size() < 7 && std::all_of(layer.begin(), layer.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
        std::stoll(layer) >= c.num_layers)
      return true;
  }
  return name.size() > 22 && name.compare(name.size() - 22, 22, "rotary_emb.inv_freq") == 0;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}
}  // namespace

std::string hf_model_type(const std::string& dir) {
  const fs::path config = fs::path(dir) / "config.json";
  json j;
  try {
    j = json::parse(read_text(config));
  } catch (const json::exception& e) {
    throw IoError(config.string() + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("model_type") || !j["model_type"].is_string())
    throw IoError(config.string() + ": has no 'model_type' string; qkv reads " + family_list());
  return j["model_type"].get<std::string>();
}

void check_layout(const DecoderConfig& config, Names names, const TensorLookup& find,
                  const std::vector<std::string>& present, const std::string& source,
                  const std::function<bool(const std::string&)>& ignorable) {
  std::vector<std::string> missing, misshapen, unexpected;
  std::set<std::string> wanted;
  for (const auto& p : config.layout(names)) {
    wanted.insert(p.name);
    const io::TensorInfo* info = find(p.name);
    if (!info) {
      missing.push_back(p.name);
    } else if (std::vector<int64_t>(p.shape.dims().begin(), p.shape.dims().end()) != info->shape) {
      misshapen.push_back(p.name + " is " + shape_text(info->shape) + ", the configuration says " + p.shape.str());
    }
  }
  for (const auto& name : present)
    if (!wanted.count(name) && !(ignorable && ignorable(name))) unexpected.push_back(name);
  if (missing.empty() && misshapen.empty() && unexpected.empty()) return;
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + printable(v[i], 120);
    if (v.size() > 5) s += " and " + std::to_string(v.size() - 5) + " more";
    return s;
  };
  std::string why = source + ": the weights do not match the configuration (" + config.family->name + ")";
  if (!missing.empty()) why += "; missing: " + list(missing);
  if (!misshapen.empty()) why += "; wrong shape: " + list(misshapen);
  if (!unexpected.empty()) why += "; unexpected: " + list(unexpected);
  throw IoError(why);
}

void read_layout(Decoder& model, Names names, const TensorReader& read) {
  for (const auto& p : model.config.layout(names)) {
    const bool direct = !p.transposed && (names == Names::Own || model.config.family->naming == Naming::HuggingFace);
    if (direct) {  // the entry is one of the model's registered tensors
      read(p, model.parameter(p));
      continue;
    }
    // Another naming's entry (GPT-2's c_attn): read whole, then each part into the model's tensor for its role.
    Tensor whole = Tensor::empty(p.shape);
    read(p, whole);
    for (const auto& part : p.parts) {
      Tensor dst = model.part(part, p.layer);
      if (p.transposed) {
        dst.copy_(transpose_columns(whole, part.row0, part.rows));  // rounded where dst is bf16
      } else {
        const int64_t width = p.shape.rank() > 1 ? p.shape[1] : 1;
        dst.copy_(whole.view_at(part.row0 * width, dst.shape()));
      }
    }
  }
}

Tensor stacked_experts_as_checkpoint(const Tensor& t, const Shape& shape) {
  if (t.rank() == shape.rank() || shape.rank() != 3) return t;
  // gpt-oss's experts kept as stored rows (E·R, K) (a published MXFP4 folder): widened into the (E, K, R) the
  // family's checkpoints hold, each expert's rows as columns
  const int64_t E = shape[0], K = shape[1], R = shape[2];
  std::vector<float> rows(static_cast<size_t>(E * R * K));
  io::dequantize_rows(t.weight_type(), t.dtype() == DType::BF16 ? static_cast<const void*>(t.bf16()) : t.stored_bytes(),
                      rows.data(), E * R, K);
  Tensor whole = Tensor::empty(shape);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) whole.data()[(e * K + k) * R + r] = rows[static_cast<size_t>((e * R + r) * K + k)];
  return whole;
}

std::vector<io::TensorData> layout_tensors(Decoder& model, Names names, HfDType dtype) {
  auto data = [dtype](std::string name, const Tensor& t) {
    return dtype == HfDType::F32 ? io::TensorData::from_tensor(std::move(name), t)
                                 : io::TensorData::from_tensor_bf16(std::move(name), t);
  };
  std::vector<io::TensorData> out;
  for (const auto& p : model.config.layout(names)) {
    const bool direct = !p.transposed && (names == Names::Own || model.config.family->naming == Naming::HuggingFace);
    if (direct) {
      out.push_back(data(p.name, stacked_experts_as_checkpoint(model.parameter(p), p.shape)));
      continue;
    }
    // Gathered from each part's role (zeros where the model has none: GPT-2's files always carry q/k/v biases).
    Tensor whole = Tensor::zeros(p.shape);
    const int64_t width = p.shape.rank() > 1 ? p.shape[1] : 1;
    for (const auto& part : p.parts) {
      Tensor src;
      try {
        src = model.part(part, p.layer);
      } catch (const ValueError&) {
        continue;
      }
      if (src.dtype() == DType::BF16) {  // widened to float32 for the copy below
        Tensor widened = Tensor::empty(src.shape());
        widened.copy_(src);
        src = widened;
      }
      if (p.transposed) {  // (out, in) rows → columns [row0, row0 + rows) of the (in, out_total) entry
        const int64_t in = src.size(1), out_rows = src.size(0);
        for (int64_t r = 0; r < out_rows; ++r)
          for (int64_t k = 0; k < in; ++k) whole.data()[k * width + part.row0 + r] = src.data()[r * in + k];
      } else {
        std::copy_n(src.data(), src.numel(), whole.data() + part.row0 * width);
      }
    }
    out.push_back(data(p.name, whole));
  }
  return out;
}

void save_hf_classifier(const std::string& dir_name, Decoder& base, const Tensor& score,
                        const std::vector<std::string>& labels, int64_t pad_token_id, const std::string& tokenizer_from,
                        HfDType dtype) {
  DecoderConfig c = base.config;
  if (c.family->naming != Naming::HuggingFace)
    throw ValueError("save_hf_classifier: a " + c.family->name + " model has no Hugging Face classifier folder");
  c.num_labels = score.size(0);
  c.labels = labels;
  c.pad_token_id = pad_token_id;
  c.validate();
  const fs::path dir(dir_name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) throw IoError(dir.string() + ": cannot create the folder (" + ec.message() + ")");
  std::vector<io::TensorData> tensors;
  for (const auto& p : c.layout()) {
    const Tensor& t = p.role() == Role::Head ? score : base.parameter(p);
    tensors.push_back(dtype == HfDType::F32 ? io::TensorData::from_tensor(p.name, t) : io::TensorData::from_tensor_bf16(p.name, t));
  }
  io::save_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string config = decoder_config_to_hf(c, dtype);
  io::write_file_atomically((dir / "config.json").string(),
                            std::span(reinterpret_cast<const std::byte*>(config.data()), config.size()));
  if (tokenizer_from.empty()) return;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                           "chat_template.json"}) {
    const fs::path from = fs::path(tokenizer_from) / name;
    if (fs::exists(from, ec)) {
      const std::vector<std::byte> bytes = io::read_file(from.string());
      io::write_file_atomically((dir / name).string(), bytes);
    }
  }
}

namespace {
// gpt-oss's published experts (transformers' Mxfp4 quantizer): a stacked matrix X (E, K, R) — gate_up_proj (E, C, 2F),
// down_proj (E, F, C) — is held as X_blocks (U8 (E, R, K/32, 16)) and X_scales (U8 (E, R, K/32)): rows of each
// expert's R outputs, the values transformers' convert_moe_packed_tensors transposes back into X.
struct Mxfp4Entry {
  const io::SafetensorsFile* blocks_file = nullptr;
  const io::SafetensorsFile* scales_file = nullptr;
  const io::TensorInfo* blocks = nullptr;
  const io::TensorInfo* scales = nullptr;
  io::TensorInfo stand_in;  // X as check_layout expects it
  int64_t rows = 0, cols = 0;  // E·R rows of K values
};

std::map<std::string, Mxfp4Entry> mxfp4_entries(const DecoderConfig& config, const Shards& shards,
                                                const std::string& source) {
  std::map<std::string, Mxfp4Entry> out;
  if (!config.family->stacked_experts) return out;
  for (const auto& p : config.layout(Names::Own)) {
    if ((p.role() != Role::StackedGateUp && p.role() != Role::StackedDown) || shards.where.count(p.name)) continue;
    const auto b = shards.where.find(p.name + "_blocks"), s = shards.where.find(p.name + "_scales");
    if (b == shards.where.end() && s == shards.where.end()) continue;  // missing altogether: check_layout lists it
    if (b == shards.where.end() || s == shards.where.end())
      throw IoError(source + ": " + p.name + (b == shards.where.end() ? "_scales" : "_blocks") + " has no " +
                    (b == shards.where.end() ? "_blocks" : "_scales") + " beside it; an MXFP4 tensor needs both");
    Mxfp4Entry m;
    m.blocks_file = &shards.files[b->second];
    m.scales_file = &shards.files[s->second];
    m.blocks = m.blocks_file->find(b->first);
    m.scales = m.scales_file->find(s->first);
    const int64_t E = p.shape[0], K = p.shape[1], R = p.shape[2];
    const std::vector<int64_t> blocks_shape = {E, R, K / 32, 16}, scales_shape = {E, R, K / 32};
    if (K % 32 != 0)
      throw IoError(source + ": " + p.name + "_blocks: MXFP4 holds rows of whole blocks of 32 values, and the "
                    "configuration's " + p.shape.str() + " gives rows of " + std::to_string(K));
    for (const auto& [info, want, suffix] : {std::tuple{m.blocks, blocks_shape, "_blocks"}, {m.scales, scales_shape, "_scales"}})
      if (info->dtype != io::DType::U8 || info->shape != want)
        throw IoError(source + ": " + p.name + suffix + " is " + io::dtype_name(info->dtype) + " " + shape_text(info->shape) +
                      "; for the configuration's " + p.shape.str() + " an MXFP4 tensor is U8 " + shape_text(want));
    m.stand_in.name = p.name;
    m.stand_in.dtype = io::DType::U8;
    m.stand_in.shape = std::vector<int64_t>(p.shape.dims().begin(), p.shape.dims().end());
    m.rows = E * R;
    m.cols = K;
    out.emplace(p.name, std::move(m));
  }
  return out;
}
}  // namespace

std::unique_ptr<Decoder> load_hf_decoder(const std::string& dir_name, DType matrices) {
  const fs::path dir(dir_name);
  const fs::path config_path = dir / "config.json";
  const DecoderConfig config = decoder_config_from_hf(read_text(config_path), config_path.string());
  const Shards shards = open_shards(dir);
  // Every tensor the layout needs, present with its shape, and nothing unknown — before allocating.
  const std::map<std::string, Mxfp4Entry> mxfp4 = mxfp4_entries(config, shards, dir.string());
  std::vector<std::string> present;
  for (const auto& [name, i] : shards.where) {
    const size_t cut = name.size() > 7 && (name.ends_with("_blocks") || name.ends_with("_scales")) ? name.size() - 7 : 0;
    if (!cut || !mxfp4.count(name.substr(0, cut))) present.push_back(name);
  }
  for (const auto& [name, m] : mxfp4) present.push_back(name);
  const TensorLookup find = [&](const std::string& name) -> const io::TensorInfo* {
    if (const auto m = mxfp4.find(name); m != mxfp4.end()) return &m->second.stand_in;
    const auto it = shards.where.find(name);
    return it == shards.where.end() ? nullptr : shards.files[it->second].find(name);
  };
  check_layout(config, Names::Own, find, present, dir.string(),
               [&](const std::string& name) { return ignorable(name, config); });
  // Experts kept as MXFP4 take their file's size; widened to float32 they could exceed the machine
  if (mxfp4.size() != static_cast<size_t>(2 * config.num_layers)) {
    try {
      check_stacked_experts_fit(config);
    } catch (const ValueError& e) {
      throw IoError(dir.string() + ": " + e.what());
    }
  }
  auto model = Decoder::for_loading(config);  // every parameter is written below: no zero fill first
  bool in_place = false;
  read_layout(*model, Names::Own, [&](const DecoderConfig::Parameter& p, Tensor& dst) {
    if (const auto m = mxfp4.find(p.name); m != mxfp4.end()) {  // kept as MXFP4 rows, in ggml's block layout
      const Mxfp4Entry& e = m->second;
      const int64_t groups = e.rows * (e.cols / 32);
      const std::shared_ptr<unsigned char> bytes = io::copy_buffer(static_cast<size_t>(groups * 17));
      io::mxfp4_blocks_from_hf(e.blocks_file->bytes(*e.blocks).data(), e.scales_file->bytes(*e.scales).data(), groups,
                               bytes.get());
      dst.set_stored_(kernels::WeightType::MXFP4, Shape{e.rows, e.cols}, bytes.get(), bytes);
      return;
    }
    const io::SafetensorsFile& file = shards.files[shards.where.at(p.name)];
    if (matrices == DType::BF16 && dst.rank() == 2) {
      // A bfloat16 matrix is used where the file is mapped: nothing is copied (loading is reading the file once, to
      // check its values), and its pages are the page cache's, shared with any other process using the folder.
      if (io::SafetensorsFile::InPlace mapped = file.bf16_in_place(p.name, dst.shape()); mapped.bytes) {
        dst.set_stored_(kernels::WeightType::BF16, mapped.bytes, std::move(mapped.owner));
        in_place = true;
        return;
      }
      dst.to_bf16_(/*keep_values=*/false);  // read below
    }
    file.read_weights(p.name, dst);
  });
  if (in_place) model->refresh_fused_views();  // a fused group's role views, over its new storage
  return model;
}

void save_hf_folder(const std::string& dir_name, Decoder& model, HfDType dtype) {
  const fs::path dir(dir_name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) throw IoError(dir.string() + ": cannot create the folder (" + ec.message() + ")");
  const std::string config = decoder_config_to_hf(model.config, dtype);
  io::save_safetensors((dir / "model.safetensors").string(), layout_tensors(model, Names::Own, dtype), {{"format", "pt"}});
  io::write_file_atomically((dir / "config.json").string(),
                            std::span(reinterpret_cast<const std::byte*>(config.data()), config.size()));
}

}  // namespace qkv::nn
