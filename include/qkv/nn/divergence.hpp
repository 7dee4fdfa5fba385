// How far a model's next-token distributions are from a reference model's on the same text: the KL divergence and
// top-1 agreement llama.cpp's llama-perplexity --kl-divergence reports, for measuring what quantization loses
// (`qkv eval --kl-reference`). Not here: perplexity in sliding windows (train/evaluate.hpp), quantizing (gguf_export.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "qkv/nn/language_model.hpp"

namespace qkv::nn {

// The comparison over every position of a text (nats; distributions in double precision)
struct Divergence {
  int64_t positions = 0;  // next-token distributions compared
  // KL(reference ‖ model) = Σ p_ref · (log p_ref − log p_model) per position: mean, median, 99th percentile, largest
  double mean_kl = 0, median_kl = 0, p99_kl = 0, max_kl = 0;
  double top1_agreement = 0;  // fraction of positions where both models' most likely token is the same
  // exp(mean −log p(next token)) of each model, over the positions whose next token is in the same window
  double perplexity = 0, reference_perplexity = 0;
};

// Runs both models over `ids` in windows of `context` tokens that do not overlap (each window from a fresh start, so a
// window's first positions see little context, as in llama-perplexity's chunks) and compares their distributions at
// every position. `progress` is called with (windows done, windows). ValueError when the vocabularies differ, fewer
// than 2 tokens are given, or `context` is not 1 … either model's context length.
Divergence next_token_divergence(const LanguageModel& reference, const LanguageModel& model, std::span<const int64_t> ids,
                                 int64_t context, const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace qkv::nn
