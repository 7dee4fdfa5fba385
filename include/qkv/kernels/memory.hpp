// The one allocator behind tensor storage and kernel scratch, and its byte counts (current and peak since the last
// reset), so benchmarks and tests can report the memory an operation needs. Counting is a relaxed atomic add.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

namespace qkv::memory {

int64_t bytes_in_use();
int64_t peak_bytes();
void reset_peak();  // peak := bytes_in_use()

// Freed blocks may be kept and handed out again, up to this many bytes in use and held in all (0, the default: none
// kept; lowering the limit frees what is over it). A request takes the smallest block held that fits it, up to 4
// times its size from 64 KiB on (its own size below). Training sets it (cache_blocks_for_steps): every step asks
// for the same sizes, or smaller ones after a longer batch, so once the longest batch has run nearly every tensor
// and kernel buffer comes from the cache, not from the system (no page faults, no heap growth). A fresh block first
// frees the smallest blocks held as far as the limit needs. A single pass would only hold more memory.
void set_block_cache_limit(int64_t bytes);
int64_t block_cache_limit();
// What the block cache holds now, in freed blocks kept for reuse.
int64_t block_cache_bytes();
// For work that repeats its allocations, training steps: turn the cache on with room for at least `floor` bytes and
// for 1.25 times the most the process ever asked for at once (the quarter for smaller requests in larger blocks).
// Call it again after each step, so the limit follows the steps' own peak: GPT-2 124M at B 8 × T 256 holds 4 GiB of
// tensors at its peak, and under a fixed 2 GiB limit every step faulted in dozens of fresh blocks again (10% of a
// bf16 step); with the limit at the peak none, and the peak RSS is unchanged.
void cache_blocks_for_steps(int64_t floor = int64_t{2} << 30);
// How many blocks, and bytes, came from the system rather than from the caches since the process started.
int64_t fresh_blocks();
int64_t fresh_bytes();

// A block of `bytes` (at least 1), 64-byte aligned; blocks of 4 MiB and more are mapped straight from the kernel
// with transparent huge pages (page-aligned) and go straight back, so freed ones never stay on the heap. Freed blocks
// of 64 KiB to 4 MiB (a layer's activations) are kept, up to 32 MiB in all, and handed out again for the same size or
// up to half of it, so a pass does not fault them in afresh (except under AddressSanitizer). The counts above count
// the whole block handed out. nullptr when the system refuses. Give it back with free_block and the size asked for.
void* allocate_block(size_t bytes);
void free_block(void* p, size_t bytes);

// A kernel's scratch buffer of n Ts from allocate_block, freed when it goes (std::bad_alloc if refused).
template <class T>
class Buffer {
 public:
  // n elements, uninitialised
  explicit Buffer(size_t n) : n_(n), data_(static_cast<T*>(allocate_block(bytes()))) {
    if (!data_) throw std::bad_alloc();
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { free_block(data_, bytes()); }
  // The first element
  T* data() const { return data_; }
  // Element i
  T& operator[](size_t i) const { return data_[i]; }
  // Elements
  size_t size() const { return n_; }

 private:
  size_t bytes() const { return (n_ ? n_ : 1) * sizeof(T); }
  size_t n_;
  T* data_;
};

// `bytes` rounded up to whole 2 MiB pages, mapped on their own at a 2 MiB boundary and asked for transparent huge pages
// (mmap alone aligns to 4 KiB, and a huge page must lie on its boundary): a page written faults in 2 MiB at once, one
// fault where 512 were (~12 µs each on the virtual machines measured). reserve_only: address space only (MAP_NORESERVE),
// for memory written as it is needed. nullptr when refused. Given back with unmap_huge_pages and the same `bytes`.
void* map_huge_pages(size_t bytes, bool reserve_only = false);
void unmap_huge_pages(void* p, size_t bytes) noexcept;  // p from map_huge_pages(bytes), or null
size_t huge_pages_length(size_t bytes);  // what map_huge_pages(bytes) maps: whole 2 MiB pages (0 if that overflows)

// Read-only file mappings (io's, of weights files) are registered while they live, so that a tensor converted from
// rows read in place can let go of this process's copy of their pages: release_file_pages(p, bytes) drops the whole
// pages inside [p, p + bytes) when that range lies in a registered mapping (they stay in the page cache, and a later
// read maps them again from the file), and does nothing for any other memory.
void register_file_mapping(const void* p, size_t bytes);
void unregister_file_mapping(const void* p) noexcept;
void release_file_pages(const void* p, size_t bytes) noexcept;

// Address space for memory written in place and let go in pieces (a KV cache's blocks): map_huge_pages(bytes,
// reserve_only), so no memory is used until a page is written, and then 2 MiB at a time.
// Not counted by bytes_in_use: its owner counts what it uses. Empty (data() null) when the system refuses the address
// space, and under AddressSanitizer (whose checks need allocations of their own): the owner then allocates its pieces.
class Region {
 public:
  Region() = default;               // empty
  explicit Region(size_t bytes);    // reserved (or empty, as above)
  ~Region();                        // the address space given back
  Region(Region&& other) noexcept;  // takes other's range; other is left empty
  Region& operator=(Region&& other) noexcept;  // gives back its own range, takes other's
  Region(const Region&) = delete;   // one owner
  Region& operator=(const Region&) = delete;  // one owner
  std::byte* data() const { return data_; }  // the first byte (null when empty)
  size_t size() const { return size_; }      // bytes reserved
  // The whole pages inside [offset, offset + bytes) go back to the system; they read as zeros when touched again.
  void release(size_t offset, size_t bytes);

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace qkv::memory
