// The MPI communicator (see qkv/train/communicator.hpp). Sums are deterministic: every element is added in rank
// order by the rank that owns its shard — the same bits for a given world size, whatever MPI's own reduction
// algorithms would choose. Built only when CMake finds MPI; otherwise make_mpi_communicator says so.
#include "qkv/train/communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <type_traits>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/elementwise.hpp"

#ifdef QKV_HAVE_MPI
#include <mpi.h>
#endif

namespace qkv::train {

#ifdef QKV_HAVE_MPI

namespace {

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    if (!finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void sum(float* values, int64_t n) override {
    enqueue_sum(values, n, false);  // behind any sums already queued: collectives in queue order
    finish_sums();
  }
  void sum(double* values, int64_t n) override {
    finish_sums();
    ordered_sum(values, n);
  }
  bool any(bool flag) override {
    finish_sums();
    int mine = flag ? 1 : 0, all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return all != 0;
  }
  void agree(const std::string& problem) override {
    // Everyone learns every rank's message (fixed width, cut if long).
    constexpr int kWidth = 512;
    std::vector<char> mine(kWidth, 0), all(static_cast<size_t>(kWidth) * size_, 0);
    std::copy_n(problem.data(), std::min<size_t>(problem.size(), kWidth - 1), mine.data());
    MPI_Allgather(mine.data(), kWidth, MPI_CHAR, all.data(), kWidth, MPI_CHAR, MPI_COMM_WORLD);
    std::string report;
    for (int r = 0; r < size_; ++r) {
      const char* text = all.data() + static_cast<size_t>(r) * kWidth;
      if (*text) report += (report.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + text;
    }
    if (!report.empty()) throw CollectiveError(report);
  }
  [[noreturn]] void abort_all(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::exit(code);
  }
  void enqueue_sum(float* values, int64_t n, bool bf16) override {
    if (size_ == 1 || n == 0) return;
    queue_.push_back({values, n, bf16});
    advance(false);
  }
  void progress() override { advance(false); }
  void finish_sums() override {
    while (!queue_.empty()) advance(true);
  }

 private:
  // Small sums (the step's loss): every rank gathers every rank's values and adds them in rank order.
  void ordered_sum(double* values, int64_t n) {
    if (size_ == 1 || n == 0) return;
    std::vector<double> all(static_cast<size_t>(n) * static_cast<size_t>(size_));
    MPI_Allgather(values, static_cast<int>(n), MPI_DOUBLE, all.data(), static_cast<int>(n), MPI_DOUBLE, MPI_COMM_WORLD);
    std::copy_n(all.data(), n, values);
    for (int r = 1; r < size_; ++r)
      for (int64_t i = 0; i < n; ++i) values[i] += all[static_cast<size_t>(r) * static_cast<size_t>(n) + static_cast<size_t>(i)];
  }
  // ---- the queue of overlapped sums ----
  // A queued sum goes by pieces of up to kPiece values, each cut into one shard per rank (shard q: values
  // [first + q·count/N, first + (q+1)·count/N)). Phase 1: every rank sends each other rank that rank's shard and
  // receives its own shard's copies; it adds the N copies in rank order into its own values. Phase 2: it sends that
  // sum to every other rank and receives theirs straight into its values. Only other ranks' shards move — nothing is
  // copied to itself or padded — and pieces are large, so a sum is a few messages that the backward's progress()
  // calls can move along (4 MiB pieces left most of the exchange for after the backward).
  static constexpr int64_t kPiece = int64_t{1} << 24;  // values (64 MiB of float32)
  static constexpr int kTag = 1;
  struct Job {
    float* values;
    int64_t n;
    bool bf16;
  };
  std::deque<Job> queue_;
  int phase_ = 0;      // of the head job's current piece: 0 not started, 1 exchanging copies, 2 exchanging sums
  int64_t first_ = 0;  // the piece's first value
  int64_t count_ = 0;  // values in the piece
  int64_t stride_ = 0;  // values between two ranks' slots in the receive buffers: the longest shard
  std::vector<MPI_Request> requests_;
  std::vector<float> received_;                     // the other ranks' copies of this rank's shard
  std::vector<uint16_t> send_h_, received_h_, mine_h_;  // bf16: the piece rounded, what arrives, this rank's sum
  MPI_Comm comm_ = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: these messages never meet anyone else's

  int64_t shard_begin(int q) const { return first_ + q * count_ / size_; }
  int shard_size(int q) const { return static_cast<int>(shard_begin(q + 1) - shard_begin(q)); }
  int64_t slot(int q) const { return (q < rank_ ? q : q - 1) * stride_; }  // a rank's place in the receive buffers

  // Moves the head job on as far as its messages allow (with `block`, waits for each).
  void advance(bool block) {
    while (!queue_.empty()) {
      Job& job = queue_.front();
      if (phase_ == 0) {
        count_ = std::min(kPiece, job.n - first_);
        stride_ = (count_ + size_ - 1) / size_;
        const size_t others = static_cast<size_t>(stride_) * static_cast<size_t>(size_ - 1);
        requests_.clear();
        if (job.bf16) {  // every rank's values travel rounded (its own too, below)
          send_h_.resize(static_cast<size_t>(count_));
          received_h_.resize(others);
          kernels::f32_to_bf16(job.values + first_, send_h_.data(), count_);
        }
        received_.resize(others);
        const int own_size = shard_size(rank_);
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) continue;
          const int64_t at = shard_begin(q) - first_;
          if (job.bf16) exchange(q, received_h_.data() + slot(q), own_size, send_h_.data() + at, shard_size(q));
          else exchange(q, received_.data() + slot(q), own_size, job.values + first_ + at, shard_size(q));
        }
        phase_ = 1;
      }
      if (!done(block)) return;
      float* own = job.values + shard_begin(rank_);
      const int mine = shard_size(rank_);
      if (phase_ == 1) {  // every copy of this rank's shard is here: their sum, in rank order, goes to every rank
        if (job.bf16) {
          kernels::bf16_to_f32(received_h_.data(), received_.data(), static_cast<int64_t>(received_.size()));
          kernels::bf16_to_f32(send_h_.data() + (shard_begin(rank_) - first_), own, mine);
        }
        add_in_rank_order(own, mine);
        requests_.clear();
        if (job.bf16) {  // the sum rounded, here too, so every rank holds the same bits
          mine_h_.resize(static_cast<size_t>(mine));
          kernels::f32_to_bf16(own, mine_h_.data(), mine);
          kernels::bf16_to_f32(mine_h_.data(), own, mine);
        }
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) continue;
          if (job.bf16) exchange(q, received_h_.data() + slot(q), shard_size(q), mine_h_.data(), mine);
          else exchange(q, job.values + shard_begin(q), shard_size(q), own, mine);
        }
        phase_ = 2;
        if (!done(block)) return;
      }
      // phase 2 done: every shard's sum is here
      if (job.bf16) {
        for (int q = 0; q < size_; ++q)
          if (q != rank_) kernels::bf16_to_f32(received_h_.data() + slot(q), job.values + shard_begin(q), shard_size(q));
      }
      phase_ = 0;
      first_ += count_;
      if (first_ >= job.n) {
        queue_.pop_front();
        first_ = 0;
      }
    }
  }
  // Posts a receive of `in_n` values from rank q into `in` and a send of `out_n` values from `out` to it.
  template <typename T>
  void exchange(int q, T* in, int in_n, const T* out, int out_n) {
    const MPI_Datatype type = std::is_same_v<T, float> ? MPI_FLOAT : MPI_UINT16_T;
    requests_.emplace_back();
    MPI_Irecv(in, in_n, type, q, kTag, comm_, &requests_.back());
    requests_.emplace_back();
    MPI_Isend(out, out_n, type, q, kTag, comm_, &requests_.back());
  }
  // own ← copy 0 + copy 1 + … + copy N−1, added left to right (own is this rank's copy; float addition of two
  // values is commutative bit for bit, so acc + own is computed as own += acc).
  void add_in_rank_order(float* own, int n) {
    auto copy = [&](int q) { return received_.data() + slot(q); };
    if (rank_ > 0) {
      float* acc = copy(0);
      for (int q = 1; q < rank_; ++q) kernels::accumulate(acc, copy(q), n);
      kernels::accumulate(own, acc, n);
    }
    for (int q = rank_ + 1; q < size_; ++q) kernels::accumulate(own, copy(q), n);
  }
  bool done(bool block) {
    if (block) {
      MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
      return true;
    }
    int flag = 0;
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE);
    return flag != 0;
  }

  int rank_ = 0, size_ = 1;
};

}  // namespace

bool built_with_mpi() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);  // OpenMP threads never call MPI
  }
  return std::make_unique<MpiCommunicator>();
}

#else

bool built_with_mpi() { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(int*, char***) {
  throw IoError("this qkv was built without MPI, so it cannot train across processes; install Open MPI "
                "(apt-get install libopenmpi-dev openmpi-bin) and rebuild, or run without mpirun");
}

#endif

}  // namespace qkv::train
