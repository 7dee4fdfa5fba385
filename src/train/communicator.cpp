// The single-process communicator and how a process learns it runs under mpirun (see qkv/train/communicator.hpp).
#include "qkv/train/communicator.hpp"

#include <cstdlib>

#include "qkv/core/error.hpp"

namespace qkv::train {

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
