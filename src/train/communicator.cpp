// The single-process communicator and how a process learns it runs under mpirun (see qkv/train/communicator.hpp).
#include "qkv/train/communicator.hpp"

#include <cstdlib>

#include "qkv/core/error.hpp"
#include "qkv/kernels/convert.hpp"

namespace qkv::train {

void Communicator::enqueue_sum(float* values, int64_t n, bool bf16) {
  // Rounded as the exchange would round them: every rank's values, then the sum.
  auto round = [&] {
    for (int64_t i = 0; i < n; ++i) values[i] = kernels::bf16_to_f32_reference(kernels::f32_to_bf16_reference(values[i]));
  };
  if (bf16) round();
  sum(values, n);
  if (bf16) round();
}

void SingleProcess::agree(const std::string& problem) {
  if (!problem.empty()) throw CollectiveError(problem);
}

void SingleProcess::abort_all(int code) { std::exit(code); }

int launched_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* v = std::getenv(name); v && std::atoi(v) > 0) return std::atoi(v);
  }
  return 1;
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "PMI_SIZE"})
    if (std::getenv(name)) return true;
  return false;
}

}  // namespace qkv::train
