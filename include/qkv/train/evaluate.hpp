// How well a model predicts a text: the mean next-token cross-entropy (loss) and its exponential (perplexity),
// computed in sliding windows the way Hugging Face's perplexity guide does: windows of `context` tokens start
// every `stride` tokens, and each token is scored once, from the first window that reaches it (so with a
// stride below the context every scored token sees at least context − stride tokens before it).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "qkv/nn/language_model.hpp"

namespace qkv::train {

// One window of an evaluation and the targets it scores
struct EvalWindow {
  int64_t begin = 0, end = 0;  // inputs ids[begin, end), targets ids[begin + 1, end + 1)
  int64_t fresh = 0;           // the last `fresh` targets are scored here
};
// ValueError unless 2 ≤ tokens, 1 ≤ stride ≤ context.
std::vector<EvalWindow> eval_windows(int64_t tokens, int64_t context, int64_t stride);

// A text's loss and perplexity, and how they were counted
struct TextEvaluation {
  double loss = 0;       // mean over the scored tokens (natural log)
  double perplexity = 0;  // exp(loss)
  int64_t scored = 0, windows = 0;  // tokens scored (every token after the first, once) and windows run
  std::vector<double> window_losses;  // the mean loss of each window's scored tokens, in window order
};
// Runs `batch` windows per forward pass (eval mode, no gradient); `progress(done, total)` after each pass.
// ValueError for a token id outside the model's vocabulary or a context beyond its context_length.
TextEvaluation evaluate_text(const nn::LanguageModel& model, std::span<const int64_t> ids, int64_t context, int64_t stride,
                             int64_t batch, const std::function<void(int64_t done, int64_t total)>& progress = {});

}  // namespace qkv::train
