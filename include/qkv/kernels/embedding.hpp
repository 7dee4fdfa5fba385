// Embedding lookup: token ids to rows of a (V, C) table, float32 or bf16, and the gradient summed back into the table,
// beside a scalar reference. Results do not depend on the thread count.
// Not here: the autograd op (core/ops_gpt.cpp), position embeddings that rotate (rope.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// y (n, C) = weight[ids[i], :]. Ids must lie in [0, V): the caller checks them.
void embedding_forward(const float* weight, const int64_t* ids, int64_t n, int64_t C, float* y);
// The same from a bfloat16 table (an inference weight, Tensor::to_bf16_), each row widened exactly.
void embedding_forward_bf16(const uint16_t* weight, const int64_t* ids, int64_t n, int64_t C, float* y);
// dweight[ids[i], :] += g[i, :], in id order (the same bits for any thread count: rows of dweight are owned
// by the thread that owns their id).
void embedding_backward(const int64_t* ids, int64_t n, int64_t C, const float* g, float* dweight);
void embedding_backward_reference(const int64_t* ids, int64_t n, int64_t C, const float* g, float* dweight);

}  // namespace qkv::kernels
