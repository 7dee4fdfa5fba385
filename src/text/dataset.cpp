// Sliding windows, deterministic shuffled batches, and the train/validation split.
#include "qkv/text/dataset.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "qkv/core/error.hpp"
#include "qkv/core/random.hpp"

namespace qkv::text {

SlidingWindowDataset::SlidingWindowDataset(std::vector<int64_t> ids, int64_t max_length, int64_t stride)
    : ids_(std::move(ids)), max_length_(max_length), stride_(stride) {
  if (max_length < 1 || stride < 1) throw ValueError("dataset: max_length and stride must be at least 1");
  const int64_t n = static_cast<int64_t>(ids_.size());
  if (n < max_length + 1) {
    throw ValueError("the text has " + std::to_string(n) + " tokens, fewer than one window of " +
                     std::to_string(max_length + 1) + " (the context length " + std::to_string(max_length) +
                     ", plus the last token's target); give a longer text or a smaller context length");
  }
  windows_ = (n - max_length - 1) / stride + 1;
}

void SlidingWindowDataset::window(int64_t i, int64_t* inputs, int64_t* targets) const {
  const int64_t start = i * stride_;
  std::copy_n(ids_.begin() + start, max_length_, inputs);
  std::copy_n(ids_.begin() + start + 1, max_length_, targets);
}

DataLoader::DataLoader(const SlidingWindowDataset& data, int64_t batch_size, bool shuffle, uint64_t seed)
    : data_(data), batch_size_(batch_size), shuffle_(shuffle), seed_(seed) {
  if (batch_size < 1) throw ValueError("batch size must be at least 1");
  batches_ = data.size() / batch_size;
  if (batches_ == 0) {
    throw ValueError("the data holds " + std::to_string(data.size()) + " windows, fewer than one batch of " +
                     std::to_string(batch_size) + "; give more text or a smaller batch size");
  }
}

std::vector<int64_t> DataLoader::order(int64_t epoch) const {
  if (epoch == cached_epoch_) return cached_order_;
  std::vector<int64_t> o(static_cast<size_t>(data_.size()));
  std::iota(o.begin(), o.end(), 0);
  if (shuffle_) {  // Fisher–Yates with a generator of its own: independent of every other random draw
    Generator gen(seed_ * 1000003u + static_cast<uint64_t>(epoch));
    for (int64_t i = static_cast<int64_t>(o.size()) - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(gen.next_u64() % static_cast<uint64_t>(i + 1));
      std::swap(o[static_cast<size_t>(i)], o[static_cast<size_t>(j)]);
    }
  }
  cached_epoch_ = epoch;
  cached_order_ = o;
  return o;
}

Batch DataLoader::batch(int64_t step) const {
  const int64_t epoch = step / batches_, index = step % batches_;
  const std::vector<int64_t> o = order(epoch);
  Batch b;
  b.batch = batch_size_;
  b.tokens = data_.max_length();
  b.inputs.resize(static_cast<size_t>(b.batch * b.tokens));
  b.targets.resize(b.inputs.size());
  for (int64_t r = 0; r < batch_size_; ++r)
    data_.window(o[static_cast<size_t>(index * batch_size_ + r)], b.inputs.data() + r * b.tokens,
                 b.targets.data() + r * b.tokens);
  return b;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> split_tokens(const std::vector<int64_t>& ids, double train_fraction) {
  if (!(train_fraction > 0.0 && train_fraction < 1.0)) throw ValueError("the train fraction must lie in (0, 1)");
  const auto cut = static_cast<size_t>(static_cast<double>(ids.size()) * train_fraction);
  return {std::vector<int64_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(cut)),
          std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(cut), ids.end())};
}

}  // namespace qkv::text
