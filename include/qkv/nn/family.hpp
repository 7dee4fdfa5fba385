// The decoder families qkv runs, one row of data each. What tells Llama 3 from Qwen, Gemma, Mistral, Phi, OLMo,
// SmolLM3 or the book's GPT-2 is data: how config.json names and defaults its settings, where the norms sit, what
// the parameters are called, how new weights are drawn. A family is not a class and not a string tested across the
// code: the decoder reads a configuration (decoder.hpp), and the row says how to fill and name it.
// Adding a family that differs from one here only in data is one row (family.cpp) and its test fixture.
// Not here: the decoder (decoder.hpp), reading a folder (hf.hpp).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace qkv::nn {

// A block's norms: LayerNorm (GPT-2), RMSNorm (Llama, Qwen), or Gemma's RMSNorm x̂·(1 + w), whose weight starts at 0.
enum class NormKind { LayerNorm, RMSNorm, GemmaRMSNorm };
// Where a block's norms sit:
//   Pre       x + attn(norm(x)), then h + mlp(norm(h))                       (GPT-2, Llama, Qwen, Mistral, Phi, SmolLM3)
//   Sandwich  x + norm(attn(norm(x))), then h + norm(mlp(norm(h))): four norms (Gemma 2 and 3)
//   Post      x + norm(attn(x)), then h + norm(mlp(h))                       (OLMo 2 and 3)
enum class NormPlacement { Pre, Sandwich, Post };
// RMSNorm of the queries and keys before RoPE: none, over each head's D values (Qwen3, Gemma 3), or over the whole
// projection of H·D values before it is split into heads (OLMo 2 and 3).
enum class QkNorm { None, PerHead, Projection };
// The MLP: GELU is down(gelu(up x)); the gated ones down(act(gate x) ∘ up x) with SiLU (SwiGLU) or GELU (GeGLU).
enum class MlpKind { GELU, SwiGLU, GeGLU };
// Whose parameter names a family's own state dict uses: the book's GPTModel (tok_emb, trf_blocks.0.att.W_query, …)
// or Hugging Face's (model.embed_tokens, model.layers.0.self_attn.q_proj, …).
enum class Naming { Book, HuggingFace };
// How new weights are drawn: as PyTorch builds the book's GPTModel (so a seed gives the book's numbers), or as
// Hugging Face's _init_weights (normal(0, 0.02) matrices, norms at their identity, biases 0).
enum class Init { Book, HuggingFace };

// Which layers of a config.json without a layer_types list have a sliding window.
enum class SlidingRule {
  None,          // none (Llama, OLMo 2)
  EveryLayer,    // every layer when sliding_window is a number, none when it is null (Mistral, Phi-3)
  QwenLayers,    // use_sliding_window: the layers from max_window_layers on (Qwen2, Qwen3)
  NoRopeLayers,  // use_sliding_window: the layers without RoPE (SmolLM3)
  Pattern,       // all but every n-th layer: Gemma 2 (n = 2: layers 0, 2, 4 … slide), Gemma 3 (6), OLMo 3 (4)
};
// Which rotation each layer uses.
enum class RopeRule {
  Same,              // one rotation everywhere
  LocalBase,         // sliding layers: rope_local_base_freq, unscaled (Gemma 3)
  ScaledOnFullOnly,  // sliding layers: plain RoPE; full-attention layers: rope_scaling (OLMo 3, as trained)
  NoRopeLayers,      // no rotation on the layers no_rope_layers marks 0 (SmolLM3)
};
// Which config.json keys give the projections biases.
enum class BiasRule {
  AttentionBias,  // attention_bias: q, k, v and o; mlp_bias: the MLP (Llama, Qwen3, Gemma, OLMo 2, SmolLM3)
  QkvAlways,      // q, k and v always, o never (Qwen2)
  None,           // never (Mistral, Phi-3)
};

// One family: everything about it that is not arithmetic.
struct Family {
  std::string name;         // qkv's name for it, in messages and qkv checkpoints: "llama"
  std::string description;  // for messages: "Llama 3.x"
  std::vector<std::string> model_types;  // config.json model_type values read as this family (the first is written)
  std::string causal_lm;                 // architectures[0] of a language model: "LlamaForCausalLM"
  std::string sequence_classifier;       // … of a classifier: "LlamaForSequenceClassification"
  std::string classifier_head;           // a classifier's head: "score" (Hugging Face), "out_head" (the book)
  std::string gguf_architecture;         // llama.cpp's general.architecture
  Naming naming = Naming::HuggingFace;   // how its parameters are named
  Init init = Init::HuggingFace;         // how a new model of it is initialised
  // The arithmetic this family's config.json implies (each a DecoderConfig field's value for it)
  NormKind norm = NormKind::RMSNorm;
  NormPlacement placement = NormPlacement::Pre;
  QkNorm qk_norm = QkNorm::None;
  MlpKind mlp = MlpKind::SwiGLU;
  bool fused_qkv = false;      // q, k and v in one qkv_proj (Phi-3)
  bool fused_gate_up = false;  // gate and up in one gate_up_proj (Phi-3)
  BiasRule bias = BiasRule::AttentionBias;
  std::string activation_key = "hidden_act";           // the config key naming the MLP's activation
  std::vector<std::string> activations = {"silu"};     // the values qkv runs
  bool tie_default = false;       // tie_word_embeddings when config.json does not say
  double rope_theta_default = 10000.0;
  double norm_eps_default = 1e-6;
  std::string norm_eps_key = "rms_norm_eps";
  bool embedding_scale = false;   // token embeddings × √hidden_size (Gemma)
  bool query_pre_attn_scalar = false;  // the attention scale is query_pre_attn_scalar^−½ (Gemma)
  bool soft_capping = false;      // attn_logit_softcapping and final_logit_softcapping are read (Gemma 2)
  bool partial_rotary = false;    // partial_rotary_factor is read (Phi-3, Phi-4-mini, Qwen3-Next)
  double partial_rotary_default = 1.0;  // … and its value when config.json leaves it out (Qwen3-Next: 0.25)
  SlidingRule sliding = SlidingRule::None;
  int64_t sliding_pattern = 0;     // Pattern: n, unless config.json's pattern_key says
  std::string pattern_key;         // "sliding_window_pattern" (Gemma 3), or none
  int64_t default_window = 0;      // sliding_window when config.json leaves it out (0: none)
  RopeRule rope = RopeRule::Same;
  bool su_yarn_are_longrope = false;  // rope_scaling types "su" and "yarn" are LongRoPE's old names (Phi-3)
  double attn_softcap_default = 0.0, final_softcap_default = 0.0;  // when config.json leaves the keys out
  // A mixture-of-experts MLP where config.json puts one (Qwen3-MoE: num_experts, num_experts_per_tok,
  // moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers)
  bool experts = false;
  // Multi-head latent attention and DeepSeek-V3's mixture of experts (kv_lora_rank, q_lora_rank, qk_nope_head_dim,
  // qk_rope_head_dim, v_head_dim; a sigmoid router over groups, shared experts, the first layers dense)
  bool latent_attention = false;
  // gpt-oss's mixture of experts: every layer's experts stacked in four tensors with biases (mlp.experts.gate_up_proj,
  // …), a router with a bias whose top-k logits are softmaxed, a clamped SwiGLU (num_local_experts,
  // num_experts_per_tok, intermediate_size, swiglu_limit)
  bool stacked_experts = false;
  bool sinks = false;  // each attention head has a learned sink logit (self_attn.sinks; gpt-oss)
  // Qwen3-Next: Gated DeltaNet layers (linear_attn.*) between gated full-attention layers (layer_types, or every
  // full_attention_interval-th layer full); the full layers' q_proj doubled, each head's D query values followed by D
  // gate values, the attention output × sigmoid(gate); the mixture of experts with one shared expert whose output is
  // scaled by sigmoid(shared_expert_gate x)
  bool linear_attention = false;
};

// Every family, in the order messages list them.
const std::vector<Family>& families();
// The family named `name` ("llama", "gpt2", …); ValueError listing the table for another name.
const Family& family(std::string_view name);
// The family whose config.json model_type this is, or nullptr.
const Family* family_of_model_type(std::string_view model_type);
// "llama (Llama 3.x), qwen2 (Qwen2, Qwen2.5), …": for messages that say what qkv reads.
std::string family_list();

}  // namespace qkv::nn
