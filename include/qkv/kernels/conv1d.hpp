// The causal depthwise 1-D convolution in front of Gated DeltaNet's delta rule (Qwen3-Next, Qwen3.5, Kimi Linear):
// each channel mixes its own last K inputs (torch's Conv1d(C, C, K, groups=C, padding=K−1, bias=False), cut to the
// first T outputs), forward and backward beside a double-precision reference. Pure compute on raw pointers; the op is
// core/ops_delta.cpp. Not here: the SiLU after it (activations.hpp), the delta rule (delta_rule.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// B sequences of T tokens with C channels, a kernel of K taps
struct CausalConvDims {
  int64_t B = 1, T = 0, C = 0, K = 4;  // sequences, tokens, channels, taps
};

// y[b, t, c] = Σ_{j<K} w[c, j] · x̃[b, t − (K − 1) + j, c], where x̃ is x (B, T, C) preceded by `state` (B, K − 1, C):
// the K − 1 inputs before the first token (a decoding cache), or zeros when state is null. w is (C, K), as the
// checkpoints' (C, 1, K) weight. Rows of y are owned by threads; each sum runs over j in order.
void causal_conv1d_forward(const CausalConvDims& dims, const float* x, const float* w, const float* state, float* y);
// dx (written) = Σ_j w[c, j] · dy[b, t + (K − 1) − j, c] over the outputs that read x[b, t, c]; dw (written, (C, K))
// = Σ_{b,t} dy[b, t, c] · x̃[b, t − (K − 1) + j, c], channels owned by threads, rows summed in order. dx or dw may be
// null (not wanted). The state's gradient is not returned (a cache is not trained).
void causal_conv1d_backward(const CausalConvDims& dims, const float* x, const float* w, const float* state,
                            const float* dy, float* dx, float* dw);
// The same in double, written from the definitions
void causal_conv1d_forward_reference(const CausalConvDims& dims, const float* x, const float* w, const float* state,
                                     float* y);
void causal_conv1d_backward_reference(const CausalConvDims& dims, const float* x, const float* w, const float* state,
                                      const float* dy, float* dx, float* dw);

}  // namespace qkv::kernels
