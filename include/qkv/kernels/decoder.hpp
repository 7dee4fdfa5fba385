// SiLU, the piece today's decoders (Llama 3, Qwen2/3, Gemma 3) add to a GPT block's activations, as a
// forward/backward pair beside a double-precision scalar reference.
// Not here: attention itself (attention.hpp), rotary embeddings (rope.hpp), norms (norms.hpp), GELU (transformer.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// ---- SiLU: y = x·σ(x) (SwiGLU's gate) ----
void silu_forward(const float* x, float* y, int64_t n);
// dx (+)= g · σ(x)·(1 + x·(1 − σ(x)))
void silu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate = true);
void silu_reference(const float* x, float* y, int64_t n);
void silu_backward_reference(const float* x, const float* g, float* dx, int64_t n);

}  // namespace qkv::kernels
