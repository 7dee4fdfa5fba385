// The attention classes of Raschka's "Build a Large Language Model (from Scratch)", chapter 3, with the
// book's constructor arguments, parameter creation order and state-dict names:
//   SelfAttentionV1  raw parameter matrices W_query, W_key, W_value (d_in, d_out), x @ W
//   SelfAttentionV2  three Linear layers W_query, W_key, W_value (weight d_out × d_in)
//   CausalAttention  V2 plus a causal mask (buffer "mask") and dropout on the attention weights
//   MultiHeadAttentionWrapper  num_heads CausalAttention modules "heads.{i}", outputs concatenated
//   MultiHeadAttention  one projection split into heads (B,H,T,D), then out_proj (with bias)
// Every forward follows the seed article: Q = XWq, K = XWk, V = XWv; Ω = QKᵀ; A = softmax(Ω/√d_out)
// by rows; C = AV.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qkv/nn/linear.hpp"
#include "qkv/nn/module.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

// Every intermediate of one attention forward, for people who want to look inside.
struct AttentionTrace {
  Tensor queries;       // Q (.., T, d_out)
  Tensor keys;          // K (.., T, d_out)
  Tensor values;        // V (.., T, d_out)
  Tensor scores;        // Ω = QKᵀ (.., T, T), before scaling
  Tensor weights;       // A = softmax(Ω / √d_out) (.., T, T); rows sum to 1
  Tensor context;       // C = AV (.., T, d_out)
};

// The book's constructor arguments, checked once (each class uses the ones it has).
struct AttentionArgs {
  int64_t d_in = 0, d_out = 0;  // input and output widths
  bool causal = false;         // the class has a causal mask of context_length (CausalAttention, MultiHead…)
  int64_t context_length = 0;  // the tokens the causal mask covers
  double dropout = 0.0;  // dropout probability on the attention weights (training only)
  int64_t num_heads = 1;  // heads (MultiHeadAttention, MultiHeadAttentionWrapper)
  bool qkv_bias = false;  // biases on the query, key and value projections
  // This, or ValueError naming `layer` and the bad argument: sizes (and, when causal, context_length) must be
  // positive, dropout in [0, 1] and d_out a multiple of num_heads.
  AttentionArgs validated(const char* layer) const;
};

// Keys and values of one attention layer for the tokens seen so far: (B, capacity, d_out) each, float32 or, made under
// PrecisionGuard(BF16) (`--precision bf16`), bfloat16: half the memory, read as they are by the bf16 attention kernel.
struct KVCacheLayer {
  Tensor keys, values;  // (B, capacity, d_out) each
  // Zeroed buffers of (batch, rows, width), in bf16 when this thread's precision is BF16, else float32
  static KVCacheLayer make(int64_t batch, int64_t rows, int64_t width);
};

// What one attention call may do besides attending: append to a KV cache (generation), and hand back what
// the weights can be recomputed from (pictures of attention: kernels::attention_probabilities).
struct AttentionStep {
  KVCacheLayer* cache = nullptr;  // x holds the tokens at positions [position, position + T)
  int64_t position = 0;  // the position of x's first token
  // Filled by the forward when set: what the attention weights can be recomputed from
  struct Record {
    Tensor queries;        // (B, T, d_out) as projected
    Tensor keys;           // (B, Tk, d_out): with a cache, the cache buffer, of which kv_tokens rows are filled
    int64_t kv_tokens = 0;  // how many rows of keys are filled
    Tensor lse;            // (B, H, T): log-sum-exp of each query row's scaled scores
  }* record = nullptr;  // where to record (nullptr: nothing)
};

// The book's SelfAttention_v1: three raw (d_in, d_out) parameter matrices, C = softmax(XWq (XWk)ᵀ / √d_out) XWv
class SelfAttentionV1 : public UnaryModule {
 public:
  // Wq, Wk, Wv drawn from `gen` with rand, in the order query, key, value (torch.manual_seed(123) gives the book's)
  SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen = default_generator());

  // x (T, d_in) or (B, T, d_in) → context (.., T, d_out)
  Tensor forward(const Tensor& x) const override { return trace(x).context; }
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out;  // input and output widths
  // W_query, W_key and W_value: (d_in, d_out) each, drawn with rand in this order
  Tensor W_query, W_key, W_value;  // (d_in, d_out), drawn with rand in this order
  std::string type_name() const override { return "SelfAttention_v1"; }
};

// The three nn.Linear projections that SelfAttention_v2, CausalAttention and MultiHeadAttention share, created
// in the book's order (query, key, value), and the one place their input is checked and projected.
class ProjectedAttention : public UnaryModule {
 public:
  int64_t d_in, d_out;  // input and output widths
  int64_t context_length;  // 0: no causal mask (SelfAttention_v2)
  // The one buffer the three weights live in, (3·d_out, d_in), rows in the book's order query, key, value (and
  // the biases', (3·d_out), undefined without them): linear_concat reads it as one matrix. Not parameters
  // themselves; W_query.weight and the others are views into them.
  Tensor qkv_weight, qkv_bias;
  Linear W_query, W_key, W_value;

 protected:
  // The three nn.Linear layers of `args`, drawn from `gen` in the book's order
  ProjectedAttention(const AttentionArgs& args, Generator& gen);
  // The three projections of an input
  struct Projections {
    Tensor queries, keys, values;  // (.., T, d_out)
  };
  // Checks x (and T ≤ context_length), then K = x Wkᵀ, Q = x Wqᵀ, V = x Wvᵀ, keys first as the book does.
  Projections project(const Tensor& x) const;
  // The same three projections as one product, (.., T, 3·d_out) with each token's query, key and value side by
  // side (linear_concat). The three layers' parameters share one buffer from construction on, so the product
  // reads them in place; load_state_dict copies into it and keeps that.
  Tensor project_packed(const Tensor& x) const;

 private:
  static Tensor part_of(const Tensor& whole, int64_t i);  // the i-th third (by rows) of qkv_weight or qkv_bias
  void check_input(const Tensor& x) const;  // x is (T, d_in) or (B, T, d_in), T ≤ context_length
};

// The book's SelfAttention_v2: nn.Linear projections (weights (d_out, d_in)), no mask
class SelfAttentionV2 : public ProjectedAttention {
 public:
  // The three Linear layers drawn from `gen` as PyTorch's nn.Linear draws them, query first
  SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias = false, Generator& gen = default_generator());

  // x (T, d_in) or (B, T, d_in) → context (.., T, d_out)
  Tensor forward(const Tensor& x) const override { return trace(x).context; }
  // Every intermediate of the forward (queries, keys, values, scores, weights, context)
  AttentionTrace trace(const Tensor& x) const;
  std::string type_name() const override { return "SelfAttention_v2"; }
};

// The book's CausalAttention: SelfAttention_v2 with a causal mask and dropout on the weights
class CausalAttention : public ProjectedAttention {
 public:
  // The projections for d_in → d_out, a mask of context_length, dropout p (drawn from `gen`, its masks too)
  CausalAttention(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, bool qkv_bias = false,
                  Generator& gen = default_generator());

  // x (B, T, d_in) or (T, d_in), T ≤ context_length → (.., T, d_out)
  Tensor forward(const Tensor& x) const override;
  // weights are the ones used for the context: after the mask, the softmax and (in training) dropout.
  AttentionTrace trace(const Tensor& x) const;

  double dropout;  // the probability of zeroing a weight in training
  // The book's "mask" buffer (1 above the diagonal) is never read: the mask is computed where it is needed.
  // It appears in the state dict, as in PyTorch, and is made only when a state dict is written.
  std::string type_name() const override { return "CausalAttention"; }

 private:
  Generator* gen_;
};

// The book's MultiHeadAttentionWrapper: num_heads CausalAttention modules side by side, outputs concatenated
class MultiHeadAttentionWrapper : public UnaryModule {
 public:
  // num_heads heads of d_in → d_out each (the output is num_heads · d_out wide)
  MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, int64_t num_heads,
                            bool qkv_bias = false, Generator& gen = default_generator());

  // x (B, T, d_in) → (B, T, num_heads · d_out)
  Tensor forward(const Tensor& x) const override;

  std::vector<std::unique_ptr<CausalAttention>> heads;  // the heads, in order ("heads.0", "heads.1", …)
  std::string type_name() const override { return "MultiHeadAttentionWrapper"; }
};

// The book's MultiHeadAttention: one set of projections split into heads, the fused kernel, and out_proj
class MultiHeadAttention : public ProjectedAttention {
 public:
  // d_in → d_out split into num_heads heads of d_out / num_heads, a causal mask of context_length, dropout p
  MultiHeadAttention(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, int64_t num_heads,
                     bool qkv_bias = false, Generator& gen = default_generator());

  // x (B, T, d_in) or (T, d_in) → (.., T, d_out)
  Tensor forward(const Tensor& x) const override { return forward(x, {}); }
  // The same, appending to a KV cache and/or recording what the weights can be recomputed from (fused path;
  // with a cache, no gradient is recorded). The one forward of this class: training, generation and the
  // pictures of attention all come here.
  Tensor forward(const Tensor& x, const AttentionStep& step) const;
  // The per-head weights (B, H, T, T) materialised by the plain path; trace always takes it.
  AttentionTrace trace(const Tensor& x) const;
  // An empty cache for `batch` rows of up to `capacity` tokens (0, or more than context_length: context_length).
  KVCacheLayer make_cache(int64_t batch, int64_t capacity = 0) const;
  // Head h's attention weights (T, Tk) for batch row b, recomputed from a record of forward(x, {.record}).
  Tensor weights(const AttentionStep::Record& record, int64_t b, int64_t h) const;

  int64_t num_heads, head_dim;  // heads, and each head's width (d_out / num_heads)
  double dropout;  // dropout probability on the attention weights (training only)
  Linear out_proj;  // the projection after the heads are joined (d_out → d_out)
  std::string type_name() const override { return "MultiHeadAttention"; }

 private:
  Generator* gen_;
};

// Checks that x is (T, d_in) or (B, T, d_in) for module `layer`; throws ShapeError otherwise.
void check_attention_input(const Tensor& x, int64_t d_in, const char* layer);

// The seed's attention from projected queries, keys and values (.., T, D): Ω = QKᵀ, A = softmax(Ω/√D),
// C = AV. With `causal`, scores above the diagonal become −∞ first (the book's masked_fill); with
// dropout_p > 0 in training, dropout acts on A. This is the plain path: it materialises Ω and A.
AttentionTrace scaled_dot_product_trace(Tensor queries, Tensor keys, Tensor values, bool causal = false,
                                        double dropout_p = 0.0, bool training = false,
                                        Generator& gen = default_generator());
// Checks a sequence length against a module's context_length (ShapeError naming both).
void check_context_length(int64_t T, int64_t context_length, const char* layer);

}  // namespace qkv::nn

namespace qkv::nn {

// Builds one of the book's classes from its Python name ("module": "MultiHeadAttention") and its
// constructor arguments under their Python names, all as strings, as `qkv apply` finds them in a
// safetensors file's __metadata__. Throws ValueError naming a missing or malformed argument.
std::unique_ptr<UnaryModule> make_attention_module(const std::map<std::string, std::string>& arguments,
                                                   Generator& gen = default_generator());
const std::vector<std::string>& attention_module_names();
// How many trainable numbers that module would hold, from the same arguments, without building it (ValueError
// on overflow): a loader compares it with what the file holds before allocating.
int64_t attention_parameter_count(const std::map<std::string, std::string>& arguments);

}  // namespace qkv::nn
