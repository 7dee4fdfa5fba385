// Inference-only operations on rows of many sequences at once (a session's batch, nn/session.hpp), with no autograd:
// the scope that makes every product row-independent, RoPE at a position per row, and the attention of one sequence's
// query rows over its keys and values gathered from a block cache.
// Not here: the differentiable ops (ops.hpp), the cache itself and the batch (nn/session.hpp).
#pragma once

#include <cstdint>

#include "qkv/core/ops.hpp"
#include "qkv/kernels/gemm.hpp"

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

}  // namespace qkv
