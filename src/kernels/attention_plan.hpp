// The attention kernel's plan (internal to src/kernels/): block sizes, the Plan each call builds from its dims, layout
// and options (padded sizes, which keys each query row sees, where each head's rows lie), the row helpers and
// dropout stream the forward and backward share, and how threads take (head, block) items.
// Not here: the packs (attention_packs.hpp), the products (micro_kernels.hpp), the passes (attention_forward.cpp,
// attention_backward.cpp), the reference (attention_reference.cpp).
//
// Blocking. Queries go in blocks of Br rows (48; 64 on AMX tiles), keys in blocks of kBc columns. Per (b, h) each
// thread packs what it streams: Kᵀ in (D × kBc) blocks, V and K row-major padded to Dp = D rounded up to 16
// columns, Q·scale and dO padded to Dp. Every product is then one shape of GEMM, C (M × N) (+)= A (M × K) ·
// B (K × N) with B rows of 16 contiguous floats, done by one register-blocked micro-kernel: 6 × 16 (12 AVX2
// accumulators), or 8 × 32 with AVX-512 (16 accumulators).
//
// bf16 products (options.bf16, AVX512_BF16): the same blocks, ownership and softmax, with bf16 operands and float32
// sums. VDPBF16PS adds a pair of k per lane, so B operands are packed in pair rows (Kᵀ per key block, V and K by
// pairs of keys, Qs and dO by pairs of queries) and A is read a pair at a time; P and dS are rounded once per tile.
// Where the CPU has AMX (amx_bf16_ready), the same packs feed TDPBF16PS tiles: A must then hold k contiguous in its
// rows, so dV and dK are summed transposed (BackwardBf16).
// ForwardF32/ForwardBf16 (attention_forward.cpp) and BackwardF32/BackwardBf16 (attention_backward.cpp) hold the
// packs and products; forward_blocks and backward_blocks are written once over them.
//
// Grouped-query attention: query head h reads K/V head h / group, in place, never copied per query head. A sliding
// window (and the causal diagonal) bound each row's keys to [key_begin, key_end): blocks wholly outside are skipped,
// edge tiles are computed and masked.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "micro_kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels::attention_detail {

// Query rows per block (Plan::Br): 48 = 8 strips of the AVX2 6-row micro-kernel, 6 of the 8-row AVX-512 and
// VDPBF16PS ones.
// On AMX tiles 64: the transposed dV and dK products sum over a block's queries, 32 (16 pairs) a tile step, so
// 48 rows padded every such product to 64 with copies of both operands (64 rows: the bf16 backward at (4, 12, 1024,
// 64) 7% / 16% faster on 1 / 2 threads).
constexpr int64_t kBrF32 = 48, kBrAmx = 64, kBrMax = 64;
static_assert(kBrF32 <= kBrMax && kBrAmx <= kBrMax && kBrAmx % 32 == 0);
#ifdef QKV_AVX512
// Keys per block: 4 strips of 32 columns. Twice the AVX2 block: longer runs for the 8 × 32 micro-kernel (the P·V
// product's K), measured (4,12,1024,64) forward 5–13% and full fwd+bwd 5% faster than 64, in one session; the
// (64 × 128) Kᵀ block fits this CPU's 48 KiB L1.
constexpr int64_t kBc = 128;
#else
constexpr int64_t kBc = 64;  // keys per block: 4 strips of 16 columns; the (64 × 64) Kᵀ block fits a 32 KiB L1
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dst[i] = src[i] · factor. Restrict-qualified so GCC vectorises it: with a Plan's scale read through a
// reference, a plain loop reloads it after every store (measured: 10% of the forward pass, scalar).
inline void scaled_copy(const float* __restrict src, float* __restrict dst, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

// ---- dropout: a counter-based stream ----
// The decision for weight (bh, i, j) is a pure function of (seed, bh, i, j): murmur3's 32-bit finalizer
// over a per-row key and the column. The backward pass regenerates the mask instead of storing it, and 8
// decisions cost a handful of AVX2 instructions.

uint32_t dropout_row_key(uint64_t seed, int64_t bh, int64_t i);
// z[j] *= keep(bh, i, j0 + j) / (1 − p) for j < n.
void apply_dropout_row(float* z, int64_t n, uint64_t seed, uint32_t threshold, float inv_keep, int64_t bh, int64_t i,
                       int64_t j0);

// ---- per-call setup shared by forward and backward ----

// Plan::Br for these options: whole tile steps where bf16 products run on AMX tiles.
int64_t query_block_rows(const AttentionOptions& o);

struct Plan {
  AttentionDims dims;
  AttentionLayout layout;
  AttentionOptions options;
  float scale, softcap;
  int64_t Br;                                                  // query rows per block (query_block_rows)
  int64_t Dp, Tk_pad, Tq_pad, q_blocks, k_blocks, offset;  // offset = Tk − Tq (causal diagonal shift)
  int64_t kv_heads, group;                                 // K/V heads, query heads per K/V head
  bool dropout;
  uint32_t threshold;
  float inv_keep;

  Plan(const AttentionDims& d, const AttentionLayout& l, const AttentionOptions& o) : dims(d), layout(l), options(o) {
    scale = o.scale != 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(d.D, 1)));
    softcap = o.softcap > 0.0f ? o.softcap : 0.0f;
    Dp = round_up(std::max<int64_t>(d.D, 1), kNR);
    Tk_pad = round_up(std::max<int64_t>(d.Tk, 1), kBc);
    Br = query_block_rows(o);
    Tq_pad = round_up(std::max<int64_t>(d.Tq, 1), Br);
    q_blocks = (d.Tq + Br - 1) / Br;
    k_blocks = (d.Tk + kBc - 1) / kBc;
    offset = d.Tk - d.Tq;
    kv_heads = d.kv_heads();
    group = std::max<int64_t>(d.H / std::max<int64_t>(kv_heads, 1), 1);
    dropout = o.dropout_p > 0.0f;
    threshold = simd::drop_threshold(o.dropout_p);
    inv_keep = o.dropout_p < 1.0f ? 1.0f / (1.0f - o.dropout_p) : 0.0f;
  }
  int threads() const { return options.threads > 0 ? options.threads : omp_get_max_threads(); }
  // The window the products' trims may use: only with the causal mask, whose diagonal they are relative to.
  int64_t band() const { return options.causal ? options.window : 0; }
  // Query row i (absolute) sees keys [key_begin(i), key_end(i)). Both are non-decreasing in i.
  int64_t key_end(int64_t i) const {
    return options.causal ? std::clamp<int64_t>(i + offset + 1, 0, dims.Tk) : dims.Tk;
  }
  int64_t key_begin(int64_t i) const {
    return options.window > 0 ? std::clamp<int64_t>(i + offset - options.window + 1, 0, dims.Tk) : 0;
  }
  int64_t visible(int64_t i) const { return std::max<int64_t>(key_end(i) - key_begin(i), 0); }
  // Key j is seen by query rows [query_begin(j), query_end(j)).
  int64_t query_begin(int64_t j) const { return options.causal ? std::clamp<int64_t>(j - offset, 0, dims.Tq) : 0; }
  int64_t query_end(int64_t j) const {
    return options.window > 0 ? std::clamp<int64_t>(j - offset + options.window, 0, dims.Tq) : dims.Tq;
  }
  // The first key block any of the rows [q0, q0 + rows) sees, and the end of the keys any of them sees.
  int64_t first_key_block(int64_t q0) const { return key_begin(q0) / kBc * kBc; }
  // Query heads are bh = b·H + h; K/V heads bkv = b·H_kv + h_kv. Head h reads K/V head h / group.
  int64_t kv_of(int64_t bh) const { return (bh / dims.H) * kv_heads + (bh % dims.H) / group; }
  int64_t query_head(int64_t bkv, int64_t g) const { return (bkv / kv_heads) * dims.H + (bkv % kv_heads) * group + g; }
  const float* row(const float* base, const AttentionStrides& s, int64_t bh, int64_t t) const {
    return base + (bh / dims.H) * s.batch + (bh % dims.H) * s.head + t * s.token;
  }
  float* row(float* base, const AttentionStrides& s, int64_t bh, int64_t t) const {
    return base + (bh / dims.H) * s.batch + (bh % dims.H) * s.head + t * s.token;
  }
  // K/V rows, float32 or (a bf16 KV cache) bf16
  template <typename T>
  const T* kv_row(const T* base, const AttentionStrides& s, int64_t bkv, int64_t t) const {
    return base + (bkv / kv_heads) * s.batch + (bkv % kv_heads) * s.head + t * s.token;
  }
  float* kv_row(float* base, const AttentionStrides& s, int64_t bkv, int64_t t) const {
    return base + (bkv / kv_heads) * s.batch + (bkv % kv_heads) * s.head + t * s.token;
  }
  // The elements a strided tensor of `heads` heads × T tokens spans from its first: where a copy of it must reach.
  int64_t extent(const AttentionStrides& s, int64_t heads, int64_t T) const {
    if (dims.B <= 0 || heads <= 0 || T <= 0 || dims.D <= 0) return 0;
    return (dims.B - 1) * s.batch + (heads - 1) * s.head + (T - 1) * s.token + dims.D;
  }
  // Soft-capping of a row's visible scores [lo, hi), in place: s = cap·tanh(s / cap).
  void cap_scores(float* s, int64_t lo, int64_t hi) const {
    if (softcap == 0.0f) return;
    const float inv = 1.0f / softcap;
    for (int64_t j = lo; j < hi; ++j) s[j] = softcap * std::tanh(s[j] * inv);
  }
  // The visible part of key block k0 (cols keys) for query row i: local columns [lo, hi), empty when hi ≤ lo.
  std::pair<int64_t, int64_t> visible_in_block(int64_t i, int64_t k0, int64_t cols) const {
    return {std::clamp<int64_t>(key_begin(i) - k0, 0, cols), std::clamp<int64_t>(key_end(i) - k0, 0, cols)};
  }
};

// y[j] = exp(x[j] − shift) for lo ≤ j < hi, 0 elsewhere below n (x and y may alias); returns Σ y.
inline float exp_range(const float* x, float* y, int64_t lo, int64_t hi, int64_t n, float shift) {
  if (hi <= lo) {
    std::fill(y, y + n, 0.0f);
    return 0.0f;
  }
  const float total = simd::exp_shifted_sum(x + lo, y + lo, hi - lo, shift);
  std::fill(y, y + lo, 0.0f);
  std::fill(y + hi, y + n, 0.0f);
  return total;
}


// One Workspace per thread, every buffer at its full size before the threads start (each Workspace has
// reserve(plan, args…)). What a call holds is then the same whatever the schedule, so once the block cache has
// seen one call, later calls take nothing fresh from the system, with any number of threads; and nothing is held
// between calls or allocated inside the block loops.
template <typename Workspace, typename... Args>
std::vector<Workspace> workspaces(int threads, const Plan& p, Args... args) {
  std::vector<Workspace> all(static_cast<size_t>(std::max(threads, 1)));
  for (Workspace& w : all) w.reserve(p, args...);
  return all;
}

// Items are (head, block) pairs ordered head-major. With many heads per thread, each thread takes one contiguous
// run of items, so it packs each of its heads once (a cyclic schedule would have every thread pack every head:
// at T = 256, 6 query blocks a head, that was a fifth of a two-thread forward); the runs mix early and late blocks
// alike, so causal work balances. With few heads, items go round-robin, so each thread still sees each head as one
// run and causal work (more keys for later blocks) balances.
template <typename Workspace, typename F>
void parallel_items(std::vector<Workspace>& spaces, int64_t heads, int64_t blocks, F&& body) {
  const int64_t items = heads * blocks;
#pragma omp parallel num_threads(static_cast<int>(spaces.size()))
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    Workspace& workspace = spaces[static_cast<size_t>(t)];
    int64_t packed_head = -1;
    auto run = [&](int64_t item) {
      const int64_t bh = item / blocks;
      body(workspace, bh, item % blocks, bh != packed_head);
      packed_head = bh;
    };
    if (heads >= 4 * n) {
      for (int64_t item = items * t / n; item < items * (t + 1) / n; ++item) run(item);
    } else {
      for (int64_t item = t; item < items; item += n) run(item);
    }
  }
}

}  // namespace qkv::kernels::attention_detail
