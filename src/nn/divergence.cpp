// next_token_divergence (see qkv/nn/divergence.hpp): both models' logits per window, each row's log-softmax in double.
#include "qkv/nn/divergence.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/error.hpp"

namespace qkv::nn {

namespace {
// log Σ exp(x): the row's normaliser, in double
double log_sum_exp(const float* x, int64_t n) {
  const double top = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - top);
  return top + std::log(sum);
}
}  // namespace

Divergence next_token_divergence(const LanguageModel& reference, const LanguageModel& model, std::span<const int64_t> ids,
                                 int64_t context, const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t V = model.vocab_size();
  if (reference.vocab_size() != V)
    throw ValueError("the reference model has " + std::to_string(reference.vocab_size()) + " tokens and the model " +
                     std::to_string(V) + ": their distributions cannot be compared");
  if (ids.size() < 2) throw ValueError("comparing next-token distributions needs at least 2 tokens");
  if (context < 1 || context > model.context_length() || context > reference.context_length())
    throw ValueError("a window of " + std::to_string(context) + " tokens does not fit the models' context lengths");
  NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(ids.size()), windows = (n + context - 1) / context;
  std::vector<double> kls;
  kls.reserve(static_cast<size_t>(n));
  int64_t agree = 0, scored = 0;
  double nll = 0, reference_nll = 0;
  for (int64_t w = 0; w < windows; ++w) {
    const int64_t start = w * context, T = std::min(context, n - start);
    const std::span<const int64_t> window = ids.subspan(static_cast<size_t>(start), static_cast<size_t>(T));
    const Tensor ref_logits = reference.forward(window, 1, T), logits = model.forward(window, 1, T);
    for (int64_t t = 0; t < T; ++t) {
      const float* r = ref_logits.data() + t * V;
      const float* q = logits.data() + t * V;
      const double lr = log_sum_exp(r, V), lq = log_sum_exp(q, V);
      double kl = 0;
      for (int64_t i = 0; i < V; ++i) {
        const double log_p = r[i] - lr;
        kl += std::exp(log_p) * (log_p - (q[i] - lq));
      }
      kls.push_back(std::max(kl, 0.0));  // rounding can leave −1e-17 for equal rows
      agree += (std::max_element(r, r + V) - r) == (std::max_element(q, q + V) - q);
      if (t + 1 < T) {
        const int64_t next = window[static_cast<size_t>(t + 1)];
        nll += lq - q[next];
        reference_nll += lr - r[next];
        ++scored;
      }
    }
    if (progress) progress(w + 1, windows);
  }
  Divergence d;
  d.positions = static_cast<int64_t>(kls.size());
  double sum = 0;
  for (double k : kls) sum += k;
  d.mean_kl = sum / static_cast<double>(kls.size());
  d.top1_agreement = static_cast<double>(agree) / static_cast<double>(kls.size());
  std::sort(kls.begin(), kls.end());
  d.median_kl = kls[kls.size() / 2];
  d.p99_kl = kls[std::min(kls.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(kls.size())))];
  d.max_kl = kls.back();
  if (scored > 0) {
    d.perplexity = std::exp(nll / static_cast<double>(scored));
    d.reference_perplexity = std::exp(reference_nll / static_cast<double>(scored));
  }
  return d;
}

}  // namespace qkv::nn
