// The decoder composed from its config (see qkv/nn/decoder.hpp): the parameter table, the module built from it, and
// the forward pass, loss, attention pictures and KV-cache inference.
#include "qkv/nn/decoder.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <tuple>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/inference.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/session.hpp"

namespace qkv::nn {

namespace {

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

// What each role is, for initialisation, freezing and messages.
// Other: drawn like a matrix (normal(0, 0.02)) but never quantized nor adapted: gpt-oss's sinks and stacked experts
enum class Kind { Embedding, Matrix, Norm, Bias, Other };
struct RoleInfo {
  Role role;
  const char* name;
  Kind kind;
};
constexpr RoleInfo kRoles[kRoleCount] = {
    {Role::TokenEmbedding, "token embedding", Kind::Embedding},
    {Role::PositionEmbedding, "position embedding", Kind::Embedding},
    {Role::FinalNorm, "final norm", Kind::Norm},
    {Role::FinalNormBias, "final norm bias", Kind::Bias},
    {Role::Head, "output head", Kind::Matrix},
    {Role::AttnNorm, "attention norm", Kind::Norm},
    {Role::AttnNormBias, "attention norm bias", Kind::Bias},
    {Role::Query, "query", Kind::Matrix},
    {Role::QueryBias, "query bias", Kind::Bias},
    {Role::Key, "key", Kind::Matrix},
    {Role::KeyBias, "key bias", Kind::Bias},
    {Role::Value, "value", Kind::Matrix},
    {Role::ValueBias, "value bias", Kind::Bias},
    {Role::Output, "attention output", Kind::Matrix},
    {Role::OutputBias, "attention output bias", Kind::Bias},
    {Role::QueryNorm, "query norm", Kind::Norm},
    {Role::KeyNorm, "key norm", Kind::Norm},
    {Role::PostAttnNorm, "post-attention norm", Kind::Norm},
    {Role::MlpNorm, "MLP norm", Kind::Norm},
    {Role::MlpNormBias, "MLP norm bias", Kind::Bias},
    {Role::PostMlpNorm, "post-MLP norm", Kind::Norm},
    {Role::Gate, "gate", Kind::Matrix},
    {Role::GateBias, "gate bias", Kind::Bias},
    {Role::Up, "up", Kind::Matrix},
    {Role::UpBias, "up bias", Kind::Bias},
    {Role::Down, "down", Kind::Matrix},
    {Role::DownBias, "down bias", Kind::Bias},
    {Role::HeadBias, "classifier head bias", Kind::Bias},
    {Role::Router, "expert router", Kind::Matrix},
    {Role::ExpertGate, "expert gate", Kind::Matrix},
    {Role::ExpertUp, "expert up", Kind::Matrix},
    {Role::ExpertDown, "expert down", Kind::Matrix},
    {Role::QueryA, "query down-projection", Kind::Matrix},
    {Role::QueryANorm, "query latent norm", Kind::Norm},
    {Role::QueryB, "query up-projection", Kind::Matrix},
    {Role::LatentA, "KV latent down-projection", Kind::Matrix},
    {Role::LatentNorm, "KV latent norm", Kind::Norm},
    {Role::LatentB, "KV latent up-projection", Kind::Matrix},
    {Role::RouterBias, "expert score correction bias", Kind::Bias},
    {Role::SharedGate, "shared expert gate", Kind::Matrix},
    {Role::SharedUp, "shared expert up", Kind::Matrix},
    {Role::SharedDown, "shared expert down", Kind::Matrix},
    {Role::Sinks, "attention sinks", Kind::Other},
    {Role::RouterLogitBias, "expert router bias", Kind::Bias},
    {Role::StackedGateUp, "experts' gate and up", Kind::Other},
    {Role::StackedGateUpBias, "experts' gate and up bias", Kind::Bias},
    {Role::StackedDown, "experts' down", Kind::Other},
    {Role::StackedDownBias, "experts' down bias", Kind::Bias},
    {Role::DeltaQkvz, "Gated DeltaNet qkvz projection", Kind::Matrix},
    {Role::DeltaBa, "Gated DeltaNet beta and decay projection", Kind::Matrix},
    {Role::DeltaConv, "Gated DeltaNet convolution", Kind::Other},
    {Role::DeltaDtBias, "Gated DeltaNet dt bias", Kind::Other},
    {Role::DeltaALog, "Gated DeltaNet A_log", Kind::Other},
    {Role::DeltaNorm, "Gated DeltaNet gated norm", Kind::Norm},
    {Role::DeltaOut, "Gated DeltaNet output", Kind::Matrix},
    {Role::SharedExpertGate, "shared expert gate", Kind::Matrix},
};
Kind kind_of(Role r) { return kRoles[static_cast<size_t>(r)].kind; }
}  // namespace

bool role_is_matrix(Role r) {
  return kind_of(r) == Kind::Matrix || kind_of(r) == Kind::Embedding || r == Role::StackedGateUp || r == Role::StackedDown;
}

namespace {

// The roles LoRA's presets choose by (module.hpp's LoraRoles bits).
unsigned lora_role_bit(Role r) {
  switch (r) {
    case Role::Query: return kLoraQuery;
    case Role::Key: return kLoraKey;
    case Role::Value: return kLoraValue;
    case Role::Output: return kLoraOutput;
    case Role::Gate: return kLoraGate;
    case Role::Up: return kLoraUp;
    case Role::Down: return kLoraDown;
    case Role::ExpertGate: return kLoraGate;  // each expert's projections are the MLP's, as PEFT's all-linear takes them
    case Role::ExpertUp: return kLoraUp;
    case Role::ExpertDown: return kLoraDown;
    default: return 0;
  }
}

// The bias role of a projection role.
Role bias_of(Role r) {
  switch (r) {
    case Role::Query: return Role::QueryBias;
    case Role::Key: return Role::KeyBias;
    case Role::Value: return Role::ValueBias;
    case Role::Output: return Role::OutputBias;
    case Role::Gate: return Role::GateBias;
    case Role::Up: return Role::UpBias;
    default: return Role::DownBias;
  }
}

// The layout of a block under the book's names (chapter 4's GPTModel), in its registration order.
void book_block(const DecoderConfig& c, int64_t i, std::vector<DecoderConfig::Parameter>& out) {
  const int64_t C = c.hidden_size, F = c.intermediate_size;
  const std::string b = "trf_blocks." + std::to_string(i) + ".";
  auto add = [&](std::string name, Shape shape, Role role) {
    out.push_back({std::move(name), shape, {{role, 0, shape[0]}}, false, i});
  };
  for (const auto& [w, role] : {std::pair{"W_query", Role::Query}, {"W_key", Role::Key}, {"W_value", Role::Value}}) {
    add(b + "att." + w + ".weight", {C, C}, role);
    if (c.qkv_bias) add(b + "att." + w + ".bias", {C}, bias_of(role));
  }
  add(b + "att.out_proj.weight", {C, C}, Role::Output);
  add(b + "att.out_proj.bias", {C}, Role::OutputBias);
  add(b + "ff.layers.0.weight", {F, C}, Role::Up);
  add(b + "ff.layers.0.bias", {F}, Role::UpBias);
  add(b + "ff.layers.2.weight", {C, F}, Role::Down);
  add(b + "ff.layers.2.bias", {C}, Role::DownBias);
  add(b + "norm1.scale", {C}, Role::AttnNorm);
  add(b + "norm1.shift", {C}, Role::AttnNormBias);
  add(b + "norm2.scale", {C}, Role::MlpNorm);
  add(b + "norm2.shift", {C}, Role::MlpNormBias);
}

// The same block in Hugging Face's GPT-2 files (GPT2LMHeadModel): Conv1D weights stored (in, out), q/k/v in c_attn.
void hf_gpt2_block(const DecoderConfig& c, int64_t i, std::vector<DecoderConfig::Parameter>& out) {
  const int64_t C = c.hidden_size, F = c.intermediate_size;
  const std::string h = "h." + std::to_string(i) + ".";
  auto add = [&](std::string name, Shape shape, std::vector<DecoderConfig::Part> parts, bool transposed = false) {
    out.push_back({std::move(name), shape, std::move(parts), transposed, i});
  };
  add(h + "ln_1.weight", {C}, {{Role::AttnNorm, 0, C}});
  add(h + "ln_1.bias", {C}, {{Role::AttnNormBias, 0, C}});
  add(h + "attn.c_attn.weight", {C, 3 * C}, {{Role::Query, 0, C}, {Role::Key, C, C}, {Role::Value, 2 * C, C}}, true);
  // GPT-2's files always carry the q/k/v bias: zeros for a model without one.
  add(h + "attn.c_attn.bias", {3 * C}, {{Role::QueryBias, 0, C}, {Role::KeyBias, C, C}, {Role::ValueBias, 2 * C, C}});
  add(h + "attn.c_proj.weight", {C, C}, {{Role::Output, 0, C}}, true);
  add(h + "attn.c_proj.bias", {C}, {{Role::OutputBias, 0, C}});
  add(h + "ln_2.weight", {C}, {{Role::MlpNorm, 0, C}});
  add(h + "ln_2.bias", {C}, {{Role::MlpNormBias, 0, C}});
  add(h + "mlp.c_fc.weight", {C, F}, {{Role::Up, 0, F}}, true);
  add(h + "mlp.c_fc.bias", {F}, {{Role::UpBias, 0, F}});
  add(h + "mlp.c_proj.weight", {F, C}, {{Role::Down, 0, C}}, true);
  add(h + "mlp.c_proj.bias", {C}, {{Role::DownBias, 0, C}});
}

// A block under Hugging Face's names for today's decoders, in transformers' registration order: self_attn (its
// projections, fused or not, then q_norm and k_norm), mlp, then the norms where the placement puts them.
void hf_block(const DecoderConfig& c, int64_t i, std::vector<DecoderConfig::Parameter>& out) {
  const int64_t C = c.hidden_size, F = c.intermediate_size, Q = c.q_width(), KV = c.kv_width(), D = c.head_dim;
  const Family& f = *c.family;
  const std::string b = "model.layers." + std::to_string(i) + ".";
  auto add = [&](std::string name, Shape shape, std::vector<DecoderConfig::Part> parts) {
    out.push_back({std::move(name), shape, std::move(parts), false, i});
  };
  auto projection = [&](const std::string& name, int64_t rows, int64_t in, Role role, bool bias) {
    add(b + name + ".weight", {rows, in}, {{role, 0, rows}});
    if (bias) add(b + name + ".bias", {rows}, {{bias_of(role), 0, rows}});
  };
  const bool linear = i < static_cast<int64_t>(c.layers.size()) && c.layers[static_cast<size_t>(i)].linear;
  if (linear) {  // Qwen3NextGatedDeltaNet, in its registration order
    const int64_t Kd = c.linear_key_heads * c.linear_key_dim, Vd = c.linear_value_heads * c.linear_value_dim;
    const int64_t conv = c.linear_conv_width(), nv = c.linear_value_heads;
    add(b + "linear_attn.conv1d.weight", {conv, 1, c.linear_conv_kernel}, {{Role::DeltaConv, 0, conv}});
    projection("linear_attn.in_proj_qkvz", 2 * Kd + 2 * Vd, C, Role::DeltaQkvz, false);
    projection("linear_attn.in_proj_ba", 2 * nv, C, Role::DeltaBa, false);
    add(b + "linear_attn.dt_bias", {nv}, {{Role::DeltaDtBias, 0, nv}});
    add(b + "linear_attn.A_log", {nv}, {{Role::DeltaALog, 0, nv}});
    add(b + "linear_attn.norm.weight", {c.linear_value_dim}, {{Role::DeltaNorm, 0, c.linear_value_dim}});
    projection("linear_attn.out_proj", C, Vd, Role::DeltaOut, false);
  } else if (c.latent()) {  // DeepseekV3Attention, in its registration order
    const int64_t H = c.num_heads, R = c.kv_lora_rank, Rq = c.q_lora_rank, dr = c.head_dim;
    if (Rq > 0) {
      projection("self_attn.q_a_proj", Rq, C, Role::QueryA, false);
      add(b + "self_attn.q_a_layernorm.weight", {Rq}, {{Role::QueryANorm, 0, Rq}});
      projection("self_attn.q_b_proj", Q, Rq, Role::QueryB, false);
    } else {
      projection("self_attn.q_proj", Q, C, Role::Query, false);
    }
    projection("self_attn.kv_a_proj_with_mqa", R + dr, C, Role::LatentA, false);
    add(b + "self_attn.kv_a_layernorm.weight", {R}, {{Role::LatentNorm, 0, R}});
    projection("self_attn.kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), R, Role::LatentB, false);
    projection("self_attn.o_proj", C, H * c.v_head_dim, Role::Output, false);
  } else if (f.fused_qkv) {  // Phi-3: o_proj is registered first, then qkv_proj (rows q, k, v)
    projection("self_attn.o_proj", C, Q, Role::Output, c.o_bias);
    add(b + "self_attn.qkv_proj.weight", {Q + 2 * KV, C}, {{Role::Query, 0, Q}, {Role::Key, Q, KV}, {Role::Value, Q + KV, KV}});
    if (c.qkv_bias)
      add(b + "self_attn.qkv_proj.bias", {Q + 2 * KV},
          {{Role::QueryBias, 0, Q}, {Role::KeyBias, Q, KV}, {Role::ValueBias, Q + KV, KV}});
  } else {
    // gpt-oss's sinks: GptOssAttention's own parameter, listed before its projections in the state dict
    if (f.sinks) add(b + "self_attn.sinks", {c.num_heads}, {{Role::Sinks, 0, c.num_heads}});
    // gated attention: each head's query values then its gate values
    projection("self_attn.q_proj", c.gated_attention ? 2 * Q : Q, C, Role::Query, c.qkv_bias);
    projection("self_attn.k_proj", KV, C, Role::Key, c.qkv_bias);
    projection("self_attn.v_proj", KV, C, Role::Value, c.qkv_bias);
    projection("self_attn.o_proj", C, Q, Role::Output, c.o_bias);
  }
  if (c.qk_norm != QkNorm::None && !linear) {  // per head: (D); over the projection (OLMo 2): (H·D) and (H_kv·D)
    const bool whole = c.qk_norm == QkNorm::Projection;
    add(b + "self_attn.q_norm.weight", {whole ? Q : D}, {{Role::QueryNorm, 0, whole ? Q : D}});
    add(b + "self_attn.k_norm.weight", {whole ? KV : D}, {{Role::KeyNorm, 0, whole ? KV : D}});
  }
  const bool experts = i < static_cast<int64_t>(c.layers.size()) && c.layers[static_cast<size_t>(i)].experts;
  if (experts && f.stacked_experts) {  // GptOssMLP: router (weight, bias), then experts, each stacked
    const int64_t E = c.num_experts, Fe = c.expert_intermediate_size;
    add(b + "mlp.router.weight", {E, C}, {{Role::Router, 0, E}});
    add(b + "mlp.router.bias", {E}, {{Role::RouterLogitBias, 0, E}});
    add(b + "mlp.experts.gate_up_proj", {E, C, 2 * Fe}, {{Role::StackedGateUp, 0, E}});
    add(b + "mlp.experts.gate_up_proj_bias", {E, 2 * Fe}, {{Role::StackedGateUpBias, 0, E}});
    add(b + "mlp.experts.down_proj", {E, Fe, C}, {{Role::StackedDown, 0, E}});
    add(b + "mlp.experts.down_proj_bias", {E, C}, {{Role::StackedDownBias, 0, E}});
  } else if (experts) {  // Qwen3MoeSparseMoeBlock: gate (the router), then experts.N; DeepseekV3MoE: experts.N, gate
                   // (its weight, then the e_score_correction_bias buffer), then shared_experts
    const int64_t E = c.num_experts, Fe = c.expert_intermediate_size;
    if (!c.sigmoid_router) add(b + "mlp.gate.weight", {E, C}, {{Role::Router, 0, E}});
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = b + "mlp.experts." + std::to_string(e) + ".";
      for (auto [name, shape, role] : {std::tuple{"gate_proj", Shape{Fe, C}, Role::ExpertGate},
                                       {"up_proj", Shape{Fe, C}, Role::ExpertUp}, {"down_proj", Shape{C, Fe}, Role::ExpertDown}}) {
        add(x + name + ".weight", shape, {{role, 0, shape[0]}});
        out.back().expert = e;
      }
    }
    if (c.sigmoid_router) {
      add(b + "mlp.gate.weight", {E, C}, {{Role::Router, 0, E}});
      add(b + "mlp.gate.e_score_correction_bias", {E}, {{Role::RouterBias, 0, E}});
    }
    if (const int64_t Fs = c.shared_expert_intermediate_size; Fs > 0) {
      // DeepseekV3MoE's shared_experts; Qwen3NextSparseMoeBlock's shared_expert, then its shared_expert_gate
      const std::string shared = b + (c.shared_expert_gate ? "mlp.shared_expert." : "mlp.shared_experts.");
      add(shared + "gate_proj.weight", {Fs, C}, {{Role::SharedGate, 0, Fs}});
      add(shared + "up_proj.weight", {Fs, C}, {{Role::SharedUp, 0, Fs}});
      add(shared + "down_proj.weight", {C, Fs}, {{Role::SharedDown, 0, C}});
      if (c.shared_expert_gate) add(b + "mlp.shared_expert_gate.weight", {1, C}, {{Role::SharedExpertGate, 0, 1}});
    }
  } else if (c.mlp == MlpKind::GELU) {
    projection("mlp.up_proj", F, C, Role::Up, c.mlp_bias);
  } else if (f.fused_gate_up) {  // Phi-3: gate_up_proj's first half is the gate
    add(b + "mlp.gate_up_proj.weight", {2 * F, C}, {{Role::Gate, 0, F}, {Role::Up, F, F}});
    if (c.mlp_bias) add(b + "mlp.gate_up_proj.bias", {2 * F}, {{Role::GateBias, 0, F}, {Role::UpBias, F, F}});
  } else {
    projection("mlp.gate_proj", F, C, Role::Gate, c.mlp_bias);
    projection("mlp.up_proj", F, C, Role::Up, c.mlp_bias);
  }
  if (!experts) projection("mlp.down_proj", C, F, Role::Down, c.mlp_bias);
  auto norm = [&](const char* name, Role role) { add(b + name + ".weight", {C}, {{role, 0, C}}); };
  switch (c.placement) {
    case NormPlacement::Pre:  // post_attention_layernorm is the norm before the MLP
      norm("input_layernorm", Role::AttnNorm);
      norm("post_attention_layernorm", Role::MlpNorm);
      break;
    case NormPlacement::Sandwich:  // post_attention_layernorm is the norm after attention; a pre-MLP norm follows
      norm("input_layernorm", Role::AttnNorm);
      norm("post_attention_layernorm", Role::PostAttnNorm);
      norm("pre_feedforward_layernorm", Role::MlpNorm);
      norm("post_feedforward_layernorm", Role::PostMlpNorm);
      break;
    case NormPlacement::Post:  // OLMo 2: the norms sit after attention and after the MLP, none before
      norm("post_attention_layernorm", Role::PostAttnNorm);
      norm("post_feedforward_layernorm", Role::PostMlpNorm);
      break;
  }
}

// A rotation's settings, each checked: ValueError naming the one that cannot be used.
void validate_rope(const RopeFrequencies& r) {
  auto fail = [](const std::string& what) { invalid("RoPE: " + what); };
  if (!(r.theta > 1.0) || !std::isfinite(r.theta)) fail("rope_theta must be a finite number above 1, got " + std::to_string(r.theta));
  if (!(r.factor > 0.0) || !std::isfinite(r.factor)) fail("the scaling factor must be positive");
  if (!(r.attention_factor > 0.0) || !std::isfinite(r.attention_factor)) fail("attention_factor must be positive");
  if (r.rotary_dim < 0) fail("the rotary dimension must not be negative");
  if ((r.scaling == RopeFrequencies::Scaling::Llama3 || r.scaling == RopeFrequencies::Scaling::Yarn || r.scaling == RopeFrequencies::Scaling::LongRope) &&
      !(r.original_max_position_embeddings >= 1.0 && std::isfinite(r.original_max_position_embeddings)))
    fail("original_max_position_embeddings must be a positive number");
  if (r.scaling == RopeFrequencies::Scaling::Llama3 && (!(r.high_freq_factor > r.low_freq_factor) || !(r.low_freq_factor > 0)))
    fail("llama3 scaling needs 0 < low_freq_factor < high_freq_factor");
  if (r.scaling == RopeFrequencies::Scaling::Yarn && (!(r.beta_fast > 0) || !(r.beta_slow > 0) || !std::isfinite(r.beta_fast) || !std::isfinite(r.beta_slow)))
    fail("yarn's beta_fast and beta_slow must be positive");
  if (r.scaling == RopeFrequencies::Scaling::Proportional && (r.rotated_pairs < 1 || r.rotary_dim != 0))
    fail("proportional RoPE turns 1 or more pairs of the whole head (partial_rotary_factor · head_dim ≥ 2)");
  if (r.scaling == RopeFrequencies::Scaling::LongRope) {
    if (r.short_factor.size() != r.long_factor.size() || r.short_factor.empty())
      fail("longrope's short_factor and long_factor must be lists of one length (half the rotated dimensions)");
    for (const auto* list : {&r.short_factor, &r.long_factor})
      for (double v : *list)
        if (!(v > 0.0) || !std::isfinite(v)) fail("longrope's factors must be positive numbers");
  }
}

}  // namespace

const char* role_name(Role role) { return kRoles[static_cast<size_t>(role)].name; }

bool DecoderConfig::has_linear_layers() const {
  return std::any_of(layers.begin(), layers.end(), [](const DecoderLayerSettings& l) { return l.linear; });
}

void DecoderConfig::validate() const {
  if (!family) invalid("no family");
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_layers, "num_hidden_layers");
  if (num_layers > 65536) invalid("num_hidden_layers = " + std::to_string(num_layers) + " is more than qkv takes (65536)");
  positive(num_heads, "num_attention_heads");
  positive(num_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(max_positions, "max_position_embeddings");
  if (num_labels < 0) invalid("num_labels must not be negative");
  if (!labels.empty() && static_cast<int64_t>(labels.size()) != num_labels)
    invalid(std::to_string(labels.size()) + " label names for " + std::to_string(num_labels) + " classes");
  if (num_heads % num_kv_heads != 0) {
    invalid("num_key_value_heads = " + std::to_string(num_kv_heads) + " does not divide num_attention_heads = " +
            std::to_string(num_heads) + " (grouped-query attention shares each K/V head among a whole group)");
  }
  if (!(norm_eps > 0.0 && norm_eps < 1.0)) invalid("the norm epsilon must lie in (0, 1), got " + std::to_string(norm_eps));
  if (!(drop_rate >= 0.0 && drop_rate < 1.0)) invalid("drop_rate must lie in [0, 1)");
  if (!(attention_dropout >= 0.0 && attention_dropout < 1.0)) invalid("attention_dropout must lie in [0, 1)");
  for (double v : {attention_scale, embedding_scale, attn_softcap, final_softcap})
    if (!(v >= 0.0) || !std::isfinite(v))
      invalid("attention_scale, embedding_scale and the soft-capping values must be finite and ≥ 0");
  if (static_cast<int64_t>(layers.size()) != num_layers) {
    invalid(std::to_string(layers.size()) + " layer settings for " + std::to_string(num_layers) + " layers");
  }
  if (learned_positions != ropes.empty()) invalid("a decoder has either learned positions or RoPE frequencies");
  for (const auto& r : ropes) {
    const int64_t rotated = r.rotary_dim > 0 ? r.rotary_dim : head_dim;
    if (rotated % 2 != 0 || rotated > head_dim)
      invalid("RoPE rotates an even number of each head's " + std::to_string(head_dim) + " values, not " +
              std::to_string(rotated));
    validate_rope(r);
  }
  if (latent() || family->latent_attention) {
    if (!family->latent_attention) invalid("the " + family->name + " family has no latent attention (kv_lora_rank)");
    positive(kv_lora_rank, "kv_lora_rank");
    positive(qk_nope_head_dim, "qk_nope_head_dim");
    positive(v_head_dim, "v_head_dim");
    if (q_lora_rank < 0) invalid("q_lora_rank must be positive or null, got " + std::to_string(q_lora_rank));
    if (head_dim % 2 != 0) invalid("qk_rope_head_dim must be even (RoPE rotates pairs), got " + std::to_string(head_dim));
    if (num_kv_heads != num_heads) invalid("latent attention expands K and V for every head: num_key_value_heads must equal num_attention_heads");
    if (qkv_bias || o_bias) invalid("attention_bias: latent attention's projections without biases only");
    if (qk_norm != QkNorm::None || learned_positions) invalid("latent attention has no q/k norms and rotates with RoPE");
    for (const auto& l : layers)
      if (l.window > 0) invalid("latent attention has no sliding window");
    product({num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank});
    product({num_heads, qk_head_dim(), std::max<int64_t>(q_lora_rank, hidden_size)});
  }
  if (sigmoid_router) {
    if (expert_groups < 1 || num_experts % expert_groups != 0)
      invalid("n_group = " + std::to_string(expert_groups) + " must divide n_routed_experts = " + std::to_string(num_experts));
    if (expert_groups > 1 && num_experts / expert_groups < 2)
      invalid("n_group = " + std::to_string(expert_groups) + " leaves fewer than two experts a group (each group is scored by its two best)");
    if (expert_groups_kept < 1 || expert_groups_kept > expert_groups)
      invalid("topk_group = " + std::to_string(expert_groups_kept) + " must lie in 1…n_group (" + std::to_string(expert_groups) + ")");
    if (experts_per_token > expert_groups_kept * (num_experts / expert_groups))
      invalid("num_experts_per_tok = " + std::to_string(experts_per_token) + " is more than topk_group groups hold (" +
              std::to_string(expert_groups_kept * (num_experts / expert_groups)) + ")");
    if (!(routed_scaling_factor > 0.0) || !std::isfinite(routed_scaling_factor))
      invalid("routed_scaling_factor must be a positive number");
  }
  if (shared_expert_intermediate_size < 0) invalid("n_shared_experts must not be negative");
  if (!(swiglu_limit >= 0.0) || !std::isfinite(swiglu_limit))
    invalid("swiglu_limit must be a finite number ≥ 0 (0: no clamp), got " + std::to_string(swiglu_limit));
  if (swiglu_limit > 0.0 && !family->stacked_experts) invalid("swiglu_limit is gpt-oss's; the " + family->name + " family has none");
  if (family->sinks && (latent() || learned_positions)) invalid("attention sinks need the plain attention");
  const bool any_experts = std::any_of(layers.begin(), layers.end(), [](const auto& l) { return l.experts; });
  if (any_experts || num_experts > 0) {
    if (!family->experts) invalid("the " + family->name + " family has no mixture-of-experts layers");
    positive(num_experts, "num_experts");
    positive(expert_intermediate_size, "moe_intermediate_size");
    if (experts_per_token < 1 || experts_per_token > num_experts)
      invalid("num_experts_per_tok = " + std::to_string(experts_per_token) + " must lie in 1…num_experts (" +
              std::to_string(num_experts) + ")");
    if (mlp != MlpKind::SwiGLU || mlp_bias) invalid("mixture-of-experts layers are SwiGLU experts (their biases, gpt-oss's, are the family's)");
    if (family->stacked_experts && (sigmoid_router || shared_expert_intermediate_size > 0))
      invalid("gpt-oss's experts have a softmax router and no shared experts");
    product({num_experts, 3, expert_intermediate_size, hidden_size});
  }
  if ((gated_attention || shared_expert_gate || has_linear_layers()) && !family->linear_attention)
    invalid("gated attention, a gated shared expert and Gated DeltaNet layers are Qwen3-Next's; the " + family->name +
            " family has none");
  if (has_linear_layers()) {
    positive(linear_key_heads, "linear_num_key_heads");
    positive(linear_key_dim, "linear_key_head_dim");
    positive(linear_value_heads, "linear_num_value_heads");
    positive(linear_value_dim, "linear_value_head_dim");
    positive(linear_conv_kernel, "linear_conv_kernel_dim");
    if (linear_value_heads % linear_key_heads != 0)
      invalid("linear_num_value_heads = " + std::to_string(linear_value_heads) + " must be a multiple of linear_num_key_heads = " +
              std::to_string(linear_key_heads) + " (each key head serves a group of value heads)");
    if (linear_conv_kernel > 64) invalid("linear_conv_kernel_dim = " + std::to_string(linear_conv_kernel) + " is more than qkv takes (64)");
    product({linear_value_heads, linear_key_dim, linear_value_dim});
    product({2 * linear_key_heads * linear_key_dim + 2 * linear_value_heads * linear_value_dim, hidden_size});
    for (size_t i = 0; i < layers.size(); ++i)
      if (layers[i].linear && layers[i].window > 0) invalid("layer " + std::to_string(i) + " is Gated DeltaNet: it has no sliding window");
  }
  if (shared_expert_gate && shared_expert_intermediate_size <= 0)
    invalid("a gated shared expert needs shared_expert_intermediate_size > 0");
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].window < 0) invalid("layer " + std::to_string(i) + " has a negative sliding window");
    if (!learned_positions && (layers[i].rope < -1 || layers[i].rope >= static_cast<int64_t>(ropes.size())))
      invalid("layer " + std::to_string(i) + " names RoPE " + std::to_string(layers[i].rope) + " of " + std::to_string(ropes.size()));
  }
  for (int64_t id : eos_token_ids)
    if (id < 0 || id >= vocab_size) invalid("eos_token_id " + std::to_string(id) + " is outside the vocabulary");
  if (family->naming == Naming::Book &&
      !(learned_positions && norm == NormKind::LayerNorm && mlp == MlpKind::GELU && o_bias && mlp_bias &&
        q_width() == hidden_size && num_kv_heads == num_heads && qk_norm == QkNorm::None &&
        placement == NormPlacement::Pre && final_softcap == 0.0)) {
    invalid("the " + family->name + " family is learned positions, pre-LayerNorm blocks, a GELU MLP with biases and "
            "full multi-head attention");
  }
  if (family->naming == Naming::HuggingFace && (norm == NormKind::LayerNorm || learned_positions))
    invalid("family " + family->name + " has no names for LayerNorm or learned positions");
  (void)parameter_count();
}

namespace {
// llama.cpp's name of a layout entry (convert_hf_to_gguf's tensor map): by its role, fused or not, and its layer.
std::string gguf_name(const DecoderConfig::Parameter& p) {
  const bool fused = p.parts.size() > 1;
  const char* base = nullptr;
  switch (p.role()) {
    case Role::TokenEmbedding: return "token_embd.weight";
    case Role::PositionEmbedding: return "position_embd.weight";
    case Role::FinalNorm: return "output_norm.weight";
    case Role::FinalNormBias: return "output_norm.bias";
    case Role::Head: return "output.weight";
    case Role::HeadBias: return "output.bias";
    case Role::AttnNorm: base = "attn_norm.weight"; break;
    case Role::AttnNormBias: base = "attn_norm.bias"; break;
    case Role::Query: base = fused ? "attn_qkv.weight" : "attn_q.weight"; break;
    case Role::QueryBias: base = fused ? "attn_qkv.bias" : "attn_q.bias"; break;
    case Role::Key: base = "attn_k.weight"; break;
    case Role::KeyBias: base = "attn_k.bias"; break;
    case Role::Value: base = "attn_v.weight"; break;
    case Role::ValueBias: base = "attn_v.bias"; break;
    case Role::Output: base = "attn_output.weight"; break;
    case Role::OutputBias: base = "attn_output.bias"; break;
    case Role::QueryNorm: base = "attn_q_norm.weight"; break;
    case Role::KeyNorm: base = "attn_k_norm.weight"; break;
    case Role::PostAttnNorm: base = "post_attention_norm.weight"; break;
    case Role::MlpNorm: base = "ffn_norm.weight"; break;
    case Role::MlpNormBias: base = "ffn_norm.bias"; break;
    case Role::PostMlpNorm: base = "post_ffw_norm.weight"; break;
    case Role::Gate: base = fused ? "ffn_up.weight" : "ffn_gate.weight"; break;  // Phi-3's gate_up is its ffn_up
    case Role::GateBias: base = fused ? "ffn_up.bias" : "ffn_gate.bias"; break;
    case Role::Up: base = "ffn_up.weight"; break;
    case Role::UpBias: base = "ffn_up.bias"; break;
    case Role::Down: base = "ffn_down.weight"; break;
    case Role::DownBias: base = "ffn_down.bias"; break;
    // A layer's experts are one 3-D tensor (experts × rows × cols): every expert's parameter names it
    case Role::Router: base = "ffn_gate_inp.weight"; break;
    case Role::ExpertGate: base = "ffn_gate_exps.weight"; break;
    case Role::ExpertUp: base = "ffn_up_exps.weight"; break;
    case Role::ExpertDown: base = "ffn_down_exps.weight"; break;
    // DeepSeek-V3 (llama.cpp's deepseek2): the router's selection bias, the shared experts, latent attention — its
    // kv_b_proj split by DecoderConfig::layout into attn_k_b (each head's key rows, transposed) and attn_v_b
    case Role::RouterBias: base = "exp_probs_b.bias"; break;
    case Role::SharedGate: base = "ffn_gate_shexp.weight"; break;
    case Role::SharedUp: base = "ffn_up_shexp.weight"; break;
    case Role::SharedDown: base = "ffn_down_shexp.weight"; break;
    case Role::QueryA: base = "attn_q_a.weight"; break;
    case Role::QueryANorm: base = "attn_q_a_norm.weight"; break;
    case Role::QueryB: base = "attn_q_b.weight"; break;
    case Role::LatentA: base = "attn_kv_a_mqa.weight"; break;
    case Role::LatentNorm: base = "attn_kv_a_norm.weight"; break;
    case Role::LatentB: base = p.parts.front().row0 == 0 ? "attn_k_b.weight" : "attn_v_b.weight"; break;
    // gpt-oss (llama.cpp's gpt-oss): the stacked experts are split by DecoderConfig::layout into gate, up and down
    case Role::Sinks: base = "attn_sinks.weight"; break;
    case Role::RouterLogitBias: base = "ffn_gate_inp.bias"; break;
    case Role::StackedGateUp: base = p.parts.front().row0 == 0 ? "ffn_gate_exps.weight" : "ffn_up_exps.weight"; break;
    case Role::StackedGateUpBias: base = p.parts.front().row0 == 0 ? "ffn_gate_exps.bias" : "ffn_up_exps.bias"; break;
    case Role::StackedDown: base = "ffn_down_exps.weight"; break;
    case Role::StackedDownBias: base = "ffn_down_exps.bias"; break;
    // Qwen3-Next (llama.cpp's qwen3next): in_proj_qkvz split by DecoderConfig::layout into attn_qkv (every q, then
    // every k, then every v) and attn_gate (z); A_log stored as −exp(A_log), without a suffix
    case Role::DeltaQkvz: base = p.parts.front().row0 == 0 ? "attn_qkv.weight" : "attn_gate.weight"; break;
    case Role::DeltaBa: base = "ssm_ba.weight"; break;
    case Role::DeltaConv: base = "ssm_conv1d.weight"; break;
    case Role::DeltaDtBias: base = "ssm_dt.bias"; break;
    case Role::DeltaALog: base = "ssm_a"; break;
    case Role::DeltaNorm: base = "ssm_norm.weight"; break;
    case Role::DeltaOut: base = "ssm_out.weight"; break;
    case Role::SharedExpertGate: base = "ffn_gate_inp_shexp.weight"; break;
  }
  return "blk." + std::to_string(p.layer) + "." + base;
}
}  // namespace

std::vector<DecoderConfig::Parameter> DecoderConfig::layout(Names names) const {
  if (names == Names::Gguf) {
    if (family->naming == Naming::Book)
      invalid("the " + family->name + " family's GGUF names (llama.cpp's gpt2: fused attn_qkv) are not read by qkv yet");
    std::vector<Parameter> out;
    for (Parameter p : layout(Names::Own)) {
      if (family->stacked_experts) {
        // llama.cpp's gpt-oss: the norm before the experts is post_attention_norm, and each layer's stacked experts
        // are rows as ggml stores matrices — gate and up apart (the even and the odd columns of gate_up), each
        // expert's (F, C); down (C, F) — their biases split alike
        if (p.role() == Role::MlpNorm) {
          p.name = "blk." + std::to_string(p.layer) + ".post_attention_norm.weight";
          out.push_back(p);
          continue;
        }
        const int64_t E = num_experts, F = expert_intermediate_size, C = hidden_size;
        if (p.role() == Role::StackedGateUp || p.role() == Role::StackedGateUpBias) {
          const bool matrix = p.role() == Role::StackedGateUp;
          for (int64_t half = 0; half < 2; ++half) {
            Parameter q = p;
            q.shape = matrix ? Shape{E, F, C} : Shape{E, F};
            q.parts = {{p.role(), half * F, F}};  // rows [row0, row0 + F) of [gate rows; up rows]
            q.transposed = matrix;
            q.name = gguf_name(q);
            out.push_back(q);
          }
          continue;
        }
        if (p.role() == Role::StackedDown) {
          p.shape = Shape{E, C, F};
          p.transposed = true;
        }
      }
      if (family->linear_attention) {  // llama.cpp's qwen3next
        if (p.role() == Role::MlpNorm) {  // the norm before the experts is its post_attention_norm
          p.name = "blk." + std::to_string(p.layer) + ".post_attention_norm.weight";
          out.push_back(p);
          continue;
        }
        if (p.role() == Role::DeltaConv) p.shape = Shape{p.shape[0], p.shape[2]};  // (channels, taps): the 1 dropped
        if (p.role() == Role::DeltaQkvz) {  // rows regrouped: q, k and v of every key head (attn_qkv), then z (attn_gate)
          const int64_t qkv = linear_conv_width(), z = linear_value_heads * linear_value_dim;
          for (const bool mixed : {true, false}) {
            Parameter q = p;
            q.shape = Shape{mixed ? qkv : z, hidden_size};
            q.parts = {{Role::DeltaQkvz, mixed ? 0 : qkv, mixed ? qkv : z}};
            q.name = gguf_name(q);
            out.push_back(q);
          }
          continue;
        }
      }
      if (p.role() == Role::LatentB) {
        // llama.cpp's deepseek2: per head h, kv_b_proj's dn key rows transposed — attn_k_b (H, R, dn) — and its dv
        // value rows as they are — attn_v_b (H, dv, R)
        const int64_t H = num_heads, R = kv_lora_rank, dn = qk_nope_head_dim, dv = v_head_dim;
        for (const bool keys : {true, false}) {
          Parameter q = p;
          q.shape = keys ? Shape{H, R, dn} : Shape{H, dv, R};
          q.parts = {{Role::LatentB, keys ? 0 : dn, keys ? dn : dv}};  // rows [row0, row0 + rows) of each head's block
          q.transposed = keys;
          q.name = gguf_name(q);
          out.push_back(q);
        }
        continue;
      }
      p.name = gguf_name(p);
      out.push_back(p);
    }
    return out;
  }
  const int64_t C = hidden_size, V = vocab_size;
  product({V, C});
  product({max_positions, C});
  product({q_width() + 2 * kv_width(), C});
  product({2, intermediate_size, C});
  std::vector<Parameter> out;
  auto add = [&](std::string name, Shape shape, Role role) {
    out.push_back({std::move(name), shape, {{role, 0, shape[0]}}, false, -1});
  };
  if (family->naming == Naming::Book && names == Names::HuggingFace) {  // GPT2LMHeadModel's files
    add("wte.weight", {V, C}, Role::TokenEmbedding);
    add("wpe.weight", {max_positions, C}, Role::PositionEmbedding);
    for (int64_t i = 0; i < num_layers; ++i) hf_gpt2_block(*this, i, out);
    add("ln_f.weight", {C}, Role::FinalNorm);
    add("ln_f.bias", {C}, Role::FinalNormBias);
    return out;
  }
  if (family->naming == Naming::Book) {  // the book's names (chapter 4's GPTModel), in its registration order
    add("tok_emb.weight", {V, C}, Role::TokenEmbedding);
    add("pos_emb.weight", {max_positions, C}, Role::PositionEmbedding);
    for (int64_t i = 0; i < num_layers; ++i) book_block(*this, i, out);
    add("final_norm.scale", {C}, Role::FinalNorm);
    add("final_norm.shift", {C}, Role::FinalNormBias);
    if (num_labels > 0) {  // the book's chapter 6: out_head = torch.nn.Linear(emb_dim, num_classes)
      add("out_head.weight", {num_labels, C}, Role::Head);
      add("out_head.bias", {num_labels}, Role::HeadBias);
    } else if (!tie_word_embeddings) {
      add("out_head.weight", {V, C}, Role::Head);
    }
    return out;
  }
  add("model.embed_tokens.weight", {V, C}, Role::TokenEmbedding);
  for (int64_t i = 0; i < num_layers; ++i) hf_block(*this, i, out);
  add("model.norm.weight", {C}, Role::FinalNorm);
  if (num_labels > 0) add("score.weight", {num_labels, C}, Role::Head);  // *ForSequenceClassification: no bias
  else if (!tie_word_embeddings) add("lm_head.weight", {V, C}, Role::Head);
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

// The rotation tables, built on first use for the positions asked and regrown by doubling: a model with 128 Ki
// positions need not hold 128 Ki × head_dim cosines to run 100 tokens. LongRoPE keeps a table for its short factors
// and one for its long ones.
struct RopeTables {
  std::mutex mutex;
  struct Rotation {
    std::vector<float> inverse_frequencies[2];  // short (or only), long
    std::shared_ptr<const RopeTable> tables[2];
    float scale = 1.0f;
  };
  std::vector<Rotation> rotations;
};

Decoder::Decoder(const DecoderConfig& c, Generator& gen) : Decoder(c, &gen) {}

std::unique_ptr<Decoder> Decoder::for_loading(const DecoderConfig& config) {
  auto generator = std::make_shared<Generator>(0);
  std::unique_ptr<Decoder> model(new Decoder(config, generator.get(), false));
  model->owned_generator_ = std::move(generator);
  return model;
}

namespace {
bool in_qkv(Role r) {
  return r == Role::Query || r == Role::Key || r == Role::Value || r == Role::QueryBias || r == Role::KeyBias ||
         r == Role::ValueBias;
}
bool in_gate_up(Role r, const DecoderConfig& c) {
  return c.mlp != MlpKind::GELU && (r == Role::Gate || r == Role::Up || r == Role::GateBias || r == Role::UpBias);
}
}  // namespace

Decoder::Decoder(const DecoderConfig& c, Generator* gen, bool fill) : config((c.validate(), c)), gen_(gen) {
  blocks.resize(static_cast<size_t>(c.num_layers));
  const float norm_identity = c.norm == NormKind::GemmaRMSNorm ? 0.0f : 1.0f;
  const int64_t C = c.hidden_size, F = c.intermediate_size, Q = c.q_width(), KV = c.kv_width();
  auto make = [fill](const Shape& shape) { return fill ? Tensor::zeros(shape) : Tensor::empty(shape); };
  // Each block's q, k and v (and their biases) lie back to back in one buffer, and so do a gated MLP's gate and up:
  // one product reads each group in place (linear_concat), and a fused checkpoint entry (Phi-3's qkv_proj,
  // gate_up_proj) is the whole buffer.
  struct Homes {
    Tensor qkv, qkv_bias, gate_up, gate_up_bias;
  };
  std::vector<Homes> homes(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    DecoderBlock& b = blocks[i];
    Homes& h = homes[i];
    // latent attention's projections are each their own tensor; a Gated DeltaNet layer has none of these
    const bool attention = !c.latent() && !c.layers[i].linear;
    const int64_t Qr = c.gated_attention ? 2 * Q : Q;  // gated attention: each head's query and gate rows
    if (attention) {
      h.qkv = make({Qr + 2 * KV, C});
      b[Role::Query] = h.qkv.view_at(0, {Qr, C});
      b[Role::Key] = h.qkv.view_at(Qr * C, {KV, C});
      b[Role::Value] = h.qkv.view_at((Qr + KV) * C, {KV, C});
    }
    if (c.qkv_bias && attention) {
      h.qkv_bias = make({Qr + 2 * KV});
      b[Role::QueryBias] = h.qkv_bias.view_at(0, {Qr});
      b[Role::KeyBias] = h.qkv_bias.view_at(Qr, {KV});
      b[Role::ValueBias] = h.qkv_bias.view_at(Qr + KV, {KV});
    }
    if (c.layers[i].experts) {  // the experts, each its own registered tensors (below; gpt-oss's: four stacked ones)
      if (c.family->stacked_experts) continue;
      const size_t E = static_cast<size_t>(c.num_experts);
      b.expert_gate.resize(E);
      b.expert_up.resize(E);
      b.expert_down.resize(E);
      b.expert_gate_lora.resize(E);
      b.expert_up_lora.resize(E);
      b.expert_down_lora.resize(E);
    } else if (c.mlp != MlpKind::GELU) {
      h.gate_up = make({2 * F, C});
      b[Role::Gate] = h.gate_up.view_at(0, {F, C});
      b[Role::Up] = h.gate_up.view_at(F * C, {F, C});
      if (c.mlp_bias) {
        h.gate_up_bias = make({2 * F});
        b[Role::GateBias] = h.gate_up_bias.view_at(0, {F});
        b[Role::UpBias] = h.gate_up_bias.view_at(F, {F});
      }
    }
  }
  // Init::Book: torch.nn.Embedding and torch.nn.Linear's initialisation, in the book's order (the layout's): a
  // Linear's weight, then its bias uniform in ±1/√(its fan-in).
  const bool book = c.family->init == Init::Book;
  int64_t fan_in = 0;
  auto book_draw = [&](const DecoderConfig::Parameter& p, Tensor& t) {
    const Kind kind = kind_of(p.role());
    if (kind == Kind::Embedding) {
      gen->normal_(t, 0.0, 1.0);
    } else if (kind == Kind::Matrix) {
      kaiming_uniform_(t, std::sqrt(5.0), *gen);
      fan_in = p.shape[1];
    } else if (kind == Kind::Bias && p.role() != Role::AttnNormBias && p.role() != Role::MlpNormBias &&
               p.role() != Role::FinalNormBias) {  // a Linear's bias; a LayerNorm's shift stays 0
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      gen->uniform_(t, -bound, bound);
    }
  };
  for (const DecoderConfig::Parameter& p : c.layout()) {
    const Role role = p.role();
    Tensor t;
    if (p.layer >= 0 && ((in_qkv(role) && !c.latent()) || in_gate_up(role, c))) {
      const Homes& h = homes[static_cast<size_t>(p.layer)];
      if (p.parts.size() == 1) {
        t = blocks[static_cast<size_t>(p.layer)][role];
      } else {  // a fused entry: the whole group
        t = role == Role::Query ? h.qkv : role == Role::QueryBias ? h.qkv_bias : role == Role::Gate ? h.gate_up : h.gate_up_bias;
        QKV_CHECK(t.defined() && t.shape() == p.shape, "a fused entry is its whole group");
      }
    } else {
      t = make(p.shape);
    }
    const Kind kind = kind_of(role);
    if (!fill) {
    } else if (role == Role::DeltaNorm || role == Role::DeltaDtBias) {  // Qwen3-Next: a plain-w norm, dt_bias 1
      t.fill_(1.0f);
    } else if (role == Role::DeltaALog) {  // A_log = log(U(0, 16)): decay rates e^A_log between 0 and 16
      gen->uniform_(t, 0.0, 16.0);
      for (int64_t k = 0; k < t.numel(); ++k) t.data()[k] = std::log(std::max(t.data()[k], 1e-30f));
    } else if (kind == Kind::Norm) {
      t.fill_(norm_identity);
    } else if (book) {
      book_draw(p, t);
    } else if (kind != Kind::Bias) {
      gen->normal_(t, 0.0, 0.02);
    }
    // The book's MultiHeadAttention keeps its causal mask as a buffer: its state dict (and .pth files) name one per
    // block, recomputed here rather than stored.
    if (book && role == Role::Query)
      register_derived_buffer(block_prefix(p.layer) + "att.mask", Shape{c.max_positions, c.max_positions},
                              [n = c.max_positions] { return causal_mask(n); });
    Tensor& registered = register_parameter(p.name, t);
    if (p.layer < 0) {
      switch (role) {
        case Role::TokenEmbedding: tok_emb = registered; break;
        case Role::PositionEmbedding: pos_emb = registered; break;
        case Role::FinalNorm: final_norm = registered; break;
        case Role::FinalNormBias: final_norm_bias = registered; break;
        case Role::Head: head = registered; break;
        case Role::HeadBias: head_bias = registered; break;
        default: break;
      }
      continue;
    }
    // DeepSeek-V3's e_score_correction_bias is a buffer in transformers, set by its training's load balancing, not by
    // gradients: it only chooses experts, so no gradient reaches it and no optimiser moves it.
    if (role == Role::RouterBias) registered.requires_grad_(false);
    DecoderBlock& b = blocks[static_cast<size_t>(p.layer)];
    if (p.expert >= 0) {
      auto& list = role == Role::ExpertGate ? b.expert_gate : role == Role::ExpertUp ? b.expert_up : b.expert_down;
      list[static_cast<size_t>(p.expert)] = registered;
      continue;
    }
    if (p.parts.size() == 1) b[role] = registered;
    // The groups' registered tensors, in order: what one product reads and writes the gradients of.
    DecoderBlock::Group* group = in_qkv(role) && !c.latent() ? &b.qkv
                                 : in_gate_up(role, c) || role == Role::Up || role == Role::UpBias ? &b.gate_up
                                                                                                   : nullptr;
    if (group && kind == Kind::Bias) {
      group->biases.push_back(registered);
    } else if (group) {
      group->weights.push_back(registered);
      group->sites.push_back(role);
    }
  }
  if (c.tie_word_embeddings && c.num_labels == 0) {
    head = tok_emb;
    // The book's GPTModel draws its out_head before tying it: the draws that follow (dropout) stay the same.
    if (book && fill && gen->draws()) {
      Tensor discarded = Tensor::empty({c.vocab_size, c.hidden_size});
      kaiming_uniform_(discarded, std::sqrt(5.0), *gen);
    }
  }
  auto ropes = std::make_shared<RopeTables>();
  for (const auto& r : c.ropes) {
    RopeTables::Rotation& rotation = ropes->rotations.emplace_back();
    rotation.inverse_frequencies[0] = r.inverse_frequencies(c.head_dim);
    if (r.scaling == RopeFrequencies::Scaling::LongRope) rotation.inverse_frequencies[1] = r.inverse_frequencies(c.head_dim, true);
    rotation.scale = static_cast<float>(r.attention_factor);
  }
  rope_tables_ = std::move(ropes);
}

std::vector<LoraSite> Decoder::own_lora_sites() {
  std::vector<LoraSite> out;
  for (const DecoderConfig::Parameter& p : config.layout()) {
    if (p.layer >= 0 && (p.role() == Role::StackedGateUp || p.role() == Role::StackedDown)) {
      // gpt-oss's stacked experts: one adapter per parameter, rank r per expert (PEFT's target_parameters)
      const bool gate_up = p.role() == Role::StackedGateUp;
      const int64_t C = config.hidden_size, F = config.expert_intermediate_size;
      LoraSite site{p.name, parameter(p), &blocks[static_cast<size_t>(p.layer)].adapter(p.role()), this, p.name + ".",
                    gate_up ? kLoraGate | kLoraUp : static_cast<unsigned>(kLoraDown)};
      site.experts = config.num_experts;
      site.in = gate_up ? C : F;
      site.out = gate_up ? 2 * F : C;
      out.push_back(site);
      continue;
    }
    if (p.layer < 0 || kind_of(p.role()) != Kind::Matrix) continue;
    // Not adapted: the router and Qwen3-Next's shared-expert gate (a gate's one output per expert or per token, whose
    // change moves every token's mixture)
    if (p.role() == Role::Router || p.role() == Role::SharedExpertGate) continue;
    unsigned roles = 0;
    for (const auto& part : p.parts) roles |= lora_role_bit(part.role);
    const std::string name = p.name.substr(0, p.name.size() - std::string(".weight").size());
    DecoderBlock& b = blocks[static_cast<size_t>(p.layer)];
    LoraWeights* site = &b.adapter(p.role());
    if (p.expert >= 0) {  // an expert's projection: its own adapter
      auto& list = p.role() == Role::ExpertGate ? b.expert_gate_lora : p.role() == Role::ExpertUp ? b.expert_up_lora : b.expert_down_lora;
      site = &list.at(static_cast<size_t>(p.expert));
    }
    out.push_back({name, parameter(p), site, this, name + ".", roles});
  }
  return out;
}

namespace {
// "model.layers.3.mlp.up_proj.weight" → "model.layers.3.": a name up to its layer number.
std::string prefix_through(const std::string& name, const std::string& marker) {
  const size_t at = name.find(marker);
  return name.substr(0, at == std::string::npos ? 0 : at + marker.size());
}
// A layout entry's module: "lm_head.weight" → "lm_head.".
std::string module_of(const std::string& name) { return name.substr(0, name.rfind('.') + 1); }
}  // namespace

std::string Decoder::block_prefix(int64_t layer) const {
  for (const auto& p : config.layout())
    if (p.layer == layer) return prefix_through(p.name, "." + std::to_string(layer) + ".");
  throw ValueError("Decoder: no block " + std::to_string(layer));
}
std::string Decoder::final_norm_prefix() const {
  for (const auto& p : config.layout())
    if (p.role() == Role::FinalNorm) return module_of(p.name);
  return "";
}
std::string Decoder::head_prefix() const {
  const Role role = config.tie_word_embeddings && config.num_labels == 0 ? Role::TokenEmbedding : Role::Head;
  for (const auto& p : config.layout())
    if (p.role() == role) return module_of(p.name);
  return "";
}

Tensor& Decoder::parameter(Role role, int64_t layer) {
  Tensor* t = nullptr;
  if (layer >= 0 && layer < config.num_layers) {
    t = &blocks[static_cast<size_t>(layer)][role];
  } else if (layer < 0) {
    switch (role) {
      case Role::TokenEmbedding: t = &tok_emb; break;
      case Role::PositionEmbedding: t = &pos_emb; break;
      case Role::FinalNorm: t = &final_norm; break;
      case Role::FinalNormBias: t = &final_norm_bias; break;
      case Role::Head: t = &head; break;
      case Role::HeadBias: t = &head_bias; break;
      default: break;
    }
  }
  if (!t || !t->defined())
    throw ValueError("Decoder: this " + config.family->name + " model has no " + role_name(role) +
                     (layer >= 0 ? " in layer " + std::to_string(layer) : std::string()));
  return *t;
}

Tensor& Decoder::parameter(const DecoderConfig::Parameter& entry) {
  if (entry.expert >= 0) {
    DecoderBlock& b = blocks.at(static_cast<size_t>(entry.layer));
    auto& list = entry.role() == Role::ExpertGate ? b.expert_gate : entry.role() == Role::ExpertUp ? b.expert_up : b.expert_down;
    return list.at(static_cast<size_t>(entry.expert));
  }
  if (entry.parts.size() == 1) return parameter(entry.role(), entry.layer);
  DecoderBlock& b = blocks.at(static_cast<size_t>(entry.layer));
  switch (entry.role()) {  // a fused entry is its group's one registered tensor
    case Role::Query: return b.qkv.weights.front();
    case Role::QueryBias: return b.qkv.biases.front();
    case Role::Gate: return b.gate_up.weights.front();
    default: return b.gate_up.biases.front();
  }
}

void Decoder::store_matrices(kernels::WeightType type) {
  const int64_t block = kernels::weight_type_info(type).block_elements;
  for (const DecoderConfig::Parameter& p : config.layout()) {
    if (p.role() == Role::StackedGateUp || p.role() == Role::StackedDown) {
      // gpt-oss's experts kept as their file's rows (MXFP4) become float32 in the shape they are used in (LoRA merged
      // into them, or the experts trained); other types leave them as they are
      Tensor& t = parameter(p);
      if (type != kernels::WeightType::F32 || t.rank() != 2) continue;
      check_stacked_experts_fit(config);
      Tensor wide = stacked_experts_as_checkpoint(t, p.shape);
      wide.requires_grad_(t.requires_grad());
      replace_parameter(p.name, wide, /*reshaped=*/true);
      t = wide;
      continue;
    }
    if (kind_of(p.role()) != Kind::Matrix || p.transposed) continue;
    if (p.role() == Role::Head && (config.tie_word_embeddings || is_classifier())) continue;  // the table, or a small score
    if (p.role() == Role::LatentB) continue;  // absorbed decoding reads it per head as float32 (attend_latent)
    // the experts' choice and Qwen3-Next's shared expert gate stay exact, as llama.cpp keeps ffn_gate_inp(_shexp)
    if (p.role() == Role::Router || p.role() == Role::SharedExpertGate) continue;
    Tensor& t = parameter(p);
    const int64_t cols = t.size(1);
    // K-quants need rows of 256 values (Qwen2-0.5B's 896 are not): such a matrix takes Q8_0, as llama.cpp falls back
    // to a 32-value type for it.
    const kernels::WeightType kept = cols % block == 0 ? type : cols % 32 == 0 ? kernels::WeightType::Q8_0 : t.weight_type();
    t.to_weight_type_(kept);
  }
  refresh_fused_views();
}

void Decoder::refresh_fused_views() {
  const int64_t C = config.hidden_size, F = config.intermediate_size, Q = config.q_width(), KV = config.kv_width();
  for (DecoderBlock& b : blocks) {
    if (b.qkv.weights.size() == 1) {
      const Tensor& w = b.qkv.weights.front();
      b[Role::Query] = w.view_at(0, {Q, C});
      b[Role::Key] = w.view_at(Q * C, {KV, C});
      b[Role::Value] = w.view_at((Q + KV) * C, {KV, C});
    }
    if (b.gate_up.weights.size() == 1 && config.mlp != MlpKind::GELU) {
      const Tensor& w = b.gate_up.weights.front();
      b[Role::Gate] = w.view_at(0, {F, C});
      b[Role::Up] = w.view_at(F * C, {F, C});
    }
  }
}

int64_t Decoder::rotation_switch() const {
  for (const auto& r : config.ropes)
    if (r.scaling == RopeFrequencies::Scaling::LongRope) return static_cast<int64_t>(r.original_max_position_embeddings);
  return 0;
}

Tensor Decoder::part(const DecoderConfig::Part& part, int64_t layer) const {
  return const_cast<Decoder*>(this)->parameter(part.role, layer);
}

std::shared_ptr<const RopeTable> Decoder::rope_table(int64_t which, int64_t positions) const {
  std::lock_guard<std::mutex> lock(rope_tables_->mutex);
  RopeTables::Rotation& rotation = rope_tables_->rotations[static_cast<size_t>(which)];
  const int kind = config.ropes[static_cast<size_t>(which)].long_context(positions) ? 1 : 0;
  auto& table = rotation.tables[kind];
  if (!table || table->positions < positions) {
    const int64_t grown = std::min(config.max_positions, std::max<int64_t>(positions, table ? 2 * table->positions : 1024));
    table = std::make_shared<const RopeTable>(
        RopeTable::make(rotation.inverse_frequencies[kind], std::max(grown, positions), rotation.scale));
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

void Decoder::record_expert_use(bool on) const {
  record_use_ = on;
  expert_use_.assign(static_cast<size_t>(config.num_layers * config.num_experts), 0);
}

std::vector<uint8_t> Decoder::take_expert_use() const {
  std::vector<uint8_t> out(static_cast<size_t>(config.num_layers * config.num_experts), 0);
  std::swap(out, expert_use_);
  out.resize(static_cast<size_t>(config.num_layers * config.num_experts), 0);
  return out;
}

int64_t Decoder::expert_use_index(const std::string& name) const {
  // "….layers.L.mlp.experts.E.…": the numbers after "layers." and after "mlp.experts."
  auto number_after = [&](const std::string& marker, size_t from, size_t* end) -> int64_t {
    const size_t at = name.find(marker, from);
    if (at == std::string::npos) return -1;
    size_t i = at + marker.size();
    int64_t value = 0;
    const size_t digits = i;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i - digits < 9) value = value * 10 + (name[i++] - '0');
    if (i == digits || i >= name.size() || name[i] != '.') return -1;
    *end = i;
    return value;
  };
  size_t end = 0;
  const int64_t layer = number_after("layers.", 0, &end);
  if (layer < 0) return -1;
  const int64_t expert = number_after(".mlp.experts.", end, &end);
  if (expert < 0 || layer >= config.num_layers || expert >= config.num_experts) return -1;
  if (!config.layers[static_cast<size_t>(layer)].experts) return -1;
  return layer * config.num_experts + expert;
}

std::vector<Decoder::SparseGradient> Decoder::sparse_gradients(std::span<const int64_t> ids, int64_t tokens) const {
  std::vector<SparseGradient> tables;
  if (!config.tie_word_embeddings || config.num_labels > 0) {
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

namespace {
// The adapters of a group's sites, or none when no site has one (the plain product).
std::vector<LowRankUpdate> group_updates(const DecoderBlock& b, const DecoderBlock::Group& g) {
  std::vector<LowRankUpdate> updates;
  bool any = false;
  for (Role r : g.sites) any = any || b.adapter(r).defined();
  if (any)
    for (Role r : g.sites) updates.push_back(b.adapter(r));
  return updates;
}
// One product for the group: x (B, T, C) → (B, T, Σ rows), each registered tensor's columns side by side.
Tensor group_product(const Tensor& x, const DecoderBlock& b, const DecoderBlock::Group& g) {
  const std::vector<LowRankUpdate> updates = group_updates(b, g);
  return linear_concat(x, g.weights, g.biases, updates);
}
}  // namespace

// Multi-head latent attention (DeepseekV3Attention), x (B, T, C) normed:
//   q = q_b(norm(q_a x)) or q_proj x                 (B, T, H, dn + dr): q_nope | q_pe per head
//   [c | k_pe] = kv_a x;  c = norm(c)                (B, T, R) and (B, T, dr), k_pe one head shared by all
//   [k_nope | v] = kv_b c                            (B, T, H, dn + dv)
//   q_pe, k_pe rotated; k_h = [k_nope_h | k_pe]; softmax(scale · q_h·k_h) v_h; o_proj
// Training and forward() run this expanded form through the autograd ops (its gradients come from theirs). With a
// cache, Expanded keeps every head's k and v; Absorbed keeps [c | k_pe] per token and folds kv_b into the query and the
// output instead, since q_nope_h·k_nope_h = q_nope_h·(W_UK_h c) = (W_UK_hᵀ q_nope_h)·c:
//   q̃_h = [W_UK_hᵀ q_nope_h | q_pe_h]  (R + dr);  õ_h = Σ_j p_hj c_j  (attention over [c | k_pe] rows as one shared
//   key/value head, the values' last dr columns dropped);  o_h = W_UV_h õ_h  (dv)
// DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm without the config's rms_norm_eps: theirs is 1e-6
constexpr float kLatentEps = 1e-6f;

Decoder::LatentProjections Decoder::latent_projections(size_t i, const Tensor& x) const {
  const DecoderBlock& b = blocks[i];
  const int64_t R = config.kv_lora_rank, dr = config.head_dim;
  const Tensor none;
  LatentProjections p;
  p.q = config.q_lora_rank > 0
            ? linear_with_lora(rms_norm(linear_with_lora(x, b[Role::QueryA], none, b.adapter(Role::QueryA)),
                                        b[Role::QueryANorm], kLatentEps),
                               b[Role::QueryB], none, b.adapter(Role::QueryB))
            : linear_with_lora(x, b[Role::Query], none, b.adapter(Role::Query));
  const Tensor compressed = linear_with_lora(x, b[Role::LatentA], none, b.adapter(Role::LatentA));  // (B, T, R + dr)
  p.latent = rms_norm(narrow(compressed, 0, R), b[Role::LatentNorm], kLatentEps);
  p.k_pe = narrow(compressed, R, dr);
  return p;
}

float Decoder::latent_scale() const {
  const double dq = static_cast<double>(config.qk_nope_head_dim + config.head_dim);
  return static_cast<float>(config.attention_scale > 0.0 ? config.attention_scale : 1.0 / std::sqrt(dq));
}

int64_t Decoder::block_cache_width() const {
  return config.latent() ? config.kv_lora_rank + config.head_dim : config.kv_width();
}

void check_stacked_experts_fit(const DecoderConfig& config) {
  if (!config.family->stacked_experts) return;
  const double widened = 4.0 * static_cast<double>(config.num_layers) * static_cast<double>(config.num_experts) *
                         static_cast<double>(config.hidden_size) * 3.0 * static_cast<double>(config.expert_intermediate_size);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const double memory = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
  if (memory > 0.0 && widened > memory)
    throw ValueError("its experts widened to float32 need " + std::to_string(static_cast<int64_t>(widened / 1e9)) +
                     " GB and this machine has " + std::to_string(static_cast<int64_t>(memory / 1e9)) +
                     " GB; load the published MXFP4 folder or a quantized GGUF file instead, whose experts qkv keeps "
                     "as they are stored");
}

Tensor Decoder::latent_up(size_t i) const {
  const DecoderBlock& b = blocks[i];
  const int64_t H = config.num_heads, R = config.kv_lora_rank, rows = H * (config.qk_nope_head_dim + config.v_head_dim);
  Tensor w = b[Role::LatentB];
  if (w.dtype() != DType::F32) {  // bf16 or a block format: float32 for the per-head products
    Tensor wide = Tensor::empty(w.shape());
    wide.copy_(w);
    w = wide;
  }
  const LoraWeights& lora = b.adapter(Role::LatentB);
  if (lora.defined()) w = add(w, mul(matmul(lora.b, lora.a), lora.scale));  // W + scale·B·A, merged for this call
  return reshape(w, {H, rows / H, R});
}

Tensor Decoder::attend_latent(size_t i, const Tensor& x, int64_t position, int64_t extent, KVCache* cache,
                              AttentionStep::Record* record) const {
  const DecoderBlock& b = blocks[i];
  const DecoderLayerSettings& layer = config.layers[i];
  const int64_t B = x.size(0), T = x.size(1), H = config.num_heads, R = config.kv_lora_rank;
  const int64_t dn = config.qk_nope_head_dim, dr = config.head_dim, dv = config.v_head_dim, dq = dn + dr;
  const Tensor none;
  const LatentProjections projections = latent_projections(i, x);
  const Tensor& q = projections.q;
  const Tensor& latent = projections.latent;
  Tensor k_pe = projections.k_pe;                                                                   // (B, T, dr)
  const Tensor q_heads = reshape(q, {B, T, H, dq});
  const Tensor q_nope = narrow(q_heads, 0, dn);                     // (B, T, H, dn)
  Tensor q_pe = reshape(narrow(q_heads, dn, dr), {B, T, H * dr});   // (B, T, H·dr)
  if (layer.rope >= 0) {
    const auto table = rope_table(layer.rope, extent);
    q_pe = rope(q_pe, table, config.rope_layout, H, position);
    k_pe = rope(k_pe, table, config.rope_layout, 1, position);
  }
  AttentionConfig attention;
  attention.causal = true;
  attention.scale = latent_scale();
  attention.dropout_p = config.attention_dropout;
  attention.training = is_training();
  attention.generator = gen_;
  Tensor context;  // (B, T, H·dv)
  if (cache && latent_decode == LatentDecode::Absorbed) {
    NoGradGuard no_grad;
    KVCacheLayer& layer_cache = cache->layers[i];
    int64_t& filled = cache->filled[i];
    const int64_t W = R + dr;
    if (filled + T > layer_cache.keys.size(1))
      throw ShapeError("Decoder: " + std::to_string(filled + T) + " tokens exceed the KV cache's " +
                       std::to_string(layer_cache.keys.size(1)) + "; make the cache for more tokens");
    write_tokens(concat({latent, k_pe}, 2), layer_cache.keys, filled);
    filled += T;
    // q̃ = W_UK_hᵀ q_nope_h per head: kv_b (H·(dn + dv), R) read as (H, dn + dv, R), q_nope padded with dv zeros so
    // that one batched product over whole head blocks does it (the value rows meet zeros)
    const int64_t N = B * T;
    const Tensor w = reshape(b[Role::LatentB], {H, dn + dv, R});
    const Tensor q_by_head = transpose(reshape(q_nope, {N, H, dn}), 0, 1);                        // (H, N, dn)
    const Tensor q_latent = matmul(concat({q_by_head, Tensor::zeros({H, N, dv})}, 2), w);         // (H, N, R)
    const Tensor queries = concat({reshape(transpose(q_latent, 0, 1), {B, T, H, R}), reshape(q_pe, {B, T, H, dr})}, 3);
    attention.kv_tokens = filled;
    attention.num_kv_heads = 1;
    Tensor out;  // (…, H, W)
    if (T == 1 && layer_cache.keys.dtype() == DType::F32) {
      // One new token sees every cached row, so its H heads are H query rows over one shared matrix of latents:
      // scores = q̃ Cᵀ (H × filled), softmax, õ = P C, as two products that each read the cache once (the fused
      // kernel's one-row-per-head tiles read it H times and ran at a few GFLOP/s here).
      std::vector<Tensor> rows;
      for (int64_t r = 0; r < B; ++r) {
        const Tensor latents = layer_cache.keys.view_at(r * layer_cache.keys.size(1) * W, {filled, W});  // C (filled, W)
        const Tensor q_row = reshape(narrow(reshape(queries, {B, H * W}), r * H * W, H * W), {H, W});
        const Tensor weights = softmax(mul(linear(q_row, latents, Tensor()), attention.scale));      // (H, filled)
        rows.push_back(reshape(matmul(weights, latents), {1, H, W}));
      }
      out = B == 1 ? rows.front() : concat(rows, 0);
    } else if (T == 1) {
      // the same as one head of H query rows in the fused kernel (a bf16 cache)
      attention.causal = false;
      attention.num_heads = 1;
      out = scaled_dot_product_attention(reshape(queries, {B, H, W}), layer_cache.keys, layer_cache.keys, attention);
    } else {
      attention.num_heads = H;
      out = scaled_dot_product_attention(reshape(queries, {B, T, H * W}), layer_cache.keys, layer_cache.keys, attention);
    }
    // o_h = W_UV_h õ_h: (H, dn + dv, R) · õ (H, R, N), the value rows kept
    const Tensor o_latent = transpose(narrow(reshape(out, {N, H, W}), 0, R), 0, 1);  // (H, N, R)
    const Tensor expanded = transpose(matmul(w, transpose(o_latent, 1, 2)), 1, 2);   // (H, N, dn + dv)
    context = reshape(transpose(narrow(expanded, dn, dv), 0, 1), {B, T, H * dv});
  } else {
    // the expanded form: every head's key [k_nope_h | k_pe] and value, each head padded with zeros to one width D
    // (the fused kernel takes one head width; zeros change no score and no kept output)
    const int64_t D = std::max(dq, dv);
    const Tensor kv = reshape(linear_with_lora(latent, b[Role::LatentB], none, b.adapter(Role::LatentB)), {B, T, H, dn + dv});
    const Tensor k_shared = reshape(k_pe, {B, T, 1, dr});
    // k_pe broadcast to the H heads: H copies side by side (their gradients sum back into k_pe)
    Tensor keys = concat({narrow(kv, 0, dn), concat(std::vector<Tensor>(static_cast<size_t>(H), k_shared), 2)}, 3);
    Tensor queries = concat({q_nope, reshape(q_pe, {B, T, H, dr})}, 3);
    Tensor values = narrow(kv, dn, dv);
    auto pad = [&](Tensor t, int64_t width) {
      return width == D ? t : concat({t, Tensor::zeros({B, T, H, D - width})}, 3);
    };
    queries = reshape(pad(queries, dq), {B, T, H * D});
    keys = reshape(pad(keys, dq), {B, T, H * D});
    values = reshape(pad(values, dv), {B, T, H * D});
    attention.num_heads = attention.num_kv_heads = H;
    if (cache) {
      NoGradGuard no_grad;
      KVCacheLayer& layer_cache = cache->layers[i];
      int64_t& filled = cache->filled[i];
      filled = append_to_cache(layer_cache, filled, 0, keys, values);
      keys = layer_cache.keys;
      values = layer_cache.values;
      attention.kv_tokens = filled;
    }
    Tensor lse;
    if (record) attention.lse = &lse;
    const Tensor out = scaled_dot_product_attention(queries, keys, values, attention);  // (B, T, H·D)
    context = D == dv ? out : reshape(narrow(reshape(out, {B, T, H, D}), 0, dv), {B, T, H * dv});
    if (record) {  // the expanded, padded heads: what recorded_attention recomputes the weights from
      record->queries = queries.detach();
      record->keys = keys.detach();
      record->kv_tokens = keys.size(1);
      record->lse = lse;
    }
  }
  return linear_with_lora(context, b[Role::Output], none, b.adapter(Role::Output));
}

Tensor Decoder::attend(size_t i, const Tensor& x, int64_t position, int64_t extent, KVCache* cache,
                       AttentionStep::Record* record, const BatchStep* step) const {
  if (config.layers[i].linear) {
    if (step) return attend_linear_blocks(i, x, *step);
    return attend_linear(i, x, cache);  // no attention weights: a record stays empty
  }
  if (config.latent()) {
    if (step) return attend_latent_blocks(i, x, *step);
    if (record && cache)
      throw ValueError("Decoder: attention pictures of latent attention (" + config.family->name + ") come from a pass "
                       "without a cache");
    return attend_latent(i, x, position, extent, cache, record);
  }
  const DecoderBlock& b = blocks[i];
  const DecoderLayerSettings& layer = config.layers[i];
  const int64_t H = config.num_heads, H_kv = config.num_kv_heads;
  const int64_t Q = config.q_width(), KV = config.kv_width();
  const float norm_offset = config.norm == NormKind::GemmaRMSNorm ? 1.0f : 0.0f;
  const float eps = static_cast<float>(config.norm_eps);
  const bool rotate = !config.learned_positions && layer.rope >= 0;
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
  attention.sinks = b[Role::Sinks];  // gpt-oss; undefined elsewhere
  // q, k and v from one product (three registered projections read in place, or one fused qkv_proj), with LoRA
  // updates in their columns; its gradient comes back as one tensor for one backward product.
  Tensor packed = group_product(x, b, b.qkv);
  Tensor context;
  // Gated attention (Qwen3-Next): q_proj's rows are each head's D query values then its D gate values; the gate
  // multiplies the context before o_proj (attention_output_gate reads it in place).
  Tensor q_and_gate;
  if (config.gated_attention) {
    const int64_t D = config.head_dim;
    q_and_gate = narrow(packed, 0, 2 * Q);
    const Tensor by_head = reshape(q_and_gate, {x.size(0), x.size(1), H, 2 * D});
    packed = concat({reshape(narrow(by_head, 0, D), {x.size(0), x.size(1), Q}), narrow(packed, 2 * Q, 2 * KV)}, -1);
  }
  auto output = [&](const Tensor& ctx) {
    const Tensor gated = q_and_gate.defined() ? attention_output_gate(ctx, q_and_gate, H) : ctx;
    return linear_with_lora(gated, b[Role::Output], b[Role::OutputBias], b.adapter(Role::Output));
  };
  if (!cache && !record && !step && config.qk_norm == QkNorm::None) {
    // Training and plain inference: rotated in place of a copy and read by the kernel with strides.
    if (rotate) packed = rope(packed, rope_table(layer.rope, extent), config.rope_layout, H + 2 * H_kv, position, H + H_kv);
    context = scaled_dot_product_attention(packed, attention);
  } else {
    Tensor q = narrow(packed, 0, Q), k = narrow(packed, Q, KV), v = narrow(packed, Q + KV, KV);
    if (config.qk_norm == QkNorm::PerHead) {  // RMSNorm of each head's D values (Qwen3, Gemma)
      q = head_norm(q, H, b[Role::QueryNorm], eps, norm_offset);
      k = head_norm(k, H_kv, b[Role::KeyNorm], eps, norm_offset);
    } else if (config.qk_norm == QkNorm::Projection) {  // over all heads of a token at once (OLMo 2)
      q = rms_norm(q, b[Role::QueryNorm], eps, norm_offset);
      k = rms_norm(k, b[Role::KeyNorm], eps, norm_offset);
    }
    if (step) return output(attend_blocks(i, q, k, v, *step));  // rotated at each row's position, over its blocks
    if (rotate) {
      const auto table = rope_table(layer.rope, extent);
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
  return output(context);
}

// Qwen3NextGatedDeltaNet: in_proj_qkvz's columns are grouped by key head g as q_g (Dk) | k_g (Dk) | v (r heads of Dv)
// | z (r heads of Dv), in_proj_ba's as b (r) | a (r), r = value heads per key head. The conv reads q, k and v of all
// heads in that order; q and k are then L2-normalised (q also × Dk^−½) and repeated for the r value heads each serves.
Tensor Decoder::attend_linear(size_t i, const Tensor& x, KVCache* cache) const {
  const DecoderBlock& b = blocks[i];
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t nk = config.linear_key_heads, nv = config.linear_value_heads, dk = config.linear_key_dim,
                dv = config.linear_value_dim, r = nv / nk, Kd = nk * dk, Vd = nv * dv, K = config.linear_conv_kernel;
  const Tensor none;
  const Tensor qkvz = reshape(linear_with_lora(x, b[Role::DeltaQkvz], none, b.adapter(Role::DeltaQkvz)),
                              {B, T, nk, 2 * dk + 2 * r * dv});
  const Tensor ba = reshape(linear_with_lora(x, b[Role::DeltaBa], none, b.adapter(Role::DeltaBa)), {B, T, nk, 2 * r});
  const Tensor q = reshape(narrow(qkvz, 0, dk), {B, T, Kd}), k = reshape(narrow(qkvz, dk, dk), {B, T, Kd});
  const Tensor v = reshape(narrow(qkvz, 2 * dk, r * dv), {B, T, Vd});
  const Tensor z = reshape(narrow(qkvz, 2 * dk + r * dv, r * dv), {B, T, nv, dv});
  const Tensor beta = sigmoid(reshape(narrow(ba, 0, r), {B, T, nv}));
  const Tensor a = reshape(narrow(ba, r, r), {B, T, nv});
  const Tensor g = neg(mul(softplus(add(a, b[Role::DeltaDtBias])), exp(b[Role::DeltaALog])));

  const Tensor mixed = concat({q, k, v}, -1);  // (B, T, 2·Kd + Vd)
  KVCacheLayer* layer_cache = cache ? &cache->layers[i] : nullptr;
  const Tensor conv_state = layer_cache ? layer_cache->keys : Tensor();  // zeros before the first token
  const Tensor convolved = silu(causal_conv1d(mixed, reshape(b[Role::DeltaConv], {config.linear_conv_width(), K}), conv_state));
  // L2 norm over each head's Dk values, as RMSNorm with eps / Dk: x / √(Σx² + eps) = rms_norm(x, eps / Dk) / √Dk
  const float eps = 1e-6f / static_cast<float>(dk), root = std::sqrt(static_cast<float>(dk));
  const Tensor unit = Tensor::ones({dk});
  auto heads = [&](const Tensor& t, float scale) {  // (B, T, Kd) → (B, T, nv, dk): normed, scaled, repeated r times
    Tensor h = mul(rms_norm(reshape(t, {B, T, nk, dk}), unit, eps), scale);
    if (r == 1) return h;
    return reshape(mul(reshape(h, {B * T, nk, 1, dk}), Tensor::ones({1, 1, r, 1})), {B, T, nv, dk});
  };
  const Tensor qh = heads(narrow(convolved, 0, Kd), 1.0f / (root * root));  // l2norm, then × Dk^−½
  const Tensor kh = heads(narrow(convolved, Kd, Kd), 1.0f / root);
  const Tensor vh = reshape(narrow(convolved, 2 * Kd, Vd), {B, T, nv, dv});
  Tensor final_state;
  const Tensor initial = layer_cache ? layer_cache->values : Tensor();
  const Tensor o = gated_delta_rule(qh, kh, vh, g, beta, initial, layer_cache ? &final_state : nullptr);
  if (layer_cache) {  // the conv's last K − 1 inputs and the state after the last token
    NoGradGuard no_grad;
    Tensor before = Tensor::zeros({B, K - 1, config.linear_conv_width()});
    const int64_t width = config.linear_conv_width();
    for (int64_t s = 0; s < B; ++s)
      for (int64_t j = 0; j < K - 1; ++j) {
        const int64_t t = T - (K - 1) + j;  // the input position this row of the new state holds
        const float* src = t >= 0 ? mixed.data() + (s * T + t) * width
                           : conv_state.defined() ? conv_state.data() + (s * (K - 1) + (K - 1) + t) * width
                                                  : nullptr;
        if (src) std::copy_n(src, width, before.data() + (s * (K - 1) + j) * width);
      }
    layer_cache->keys = before;
    layer_cache->values = final_state;
  }
  // Qwen3NextRMSNormGated: RMSNorm over each head's Dv values with a plain weight, × silu(z)
  const Tensor normed = mul(rms_norm(o, b[Role::DeltaNorm], static_cast<float>(config.norm_eps)), silu(z));
  return linear_with_lora(reshape(normed, {B, T, Vd}), b[Role::DeltaOut], none, b.adapter(Role::DeltaOut));
}

Tensor Decoder::mlp(const DecoderBlock& b, const Tensor& x, std::vector<Tensor>* routers) const {
  if (b[Role::StackedGateUp].defined()) {  // gpt-oss: stacked experts with biases, a biased router, clamped SwiGLU
    if (routers)
      routers->push_back(reshape(linear(x, b[Role::Router], b[Role::RouterLogitBias]), {-1, config.num_experts}));
    MoeConfig moe;
    moe.experts_per_token = config.experts_per_token;
    moe.top_k_then_softmax = true;
    moe.swiglu_limit = static_cast<float>(config.swiglu_limit);
    if (routing_) {
      auto& [chosen, weights] = routing_->emplace_back();
      moe.chosen = &chosen;
      moe.weights = &weights;
    }
    return mixture_of_experts(x, b[Role::Router], b[Role::RouterLogitBias], b[Role::StackedGateUp],
                              b[Role::StackedGateUpBias], b[Role::StackedDown], b[Role::StackedDownBias], moe,
                              {b.adapter(Role::StackedGateUp), b.adapter(Role::StackedDown)});
  }
  if (!b.expert_gate.empty()) {  // a mixture of experts: each token through the k its router picks
    // The router's logits again, for the load-balancing loss (E × C per token: small beside the experts)
    if (routers) routers->push_back(reshape(linear(x, b[Role::Router], Tensor()), {-1, config.num_experts}));
    MoeConfig moe;
    moe.experts_per_token = config.experts_per_token;
    moe.norm_topk_prob = config.norm_topk_prob;
    moe.sigmoid = config.sigmoid_router;
    moe.selection_bias = b[Role::RouterBias];
    moe.groups = config.expert_groups;
    moe.groups_kept = config.expert_groups_kept;
    moe.scaling = static_cast<float>(config.routed_scaling_factor);
    std::vector<int32_t> chose;
    std::vector<float> chose_weights;
    if (routing_) {
      auto& [chosen, weights] = routing_->emplace_back();
      moe.chosen = &chosen;
      moe.weights = &weights;
    } else if (record_use_) {
      moe.chosen = &chose;
      moe.weights = &chose_weights;
    }
    // LoRA on the experts runs beside their products (kernels::MoeExpertLora): none is formed as W + ΔW
    Tensor routed = mixture_of_experts(x, b[Role::Router], b.expert_gate, b.expert_up, b.expert_down, moe,
                                       {b.expert_gate_lora, b.expert_up_lora, b.expert_down_lora});
    if (record_use_) {
      const int64_t E = config.num_experts, layer = &b - blocks.data();
      expert_use_.resize(static_cast<size_t>(config.num_layers * E), 0);
      for (int32_t e : *moe.chosen) expert_use_[static_cast<size_t>(layer * E + e)] = 1;
    }
    if (!b[Role::SharedGate].defined()) return routed;
    // DeepSeek-V3's shared experts: one SwiGLU every token goes through, added to the routed experts' sum
    const Tensor none;
    const Tensor shared = mul(silu(linear_with_lora(x, b[Role::SharedGate], none, b.adapter(Role::SharedGate))),
                              linear_with_lora(x, b[Role::SharedUp], none, b.adapter(Role::SharedUp)));
    Tensor out = linear_with_lora(shared, b[Role::SharedDown], none, b.adapter(Role::SharedDown));
    // Qwen3-Next's: scaled per token by sigmoid(shared_expert_gate x), (…, 1) broadcast over C
    if (b[Role::SharedExpertGate].defined()) out = mul(out, sigmoid(linear(x, b[Role::SharedExpertGate], none)));
    return add(routed, out);
  }
  const Tensor& down = b[Role::Down];
  const Tensor& down_bias = b[Role::DownBias];
  if (config.mlp == MlpKind::GELU)
    return linear_with_lora(gelu(group_product(x, b, b.gate_up)), down, down_bias, b.adapter(Role::Down));
  // gate and up from one product (two registered projections read in place, or one fused gate_up_proj)
  const int64_t F = config.intermediate_size;
  const Tensor gate_up = group_product(x, b, b.gate_up);
  const Tensor gate = narrow(gate_up, 0, F), up = narrow(gate_up, F, F);
  const Tensor activated = config.mlp == MlpKind::SwiGLU ? silu(gate) : gelu(gate);
  return linear_with_lora(mul(activated, up), down, down_bias, b.adapter(Role::Down));
}

// The block's components in the order its norm placement gives:
//   Pre       h = x + attn(norm(x));            out = h + mlp(norm(h))
//   Sandwich  h = x + norm(attn(norm(x)));      out = h + norm(mlp(norm(h)))
//   Post      h = x + norm(attn(x));            out = h + norm(mlp(h))
Tensor Decoder::block_forward(size_t i, const Tensor& x, int64_t position, KVCache* cache, AttentionStep::Record* record,
                              int64_t extent, const BatchStep* step, std::vector<Tensor>* routers) const {
  const DecoderBlock& b = blocks[i];
  const bool before = config.placement != NormPlacement::Post, after = config.placement != NormPlacement::Pre;
  if (extent <= 0) extent = position + x.size(1);
  Tensor a = attend(i, before ? norm(x, b[Role::AttnNorm], b[Role::AttnNormBias]) : x, position, extent, cache, record, step);
  if (after) a = norm(a, b[Role::PostAttnNorm], Tensor());
  const Tensor h = add(x, hashed_dropout(a, config.drop_rate, is_training(), *gen_));
  Tensor m = mlp(b, before ? norm(h, b[Role::MlpNorm], b[Role::MlpNormBias]) : h, routers);
  if (after) m = norm(m, b[Role::PostMlpNorm], Tensor());
  return add(h, hashed_dropout(m, config.drop_rate, is_training(), *gen_));
}

Tensor Decoder::hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                       std::vector<AttentionStep::Record>* records, std::vector<Tensor>* routers) const {
  Tensor x = embed(ids, batch, tokens, 0);
  if (records) records->assign(blocks.size(), {});
  for (size_t i = 0; i < blocks.size(); ++i)
    x = block_forward(i, x, 0, nullptr, records ? &(*records)[i] : nullptr, 0, nullptr, routers);
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

Tensor Decoder::logits(const Tensor& hidden_states) const {
  const Tensor z = linear(hidden_states, head, head_bias);
  // Gemma 2 caps its language-model logits; a classifier's scores are left as they are (as transformers does).
  return config.final_softcap > 0.0 && !is_classifier() ? soft_cap(z, static_cast<float>(config.final_softcap)) : z;
}

Tensor Decoder::forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                        std::vector<AttentionStep::Record>* records) const {
  return logits(hidden(ids, batch, tokens, records));
}

Tensor Decoder::loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
                     int64_t ignore_index) const {
  if (static_cast<int64_t>(targets.size()) != batch * tokens) {
    throw ShapeError("Decoder::loss: " + std::to_string(targets.size()) + " targets for " + std::to_string(batch) +
                     " × " + std::to_string(tokens) + " tokens");
  }
  if (is_classifier())
    throw ValueError("Decoder::loss: this model is a classifier (" + std::to_string(config.num_labels) +
                     " classes), not a language model: it has no next-token loss");
  std::vector<Tensor> routers;
  const bool balance = config.router_aux_loss_coef != 0.0 && config.num_experts > 0;
  const Tensor h = hidden(ids, batch, tokens, nullptr, balance ? &routers : nullptr);
  // Soft-capped logits (Gemma 2) are formed whole; otherwise the head and the loss go together, block by block.
  const Tensor loss = config.final_softcap > 0.0
                          ? cross_entropy(reshape(logits(h), {batch * tokens, config.vocab_size}), targets, ignore_index)
                          : linear_cross_entropy(h, head, Tensor(), targets, ignore_index);
  if (!balance || routers.empty()) return loss;
  return add(loss, mul(load_balancing_loss(routers, config.experts_per_token), static_cast<float>(config.router_aux_loss_coef)));
}

Tensor load_balancing_loss(const std::vector<Tensor>& router_logits, int64_t experts_per_token) {
  if (router_logits.empty()) throw ValueError("load_balancing_loss: no router logits");
  const Tensor logits = router_logits.size() == 1 ? router_logits[0] : concat(router_logits, 0);
  if (logits.rank() != 2 || experts_per_token < 1 || experts_per_token > logits.size(1))
    throw ShapeError("load_balancing_loss: router logits must be (N, E) with 1 ≤ k ≤ E, got " + logits.shape().str() +
                     " and k = " + std::to_string(experts_per_token));
  const int64_t N = logits.size(0), E = logits.size(1), k = experts_per_token;
  const Tensor probs = softmax(logits);
  // f_e: the share of the N·k choices that went to e (a count: no gradient), as transformers' one-hot mean
  Tensor share = Tensor::zeros({E});
  for_each_top_k(probs.data(), N, E, k, [&](int64_t, int64_t e) { share.data()[e] += 1.0f; });
  for (int64_t e = 0; e < E; ++e) share.data()[e] /= static_cast<float>(N);
  return mul(sum(mul(mean(probs, 0), share)), static_cast<float>(E));
}

namespace {
// The attention settings a recorded layer ran with, for recomputing its weights
AttentionConfig recorded_attention(const DecoderConfig& config, int64_t layer, int64_t kv_tokens) {
  AttentionConfig attention;
  attention.num_heads = config.num_heads;
  attention.num_kv_heads = config.num_kv_heads;
  attention.causal = true;
  attention.window = config.layers[static_cast<size_t>(layer)].window;
  attention.scale = static_cast<float>(config.attention_scale);
  if (config.latent() && config.attention_scale <= 0.0)  // latent attention's heads are padded: Decoder::latent_scale
    attention.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.qk_nope_head_dim + config.head_dim)));
  attention.softcap = static_cast<float>(config.attn_softcap);
  attention.kv_tokens = kv_tokens;
  return attention;
}
}  // namespace

namespace {
// "4, 8 and 12": the 1-based numbers of a hybrid model's attention layers, for messages about the others
std::string attention_layer_list(const DecoderConfig& config) {
  std::vector<std::string> numbers;
  for (size_t i = 0; i < config.layers.size(); ++i)
    if (!config.layers[i].linear) numbers.push_back(std::to_string(i + 1));
  std::string list;
  for (size_t i = 0; i < numbers.size(); ++i)
    list += (i == 0 ? "" : i + 1 == numbers.size() ? " and " : ", ") + numbers[i];
  return list.empty() ? "none" : list;
}
}  // namespace

Tensor Decoder::weights(int64_t layer, const AttentionStep::Record& record, int64_t b, int64_t h) const {
  if (layer >= 0 && layer < config.num_layers && config.layers[static_cast<size_t>(layer)].linear)
    throw ValueError("layer " + std::to_string(layer + 1) + " of this " + config.family->description + " model is Gated "
                     "DeltaNet: it keeps a state instead of weighing positions, so it has no attention map; its attention "
                     "layers are " + attention_layer_list(config));
  if (!record.lse.defined()) throw ValueError("Decoder::weights: the record is empty; run forward with it first");
  return attention_weights(record.queries, record.keys, record.lse, recorded_attention(config, layer, record.kv_tokens),
                           b, h);
}

Tensor Decoder::attention_row(std::span<const int64_t> ids, int64_t position) const {
  if (position < 0 || position >= static_cast<int64_t>(ids.size())) {
    throw ValueError("Decoder::attention_row: position " + std::to_string(position) + " is outside the " +
                     std::to_string(ids.size()) + " tokens given");
  }
  NoGradGuard no_grad;
  const int64_t T = position + 1, H = config.num_heads;
  Tensor x = embed(ids.first(static_cast<size_t>(T)), 1, T, 0);
  Tensor out = Tensor::empty({config.num_layers, H, T});
  for (size_t i = 0; i < blocks.size(); ++i) {
    AttentionStep::Record record;
    x = block_forward(i, x, 0, nullptr, &record);
    if (config.layers[i].linear) {  // Gated DeltaNet weighs no positions: its rows stay 0
      std::fill_n(out.data() + static_cast<int64_t>(i) * H * T, H * T, 0.0f);
      continue;
    }
    if (!record.lse.defined()) throw ValueError("Decoder::attention_row: layer " + std::to_string(i + 1) + " recorded no attention");
    // The last query alone, over all T keys: a decode step's shape, so the causal mask and the window line up.
    const int64_t width = record.queries.size(2);
    const Tensor q = Tensor::from(std::span<const float>(record.queries.data() + (T - 1) * width, static_cast<size_t>(width)),
                                  {1, 1, width});
    Tensor lse = Tensor::empty({1, H, 1});
    for (int64_t h = 0; h < H; ++h) lse.data()[h] = record.lse.data()[h * T + T - 1];
    const AttentionConfig attention = recorded_attention(config, static_cast<int64_t>(i), record.kv_tokens);
    for (int64_t h = 0; h < H; ++h) {
      const Tensor w = attention_weights(q, record.keys, lse, attention, 0, h);  // (1, T)
      std::copy_n(w.data(), T, out.data() + (static_cast<int64_t>(i) * H + h) * T);
    }
  }
  return out;
}

Decoder::Routing Decoder::expert_routing(std::span<const int64_t> ids) const {
  Routing out;
  for (int64_t i = 0; i < config.num_layers; ++i)
    if (config.layers[static_cast<size_t>(i)].experts) out.layers.push_back(i);
  const auto T = static_cast<int64_t>(ids.size()), E = config.num_experts, k = config.experts_per_token;
  if (out.layers.empty() || T == 0) return out;
  std::vector<std::pair<std::vector<int32_t>, std::vector<float>>> collected;
  routing_ = &collected;
  try {
    NoGradGuard no_grad;
    forward(ids, 1, T);
  } catch (...) {
    routing_ = nullptr;
    throw;
  }
  routing_ = nullptr;
  const auto L = static_cast<int64_t>(out.layers.size());
  if (static_cast<int64_t>(collected.size()) != L) throw ValueError("Decoder::expert_routing: a routed layer reported nothing");
  out.weights = Tensor::zeros({L, T, E});
  for (int64_t l = 0; l < L; ++l) {
    const auto& [chosen, weights] = collected[static_cast<size_t>(l)];
    for (int64_t slot = 0; slot < T * k && slot < static_cast<int64_t>(chosen.size()); ++slot)
      out.weights.data()[(l * T + slot / k) * E + chosen[static_cast<size_t>(slot)]] = weights[static_cast<size_t>(slot)];
  }
  return out;
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
    if (layer.linear) {  // Gated DeltaNet: the conv's last K − 1 inputs and the (Dk × Dv) state per value head,
                         // float32 and constant in the length
      KVCacheLayer state;
      product({batch, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim});
      state.keys = Tensor::zeros({batch, config.linear_conv_kernel - 1, config.linear_conv_width()});
      state.values = Tensor::zeros({batch, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim});
      cache.layers.push_back(std::move(state));
      cache.filled.push_back(0);
      continue;
    }
    const int64_t rows =
        layer.window > 0 ? std::min(cache.capacity, layer.window - 1 + kCacheChunk) : cache.capacity;
    if (config.latent()) {  // latents and rotated keys (absorbed), or every head's padded key and value (expanded)
      const int64_t dq = config.qk_head_dim(), width = latent_decode == LatentDecode::Absorbed
                                                           ? config.kv_lora_rank + config.head_dim
                                                           : config.num_heads * std::max(dq, config.v_head_dim);
      product({batch, rows, width});
      KVCacheLayer buffers = KVCacheLayer::make(batch, rows, width);
      if (latent_decode == LatentDecode::Absorbed) buffers.values = Tensor();  // keys holds both
      cache.layers.push_back(std::move(buffers));
      cache.filled.push_back(0);
      continue;
    }
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
  const int64_t extent = cache.length + tokens;
  for (int64_t t0 = 0; t0 < tokens; t0 += kCacheChunk) {
    const int64_t n = std::min(kCacheChunk, tokens - t0);
    std::vector<int64_t> chunk;
    chunk.reserve(static_cast<size_t>(batch * n));
    for (int64_t b = 0; b < batch; ++b)
      chunk.insert(chunk.end(), ids.begin() + b * tokens + t0, ids.begin() + b * tokens + t0 + n);
    x = embed(chunk, batch, n, cache.length);
    // The rotation is chosen for the whole call (LongRoPE's factors by its last position), not chunk by chunk.
    for (size_t i = 0; i < blocks.size(); ++i) x = block_forward(i, x, cache.length, &cache, nullptr, extent);
    cache.length += n;
  }
  return logits(norm(select_token(x, x.size(1) - 1), final_norm, final_norm_bias));
}

// ---- a session's step: rows of many sequences, each at its own position, over a block cache ----

struct Decoder::BatchStep {
  const BatchPlan& plan;
  KVBlockCache& cache;
};

Tensor Decoder::attend_blocks(size_t i, Tensor& q, Tensor& k, const Tensor& v, const BatchStep& step) const {
  const DecoderLayerSettings& layer = config.layers[i];
  // Latent attention comes here expanded and already rotated: every head its own key and value, padded to one width
  const bool latent = config.latent();
  const int64_t H = config.num_heads, H_kv = latent ? H : config.num_kv_heads, KV = block_cache_width();
  const int64_t D = KV / H_kv, Q = H * D, N = q.size(1);
  const int64_t layer_index = block_cache_layer(static_cast<int64_t>(i));
  AttentionConfig attention;
  attention.num_heads = H;
  attention.num_kv_heads = H_kv;
  attention.causal = true;
  attention.window = layer.window;
  attention.scale = latent ? latent_scale() : static_cast<float>(config.attention_scale);
  attention.softcap = static_cast<float>(config.attn_softcap);
  attention.sinks = blocks[i][Role::Sinks];
  Tensor context = Tensor::empty({1, N, Q});
  for (const BatchPlan::Run& run : step.plan.runs) {
    const int64_t end = run.start + run.rows;  // the sequence's length after this step
    if (!latent && !config.learned_positions && layer.rope >= 0) {
      // The rotation is chosen per sequence by its own last position (LongRoPE's factors), as a call on that
      // sequence alone would choose it.
      const auto table = rope_table(layer.rope, end);
      const int64_t* positions = step.plan.positions.data() + run.row0;
      rope_rows_(q, *table, config.rope_layout, H, D, run.row0, run.rows, positions);
      rope_rows_(k, *table, config.rope_layout, H_kv, D, run.row0, run.rows, positions);
    }
    const float* ks = k.data();
    const float* vs = v.data();
    for (int64_t r = 0; r < run.rows; ++r)
      step.cache.write(layer_index, run.sequence, run.start + r, ks + (run.row0 + r) * KV, vs + (run.row0 + r) * KV);
  }
  // Each sequence attends over its own keys, gathered from its blocks (a sliding-window layer's only those its rows
  // can see; the causal offset Tk − Tq stays right).
  const auto& runs = step.plan.runs;
  std::vector<AttentionRun> spans(runs.size());
  std::vector<int64_t> first(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    const int64_t end = runs[r].start + runs[r].rows;
    first[r] = layer.window > 0 ? std::max<int64_t>(0, runs[r].start - (layer.window - 1)) : 0;
    spans[r] = {runs[r].row0, runs[r].rows, end - first[r]};
  }
  attend_runs(
      q, spans, KV,
      [&](size_t r, float* keys, float* values) {
        step.cache.gather(layer_index, runs[r].sequence, first[r], first[r] + spans[r].Tk, keys, values);
      },
      attention, context,
      [&](size_t r, PagedKV& kv) {  // a decoding row reads its blocks where they are
        step.cache.pages(layer_index, runs[r].sequence, first[r], first[r] + spans[r].Tk, kv.pages);
        kv.type = step.cache.type();
        kv.row_bytes = step.cache.row_bytes();
      });
  return context;
}

// Latent attention in a session's step: q_pe and k_pe rotated at each row's position, then every head's query, key
// [k_nope_h | k_pe] and value laid out as attend_latent's expanded form lays them (zeros to one width D), attended over
// the blocks, and each head's first dv outputs kept.
Tensor Decoder::attend_latent_blocks(size_t i, const Tensor& x, const BatchStep& step) const {
  const DecoderBlock& b = blocks[i];
  const DecoderLayerSettings& layer = config.layers[i];
  const int64_t N = x.size(1), H = config.num_heads, R = config.kv_lora_rank;
  const int64_t dn = config.qk_nope_head_dim, dr = config.head_dim, dv = config.v_head_dim, dq = dn + dr, W = R + dr;
  const int64_t layer_index = block_cache_layer(static_cast<int64_t>(i));
  const Tensor none;
  const LatentProjections p = latent_projections(i, x);
  Tensor q_pe = Tensor::empty({1, N, H * dr}), k_pe = p.k_pe;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      std::copy_n(p.q.data() + (n * H + h) * dq + dn, dr, q_pe.data() + (n * H + h) * dr);
  if (layer.rope >= 0)
    for (const BatchPlan::Run& run : step.plan.runs) {
      const auto table = rope_table(layer.rope, run.start + run.rows);
      const int64_t* positions = step.plan.positions.data() + run.row0;
      rope_rows_(q_pe, *table, config.rope_layout, H, dr, run.row0, run.rows, positions);
      rope_rows_(k_pe, *table, config.rope_layout, 1, dr, run.row0, run.rows, positions);
    }
  // The absorbed queries: each head's q_nope through its W_UK (q̃ = W_UK_hᵀ q_nope_h, R values), then its q_pe: one
  // "head" of W = R + dr over the cached [latent | k_pe] rows, which serve as keys and values alike
  const Tensor w = latent_up(i);  // (H, dn + dv, R)
  Tensor q_nope = Tensor::zeros({H, N, dn + dv});  // q_nope by head, padded with dv zeros (the value rows meet zeros)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) std::copy_n(p.q.data() + (n * H + h) * dq, dn, q_nope.data() + (h * N + n) * (dn + dv));
  const Tensor q_latent = matmul(q_nope, w);  // (H, N, R)
  Tensor queries = Tensor::empty({1, N, H * W});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      std::copy_n(q_latent.data() + (h * N + n) * R, R, queries.data() + (n * H + h) * W);
      std::copy_n(q_pe.data() + (n * H + h) * dr, dr, queries.data() + (n * H + h) * W + R);
    }
  AttentionConfig attention;
  attention.num_heads = H;
  attention.num_kv_heads = 1;
  attention.causal = true;
  attention.scale = latent_scale();
  Tensor context = Tensor::empty({1, N, H * W});
  std::vector<float> row(static_cast<size_t>(W));
  for (const BatchPlan::Run& run : step.plan.runs) {
    for (int64_t r = 0; r < run.rows; ++r) {
      const int64_t n = run.row0 + r;
      std::copy_n(p.latent.data() + n * R, R, row.data());
      std::copy_n(k_pe.data() + n * dr, dr, row.data() + R);
      step.cache.write(layer_index, run.sequence, run.start + r, row.data(), nullptr);
    }
    const int64_t end = run.start + run.rows;
    if (run.rows == 1 && kernels::attention_decode_supports(step.cache.type(), W)) {
      // A decoded token sees every row: its H heads are H query rows over one matrix C of latents, read where the
      // cache's blocks hold it (keys and values alike): scores = q̃ Cᵀ, softmax, õ = P C
      thread_local std::vector<kernels::KVPage> pages;
      pages.clear();
      step.cache.pages(layer_index, run.sequence, 0, end, pages);
      kernels::AttentionDims dims;
      dims.H = H, dims.H_kv = 1, dims.D = W, dims.Tq = 1, dims.Tk = end;
      kernels::AttentionOptions options;
      options.scale = attention.scale;
      kernels::attention_decode(dims, options, queries.data() + run.row0 * H * W,
                                kernels::KVPages{pages, step.cache.type(), step.cache.row_bytes()},
                                context.data() + run.row0 * H * W);
      continue;
    }
    Tensor latents = Tensor::empty({end, W});  // C: the sequence's rows so far
    step.cache.gather(layer_index, run.sequence, 0, end, latents.data(), nullptr);
    if (run.rows == 1) {
      // The same as two products that each read the latents once (the fused kernel's one-row tiles read them H times:
      // 4.5× slower), for a cache type attention_decode does not read
      const Tensor q_row = queries.view_at(run.row0 * H * W, {H, W});
      const Tensor weights = softmax(mul(linear(q_row, latents, Tensor()), attention.scale));  // (H, end)
      const Tensor out = matmul(weights, latents);                                              // (H, W)
      std::copy_n(out.data(), H * W, context.data() + run.row0 * H * W);
    } else {
      attend_rows(queries, run.row0, run.rows, latents.data(), latents.data(), end, attention, context);
    }
  }
  // o_h = W_UV_h õ_h, õ_h the first R values of head h's output: (H, dn + dv, R) · õ (H, R, N), the value rows kept
  Tensor o_latent = Tensor::empty({H, R, N});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) o_latent.data()[(h * R + r) * N + n] = context.data()[(n * H + h) * W + r];
  const Tensor expanded = matmul(w, o_latent);  // (H, dn + dv, N)
  Tensor out = Tensor::empty({1, N, H * dv});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < dv; ++d) out.data()[(n * H + h) * dv + d] = expanded.data()[(h * (dn + dv) + dn + d) * N + n];
  return linear_with_lora(out, b[Role::Output], none, b.adapter(Role::Output));
}

int64_t Decoder::block_cache_layers() const { return block_cache_layer(config.num_layers); }

int64_t Decoder::block_cache_layer(int64_t layer) const {
  int64_t n = 0;
  for (int64_t l = 0; l < layer && l < config.num_layers; ++l) n += config.layers[static_cast<size_t>(l)].linear ? 0 : 1;
  return n;
}

int64_t Decoder::block_cache_state_floats() const {
  return (config.num_layers - block_cache_layers()) * (config.has_linear_layers() ? config.linear_state_floats() : 0);
}

// Each sequence's rows run through attend_linear alone, from the state the block cache holds for it (zeros for a
// sequence encoded from its start), which gets the state after them: the bits a sequence gets alone, in any batch.
Tensor Decoder::attend_linear_blocks(size_t i, const Tensor& x, const BatchStep& step) const {
  const int64_t C = x.size(2), N = x.size(1), K = config.linear_conv_kernel, W = config.linear_conv_width();
  const int64_t conv = (K - 1) * W, floats = config.linear_state_floats();
  const int64_t offset = (static_cast<int64_t>(i) - block_cache_layer(static_cast<int64_t>(i))) * floats;
  Tensor out = Tensor::empty({1, N, C});
  KVCache one;  // this layer's state, as attend_linear reads and writes it
  one.layers.resize(i + 1);
  for (const BatchPlan::Run& run : step.plan.runs) {
    float* state = step.cache.state(run.sequence) + offset;
    if (run.start == 0) std::fill_n(state, floats, 0.0f);  // (encoded again from its start: LongRoPE's switch)
    KVCacheLayer& layer = one.layers[i];
    layer.keys = Tensor::from(std::span<const float>(state, static_cast<size_t>(conv)), {1, K - 1, W});
    layer.values = Tensor::from(std::span<const float>(state + conv, static_cast<size_t>(floats - conv)),
                                {1, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim});
    const Tensor rows = Tensor::from(std::span<const float>(x.data() + run.row0 * C, static_cast<size_t>(run.rows * C)),
                                     {1, run.rows, C});
    const Tensor y = attend_linear(i, rows, &one);
    std::copy_n(y.data(), run.rows * C, out.data() + run.row0 * C);
    std::copy_n(layer.keys.data(), conv, state);
    std::copy_n(layer.values.data(), floats - conv, state + conv);
  }
  return out;
}

Tensor Decoder::forward_batch(const BatchPlan& plan, KVBlockCache& cache) const {
  NoGradGuard no_grad;
  const RowIndependentScope row_independent;
  const int64_t N = static_cast<int64_t>(plan.ids.size()), C = config.hidden_size;
  if (N == 0 || plan.positions.size() != plan.ids.size()) throw ShapeError("Decoder::forward_batch: an empty or malformed plan");
  Tensor x = embedding(tok_emb, plan.ids, {1, N});
  if (config.embedding_scale > 0.0) x = mul(x, static_cast<float>(config.embedding_scale));
  if (config.learned_positions) x = add(x, embedding(pos_emb, plan.positions, {1, N}));
  const BatchStep step{plan, cache};
  for (size_t i = 0; i < blocks.size(); ++i) x = block_forward(i, x, 0, nullptr, nullptr, 0, &step);
  const int64_t R = static_cast<int64_t>(plan.logit_rows.size());
  if (R == 0) return Tensor::empty({0, config.vocab_size});
  Tensor rows = Tensor::empty({1, R, C});
  for (int64_t r = 0; r < R; ++r)
    std::copy_n(x.data() + plan.logit_rows[static_cast<size_t>(r)] * C, C, rows.data() + r * C);
  return reshape(logits(norm(rows, final_norm, final_norm_bias)), {R, config.vocab_size});
}

}  // namespace qkv::nn
