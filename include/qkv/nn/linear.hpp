// Linear: y = x Wᵀ + b, initialised exactly as torch.nn.Linear (weight kaiming-uniform with a = √5,
// bias uniform in ±1/√in), so the same seed gives the same numbers as PyTorch.
#pragma once

#include "qkv/nn/module.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

// Tag for a layer whose weights the caller initialises (zeros until then; no random numbers drawn).
struct NoInit {};

class Linear : public UnaryModule {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator& gen = default_generator());
  // The same numbers drawn into given tensors (out, in) and (out) (the bias one ignored without a bias), e.g.
  // views into one buffer that several layers share so that one product reads them all.
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen, const Tensor& weight_home,
         const Tensor& bias_home);
  Linear(int64_t in_features, int64_t out_features, bool bias, NoInit);

  // x (..., in) → (..., out)
  Tensor forward(const Tensor& x) const override;
  // Uses `shared` (e.g. a token embedding table, out × in) as this layer's weight: weight tying.
  void tie_weight(const Tensor& shared);
  // Moves this layer's parameters, values kept, into `weight_home` and `bias_home` (this layer's shapes; the bias
  // one is ignored without a bias), e.g. views into one buffer that several layers share so that one product can
  // read them all (ProjectedAttention's W_query, W_key, W_value).
  void relocate(const Tensor& weight_home, const Tensor& bias_home);

  // LoRA, low-rank adaptation: forward becomes x Wᵀ + b + (alpha / rank)·(x Aᵀ) Bᵀ with A (rank, in) and B (out, rank),
  // registered as "lora_A.weight" and "lora_B.weight" (PEFT's names). A is drawn as the book's LoRALayer (appendix E)
  // draws its (in, rank) matrix — kaiming_uniform_(a = √5) over that shape — and stored transposed; B starts at zeros,
  // so the layer's output is unchanged until B trains. ValueError for a rank outside 1…min(in, out), a non-positive
  // alpha, or a layer that already has an adapter.
  void add_lora(int64_t rank, double alpha, Generator& gen);
  bool has_lora() const { return lora_A.defined(); }
  int64_t lora_rank() const { return has_lora() ? lora_A.size(0) : 0; }
  // W ← W + (alpha / rank)·B·A, then the adapter is removed: a plain Linear that computes what the adapted one did.
  void merge_lora();
  void remove_lora();

  Tensor weight;  // (out, in)
  Tensor bias;    // (out), undefined without bias
  Tensor lora_A, lora_B;  // (rank, in), (out, rank); undefined without an adapter
  float lora_scale = 0.0f;
  std::string type_name() const override { return "Linear"; }
};

// Checks a layer size given by a user: a positive number, or ValueError naming the layer and argument.
void require_positive(int64_t value, const char* layer, const char* argument);

}  // namespace qkv::nn
