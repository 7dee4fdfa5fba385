// What data-parallel training needs from the processes it runs in: who am I, how many are we, sum these numbers
// over everyone (the same bits everywhere), and did anyone fail. One process (SingleProcess) or MPI ranks
// (make_mpi_communicator, when qkv is built with MPI). Not here: the training loop (trainer.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "qkv/core/error.hpp"

namespace qkv::train {

// A failure every process knows of (from agree()): each stops on its own; nothing needs aborting.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

// How training processes talk: sums of gradients, agreement on errors. One process (SingleProcess) or MPI
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // This process's number, 0 … size() − 1
  virtual int size() const = 0;  // How many processes train together
  // values ← Σ over ranks, added in rank order (0 + 1 + … + N−1), so every rank gets the same bits and a run is
  // repeatable for a given world size. Collective: every rank calls it with the same n.
  virtual void sum(float* values, int64_t n) = 0;
  virtual void sum(double* values, int64_t n) = 0;
  // Collective: true on every rank if `flag` is true on any.
  virtual bool any(bool flag) = 0;
  // Collective: every rank passes the problem it ran into ("" if none); if any rank has one, every rank throws
  // an Error listing them as "rank N: problem".
  virtual void agree(const std::string& problem) = 0;
  // Ends every process at once after a failure that the others cannot know of (an exception on one rank).
  [[noreturn]] virtual void abort_all(int code) = 0;

  // Sums that overlap other work (the backward). enqueue_sum queues values ← Σ over ranks, the same bits as sum();
  // with `bf16` each rank's values travel rounded to bf16 and their float32 sum (in rank order) comes back rounded
  // to bf16: half the bytes, the same result on every rank. A queued sum starts when the ones before it are done, so
  // every rank sends the same messages in the same order. progress() advances the queue without waiting;
  // finish_sums() waits until every queued sum is done; `values` must stay put until then. Collective: every rank
  // queues the same sums (sizes, order, precision). This default does each sum at once.
  virtual void enqueue_sum(float* values, int64_t n, bool bf16);
  virtual void progress() {}
  virtual void finish_sums() {}
};

// Training in one process: sums are the values themselves
class SingleProcess : public Communicator {
 public:
  // Always 0
  int rank() const override { return 0; }
  // Always 1
  int size() const override { return 1; }
  void sum(float*, int64_t) override {}
  void sum(double*, int64_t) override {}
  bool any(bool flag) override { return flag; }
  void agree(const std::string& problem) override;
  [[noreturn]] void abort_all(int code) override;
};

// Whether this process was started by mpirun/mpiexec (Open MPI's or MPICH's environment variables).
bool launched_by_mpi();
// The number of ranks mpirun started, from the environment (1 if not under mpirun).
int launched_world_size();
// Whether this qkv was built with MPI (find_package(MPI) found it).
bool built_with_mpi();
// MPI_COMM_WORLD, after MPI_Init; IoError if qkv was built without MPI.
std::unique_ptr<Communicator> make_mpi_communicator(int* argc, char*** argv);

}  // namespace qkv::train
