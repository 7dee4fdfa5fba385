// How many threads qkv's kernels use: OpenMP's, which OMP_NUM_THREADS sets at start-up and set_num_threads()
// changes (the CLI's --threads). Results are deterministic for a given number; OpenBLAS stays single-threaded.
#pragma once

namespace qkv {

// n ≥ 1: the threads every later kernel call may use (ValueError otherwise). Not to be called while kernels run.
void set_num_threads(int n);
int num_threads();

}  // namespace qkv
