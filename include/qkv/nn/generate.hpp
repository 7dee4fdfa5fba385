// Text generation from any LanguageModel (the Decoder: GPT-2, Llama, Qwen, Gemma): greedy or sampled (temperature, top-k, top-p), with a KV cache so each
// new token costs one position's work instead of a full forward pass.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "qkv/nn/language_model.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

// How generate() picks each new token, and when it stops
struct SamplingOptions {
  int64_t max_new_tokens = 100;  // tokens to add at most
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: all tokens
  double top_p = 1.0;        // nucleus: the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;  // the sampling stream's seed
  bool use_cache = true;  // keep every layer's keys and values (false: recompute the whole context per token)
  int64_t stop_token = -1;   // e.g. <|endoftext|>; −1: never stop early
  std::vector<int64_t> stop_tokens;  // more tokens that end generation (a model's EOS ids)
  // Sample only ids below this (0: the model's whole vocabulary): a model whose table is wider than its tokenizer's
  // vocabulary (a padded table, or --vocab-size above a byte tokenizer's 256) never picks an id nothing decodes.
  int64_t vocab_limit = 0;
};

// Returns the new tokens (not the prompt). A prompt longer than context_length keeps its last
// context_length tokens (documented truncation); the cache is made for the prompt and max_new_tokens (at most
// context_length), and when it fills up it is refilled from the last context_length / 2 tokens, so generation can
// run past context_length. on_token sees each new token.
std::vector<int64_t> generate(const LanguageModel& model, std::vector<int64_t> prompt, const SamplingOptions& options,
                              const std::function<void(int64_t token)>& on_token = {});

// Picks a token from one row of logits (V) as `options` say, drawing from `gen`.
int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options, Generator& gen);

}  // namespace qkv::nn
