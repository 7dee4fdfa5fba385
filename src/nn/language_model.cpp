// What LanguageModel's users share (see qkv/nn/language_model.hpp): the cache's size and the plain loss.
#include "qkv/nn/language_model.hpp"

#include <algorithm>

#include "qkv/core/ops.hpp"

namespace qkv::nn {

int64_t KVCache::bytes() const {
  int64_t total = 0;
  for (const KVCacheLayer& layer : layers)
    for (const Tensor* t : {&layer.keys, &layer.values})
      if (t->defined())  // a latent-attention layer's one buffer is its keys and its values (values undefined)
        total += t->numel() * (t->dtype() == DType::BF16 ? 2 : static_cast<int64_t>(sizeof(float)));
  return total;
}

void check_token_batch(std::span<const int64_t> ids, int64_t batch, int64_t tokens, const char* who) {
  if (batch <= 0 || tokens <= 0 || batch * tokens != static_cast<int64_t>(ids.size())) {
    throw ShapeError(std::string(who) + ": " + std::to_string(ids.size()) + " token ids do not form a (" +
                     std::to_string(batch) + ", " + std::to_string(tokens) + ") batch");
  }
}

Tensor gather_attention_maps(int64_t L, int64_t H, int64_t T, std::vector<int64_t> layers, std::vector<int64_t> heads,
                             const std::function<void(int64_t, AttentionStep::Record&)>& run_layer,
                             const std::function<Tensor(int64_t, const AttentionStep::Record&, int64_t)>& weights) {
  auto all = [](int64_t n) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
    return v;
  };
  if (layers.empty()) layers = all(L);
  if (heads.empty()) heads = all(H);
  for (int64_t l : layers)
    if (l < 0 || l >= L) throw ValueError("attention maps: layer " + std::to_string(l + 1) + " does not exist; the model has layers 1…" + std::to_string(L));
  for (int64_t h : heads)
    if (h < 0 || h >= H) throw ValueError("attention maps: head " + std::to_string(h + 1) + " does not exist; the model has heads 1…" + std::to_string(H));
  const int64_t last = *std::max_element(layers.begin(), layers.end());
  std::vector<AttentionStep::Record> records(static_cast<size_t>(last + 1));
  for (int64_t i = 0; i <= last; ++i) run_layer(i, records[static_cast<size_t>(i)]);
  Tensor maps = Tensor::empty({static_cast<int64_t>(layers.size()), static_cast<int64_t>(heads.size()), T, T});
  for (size_t li = 0; li < layers.size(); ++li)
    for (size_t hi = 0; hi < heads.size(); ++hi) {
      const Tensor w = weights(layers[li], records[static_cast<size_t>(layers[li])], heads[hi]);
      std::copy_n(w.data(), T * T, maps.data() + (li * heads.size() + hi) * T * T);
    }
  return maps;
}

Tensor language_model_loss(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index) {
  if (logits.rank() != 3) throw ShapeError("language_model_loss: logits must be (B, T, V), got " + logits.shape().str());
  return cross_entropy(reshape(logits, {logits.size(0) * logits.size(1), logits.size(2)}), targets, ignore_index);
}

}  // namespace qkv::nn
