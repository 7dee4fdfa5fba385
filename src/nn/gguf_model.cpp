// A GGUF file as a Decoder (see qkv/nn/gguf_model.hpp): the configuration through the Hugging Face reader (the
// metadata written as the config.json it came from, so every family rule applies once), the tensors mapped.
#include "qkv/nn/gguf_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <vector>

#include "qkv/io/ggml_types.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::nn {

namespace {

using json = nlohmann::json;
using io::WeightType;

// Every message says what the file is, then what is wrong with it.
[[noreturn]] void fail(const io::GgufFile& file, const std::string& what) {
  throw IoError(file.path() + ": a GGUF file (llama.cpp's format) that qkv cannot run: " + what);
}

// A scalar integer key, or `fallback` when absent; a per-layer array whose entries are all equal is that value.
int64_t integer_key(const io::GgufFile& file, const std::string& key, int64_t fallback) {
  const io::GgufValue* v = file.find_value(key);
  if (!v) return fallback;
  if (v->is_array()) {
    const std::vector<int64_t> values = file.integers(key);
    if (values.empty()) fail(file, key + " is an empty array");
    for (int64_t x : values)
      if (x != values.front()) fail(file, key + " differs from layer to layer; qkv's decoder has one value for all layers");
    return values.front();
  }
  return file.integer(key);
}
int64_t required_integer(const io::GgufFile& file, const std::string& key) {
  if (!file.contains(key)) fail(file, "has no metadata key '" + key + "', which a model of its architecture needs");
  return integer_key(file, key, 0);
}
double real_key(const io::GgufFile& file, const std::string& key, double fallback) {
  return file.contains(key) ? file.real(key) : fallback;
}

// The storage a GGUF tensor type is kept in: its own, or Q8_0 for Q5_0 (exact), or F32 for the types with an offset.
struct Storage {
  WeightType type = WeightType::F32;
  bool exact_repack = false;  // Q5_0 → Q8_0
  bool widen = false;         // Q4_1, Q5_1 → F32 (dequantized here)
};
Storage storage_of(const io::GgufFile& file, const io::GgufTensor& t) {
  const auto id = static_cast<uint32_t>(t.type);
  if (t.type == io::GgmlType::Q5_0) return {WeightType::Q8_0, true, false};
  if (t.type == io::GgmlType::Q4_1 || t.type == io::GgmlType::Q5_1) return {WeightType::F32, false, true};
  if (const auto type = io::weight_type_from_ggml(id)) return {*type, false, false};
  fail(file, "tensor '" + t.name + "' is " + io::ggml_type_name(id) + "; qkv computes with F32, F16, BF16, Q8_0, Q4_0, "
             "Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 (requantize the model with llama-quantize or qkv quantize)");
}

float half(const unsigned char* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return io::f16_to_f32(h);
}

// ggml's Q5_0 (d, 32 fifth bits, 16 bytes of nibbles: x = d·(q − 16)) as Q8_0 (d, int8 q − 16): the same values and
// the same integer products against q8_0 activations. `rows` rows of `cols`.
std::vector<unsigned char> q5_0_as_q8_0(const unsigned char* src, int64_t rows, int64_t cols) {
  const int64_t blocks = rows * cols / 32;
  std::vector<unsigned char> out(static_cast<size_t>(blocks * 34));
  for (int64_t b = 0; b < blocks; ++b) {
    const unsigned char* in = src + b * 22;
    unsigned char* o = out.data() + b * 34;
    std::memcpy(o, in, 2);  // d
    uint32_t qh;
    std::memcpy(&qh, in + 2, 4);
    for (int j = 0; j < 16; ++j) {
      const int low = (in[6 + j] & 0x0f) | (((qh >> j) & 1) << 4), high = (in[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      o[2 + j] = static_cast<unsigned char>(static_cast<int8_t>(low - 16));
      o[2 + j + 16] = static_cast<unsigned char>(static_cast<int8_t>(high - 16));
    }
  }
  return out;
}

// ggml's Q4_1 (d, m, nibbles) and Q5_1 (d, m, fifth bits, nibbles): x = d·q + m, widened to float32.
void widen_offset_blocks(io::GgmlType type, const unsigned char* src, float* dst, int64_t count) {
  const bool five = type == io::GgmlType::Q5_1;
  const int64_t bytes = five ? 24 : 20;
  for (int64_t b = 0; b < count / 32; ++b) {
    const unsigned char* in = src + b * bytes;
    const float d = half(in), m = half(in + 2);
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, in + 4, 4);
    const unsigned char* qs = in + (five ? 8 : 4);
    for (int j = 0; j < 16; ++j) {
      const int low = (qs[j] & 0x0f) | (five ? static_cast<int>(((qh >> j) & 1) << 4) : 0);
      const int high = (qs[j] >> 4) | (five ? static_cast<int>(((qh >> (j + 16)) & 1) << 4) : 0);
      dst[b * 32 + j] = d * static_cast<float>(low) + m;
      dst[b * 32 + j + 16] = d * static_cast<float>(high) + m;
    }
  }
}


// Phi-3's LongRoPE from rope_factors_long/short.weight (one F32 factor per rotated frequency each) and the keys
// convert_hf_to_gguf writes beside them, as transformers' rope_scaling object; or a refusal naming what is missing.
json longrope_scaling(const io::GgufFile& file, const io::GgufTensor& long_factors, const std::string& k, int64_t rotary) {
  const io::GgufTensor* short_factors = file.find("rope_factors_short.weight");
  json scaling{{"rope_type", "longrope"}};
  for (const auto& [name, t] : {std::pair{"long", &long_factors}, {"short", short_factors}}) {
    if (!t || t->type != io::GgmlType::F32 || t->dims.size() != 1 || t->dims[0] != rotary / 2)
      fail(file, std::string("rope_factors_") + name + ".weight is not " + std::to_string(rotary / 2) +
                     " F32 factors, one per rotated frequency (LongRoPE needs both the long and the short ones)");
    std::vector<float> factors(static_cast<size_t>(t->dims[0]));
    if (!factors.empty()) std::memcpy(factors.data(), t->data, factors.size() * 4);
    scaling[std::string(name) + "_factor"] = factors;
  }
  scaling["original_max_position_embeddings"] = required_integer(file, k + "rope.scaling.original_context_length");
  if (file.contains(k + "rope.scaling.attn_factor")) scaling["attention_factor"] = file.real(k + "rope.scaling.attn_factor");
  return scaling;
}

// rope_freqs.weight as Llama 3.1's scaling (see the header), or a refusal naming what differs.
json llama3_scaling(const io::GgufFile& file, const io::GgufTensor& freqs, const json& config, int64_t rotary) {
  const int64_t head_dim = config["head_dim"].get<int64_t>();
  if (freqs.type != io::GgmlType::F32 || freqs.dims.size() != 1 || freqs.dims[0] != rotary / 2 || rotary != head_dim)
    fail(file, "rope_freqs.weight is not " + std::to_string(head_dim / 2) + " F32 factors, one per frequency of a head");
  std::vector<float> factors(static_cast<size_t>(freqs.dims[0]));
  if (!factors.empty()) std::memcpy(factors.data(), freqs.data, factors.size() * 4);
  kernels::RopeFrequencies rope{.theta = config["rope_theta"].get<double>()};
  rope.scaling = kernels::RopeFrequencies::Scaling::Llama3;
  if (const io::GgufValue* v = file.find_value("qkv.rope.llama3"); v && v->is_array() && v->size() == 4) {
    const std::vector<double> p = v->as_doubles();
    rope.factor = p[0], rope.low_freq_factor = p[1], rope.high_freq_factor = p[2], rope.original_max_position_embeddings = p[3];
  } else {  // a file from convert_hf_to_gguf.py: Meta's settings for every Llama 3.1, 3.2 and 3.3
    rope.factor = factors.empty() ? 1.0 : factors.back(), rope.low_freq_factor = 1.0, rope.high_freq_factor = 4.0;
    rope.original_max_position_embeddings = 8192.0;
  }
  const std::vector<float> want = llama3_rope_factors(rope, head_dim);
  for (size_t i = 0; i < factors.size(); ++i)
    if (!(std::fabs(factors[i] - want[i]) <= 1e-4f * std::fabs(want[i])))
      fail(file, "rope_freqs.weight[" + std::to_string(i) + "] is " + std::to_string(factors[i]) + " where Llama 3.1's "
                 "scaling gives " + std::to_string(want[i]) + "; qkv computes RoPE scaled only as Llama 3.1 does");
  return {{"rope_type", "llama3"}, {"factor", rope.factor}, {"low_freq_factor", rope.low_freq_factor},
          {"high_freq_factor", rope.high_freq_factor},
          {"original_max_position_embeddings", static_cast<int64_t>(rope.original_max_position_embeddings)}};
}

}  // namespace

std::vector<float> llama3_rope_factors(const kernels::RopeFrequencies& rope, int64_t head_dim) {
  // convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): freqs = 1 / base ** (arange(0, dim, 2) / dim) in
  // float32, then per frequency its wavelength's band.
  const double old_len = rope.original_max_position_embeddings;
  const double low_wavelen = old_len / rope.low_freq_factor, high_wavelen = old_len / rope.high_freq_factor;
  std::vector<float> out(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float freq = 1.0f / static_cast<float>(std::pow(rope.theta, static_cast<double>(exponent)));
    const double wavelen = 2.0 * std::numbers::pi / freq;
    double f = 1.0;
    if (wavelen > low_wavelen) {
      f = rope.factor;
    } else if (!(wavelen < high_wavelen)) {
      const double smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
      f = 1.0 / ((1.0 - smooth) / rope.factor + smooth);
    }
    out[static_cast<size_t>(i)] = static_cast<float>(f);
  }
  return out;
}

const Family* family_of_gguf_architecture(std::string_view architecture) {
  for (const Family& f : families())
    if (!f.gguf_architecture.empty() && f.gguf_architecture == architecture && f.naming != Naming::Book) return &f;
  return nullptr;
}

DecoderConfig decoder_config_from_gguf(const io::GgufFile& file) {
  if (!file.contains("general.architecture"))
    fail(file, "it has no general.architecture key, so nothing says which model it holds");
  const std::string arch = file.string("general.architecture");
  const Family* family = family_of_gguf_architecture(arch);
  if (!family) {
    std::string known;
    for (const Family& f : families())
      if (!f.gguf_architecture.empty() && f.naming != Naming::Book && known.find(f.gguf_architecture) == std::string::npos)
        known += (known.empty() ? "" : ", ") + f.gguf_architecture;
    fail(file, "general.architecture is '" + arch.substr(0, 40) + "'; qkv runs GGUF files of " + known);
  }
  const std::string k = arch + ".";
  const io::GgufTensor* embedding = file.find("token_embd.weight");
  if (!embedding || embedding->dims.size() != 2) fail(file, "has no 2-D tensor token_embd.weight (the token embedding)");
  json j;
  j["model_type"] = family->model_types.front();
  j["vocab_size"] = embedding->dims[1];
  j["hidden_size"] = required_integer(file, k + "embedding_length");
  j["intermediate_size"] = required_integer(file, k + "feed_forward_length");
  j["num_hidden_layers"] = required_integer(file, k + "block_count");
  const int64_t heads = required_integer(file, k + "attention.head_count");
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = integer_key(file, k + "attention.head_count_kv", heads);
  const int64_t head_dim = integer_key(file, k + "attention.key_length", heads > 0 ? j["hidden_size"].get<int64_t>() / heads : 0);
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = required_integer(file, k + "context_length");
  j[family->norm_eps_key] = real_key(file, k + "attention.layer_norm_rms_epsilon",
                                     real_key(file, k + "attention.layer_norm_epsilon", family->norm_eps_default));
  j["rope_theta"] = real_key(file, k + "rope.freq_base", family->rope_theta_default);
  const int64_t rotary = integer_key(file, k + "rope.dimension_count", head_dim);
  if (rotary != head_dim && head_dim > 0) j["partial_rotary_factor"] = static_cast<double>(rotary) / static_cast<double>(head_dim);
  if (file.contains(k + "rope.scaling.type")) {
    const std::string type = file.string(k + "rope.scaling.type");
    if (type == "linear" || type == "yarn") {
      json scaling{{"rope_type", type}, {"factor", real_key(file, k + "rope.scaling.factor", 1.0)}};
      if (type == "yarn")
        scaling["original_max_position_embeddings"] = integer_key(file, k + "rope.scaling.original_context_length", 0);
      j["rope_scaling"] = scaling;
    } else if (type != "none") {
      fail(file, k + "rope.scaling.type is '" + type.substr(0, 20) + "'; qkv reads none, linear and yarn from a GGUF");
    }
  }
  if (const io::GgufTensor* freqs = file.find("rope_freqs.weight")) j["rope_scaling"] = llama3_scaling(file, *freqs, j, rotary);
  if (const io::GgufTensor* factors = file.find("rope_factors_long.weight")) {
    if (!family->partial_rotary) fail(file, "holds LongRoPE factors (rope_factors_long.weight), which qkv reads for phi3 only");
    j["rope_scaling"] = longrope_scaling(file, *factors, k, rotary);
  }
  if (file.contains(k + "attention.sliding_window")) j["sliding_window"] = integer_key(file, k + "attention.sliding_window", 0);
  // llama.cpp's olmo2 with a window is OLMo 3 (3 sliding layers of 4)
  if (arch == "olmo2" && j.contains("sliding_window") && j["sliding_window"].get<int64_t>() > 0) j["model_type"] = "olmo3";
  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (file.contains(k + cap)) j[cap] = file.real(k + cap);
  if (family->query_pre_attn_scalar) j["query_pre_attn_scalar"] = head_dim;
  if (family->stacked_experts) {  // gpt-oss: every layer's experts; the clamp llama.cpp's graph fixes at 7
    j["num_local_experts"] = required_integer(file, k + "expert_count");
    j["num_experts_per_tok"] = required_integer(file, k + "expert_used_count");
    j["intermediate_size"] = required_integer(file, k + "expert_feed_forward_length");
    j["swiglu_limit"] = 7.0;
    // YaRN as the model was trained (OpenAI's reference and transformers: the ramp's ends not rounded; llama.cpp
    // rounds them, 8 and 18 for gpt-oss-20b's 8.09 and 17.40)
    if (j.contains("rope_scaling") && j["rope_scaling"]["rope_type"] == "yarn") j["rope_scaling"]["truncate"] = false;
  } else if (family->latent_attention) {  // deepseek2: DeepSeek-V3's keys, written back as its config.json's
    // Files converted before llama.cpp's MLA support (mid-2025) keep kv_b_proj whole as attn_kv_b, with every head's
    // key and value sizes in key_length and value_length and as many K/V heads as query heads
    const bool joined = !file.contains(k + "attention.key_length_mla");
    if (joined && !file.find("blk.0.attn_kv_b.weight"))
      fail(file, "has neither " + k + "attention.key_length_mla (attn_k_b and attn_v_b) nor blk.0.attn_kv_b.weight: "
                 "its latent attention's up-projection is missing");
    const std::string key_length = k + (joined ? "attention.key_length" : "attention.key_length_mla");
    const std::string value_length = k + (joined ? "attention.value_length" : "attention.value_length_mla");
    const int64_t rope_dims = required_integer(file, k + "rope.dimension_count");
    j["num_key_value_heads"] = heads;
    j.erase("head_dim");
    j.erase("partial_rotary_factor");
    j["kv_lora_rank"] = required_integer(file, k + "attention.kv_lora_rank");
    j["q_lora_rank"] = file.contains(k + "attention.q_lora_rank") ? json(required_integer(file, k + "attention.q_lora_rank")) : json();
    j["qk_rope_head_dim"] = rope_dims;
    j["qk_nope_head_dim"] = required_integer(file, key_length) - rope_dims;
    j["v_head_dim"] = required_integer(file, value_length);
    j["rope_interleave"] = true;  // llama.cpp's deepseek2 rotates pairs (rope type NORM)
    j["first_k_dense_replace"] = integer_key(file, k + "leading_dense_block_count", 0);
    const bool moe = file.contains(k + "expert_count") && file.integer(k + "expert_count") > 0;
    if (moe) {
      if (integer_key(file, k + "expert_gating_func", 1) != 2)
        fail(file, k + "expert_gating_func is not 2 (sigmoid); qkv runs DeepSeek-V3's sigmoid router only");
      j["n_routed_experts"] = required_integer(file, k + "expert_count");
      j["num_experts_per_tok"] = required_integer(file, k + "expert_used_count");
      j["moe_intermediate_size"] = required_integer(file, k + "expert_feed_forward_length");
      j["n_shared_experts"] = integer_key(file, k + "expert_shared_count", 0);
      j["routed_scaling_factor"] = real_key(file, k + "expert_weights_scale", 1.0);
      j["norm_topk_prob"] = file.contains(k + "expert_weights_norm") && file.value(k + "expert_weights_norm").as_bool();
      j["n_group"] = std::max<int64_t>(1, integer_key(file, k + "expert_group_count", 1));
      j["topk_group"] = std::max<int64_t>(1, integer_key(file, k + "expert_group_used_count", 1));
    } else {
      j["first_k_dense_replace"] = j["num_hidden_layers"];
      j["n_routed_experts"] = 1, j["num_experts_per_tok"] = 1, j["n_group"] = 1, j["topk_group"] = 1;
    }
    if (j.contains("rope_scaling") && j["rope_scaling"]["rope_type"] == "yarn") {
      // llama.cpp keeps 0.1·mscale_all_dim, and takes mscale equal to it (its graph scales cos and sin by their ratio, 1)
      const double all_dim = real_key(file, k + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1;
      j["rope_scaling"]["beta_fast"] = 32.0, j["rope_scaling"]["beta_slow"] = 1.0;
      if (all_dim != 0.0) j["rope_scaling"]["mscale"] = all_dim, j["rope_scaling"]["mscale_all_dim"] = all_dim;
    }
  } else if (family->linear_attention) {  // qwen3next: Gated DeltaNet layers and gated attention, experts everywhere
    const int64_t nextn = integer_key(file, k + "nextn_predict_layers", 0), layers = j["num_hidden_layers"].get<int64_t>() - nextn;
    if (nextn < 0 || layers <= 0) fail(file, k + "nextn_predict_layers is " + std::to_string(nextn) + " of " + std::to_string(layers + nextn) + " blocks");
    j["num_hidden_layers"] = layers;  // the multi-token-prediction blocks after the last are not run
    j["partial_rotary_factor"] = static_cast<double>(rotary) / static_cast<double>(head_dim);
    j["linear_conv_kernel_dim"] = required_integer(file, k + "ssm.conv_kernel");
    j["linear_key_head_dim"] = required_integer(file, k + "ssm.state_size");
    j["linear_num_key_heads"] = required_integer(file, k + "ssm.group_count");
    const int64_t value_heads = required_integer(file, k + "ssm.time_step_rank");
    j["linear_num_value_heads"] = value_heads;
    j["linear_value_head_dim"] = required_integer(file, k + "ssm.inner_size") / std::max<int64_t>(value_heads, 1);
    json types = json::array();
    if (file.contains(k + "attention.recurrent_layers")) {
      const io::GgufValue& value = file.value(k + "attention.recurrent_layers");  // bools (or integers, as llama.cpp takes)
      std::vector<bool> flags;
      if (value.is_array() && value.element_type() == io::GgufType::Bool)
        for (std::byte b : value.raw()) flags.push_back(b != std::byte{0});
      else if (value.is_array())
        for (int64_t v : value.as_int64s()) flags.push_back(v != 0);
      if (static_cast<int64_t>(flags.size()) < layers)
        fail(file, k + "attention.recurrent_layers holds " + std::to_string(flags.size()) + " flags for " + std::to_string(layers) + " blocks");
      for (int64_t i = 0; i < layers; ++i) types.push_back(flags[static_cast<size_t>(i)] ? "linear_attention" : "full_attention");
    } else {
      const int64_t interval = integer_key(file, k + "full_attention_interval", 4);
      if (interval <= 0) fail(file, k + "full_attention_interval must be positive");
      for (int64_t i = 0; i < layers; ++i) types.push_back((i + 1) % interval != 0 ? "linear_attention" : "full_attention");
    }
    j["layer_types"] = types;
    j["num_experts"] = required_integer(file, k + "expert_count");
    j["num_experts_per_tok"] = required_integer(file, k + "expert_used_count");
    j["moe_intermediate_size"] = required_integer(file, k + "expert_feed_forward_length");
    j["shared_expert_intermediate_size"] = integer_key(file, k + "expert_shared_feed_forward_length", j["intermediate_size"].get<int64_t>());
    j["norm_topk_prob"] = true;  // llama.cpp's graph renormalises the top k weights
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = json::array();
  } else if (family->experts && !family->latent_attention) {  // qwen3moe: llama.cpp's graph renormalises the top k weights
    j["num_experts"] = required_integer(file, k + "expert_count");
    j["num_experts_per_tok"] = required_integer(file, k + "expert_used_count");
    j["moe_intermediate_size"] = required_integer(file, k + "expert_feed_forward_length");
    j["norm_topk_prob"] = true;
    json dense = json::array();  // layers with a plain MLP (no router)
    for (int64_t i = 0; i < j["num_hidden_layers"].get<int64_t>(); ++i)
      if (!file.find("blk." + std::to_string(i) + ".ffn_gate_inp.weight")) dense.push_back(i);
    j["mlp_only_layers"] = dense;
  }
  j["tie_word_embeddings"] = file.find("output.weight") == nullptr;
  if (family->bias == BiasRule::AttentionBias) j["attention_bias"] = file.find("blk.0.attn_q.bias") != nullptr;
  const GgufExtras extras = gguf_extras(file);
  if (extras.bos_id >= 0) j["bos_token_id"] = extras.bos_id;
  if (extras.eos_id >= 0) j["eos_token_id"] = extras.eos_id;
  try {
    return decoder_config_from_hf(j.dump(), file.path() + " (its " + arch + ".* metadata)");
  } catch (const ValueError& e) {
    fail(file, std::string("its metadata do not make a valid model: ") + e.what());
  }
}

GgufExtras gguf_extras(const io::GgufFile& file) {
  GgufExtras out;
  if (const io::GgufValue* v = file.find_value("tokenizer.chat_template"); v && v->type() == io::GgufType::String)
    out.chat_template = v->as_string();
  auto id = [&](const char* key) { return file.contains(key) ? file.integer(key) : int64_t{-1}; };
  out.bos_id = id("tokenizer.ggml.bos_token_id");
  out.eos_id = id("tokenizer.ggml.eos_token_id");
  return out;
}

// Llama (and Mistral, written as llama) and SmolLM3 (rope type NORM). convert_hf_to_gguf's permute: GGUF row
// h·D + 2i + s holds Hugging Face row h·D + s·D/2 + i.
bool gguf_permutes_qk(std::string_view architecture) { return architecture == "llama" || architecture == "smollm3"; }

bool is_norm(Role r) {
  return r == Role::AttnNorm || r == Role::QueryNorm || r == Role::KeyNorm || r == Role::PostAttnNorm ||
         r == Role::MlpNorm || r == Role::PostMlpNorm || r == Role::FinalNorm;
}

bool is_stacked(Role r) {
  return r == Role::StackedGateUp || r == Role::StackedGateUpBias || r == Role::StackedDown || r == Role::StackedDownBias;
}

bool gguf_rearranged(Role r) {
  return is_stacked(r) || r == Role::LatentB || r == Role::DeltaQkvz || r == Role::DeltaConv || r == Role::DeltaALog;
}

namespace {
// The model tensor's values as float32: its own, or (writing a file) a widened copy in `widened`
float* model_values(const Tensor& t, bool to_file, std::vector<float>& widened) {
  if (t.dtype() == DType::F32) return const_cast<float*>(t.data());  // written only when reading the file
  if (!to_file) throw ValueError("gguf_stacked_values: the model's tensor must be float32 to be read into");
  widened.resize(static_cast<size_t>(t.numel()));
  io::dequantize_rows(t.weight_type(), t.dtype() == DType::BF16 ? static_cast<const void*>(t.bf16()) : t.stored_bytes(),
                           widened.data(), t.size(0), t.numel() / std::max<int64_t>(t.size(0), 1));
  return widened.data();
}
}  // namespace

void gguf_stacked_values(const Tensor& t, const DecoderConfig::Parameter& entry, float* file, bool to_file,
                         const DecoderConfig* config) {
  std::vector<float> widened;
  auto swap_in = [&](float& f, float& m) {
    if (to_file) f = m;
    else m = f;
  };
  if (entry.role() == Role::DeltaConv) {  // (channels, 1, taps) as (channels, taps): the same values
    float* model = model_values(t, to_file, widened);
    for (int64_t i = 0; i < entry.shape.numel(); ++i) swap_in(file[i], model[i]);
    return;
  }
  if (entry.role() == Role::DeltaALog) {  // llama.cpp's ssm_a = −exp(A_log)
    float* model = model_values(t, to_file, widened);
    for (int64_t i = 0; i < entry.shape.numel(); ++i) {
      if (to_file) file[i] = -std::exp(model[i]);
      else if (!(file[i] < 0.0f)) throw ValueError("ssm_a holds " + std::to_string(file[i]) + "; −exp(A_log) is negative");
      else model[i] = std::log(-file[i]);
    }
    return;
  }
  if (entry.role() == Role::DeltaQkvz) {  // in_proj_qkvz's rows per key head g: q_g, k_g, v_g (r heads), z_g (r heads)
    if (!config) throw ValueError("gguf_stacked_values: in_proj_qkvz needs the model's configuration");
    const int64_t hk = config->linear_key_dim, nk = config->linear_key_heads, Kd = nk * hk;
    const int64_t rv = config->linear_value_heads / nk * config->linear_value_dim, block = 2 * hk + 2 * rv;
    const int64_t C = entry.shape[1], rows = entry.shape[0];
    const bool mixed = entry.parts.front().row0 == 0, whole = rows == 2 * Kd + 2 * config->linear_value_heads * config->linear_value_dim;
    float* model = model_values(t, to_file, widened);
    for (int64_t i = 0; i < rows; ++i) {
      int64_t from;
      if (whole) from = i;  // ssm_in (late-2025 files): Hugging Face's order
      else if (!mixed) from = i / rv * block + 2 * hk + rv + i % rv;      // attn_gate: z of every key head
      else if (i < Kd) from = i / hk * block + i % hk;                // q
      else if (i < 2 * Kd) from = (i - Kd) / hk * block + hk + (i - Kd) % hk;  // k
      else from = (i - 2 * Kd) / rv * block + 2 * hk + (i - 2 * Kd) % rv;      // v
      for (int64_t c = 0; c < C; ++c) swap_in(file[i * C + c], model[from * C + c]);
    }
    return;
  }
  if (entry.role() == Role::LatentB) {  // kv_b_proj (H·(dn + dv), R): per head dn key rows, then dv value rows
    if (entry.shape.rank() == 2) {  // attn_kv_b (an older file): kv_b_proj as it is
      float* model = model_values(t, to_file, widened);
      for (int64_t i = 0; i < t.numel(); ++i) swap_in(file[i], model[i]);
      return;
    }
    const bool keys = entry.parts.front().row0 == 0;
    const int64_t H = entry.shape[0], R = keys ? entry.shape[1] : entry.shape[2], dn = entry.parts.front().row0;
    const int64_t width = t.size(0) / std::max<int64_t>(H, 1);  // dn + dv
    float* model = model_values(t, to_file, widened);
    const int64_t key_rows = keys ? entry.parts.front().rows : dn;
    for (int64_t h = 0; h < H; ++h) {
      if (keys) {  // attn_k_b[h][r][d] = kv_b_proj[h·width + d][r]
        for (int64_t r = 0; r < R; ++r)
          for (int64_t d = 0; d < key_rows; ++d) {
            swap_in(file[(h * R + r) * key_rows + d], model[(h * width + d) * R + r]);
          }
      } else {  // attn_v_b[h][j][r] = kv_b_proj[h·width + dn + j][r]
        const int64_t dv = entry.shape[1];
        for (int64_t j = 0; j < dv; ++j)
          for (int64_t r = 0; r < R; ++r) {
            swap_in(file[(h * dv + j) * R + r], model[(h * width + dn + j) * R + r]);
          }
      }
    }
    return;
  }
  if (to_file && t.rank() == 2 && (entry.role() == Role::StackedGateUp || entry.role() == Role::StackedDown)) {
    // experts kept as stored rows (a published MXFP4 folder, a quantized GGUF): widened, gate or up rows picked out
    const int64_t rows = t.size(0), K = t.size(1);
    std::vector<float> values(static_cast<size_t>(rows * K));
    if (t.dtype() == DType::F32) std::copy_n(t.data(), rows * K, values.data());
    else io::dequantize_rows(t.weight_type(), t.dtype() == DType::BF16 ? static_cast<const void*>(t.bf16()) : t.stored_bytes(),
                                  values.data(), rows, K);
    if (entry.role() == Role::StackedDown) {  // the file's (E, C, F) rows are the stored rows
      std::copy(values.begin(), values.end(), file);
      return;
    }
    const int64_t half = entry.parts.front().row0 == 0 ? 0 : 1;
    for (int64_t r = 0; r < rows / 2; ++r)  // file row e·F + f ← stored row e·2F + 2f + half
      std::copy_n(values.data() + (2 * r + half) * K, K, file + r * K);
    return;
  }
  if (t.dtype() != DType::F32) throw ValueError("gguf_stacked_values: the stacked experts must be float32");
  float* model = const_cast<float*>(t.data());  // written only when reading the file (to_file false)
  auto move = [&](int64_t at_file, int64_t at_model) {
    if (to_file) file[at_file] = model[at_model];
    else model[at_model] = file[at_file];
  };
  const Shape& s = entry.shape;
  const int64_t E = s[0];
  switch (entry.role()) {
    case Role::StackedGateUp: {  // file (E, F, C) rows ← the model's (E, C, 2F) column 2r + half
      const int64_t F = s[1], C = s[2], half = entry.parts.front().row0 == 0 ? 0 : 1;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < F; ++r)
          for (int64_t c = 0; c < C; ++c) move((e * F + r) * C + c, (e * C + c) * 2 * F + 2 * r + half);
      break;
    }
    case Role::StackedGateUpBias: {  // file (E, F) ← the model's (E, 2F) entry 2r + half
      const int64_t F = s[1], half = entry.parts.front().row0 == 0 ? 0 : 1;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < F; ++r) move(e * F + r, e * 2 * F + 2 * r + half);
      break;
    }
    case Role::StackedDown: {  // file (E, C, F) rows ← the model's (E, F, C) transposed per expert
      const int64_t C = s[1], F = s[2];
      for (int64_t e = 0; e < E; ++e)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t f = 0; f < F; ++f) move((e * C + c) * F + f, (e * F + f) * C + c);
      break;
    }
    default:  // the down bias (E, C): as it is
      for (int64_t i = 0; i < s.numel(); ++i) move(i, i);
  }
}

namespace {
// The file's entries: DecoderConfig::layout(Names::Gguf), but for a qwen3next layer written by late-2025 converters,
// whose in_proj_qkvz is one ssm_in in Hugging Face's order instead of attn_qkv and attn_gate
std::vector<DecoderConfig::Parameter> gguf_entries_of(const io::GgufFile& file, const DecoderConfig& config) {
  std::vector<DecoderConfig::Parameter> out;
  for (DecoderConfig::Parameter& p : config.layout(Names::Gguf)) {
    if (p.role() == Role::LatentB) {  // an older deepseek2 file: kv_b_proj whole, as Hugging Face holds it
      const std::string layer = "blk." + std::to_string(p.layer) + ".";
      if (!file.find(layer + "attn_k_b.weight") && file.find(layer + "attn_kv_b.weight")) {
        if (p.parts.front().row0 != 0) continue;  // the attn_v_b entry: attn_kv_b holds it
        const int64_t rows = config.num_heads * (config.qk_nope_head_dim + config.v_head_dim);
        p.name = layer + "attn_kv_b.weight";
        p.shape = Shape{rows, config.kv_lora_rank};
        p.parts = {{Role::LatentB, 0, rows}};
        p.transposed = false;
      }
    }
    if (p.role() == Role::DeltaQkvz) {
      const std::string layer = "blk." + std::to_string(p.layer) + ".";
      if (!file.find(layer + "attn_qkv.weight") && file.find(layer + "ssm_in.weight")) {
        if (p.parts.front().row0 != 0) continue;  // the attn_gate entry: ssm_in holds it
        const int64_t rows = config.linear_conv_width() + config.linear_value_heads * config.linear_value_dim;
        p.name = layer + "ssm_in.weight";
        p.shape = Shape{rows, config.hidden_size};
        p.parts = {{Role::DeltaQkvz, 0, rows}};  // every row, as the model holds them
      }
    }
    out.push_back(std::move(p));
  }
  return out;
}
}  // namespace

std::unique_ptr<Decoder> load_gguf_decoder(const std::string& path) {
  return load_gguf_decoder(std::make_shared<const io::GgufFile>(io::GgufFile::open(path, io::MapAccess::Random)));
}

std::unique_ptr<Decoder> load_gguf_decoder(std::shared_ptr<const io::GgufFile> file) {
  const DecoderConfig config = decoder_config_from_gguf(*file);
  // The file's entries, each naming the model's tensor it fills (gpt-oss's stacked experts come from several)
  const std::vector<DecoderConfig::Parameter> names = gguf_entries_of(*file, config), &own = names;
  // Every tensor the layout names, with its shape and a type qkv computes with, and nothing else — before any is used.
  std::vector<const io::GgufTensor*> found(own.size());
  for (size_t i = 0; i < own.size(); ++i) {
    const io::GgufTensor* t = file->find(names[i].name);
    if (!t) fail(*file, "has no tensor '" + names[i].name + "', which its " + config.family->name + " configuration needs");
    // An expert's matrix is one slice of its layer's stacked tensor (experts, rows, cols)
    Shape want = own[i].shape;
    if (own[i].expert >= 0) want = Shape{config.num_experts, own[i].shape[0], own[i].shape[1]};
    if (!(Shape(std::span<const int64_t>(t->shape())) == want))
      fail(*file, "tensor '" + t->name + "' has shape " + Shape(std::span<const int64_t>(t->shape())).str() + "; its configuration gives " +
                      want.str());
    const Storage s = storage_of(*file, *t);
    if (!role_is_matrix(own[i].role()) && s.type != WeightType::F32 && s.type != WeightType::F16 && s.type != WeightType::BF16)
      fail(*file, "tensor '" + t->name + "' (a vector) is " + io::ggml_type_name(t->type) + "; vectors must be F32, F16 or BF16");
    found[i] = t;
  }
  if (file->tensors().size() != own.size()) {
    for (const io::GgufTensor& t : file->tensors()) {
      // read into the configuration
      bool known = t.name == "rope_freqs.weight" || t.name == "rope_factors_long.weight" || t.name == "rope_factors_short.weight";
      // qwen3next's multi-token-prediction blocks (after the last, nextn_predict_layers of them): not run
      const std::string arch_key = config.family->gguf_architecture + ".nextn_predict_layers";
      if (t.name.rfind("blk.", 0) == 0 && file->contains(arch_key) && file->integer(arch_key) > 0) {
        const size_t dot = t.name.find('.', 4);
        const std::string n = t.name.substr(4, dot == std::string::npos ? 0 : dot - 4);
        known = known || (!n.empty() && n.size() < 7 && std::all_of(n.begin(), n.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
                          std::stoll(n) >= config.num_layers);
      }
      for (const auto& p : names) known = known || p.name == t.name;
      if (!known) fail(*file, "holds tensor '" + t.name + "', which qkv's " + config.family->name + " model does not use");
    }
  }
  // gpt-oss's experts in a block format or 16-bit floats (MXFP4 in the files people download) are kept as the file
  // stores them, one layer's gate and up rows interleaved as the model reads them (ops.hpp's stored stacked experts);
  // a layer whose experts are float32, or of two types, or of a type qkv widens, is held in float32 as before.
  std::vector<int> stored_layer(static_cast<size_t>(config.num_layers), config.family->stacked_experts ? 1 : 0);
  std::vector<WeightType> gate_up_type(static_cast<size_t>(config.num_layers), WeightType::F32);
  for (size_t i = 0; i < own.size(); ++i) {
    const Role r = own[i].role();
    if (r != Role::StackedGateUp && r != Role::StackedDown) continue;
    const Storage st = storage_of(*file, *found[i]);
    const size_t layer = static_cast<size_t>(own[i].layer);
    if (st.widen || st.type == WeightType::F32) stored_layer[layer] = 0;
    if (r == Role::StackedGateUp) {
      if (own[i].parts.front().row0 == 0) gate_up_type[layer] = st.type;
      else if (gate_up_type[layer] != st.type) stored_layer[layer] = 0;
    }
  }
  if (std::find(stored_layer.begin(), stored_layer.end(), 0) != stored_layer.end()) {
    try {
      check_stacked_experts_fit(config);
    } catch (const ValueError& e) {
      fail(*file, e.what());
    }
  }
  auto model = Decoder::for_loading(config);
  // Llama-architecture files store each head's query and key rows interleaved (llama.cpp's rotary pairs): Hugging
  // Face's row h·D + s·D/2 + i is the file's h·D + 2i + s. Those matrices are copied in that order into one buffer
  // (not zeroed, in huge pages: zeroed vectors' fresh 4 KiB pages were 0.2 s of a Llama-3.2-1B-shaped Q4_0 file's
  // load, its 47 MB of queries and keys, on the virtual machines measured).
  const bool permutes_qk = gguf_permutes_qk(file->string("general.architecture"));
  auto rows_permuted = [&](const DecoderConfig::Parameter& p) {
    return permutes_qk && p.parts.size() == 1 && (p.role() == Role::Query || p.role() == Role::Key);
  };
  // The buffer's bytes for parameter i: a permuted matrix kept in its block type (float32 ones go to the parameter)
  auto permuted_bytes_of = [&](size_t i) -> size_t {
    if (!rows_permuted(own[i]) || own[i].shape.rank() != 2) return 0;
    const Storage s = storage_of(*file, *found[i]);
    if (s.widen || s.type == WeightType::F32) return 0;
    return static_cast<size_t>(own[i].shape[0] * io::row_bytes(s.type, own[i].shape[1]));
  };
  size_t permuted_bytes = 0;
  for (size_t i = 0; i < own.size(); ++i) permuted_bytes += permuted_bytes_of(i);
  const std::shared_ptr<unsigned char> permuted = permuted_bytes ? io::copy_buffer(permuted_bytes) : nullptr;
  size_t permuted_used = 0;
  std::vector<std::shared_ptr<unsigned char>> gate_up_rows(static_cast<size_t>(config.num_layers));
  const std::shared_ptr<const void> owner = file;  // the mapping lives as long as any tensor over it
  const bool gemma_norms = config.norm == NormKind::GemmaRMSNorm;
  for (size_t i = 0; i < own.size(); ++i) {
    const DecoderConfig::Parameter& p = own[i];
    const io::GgufTensor& t = *found[i];
    Tensor& dst = model->parameter(p);
    const Storage s = storage_of(*file, t);
    const auto* bytes = reinterpret_cast<const unsigned char*>(t.data);
    const bool stored_matrix = (p.role() == Role::StackedGateUp || p.role() == Role::StackedDown) &&
                               stored_layer[static_cast<size_t>(p.layer)];
    if (stored_matrix) {  // gpt-oss's experts as stored rows: down (E·C, F) is the file's; gate and up interleaved
      const int64_t E = p.shape[0], R = p.shape[1], K = p.shape[2];  // the file's (E, R, K): rows of K values
      std::shared_ptr<std::vector<unsigned char>> converted;
      const WeightType type = s.type;  // Q5_0's blocks become Q8_0's
      if (s.exact_repack) converted = std::make_shared<std::vector<unsigned char>>(q5_0_as_q8_0(bytes, E * R, K));
      const unsigned char* file_rows = converted ? converted->data() : bytes;
      if (p.role() == Role::StackedDown) {
        const std::shared_ptr<const void> keep = converted ? std::shared_ptr<const void>(converted, converted->data()) : owner;
        dst.set_stored_(type, Shape{E * R, K}, file_rows, keep);
        continue;
      }
      const int64_t row = io::row_bytes(type, K), half = p.parts.front().row0 == 0 ? 0 : 1;
      auto& rows = gate_up_rows[static_cast<size_t>(p.layer)];
      if (!rows) {
        rows = io::copy_buffer(static_cast<size_t>(2 * E * R * row));
        dst.set_stored_(type, Shape{2 * E * R, K}, rows.get(), rows);
      }
      for (int64_t r = 0; r < E * R; ++r)  // expert e's row f → row e·2F + 2f (gate) or + 1 (up)
        std::memcpy(rows.get() + (2 * r + half) * row, file_rows + r * row, static_cast<size_t>(row));
      // the file's pages of this tensor are not read again: out of the resident set (they stay in the page cache),
      // so the experts are not held twice (peak RSS was 1.5× the file for a gpt-oss-shaped MXFP4 model)
      if (const io::MappedFile* mapping = file->mapping())
        mapping->release(static_cast<uint64_t>(bytes - reinterpret_cast<const unsigned char*>(mapping->data())), t.bytes);
      continue;
    }
    if (gguf_rearranged(p.role())) {  // gpt-oss's experts, DeepSeek's kv_b_proj: widened to float32, laid out as the model holds them
      const int64_t cols = p.shape[p.shape.rank() - 1], rows = p.shape.numel() / std::max<int64_t>(cols, 1);
      std::vector<float> values(static_cast<size_t>(p.shape.numel()));
      if (!values.empty()) {
        if (s.widen) widen_offset_blocks(t.type, bytes, values.data(), rows * cols);
        else io::dequantize_rows(s.type, bytes, values.data(), rows, cols);
      }
      gguf_stacked_values(dst, p, values.data(), /*to_file=*/false, &config);
      continue;
    }
    if (p.expert >= 0)  // this expert's rows of the stacked tensor
      bytes += static_cast<int64_t>(t.bytes) / config.num_experts * p.expert;
    if (p.shape.rank() == 1) {  // norms and biases: float32 copies
      float* out = dst.data();
      const int64_t n = p.shape[0];
      if (n > 0) io::dequantize_rows(s.type, bytes, out, 1, n);
      if (gemma_norms && is_norm(p.role()))  // llama.cpp's converter stored 1 + w; qkv's Gemma norm adds the 1
        for (int64_t c = 0; c < n; ++c) out[c] -= 1.0f;
      continue;
    }
    const int64_t rows = p.shape[0], cols = p.shape[1];
    if (rows == 0 || cols == 0) continue;
    const bool permute = rows_permuted(p);
    const int64_t D = config.head_dim;
    if (permute && (D % 2 != 0 || rows % D != 0))
      fail(*file, "tensor '" + t.name + "' does not hold whole heads of " + std::to_string(D) + " rows");
    auto permute_rows = [&](const unsigned char* from, unsigned char* to, int64_t row) {
      for (int64_t h = 0; h < rows / D; ++h)
        for (int64_t sd = 0; sd < 2; ++sd)
          for (int64_t i2 = 0; i2 < D / 2; ++i2)
            std::memcpy(to + (h * D + sd * D / 2 + i2) * row, from + (h * D + 2 * i2 + sd) * row, static_cast<size_t>(row));
    };
    if (s.widen || s.type == WeightType::F32) {  // float32, into the parameter's own storage (a mapped float32 would
      auto* f = dst.data();                      // be written through)
      std::shared_ptr<unsigned char> widened;
      if (permute) {
        widened = io::copy_buffer(static_cast<size_t>(rows * cols * 4));
        f = reinterpret_cast<float*>(widened.get());
      }
      if (s.widen) widen_offset_blocks(t.type, bytes, f, rows * cols);
      else std::memcpy(f, bytes, static_cast<size_t>(rows * cols * 4));
      if (permute) permute_rows(widened.get(), reinterpret_cast<unsigned char*>(dst.data()), cols * 4);
      continue;
    }
    // The rows as they will be stored: the file's own bytes (kept alive by the mapping's owner), or a converted copy.
    std::shared_ptr<const void> keep = owner;
    const unsigned char* rows_at = bytes;
    if (s.exact_repack) {
      auto copy = std::make_shared<std::vector<unsigned char>>(q5_0_as_q8_0(bytes, rows, cols));
      rows_at = copy->data();
      keep = std::shared_ptr<const void>(copy, copy->data());
    }
    if (permute) {
      const size_t need = static_cast<size_t>(rows * io::row_bytes(s.type, cols));
      if (permuted_bytes_of(i) != need || permuted_used + need > permuted_bytes)
        throw std::logic_error("load_gguf_decoder: a permuted matrix was not counted");
      unsigned char* to = permuted.get() + permuted_used;
      permuted_used += need;
      permute_rows(rows_at, to, io::row_bytes(s.type, cols));
      // The file's pages of this tensor are not read again: out of the resident set (peak RSS was 1.11× the file).
      const io::MappedFile* mapping = file->mapping();
      if (rows_at == bytes && mapping)
        mapping->release(static_cast<uint64_t>(bytes - reinterpret_cast<const unsigned char*>(mapping->data())), t.bytes);
      rows_at = to;
      keep = std::shared_ptr<const void>(permuted, to);
    }
    dst.set_stored_(s.type, rows_at, std::move(keep));
  }
  model->refresh_fused_views();  // Phi-3's attn_qkv and ffn_up: the roles' views of the mapped tensor
  for (Tensor& t : model->parameters()) t.requires_grad_(false);
  model->eval();
  return model;
}

}  // namespace qkv::nn
