// The block allocator and its counters (see qkv/kernels/memory.hpp).
#include "qkv/kernels/memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace qkv::memory {

namespace {
// Bytes in blocks handed out (whole blocks), and in what was asked for (a block from a cache may be larger); the
// peaks of both.
std::atomic<int64_t> g_in_use{0}, g_peak{0}, g_asked{0}, g_asked_peak{0};
std::atomic<int64_t> g_block_cache_limit{0};
std::atomic<int64_t> g_fresh_blocks{0}, g_fresh_bytes{0};

void raise(std::atomic<int64_t>& peak, int64_t now) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}
void on_allocate(int64_t capacity, int64_t asked) {
  raise(g_peak, g_in_use.fetch_add(capacity, std::memory_order_relaxed) + capacity);
  raise(g_asked_peak, g_asked.fetch_add(asked, std::memory_order_relaxed) + asked);
}
void on_free(int64_t capacity, int64_t asked) {
  g_in_use.fetch_sub(capacity, std::memory_order_relaxed);
  g_asked.fetch_sub(asked, std::memory_order_relaxed);
}

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

// A block from the system: its start, its size, and whether it is mapped (mmap) or from operator new.
struct Block {
  void* p = nullptr;
  size_t size = 0;
  bool mapped = false;
};

Block system_block(size_t bytes, bool map) {
  if (!map) return {::operator new[](bytes, std::align_val_t(64), std::nothrow), bytes, false};
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return {};
  ::madvise(p, bytes, MADV_HUGEPAGE);  // fewer faults and TLB misses; a hint, so a refusal changes nothing
  return {p, bytes, true};
}
void release_system_block(const Block& b) {
  if (b.mapped) {
    ::munmap(b.p, b.size);
  } else {
    ::operator delete[](b.p, std::align_val_t(64));
  }
}

// Freed blocks kept while memory::block_cache_limit allows: a training step allocates the same sizes step after step,
// and a fresh block of hundreds of MiB costs a page fault per 4 KiB page on first touch (the kernel zeroes each one).
// Off by default: a single forward and backward (qkv apply) would only hold more memory (268 → 362 MiB at T = 4096,
// measured before the backward pass learned to write first gradients in place). A request takes the smallest block
// held that is large enough, up to 4 times its size from 64 KiB on (kMediumBytes; below that, only its own size):
// steps whose batches change length, as instruction tuning's do, then reuse the blocks of longer steps (take_most). It
// lives until the process ends (never destroyed, so a block freed by a static destructor still finds it; what it
// holds stays reachable, not leaked).
class BlockCache {
 public:
  // The smallest block held of `bytes` to `most` bytes; none (p nullptr) when there is none.
  Block take(size_t bytes, size_t most) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.lower_bound(bytes);
    if (it == blocks_.end() || it->first > most) return {};
    const Block b = it->second;
    blocks_.erase(it);
    held_ -= b.size;
    return b;
  }
  // Which blocks go to make room for a freed one.
  enum class Evict {
    kLargest,  // the largest (the sizes a program frees last are the ones it asks for next)
    kSmaller,  // blocks smaller than it, the smallest first (it can serve their sizes; they cannot serve its)
  };
  // Keeps b unless that would hold more than `limit`, after evicting what `evict` allows.
  bool give(const Block& b, size_t limit, Evict evict) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (b.size > limit) return false;
    if (evict == Evict::kLargest) release_largest(limit - b.size);
    if (evict == Evict::kSmaller && held_ + b.size > limit) {
      size_t smaller = 0;  // what evicting the smaller blocks needed would free
      for (auto it = blocks_.begin(); it != blocks_.end() && it->first < b.size; ++it) {
        if (held_ - smaller + b.size <= limit) break;
        smaller += it->first;
      }
      if (held_ - smaller + b.size <= limit) release_smallest(limit - b.size);
    }
    if (held_ + b.size > limit) return false;
    blocks_.emplace(b.size, b);
    held_ += b.size;
    return true;
  }
  size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }
  // Frees the largest blocks until at most `limit` bytes are held.
  void trim(size_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    release_largest(limit);
  }
  // Frees the smallest blocks until at most `limit` bytes are held.
  void trim_smallest(size_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    release_smallest(limit);
  }

 private:
  void release_largest(size_t limit) {  // with mutex_ held
    while (held_ > limit && !blocks_.empty()) release(std::prev(blocks_.end()));
  }
  void release_smallest(size_t limit) {  // with mutex_ held
    while (held_ > limit && !blocks_.empty()) release(blocks_.begin());
  }
  void release(std::multimap<size_t, Block>::iterator it) {  // with mutex_ held
    release_system_block(it->second);
    held_ -= it->first;
    blocks_.erase(it);
  }

  std::mutex mutex_;
  std::multimap<size_t, Block> blocks_;
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
// freed one 5 MB vector. Freed medium blocks are therefore kept here, up to kMediumCacheBytes, and handed out again
// (the smallest that fits, up to twice the size asked for): after the first pass no fault, whatever came before.
// (Not under AddressSanitizer, whose use-after-free checks need every block given back.)
constexpr size_t kMediumBytes = size_t{64} << 10;  // blocks from this size to kMapBytes
constexpr size_t kMediumCacheBytes = size_t{32} << 20;
bool medium(size_t bytes) { return kMapLargeBlocks && bytes >= kMediumBytes && bytes < kMapBytes; }
BlockCache& medium_cache() {
  static BlockCache* cache = new BlockCache;
  return *cache;
}
// The largest block a request of `bytes` may take from a cache, from kMediumBytes on: `times` its size (activations
// whose batch or prompt is shorter than the last one's); below that (and under AddressSanitizer, whose bounds checks
// need the size asked for), its own size.
size_t take_most(size_t bytes, size_t times) {
  return kMapLargeBlocks && bytes >= kMediumBytes && bytes <= SIZE_MAX / times ? times * bytes : bytes;
}
// A training step's activations come in a few widths (the model's, the MLP's, the heads'), and after a longer step a
// shorter one's requests of one width may have to take blocks of the next: the block cache allows 4 times the size,
// the medium cache (inference's, with no limit of its own on what it wastes) twice.
constexpr size_t kBlockCacheTimes = 4, kMediumCacheTimes = 2;

// The blocks handed out that free_block could not tell from the size asked for: larger (from a cache), or mapped
// below kMapBytes (while the block cache is on), so it gives back, and munmaps, the whole block.
class Handed {
 public:
  void record(const Block& b) {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_[b.p] = b;
    count_.store(blocks_.size(), std::memory_order_relaxed);
  }
  // The block at p (forgetting it), as recorded, or as allocate_block makes one of `bytes`.
  Block release(void* p, size_t bytes) {
    const Block plain{p, bytes, mapped(bytes)};
    if (count_.load(std::memory_order_relaxed) == 0) return plain;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return plain;
    const Block b = it->second;
    blocks_.erase(it);
    count_.store(blocks_.size(), std::memory_order_relaxed);
    return b;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<size_t> count_{0};
};
Handed& handed() {
  static Handed* blocks = new Handed;
  return *blocks;
}

// Room left under the block cache's limit for blocks held, with `extra` bytes more in use.
size_t cache_room(int64_t limit, size_t extra) {
  const int64_t room = limit - bytes_in_use() - static_cast<int64_t>(std::min<size_t>(extra, INT64_MAX));
  return room > 0 ? static_cast<size_t>(room) : 0;
}
}  // namespace

void set_block_cache_limit(int64_t bytes) {
  g_block_cache_limit.store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed);
  block_cache().trim(static_cast<size_t>(block_cache_limit()));
}
int64_t block_cache_limit() { return g_block_cache_limit.load(std::memory_order_relaxed); }
int64_t block_cache_bytes() { return static_cast<int64_t>(block_cache().held()); }
void cache_blocks_for_steps(int64_t floor) {
  // The peak of what the steps asked for, not of the blocks they were handed (which the limit itself allows to be
  // larger, so the limit would ratchet up); a quarter more for the smaller requests that take larger blocks.
  const int64_t peak = g_asked_peak.load(std::memory_order_relaxed), wanted = std::max(floor, peak + peak / 4);
  if (wanted > block_cache_limit()) set_block_cache_limit(wanted);
}
int64_t fresh_blocks() { return g_fresh_blocks.load(std::memory_order_relaxed); }
int64_t fresh_bytes() { return g_fresh_bytes.load(std::memory_order_relaxed); }

int64_t bytes_in_use() { return g_in_use.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() {
  g_peak.store(bytes_in_use(), std::memory_order_relaxed);
  g_asked_peak.store(g_asked.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void* allocate_block(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const int64_t limit = block_cache_limit();
  // The block cache first when it is on: it holds what the steps free, and the medium cache's leftovers from other
  // work would only add to the blocks owned.
  Block b = limit > 0 ? block_cache().take(bytes, take_most(bytes, kBlockCacheTimes)) : Block{};
  if (!b.p && medium(bytes)) b = medium_cache().take(bytes, take_most(bytes, kMediumCacheTimes));
  if (!b.p) {
    // The blocks in use and held stay within the limit: a fresh block first frees the smallest held (after a longer
    // batch than any before, the shorter ones' blocks it has outgrown). Medium blocks are mapped too while the cache
    // is on: from glibc's heap, those the caches let go stayed in the process as free heap, 330-680 MiB beside a
    // LoRA step's 2.8 GiB of blocks.
    if (limit > 0) block_cache().trim_smallest(cache_room(limit, bytes));
    b = system_block(bytes, mapped(bytes) || (limit > 0 && medium(bytes)));
    if (!b.p) return nullptr;
    g_fresh_blocks.fetch_add(1, std::memory_order_relaxed);
    g_fresh_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }
  if (b.size != bytes || b.mapped != mapped(bytes)) handed().record(b);
  on_allocate(static_cast<int64_t>(b.size), static_cast<int64_t>(bytes));
  return b.p;
}

void free_block(void* p, size_t bytes) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  const Block b = handed().release(p, bytes);
  on_free(static_cast<int64_t>(b.size), static_cast<int64_t>(bytes));
  // Under a block cache limit, every size is kept while the blocks in use and held fit in it; the medium cache
  // otherwise.
  const int64_t limit = block_cache_limit();
  if (limit > 0 && block_cache().give(b, cache_room(limit, 0), BlockCache::Evict::kSmaller)) return;
  if (medium(b.size) && medium_cache().give(b, kMediumCacheBytes, BlockCache::Evict::kLargest)) return;
  release_system_block(b);
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
