// When a kernel's loop is worth splitting between OpenMP threads (internal to src/kernels/).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// Elements (or multiply-adds) below which a parallel region costs more than it saves: one named grain for
// every elementwise and row loop, instead of a threshold per loop. Measured on the 2-core machines: a
// parallel region costs ~2–5 µs; 32 Ki floats take ~5 µs to stream.
inline constexpr int64_t kParallelGrain = int64_t{1} << 15;

inline bool worth_parallel(int64_t work) { return work > kParallelGrain; }

// body(i) for every i in [0, count): split between the threads (static schedule) when `parallel`, else a plain loop on
// the calling thread. Not `#pragma omp parallel for if (parallel)`: for a false `if`, libgomp still opens a region of
// one thread, which cost 1.3–1.6 µs and a futex system call each on the dev VM (0.08 µs the loop alone) — ~375 of
// them in every token a Qwen3-0.6B generates (its norms, copies, RoPE, residual adds, SiLU).
template <typename Body>
void parallel_for(int64_t count, bool parallel, Body&& body) {
  if (!parallel) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) body(i);
}

// body(begin, end) over blocks of 256 values, the blocks split between threads (elementwise maps: GELU, SiLU).
template <typename Body>
void for_blocks(int64_t n, Body&& body) {
  const int64_t blocks = (n + 255) / 256;
  parallel_for(blocks, worth_parallel(n), [&](int64_t b) { body(b * 256, b * 256 + 256 < n ? b * 256 + 256 : n); });
}

}  // namespace qkv::kernels
