// generate and sample_token (see qkv/nn/generate.hpp).
#include "qkv/nn/generate.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "qkv/core/autograd.hpp"

namespace qkv::nn {

int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options, Generator& gen) {
  if (options.temperature <= 0.0) return std::max_element(logits, logits + vocab) - logits;
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  // Softmax over the kept tokens at this temperature, largest first.
  std::vector<double> p(static_cast<size_t>(keep));
  const double top = logits[order[0]];
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) total += p[static_cast<size_t>(i)] = std::exp((logits[order[static_cast<size_t>(i)]] - top) / options.temperature);
  if (options.top_p < 1.0) {
    double cumulative = 0.0;
    int64_t nucleus = 0;
    while (nucleus < keep) {
      cumulative += p[static_cast<size_t>(nucleus++)] / total;
      if (cumulative >= options.top_p) break;
    }
    keep = std::max<int64_t>(nucleus, 1);
    total = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  double u = gen.uniform_double() * total;
  for (int64_t i = 0; i < keep; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u < 0) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(keep - 1)];
}

std::vector<int64_t> generate(const LanguageModel& model, std::vector<int64_t> prompt, const SamplingOptions& options,
                              const std::function<void(int64_t token)>& on_token) {
  NoGradGuard no_grad;
  const int64_t ctx = model.context_length(), V = model.vocab_size();
  if (prompt.empty()) throw ValueError("generate: the prompt is empty; give at least one token");
  if (static_cast<int64_t>(prompt.size()) > ctx) prompt.erase(prompt.begin(), prompt.end() - ctx);
  Generator gen(options.seed);
  std::vector<int64_t> sequence = prompt, produced;
  KVCache cache;
  Tensor logits;
  auto refill = [&](int64_t keep) {  // (re)start the cache from the last `keep` tokens
    cache = model.make_cache(1, std::min<int64_t>(ctx, static_cast<int64_t>(sequence.size()) + options.max_new_tokens));
    const std::vector<int64_t> window(sequence.end() - keep, sequence.end());
    logits = model.forward_cached(window, 1, keep, cache);
  };
  if (options.use_cache) refill(static_cast<int64_t>(sequence.size()));
  const int64_t switch_length = model.rotation_switch();  // crossing it, the whole sequence is encoded again
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    if (!options.use_cache) {  // the book's loop: the whole (cropped) sequence every time
      const int64_t T = std::min<int64_t>(static_cast<int64_t>(sequence.size()), ctx);
      const std::vector<int64_t> window(sequence.end() - T, sequence.end());
      const Tensor all = model.forward(window, 1, T);
      logits = Tensor::from(std::span<const float>(all.data() + (T - 1) * V, static_cast<size_t>(V)), {1, V});
    }
    const int64_t token = sample_token(logits.data(), options.vocab_limit > 0 ? std::min(V, options.vocab_limit) : V, options, gen);
    produced.push_back(token);
    sequence.push_back(token);
    if (on_token) on_token(token);
    if (token == options.stop_token ||
        std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) != options.stop_tokens.end())
      break;
    if (options.use_cache && n + 1 < options.max_new_tokens) {
      if (cache.length + 1 > cache.capacity) refill(std::max<int64_t>(1, ctx / 2));
      else if (cache.length == switch_length) refill(std::min<int64_t>(static_cast<int64_t>(sequence.size()), ctx));
      else logits = model.forward_cached(std::vector<int64_t>{token}, 1, 1, cache);
    }
  }
  return produced;
}

}  // namespace qkv::nn
