// Byte-pair encoding's tables and merge loop (see bpe.hpp).
#include "bpe.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <cstdio>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>

#include "qkv/kernels/memory.hpp"

namespace qkv::text::detail {

// Blocks from this size on get huge pages of their own: a 2 MiB page is one fault where 64 pages of 4 KiB are 64
// (on the virtual machines measured, ~12 µs each: 0.8 ms for this much against ~0.1 ms for the huge page), and the
// tables of a vocabulary are a handful of blocks, so the memory rounded up is a few MiB at most.
constexpr size_t kMapAtLeast = size_t{256} << 10;

void* big_allocate(size_t bytes) {
  if (bytes < kMapAtLeast) {
    if (void* p = std::malloc(bytes ? bytes : 1)) return p;
    throw std::bad_alloc();
  }
  if (void* p = memory::map_huge_pages(bytes)) return p;
  throw std::bad_alloc();
}

void big_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes < kMapAtLeast) return std::free(p);
  memory::unmap_huge_pages(p, bytes);
}

namespace {
size_t utf8_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}
}  // namespace

// Lookups and inserts go in batches of this many: the first pass hashes and prefetches each slot, the second probes,
// so a batch's cache misses overlap instead of following one another.
constexpr size_t kBatch = 32;
// The vocabulary's index is at most this full: linear probing then averages ~1.7 probes for a token found, and a
// 262,144-token vocabulary (Gemma's, plus its added tokens) fits 524,288 slots, 8 MB, not twice that.
constexpr double kMaxLoad = 0.7;

void Vocabulary::reserve(size_t tokens, size_t bytes) {
  arena_.reserve(bytes);
  spans_.reserve(tokens);
  size_t slots = 16;
  while (slots * kMaxLoad < tokens) slots *= 2;
  if (slots > slots_.size()) rehash(slots);
}

size_t Vocabulary::slot_of(std::string_view token, uint64_t hash) const {
  const size_t mask = slots_.size() - 1;
  const uint64_t head = head_of(token);
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id_plus_one == 0 || holds(s, token, head)) return i;
  }
}

void Vocabulary::rehash(size_t slots) {
  BigVector<Slot> old = std::move(slots_);
  slots_.assign(slots, Slot{});
  const size_t mask = slots - 1;
  for (const Slot& s : old) {
    if (s.id_plus_one == 0) continue;
    size_t i = hash_bytes(text(static_cast<int32_t>(s.id_plus_one - 1))) & mask;
    while (slots_[i].id_plus_one != 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void Vocabulary::set(int32_t id, std::string_view token) {
  if (arena_.size() + token.size() > std::numeric_limits<uint32_t>::max())
    throw std::length_error("a vocabulary's token texts exceed 4 GiB");
  if (static_cast<size_t>(id) >= spans_.size()) spans_.resize(static_cast<size_t>(id) + 1);
  spans_[static_cast<size_t>(id)] = {static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(token.size())};
  if (token.data() >= arena_.data() && token.data() < arena_.data() + arena_.size()) {
    const std::string copy(token);  // one of our own texts: inserting from it would read what the insert moves
    arena_.insert(arena_.end(), copy.begin(), copy.end());
  } else {
    arena_.insert(arena_.end(), token.begin(), token.end());
  }
  if (token.empty()) return;
  token = text(id);  // `token` may have pointed into the arena before it grew
  if (used_ + 1 > slots_.size() * kMaxLoad) rehash(slots_.empty() ? 16 : 2 * slots_.size());
  const size_t i = slot_of(token, hash_bytes(token));
  if (slots_[i].id_plus_one == 0) ++used_;
  slots_[i] = {static_cast<uint32_t>(id) + 1, static_cast<uint32_t>(token.size()), head_of(token)};
}

void Vocabulary::set_all(std::span<const std::pair<std::string_view, int32_t>> entries) {
  for (size_t at = 0; at < entries.size(); at += kBatch) {
    const size_t n = std::min(kBatch, entries.size() - at);
    if (used_ + n <= slots_.size() * kMaxLoad) {
      const size_t mask = slots_.size() - 1;
      for (size_t k = 0; k < n; ++k) __builtin_prefetch(&slots_[hash_bytes(entries[at + k].first) & mask], 1);
    }
    for (size_t k = 0; k < n; ++k) set(entries[at + k].second, entries[at + k].first);
  }
}

int32_t Vocabulary::find(std::string_view token) const {
  if (slots_.empty() || token.empty()) return -1;
  return static_cast<int32_t>(slots_[slot_of(token, hash_bytes(token))].id_plus_one) - 1;
}

void Vocabulary::find_all(std::span<const std::string_view> texts, int32_t* ids) const {
  if (slots_.empty()) {
    std::fill(ids, ids + texts.size(), -1);
    return;
  }
  const size_t mask = slots_.size() - 1;
  uint64_t hashes[kBatch];
  for (size_t at = 0; at < texts.size(); at += kBatch) {
    const size_t n = std::min(kBatch, texts.size() - at);
    for (size_t k = 0; k < n; ++k) {
      hashes[k] = hash_bytes(texts[at + k]);
      __builtin_prefetch(&slots_[hashes[k] & mask]);
    }
    for (size_t k = 0; k < n; ++k)
      ids[at + k] = texts[at + k].empty() ? -1 : static_cast<int32_t>(slots_[slot_of(texts[at + k], hashes[k])].id_plus_one) - 1;
  }
}

void MergeTable::build(BigVector<Merge> merges, int32_t tokens) {
  // Counting sort by left id, then each group by (right, rank): a pair given twice keeps its lowest rank.
  begin_.assign(static_cast<size_t>(tokens) + 1, 0);
  for (const Merge& m : merges) ++begin_[static_cast<size_t>(m.left) + 1];
  for (size_t i = 1; i < begin_.size(); ++i) begin_[i] += begin_[i - 1];
  merges_.resize(merges.size());
  BigVector<uint32_t> next(begin_.begin(), begin_.end() - 1);
  for (const Merge& m : merges) merges_[next[static_cast<size_t>(m.left)]++] = m;
  merges = {};
  size_t out = 0;
  for (size_t g = 0; g + 1 < begin_.size(); ++g) {
    Merge* first = merges_.data() + begin_[g];
    Merge* last = merges_.data() + begin_[g + 1];
    std::sort(first, last, [](const Merge& a, const Merge& b) { return a.right != b.right ? a.right < b.right : a.rank < b.rank; });
    begin_[g] = static_cast<uint32_t>(out);
    for (Merge* m = first; m < last; ++m)
      if (m == first || m->right != (m - 1)->right) merges_[out++] = *m;
  }
  begin_.back() = static_cast<uint32_t>(out);
  merges_.resize(out);
}

void BpeModel::find_byte_tokens() {
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    byte_tokens[static_cast<size_t>(b)] = vocab.find(name);
  }
}

void BpeModel::push_unknown(std::string_view character, std::vector<int64_t>& out) const {
  bool all = byte_fallback;
  for (char c : character) all = all && byte_tokens[static_cast<unsigned char>(c)] >= 0;
  if (all) {
    for (char c : character) out.push_back(byte_tokens[static_cast<unsigned char>(c)]);
  } else if (unk >= 0 && !(fuse_unk && !out.empty() && out.back() == unk)) {
    out.push_back(unk);
  }
}

void BpeModel::encode_scored(std::string_view word, std::vector<int64_t>& out) const {
  struct Symbol {
    uint32_t begin, length;  // a range of the word: merged symbols are contiguous
    int32_t prev, next;
  };
  std::vector<Symbol> symbols;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    const auto k = static_cast<int32_t>(symbols.size());
    symbols.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(n), k - 1, i + n < word.size() ? k + 1 : -1});
    i += n;
  }
  struct Bigram {
    float score;
    int32_t left, right;
    uint32_t length;
    bool operator<(const Bigram& o) const { return score < o.score || (score == o.score && left > o.left); }
  };
  std::priority_queue<Bigram> queue;  // best score first, then leftmost
  auto consider = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[static_cast<size_t>(left)];
    const uint32_t length = l.length + symbols[static_cast<size_t>(right)].length;
    const int32_t id = vocab.find(word.substr(l.begin, length));
    if (id < 0 || static_cast<size_t>(id) >= scores.size()) return;
    queue.push({scores[static_cast<size_t>(id)], left, right, length});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) consider(i - 1, i);
  while (!queue.empty()) {
    const Bigram top = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<size_t>(top.left)];
    Symbol& right = symbols[static_cast<size_t>(top.right)];
    if (left.length == 0 || right.length == 0 || left.length + right.length != top.length) continue;  // stale
    left.length += right.length;
    right.length = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.left;
    consider(left.prev, top.left);
    consider(top.left, left.next);
  }
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
    const std::string_view text = word.substr(symbols[static_cast<size_t>(i)].begin, symbols[static_cast<size_t>(i)].length);
    const int32_t id = vocab.find(text);
    if (id >= 0) out.push_back(id);
    else push_unknown(text, out);  // only a single character is no token: merges make tokens
  }
}

void BpeModel::encode(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (!scores.empty()) return encode_scored(word, out);
  if (ignore_merges) {
    const int32_t whole = vocab.find(word);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto push = [&](int32_t id) {
    if (id == unk && fuse_unk && !symbols.empty() && symbols.back().id == unk) return;
    const int32_t n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, true});
  };
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    const int32_t id = vocab.find(word.substr(i, n));
    if (id >= 0) {
      push(id);
    } else if (byte_fallback) {
      bool all = true;
      for (size_t k = 0; k < n; ++k) all = all && byte_tokens[static_cast<unsigned char>(word[i + k])] >= 0;
      if (all) {
        for (size_t k = 0; k < n; ++k) push(byte_tokens[static_cast<unsigned char>(word[i + k])]);
      } else if (unk >= 0) {
        push(unk);
      }
    } else if (unk >= 0) {
      push(unk);
    }
    i += n;
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;
  struct Candidate {
    int32_t rank, pos, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t next = symbols[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    if (const MergeTable::Merge* m = merges.find(symbols[static_cast<size_t>(pos)].id, symbols[static_cast<size_t>(next)].id))
      queue.push({m->rank, pos, m->merged});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    const MergeTable::Merge* m = merges.find(left.id, right.id);
    if (!m || m->merged != top.merged) continue;  // stale: a neighbour changed since
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    consider(left.prev);
    consider(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) out.push_back(symbols[static_cast<size_t>(i)].id);
}

}  // namespace qkv::text::detail
