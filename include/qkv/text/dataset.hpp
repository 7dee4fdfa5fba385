// Token windows for next-token training (the book's GPTDatasetV1): input ids[i : i + max_length], target
// the same window shifted by one. Batches are a pure function of (seed, step), so a resumed run sees
// exactly the batches an uninterrupted one would.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace qkv::text {

// The book's GPTDatasetV1: windows of max_length tokens every `stride` tokens, each with its next-token targets
class SlidingWindowDataset {
 public:
  // ValueError if the ids hold no full window (fewer than max_length + 1 tokens) or an argument is < 1.
  SlidingWindowDataset(std::vector<int64_t> ids, int64_t max_length, int64_t stride);
  int64_t size() const { return windows_; }
  int64_t max_length() const { return max_length_; }
  // Window i: max_length inputs and max_length targets.
  void window(int64_t i, int64_t* inputs, int64_t* targets) const;
  const std::vector<int64_t>& ids() const { return ids_; }

 private:
  std::vector<int64_t> ids_;
  int64_t max_length_, stride_, windows_;
};

// A batch of windows: inputs and their next-token targets
struct Batch {
  std::vector<int64_t> inputs, targets;  // (batch × tokens), row-major
  int64_t batch = 0, tokens = 0;  // windows and tokens per window
};

// Batches of windows in a seeded order per epoch (the book's DataLoader with shuffle)
class DataLoader {
 public:
  // Windows are reshuffled every epoch with a generator seeded by (seed, epoch); the last partial batch
  // is dropped. ValueError if the dataset has fewer windows than batch_size.
  DataLoader(const SlidingWindowDataset& data, int64_t batch_size, bool shuffle, uint64_t seed);
  int64_t batches_per_epoch() const { return batches_; }
  Batch batch(int64_t step) const;  // step counts from 0 across epochs

 private:
  std::vector<int64_t> order(int64_t epoch) const;
  const SlidingWindowDataset& data_;
  int64_t batch_size_, batches_;
  bool shuffle_;
  uint64_t seed_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

// The first train_fraction of the tokens for training, the rest for validation (the book's split).
std::pair<std::vector<int64_t>, std::vector<int64_t>> split_tokens(const std::vector<int64_t>& ids, double train_fraction);

}  // namespace qkv::text
