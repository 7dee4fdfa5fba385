// Byte counts of tensor storage and kernel scratch, so benchmarks and tests can report the extra memory
// an operation needs (current and peak since the last reset). Counting is a relaxed atomic add.
#pragma once

#include <cstdint>

namespace qkv::memory {

int64_t bytes_in_use();
int64_t peak_bytes();
void reset_peak();  // peak := bytes_in_use()

namespace detail {
void on_allocate(int64_t bytes);
void on_free(int64_t bytes);
}  // namespace detail

}  // namespace qkv::memory
