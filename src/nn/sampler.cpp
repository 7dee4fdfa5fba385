// The sampler chain (see qkv/nn/sampler.hpp): penalties, temperature, top-k, top-p, min-p, a seeded draw or greedy.
#include "qkv/nn/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>

#include "qkv/core/error.hpp"

namespace qkv::nn {

namespace {

bool has_penalties(const SamplerOptions& o) {
  return o.repetition_penalty != 1.0 || o.presence_penalty != 0.0 || o.frequency_penalty != 0.0;
}

}  // namespace

void SamplerOptions::validate() const {
  auto fail = [](const std::string& what) { throw ValueError("sampler: " + what); };
  if (!(temperature >= 0.0) || !std::isfinite(temperature)) fail("temperature must be a finite number ≥ 0 (0: greedy)");
  if (top_k < 0) fail("top_k must be ≥ 0 (0: off)");
  if (!(top_p > 0.0 && top_p <= 1.0)) fail("top_p must lie in (0, 1] (1: off)");
  if (!(min_p >= 0.0 && min_p <= 1.0)) fail("min_p must lie in [0, 1] (0: off)");
  if (!(repetition_penalty > 0.0) || !std::isfinite(repetition_penalty)) fail("repetition_penalty must be positive (1: off)");
  if (!std::isfinite(presence_penalty) || !std::isfinite(frequency_penalty))
    fail("presence_penalty and frequency_penalty must be finite numbers (0: off)");
  if (penalty_last_n < 0) fail("penalty_last_n must be ≥ 0 (0: every token the sequence holds)");
  if (vocab_limit < 0) fail("vocab_limit must be ≥ 0 (0: the whole row)");
}

Sampler::Sampler(const SamplerOptions& options) : options_(options), gen_(options.seed) { options_.validate(); }

void Sampler::accept(int64_t token) {
  history_.push_back(token);
  // Keep the window bounded: drop the older half when the history is twice the window.
  const auto n = static_cast<size_t>(options_.penalty_last_n);
  if (n > 0 && history_.size() >= 2 * n) history_.erase(history_.begin(), history_.end() - static_cast<std::ptrdiff_t>(n));
}

void Sampler::accept(std::span<const int64_t> tokens) {
  for (int64_t t : tokens) accept(t);
}

std::vector<float> Sampler::penalised(const float* logits, int64_t vocab) const {
  std::vector<float> z(logits, logits + vocab);
  if (!has_penalties(options_) || history_.empty()) return z;
  const size_t n = options_.penalty_last_n > 0 ? std::min(history_.size(), static_cast<size_t>(options_.penalty_last_n))
                                               : history_.size();
  std::unordered_map<int64_t, int64_t> counts;
  for (auto it = history_.end() - static_cast<std::ptrdiff_t>(n); it != history_.end(); ++it)
    if (*it >= 0 && *it < vocab) ++counts[*it];
  const auto r = static_cast<float>(options_.repetition_penalty);
  for (const auto& [token, count] : counts) {
    float& v = z[static_cast<size_t>(token)];
    v = v > 0.0f ? v / r : v * r;  // as transformers' RepetitionPenaltyLogitsProcessor and llama.cpp
    v -= static_cast<float>(options_.presence_penalty + static_cast<double>(count) * options_.frequency_penalty);
  }
  return z;
}

std::vector<std::pair<int64_t, double>> Sampler::distribution(const float* logits, int64_t vocab) const {
  if (vocab <= 0) throw ValueError("sampler: an empty row of logits");
  if (options_.vocab_limit > 0) vocab = std::min(vocab, options_.vocab_limit);
  const bool penalties = !history_.empty() && has_penalties(options_);
  // Greedy without penalties reads the logits where they are: no copy of the row (600 KB for a 152k vocabulary, each
  // token)
  if (options_.is_greedy() && !penalties)
    return {{static_cast<int64_t>(std::max_element(logits, logits + vocab) - logits), 1.0}};
  const std::vector<float> z = penalised(logits, vocab);
  if (options_.is_greedy())
    return {{static_cast<int64_t>(std::max_element(z.begin(), z.end()) - z.begin()), 1.0}};
  // Most probable first, lower id first among equals (stable). With top-k only the tokens at or above the k-th
  // logit are sorted (ties with the k-th stay, as transformers keeps them): not the whole vocabulary per token.
  std::vector<int64_t> order;
  if (options_.top_k > 0 && options_.top_k < vocab) {
    std::vector<float> sorted(z);
    std::nth_element(sorted.begin(), sorted.begin() + (options_.top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<size_t>(options_.top_k - 1)];
    for (int64_t id = 0; id < vocab; ++id)
      if (z[static_cast<size_t>(id)] >= kth) order.push_back(id);
  } else {
    order.resize(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[static_cast<size_t>(a)] > z[static_cast<size_t>(b)]; });
  size_t keep = order.size();
  // softmax of z / T over all tokens (top-k only removes tokens; the ratios of the rest do not change)
  const double T = options_.temperature, top = z[static_cast<size_t>(order[0])];
  std::vector<double> p(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += p[i] = std::exp((z[static_cast<size_t>(order[i])] - top) / T);
  for (double& v : p) v /= total;
  if (options_.top_p < 1.0) {  // keep a token while the mass before it is below top_p
    double before = 0.0;
    size_t nucleus = 0;
    while (nucleus < keep && before < options_.top_p) before += p[nucleus++];
    keep = std::max<size_t>(nucleus, 1);
  }
  if (options_.min_p > 0.0) {  // p ≥ min_p · the largest p (p[0])
    const double floor = options_.min_p * p[0];
    size_t n = 1;
    while (n < keep && p[n] >= floor) ++n;
    keep = n;
  }
  total = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  std::vector<std::pair<int64_t, double>> out(keep);
  for (size_t i = 0; i < keep; ++i) out[i] = {order[i], p[i] / total};
  return out;
}

int64_t Sampler::sample(const float* logits, int64_t vocab) {
  const std::vector<std::pair<int64_t, double>> d = distribution(logits, vocab);
  if (d.size() == 1) return d[0].first;
  double u = gen_.uniform_double();
  for (const auto& [token, p] : d) {
    u -= p;
    if (u < 0.0) return token;
  }
  return d.back().first;
}

}  // namespace qkv::nn
