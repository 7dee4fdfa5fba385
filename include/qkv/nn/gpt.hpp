// The GPT model of the book's chapter 4 by its configuration names. The model itself is the decoder in its gpt2
// configuration (decoder.hpp): nn::Decoder model(GPTConfig{…}, gen) is the book's GPTModel(cfg), drawn from the same
// seed as PyTorch draws it, under its state-dict names:
//   tok_emb, pos_emb → dropout → trf_blocks.{i} (norm1 → att → dropout → +, norm2 → ff → dropout → +)
//   → final_norm → out_head
// Pre-LayerNorm blocks, causal multi-head attention (fused kernel, dropout on its weights), a 4× wide tanh-GELU MLP.
// Optional weight tying (the head reads tok_emb.weight, as in GPT-2).
// Not here: training (train/), text (text/), loading Hugging Face GPT-2 files (nn/gpt2.hpp).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/settings.hpp"
#include "qkv/nn/decoder.hpp"

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
  // "book": the book's GPTModel (LayerNorm, learned positions, GELU). The others build today's decoder of the same
  // widths (RMSNorm, RoPE, SwiGLU of 8·emb_dim/3) with that attention, so they compare on the same skeleton:
  //   mha              every head its own K and V (the qwen3 family: q/k norms)
  //   gqa              K/V heads shared by groups of 4 (or 2, when n_heads is not a multiple of 4)
  //   mla              multi-head latent attention: a latent of emb_dim/2 cached, plus half a head rotated (deepseek_v3)
  //   deltanet-hybrid  Gated DeltaNet on 3 layers of 4, gated attention on the others (qwen3_next)
  std::string attention = "book";
  // A mixture of `experts` SwiGLU experts in every layer, experts_per_token of them per token, each 1/experts of the
  // dense MLP's width (the total matches the dense MLP; the book's MoE bonus), with the load-balancing loss; 0: none.
  // Today's decoder only (an --attention other than book).
  int64_t experts = 0, experts_per_token = 2;

  void validate() const;  // ValueError naming the bad field
  // Every parameter's state-dict name and shape, in registration order (tied: no out_head.weight), computed
  // without building the model, so a loader can check a file before allocating anything. Both come from the
  // decoder's one table (decoder_config().layout()).
  std::vector<std::pair<std::string, Shape>> parameter_shapes() const;
  // This model as a configuration of the composed decoder: family gpt2 and the book's names, or (attention other than
  // book) the family that attention belongs to.
  DecoderConfig decoder_config() const;
  // The settings of a decoder configuration decoder_config() gives (the book's GPT, or a model qkv train built);
  // ValueError for another (a downloaded model).
  static GPTConfig of(const DecoderConfig& config);
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

}  // namespace qkv::nn
