// The block allocator and its counters (see qkv/kernels/memory.hpp).
#include "qkv/kernels/memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

namespace qkv::memory {

namespace {
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_block_cache_limit{0};
std::atomic<int64_t> g_fresh_blocks{0};

void on_allocate(int64_t bytes) {
  const int64_t now = g_in_use.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
void on_free(int64_t bytes) { g_in_use.fetch_sub(bytes, std::memory_order_relaxed); }

// Blocks of at least kMapBytes come straight from the kernel (mmap) and go straight back (munmap). Through malloc
// they would not: glibc raises its mmap threshold each time such a block is freed, so later ones land on the heap,
// and freed heap memory stays in the process — qkv apply's peak RSS at T = 4096 went from 163 to 207 MiB on some
// runs and not others. They are asked for transparent huge pages: GPT-2 B8T256 training measured 275 against
// 264 tok/s without (medians of 3, interleaved).
// Under AddressSanitizer (GCC's macro, clang's feature test) every block goes through operator new, so its bounds
// stay checked.
#if defined(__SANITIZE_ADDRESS__)
#define QKV_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QKV_ASAN 1
#endif
#endif
#ifdef QKV_ASAN
constexpr bool kMapLargeBlocks = false;
#else
constexpr bool kMapLargeBlocks = true;
#endif
constexpr size_t kMapBytes = size_t{4} << 20;
bool mapped(size_t bytes) { return kMapLargeBlocks && bytes >= kMapBytes; }

void* system_block(size_t bytes) {
  if (!mapped(bytes)) return ::operator new[](bytes, std::align_val_t(64), std::nothrow);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  ::madvise(p, bytes, MADV_HUGEPAGE);  // fewer faults and TLB misses; a hint, so a refusal changes nothing
  return p;
}
void release_system_block(void* p, size_t bytes) {
  if (mapped(bytes)) {
    ::munmap(p, bytes);
  } else {
    ::operator delete[](p, std::align_val_t(64));
  }
}

// Freed blocks kept by exact size while memory::block_cache_limit allows: a training step allocates the same sizes
// step after step, and a fresh block of hundreds of MiB costs a page fault per 4 KiB page on first touch (the kernel
// zeroes each one). Off by default: a single forward and backward (qkv apply) would only hold more memory (268 →
// 362 MiB at T = 4096, measured before the backward pass learned to write first gradients in place). It lives until
// the process ends (never destroyed, so a block freed by a static destructor still finds it; what it holds stays
// reachable, not leaked).
class BlockCache {
 public:
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(bytes);
    if (it == blocks_.end()) return nullptr;
    void* p = it->second;
    blocks_.erase(it);
    held_ -= bytes;
    return p;
  }
  // Keeps p unless that would hold more than `limit`; with `evict`, the largest blocks held go first to make room
  // (the sizes a program frees last are the ones it asks for next).
  bool give(void* p, size_t bytes, size_t limit, bool evict = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (evict && bytes <= limit) release_largest(limit - bytes);
    if (held_ + bytes > limit) return false;
    blocks_.emplace(bytes, p);
    held_ += bytes;
    return true;
  }
  // Frees the largest blocks until at most `limit` bytes are held.
  void trim(size_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    release_largest(limit);
  }

 private:
  void release_largest(size_t limit) {  // with mutex_ held
    while (held_ > limit && !blocks_.empty()) {
      auto last = std::prev(blocks_.end());
      release_system_block(last->second, last->first);
      held_ -= last->first;
      blocks_.erase(last);
    }
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> blocks_;
  size_t held_ = 0;
};
BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache;
  return *cache;
}

// Blocks under kMapBytes come from operator new, that is glibc, which maps any block above its mmap threshold (128 KiB
// at first, raised to the size of each mapped block freed) straight from the kernel and unmaps it when freed, and
// trims the heap's top beyond twice that threshold. A forward pass allocates and frees activations of hundreds of KiB
// to a few MiB in every layer, so they were faulted in afresh, 4 KiB at a time, for as long as the threshold had not
// been raised past them — which depended on what the program had happened to free before: a 512-token prompt on a
// Q4_0 Qwen3-0.6B took 130k page faults and ran at 100-125 tok/s, or 55k faults and 140 tok/s after a load that had
// freed one 5 MB vector. Freed medium blocks are therefore kept here, by exact size, up to kMediumCacheBytes, and
// handed out again: after the first pass no fault, whatever came before. (Not under AddressSanitizer, whose
// use-after-free checks need every block given back.)
constexpr size_t kMediumBytes = size_t{64} << 10;  // blocks from this size to kMapBytes
constexpr size_t kMediumCacheBytes = size_t{32} << 20;
bool medium(size_t bytes) { return kMapLargeBlocks && bytes >= kMediumBytes && bytes < kMapBytes; }
BlockCache& medium_cache() {
  static BlockCache* cache = new BlockCache;
  return *cache;
}
}  // namespace

void set_block_cache_limit(int64_t bytes) {
  g_block_cache_limit.store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed);
  block_cache().trim(static_cast<size_t>(block_cache_limit()));
}
int64_t block_cache_limit() { return g_block_cache_limit.load(std::memory_order_relaxed); }
void cache_blocks_for_steps(int64_t floor) {
  const int64_t wanted = std::max(floor, peak_bytes());
  if (wanted > block_cache_limit()) set_block_cache_limit(wanted);
}
int64_t fresh_blocks() { return g_fresh_blocks.load(std::memory_order_relaxed); }

int64_t bytes_in_use() { return g_in_use.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() { g_peak.store(bytes_in_use(), std::memory_order_relaxed); }

void* allocate_block(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void* p = medium(bytes) ? medium_cache().take(bytes) : nullptr;
  if (!p && block_cache_limit() > 0) p = block_cache().take(bytes);
  if (!p) {
    p = system_block(bytes);
    if (!p) return nullptr;
    g_fresh_blocks.fetch_add(1, std::memory_order_relaxed);
  }
  on_allocate(static_cast<int64_t>(bytes));
  return p;
}

void free_block(void* p, size_t bytes) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  on_free(static_cast<int64_t>(bytes));
  if (medium(bytes) && medium_cache().give(p, bytes, kMediumCacheBytes, /*evict=*/true)) return;
  const int64_t limit = block_cache_limit();
  if (limit <= 0 || !block_cache().give(p, bytes, static_cast<size_t>(limit))) release_system_block(p, bytes);
}

size_t huge_pages_length(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  return bytes > SIZE_MAX - 2 * kHuge ? 0 : (bytes + kHuge - 1) / kHuge * kHuge;
}

void* map_huge_pages(size_t bytes, bool reserve_only) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t length = huge_pages_length(bytes);
  if (length == 0) return nullptr;
  // One huge page more is mapped; what lies before and after the aligned range is given back.
  void* raw = ::mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | (reserve_only ? MAP_NORESERVE : 0), -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw), aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) ::munmap(raw, aligned - start);
  if (start + kHuge > aligned) ::munmap(reinterpret_cast<void*>(aligned + length), start + kHuge - aligned);
  ::madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);  // a hint: refused, the pages are 4 KiB ones
  return reinterpret_cast<void*>(aligned);
}

void unmap_huge_pages(void* p, size_t bytes) noexcept {
  if (p) ::munmap(p, huge_pages_length(bytes));
}

Region::Region(size_t bytes) {
  if (!kMapLargeBlocks || bytes == 0) return;  // AddressSanitizer: empty (see the header)
  data_ = static_cast<std::byte*>(map_huge_pages(bytes, /*reserve_only=*/true));
  if (data_) size_ = huge_pages_length(bytes);
}

namespace {
// start → end of each registered mapping, with its lock; never destroyed, so that a mapping let go during the
// program's exit (a static's) still finds them
struct FileMappings {
  std::mutex mutex;
  std::map<uintptr_t, uintptr_t> ranges;
};
FileMappings& file_mappings() {
  static FileMappings* mappings = new FileMappings;
  return *mappings;
}
}  // namespace

void register_file_mapping(const void* p, size_t bytes) {
  if (!p || bytes == 0) return;
  FileMappings& m = file_mappings();
  const std::lock_guard<std::mutex> lock(m.mutex);
  m.ranges[reinterpret_cast<uintptr_t>(p)] = reinterpret_cast<uintptr_t>(p) + bytes;
}

void unregister_file_mapping(const void* p) noexcept {
  FileMappings& m = file_mappings();
  const std::lock_guard<std::mutex> lock(m.mutex);
  m.ranges.erase(reinterpret_cast<uintptr_t>(p));
}

void release_file_pages(const void* p, size_t bytes) noexcept {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  {
    FileMappings& m = file_mappings();
    const std::lock_guard<std::mutex> lock(m.mutex);
    const auto& mappings = m.ranges;
    auto at = mappings.upper_bound(begin);  // the first mapping starting after p; the one before may hold it
    if (!p || bytes == 0 || at == mappings.begin() || (--at)->second < end) return;
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

Region::~Region() { unmap_huge_pages(data_, size_); }

Region::Region(Region&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

Region& Region::operator=(Region&& other) noexcept {
  if (this != &other) {
    unmap_huge_pages(data_, size_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void Region::release(size_t offset, size_t bytes) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(data_) + offset + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(data_) + std::min(offset + bytes, size_)) / page * page;
  if (data_ && last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace qkv::memory
