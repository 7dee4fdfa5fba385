// Inference-only operations on rows of many sequences at once (a session's batch, nn/session.hpp), with no autograd:
// the scope that makes every product row-independent, RoPE at a position per row, and the attention of one sequence's
// query rows over its keys and values gathered from a block cache.
// Not here: the differentiable ops (ops.hpp), the cache itself and the batch (nn/session.hpp).
#pragma once

#include <span>

#include <functional>

#include <cstdint>

#include "qkv/core/ops.hpp"
#include "qkv/kernels/attention_decode.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"  // memory::Region, where a session's KV cache keeps its blocks

namespace qkv {

// While alive, every Linear product on this thread gives each row the same bits whatever the rows beside it
// (kernels::gemm_rows_nt): a sequence decoded in a batch then equals the same sequence decoded alone.
class RowIndependentScope {
 public:
  RowIndependentScope() = default;  // on for this thread until destroyed
 private:
  kernels::RowIndependentProducts on_;
};

// Rows [row0, row0 + rows) of x (1, N, W) in place: each row's first `heads` heads of D values rotated at its own
// position positions[r] (r < rows). ShapeError when a position is outside the table.
void rope_rows_(Tensor& x, const kernels::RopeTable& table, RopeLayout layout, int64_t heads, int64_t D, int64_t row0,
                int64_t rows, const int64_t* positions);

// Causal attention for one sequence: query rows [row0, row0 + rows) of q (1, N, H·D) are that sequence's last `rows`
// positions among the Tk whose keys and values are given ((Tk, H_kv·D) each, contiguous); writes the same rows of
// context (1, N, H·D). Uses config's heads, window, scale and softcap (no dropout, no gradient). The query rows'
// results depend only on them and the keys: the same call alone or beside other sequences gives the same bits.
void attend_rows(const Tensor& q, int64_t row0, int64_t rows, const float* keys, const float* values, int64_t Tk,
                 const AttentionConfig& config, Tensor& context);

// One sequence of a batch's step: its query rows [row0, row0 + rows) of q and the Tk positions it attends over.
struct AttentionRun {
  int64_t row0 = 0;  // its first query row in q
  int64_t rows = 0;  // its query rows: the sequence's last `rows` positions
  int64_t Tk = 0;    // the positions it attends over (its keys and values)
};
// attend_rows for every run of a step, each run's keys and values first written by gather(i, keys, values) into
// (Tk, kv_width) buffers. Several runs of at most 64 rows go to the threads whole (a decoding sequence is one row: too
// little to split); otherwise each run's kernel has the threads. A run's rows get the same bits either way. The first
// error a run raises is rethrown once all have ended.
//
// With `pages`, a run of one row (a decoding sequence) is attended where its keys and values lie instead:
// pages(i, out) fills out.pages (cleared first) with run i's positions, and kernels::attention_decode reads them — no
// copy of the keys, no packing. Every one-row run takes that path when the cache's type and head width allow it
// (kernels::attention_decode_supports), whatever the other runs, so a sequence gets the same bits alone or in a batch.
struct PagedKV {
  std::vector<kernels::KVPage> pages;  // the run's positions, in order
  kernels::WeightType type = kernels::WeightType::F32;  // how the rows are stored
  int64_t row_bytes = 0;                                // bytes between consecutive positions of a page
};
using PageLookup = std::function<void(size_t, PagedKV&)>;
void attend_runs(const Tensor& q, std::span<const AttentionRun> runs, int64_t kv_width,
                 const std::function<void(size_t, float*, float*)>& gather, const AttentionConfig& config,
                 Tensor& context, const PageLookup& pages = {});

}  // namespace qkv
