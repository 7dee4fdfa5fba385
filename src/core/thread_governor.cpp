// ThreadGovernor (qkv/core/thread_governor.hpp): per kind of step, the current count's typical time and, now and
// then, one step on the other count to compare. Why tries and not a load reading: /proc/loadavg and sched_getaffinity
// say nothing about whether the other program yields quickly, and only the step's own time says what it costs.
#include "qkv/core/thread_governor.hpp"

#include <omp.h>

#include <algorithm>

namespace qkv {

namespace {

// The first try comes early: on a busy machine every step before the switch runs at half speed or worse, and on a
// quiet one a lost try backs off fast (below). After a switch the count just left is tried again later.
constexpr int64_t kAfterSwitch = 16;     // steps between a switch and the next try
constexpr int64_t kLongestInterval = 256;
constexpr int64_t kSettle = 2;           // steps timed on a count before it is compared
constexpr double kMargin = 0.93;         // a try must take at most this share of the typical time…
constexpr double kClearLoss = 1.3;       // a try this much slower backs off four times as far, not twice
constexpr int kWinsToSwitch = 2;         // …this many times in a row
constexpr double kAverageWeight = 0.2;   // of a new step in the running average
constexpr size_t kMostKinds = 1024;      // kinds remembered (a session's are row counts up to max_batch_tokens)

}  // namespace

ThreadGovernor::~ThreadGovernor() {
  if (step_ != nullptr) omp_set_num_threads(full_);
}

int ThreadGovernor::current(int64_t key) const {
  const auto it = kinds_.find(key);
  return (it != kinds_.end() ? it->second.on_one : last_to_one_) ? 1 : full_;
}

int ThreadGovernor::begin_step(int64_t key) {
  step_ = nullptr;
  trial_ = false;
  const int full = omp_get_max_threads();
  if (full != full_) {
    full_ = full;
    kinds_.clear();
    last_to_one_ = false;
  }
  if (full_ <= 1) return 1;
  if (kinds_.size() >= kMostKinds && kinds_.find(key) == kinds_.end()) kinds_.clear();
  const auto [at, unseen] = kinds_.try_emplace(key);
  Kind& kind = at->second;
  if (unseen) kind.on_one = last_to_one_;
  step_ = &kind;
  // A try after the interval, and at once after a try that won (a second one confirms it before switching).
  trial_ = kind.timed >= kSettle && (kind.wins > 0 || kind.since_trial >= kind.interval);
  const int threads = kind.on_one != trial_ ? 1 : full_;
  omp_set_num_threads(threads);
  return threads;
}

void ThreadGovernor::abandon_step() {
  if (step_ == nullptr) return;
  step_ = nullptr;
  omp_set_num_threads(full_);
}

void ThreadGovernor::end_step(double seconds) {
  if (step_ == nullptr) return;
  Kind& kind = *step_;
  step_ = nullptr;
  omp_set_num_threads(full_);
  if (!trial_) {
    kind.typical = kind.timed == 0 ? seconds : (1 - kAverageWeight) * kind.typical + kAverageWeight * seconds;
    ++kind.timed;
    ++kind.since_trial;
    return;
  }
  ++trials_;
  kind.since_trial = 0;
  if (seconds >= kMargin * kind.typical) {  // the current count stays; try less often
    kind.wins = 0;
    kind.interval = std::min(kind.interval * (seconds > kClearLoss * kind.typical ? 4 : 2), kLongestInterval);
    return;
  }
  if (++kind.wins < kWinsToSwitch) return;
  kind.on_one = !kind.on_one;
  last_to_one_ = kind.on_one;
  kind.typical = seconds;
  kind.timed = 1;
  kind.wins = 0;
  kind.interval = kAfterSwitch;
  ++switches_;
}

}  // namespace qkv
