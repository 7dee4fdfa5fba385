// Activations, elementwise: GELU (tanh form; GPT-2) and SiLU (SwiGLU's gate in Llama, Qwen, Gemma's gated MLPs), each
// as a forward/backward pair beside a double-precision scalar reference. Blocks of the input run in parallel; every
// element is computed alone, so results do not depend on the thread count.
// Not here: the autograd ops (core/ops_gpt.cpp, core/ops_decoder.cpp), the other unary maps (elementwise.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// ---- GELU, tanh form ----
// y = 0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³))). gelu_backward adds g · GELU'(x) into dx, or with accumulate
// false writes it there.
void gelu_forward(const float* x, float* y, int64_t n);
void gelu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate = true);
void gelu_reference(const float* x, float* y, int64_t n);
void gelu_backward_reference(const float* x, const float* g, float* dx, int64_t n);

// ---- SiLU: y = x·σ(x) (SwiGLU's gate) ----
void silu_forward(const float* x, float* y, int64_t n);
// dx (+)= g · σ(x)·(1 + x·(1 − σ(x)))
void silu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate = true);
void silu_reference(const float* x, float* y, int64_t n);
void silu_backward_reference(const float* x, const float* g, float* dx, int64_t n);

}  // namespace qkv::kernels
