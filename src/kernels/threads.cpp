// set_num_threads / num_threads (see qkv/kernels/threads.hpp).
#include "qkv/kernels/threads.hpp"

#include <omp.h>

#include <algorithm>
#include <exception>
#include <mutex>
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

void parallel_for_each(int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  std::exception_ptr first;
  std::mutex lock;
  const int threads = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(n, omp_get_max_threads()));
  auto run = [&](int64_t i) {
    try {
      body(i);
    } catch (...) {  // an exception must not leave an OpenMP region
      const std::lock_guard<std::mutex> hold(lock);
      if (!first) first = std::current_exception();
    }
  };
  if (threads <= 1) {  // no OpenMP region at all (see parallel_for in parallel.hpp)
    for (int64_t i = 0; i < n; ++i) run(i);
  } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run(i);
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace qkv
