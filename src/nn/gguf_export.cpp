// A decoder as a GGUF file llama.cpp loads (see qkv/nn/gguf_export.hpp): the metadata llama.cpp reads for the
// architectures qkv writes, each matrix widened a few rows at a time from however the model holds it and quantized
// into the file's bytes as it is written.
#include "qkv/nn/gguf_export.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <tuple>

#include "qkv/io/ggml_types.hpp"
#include "qkv/nn/gguf_model.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/text/gguf_vocab.hpp"

namespace qkv::nn {

namespace {

using io::GgufValue;
using kernels::WeightType;

struct FileTypeRow {
  GgufFileType type;
  const char* name;
  WeightType base;     // what most matrices take
  uint32_t ftype;      // llama.cpp's llama_ftype, written as general.file_type
};
// LLAMA_FTYPE_*: ALL_F32 0, MOSTLY_F16 1, Q4_0 2, Q8_0 7, Q4_K_S 14, Q4_K_M 15, Q5_K_S 16, Q5_K_M 17, Q6_K 18, BF16 32,
// MXFP4_MOE 38.
// The pure K types are recorded as the _S mixes' ids (llama.cpp has no id of its own for them).
constexpr FileTypeRow kFileTypes[] = {
    {GgufFileType::F32, "f32", WeightType::F32, 0},        {GgufFileType::F16, "f16", WeightType::F16, 1},
    {GgufFileType::BF16, "bf16", WeightType::BF16, 32},    {GgufFileType::Q8_0, "q8_0", WeightType::Q8_0, 7},
    {GgufFileType::Q4_0, "q4_0", WeightType::Q4_0, 2},     {GgufFileType::Q4_K, "q4_k", WeightType::Q4_K, 14},
    {GgufFileType::Q5_K, "q5_k", WeightType::Q5_K, 16},    {GgufFileType::Q6_K, "q6_k", WeightType::Q6_K, 18},
    {GgufFileType::Q4_K_M, "q4_k_m", WeightType::Q4_K, 15}, {GgufFileType::Q5_K_M, "q5_k_m", WeightType::Q5_K, 17},
    {GgufFileType::MXFP4_MOE, "mxfp4_moe", WeightType::Q8_0, 38},
};
const FileTypeRow& row_of(GgufFileType type) {
  for (const FileTypeRow& r : kFileTypes)
    if (r.type == type) return r;
  throw ValueError("unknown GGUF file type");
}

// llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between.
bool use_more_bits(int64_t layer, int64_t layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

// tensor_type_fallback for rows of `cols` values, with Q8_0 for the K-quants' 32-value fallbacks (see the header).
WeightType fallback(WeightType type, int64_t cols) {
  const int64_t block = io::weight_type_info(type).block_elements;
  if (cols % block == 0) return type;
  if (block > 32 && cols % 32 == 0) return WeightType::Q8_0;
  return WeightType::F16;
}


// Refuses what llama.cpp's graphs of the architectures qkv writes would compute differently from qkv's model.
void check_exportable(const DecoderConfig& c) {
  const std::string arch = c.family->gguf_architecture;
  auto refuse = [&](const std::string& what) {
    throw ValueError("qkv quantize writes GGUF files of " + gguf_export_families() + " models; this " + c.family->name +
                     " model " + what);
  };
  const bool gpt_oss = c.family->stacked_experts;
  if (c.family->naming == Naming::Book ||
      (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "qwen3moe" && arch != "gpt-oss" && arch != "olmo2" &&
       arch != "gemma3" && arch != "gemma2" && arch != "smollm3" && arch != "phi3" && arch != "deepseek2" &&
       arch != "qwen3next"))
    refuse("is not one of them (llama.cpp's " + (arch.empty() ? std::string("?") : arch) + " architecture needs keys and "
           "conventions qkv does not write yet)");
  if (c.num_labels > 0) refuse("is a classifier (its head scores " + std::to_string(c.num_labels) + " classes), not a language model");
  if (gpt_oss) {  // llama.cpp's gpt-oss: its clamp is fixed at 7, its sliding layers are the even ones, all one window
    if (c.swiglu_limit != 7.0) refuse("clamps its SwiGLU at " + std::to_string(c.swiglu_limit) + "; llama.cpp's gpt-oss clamps at 7");
    for (size_t i = 0; i < c.layers.size(); ++i)
      if ((c.layers[i].window > 0) != (i % 2 == 0) || (c.layers[i].window > 0 && c.layers[i].window != c.layers[0].window))
        refuse("slides on other layers than the even ones (llama.cpp's gpt-oss slides on layers 0, 2, 4 …, one window)");
  } else if (arch == "deepseek2") {  // llama.cpp's deepseek2: MLA, the first layers dense, then experts everywhere
    if (!c.latent()) refuse("has no latent attention (kv_lora_rank), which llama.cpp's deepseek2 computes");
    bool moe = false;
    for (const DecoderLayerSettings& l : c.layers) {
      if (moe && !l.experts) refuse("has a dense layer after its first mixture-of-experts layer; llama.cpp's deepseek2 has dense layers first only");
      moe = moe || l.experts;
    }
    if (c.num_experts > 0 && !c.sigmoid_router) refuse("routes by softmax; qkv writes DeepSeek-V3's sigmoid router");
    if (c.expert_groups > 1 && c.expert_groups_kept >= c.expert_groups)
      refuse("keeps all " + std::to_string(c.expert_groups) + " of its expert groups (topk_group); llama.cpp's deepseek2 "
             "needs fewer kept than there are (set n_group to 1 for no grouping)");
    if (c.q_lora_rank > 0 && (c.num_layers == 26 || c.num_layers == 27))
      refuse("has " + std::to_string(c.num_layers) + " layers and a q_lora_rank: llama.cpp takes such a deepseek2 for "
             "DeepSeek-V2-Lite and then expects a plain q projection");
    if (c.num_experts > 0 && c.shared_expert_intermediate_size % std::max<int64_t>(c.expert_intermediate_size, 1) != 0)
      refuse("has shared experts whose width is not a multiple of moe_intermediate_size");
    if (c.rope_layout != RopeLayout::Interleaved)
      refuse("rotates halves (rope_interleave false); llama.cpp's deepseek2 rotates interleaved pairs");
    if (std::fabs(c.ropes.front().attention_factor - 1.0) > 1e-12)
      refuse("scales RoPE's cos and sin (YaRN's mscale other than mscale_all_dim), which llama.cpp's deepseek2 does not");
  } else if (arch == "qwen3next") {  // llama.cpp's qwen3next: experts with a gated shared expert in every layer
    for (const DecoderLayerSettings& l : c.layers)
      if (!l.experts) refuse("has layers without experts, which llama.cpp's qwen3next does not compute");
    if (!c.norm_topk_prob) refuse("does not renormalise its top-k weights (norm_topk_prob false); llama.cpp's qwen3next does");
    if (c.shared_expert_intermediate_size <= 0 || !c.shared_expert_gate)
      refuse("has no gated shared expert, which llama.cpp's qwen3next needs in every layer");
    if (c.linear_key_dim != c.linear_value_dim)
      refuse("has Gated DeltaNet key heads of " + std::to_string(c.linear_key_dim) + " and value heads of " +
             std::to_string(c.linear_value_dim) + " values; llama.cpp's qwen3next needs them equal");
    if (c.has_linear_layers() && std::fabs(c.norm_eps - 1e-6) > 1e-12)
      refuse("has rms_norm_eps " + std::to_string(c.norm_eps) + ": llama.cpp's qwen3next L2-normalises q and k with it, "
             "transformers with 1e-6, so they agree only at 1e-6");
  } else if (c.num_experts > 0) {  // llama.cpp's qwen3moe: experts in every layer, the top k weights renormalised
    if (arch != "qwen3moe") refuse("has a mixture of experts");
    for (const DecoderLayerSettings& l : c.layers)
      if (!l.experts) refuse("has layers without experts (mlp_only_layers), which llama.cpp's qwen3moe does not compute");
    if (!c.norm_topk_prob) refuse("does not renormalise its top-k weights (norm_topk_prob false); llama.cpp's qwen3moe does");
  }
  const bool gemma3 = arch == "gemma3", gemma2 = arch == "gemma2";
  const bool olmo3 = arch == "olmo2" && c.family->sliding == SlidingRule::Pattern;
  // The sliding layers llama.cpp fixes, one window: all but every period-th layer (gemma3 6, olmo2 with a window 4,
  // gemma2 2)
  if (const size_t period = gemma3 ? 6 : olmo3 ? 4 : gemma2 ? 2 : 0; period > 0)
    for (size_t i = 0; i < c.layers.size(); ++i)
      if ((c.layers[i].window > 0) != ((i + 1) % period != 0) || (c.layers[i].window > 0 && c.layers[i].window != c.layers[0].window))
        refuse("slides on other layers than llama.cpp's " + arch + " does (" +
               (gemma3 ? "5 of every 6" : olmo3 ? "3 of every 4" : "layers 0, 2, 4 …") + "), or with several windows");
  if (gemma3 || gemma2) {  // llama.cpp's gemma3: its sliding layers' RoPE base 10000; gemma2: one RoPE
    if (gemma3 && (c.ropes.size() != 2 || c.ropes[1].theta != 10000.0 || c.ropes[1].scaling != kernels::RopeFrequencies::Scaling::None))
      refuse("rotates its sliding layers with another RoPE than base 10000 unscaled, which llama.cpp's gemma3 fixes");
    if (gemma2 && c.ropes.size() != 1) refuse("rotates with several RoPE settings; llama.cpp's gemma2 has one");
    if (c.attention_scale > 0.0 && std::fabs(c.attention_scale * std::sqrt(static_cast<double>(c.head_dim)) - 1.0) > 1e-9)
      refuse("scales its scores by query_pre_attn_scalar other than head_dim, which llama.cpp's " + arch + " does not read");
    if (gemma3 && (c.attn_softcap > 0.0 || c.final_softcap > 0.0)) refuse("soft-caps its logits, which llama.cpp's gemma3 does not");
  } else if (olmo3) {  // its sliding and full layers' RoPE: one setting unless the full layers' is scaled
    for (const kernels::RopeFrequencies& r : c.ropes)
      if (r.scaling != kernels::RopeFrequencies::Scaling::None || r.theta != c.ropes.front().theta)
        refuse("scales the RoPE of its full-attention layers (YaRN), which qkv does not write for llama.cpp's olmo2 yet");
  } else if (c.ropes.size() != 1) {
    refuse("rotates with " + std::to_string(c.ropes.size()) + " RoPE settings; one is written");
  }
  const kernels::RopeFrequencies& rope = c.ropes.front();
  const bool llama3 = rope.scaling == kernels::RopeFrequencies::Scaling::Llama3;
  const bool yarn = rope.scaling == kernels::RopeFrequencies::Scaling::Yarn;
  const bool linear = rope.scaling == kernels::RopeFrequencies::Scaling::Linear;
  const bool longrope = rope.scaling == kernels::RopeFrequencies::Scaling::LongRope, phi3 = arch == "phi3";
  const bool deepseek2 = arch == "deepseek2";
  if (rope.scaling == kernels::RopeFrequencies::Scaling::Proportional)  // llama.cpp holds it for its gemma4 only
    refuse("turns part of each head by proportional RoPE (Gemma 4's), which llama.cpp's " + arch + " cannot hold");
  if (rope.scaling != kernels::RopeFrequencies::Scaling::None && !(llama3 && arch == "llama") && !(yarn && (gpt_oss || deepseek2)) &&
      !(linear && gemma3) && !(longrope && phi3))
    refuse("scales its RoPE (linear, YaRN or LongRoPE), which qkv does not write to GGUF yet (Llama 3.1's, gpt-oss's "
           "YaRN, Gemma 3's linear scaling and Phi-3's LongRoPE it does)");
  if (yarn && (rope.beta_fast != 32.0 || rope.beta_slow != 1.0))
    refuse("sets YaRN's beta_fast and beta_slow to other values than 32 and 1, which llama.cpp's GGUF keys cannot hold");
  if (rope.rotary_dim != 0 && rope.rotary_dim != c.head_dim && !phi3 && arch != "qwen3next") refuse("rotates only part of each head");
  // Phi-3's window is written as convert_hf_to_gguf writes it, though llama.cpp's phi3 disables it (qkv reads it back)
  for (const DecoderLayerSettings& l : c.layers) {
    if (l.window > 0 && !gpt_oss && !gemma3 && !gemma2 && !phi3 && !olmo3)
      refuse("has sliding-window layers, which llama.cpp's " + arch + " does not compute");
  }
  for (size_t i = 0; i < c.layers.size(); ++i) {  // SmolLM3: llama.cpp's smollm3 leaves every 4th layer unrotated
    if (arch == "qwen3next" && c.layers[i].linear) continue;  // Gated DeltaNet layers rotate nothing
    const int64_t want = arch == "smollm3" && (i + 1) % 4 == 0 ? -1 : gemma3 && c.layers[i].window > 0 ? 1 : 0;
    if (c.layers[i].rope != want && !(olmo3 && c.layers[i].rope >= 0))  // OLMo 3's two settings are equal (above)
      refuse(arch == "smollm3" ? "leaves other layers than every 4th without RoPE, as llama.cpp's smollm3 does"
                               : "has layers without RoPE");
  }
  if (c.rope_layout != RopeLayout::RotateHalf && arch != "llama" && !deepseek2)
    refuse("rotates interleaved pairs, which llama.cpp's " + arch + " does not");
  for (const DecoderConfig::Parameter& p : c.layout())  // Phi-3's fused qkv_proj and gate_up_proj: its attn_qkv and ffn_up
    if (p.transposed || (p.parts.size() != 1 && !phi3)) refuse("stores " + p.name + " fused or transposed");
  (void)deepseek2;
}

// llama.cpp's deepseek2 (convert_hf_to_gguf's DeepseekV2Model for DeepSeek-V3): latent attention as one shared KV head
// of the latent and the rotated key (key_length R + dr, value_length R), the per-head sizes in the *_mla keys; the
// first layers dense; the sigmoid router with its groups, scale and renormalisation; YaRN's mscale_all_dim as 0.1·it.
void deepseek2_metadata(const DecoderConfig& c, std::vector<std::pair<std::string, GgufValue>>& m) {
  const std::string a = "deepseek2.";
  auto u32 = [](int64_t v) { return GgufValue::u32(static_cast<uint32_t>(v)); };
  auto set = [&](const std::string& key, GgufValue v) {  // replace a key written above, or add it
    for (auto& [k, old] : m)
      if (k == a + key) {
        old = std::move(v);
        return;
      }
    m.emplace_back(a + key, std::move(v));
  };
  set("attention.head_count_kv", u32(1));
  set("attention.key_length", u32(c.kv_lora_rank + c.head_dim));
  set("attention.value_length", u32(c.kv_lora_rank));
  set("attention.key_length_mla", u32(c.qk_nope_head_dim + c.head_dim));
  set("attention.value_length_mla", u32(c.v_head_dim));
  if (c.q_lora_rank > 0) set("attention.q_lora_rank", u32(c.q_lora_rank));
  set("attention.kv_lora_rank", u32(c.kv_lora_rank));
  set("rope.dimension_count", u32(c.head_dim));
  int64_t dense = 0;
  while (dense < c.num_layers && !c.layers[static_cast<size_t>(dense)].experts) ++dense;
  set("leading_dense_block_count", u32(dense));
  if (c.num_experts > 0) {
    set("expert_shared_count", u32(c.shared_expert_intermediate_size / std::max<int64_t>(c.expert_intermediate_size, 1)));
    set("expert_weights_scale", GgufValue::f32(static_cast<float>(c.routed_scaling_factor)));
    if (c.norm_topk_prob) set("expert_weights_norm", GgufValue::boolean(true));
    set("expert_gating_func", u32(2));  // sigmoid (llama.cpp's default, when absent, is softmax)
    if (c.expert_groups > 1) {
      set("expert_group_count", u32(c.expert_groups));
      set("expert_group_used_count", u32(c.expert_groups_kept));
    }
  }
  const kernels::RopeFrequencies& r = c.ropes.front();
  if (r.scaling == kernels::RopeFrequencies::Scaling::Yarn) {
    set("rope.scaling.type", GgufValue::string("yarn"));
    set("rope.scaling.factor", GgufValue::f32(static_cast<float>(r.factor)));
    set("rope.scaling.original_context_length", u32(static_cast<int64_t>(r.original_max_position_embeddings)));
    // the softmax scale carries mscale(factor, mscale_all_dim)²: mscale_all_dim taken back from it
    const double mscale = std::sqrt(c.attention_scale * std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.head_dim)));
    if (r.factor > 1.0 && std::fabs(mscale - 1.0) > 1e-9)
      set("rope.scaling.yarn_log_multiplier", GgufValue::f32(static_cast<float>((mscale - 1.0) / std::log(r.factor))));
  }
}

// The model's keys, as convert_hf_to_gguf.py writes them for these architectures.
std::vector<std::pair<std::string, GgufValue>> model_metadata(const DecoderConfig& c, const GgufExportOptions& o,
                                                              bool quantized) {
  const std::string a = c.family->gguf_architecture;
  auto u32 = [](int64_t v) { return GgufValue::u32(static_cast<uint32_t>(v)); };
  std::vector<std::pair<std::string, GgufValue>> m = {{"general.architecture", GgufValue::string(a)}};
  if (!o.name.empty()) m.emplace_back("general.name", GgufValue::string(o.name));
  m.emplace_back(a + ".vocab_size", u32(c.vocab_size));
  m.emplace_back(a + ".context_length", u32(c.max_positions));
  m.emplace_back(a + ".embedding_length", u32(c.hidden_size));
  m.emplace_back(a + ".block_count", u32(c.num_layers));
  m.emplace_back(a + ".feed_forward_length", u32(c.intermediate_size));
  m.emplace_back(a + ".attention.head_count", u32(c.num_heads));
  m.emplace_back(a + ".attention.head_count_kv", u32(c.num_kv_heads));
  m.emplace_back(a + ".rope.freq_base", GgufValue::f32(static_cast<float>(c.ropes.front().theta)));
  m.emplace_back(a + ".attention.layer_norm_rms_epsilon", GgufValue::f32(static_cast<float>(c.norm_eps)));
  if (c.head_dim * c.num_heads != c.hidden_size) {  // Qwen3's 128-wide heads of a 1024-wide model
    m.emplace_back(a + ".attention.key_length", u32(c.head_dim));
    m.emplace_back(a + ".attention.value_length", u32(c.head_dim));
  }
  const kernels::RopeFrequencies& rope = c.ropes.front();
  if (a == "llama" || a == "phi3" || a == "qwen3next")  // Phi-3 and Qwen3-Next rotate the first rotary_dim of each head
    m.emplace_back(a + ".rope.dimension_count", u32(rope.rotary_dim > 0 ? rope.rotary_dim : c.head_dim));
  if (rope.scaling == kernels::RopeFrequencies::Scaling::LongRope) {  // the factors are tensors (write_gguf)
    m.emplace_back(a + ".rope.scaling.attn_factor", GgufValue::f32(static_cast<float>(rope.attention_factor)));
    m.emplace_back(a + ".rope.scaling.original_context_length", u32(static_cast<int64_t>(rope.original_max_position_embeddings)));
  }
  if (c.attn_softcap > 0.0) m.emplace_back(a + ".attn_logit_softcapping", GgufValue::f32(static_cast<float>(c.attn_softcap)));
  if (c.final_softcap > 0.0) m.emplace_back(a + ".final_logit_softcapping", GgufValue::f32(static_cast<float>(c.final_softcap)));
  int64_t window = 0;  // the sliding layers' window (gpt-oss, Gemma 2 and 3, OLMo 3)
  for (const DecoderLayerSettings& l : c.layers) window = std::max(window, l.window);
  if (window > 0 || a == "phi3") m.emplace_back(a + ".attention.sliding_window", u32(window));  // phi3: 0 for none
  if (c.ropes.front().scaling == kernels::RopeFrequencies::Scaling::Linear) {  // Gemma 3 4B and larger: its global layers
    m.emplace_back(a + ".rope.scaling.type", GgufValue::string("linear"));
    m.emplace_back(a + ".rope.scaling.factor", GgufValue::f32(static_cast<float>(c.ropes.front().factor)));
  }
  if (c.family->stacked_experts) {  // gpt-oss: YaRN as convert_hf_to_gguf writes it
    const kernels::RopeFrequencies& r = c.ropes.front();
    if (r.scaling == kernels::RopeFrequencies::Scaling::Yarn) {
      m.emplace_back(a + ".rope.scaling.type", GgufValue::string("yarn"));
      m.emplace_back(a + ".rope.scaling.factor", GgufValue::f32(static_cast<float>(r.factor)));
      m.emplace_back(a + ".rope.scaling.original_context_length", u32(static_cast<int64_t>(r.original_max_position_embeddings)));
    }
  }
  if (c.num_experts > 0) {
    m.emplace_back(a + ".expert_count", u32(c.num_experts));
    m.emplace_back(a + ".expert_used_count", u32(c.experts_per_token));
    m.emplace_back(a + ".expert_feed_forward_length", u32(c.expert_intermediate_size));
  }
  if (a == "deepseek2") deepseek2_metadata(c, m);
  if (a == "qwen3next") {  // its Gated DeltaNet sizes, which layers are linear, the shared expert; heads of head_dim
    auto set = [&](const std::string& key, GgufValue v) {
      for (auto& [k, old] : m)
        if (k == a + "." + key) {
          old = std::move(v);
          return;
        }
      m.emplace_back(a + "." + key, std::move(v));
    };
    set("attention.key_length", u32(c.head_dim));
    set("attention.value_length", u32(c.head_dim));
    set("expert_shared_feed_forward_length", u32(c.shared_expert_intermediate_size));
    set("ssm.conv_kernel", u32(c.linear_conv_kernel));
    set("ssm.state_size", u32(c.linear_key_dim));
    set("ssm.group_count", u32(c.linear_key_heads));
    set("ssm.time_step_rank", u32(c.linear_value_heads));
    set("ssm.inner_size", u32(c.linear_value_heads * c.linear_value_dim));
    std::vector<bool> recurrent;
    for (const DecoderLayerSettings& l : c.layers) recurrent.push_back(l.linear);
    set("attention.recurrent_layers", GgufValue::booleans(recurrent));
  }
  m.emplace_back("general.file_type", GgufValue::u32(row_of(o.type).ftype));
  if (quantized) m.emplace_back("general.quantization_version", GgufValue::u32(2));  // ggml's GGML_QNT_VERSION
  if (rope.scaling == kernels::RopeFrequencies::Scaling::Llama3) {
    // llama.cpp reads only rope_freqs.weight; qkv's reader takes the settings back from here (not rope.scaling.factor:
    // llama.cpp would scale every frequency by it)
    const std::vector<double> settings = {rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                                          rope.original_max_position_embeddings};
    m.emplace_back("qkv.rope.llama3", GgufValue::f64s(settings));
  }
  return m;
}

// Rows [r0, r0 + n) of a matrix as float32, whatever it is stored as.
void widen_rows(const Tensor& t, const std::vector<int64_t>& rows, float* out) {
  const int64_t cols = t.size(1);
  const WeightType type = t.weight_type();
  if (type == WeightType::F32) {
    for (size_t k = 0; k < rows.size(); ++k) std::memcpy(out + k * cols, t.data() + rows[k] * cols, static_cast<size_t>(cols) * 4);
    return;
  }
  const auto* base = type == WeightType::BF16 ? static_cast<const unsigned char*>(static_cast<const void*>(t.bf16()))
                                              : static_cast<const unsigned char*>(t.stored_bytes());
  const int64_t bytes = io::row_bytes(type, cols);
  // Consecutive rows in one call (the threads split them); a permuted matrix's rows one by one.
  for (size_t k = 0; k < rows.size();) {
    size_t run = 1;
    while (k + run < rows.size() && rows[k + run] == rows[k] + static_cast<int64_t>(run)) ++run;
    io::dequantize_rows(type, base + rows[k] * bytes, out + k * cols, static_cast<int64_t>(run), cols);
    k += run;
  }
}

}  // namespace

std::optional<GgufFileType> gguf_file_type_from_name(std::string_view name) {
  std::string lower(name);
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const FileTypeRow& r : kFileTypes)
    if (lower == r.name) return r.type;
  return std::nullopt;
}

const char* gguf_file_type_name(GgufFileType type) { return row_of(type).name; }

std::string gguf_file_type_names() {
  std::string out;
  for (const FileTypeRow& r : kFileTypes) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

std::string gguf_export_families() {
  return "llama (Llama, Mistral, SmolLM2 …), qwen2, qwen3, qwen3moe, gpt-oss, olmo2 (OLMo 2 and 3), gemma2, gemma3, smollm3, "
         "phi3, deepseek2 (DeepSeek-V3) and qwen3next";
}

WeightType gguf_tensor_type(GgufFileType type, const DecoderConfig& config, const DecoderConfig::Parameter& p) {
  // llama.cpp keeps ffn_gate_inp (and qwen3next's ffn_gate_inp_shexp) in float32
  if (p.role() == Role::Router || p.role() == Role::SharedExpertGate) return WeightType::F32;
  if (!role_is_matrix(p.role())) return WeightType::F32;  // norms, biases, sinks
  const WeightType base = row_of(type).base;
  const int64_t cols = p.shape[p.shape.rank() - 1];
  WeightType chosen = base;
  if (type == GgufFileType::MXFP4_MOE) {  // llama.cpp: the experts' 3-D tensors MXFP4, every other matrix Q8_0
    const Role role = p.role();
    const bool expert = role == Role::ExpertGate || role == Role::ExpertUp || role == Role::ExpertDown ||
                        role == Role::StackedGateUp || role == Role::StackedDown;
    if (expert) chosen = WeightType::MXFP4;
  }
  if (type == GgufFileType::Q4_K_M || type == GgufFileType::Q5_K_M) {
    const Role role = p.role();
    if (role == Role::Head || (role == Role::TokenEmbedding && config.tie_word_embeddings)) {
      // llama.cpp: Q8_0 when the rows do not hold whole 256-value blocks, else Q6_K
      return cols % 256 != 0 ? WeightType::Q8_0 : WeightType::Q6_K;
    }
    if ((role == Role::Value || role == Role::Down || role == Role::ExpertDown || role == Role::StackedDown) &&
        use_more_bits(p.layer, config.num_layers))
      chosen = WeightType::Q6_K;  // llama.cpp matches "ffn_down" in ffn_down_exps too
    if (role == Role::Query && p.parts.size() > 1)  // a fused attn_qkv (Phi-3): one K type up, in every layer
      chosen = type == GgufFileType::Q4_K_M ? WeightType::Q5_K : WeightType::Q6_K;
  }
  return fallback(chosen, cols);
}

GgufExportReport write_gguf(Decoder& model, const std::vector<std::pair<std::string, GgufValue>>& tokenizer,
                            const std::string& path, const GgufExportOptions& options) {
  const DecoderConfig& c = model.config;
  check_exportable(c);
  const std::string arch = c.family->gguf_architecture;
  // The file's entries (gpt-oss's stacked experts are split into several), each naming the model's tensor it holds
  const std::vector<DecoderConfig::Parameter> own = c.layout(Names::Gguf), &names = own;
  // Each tensor's type and dims, before anything is written.
  // A layer's experts go into one 3-D tensor (experts, rows, cols), as llama.cpp stacks them: planned at expert 0.
  struct Planned {
    const DecoderConfig::Parameter* p;
    std::string name;
    WeightType type;
    bool permute;
    std::vector<const DecoderConfig::Parameter*> experts;  // the stacked matrices, by expert (empty: p alone)
  };
  std::map<std::tuple<int64_t, int, int64_t>, const DecoderConfig::Parameter*> by_expert;  // (layer, role, expert)
  for (const DecoderConfig::Parameter& p : own)
    if (p.expert >= 0) by_expert[{p.layer, static_cast<int>(p.role()), p.expert}] = &p;
  std::vector<Planned> plan;
  bool quantized = false;
  for (size_t i = 0; i < own.size(); ++i) {
    const DecoderConfig::Parameter& p = own[i];
    if (p.expert > 0) continue;
    const bool matrix = role_is_matrix(p.role());
    const WeightType type = gguf_tensor_type(options.type, c, p);
    quantized = quantized || io::weight_type_info(type).block_elements > 1;
    const bool permute = matrix && gguf_permutes_qk(arch) && c.rope_layout == RopeLayout::RotateHalf &&
                         (p.role() == Role::Query || p.role() == Role::Key);
    Planned planned{&p, names[i].name, type, permute, {}};
    if (p.expert == 0)
      for (int64_t e = 0; e < c.num_experts; ++e) planned.experts.push_back(by_expert.at({p.layer, static_cast<int>(p.role()), e}));
    plan.push_back(std::move(planned));
  }

  GgufExportReport report;
  report.architecture = arch;
  io::GgufWriter writer(path);
  for (auto& [k, v] : model_metadata(c, options, quantized)) writer.add_metadata(k, v);
  for (const auto& [k, v] : tokenizer) writer.add_metadata(k, v);
  uint64_t total = 0;
  // Llama 3.1's scaled RoPE: one divisor per frequency, first, as convert_hf_to_gguf.py writes it
  std::vector<float> rope_factors;
  if (c.ropes.front().scaling == kernels::RopeFrequencies::Scaling::Llama3) {
    rope_factors = llama3_rope_factors(c.ropes.front(), c.head_dim);
    total += writer.add_tensor("rope_freqs.weight", {static_cast<int64_t>(rope_factors.size())}, io::GgmlType::F32);
    ++report.tensors_by_type["F32"];
  }
  // Phi-3's LongRoPE: its long then short factors, one per rotated frequency (llama.cpp takes the long ones when its
  // context is longer than the original one, as transformers does when the sequence is)
  if (c.ropes.front().scaling == kernels::RopeFrequencies::Scaling::LongRope) {
    const kernels::RopeFrequencies& r = c.ropes.front();
    for (const auto& [name, list] : {std::pair{"rope_factors_long.weight", &r.long_factor}, {"rope_factors_short.weight", &r.short_factor}}) {
      for (double v : *list) rope_factors.push_back(static_cast<float>(v));
      total += writer.add_tensor(name, {static_cast<int64_t>(list->size())}, io::GgmlType::F32);
      ++report.tensors_by_type["F32"];
    }
  }
  for (const Planned& t : plan) {
    std::vector<int64_t> dims(t.p->shape.dims().rbegin(), t.p->shape.dims().rend());  // ggml order: ne0 first
    if (!t.experts.empty()) dims.push_back(static_cast<int64_t>(t.experts.size()));
    total += writer.add_tensor(t.name, dims, static_cast<io::GgmlType>(io::weight_type_info(t.type).ggml_type));
    report.parameters += static_cast<uint64_t>(t.p->shape.numel()) * std::max<uint64_t>(1, t.experts.size());
    ++report.tensors_by_type[io::ggml_type_name(io::weight_type_info(t.type).ggml_type)];
  }
  report.tensor_bytes = total;

  uint64_t done = 0;
  if (!rope_factors.empty()) {
    writer.write_tensor_data(std::as_bytes(std::span(rope_factors)));
    done += rope_factors.size() * 4;
  }
  std::vector<float> values;
  std::vector<unsigned char> bytes;
  for (const Planned& planned : plan) {
   for (size_t part = 0; part < std::max<size_t>(1, planned.experts.size()); ++part) {
    Planned t = planned;
    if (!planned.experts.empty()) t.p = planned.experts[part];
    Tensor& tensor = model.parameter(*t.p);
    if (gguf_rearranged(t.p->role())) {  // gpt-oss's experts, DeepSeek's kv_b_proj: gathered into the file's rows
      values.assign(static_cast<size_t>(t.p->shape.numel()), 0.0f);
      gguf_stacked_values(tensor, *t.p, values.data(), /*to_file=*/true, &c);
      const int64_t cols = t.p->shape[t.p->shape.rank() - 1], rows = t.p->shape.numel() / cols;
      if (t.type == WeightType::F32) {
        writer.write_tensor_data(std::as_bytes(std::span(values)));
        done += values.size() * 4;
        continue;
      }
      bytes.resize(static_cast<size_t>(rows * io::row_bytes(t.type, cols)));
      io::quantize_rows(t.type, values.data(), bytes.data(), rows, cols);
      writer.write_tensor_data(std::as_bytes(std::span(bytes)));
      done += bytes.size();
      if (options.progress) options.progress(done, total);
      continue;
    }
    if (t.p->shape.rank() == 1) {  // norms and biases: float32
      const Tensor v = tensor.dtype() == DType::F32 ? tensor : Tensor();
      values.resize(static_cast<size_t>(tensor.numel()));
      if (v.defined()) std::memcpy(values.data(), v.data(), values.size() * 4);
      else io::dequantize_rows(tensor.weight_type(), tensor.bf16(), values.data(), 1, tensor.numel());
      if (c.norm == NormKind::GemmaRMSNorm && is_norm(t.p->role()))  // convert_hf_to_gguf stores Gemma's norms as 1 + w
        for (float& w : values) w += 1.0f;
      writer.write_tensor_data(std::as_bytes(std::span(values)));
      done += values.size() * 4;
      continue;
    }
    const int64_t rows = t.p->shape[0], cols = t.p->shape[1], D = c.head_dim;
    const int64_t row_size = io::row_bytes(t.type, cols);
    // A few MiB of float32 at a time: memory stays at the model plus one chunk.
    const int64_t chunk = std::max<int64_t>(1, (int64_t{8} << 20) / std::max<int64_t>(cols * 4, 1));
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      std::vector<int64_t> source(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) {
        const int64_t r = r0 + k;
        // convert_hf_to_gguf's permute: file row h·D + 2i + s holds the model's row h·D + s·D/2 + i
        source[static_cast<size_t>(k)] = t.permute ? (r / D) * D + (r % D % 2) * (D / 2) + (r % D) / 2 : r;
      }
      values.resize(static_cast<size_t>(n * cols));
      widen_rows(tensor, source, values.data());
      bytes.resize(static_cast<size_t>(n * row_size));
      try {
        io::quantize_rows(t.type, values.data(), bytes.data(), n, cols);
      } catch (const std::invalid_argument& e) {
        throw ValueError(t.p->name + " cannot be stored as " + io::weight_type_info(t.type).name + ": " + e.what());
      }
      writer.write_tensor_data(std::as_bytes(std::span(bytes)));
      done += bytes.size();
      if (options.progress) options.progress(done, total);
    }
   }
  }
  writer.finish();
  std::error_code ec;
  report.file_bytes = std::filesystem::file_size(path, ec);
  return report;
}

GgufExportReport quantize_to_gguf(const std::string& source, const std::string& path, const GgufExportOptions& options) {
  PretrainedOptions load;
  load.keep_stored = true;  // read as stored: a bfloat16 folder stays bfloat16, a GGUF mapped
  load.tokenizer = false;   // its metadata is taken as the file has it, below
  const auto loaded = load_pretrained(source, load);
  check_exportable(loaded->model->config);
  std::vector<std::pair<std::string, GgufValue>> tokenizer;
  GgufExportOptions o = options;
  if (loaded->format == CheckpointFormat::Gguf) {  // its tokenizer keys as they are
    const io::GgufFile file = io::GgufFile::open(source);
    for (const auto& [k, v] : file.metadata())
      if (k.rfind("tokenizer.", 0) == 0) tokenizer.emplace_back(k, v);
    if (o.name.empty() && file.contains("general.name") && file.value("general.name").type() == io::GgufType::String)
      o.name = file.string("general.name");
  } else if (loaded->format == CheckpointFormat::HuggingFaceFolder) {
    tokenizer = text::gguf_tokenizer_metadata(source);
    if (o.name.empty()) o.name = std::filesystem::path(source).lexically_normal().filename().string();
    if (o.name.empty()) o.name = std::filesystem::path(source).lexically_normal().parent_path().filename().string();
  } else {
    throw IoError(source + " is a " + std::string(checkpoint_format_name(loaded->format)) +
                  "; qkv quantize reads a Hugging Face model folder (with its tokenizer.json) or a GGUF file");
  }
  return write_gguf(*loaded->model, tokenizer, path, o);
}

}  // namespace qkv::nn
