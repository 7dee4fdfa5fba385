// Byte-pair encoding's tables and merge loop, shared by the tokenizer.json and GGUF tokenizers (internal to
// src/text/): token texts in one arena with a flat hash index, merges grouped by their left token. Built for loading
// at the speed of the file: no allocation per token, lookups in batches that prefetch their slots (a 262k-token
// vocabulary's index is 8 MB: each lookup is a cache miss, so the misses of a batch are overlapped). Memory is
// reserved once where the file says how much (its lists' lengths), since on a virtual machine each fresh page costs
// a fault of several microseconds.
// Not here: normalizers, pre-tokenizers, added tokens, decoders (hf_tokenizer.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::text::detail {

// std::allocator for small blocks; blocks of 256 KiB or more are mapped on their own, aligned to 2 MiB, with
// MADV_HUGEPAGE. On the virtual machines qkv is measured on a first touch of a 4 KiB page costs 10-40 µs, so a
// 262k-token vocabulary's 8 MB index paid more in page faults than in hashing; in 2 MiB pages it pays a few faults.
void* big_allocate(size_t bytes);
void big_free(void* p, size_t bytes) noexcept;
template <typename T>
struct BigAllocator {
  using value_type = T;
  BigAllocator() = default;
  template <typename U>
  BigAllocator(const BigAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(big_allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { big_free(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const BigAllocator<U>&) const noexcept { return true; }
};
template <typename T>
using BigVector = std::vector<T, BigAllocator<T>>;

// 64-bit hash of a short byte string: 8 bytes at a time, multiply-xorshift mixing (splitmix64's constants).
inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  if (i < s.size()) {
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

// Token id ↔ text. Ids may leave gaps (their text is empty and they are not found).
class Vocabulary {
 public:
  void reserve(size_t tokens, size_t bytes);
  // Sets id's text (callers check ids against the file's size); a text already present now finds `id` (the last one
  // set wins, as added tokens over the model's). Texts beyond 4 GiB in all are a std::length_error.
  void set(int32_t id, std::string_view text);
  // set() for each (text, id), the index slots prefetched a batch ahead.
  void set_all(std::span<const std::pair<std::string_view, int32_t>> entries);
  int32_t find(std::string_view text) const;  // −1 when absent
  // ids[i] = find(texts[i]), the slots prefetched a batch ahead.
  void find_all(std::span<const std::string_view> texts, int32_t* ids) const;
  std::string_view text(int32_t id) const {
    const Span s = spans_[static_cast<size_t>(id)];
    return {arena_.data() + s.offset, s.length};
  }
  int32_t size() const { return static_cast<int32_t>(spans_.size()); }  // 1 + the largest id set

 private:
  struct Span {
    uint32_t offset = 0, length = 0;
  };
  // A token's first 8 bytes are kept in its slot: a lookup of a short token (most are) reads one cache line.
  struct Slot {
    uint32_t id_plus_one = 0, length = 0;  // id_plus_one 0: empty
    uint64_t head = 0;                     // the first 8 bytes, zero-padded
  };
  static uint64_t head_of(std::string_view s) {
    uint64_t h = 0;
    std::memcpy(&h, s.data(), s.size() < 8 ? s.size() : 8);
    return h;
  }
  bool holds(const Slot& slot, std::string_view text, uint64_t head) const {
    return slot.length == text.size() && slot.head == head &&
           (text.size() <= 8 || std::memcmp(arena_.data() + spans_[slot.id_plus_one - 1].offset + 8, text.data() + 8, text.size() - 8) == 0);
  }
  size_t slot_of(std::string_view text, uint64_t hash) const;
  void rehash(size_t slots);

  BigVector<char> arena_;
  BigVector<Span> spans_;
  BigVector<Slot> slots_;  // open addressing, linear probing, at most 70% full
  size_t used_ = 0;
};

// (left id, right id) → (rank, merged id), grouped by left id and sorted by right id within a group; the lowest rank
// given for a pair is kept.
class MergeTable {
 public:
  struct Merge {
    int32_t left, right, rank, merged;
  };
  // Replaces the table by these merges (any order); `tokens` bounds the ids.
  void build(BigVector<Merge> merges, int32_t tokens);
  const Merge* find(int32_t left, int32_t right) const {
    if (static_cast<size_t>(left) + 1 >= begin_.size()) return nullptr;
    const Merge* lo = merges_.data() + begin_[static_cast<size_t>(left)];
    const Merge* hi = merges_.data() + begin_[static_cast<size_t>(left) + 1];
    while (lo < hi) {  // most groups hold a few merges; "Ġ" or "▁" thousands
      const Merge* mid = lo + (hi - lo) / 2;
      if (mid->right < right) lo = mid + 1;
      else hi = mid;
    }
    return lo < merges_.data() + begin_[static_cast<size_t>(left) + 1] && lo->right == right ? lo : nullptr;
  }
  size_t size() const { return merges_.size(); }

 private:
  BigVector<uint32_t> begin_;  // left id → its group's first merge; begin_[tokens] = size()
  BigVector<Merge> merges_;
};

// A BPE model: vocabulary, merges and how characters outside the vocabulary are handled.
struct BpeModel {
  Vocabulary vocab;
  MergeTable merges;
  bool ignore_merges = false;  // a word that is itself a token is that token (Llama 3's, gpt-oss's files)
  bool byte_fallback = false;  // characters outside the vocabulary become their <0xNN> byte tokens
  bool fuse_unk = false;       // consecutive unknown characters become one unk
  int32_t unk = -1;
  std::array<int32_t, 256> byte_tokens{};  // <0xNN> ids (−1 where missing), with byte_fallback
  // SentencePiece's scores (a GGUF file's "llama" model): when set, merges follow them, not the merge table.
  std::vector<float> scores;

  // Looks the <0xNN> tokens up (after the vocabulary is complete).
  void find_byte_tokens();
  // One pre-tokenized word → ids: its characters, then the lowest-ranked adjacent pair merged (leftmost on ties)
  // until no pair has a merge. O(n log n) in the word's characters. With scores, SentencePiece's rule instead.
  void encode(std::string_view word, std::vector<int64_t>& out) const;

 private:
  // SentencePiece's BPE as llama.cpp runs it (llm_tokenizer_spm): the word's characters, then repeatedly the adjacent
  // pair whose concatenation is the best-scored token (leftmost on ties) merged; characters that are no token become
  // their byte tokens (or unk).
  void encode_scored(std::string_view word, std::vector<int64_t>& out) const;
  void push_unknown(std::string_view character, std::vector<int64_t>& out) const;
};

}  // namespace qkv::text::detail
