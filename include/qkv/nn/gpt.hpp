// The GPT model of the book's chapter 4, with its configuration names and state-dict names:
//   tok_emb, pos_emb → dropout → trf_blocks.{i} (norm1 → att → dropout → +, norm2 → ff → dropout → +)
//   → final_norm → out_head
// Pre-LayerNorm blocks, MultiHeadAttention (causal, fused kernel), FeedForward (Linear 4× wide, tanh-GELU,
// Linear). Optional weight tying (out_head.weight is tok_emb.weight, as in GPT-2).
// Not here: training (train/), text (text/), loading Hugging Face GPT-2 files (nn/gpt2.hpp).
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkv/core/settings.hpp"
#include "qkv/nn/attention.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/language_model.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/module.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

// The book's GPT_CONFIG_124M: the configuration names and defaults of its chapter 4 (GPT-2 small)
struct GPTConfig {
  int64_t vocab_size = 50257;  // tokens in the vocabulary (GPT-2's BPE: 50,257)
  int64_t context_length = 1024;  // positions the model reads at most (the position table's rows)
  int64_t emb_dim = 768;  // the residual width C
  int64_t n_heads = 12;  // attention heads per block (emb_dim must divide by it)
  int64_t n_layers = 12;  // transformer blocks
  // dropout after embeddings, on attention weights and in the residual branches (training only)
  double drop_rate = 0.1;
  bool qkv_bias = false;  // biases on W_query, W_key and W_value
  bool tie_weights = false;  // the output head shares tok_emb.weight (GPT-2's own checkpoints do)

  void validate() const;  // ValueError naming the bad field
  // Every parameter's state-dict name and shape, in registration order (tied: no out_head.weight), computed
  // without building the model, so a loader can check a file before allocating anything. Both come from the
  // decoder's one table (decoder_config().layout()).
  std::vector<std::pair<std::string, Shape>> parameter_shapes() const;
  // This model as a configuration of the composed decoder: family gpt2, the book's names.
  DecoderConfig decoder_config() const;
  int64_t parameter_count() const;  // ValueError if it does not fit int64
  // This configuration after validate(): for initialisers
  GPTConfig validated() const {
    validate();
    return *this;
  }
  // The book's names as strings (gpt_config_schema); from_strings parses with checks, then validates.
  std::map<std::string, std::string> to_strings() const;
  static GPTConfig from_strings(const std::map<std::string, std::string>& values);  // ValueError on a bad value
  bool operator==(const GPTConfig&) const = default;  // field by field
};

// Every GPTConfig field once: its key (the book's name), command-line flag and help.
const std::vector<Setting<GPTConfig>>& gpt_config_schema();

// A lookup table (torch.nn.Embedding): row i is token (or position) i's vector
class Embedding : public Module {
 public:
  // A (num_embeddings, embedding_dim) table drawn from `gen`, standard normal as PyTorch draws it
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator& gen = default_generator());
  // The rows of `ids` (any shape `ids_shape`), as a tensor of shape ids_shape + (embedding_dim)
  Tensor forward(std::span<const int64_t> ids, const Shape& ids_shape) const;
  Tensor weight;  // (num, dim), standard normal like torch.nn.Embedding
  std::string type_name() const override { return "Embedding"; }
};

// The book's LayerNorm: (x − mean) / √(var + eps) · scale + shift over the last dimension (biased variance)
class LayerNorm : public UnaryModule {
 public:
  explicit LayerNorm(int64_t emb_dim, float eps = 1e-5f);  // Over the last dimension of width emb_dim
  Tensor forward(const Tensor& x) const override;  // x (…, emb_dim) normalised, same shape
  Tensor scale, shift;  // the book's names (ones, zeros)
  float eps;  // added to the variance (1e-5)
  std::string type_name() const override { return "LayerNorm"; }
};

// The book's FeedForward: Linear(C, 4C), tanh-approximated GELU, Linear(4C, C)
class FeedForward : public UnaryModule {
 public:
  // Its two Linear layers for width emb_dim, drawn from `gen` as PyTorch draws them
  FeedForward(int64_t emb_dim, Generator& gen = default_generator());
  Tensor forward(const Tensor& x) const override;  // Linear(C, 4C) → GELU → Linear(4C, C)
  Linear fc, proj;                                   // "layers.0", "layers.2" (layers.1 is the GELU)
  std::string type_name() const override { return "FeedForward"; }
};

// One pre-LayerNorm block: x + Dropout(MultiHeadAttention(LayerNorm(x))), then x + Dropout(FeedForward(LayerNorm(x)))
class TransformerBlock : public UnaryModule {
 public:
  // The block's attention, feed-forward and norms for `config`, drawn from `gen` in the book's order
  TransformerBlock(const GPTConfig& config, Generator& gen = default_generator());
  // x (B, T, C) through the block
  Tensor forward(const Tensor& x) const override { return forward(x, {}); }
  // With a KV cache and/or a record of the attention (see AttentionStep).
  Tensor forward(const Tensor& x, const AttentionStep& step) const;
  MultiHeadAttention att;
  FeedForward ff;
  LayerNorm norm1, norm2;
  double drop_rate;
  std::string type_name() const override { return "TransformerBlock"; }

 private:
  Generator* gen_;
};

// The book's GPTModel (chapter 4): embeddings, trf_blocks, final_norm and out_head under the book's state-dict names
class GPTModel : public LanguageModel {
 public:
  // All parameters for `config`, drawn from `gen` in the book's order: same seed, same weights as PyTorch
  explicit GPTModel(const GPTConfig& config, Generator& gen = default_generator());

  // A model whose weights a loader will overwrite: nothing is drawn (the parameters start as zeros). It owns
  // its dropout generator (seeded with `seed`), so models made this way share no state.
  static std::unique_ptr<GPTModel> uninitialised(const GPTConfig& config, uint64_t seed = 0);

  // ids (B·T, row-major) → logits (B, T, vocab_size). T ≤ context_length, else ShapeError. With `records`,
  // each layer's attention leaves what its weights can be recomputed from (one record per layer).
  Tensor forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                 std::vector<AttentionStep::Record>* records = nullptr) const override;

  // The mean next-token cross-entropy against targets (B·T, ignore_index skipped): the value of
  // language_model_loss(forward(ids, batch, tokens), targets), through the fused head (linear_cross_entropy), so
  // the (B·T × vocab) logits, probabilities and their gradient are never held whole. What training calls.
  Tensor loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
              int64_t ignore_index = -100) const override;

  // What one sequence's tokens attend to: the weights of the chosen layers and heads (0-based; empty = all),
  // (layers, heads, T, T), from the fused path — one forward pass through the blocks records q, k and the
  // log-sum-exp per layer, and only the chosen heads' weights are recomputed. No gradient, no output head.
  Tensor attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers,
                        std::vector<int64_t> heads) const override;

  // Inference with a cache: appends `tokens` new ids per batch row at positions cache.length…, returns the
  // logits of the last new position (B, vocab_size). Throws ShapeError when the cache would overflow.
  KVCache make_cache(int64_t batch, int64_t max_tokens = 0) const override;
  Tensor forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const override;

  Tensor hidden_states(std::span<const int64_t> ids, int64_t batch, int64_t tokens) const override {
    return hidden(ids, batch, tokens, nullptr);
  }
  int64_t hidden_size() const override { return config.emb_dim; }
  Tensor residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const override;
  Tensor hidden_from(const Tensor& residual, int64_t layer) const override;
  std::string block_prefix(int64_t layer) const override { return "trf_blocks." + std::to_string(layer) + "."; }
  std::string final_norm_prefix() const override { return "final_norm."; }
  std::string head_prefix() const override { return "out_head."; }

  // the rows of tok_emb.weight
  int64_t vocab_size() const override { return config.vocab_size; }
  int64_t context_length() const override { return config.context_length; }
  // the blocks in trf_blocks
  int64_t num_layers() const override { return config.n_layers; }
  int64_t num_heads() const override { return config.n_heads; }

  GPTConfig config;  // what the model was built from
  Embedding tok_emb, pos_emb;  // the token and position tables
  std::vector<std::unique_ptr<TransformerBlock>> trf_blocks;  // the transformer blocks, in order
  LayerNorm final_norm;  // the LayerNorm after the last block
  Linear out_head;  // the output head (C → vocab_size; tied: reads tok_emb.weight)
  std::string type_name() const override { return "GPTModel"; }

 private:
  Tensor embed(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t position) const;
  // Embedding, blocks and the final norm: (B, T, emb_dim), what the output head reads.
  Tensor hidden(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                std::vector<AttentionStep::Record>* records) const;
  std::shared_ptr<Generator> owned_generator_;  // set by uninitialised()
  Generator* gen_;
};

}  // namespace qkv::nn
