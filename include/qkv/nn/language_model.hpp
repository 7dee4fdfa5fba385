// What every causal language model in qkv offers the code that uses one — generation, evaluation, training, pictures
// of attention — so that code takes a LanguageModel, not one architecture. The Decoder (a block stack composed from
// a config: the book's GPT-2, Llama 3, Qwen2/3, Gemma 3) is one.
// Not here: any architecture (gpt.hpp, decoder.hpp), sampling (generate.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "qkv/nn/attention.hpp"
#include "qkv/nn/module.hpp"

namespace qkv::nn {

// Keys and values of every layer for the tokens seen so far, so each new token costs O(T) attention instead of a
// full forward pass. layers[i] holds (B, capacity[i], H_kv·D) keys and values: a global layer up to the cache's
// length, a sliding-window layer only its last window − 1 positions plus room for one chunk of new ones. A latent-
// attention layer decoding absorbed (Decoder::LatentDecode) holds one (B, capacity, kv_lora_rank + qk_rope_head_dim)
// buffer of latents and rotated keys in `keys`, read as keys and as values; its `values` is undefined.
struct KVCache {
  std::vector<KVCacheLayer> layers;  // one per layer, (B, capacity, H_kv·D) keys and values
  std::vector<int64_t> filled;  // per layer: how many rows of its buffers hold keys (== length for global layers)
  int64_t batch = 0, capacity = 0, length = 0;  // capacity: the most positions the cache can reach
  int64_t bytes() const;                        // what its buffers hold, in bytes
};

// What generate, eval, attention and the fine-tuning take: the composed Decoder in any of its families is one
class LanguageModel : public Module {
 public:
  virtual int64_t vocab_size() const = 0;  // Tokens in the vocabulary
  virtual int64_t context_length() const = 0;  // the longest sequence forward() accepts
  virtual int64_t num_layers() const = 0;  // Transformer blocks
  virtual int64_t num_heads() const = 0;       // query heads per layer
  // K/V heads per layer (grouped-query attention: fewer than num_heads)
  virtual int64_t num_kv_heads() const { return num_heads(); }
  virtual int64_t layer_window(int64_t /*layer*/) const { return 0; }  // a layer's sliding window, 0 for full causal

  // ids (B·T, row-major) → logits (B, T, vocab_size). With `records`, each layer's attention leaves what its weights
  // can be recomputed from (one record per layer).
  virtual Tensor forward(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                         std::vector<AttentionStep::Record>* records = nullptr) const = 0;
  // The final norm's output (B, T, hidden_size()): what the output head reads, and what a classifier head reads instead.
  virtual Tensor hidden_states(std::span<const int64_t> ids, int64_t batch, int64_t tokens) const = 0;
  // The same in two stages: the residual stream entering block `layer` (B, T, hidden_size(); layer 0 is the embedding),
  // and the final hidden states from such a residual. hidden_from(residual_before(ids, B, T, k), k) is hidden_states:
  // what lets a fine-tuner compute a frozen prefix of the blocks once per text and reuse it every epoch.
  virtual Tensor residual_before(std::span<const int64_t> ids, int64_t batch, int64_t tokens, int64_t layer) const = 0;
  virtual Tensor hidden_from(const Tensor& residual, int64_t layer) const = 0;
  virtual int64_t hidden_size() const = 0;
  // Where parameters live by name, for freezing and adapters: the state-dict prefix of block `layer` ("trf_blocks.11."
  // in the book's names, "model.layers.11." in Hugging Face's), of the final norm ("final_norm.", "model.norm.") and
  // of the output head ("out_head.", "lm_head.").
  virtual std::string block_prefix(int64_t layer) const = 0;
  virtual std::string final_norm_prefix() const = 0;
  virtual std::string head_prefix() const = 0;
  // The name a classifier's head takes in place of the output head: "out_head" (the book's chapter 6), "score"
  // (Hugging Face's *ForSequenceClassification).
  virtual std::string classifier_head_name() const = 0;
  // The mean next-token cross-entropy against targets (B·T, ignore_index skipped), through the fused head, so the
  // (B·T × vocab) logits are never held whole.
  virtual Tensor loss(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> targets,
                      int64_t ignore_index = -100) const = 0;
  // What one sequence's tokens attend to: (layers, heads, T, T) for the chosen layers and query heads (0-based; empty
  // = all), recomputed from one forward pass's records. No gradient.
  virtual Tensor attention_maps(std::span<const int64_t> ids, std::vector<int64_t> layers,
                                std::vector<int64_t> heads) const = 0;
  // A cache for `batch` rows of up to max_tokens positions (0: context_length), and inference with it: appends
  // `tokens` new ids per row at positions cache.length…, returns the logits of the last new position (B, vocab).
  // ShapeError when the cache would overflow.
  virtual KVCache make_cache(int64_t batch, int64_t max_tokens = 0) const = 0;
  // A length past which the rotation of every position changes (LongRoPE's original context, Phi-3), or 0: keys
  // cached before a sequence grows past it are stale, so generation encodes the whole sequence again once when it
  // crosses it, as transformers' generate does.
  virtual int64_t rotation_switch() const { return 0; }
  virtual Tensor forward_cached(std::span<const int64_t> ids, int64_t batch, int64_t tokens, KVCache& cache) const = 0;
};

// What attention_maps implementations share: checks the chosen layers and heads (0-based; empty = all of the model's
// L and H), runs layers 0…(the last chosen) one after another with `run_layer(i, record)`, and gathers the chosen
// heads' weights, `weights(layer, record, head)` (T × T each), into (layers, heads, T, T). ValueError naming a layer or
// head that does not exist.
Tensor gather_attention_maps(int64_t L, int64_t H, int64_t T, std::vector<int64_t> layers, std::vector<int64_t> heads,
                             const std::function<void(int64_t layer, AttentionStep::Record& record)>& run_layer,
                             const std::function<Tensor(int64_t layer, const AttentionStep::Record&, int64_t head)>& weights);

// That `ids` form a (batch, tokens) batch with both positive; ShapeError starting with `who` otherwise.
void check_token_batch(std::span<const int64_t> ids, int64_t batch, int64_t tokens, const char* who);

// Mean next-token cross-entropy of logits (B, T, V) against targets (B·T), ignoring ignore_index.
Tensor language_model_loss(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index = -100);

}  // namespace qkv::nn
