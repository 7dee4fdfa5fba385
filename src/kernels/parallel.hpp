// When a kernel's loop is worth splitting between OpenMP threads (internal to src/kernels/).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// Elements (or multiply-adds) below which a parallel region costs more than it saves: one named grain for
// every elementwise and row loop, instead of a threshold per loop. Measured on the 2-core machines: a
// parallel region costs ~2–5 µs; 32 Ki floats take ~5 µs to stream.
inline constexpr int64_t kParallelGrain = int64_t{1} << 15;

inline bool worth_parallel(int64_t work) { return work > kParallelGrain; }

// body(begin, end) over blocks of 256 values, the blocks split between threads (elementwise maps: GELU, SiLU).
template <typename Body>
void for_blocks(int64_t n, Body&& body) {
  const int64_t blocks = (n + 255) / 256;
#pragma omp parallel for schedule(static) if (worth_parallel(n))
  for (int64_t b = 0; b < blocks; ++b) body(b * 256, b * 256 + 256 < n ? b * 256 + 256 : n);
}

}  // namespace qkv::kernels
