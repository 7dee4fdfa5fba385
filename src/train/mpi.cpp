// The MPI communicator (see qkv/train/communicator.hpp). Sums are deterministic: every element is added in rank
// order by the rank that owns its shard — the same bits for a given world size, whatever MPI's own reduction
// algorithms would choose. Built only when CMake finds MPI; otherwise make_mpi_communicator says so.
#include "qkv/train/communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <deque>
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
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
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
    ordered_sum(values, n, MPI_DOUBLE);
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
  // A deterministic all-reduce by shards: each piece of the buffer is cut into one shard per rank; every rank
  // sends shard r to rank r (MPI_Alltoall), rank r adds the N copies of its shard in rank order, and the summed
  // shards are gathered back everywhere (MPI_Allgather). Each rank moves 2·(N−1)/N of the buffer and does 1/N of
  // the adding — half of what gathering everything to rank 0 costs with two ranks — and the order of the
  // additions is fixed, so the bits do not depend on MPI's algorithms.
  // (float32 buffers go through the queue below, the same scheme as non-blocking collectives; this serves doubles)
  template <typename T>
  void ordered_sum(T* values, int64_t n, MPI_Datatype type) {
    if (size_ == 1 || n == 0) return;
    constexpr int64_t kShard = int64_t{1} << 20;  // floats per shard (4 MiB): bounded scratch, large messages
    const int64_t piece = kShard * size_;
    std::vector<T> received(static_cast<size_t>(piece)), mine(static_cast<size_t>(kShard));
    for (int64_t first = 0; first < n; first += piece) {
      const int64_t count = std::min(piece, n - first);
      const int shard = static_cast<int>((count + size_ - 1) / size_);  // the last piece may be short: pad
      T* data = values + first;
      std::vector<T> padded;
      if (static_cast<int64_t>(shard) * size_ != count) {
        padded.assign(static_cast<size_t>(shard) * size_, T(0));
        std::copy_n(data, count, padded.data());
      }
      T* send = padded.empty() ? data : padded.data();
      MPI_Alltoall(send, shard, type, received.data(), shard, type, MPI_COMM_WORLD);
      add_in_rank_order(received.data(), mine.data(), shard);
      MPI_Allgather(mine.data(), shard, type, send, shard, type, MPI_COMM_WORLD);
      if (!padded.empty()) std::copy_n(padded.data(), count, data);
    }
  }
  // mine = ((copy 0 + copy 1) + copy 2) + …: the N received copies of this rank's shard, in rank order.
  void add_in_rank_order(const float* received, float* mine, int shard) const {
    std::copy_n(received, shard, mine);
    for (int r = 1; r < size_; ++r) kernels::accumulate(mine, received + static_cast<size_t>(r) * shard, shard);
  }
  void add_in_rank_order(const double* received, double* mine, int shard) const {
    std::copy_n(received, shard, mine);
    for (int r = 1; r < size_; ++r)
      for (int i = 0; i < shard; ++i) mine[i] += received[static_cast<size_t>(r) * shard + i];
  }
  // ---- the queue of overlapped sums: ordered_sum's two phases per piece as non-blocking collectives ----
  struct Job {
    float* values;
    int64_t n;
    bool bf16;
  };
  std::deque<Job> queue_;
  int phase_ = 0;          // of the head job's current piece: 0 not started, 1 exchanging shards, 2 gathering sums
  int64_t first_ = 0;      // the piece's first value
  int64_t count_ = 0;      // values in the piece
  int shard_ = 0;          // values per rank's shard (the piece padded to a multiple of the ranks)
  bool in_place_ = false;  // the piece is sent from and gathered into the values themselves
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::vector<float> send_, received_, mine_;  // float32 pieces
  std::vector<uint16_t> send_h_, received_h_, mine_h_;  // the same as bf16

  // Moves the head job on as far as its requests allow (with `block`, waits for each).
  void advance(bool block) {
    constexpr int64_t kShard = int64_t{1} << 20;
    while (!queue_.empty()) {
      Job& job = queue_.front();
      if (phase_ == 0) {
        count_ = std::min(kShard * size_, job.n - first_);
        shard_ = static_cast<int>((count_ + size_ - 1) / size_);
        const size_t padded = static_cast<size_t>(shard_) * static_cast<size_t>(size_);
        // A whole piece goes from and comes back into the values themselves; a short last one through a padded copy.
        in_place_ = static_cast<int64_t>(padded) == count_ && !job.bf16;
        if (!in_place_ && !job.bf16) {
          send_.assign(padded, 0.0f);
          std::copy_n(job.values + first_, count_, send_.data());
        }
        received_.resize(padded);
        mine_.resize(static_cast<size_t>(shard_));
        if (job.bf16) {  // rounded straight from the values (the padding is zeros)
          send_h_.assign(padded, 0);
          received_h_.resize(padded);
          kernels::f32_to_bf16(job.values + first_, send_h_.data(), count_);
          MPI_Ialltoall(send_h_.data(), shard_, MPI_UINT16_T, received_h_.data(), shard_, MPI_UINT16_T, MPI_COMM_WORLD, &request_);
        } else {
          MPI_Ialltoall(in_place_ ? job.values + first_ : send_.data(), shard_, MPI_FLOAT, received_.data(), shard_, MPI_FLOAT,
                        MPI_COMM_WORLD, &request_);
        }
        phase_ = 1;
      }
      if (!done(block)) return;
      if (phase_ == 1) {  // this rank's shard from every rank: summed in rank order, sent back to all
        if (job.bf16) kernels::bf16_to_f32(received_h_.data(), received_.data(), static_cast<int64_t>(received_.size()));
        add_in_rank_order(received_.data(), mine_.data(), shard_);
        if (job.bf16) {
          mine_h_.resize(mine_.size());
          kernels::f32_to_bf16(mine_.data(), mine_h_.data(), shard_);
          MPI_Iallgather(mine_h_.data(), shard_, MPI_UINT16_T, send_h_.data(), shard_, MPI_UINT16_T, MPI_COMM_WORLD, &request_);
        } else {
          MPI_Iallgather(mine_.data(), shard_, MPI_FLOAT, in_place_ ? job.values + first_ : send_.data(), shard_, MPI_FLOAT,
                         MPI_COMM_WORLD, &request_);
        }
        phase_ = 2;
        if (!done(block)) return;
      }
      // phase 2 done: every shard's sum is here
      if (job.bf16) kernels::bf16_to_f32(send_h_.data(), job.values + first_, count_);
      else if (!in_place_) std::copy_n(send_.data(), count_, job.values + first_);
      phase_ = 0;
      first_ += count_;
      if (first_ >= job.n) {
        queue_.pop_front();
        first_ = 0;
      }
    }
  }
  bool done(bool block) {
    if (block) {
      MPI_Wait(&request_, MPI_STATUS_IGNORE);
      return true;
    }
    int flag = 0;
    MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
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
