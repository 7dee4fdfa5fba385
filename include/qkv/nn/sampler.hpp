// The sampler chain: how one sequence's next token is picked from a row of logits — penalties from the tokens it
// holds (repetition, presence, frequency), then temperature, top-k, top-p (nucleus), min-p and a seeded draw, or the
// argmax (greedy). Semantics as transformers' logits processors and llama.cpp's samplers; each sequence owns its own
// Sampler (history and random stream), so a sequence samples the same whatever batch it is decoded in.
// Not here: running the model (session.hpp), turning tokens into text (text/stream.hpp).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "qkv/core/random.hpp"

namespace qkv::nn {

// What the chain does, step by step, in this order:
//   1. penalties over the last penalty_last_n tokens the sequence holds (prompt and reply; 0: all of them), for each
//      token id seen c > 0 times: repetition (transformers, llama.cpp) logit / r if logit > 0, else logit · r; then
//      presence and frequency (OpenAI, llama.cpp) logit − presence − c · frequency
//   2. greedy (temperature 0 or greedy): the largest logit, the lowest id among equals — nothing below applies
//   3. temperature: logits / T, then p = softmax
//   4. top-k: the k largest logits (those equal to the k-th are kept too, as transformers' TopKLogitsWarper)
//   5. top-p: the largest tokens whose mass before them is below top_p (the smallest set reaching top_p)
//   6. min-p: tokens with p ≥ min_p · the largest p
//   7. a draw from what is left, renormalised, with the sequence's own generator (seeded)
// transformers applies temperature before top-p and min-p as here (llama.cpp's default chain applies it after them).
struct SamplerOptions {
  bool greedy = false;            // the argmax after penalties (as temperature 0)
  double temperature = 1.0;       // 0: greedy
  int64_t top_k = 0;              // 0: no top-k
  double top_p = 1.0;             // 1: no nucleus
  double min_p = 0.0;             // 0: no min-p
  double repetition_penalty = 1.0;  // 1: none; > 1 discourages repeats
  double presence_penalty = 0.0;    // subtracted once from every token seen
  double frequency_penalty = 0.0;   // subtracted once per time a token was seen
  int64_t penalty_last_n = 0;       // the penalties look at this many last tokens; 0: all the sequence holds
  uint64_t seed = 0;                // the draw's random stream
  // Sample only ids below this (0: the whole row): a model whose table is wider than its tokenizer's vocabulary
  // never picks an id nothing decodes.
  int64_t vocab_limit = 0;
  // ValueError naming the setting that is out of range (temperature < 0, top_p outside (0, 1], …)
  void validate() const;
  bool is_greedy() const { return greedy || temperature <= 0.0; }  // whether step 2 ends the chain
};

// One sequence's sampler: its options, the tokens it has seen (for the penalties) and its random stream
class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options = {});  // validates the options
  // The sequence now holds `token` (prompt tokens and sampled ones alike): the penalties count it.
  void accept(int64_t token);
  void accept(std::span<const int64_t> tokens);  // each of `tokens` in order
  // The next token from a row of `vocab` logits (not modified), drawing from the sampler's stream.
  int64_t sample(const float* logits, int64_t vocab);
  // What the chain would draw from for this row: (token, probability) pairs, most probable first (ties: lower id
  // first), probabilities summing to 1; greedy: the argmax with probability 1.
  std::vector<std::pair<int64_t, double>> distribution(const float* logits, int64_t vocab) const;
  const SamplerOptions& options() const { return options_; }  // what it was made with

 private:
  std::vector<float> penalised(const float* logits, int64_t vocab) const;
  SamplerOptions options_;
  std::vector<int64_t> history_;  // the tokens seen, oldest first (the last penalty_last_n when that is set)
  Generator gen_;
};

}  // namespace qkv::nn
