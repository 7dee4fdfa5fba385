// The family table (see qkv/nn/family.hpp): one row per family. Each row's values come from the family's
// configuration and modeling code in Hugging Face's transformers (its defaults, key names and module layout) or, for
// gpt2, from the book's GPTModel.
#include "qkv/nn/family.hpp"

#include <algorithm>

#include "qkv/core/error.hpp"

namespace qkv::nn {

namespace {

std::vector<Family> make_table() {
  std::vector<Family> t;
  {  // The book's GPTModel (chapter 4); Hugging Face's GPT-2 files are another naming of it (load_gpt2).
    Family f;
    f.name = "gpt2";
    f.description = "GPT-2, the book's GPTModel";
    f.model_types = {"gpt2"};
    f.causal_lm = "GPT2LMHeadModel";
    f.sequence_classifier = "GPT2ForSequenceClassification";
    f.classifier_head = "out_head";  // the book's chapter 6 replaces out_head
    f.gguf_architecture = "gpt2";
    f.naming = Naming::Book;
    f.init = Init::Book;
    f.norm = NormKind::LayerNorm;
    f.mlp = MlpKind::GELU;
    f.activation_key = "activation_function";
    f.activations = {"gelu_new"};
    f.norm_eps_key = "layer_norm_epsilon";
    f.norm_eps_default = 1e-5;
    t.push_back(f);
  }
  Family llama;
  llama.name = "llama";
  llama.description = "Llama 3.x";
  llama.model_types = {"llama"};
  llama.causal_lm = "LlamaForCausalLM";
  llama.sequence_classifier = "LlamaForSequenceClassification";
  llama.classifier_head = "score";
  llama.gguf_architecture = "llama";
  t.push_back(llama);
  {  // Mistral: Llama with a sliding window on every layer (sliding_window null: none) and no biases.
    Family f = llama;
    f.name = "mistral";
    f.description = "Mistral";
    f.model_types = {"mistral"};
    f.causal_lm = "MistralForCausalLM";
    f.sequence_classifier = "MistralForSequenceClassification";
    f.bias = BiasRule::None;
    f.sliding = SlidingRule::EveryLayer;
    f.default_window = 4096;
    t.push_back(f);
  }
  {  // Qwen2 and Qwen2.5: q/k/v biases always.
    Family f = llama;
    f.name = "qwen2";
    f.description = "Qwen2, Qwen2.5";
    f.model_types = {"qwen2"};
    f.causal_lm = "Qwen2ForCausalLM";
    f.sequence_classifier = "Qwen2ForSequenceClassification";
    f.gguf_architecture = "qwen2";
    f.bias = BiasRule::QkvAlways;
    f.sliding = SlidingRule::QwenLayers;
    f.default_window = 4096;
    t.push_back(f);
  }
  {  // Qwen3: q/k RMSNorm per head.
    Family f = llama;
    f.name = "qwen3";
    f.description = "Qwen3";
    f.model_types = {"qwen3"};
    f.causal_lm = "Qwen3ForCausalLM";
    f.sequence_classifier = "Qwen3ForSequenceClassification";
    f.gguf_architecture = "qwen3";
    f.qk_norm = QkNorm::PerHead;
    f.sliding = SlidingRule::QwenLayers;
    f.default_window = 4096;
    t.push_back(f);
  }
  {  // Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, a softmax top-k router over SwiGLU experts.
    Family f = llama;
    f.name = "qwen3_moe";
    f.description = "Qwen3-MoE";
    f.model_types = {"qwen3_moe"};
    f.causal_lm = "Qwen3MoeForCausalLM";
    f.sequence_classifier = "Qwen3MoeForSequenceClassification";
    f.gguf_architecture = "qwen3moe";
    f.qk_norm = QkNorm::PerHead;
    f.sliding = SlidingRule::QwenLayers;
    f.default_window = 4096;
    f.experts = true;
    t.push_back(f);
  }
  {  // Qwen3-Next (80B-A3B): three Gated DeltaNet layers to one of gated attention rotating a quarter of each head,
     // (1 + w) RMSNorms, a softmax top-k router over SwiGLU experts plus a gated shared expert.
    Family f = llama;
    f.name = "qwen3_next";
    f.description = "Qwen3-Next";
    f.model_types = {"qwen3_next"};
    f.causal_lm = "Qwen3NextForCausalLM";
    f.sequence_classifier = "Qwen3NextForSequenceClassification";
    f.gguf_architecture = "qwen3next";
    f.norm = NormKind::GemmaRMSNorm;
    f.qk_norm = QkNorm::PerHead;
    f.partial_rotary = true;
    f.partial_rotary_default = 0.25;
    f.experts = true;
    f.linear_attention = true;
    t.push_back(f);
  }
  {  // DeepSeek-V3 (and Kimi K2, the same architecture): multi-head latent attention; a sigmoid router over expert
     // groups with shared experts, after first_k_dense_replace dense layers.
    Family f = llama;
    f.name = "deepseek_v3";
    f.description = "DeepSeek-V3";
    f.model_types = {"deepseek_v3"};
    f.causal_lm = "DeepseekV3ForCausalLM";
    f.sequence_classifier = "DeepseekV3ForSequenceClassification";
    f.gguf_architecture = "deepseek2";
    f.experts = true;
    f.latent_attention = true;
    t.push_back(f);
  }
  {  // gpt-oss (20b, 120b): attention with biases and a sink per head, sliding and full layers alternating, YaRN;
     // every layer a mixture of experts stacked with biases, a biased router softmaxing its top-k, a clamped SwiGLU.
    Family f = llama;
    f.name = "gpt_oss";
    f.description = "gpt-oss";
    f.model_types = {"gpt_oss"};
    f.causal_lm = "GptOssForCausalLM";
    f.sequence_classifier = "GptOssForSequenceClassification";
    f.gguf_architecture = "gpt-oss";
    f.norm_eps_default = 1e-5;
    f.rope_theta_default = 150000.0;
    f.sliding = SlidingRule::Pattern;  // GptOssConfig's default layer_types: layers 0, 2, 4 … slide
    f.sliding_pattern = 2;
    f.default_window = 128;
    f.experts = true;
    f.stacked_experts = true;
    f.sinks = true;
    t.push_back(f);
  }
  Family gemma = llama;  // Gemma 2 and 3: (1 + w) norms, four a block, GeGLU, √C embedding scale
  gemma.norm = NormKind::GemmaRMSNorm;
  gemma.placement = NormPlacement::Sandwich;
  gemma.mlp = MlpKind::GeGLU;
  gemma.activation_key = "hidden_activation";
  gemma.activations = {"gelu_pytorch_tanh", "gelu_tanh"};
  gemma.tie_default = true;
  gemma.embedding_scale = true;
  gemma.query_pre_attn_scalar = true;
  gemma.soft_capping = true;
  gemma.sliding = SlidingRule::Pattern;
  gemma.default_window = 4096;
  {  // Gemma 2: attention and final logits soft-capped, layers 0, 2, 4 … sliding, one RoPE.
    Family f = gemma;
    f.name = "gemma2";
    f.description = "Gemma 2";
    f.model_types = {"gemma2"};
    f.causal_lm = "Gemma2ForCausalLM";
    f.sequence_classifier = "Gemma2ForSequenceClassification";
    f.gguf_architecture = "gemma2";
    f.sliding_pattern = 2;
    f.attn_softcap_default = 50.0;
    f.final_softcap_default = 30.0;
    t.push_back(f);
  }
  {  // Gemma 3's text models (270M, 1B): q/k norms per head, local (sliding) and global layers with their own RoPE.
    Family f = gemma;
    f.name = "gemma3";
    f.description = "Gemma 3 text models";
    f.model_types = {"gemma3_text"};
    f.causal_lm = "Gemma3ForCausalLM";
    f.sequence_classifier = "Gemma3TextForSequenceClassification";
    f.gguf_architecture = "gemma3";
    f.qk_norm = QkNorm::PerHead;
    f.rope_theta_default = 1000000.0;
    f.sliding_pattern = 6;
    f.pattern_key = "sliding_window_pattern";
    f.rope = RopeRule::LocalBase;
    t.push_back(f);
  }
  {  // Phi-3, Phi-3.5 and Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotation, LongRoPE.
    Family f = llama;
    f.name = "phi3";
    f.description = "Phi-3, Phi-4-mini";
    f.model_types = {"phi3"};
    f.causal_lm = "Phi3ForCausalLM";
    f.sequence_classifier = "Phi3ForSequenceClassification";
    f.gguf_architecture = "phi3";
    f.fused_qkv = f.fused_gate_up = true;
    f.bias = BiasRule::None;
    f.norm_eps_default = 1e-5;
    f.partial_rotary = true;
    f.su_yarn_are_longrope = true;
    f.sliding = SlidingRule::EveryLayer;
    t.push_back(f);
  }
  Family olmo2 = llama;  // OLMo 2: norms after attention and after the MLP, none before; q/k norms over the projection
  olmo2.name = "olmo2";
  olmo2.description = "OLMo 2";
  olmo2.model_types = {"olmo2"};
  olmo2.causal_lm = "Olmo2ForCausalLM";
  olmo2.sequence_classifier = "Olmo2ForSequenceClassification";
  olmo2.gguf_architecture = "olmo2";
  olmo2.placement = NormPlacement::Post;
  olmo2.qk_norm = QkNorm::Projection;
  olmo2.norm_eps_default = 1e-5;
  t.push_back(olmo2);
  {  // OLMo 3: OLMo 2 with three sliding layers of four; RoPE scaling (YaRN) on the full-attention layers only, as
     // the released checkpoints were trained (OLMo 3 paper, OLMo-core; transformers 4.57 and its newest versions).
    Family f = olmo2;
    f.name = "olmo3";
    f.description = "OLMo 3";
    f.model_types = {"olmo3"};
    f.causal_lm = "Olmo3ForCausalLM";
    f.sequence_classifier = "Olmo3ForSequenceClassification";
    f.sliding = SlidingRule::Pattern;
    f.sliding_pattern = 4;
    f.default_window = 4096;
    f.rope = RopeRule::ScaledOnFullOnly;
    f.rope_theta_default = 500000.0;
    t.push_back(f);
  }
  {  // SmolLM3: Llama with no RoPE on the layers no_rope_layers marks 0 (every fourth by default), tied head.
    Family f = llama;
    f.name = "smollm3";
    f.description = "SmolLM3";
    f.model_types = {"smollm3"};
    f.causal_lm = "SmolLM3ForCausalLM";
    f.sequence_classifier = "SmolLM3ForSequenceClassification";
    f.gguf_architecture = "smollm3";
    f.rope = RopeRule::NoRopeLayers;
    f.sliding = SlidingRule::NoRopeLayers;
    f.rope_theta_default = 2000000.0;
    f.tie_default = true;
    t.push_back(f);
  }
  return t;
}

}  // namespace

const std::vector<Family>& families() {
  static const std::vector<Family> table = make_table();
  return table;
}

const Family& family(std::string_view name) {
  for (const Family& f : families())
    if (f.name == name) return f;
  throw ValueError("unknown model family '" + std::string(name) + "'; qkv has " + family_list());
}

const Family* family_of_model_type(std::string_view model_type) {
  for (const Family& f : families())
    if (std::find(f.model_types.begin(), f.model_types.end(), model_type) != f.model_types.end()) return &f;
  return nullptr;
}

std::string family_list() {
  std::string out;
  for (const Family& f : families()) {
    if (!out.empty()) out += ", ";
    out += f.model_types.front() + " (" + f.description + ")";
  }
  return out;
}

}  // namespace qkv::nn
