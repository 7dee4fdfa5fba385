// A thread count that follows the machine: times the steps of a decode loop and runs them on 1 thread while the
// full count is slower (another program holds a core), and on the full count again when it is faster.
// It chooses between the caller's thread count and 1, nothing in between; it measures, it does not guess.
// Not for training or single large products: those keep the count they are given.
#pragma once

#include <cstdint>
#include <unordered_map>

namespace qkv {

// Which thread count each step of a loop runs with, learnt from the steps' times. Each kind of step (a key: for a
// session, the rows a batch feeds) is timed apart, so a long prompt piece is never compared with one token. A kind
// not seen before starts on the count the last switch chose: a prompt after a busy machine sent the decoding steps to
// 1 thread runs on 1 thread too, as it is seen once and could not learn it itself.
// On a quiet machine it stays on the full count and tries 1 thread once in a while (once two steps are timed, then
// ever rarer while 1 thread keeps losing: 2× further each time, 4× when it lost by 30%, down to one in 256); it
// switches when two tries in a row beat the current count by 7%. Results do not depend on the choice: qkv's kernels
// give the same bits on 1 thread as on many, each output row owned by one thread.
class ThreadGovernor {
 public:
  ThreadGovernor() = default;  // learns nothing until its first step
  ~ThreadGovernor();            // a step still under way gets the caller's count back
  ThreadGovernor(const ThreadGovernor&) = delete;             // one governor per loop
  ThreadGovernor& operator=(const ThreadGovernor&) = delete;  // one governor per loop

  // The thread count for the next step of this kind, set for the calling thread's parallel regions until
  // end_step. The full count is the calling thread's OpenMP count at this call (set_num_threads, OMP_NUM_THREADS);
  // when it changes, what was learnt is forgotten. With a full count of 1 it changes nothing.
  int begin_step(int64_t key);
  // The step begun last took this many seconds; the caller's own thread count is set back.
  void end_step(double seconds);
  // The step begun last failed: nothing is learnt from it; the caller's thread count is set back.
  void abandon_step();

  int full() const { return full_; }                // the most threads a step uses (0 before the first step)
  int current(int64_t key) const;                   // the count this kind of step runs with now
  int64_t trials() const { return trials_; }        // steps run on the other count to compare
  int64_t switches() const { return switches_; }    // times a kind of step changed its count

 private:
  struct Kind {
    bool on_one = false;        // runs on 1 thread now
    double typical = 0;         // a running average of this count's step times (seconds)
    int64_t timed = 0;          // steps timed on the current count since it was chosen
    int64_t since_trial = 0;    // steps since the last try of the other count
    int64_t interval = 1;       // steps between tries (the first comes once the count is settled)
    int wins = 0;               // tries in a row that beat the current count
  };
  int full_ = 0;
  std::unordered_map<int64_t, Kind> kinds_;
  Kind* step_ = nullptr;  // the kind of the step under way
  bool trial_ = false;    // the step under way runs on the other count
  bool last_to_one_ = false;  // the last switch of any kind went to 1 thread (unseen kinds start there)
  int64_t trials_ = 0, switches_ = 0;
};

}  // namespace qkv
