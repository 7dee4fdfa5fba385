// Linear: y = x Wᵀ + b, initialised exactly as torch.nn.Linear (weight kaiming-uniform with a = √5,
// bias uniform in ±1/√in), so the same seed gives the same numbers as PyTorch.
#pragma once

#include "qkv/nn/module.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

// Tag for a layer whose weights the caller initialises (zeros until then; no random numbers drawn).
struct NoInit {};

// torch.nn.Linear: y = x Wᵀ + b, weight (out, in), optionally with a LoRA adapter fused into the same products
class Linear : public UnaryModule {
 public:
  // Weight and bias drawn from `gen` as PyTorch's nn.Linear draws them (kaiming-uniform and its bias rule)
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator& gen = default_generator());
  // The same numbers drawn into given tensors (out, in) and (out) (the bias one ignored without a bias), e.g.
  // views into one buffer that several layers share so that one product reads them all.
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen, const Tensor& weight_home,
         const Tensor& bias_home);
  Linear(int64_t in_features, int64_t out_features, bool bias, NoInit);

  // x (..., in) → (..., out)
  Tensor forward(const Tensor& x) const override;
  // Moves this layer's parameters, values kept, into `weight_home` and `bias_home` (this layer's shapes; the bias
  // one is ignored without a bias), e.g. views into one buffer that several layers share so that one product can
  // read them all (ProjectedAttention's W_query, W_key, W_value).
  void relocate(const Tensor& weight_home, const Tensor& bias_home);

  // LoRA (low-rank adaptation, see Module::add_lora): forward becomes x Wᵀ + b + scale·(x Aᵀ) Bᵀ.
  void add_lora(int64_t rank, double alpha, Generator& gen);
  bool has_lora() const { return lora.defined(); }
  void merge_lora();
  std::vector<LoraSite> own_lora_sites() override { return {{"", weight, &lora, this, "", lora_roles}}; }

  Tensor weight;  // (out, in)
  Tensor bias;    // (out), undefined without bias
  LoraWeights lora;  // A (rank, in), B (out, rank); undefined without an adapter
  unsigned lora_roles = 0;  // what it projects to, for LoRA's presets (module.hpp's LoraRoleBits); set by its owner
  std::string type_name() const override { return "Linear"; }
};

// x Wᵀ + b, plus the adapter's low-rank update when it has one (lora_linear): what every adapted projection computes.
Tensor linear_with_lora(const Tensor& x, const Tensor& weight, const Tensor& bias, const LoraWeights& lora);

// Checks a layer size given by a user: a positive number, or ValueError naming the layer and argument.
void require_positive(int64_t value, const char* layer, const char* argument);

}  // namespace qkv::nn
