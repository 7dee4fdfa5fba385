// SelfAttention_v1 and _v2: the seed's trainable scaled dot-product attention.
#include "qkv/nn/attention.hpp"

#include <cmath>
#include <string>

#include "qkv/ops.hpp"

namespace qkv::nn {

void check_attention_input(const Tensor& x, int64_t d_in, const char* layer) {
  if (x.rank() != 2 && x.rank() != 3) {
    throw ShapeError(std::string(layer) + ": input must be (T, d_in) or (B, T, d_in) with d_in = " +
                     std::to_string(d_in) + ", got shape " + x.shape().str());
  }
  if (x.size(-1) != d_in) {
    throw ShapeError(std::string(layer) + ": input's last dimension is " + std::to_string(x.size(-1)) +
                     " but the layer was built with d_in = " + std::to_string(d_in) + " (input shape " +
                     x.shape().str() + ")");
  }
}

AttentionTrace scaled_dot_product_trace(Tensor queries, Tensor keys, Tensor values) {
  AttentionTrace t;
  t.scores = matmul(queries, transpose(keys, -2, -1));                       // Ω = QKᵀ (.., T, T)
  const float scale = std::sqrt(static_cast<float>(keys.size(-1)));          // √d_out
  t.weights = softmax(div(t.scores, scale));                                 // A, rows sum to 1
  t.context = matmul(t.weights, values);                                     // C = AV (.., T, d_out)
  t.queries = std::move(queries);
  t.keys = std::move(keys);
  t.values = std::move(values);
  return t;
}

SelfAttentionV1::SelfAttentionV1(int64_t d_in_, int64_t d_out_, Generator& gen) : d_in(d_in_), d_out(d_out_) {
  require_positive(d_in, "SelfAttention_v1", "d_in");
  require_positive(d_out, "SelfAttention_v1", "d_out");
  // torch.rand(d_in, d_out) three times, in the book's order.
  W_query = register_parameter("W_query", gen.rand({d_in, d_out}));
  W_key = register_parameter("W_key", gen.rand({d_in, d_out}));
  W_value = register_parameter("W_value", gen.rand({d_in, d_out}));
}

AttentionTrace SelfAttentionV1::trace(const Tensor& x) const {
  check_attention_input(x, d_in, "SelfAttention_v1");
  Tensor keys = matmul(x, W_key);  // the book computes keys, queries, values in this order
  Tensor queries = matmul(x, W_query);
  Tensor values = matmul(x, W_value);
  return scaled_dot_product_trace(std::move(queries), std::move(keys), std::move(values));
}

SelfAttentionV2::SelfAttentionV2(int64_t d_in_, int64_t d_out_, bool qkv_bias, Generator& gen)
    : d_in(d_in_),
      d_out(d_out_),
      W_query((require_positive(d_in_, "SelfAttention_v2", "d_in"),
               require_positive(d_out_, "SelfAttention_v2", "d_out"), d_in_),
              d_out_, qkv_bias, gen),
      W_key(d_in_, d_out_, qkv_bias, gen),
      W_value(d_in_, d_out_, qkv_bias, gen) {
  register_module("W_query", W_query);
  register_module("W_key", W_key);
  register_module("W_value", W_value);
}

AttentionTrace SelfAttentionV2::trace(const Tensor& x) const {
  check_attention_input(x, d_in, "SelfAttention_v2");
  Tensor keys = W_key(x);
  Tensor queries = W_query(x);
  Tensor values = W_value(x);
  return scaled_dot_product_trace(std::move(queries), std::move(keys), std::move(values));
}

}  // namespace qkv::nn
