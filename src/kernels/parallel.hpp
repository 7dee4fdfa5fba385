// When a kernel's loop is worth splitting between OpenMP threads (internal to src/kernels/).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// Elements (or multiply-adds) below which a parallel region costs more than it saves: one named grain for
// every elementwise and row loop, instead of a threshold per loop. Measured on the 2-core machines: a
// parallel region costs ~2–5 µs; 32 Ki floats take ~5 µs to stream.
inline constexpr int64_t kParallelGrain = int64_t{1} << 15;

inline bool worth_parallel(int64_t work) { return work > kParallelGrain; }

}  // namespace qkv::kernels
