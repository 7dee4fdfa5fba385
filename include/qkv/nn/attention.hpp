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
#include "qkv/random.hpp"

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

class SelfAttentionV1 : public UnaryModule {
 public:
  SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen = default_generator());

  // x (T, d_in) or (B, T, d_in) → context (.., T, d_out)
  Tensor forward(const Tensor& x) const override { return trace(x).context; }
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out;
  Tensor W_query, W_key, W_value;  // (d_in, d_out), drawn with rand in this order
  std::string type_name() const override { return "SelfAttention_v1"; }
};

class SelfAttentionV2 : public UnaryModule {
 public:
  SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias = false, Generator& gen = default_generator());

  Tensor forward(const Tensor& x) const override { return trace(x).context; }
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out;
  Linear W_query, W_key, W_value;  // created in this order, as in the book
  std::string type_name() const override { return "SelfAttention_v2"; }
};

class CausalAttention : public UnaryModule {
 public:
  CausalAttention(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, bool qkv_bias = false,
                  Generator& gen = default_generator());

  // x (B, T, d_in) or (T, d_in), T ≤ context_length → (.., T, d_out)
  Tensor forward(const Tensor& x) const override;
  // weights are the ones used for the context: after the mask, the softmax and (in training) dropout.
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out, context_length;
  double dropout;
  Linear W_query, W_key, W_value;
  Tensor mask;  // (context_length, context_length), 1 above the diagonal
  std::string type_name() const override { return "CausalAttention"; }

 private:
  Generator* gen_;
};

class MultiHeadAttentionWrapper : public UnaryModule {
 public:
  MultiHeadAttentionWrapper(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, int64_t num_heads,
                            bool qkv_bias = false, Generator& gen = default_generator());

  // x (B, T, d_in) → (B, T, num_heads · d_out)
  Tensor forward(const Tensor& x) const override;

  std::vector<std::unique_ptr<CausalAttention>> heads;
  std::string type_name() const override { return "MultiHeadAttentionWrapper"; }
};

class MultiHeadAttention : public UnaryModule {
 public:
  MultiHeadAttention(int64_t d_in, int64_t d_out, int64_t context_length, double dropout, int64_t num_heads,
                     bool qkv_bias = false, Generator& gen = default_generator());

  // x (B, T, d_in) or (T, d_in) → (.., T, d_out)
  Tensor forward(const Tensor& x) const override;
  // The per-head weights (B, H, T, T) need the plain path; trace always takes it.
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out, context_length, num_heads, head_dim;
  double dropout;
  Linear W_query, W_key, W_value, out_proj;
  Tensor mask;
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

}  // namespace qkv::nn
