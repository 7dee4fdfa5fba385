// One decoder-only transformer, composed from its configuration: GPT-2, Llama 3, Qwen2, Qwen3 and Gemma 3 are each
// a DecoderConfig, not a class. A block is
//   x + post_attn_norm?(attention(attn_norm(x))),  then  x + post_mlp_norm?(mlp(mlp_norm(x)))
// where each part is chosen by the config: LayerNorm, RMSNorm or Gemma's (1 + w) RMSNorm; learned positions or
// RoPE (per layer: Gemma 3's local and global bases); H_kv K/V heads; a sliding window per layer; q/k RMSNorm per
// head (Qwen3, Gemma 3); biases or not; a GELU, SwiGLU or GeGLU MLP; a tied or untied head; an embedding scale.
//
// The layout is written once: DecoderConfig::layout() is the table of every parameter — its state-dict name (the
// family's own: Hugging Face's for llama/qwen/gemma, the book's for gpt2), shape and role — and the module's
// registry, the parameter count and the loaders all come from it.
// The book's GPTModel (chapter 4) is the gpt2 family: Decoder(GPTConfig) draws its weights as PyTorch draws the book's
// model from the same seed, and its state dict has the book's names (causal masks included).
// Not here: reading config.json or a Hugging Face folder (hf.hpp), the book's configuration names (gpt.hpp), sampling.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/nn/language_model.hpp"

namespace qkv::nn {

struct GPTConfig;  // the book's GPT_CONFIG (gpt.hpp): a gpt2-family DecoderConfig under the book's names

// A block's norms: LayerNorm (GPT-2), RMSNorm (Llama, Qwen), or Gemma's RMSNorm x̂·(1 + w), whose weight starts at 0.
enum class NormKind { LayerNorm, RMSNorm, GemmaRMSNorm };
// The MLP: GELU is down(gelu(up x)); the gated ones down(act(gate x) ∘ up x) with SiLU (SwiGLU) or GELU (GeGLU).
enum class MlpKind { GELU, SwiGLU, GeGLU };

// What one layer's attention does differently from the others.
struct DecoderLayerSettings {
  int64_t window = 0;  // sliding window (Gemma 3's local layers, Qwen2's use_sliding_window); 0: global
  int64_t rope = 0;    // which of DecoderConfig::ropes rotates its q and k
  bool operator==(const DecoderLayerSettings&) const = default;  // Field by field
};

// One decoder, composed from its config: what a Hugging Face config.json (or the book's GPT config) describes
struct DecoderConfig {
  std::string family = "llama";  // llama, qwen2, qwen3, gemma3, gpt2: the parameter names and their order
  // vocabulary, residual width C, the MLP's inner width, blocks
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;  // head_dim may differ from hidden/heads (Qwen3, Gemma 3)
  int64_t max_positions = 0;                               // max_position_embeddings (GPT-2: n_positions)
  NormKind norm = NormKind::RMSNorm;  // LayerNorm, RMSNorm or Gemma's (1 + w) RMSNorm
  double norm_eps = 1e-6;  // added to the variance in every norm
  MlpKind mlp = MlpKind::SwiGLU;  // the MLP's kind
  bool mlp_bias = false;  // biases in the MLP's projections
  bool qkv_bias = false, o_bias = false;  // Qwen2: q/k/v biases; GPT-2: all
  bool qk_norm = false;                   // RMSNorm of each head's q and k over head_dim (Qwen3, Gemma 3)
  bool learned_positions = false;         // GPT-2's position table; otherwise RoPE
  bool sandwich_norms = false;            // Gemma 3: norms after attention and after the MLP too (four per block)
  bool tie_word_embeddings = false;  // the head reads tok_emb
  double embedding_scale = 0.0;           // token embeddings × this (Gemma: √hidden_size); 0: none
  double attention_scale = 0.0;           // 0: 1/√head_dim (Gemma 3: query_pre_attn_scalar^−½)
  double attn_softcap = 0.0;              // attention logit soft-capping (Gemma 2); 0: none
  double drop_rate = 0.0;                 // embedding and residual dropout (GPT-2's)
  double attention_dropout = 0.0;         // dropout on the attention weights, in training (the book's GPTModel: drop_rate)
  // rotate-half (Hugging Face) or interleaved (Meta's original checkpoints)
  RopeLayout rope_layout = RopeLayout::RotateHalf;
  std::vector<RopeFrequencies> ropes;  // one per distinct rotation; empty with learned positions
  std::vector<DecoderLayerSettings> layers;      // num_layers entries
  std::vector<int64_t> eos_token_ids;            // generation stops at any of them
  int64_t bos_token_id = -1;  // the beginning-of-text token (-1: none)

  void validate() const;  // ValueError naming the field and what is allowed

  // The parameter table, in the family's registration order (PyTorch's state_dict order).
  enum class Role {
    TokenEmbedding, PositionEmbedding, FinalNorm, FinalNormBias, Head,
    AttnNorm, AttnNormBias, Query, QueryBias, Key, KeyBias, Value, ValueBias, Output, OutputBias, QueryNorm, KeyNorm,
    PostAttnNorm, MlpNorm, MlpNormBias, PostMlpNorm, Gate, GateBias, Up, UpBias, Down, DownBias,
  };
  // One parameter: its state-dict name (the family's), shape, role and block
  struct Parameter {
    std::string name;  // as in the family's checkpoints ("model.layers.0.self_attn.q_proj.weight")
    Shape shape;  // its shape
    Role role;  // what it does
    int64_t layer = -1;  // -1 outside the blocks
  };
  std::vector<Parameter> layout() const;  // ValueError when a size overflows
  int64_t parameter_count() const;         // Σ over layout()
  // Query projection's output width, num_heads · head_dim
  int64_t q_width() const { return num_heads * head_dim; }
  // Key and value projections' output width, num_kv_heads · head_dim
  int64_t kv_width() const { return num_kv_heads * head_dim; }
  bool operator==(const DecoderConfig&) const = default;  // Field by field
};

// Short names for the supported families and what they are, for messages: "llama (Llama 3.x), qwen2, …".
const std::vector<std::string>& decoder_families();

// One block's parameters, by role (undefined where the config has none).
struct DecoderBlock {
  // attention's norm, projections (with biases where the config has them) and q/k norms
  Tensor attn_norm, attn_norm_bias, wq, bq, wk, bk, wv, bv, wo, bo, q_norm, k_norm;
  // the norms after attention, before and after the MLP, and the MLP's projections
  Tensor post_attn_norm, mlp_norm, mlp_norm_bias, post_mlp_norm, gate, gate_bias, up, up_bias, down, down_bias;
  LoraWeights lora_q, lora_k, lora_v, lora_o, lora_gate, lora_up, lora_down;  // adapters (fine-tuning), usually none
};

// The decoder of today's models, composed from a DecoderConfig: Llama 3, Qwen2, Qwen3, Gemma 3 and GPT-2 are configurations of it
class Decoder : public LanguageModel {
 public:
  // Weights drawn from `gen`: for llama, qwen2, qwen3 and gemma3 as Hugging Face initialises them (normal(0, 0.02)
  // matrices and embeddings, norms at their identity, biases 0); for gpt2 as PyTorch builds the book's GPTModel
  // (embeddings standard normal, each Linear's kaiming_uniform_(a = √5) weight then its uniform bias, the head last
  // and drawn even when tied), so the same seed gives the book's weights.
  explicit Decoder(const DecoderConfig& config, Generator& gen = default_generator());
  // The book's GPTModel(cfg): this decoder in its gpt2 configuration (config.decoder_config()), drawn as above.
  explicit Decoder(const GPTConfig& config, Generator& gen = default_generator());
  // A model whose weights a loader will overwrite: nothing is drawn, zeros everywhere.
  static std::unique_ptr<Decoder> uninitialised(const DecoderConfig& config, uint64_t seed = 0);
  // The same without even the zeros: for a loader that writes every parameter (load_hf_decoder), so loading is one
  // pass over the weights. Reading a parameter before it is written gives unspecified values.
  static std::unique_ptr<Decoder> for_loading(const DecoderConfig& config);

  Tensor forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                 std::vector<AttentionStep::Record>* records = nullptr) const override;
  Tensor loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
              int64_t ignore_index = -100) const override;
  Tensor attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers,
                        std::vector<int64_t> heads) const override;
  KVCache make_cache(int64_t batch, int64_t max_tokens = 0) const override;
  Tensor forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const override;

  Tensor hidden_states(std::span<const int64_t> ids, int64_t batch, int64_t tokens) const override {
    return hidden(ids, batch, tokens, nullptr);
  }
  int64_t hidden_size() const override { return config.hidden_size; }
  Tensor residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const override;
  Tensor hidden_from(const Tensor& residual, int64_t layer) const override;
  std::string block_prefix(int64_t layer) const override;
  std::string final_norm_prefix() const override;
  std::string head_prefix() const override;

  // the rows of the token table
  int64_t vocab_size() const override { return config.vocab_size; }
  int64_t context_length() const override { return config.max_positions; }
  // blocks
  int64_t num_layers() const override { return config.num_layers; }
  int64_t num_heads() const override { return config.num_heads; }
  // K/V heads (grouped-query attention: fewer than the query heads)
  int64_t num_kv_heads() const override { return config.num_kv_heads; }
  // Layer `layer`'s sliding window (0: full causal)
  int64_t layer_window(int64_t layer) const override {
    return layer >= 0 && layer < config.num_layers ? config.layers[static_cast<size_t>(layer)].window : 0;
  }
  std::string type_name() const override { return "Decoder"; }
  // LoRA can adapt every block's q/k/v/o and MLP projections, named as PEFT names them (the layout's names without
  // ".weight": "model.layers.0.self_attn.q_proj", "trf_blocks.0.att.W_query").
  std::vector<LoraSite> own_lora_sites() override;

  // The parameter with this role (and layer); ValueError when the config has none.
  Tensor& parameter(DecoderConfig::Role role, int64_t layer = -1);
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

  // New positions are processed in chunks of at most this many tokens when a cache is used, so a sliding-window
  // layer's cache needs only window − 1 + kCacheChunk rows.
  static constexpr int64_t kCacheChunk = 256;

  const DecoderConfig config;  // what the model was built from
  Tensor tok_emb, pos_emb, final_norm, final_norm_bias, head;  // head is tok_emb when tied
  std::vector<DecoderBlock> blocks;  // the blocks' parameters, in order

 private:
  Decoder(const DecoderConfig& config, Generator* gen, bool fill = true);
  Tensor embed(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t position) const;
  Tensor norm(const Tensor& x, const Tensor& weight, const Tensor& bias) const;
  Tensor block_forward(size_t i, const Tensor& x, int64_t position, KVCache* cache,
                       AttentionStep::Record* record) const;
  Tensor attend(size_t i, const Tensor& x, int64_t position, KVCache* cache, AttentionStep::Record* record) const;
  Tensor mlp(const DecoderBlock& b, const Tensor& x) const;
  Tensor hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                std::vector<AttentionStep::Record>* records) const;
  // The rotation table of config.ropes[which] for at least `positions` positions.
  std::shared_ptr<const RopeTable> rope_table(int64_t which, int64_t positions) const;
  std::shared_ptr<struct RopeTables> rope_tables_;
  std::shared_ptr<Generator> owned_generator_;
  Generator* gen_;
};

}  // namespace qkv::nn
