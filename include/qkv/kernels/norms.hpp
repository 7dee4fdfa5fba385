// Normalisation over rows of C: layer norm (GPT-2) and RMSNorm (Llama, Qwen, Gemma's (1 + w)), each as a
// forward/backward pair beside a double-precision scalar reference. Rows run in parallel; sums over rows (the weight
// gradients) go through fixed chunks added in order, so results do not depend on the thread count.
// Not here: the autograd ops (core/ops_gpt.cpp, core/ops_decoder.cpp), softmax (softmax.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// ---- layer norm over rows of C ----
// Layer norm over rows of C: x̂ = (x − μ)·rstd, rstd = 1/√(σ² + eps) (σ² biased), y = x̂·scale + shift.
// mean and rstd (rows) are saved for the backward pass.
void layer_norm_forward(const float* x, const float* scale, const float* shift, float* y, float* mean, float* rstd,
                        int64_t rows, int64_t C, float eps);
// With d = dy·scale (llm.c's derivation): dx += rstd · (d − mean(d) − x̂ · mean(d · x̂)) (dx = … when not
// accumulate: a fresh gradient needs no zeroing pass); dscale += Σ_rows dy·x̂;  dshift += Σ_rows dy. Any of dx,
// dscale, dshift may be null.
void layer_norm_backward(const float* x, const float* scale, const float* mean, const float* rstd, const float* dy,
                         float* dx, float* dscale, float* dshift, int64_t rows, int64_t C, bool accumulate = true);
void layer_norm_forward_reference(const float* x, const float* scale, const float* shift, float* y, int64_t rows,
                                  int64_t C, float eps);
void layer_norm_backward_reference(const float* x, const float* scale, const float* dy, float* dx, float* dscale,
                                   float* dshift, int64_t rows, int64_t C, float eps);

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

}  // namespace qkv::kernels
