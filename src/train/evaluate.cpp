// Loss and perplexity of a text in sliding windows (see qkv/train/evaluate.hpp).
#include "qkv/train/evaluate.hpp"

#include <algorithm>
#include <cmath>

#include "qkv/core/autograd.hpp"

namespace qkv::train {

std::vector<EvalWindow> eval_windows(int64_t tokens, int64_t context, int64_t stride) {
  if (tokens < 2) throw ValueError("the text has " + std::to_string(tokens) + " token(s); scoring needs at least 2");
  if (context < 1 || stride < 1 || stride > context) {
    throw ValueError("the stride (" + std::to_string(stride) + ") must lie between 1 and the window length (" +
                     std::to_string(context) + ")");
  }
  std::vector<EvalWindow> out;
  int64_t scored_to = 0;  // targets ids[1 … scored_to] are scored
  for (int64_t begin = 0;; begin += stride) {
    const int64_t end = std::min(begin + context, tokens - 1);
    const int64_t fresh = end - std::max(scored_to, begin);
    if (fresh > 0) out.push_back({begin, end, fresh});
    scored_to = std::max(scored_to, end);
    if (end == tokens - 1) break;
  }
  return out;
}

TextEvaluation evaluate_text(const nn::LanguageModel& model, std::span<const int64_t> ids, int64_t context, int64_t stride,
                             int64_t batch, const std::function<void(int64_t, int64_t)>& progress) {
  if (context > model.context_length()) {
    throw ValueError("the window (" + std::to_string(context) + " tokens) is longer than the model's context_length (" +
                     std::to_string(model.context_length()) + ")");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= model.vocab_size()) {
      throw ValueError("token " + std::to_string(i) + " has id " + std::to_string(ids[i]) + ", outside the model's vocabulary of " +
                       std::to_string(model.vocab_size()) + "; was the model trained with another tokenizer (--tokenizer)?");
    }
  }
  const std::vector<EvalWindow> windows = eval_windows(static_cast<int64_t>(ids.size()), context, stride);
  NoGradGuard no_grad;
  const int64_t V = model.vocab_size();
  double total = 0.0;
  int64_t scored = 0;
  size_t w = 0;
  TextEvaluation out;
  while (w < windows.size()) {
    // Windows of one length go through together.
    const int64_t T = windows[w].end - windows[w].begin;
    size_t n = 0;
    std::vector<int64_t> inputs;
    while (w + n < windows.size() && static_cast<int64_t>(n) < std::max<int64_t>(batch, 1) &&
           windows[w + n].end - windows[w + n].begin == T) {
      inputs.insert(inputs.end(), ids.begin() + windows[w + n].begin, ids.begin() + windows[w + n].end);
      ++n;
    }
    const Tensor logits = model.forward(inputs, static_cast<int64_t>(n), T);
    for (size_t b = 0; b < n; ++b) {
      const EvalWindow& win = windows[w + b];
      const double before = total;
      for (int64_t t = T - win.fresh; t < T; ++t) {  // −log softmax(logits)[target], in double
        const float* row = logits.data() + (static_cast<int64_t>(b) * T + t) * V;
        const float peak = *std::max_element(row, row + V);
        double sum = 0.0;
        for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - peak);
        total += std::log(sum) + peak - row[ids[static_cast<size_t>(win.begin + t + 1)]];
        ++scored;
      }
      out.window_losses.push_back((total - before) / static_cast<double>(std::max<int64_t>(win.fresh, 1)));
    }
    w += n;
    if (progress) progress(static_cast<int64_t>(w), static_cast<int64_t>(windows.size()));
  }
  out.scored = scored;
  out.windows = static_cast<int64_t>(windows.size());
  out.loss = total / static_cast<double>(scored);
  out.perplexity = std::exp(out.loss);
  return out;
}

}  // namespace qkv::train
