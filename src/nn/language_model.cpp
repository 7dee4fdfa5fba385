// What LanguageModel's users share (see qkv/nn/language_model.hpp): the cache's size and the plain loss.
#include "qkv/nn/language_model.hpp"

#include "qkv/core/ops.hpp"

namespace qkv::nn {

int64_t KVCache::bytes() const {
  int64_t total = 0;
  for (const KVCacheLayer& layer : layers)
    total += (layer.keys.numel() + layer.values.numel()) * static_cast<int64_t>(sizeof(float));
  return total;
}

Tensor language_model_loss(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index) {
  if (logits.rank() != 3) throw ShapeError("language_model_loss: logits must be (B, T, V), got " + logits.shape().str());
  return cross_entropy(reshape(logits, {logits.size(0) * logits.size(1), logits.size(2)}), targets, ignore_index);
}

}  // namespace qkv::nn
