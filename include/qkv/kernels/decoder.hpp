// The pieces today's decoders (Llama 3, Qwen2/3, Gemma 3) add to a GPT block: RMSNorm and SiLU, each as a
// forward/backward pair beside a double-precision scalar reference. Rows run in parallel; sums over rows go through
// fixed chunks added in order, so results do not depend on the thread count.
// Not here: attention itself (attention.hpp), rotary embeddings (rope.hpp), layer norm and GELU (transformer.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// ---- RMSNorm over rows of C ----
// y = x · rstd · (w + offset), rstd = 1/√(mean(x²) + eps). offset is 0 (Llama, Qwen) or 1 (Gemma's (1 + w)).
// rstd (rows) is saved for the backward.
void rms_norm_forward(const float* x, const float* weight, float offset, float* y, float* rstd, int64_t rows, int64_t C,
                      float eps);
// With x̂ = x·rstd and d = dy·(w + offset): dx (+)= rstd · (d − x̂ · mean(d · x̂)); dweight += Σ_rows dy·x̂.
// dx or dweight may be null.
void rms_norm_backward(const float* x, const float* weight, float offset, const float* rstd, const float* dy, float* dx,
                       float* dweight, int64_t rows, int64_t C, bool accumulate = true);
void rms_norm_forward_reference(const float* x, const float* weight, float offset, float* y, int64_t rows, int64_t C,
                                float eps);
void rms_norm_backward_reference(const float* x, const float* weight, float offset, const float* dy, float* dx,
                                 float* dweight, int64_t rows, int64_t C, float eps);

// ---- SiLU: y = x·σ(x) (SwiGLU's gate) ----
void silu_forward(const float* x, float* y, int64_t n);
// dx (+)= g · σ(x)·(1 + x·(1 − σ(x)))
void silu_backward(const float* x, const float* g, float* dx, int64_t n, bool accumulate = true);
void silu_reference(const float* x, float* y, int64_t n);
void silu_backward_reference(const float* x, const float* g, float* dx, int64_t n);

}  // namespace qkv::kernels
