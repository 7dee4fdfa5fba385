// Optimiser updates and gradient-norm pieces over flat float arrays, beside scalar references. One pass over
// parameter, gradient and state; parallel and vectorised, and elementwise, so the result does not depend on
// the thread count.
//
// The updates run with denormals flushed (Denormals::Flush in gemm.hpp). Gradients of rarely seen rows (a tied
// head's embedding rows for tokens no target names) get as small as 1e-30, so g² and then v sink below 1.2e-38;
// every operation on such a value costs a microcode assist (measured: AdamW over GPT-2's 124M parameters went
// 73 → 125 ms within three steps). What a flushed value could have changed is a step below lr·1.2e-38/eps, far
// under the last bit of any weight bigger than 1e-25.
#pragma once

#include <cstdint>

namespace qkv::kernels {

// One AdamW step (PyTorch 1.13's single-tensor rule, in float):
//   g ← g·grad_scale (gradient clipping, when not 1);
//   w ← w·decay;  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;  w ← w − step_size · m / (√v / bc2_sqrt + eps)
struct AdamWStep {
  // the update's constants, as in the formula above (bc2_sqrt: √(1 − β2^t))
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, eps;
  float grad_scale = 1.0f;  // the gradient's factor (clipping)
};
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s);
void adamw_update_reference(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s);

// One SGD step (torch.optim.SGD): d = g + wd·w; with momentum buf = first ? d : buf·μ + (1 − dampening)·d and
// d = nesterov ? d + μ·buf : buf; then w ← w − lr·d. buf may be null (no momentum).
struct SGDStep {
  float lr, weight_decay, momentum, keep;  // keep = 1 − dampening
  bool nesterov, first;  // Nesterov momentum; the first step (the buffer starts as d)
  float grad_scale = 1.0f;  // gradient clipping folded into the sweep
};
void sgd_update(float* w, const float* g, float* buf, int64_t n, const SGDStep& s);

// Σ x² in double, summed over fixed chunks in order (the same for any thread count).
double sum_of_squares(const float* x, int64_t n);
double sum_of_squares_reference(const float* x, int64_t n);
// x ← x · factor.
void scale(float* x, int64_t n, float factor);

}  // namespace qkv::kernels
