// The MPI communicator (see qkv/train/communicator.hpp). Sums are deterministic: each chunk is gathered to rank 0,
// added there in rank order, and broadcast back — the same bits for a given world size, whatever MPI's own
// reduction algorithms would choose. Built only when CMake finds MPI; otherwise make_mpi_communicator says so.
#include "qkv/train/communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "qkv/core/error.hpp"

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
  void sum(float* values, int64_t n) override { ordered_sum(values, n, MPI_FLOAT); }
  void sum(double* values, int64_t n) override { ordered_sum(values, n, MPI_DOUBLE); }
  bool any(bool flag) override {
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

 private:
  template <typename T>
  void ordered_sum(T* values, int64_t n, MPI_Datatype type) {
    if (size_ == 1 || n == 0) return;
    constexpr int64_t kChunk = int64_t{1} << 20;  // 4 MiB of floats per round: bounded extra memory on rank 0
    std::vector<T> gathered(rank_ == 0 ? static_cast<size_t>(kChunk * size_) : 0);
    for (int64_t first = 0; first < n; first += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, n - first));
      T* chunk = values + first;
      MPI_Gather(chunk, count, type, gathered.data(), count, type, 0, MPI_COMM_WORLD);
      if (rank_ == 0) {
        for (int r = 1; r < size_; ++r) {  // rank order: ((v0 + v1) + v2) + …
          const T* other = gathered.data() + static_cast<size_t>(r) * count;
          for (int i = 0; i < count; ++i) chunk[i] += other[i];
        }
      }
      MPI_Bcast(chunk, count, type, 0, MPI_COMM_WORLD);
    }
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
