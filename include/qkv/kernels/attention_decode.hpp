// Generation's attention: one query row per head (the token being decoded) over keys and values read where a paged
// KV cache keeps them, beside its double-precision reference. The fused kernel (attention.hpp) wants K and V as
// contiguous rows, so a session first gathered each sequence's blocks into fresh buffers and the kernel then packed
// them again: two copies of every key per token and layer for a single row of products. Not here: prompts (many query
// rows: the fused kernel), the cache's bookkeeping (nn/session.hpp).
#pragma once

#include <cstdint>
#include <span>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/quant.hpp"

namespace qkv::kernels {

// Consecutive positions of one sequence as a cache holds them: `positions` key rows from `keys` and value rows from
// `values`, each row H_kv·D values of the cache's type, KVPages::row_bytes apart
struct KVPage {
  const void* keys = nullptr;    // the first position's key row
  const void* values = nullptr;  // the first position's value row (may be `keys`: latent caches read one row as both)
  int64_t positions = 0;         // rows in this page
};

// The keys and values a query row attends over: pages in position order
struct KVPages {
  std::span<const KVPage> pages;      // in position order (not owned)
  WeightType type = WeightType::F32;  // F32, F16, BF16 or Q8_0 (see attention_decode_supports)
  int64_t row_bytes = 0;              // bytes from one position's row to the next within a page
  int64_t positions() const;          // Σ of the pages' positions
};

// Whether attention_decode reads rows of `type` with heads of D values: F32, F16 and BF16 always, Q8_0 when each head
// is whole blocks (D a multiple of 32).
bool attention_decode_supports(WeightType type, int64_t D);

// For each query head h (dims.H of them, dims.D values each, contiguous in q and o; head h reads K/V head h / group):
// o_h = Σ_t P_ht v_t with P_h = softmax over every position t of the pages of s_ht = scale·q_h·k_t (soft-capped:
// cap·tanh(s / cap)), a sink logit joining the denominator when options.sinks is set. The query is the last position
// and sees every key it is given (causality and sliding windows are the caller's choice of pages). Uses dims.H, H_kv
// and D (B = Tq = 1, Tk = the pages' positions) and options' scale, softcap, sinks and threads; bf16 products and
// dropout do not apply. Threads own heads, and a head's result never depends on how many there are. Keys and values
// of F16, BF16 and Q8_0 are widened as they are read (the plain C++ build: a few positions at a time), exactly as
// dequantize_rows widens them, so a narrow cache gives the bits of the same values stored as float32 and reads only
// its own bytes.
// std::invalid_argument for dims that do not fit, an unsupported type, or pages without positions.
void attention_decode(const AttentionDims& dims, const AttentionOptions& options, const float* q, const KVPages& kv,
                      float* o);
// The same from the definition, in double (keys and values widened by dequantize_rows).
void attention_decode_reference(const AttentionDims& dims, const AttentionOptions& options, const float* q,
                                const KVPages& kv, float* o);

}  // namespace qkv::kernels
