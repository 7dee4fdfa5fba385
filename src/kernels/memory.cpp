// Allocation counters (see qkv/kernels/memory.hpp).
#include "qkv/kernels/memory.hpp"

#include <atomic>

namespace qkv::memory {

namespace {
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_block_cache_limit{0};
}  // namespace

void set_block_cache_limit(int64_t bytes) { g_block_cache_limit.store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed); }
int64_t block_cache_limit() { return g_block_cache_limit.load(std::memory_order_relaxed); }

int64_t bytes_in_use() { return g_in_use.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() { g_peak.store(bytes_in_use(), std::memory_order_relaxed); }

namespace detail {
void on_allocate(int64_t bytes) {
  const int64_t now = g_in_use.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
void on_free(int64_t bytes) { g_in_use.fetch_sub(bytes, std::memory_order_relaxed); }
}  // namespace detail

}  // namespace qkv::memory
