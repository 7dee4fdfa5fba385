// set_num_threads / num_threads (see qkv/kernels/threads.hpp).
#include "qkv/kernels/threads.hpp"

#include <omp.h>

#include <stdexcept>
#include <string>

namespace qkv {

void set_num_threads(int n) {
  // The kernels layer sits below core's error types; the argument check is the caller's contract here, and the
  // CLI validates --threads before calling.
  if (n < 1) throw std::invalid_argument("set_num_threads: need at least 1 thread, got " + std::to_string(n));
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace qkv
