// The attention classes of Raschka's "Build a Large Language Model (from Scratch)", chapter 3, with the
// book's constructor arguments, parameter creation order and state-dict names:
//   SelfAttentionV1  raw parameter matrices W_query, W_key, W_value (d_in, d_out), x @ W
//   SelfAttentionV2  three Linear layers W_query, W_key, W_value (weight d_out × d_in)
// Every forward follows the seed article: Q = XWq, K = XWk, V = XWv; Ω = QKᵀ; A = softmax(Ω/√d_out)
// by rows; C = AV.
#pragma once

#include <memory>
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

class SelfAttentionV1 : public Module {
 public:
  SelfAttentionV1(int64_t d_in, int64_t d_out, Generator& gen = default_generator());

  // x (T, d_in) or (B, T, d_in) → context (.., T, d_out)
  Tensor forward(const Tensor& x) const { return trace(x).context; }
  Tensor operator()(const Tensor& x) const { return forward(x); }
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out;
  Tensor W_query, W_key, W_value;  // (d_in, d_out), drawn with rand in this order
  std::string type_name() const override { return "SelfAttention_v1"; }
};

class SelfAttentionV2 : public Module {
 public:
  SelfAttentionV2(int64_t d_in, int64_t d_out, bool qkv_bias = false, Generator& gen = default_generator());

  Tensor forward(const Tensor& x) const { return trace(x).context; }
  Tensor operator()(const Tensor& x) const { return forward(x); }
  AttentionTrace trace(const Tensor& x) const;

  int64_t d_in, d_out;
  Linear W_query, W_key, W_value;  // created in this order, as in the book
  std::string type_name() const override { return "SelfAttention_v2"; }
};

// Checks that x is (T, d_in) or (B, T, d_in) for module `layer`; throws ShapeError otherwise.
void check_attention_input(const Tensor& x, int64_t d_in, const char* layer);

// The seed's attention from projected queries, keys and values: Ω = QKᵀ, A = softmax(Ω/√d), C = AV.
AttentionTrace scaled_dot_product_trace(Tensor queries, Tensor keys, Tensor values);

}  // namespace qkv::nn
