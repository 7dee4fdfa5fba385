// Byte counts of tensor storage and kernel scratch, so benchmarks and tests can report the extra memory
// an operation needs (current and peak since the last reset). Counting is a relaxed atomic add.
#pragma once

#include <cstdint>

namespace qkv::memory {

int64_t bytes_in_use();
int64_t peak_bytes();
void reset_peak();  // peak := bytes_in_use()

// Tensor blocks of 4 MiB and more may be kept after they are freed and handed out again for the same size, up to
// this many bytes in all (0, the default: none kept). Training sets it (train::Trainer: 2 GiB), where every step
// allocates the same sizes and fresh blocks would cost page faults; a single pass would only hold more memory.
void set_block_cache_limit(int64_t bytes);
int64_t block_cache_limit();

namespace detail {
void on_allocate(int64_t bytes);
void on_free(int64_t bytes);
}  // namespace detail

}  // namespace qkv::memory
