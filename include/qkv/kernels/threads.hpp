// How many threads qkv's kernels use: OpenMP's, which OMP_NUM_THREADS sets at start-up and set_num_threads()
// changes (the CLI's --threads). Results are deterministic for a given number; OpenBLAS stays single-threaded.
#pragma once

#include <cstdint>
#include <functional>

namespace qkv {

// n ≥ 1: the threads every later kernel call may use (ValueError otherwise). Not to be called while kernels run.
void set_num_threads(int n);
int num_threads();

// body(i) for every i < n, each index on one thread, handed out one at a time (items of unequal work), the kernels a
// body calls running on its thread alone. The first exception a body throws is rethrown once all have ended. For items
// that own their outputs: a batch's sequences, each attending over its own keys.
void parallel_for_each(int64_t n, const std::function<void(int64_t)>& body);

}  // namespace qkv
