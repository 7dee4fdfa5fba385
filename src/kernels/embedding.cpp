// Embedding kernels (see qkv/kernels/embedding.hpp), each beside its reference.
#include "qkv/kernels/embedding.hpp"

#include <algorithm>

#include "parallel.hpp"
#include "qkv/kernels/convert.hpp"

namespace qkv::kernels {

void embedding_forward(const float* weight, const int64_t* ids, int64_t n, int64_t C, float* y) {
  parallel_for(n, worth_parallel(n * C), [&](int64_t i) { std::copy_n(weight + ids[i] * C, C, y + i * C); });
}

void embedding_forward_bf16(const uint16_t* weight, const int64_t* ids, int64_t n, int64_t C, float* y) {
  parallel_for(n, worth_parallel(n * C), [&](int64_t i) { bf16_to_f32(weight + ids[i] * C, y + i * C, C); });
}

void embedding_backward(const int64_t* ids, int64_t n, int64_t C, const float* g, float* dweight) {
  // Threads own column slices of dweight and walk every id in order: no two threads touch one float, and each
  // float is summed in id order whatever the thread count.
  constexpr int64_t kSlice = 64;
  const int64_t slices = (C + kSlice - 1) / kSlice;
  parallel_for(slices, worth_parallel(n * C) && slices > 1, [&](int64_t s) {
    const int64_t c0 = s * kSlice, c1 = std::min(C, c0 + kSlice);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = dweight + ids[i] * C;
      const float* src = g + i * C;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  });
}

void embedding_backward_reference(const int64_t* ids, int64_t n, int64_t C, const float* g, float* dweight) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) dweight[ids[i] * C + c] += g[i * C + c];
}

}  // namespace qkv::kernels
