// One decoder-only transformer, composed from its configuration: the book's GPT-2, Llama 3, Qwen2/3, Gemma 2/3,
// Mistral, Phi-3, OLMo 2/3 and SmolLM3 are each a DecoderConfig, not a class. A block is built from components the
// config chooses:
//   attention   H query and H_kv K/V heads; q/k RMSNorm per head or over the projection; RoPE per layer (none, plain,
//               scaled, partial) or learned positions; a sliding window per layer; logit soft-capping
//   MLP         GELU, or gated (SwiGLU, GeGLU); biases or not
//   norms       LayerNorm, RMSNorm or Gemma's (1 + w) RMSNorm, placed before (pre), around (sandwich) or after (post)
// The layout is written once: DecoderConfig::layout() is the table of every parameter — its name (the family's own,
// or Hugging Face's files of it), shape as stored and the roles it holds (a fused qkv_proj holds three) — and the
// module's registry, the parameter count, the loaders, the writers and LoRA's sites all come from it.
// The book's GPTModel (chapter 4) is the gpt2 family: Decoder(GPTConfig) draws its weights as PyTorch draws the book's
// model from the same seed, and its state dict has the book's names (causal masks included).
// Not here: the family table (family.hpp), reading config.json or a folder (hf.hpp), the book's names (gpt.hpp).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/nn/family.hpp"
#include "qkv/nn/language_model.hpp"

namespace qkv::nn {

struct GPTConfig;  // the book's GPT_CONFIG (gpt.hpp): a gpt2-family DecoderConfig under the book's names
struct BatchPlan;     // a session's batch, rows grouped by sequence (session.hpp)
class KVBlockCache;   // a session's block KV cache (session.hpp)

// What one layer's attention does differently from the others.
struct DecoderLayerSettings {
  int64_t window = 0;  // sliding window (Gemma's local layers, Mistral, Qwen2's use_sliding_window); 0: global
  int64_t rope = 0;    // which of DecoderConfig::ropes rotates its q and k; −1: none (SmolLM3's NoPE layers)
  bool experts = false;  // its MLP is a mixture of experts (Qwen3-MoE's sparse layers), not the dense one
  bool linear = false;   // its token mixer is Gated DeltaNet (Qwen3-Next's linear_attention layers), not attention
  bool operator==(const DecoderLayerSettings&) const = default;  // Field by field
};

// What a parameter does in the decoder. A layout entry holds one or several (a fused qkv_proj holds three).
enum class Role {
  TokenEmbedding, PositionEmbedding, FinalNorm, FinalNormBias, Head,
  AttnNorm, AttnNormBias, Query, QueryBias, Key, KeyBias, Value, ValueBias, Output, OutputBias, QueryNorm, KeyNorm,
  PostAttnNorm, MlpNorm, MlpNormBias, PostMlpNorm, Gate, GateBias, Up, UpBias, Down, DownBias,
  HeadBias,  // a classifier head's bias (the book's chapter 6 Linear(C, classes))
  // A mixture-of-experts MLP: the router (E, C) and each expert's SwiGLU projections (Parameter::expert says whose)
  Router, ExpertGate, ExpertUp, ExpertDown,
  // Multi-head latent attention (DeepSeek-V2/V3): q_a_proj (q_lora_rank, C), q_a_layernorm, q_b_proj (H·(dn + dr),
  // q_lora_rank) (Query is the plain q_proj when q_lora_rank is 0), kv_a_proj_with_mqa (kv_lora_rank + dr, C),
  // kv_a_layernorm (kv_lora_rank), kv_b_proj (H·(dn + dv), kv_lora_rank)
  QueryA, QueryANorm, QueryB, LatentA, LatentNorm, LatentB,
  // DeepSeek-V3's router's e_score_correction_bias (E) and its shared experts' SwiGLU (moe_intermediate_size ·
  // n_shared_experts wide)
  RouterBias, SharedGate, SharedUp, SharedDown,
  // gpt-oss: each attention head's sink logit (H); the router's bias (E), added to its logits; a layer's experts
  // stacked as its checkpoints store them: gate_up (E, C, 2F), gate and up columns alternating, its bias (E, 2F),
  // down (E, F, C) and its bias (E, C)
  Sinks, RouterLogitBias, StackedGateUp, StackedGateUpBias, StackedDown, StackedDownBias,
  // Qwen3-Next's Gated DeltaNet (linear_attn): in_proj_qkvz (2·Kd + 2·Vd, C), grouped per key head as q | k | v | z;
  // in_proj_ba (2·nv, C), per key head b | a; the causal conv1d (2·Kd + Vd, 1, K); dt_bias (nv); A_log (nv); the
  // gated RMSNorm's weight (Dv, plain w); out_proj (C, Vd). Kd = nk·Dk, Vd = nv·Dv.
  DeltaQkvz, DeltaBa, DeltaConv, DeltaDtBias, DeltaALog, DeltaNorm, DeltaOut,
  // Qwen3-Next's shared expert gate (1, C): the shared expert's output × sigmoid(x · wᵀ)
  SharedExpertGate,
};
inline constexpr int kRoleCount = static_cast<int>(Role::SharedExpertGate) + 1;  // how many roles there are
const char* role_name(Role role);  // "query", "gate bias", … for messages
// A matrix, an embedding table or a stack of matrices (gpt-oss's experts): what file formats may quantize; not a
// vector, a bias or a norm
bool role_is_matrix(Role role);

// How a checkpoint's names and layout for a model are chosen:
//   Own          the family's own state dict (the module's registry, qkv checkpoints, .pth, the family's folders)
//   HuggingFace  Hugging Face's files of the model: for the book's GPT-2, transformers' GPT2LMHeadModel (Conv1D
//                weights stored transposed, q/k/v fused in c_attn); for the others the same as Own
//   Gguf         llama.cpp's GGUF tensor names (token_embd, blk.N.attn_q, ffn_gate, output_norm, output, …), the
//                shapes as Own's (GGUF's dims reversed); the values' conventions (llama's permuted q/k rows, Gemma's
//                norms stored with the 1 added) are the reader's (gguf_model.hpp)
enum class Names { Own, HuggingFace, Gguf };

// One decoder, composed from its config: what a Hugging Face config.json (or the book's GPT config) describes
struct DecoderConfig {
  const Family* family = &nn::family("llama");  // names, config.json, initialisation (family.hpp); never tested by name
  // vocabulary, residual width C, the MLP's inner width, blocks
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;  // head_dim may differ from hidden/heads (Qwen3, Gemma 3)
  int64_t max_positions = 0;                               // max_position_embeddings (GPT-2: n_positions)
  NormKind norm = NormKind::RMSNorm;  // LayerNorm, RMSNorm or Gemma's (1 + w) RMSNorm
  NormPlacement placement = NormPlacement::Pre;  // pre-norm, sandwich (four norms) or post-norm blocks
  double norm_eps = 1e-6;  // added to the variance in every norm
  MlpKind mlp = MlpKind::SwiGLU;  // the MLP's kind
  bool mlp_bias = false;  // biases in the MLP's projections
  bool qkv_bias = false, o_bias = false;  // Qwen2: q/k/v biases; GPT-2: all
  QkNorm qk_norm = QkNorm::None;          // RMSNorm of q and k: per head (Qwen3, Gemma) or per projection (OLMo 2)
  bool learned_positions = false;         // GPT-2's position table; otherwise RoPE
  bool tie_word_embeddings = false;  // the head reads tok_emb
  double embedding_scale = 0.0;           // token embeddings × this (Gemma: √hidden_size); 0: none
  double attention_scale = 0.0;           // 0: 1/√head_dim (Gemma: query_pre_attn_scalar^−½)
  double attn_softcap = 0.0;              // attention logit soft-capping (Gemma 2); 0: none
  double final_softcap = 0.0;             // final logits become cap·tanh(logits / cap) (Gemma 2); 0: none
  double drop_rate = 0.0;                 // embedding and residual dropout (GPT-2's)
  double attention_dropout = 0.0;         // dropout on the attention weights, in training (the book's GPTModel: drop_rate)
  // rotate-half (Hugging Face) or interleaved (Meta's original checkpoints)
  RopeLayout rope_layout = RopeLayout::RotateHalf;
  std::vector<RopeFrequencies> ropes;  // one per distinct rotation; empty with learned positions
  // Mixture of experts (the layers whose settings say experts): num_experts SwiGLU experts of inner width
  // expert_intermediate_size, experts_per_token chosen per token by a softmax router, their weights renormalised
  // with norm_topk_prob (Qwen3-MoE's num_experts, moe_intermediate_size, num_experts_per_tok, norm_topk_prob).
  int64_t num_experts = 0, expert_intermediate_size = 0, experts_per_token = 0;
  bool norm_topk_prob = false;
  // The routers' load-balancing loss added to loss() with this weight (Qwen3-MoE's router_aux_loss_coef, used when
  // output_router_logits is true; 0: none): Switch Transformer's E · Σ_e f_e · P_e over every routed layer's tokens,
  // f_e the share of (token, choice) pairs that chose expert e, P_e the mean router probability of e.
  double router_aux_loss_coef = 0.0;
  // DeepSeek-V3's router (n_group, topk_group, routed_scaling_factor, e_score_correction_bias): sigmoid scores, the
  // choice limited to the best expert_groups_kept of expert_groups groups, weights × routed_scaling_factor; and
  // shared experts, one SwiGLU of shared_expert_intermediate_size (moe_intermediate_size · n_shared_experts; 0: none)
  // added to every token's output.
  bool sigmoid_router = false;
  int64_t expert_groups = 1, expert_groups_kept = 1, shared_expert_intermediate_size = 0;
  double routed_scaling_factor = 1.0;
  // gpt-oss (Family::stacked_experts): the router's top-k logits softmaxed, experts stacked with biases, and SwiGLU's
  // gate and up clamped at swiglu_limit (kernels::MoeOptions); attention sinks (Family::sinks) in every layer.
  double swiglu_limit = 0.0;
  // Qwen3-Next: the shared expert's output scaled by sigmoid(shared_expert_gate x), named mlp.shared_expert.*
  bool shared_expert_gate = false;
  // Gated attention (Qwen3-Next): q_proj is 2·q_width() rows, head h's D query values then its D gate values; the
  // attention output is multiplied by sigmoid(gate) before o_proj.
  bool gated_attention = false;
  // Gated DeltaNet (the layers whose settings say linear): linear_key_heads heads of linear_key_dim values for q and
  // k, linear_value_heads of linear_value_dim for v (a multiple of the key heads, each key head serving
  // linear_value_heads / linear_key_heads of them), a causal depthwise conv of linear_conv_kernel taps in front
  // (Qwen3-Next's linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim,
  // linear_conv_kernel_dim).
  int64_t linear_key_heads = 0, linear_key_dim = 0, linear_value_heads = 0, linear_value_dim = 0, linear_conv_kernel = 0;  // as above
  // The conv's channels: q, k and v of every head, 2·Kd + Vd
  int64_t linear_conv_width() const { return 2 * linear_key_heads * linear_key_dim + linear_value_heads * linear_value_dim; }
  bool has_linear_layers() const;  // whether any layer is Gated DeltaNet
  // What one Gated DeltaNet layer keeps per sequence while decoding, in float32 values: the conv's last K − 1 inputs,
  // then the (Dk × Dv) state per value head; the same for any length
  int64_t linear_state_floats() const {
    return (linear_conv_kernel - 1) * linear_conv_width() + linear_value_heads * linear_key_dim * linear_value_dim;
  }
  // Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank > 0): each token's keys and values come from a latent
  // of kv_lora_rank values (after its RMSNorm) expanded per head by kv_b_proj into qk_nope_head_dim key values and
  // v_head_dim values, plus one rotated key of head_dim (= qk_rope_head_dim) values shared by all heads; queries are
  // qk_nope_head_dim + head_dim per head, through a low-rank q_lora_rank path when it is not 0. The cache holds the
  // latent and the rotated key only. rope_layout: Interleaved when rope_interleave (transformers de-interleaves then
  // rotates halves; the scores are the same).
  int64_t kv_lora_rank = 0, q_lora_rank = 0, qk_nope_head_dim = 0, v_head_dim = 0;
  bool latent() const { return kv_lora_rank > 0; }  // multi-head latent attention
  int64_t qk_head_dim() const { return qk_nope_head_dim + head_dim; }  // a latent attention head's query/key width
  std::vector<DecoderLayerSettings> layers;      // num_layers entries
  std::vector<int64_t> eos_token_ids;            // generation stops at any of them
  int64_t bos_token_id = -1;  // the beginning-of-text token (-1: none)
  int64_t pad_token_id = -1;  // the padding token (-1: none); a classifier pools the last token before it
  // A sequence classifier (Hugging Face's *ForSequenceClassification, the book's chapter 6): its head maps C to
  // num_labels scores instead of the vocabulary (score.weight, no bias; the book's out_head with a bias). 0: a
  // language model.
  int64_t num_labels = 0;
  std::vector<std::string> labels;  // the classes' names in id order (config.json's id2label); empty: unnamed
  // The config.json this configuration was read from (empty for a model made here): writing it back keeps its keys
  // and replaces only those qkv knows the value of. Not compared: two configurations are equal when they compute the
  // same.
  struct Source {
    std::string json;                                      // the file's text (empty: none)
    bool operator==(const Source&) const { return true; }  // always: the source is not compared
  };
  Source source;  // the config.json read, kept for writing back

  void validate() const;  // ValueError naming the field and what is allowed

  // One role's rows of a layout entry: rows [row0, row0 + rows) of its (out, in) matrix (or of a vector)
  struct Part {
    Role role;                                     // what these rows are
    int64_t row0 = 0, rows = 0;                    // where they start and how many
    bool operator==(const Part&) const = default;  // same role, same rows
  };
  // One parameter of a checkpoint: its name, its shape as stored, the roles it holds and how it is stored
  struct Parameter {
    std::string name;  // as in the family's checkpoints ("model.layers.0.self_attn.q_proj.weight")
    Shape shape;  // as stored
    std::vector<Part> parts;  // what it holds: one part, or several for a fused projection
    bool transposed = false;  // stored (in, out), as GPT-2's Conv1D: the transpose of the (out, in) matrix
    int64_t layer = -1;  // -1 outside the blocks
    int64_t expert = -1;  // the expert whose projection this is (Role::Expert*), -1 otherwise
    Role role() const { return parts.front().role; }  // its (first) role
  };
  // The parameter table, in the family's registration order (PyTorch's state_dict order), under `names`.
  std::vector<Parameter> layout(Names names = Names::Own) const;  // ValueError when a size overflows
  int64_t parameter_count() const;         // Σ over layout()
  // Query projection's output width, num_heads · head_dim (latent attention: num_heads · qk_head_dim())
  int64_t q_width() const { return num_heads * (latent() ? qk_head_dim() : head_dim); }
  // Key and value projections' output width, num_kv_heads · head_dim
  int64_t kv_width() const { return num_kv_heads * head_dim; }
  bool operator==(const DecoderConfig&) const = default;  // Field by field
};

// One block's parameters, by role (undefined where the config has none). q, k and v live back to back in one buffer,
// and so do gate and up, so that one product reads each group; the registered parameters covering a group (three
// q_proj/k_proj/v_proj, or one fused qkv_proj) are what the products read, so their gradients reach the registry.
struct DecoderBlock {
  std::array<Tensor, kRoleCount> weights;       // by role; for q/k/v and gate/up, views into the group's buffer
  std::array<LoraWeights, kRoleCount> lora;     // adapters, by the role of the site they adapt (its first part)
  // A group of projections read by one product: the registered tensors covering it, their biases, and each one's
  // site role (where its adapter lives in `lora`)
  struct Group {
    std::vector<Tensor> weights, biases;  // the registered tensors and their biases (undefined: none)
    std::vector<Role> sites;              // each tensor's site role
  };
  Group qkv, gate_up;  // q/k/v and gate/up, each read by one product
  // A mixture-of-experts layer's experts (empty in a dense layer): gate, up (F, C) and down (C, F) of expert e at
  // index e; the router is weights[Role::Router].
  std::vector<Tensor> expert_gate, expert_up, expert_down;
  // Their adapters (LoRA on experts; undefined where an expert's projection has none), expert e at index e
  std::vector<LoraWeights> expert_gate_lora, expert_up_lora, expert_down_lora;
  // The weight, or the adapter, of a role
  Tensor& operator[](Role role) { return weights[static_cast<size_t>(role)]; }
  const Tensor& operator[](Role role) const { return weights[static_cast<size_t>(role)]; }
  LoraWeights& adapter(Role role) { return lora[static_cast<size_t>(role)]; }
  const LoraWeights& adapter(Role role) const { return lora[static_cast<size_t>(role)]; }
};

// gpt-oss's stacked experts read from float32 or bf16 tensors are held in float32 (E·C·3F values a layer): ValueError
// before anything is allocated when that is more than the machine's memory (gpt-oss-20b's: 76 GB). Nothing for other
// families; loaders skip it when the experts are kept as stored (MXFP4 folders, quantized GGUF files).
void check_stacked_experts_fit(const DecoderConfig& config);

// Switch Transformer's load-balancing loss as transformers' load_balancing_loss_func computes it (Qwen3-MoE, Mixtral):
// the router logits of every routed layer, (N_l, E) each, joined into (N, E); E · Σ_e f_e · P_e, with P_e the mean
// softmax probability of expert e and f_e the share of tokens whose top `experts_per_token` include e (a count: the
// gradient goes through P only). ShapeError for logits that are not (N, E) or k outside 1…E.
Tensor load_balancing_loss(const std::vector<Tensor>& router_logits, int64_t experts_per_token);

// The decoder of today's models, composed from a DecoderConfig: every family of family.hpp is a configuration of it
class Decoder : public LanguageModel {
 public:
  // Weights drawn from `gen` as the family's row says (Init): as Hugging Face initialises them (normal(0, 0.02)
  // matrices and embeddings, norms at their identity, biases 0), or as PyTorch builds the book's GPTModel
  // (embeddings standard normal, each Linear's kaiming_uniform_(a = √5) weight then its uniform bias, the head last
  // and drawn even when tied), so the same seed gives the book's weights.
  explicit Decoder(const DecoderConfig& config, Generator& gen = default_generator());
  // The book's GPTModel(cfg): this decoder in its gpt2 configuration (config.decoder_config()), drawn as above.
  explicit Decoder(const GPTConfig& config, Generator& gen = default_generator());
  // The same without even the zeros: for a loader that writes every parameter (load_hf_decoder), so loading is one
  // pass over the weights. Reading a parameter before it is written gives unspecified values.
  static std::unique_ptr<Decoder> for_loading(const DecoderConfig& config);

  Tensor forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                 std::vector<AttentionStep::Record>* records = nullptr) const override;
  Tensor loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
              int64_t ignore_index = -100) const override;
  Tensor attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers,
                        std::vector<int64_t> heads) const override;
  // What the token at `position` attended to: (L, H, position + 1), layer l's head h giving the softmax weights of
  // that query over positions 0…position (0 outside a sliding window), as the model computed them when it read that
  // token (a decode step sees the same keys). One pass over ids[0…position] and one row of QKᵀ per head: the last
  // row of attention_maps without its T × T. A Gated DeltaNet layer's rows are 0 (it weighs no positions). ValueError
  // for a position outside ids.
  Tensor attention_row(std::span<const int64_t> ids, int64_t position) const;
  // Where a mixture-of-experts model sends each of ids' tokens: for every layer with experts (their 0-based numbers in
  // `layers`), a (T, num_experts) matrix of each token's routing weights, 0 for the experts it did not choose. One
  // forward pass; not for two threads on one model at once. Empty for a dense model.
  struct Routing {
    std::vector<int64_t> layers;  // the layers with experts, 0-based
    Tensor weights;               // (layers, T, num_experts)
  };
  // The routing of ids' tokens in every layer with experts (see Routing); empty for a dense model
  Routing expert_routing(std::span<const int64_t> ids) const;
  KVCache make_cache(int64_t batch, int64_t max_tokens = 0) const override;
  Tensor forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const override;
  // One step of a session (session.hpp): the plan's rows, each at its own position, run through the blocks; each
  // row's keys and values are written to its sequence's blocks of `cache` (made room for by the caller) and each
  // sequence's rows attend over its own positions only. Every product runs row-independent, so a row's logits are
  // the same bits in any batch. Returns the logits of plan.logit_rows, (rows, V). No gradient.
  Tensor forward_batch(const BatchPlan& plan, KVBlockCache& cache) const;

  Tensor hidden_states(std::span<const int64_t> ids, int64_t batch, int64_t tokens) const override {
    return hidden(ids, batch, tokens, nullptr);
  }
  int64_t hidden_size() const override { return config.hidden_size; }
  Tensor residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const override;
  Tensor hidden_from(const Tensor& residual, int64_t layer) const override;
  std::string block_prefix(int64_t layer) const override;
  std::string final_norm_prefix() const override;
  std::string head_prefix() const override;
  std::string classifier_head_name() const override { return config.family->classifier_head; }
  int64_t rotation_switch() const override;

  // the rows of the token table
  int64_t vocab_size() const override { return config.vocab_size; }
  int64_t context_length() const override { return config.max_positions; }
  // blocks
  int64_t num_layers() const override { return config.num_layers; }
  // Values a session's block cache keeps per token, layer and kind (keys, values): kv_width(), or with latent
  // attention the latent and the rotated key, kv_lora_rank + qk_rope_head_dim, as keys alone (sessions decode absorbed)
  int64_t block_cache_width() const;
  // A session's block cache holds rows for the attention layers only (Gated DeltaNet layers keep a state instead):
  // how many, and which of them layer i is
  int64_t block_cache_layers() const;
  int64_t block_cache_layer(int64_t layer) const;
  // The float32 values of one sequence's Gated DeltaNet states in a session: per such layer, its conv's last K − 1
  // inputs then its (Dk × Dv) state per value head (0 without such layers)
  int64_t block_cache_state_floats() const;
  int64_t num_heads() const override { return config.num_heads; }
  // K/V heads (grouped-query attention: fewer than the query heads)
  int64_t num_kv_heads() const override { return config.num_kv_heads; }
  // Layer `layer`'s sliding window (0: full causal)
  int64_t layer_window(int64_t layer) const override {
    return layer >= 0 && layer < config.num_layers ? config.layers[static_cast<size_t>(layer)].window : 0;
  }
  std::string type_name() const override { return "Decoder"; }
  // LoRA can adapt every block's projections — one site per layout entry (a fused qkv_proj is one site), named as
  // PEFT names them (the layout's names without ".weight": "model.layers.0.self_attn.q_proj",
  // "trf_blocks.0.att.W_query") and tagged with the roles they hold, which LoRA's presets choose by.
  std::vector<LoraSite> own_lora_sites() override;

  // The parameter with this role (and layer); ValueError when the config has none. For q/k/v and gate/up: the role's
  // rows, a view into its group's buffer.
  Tensor& parameter(Role role, int64_t layer = -1);
  // The registered tensor of a layout entry (Names::Own): what loaders write and writers read.
  Tensor& parameter(const DecoderConfig::Parameter& entry);
  // Rows [part.row0, part.row0 + part.rows) of the model's (out, in) matrix (or vector) for `part` in `layer`: where a
  // checkpoint entry's part lives, whatever the checkpoint's naming fuses or splits.
  Tensor part(const DecoderConfig::Part& part, int64_t layer) const;
  // Keeps every matrix of the blocks (q/k/v, output, gate/up, down) and an untied language-model head in `type`, in
  // place (Tensor::to_weight_type_; the float32 values are let go): products then read them as stored
  // (kernels::gemm_weight), for inference or LoRA on the frozen base; training such a weight is a ValueError. A matrix
  // whose rows are not a multiple of a block type's block (K-quants: 256) is kept as Q8_0 when they are a multiple
  // of 32, else as it is. Embeddings, norms and routers are not converted. gpt-oss's stacked experts kept as MXFP4
  // rows are widened by F32 (to merge an adapter into them, or train them), and left as they are by other types.
  void store_matrices(kernels::WeightType type);
  // Makes the role views of each fused group again (Phi-3's qkv_proj, gate_up_proj: the group's one tensor), after
  // its storage was replaced (converted, or mapped from a file)
  void refresh_fused_views();
  // Dropout (in training) draws from `gen` from now on; the caller keeps it alive as long as the model.
  void use_generator(Generator& gen) { gen_ = &gen; }
  // Layer `layer`'s attention weights for batch row b and query head h, (T, Tk), from a record of forward().
  Tensor weights(int64_t layer, const AttentionStep::Record& record, int64_t b, int64_t h) const;

  // A table whose gradient from a training batch lands only in some of its rows, and those rows (ascending)
  struct SparseGradient {
    Tensor table;               // the parameter (tok_emb or pos_emb)
    std::vector<int64_t> rows;  // the rows a batch reaches, ascending (empty when asked with no ids)
  };
  // The tables a batch of `ids` (positions 0…tokens − 1) leaves gradient in only some rows of: the token embedding
  // (the ids' rows) unless the head reads it too, and learned positions (rows 0…tokens − 1). Data-parallel training
  // sums only those rows across processes. With no ids: the tables, with no rows.
  std::vector<SparseGradient> sparse_gradients(std::span<const int64_t> ids, int64_t tokens) const;

  // Which experts the forward passes chose since the last take_expert_use(), while recording is on: a flag for each
  // (layer, expert), at layer · num_experts + expert (0 for dense layers). Data-parallel training sums only the chosen
  // experts' gradients; the others are zero on every process. Experts held in one tensor per layer (gpt-oss) are not
  // told apart.
  void record_expert_use(bool on) const;
  std::vector<uint8_t> take_expert_use() const;
  // A parameter of one expert ("model.layers.3.mlp.experts.7.up_proj.weight", or its adapter's lora_A and lora_B):
  // its flag's index in take_expert_use(); −1 for any other parameter.
  int64_t expert_use_index(const std::string& parameter_name) const;

  // How latent attention decodes from its cache (make_cache and forward_cached read it):
  //   Absorbed  the cache holds each token's normed latent and rotated key, kv_lora_rank + qk_rope_head_dim values
  //             per layer; q_nope is multiplied into the latent space through kv_b_proj's key rows (W_UK), attention
  //             runs over the latents as one shared key/value head, and kv_b_proj's value rows (W_UV) map each
  //             head's result back (DeepSeek-V2 §2.1.2)
  //   Expanded  the cache holds every head's full key and value (as multi-head attention would), expanded once per
  //             token: the reference and the speed baseline
  enum class LatentDecode { Absorbed, Expanded };
  LatentDecode latent_decode = LatentDecode::Absorbed;  // what make_cache and forward_cached do for latent attention

  // New positions are processed in chunks of at most this many tokens when a cache is used, so a sliding-window
  // layer's cache needs only window − 1 + kCacheChunk rows.
  static constexpr int64_t kCacheChunk = 256;

  const DecoderConfig config;  // what the model was built from
  Tensor tok_emb, pos_emb, final_norm, final_norm_bias, head;  // head is tok_emb when tied
  Tensor head_bias;  // a classifier head's bias (the book's), else undefined
  bool is_classifier() const { return config.num_labels > 0; }  // a sequence classifier (num_labels > 0)
  std::vector<DecoderBlock> blocks;  // the blocks' parameters, in order

 private:
  Decoder(const DecoderConfig& config, Generator* gen, bool fill = true);
  Tensor embed(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t position) const;
  Tensor norm(const Tensor& x, const Tensor& weight, const Tensor& bias) const;
  // One block on x (B, T, C) at positions [position, position + T); `extent` is the end of the call's positions (0:
  // position + T), which picks the rotation where it depends on the length (LongRoPE).
  struct BatchStep;  // a session step: the plan and the block cache (decoder.cpp)
  // `routers`, if given, receives each mixture-of-experts layer's router logits (B·T, E), with their gradient.
  Tensor block_forward(size_t i, const Tensor& x, int64_t position, KVCache* cache, AttentionStep::Record* record,
                       int64_t extent = 0, const BatchStep* step = nullptr, std::vector<Tensor>* routers = nullptr) const;
  Tensor attend(size_t i, const Tensor& x, int64_t position, int64_t extent, KVCache* cache,
                AttentionStep::Record* record, const BatchStep* step = nullptr) const;
  // A session step's attention for layer i: q (1, N, H·D) and k (1, N, H_kv·D) rotated at each row's position, k and v
  // written to the blocks, each sequence's rows attending over its positions → context (1, N, H·D)
  Tensor attend_blocks(size_t i, Tensor& q, Tensor& k, const Tensor& v, const BatchStep& step) const;
  Tensor mlp(const DecoderBlock& b, const Tensor& x, std::vector<Tensor>* routers = nullptr) const;
  // Gated DeltaNet for layer i (x normed, (B, T, C)): projections, causal conv + SiLU, the gated delta rule, the gated
  // RMSNorm and out_proj. With a cache, its layer holds the conv's last K − 1 inputs (keys) and the state (values).
  Tensor attend_linear(size_t i, const Tensor& x, KVCache* cache) const;
  // The same for a session's step: each sequence's rows from and to its state in the block cache
  Tensor attend_linear_blocks(size_t i, const Tensor& x, const BatchStep& step) const;
  // Multi-head latent attention for layer i (x normed), as attend() is for the others
  Tensor attend_latent(size_t i, const Tensor& x, int64_t position, int64_t extent, KVCache* cache,
                       AttentionStep::Record* record = nullptr) const;
  // The same for a session's step, absorbed: each token caches its latent and rotated key (block_cache_width())
  Tensor attend_latent_blocks(size_t i, const Tensor& x, const BatchStep& step) const;
  struct LatentProjections {
    Tensor q;       // (B, T, H·(dn + dr)): each head's q_nope | q_pe, not rotated
    Tensor latent;  // (B, T, R), normed
    Tensor k_pe;    // (B, T, dr), not rotated
  };
  LatentProjections latent_projections(size_t i, const Tensor& x) const;
  float latent_scale() const;  // the softmax scale of latent attention
  Tensor latent_up(size_t i) const;  // layer i's kv_b_proj as (H, dn + dv, R) float32, a LoRA update merged in
  // While expert_routing runs: each routed layer's chosen experts and weights (N·k each), in layer order
  mutable std::vector<std::pair<std::vector<int32_t>, std::vector<float>>>* routing_ = nullptr;
  mutable bool record_use_ = false;        // record_expert_use
  mutable std::vector<uint8_t> expert_use_;  // its flags
  Tensor logits(const Tensor& hidden_states) const;  // the head, soft-capped where the config says
  Tensor hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                std::vector<AttentionStep::Record>* records, std::vector<Tensor>* routers = nullptr) const;
  // The rotation table of config.ropes[which] for at least `positions` positions.
  std::shared_ptr<const RopeTable> rope_table(int64_t which, int64_t positions) const;
  std::shared_ptr<struct RopeTables> rope_tables_;
  std::shared_ptr<Generator> owned_generator_;
  Generator* gen_;
};

}  // namespace qkv::nn
