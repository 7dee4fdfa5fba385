// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, Kimi Linear), the recurrent form, forward and backward,
// and the chunked form,
// beside its double-precision reference: linear attention whose state is a (Dk × Dv) matrix per head, decayed and
// corrected token by token, so its cost and its cache are constant in the context length. Pure compute on raw
// pointers; the op is core/ops_delta.cpp. Not here: the L2 norm of q and k, the causal conv1d and the gated RMSNorm
// around it.
#pragma once

#include <cstdint>

namespace qkv::kernels {

// B sequences of T tokens, H heads; keys and queries of Dk values, values of Dv
struct DeltaRuleDims {
  int64_t B = 1, T = 0, H = 1, Dk = 0, Dv = 0;  // batch, tokens, heads, key width, value width
};

// Per head, from S_0 (zeros, or `initial`), for each token t (q, k, v rows of the head; g_t, β_t scalars):
//   S' = e^(g_t) · S_{t−1}                 (the gate: g_t ≤ 0 forgets)
//   u_t = β_t · (v_t − S'ᵀ k_t)            (the delta rule: write what the state mispredicts for k_t)
//   S_t = S' + k_t u_tᵀ
//   o_t = S_tᵀ q_t
// q, k: (B, T, H, Dk); v, o: (B, T, H, Dv); g, beta: (B, T, H); states (B, H, Dk, Dv). initial may be null
// (zeros); final_state may be null. Heads run in parallel, each owned by one thread; sums in float32 in a fixed
// order.
void delta_rule_forward(const DeltaRuleDims& dims, const float* q, const float* k, const float* v, const float* g,
                        const float* beta, const float* initial, float* o, float* final_state);
// The same outputs and final state, and the same gradients, computed kDeltaRuleChunk tokens at a time with matrix
// products (the chunked form, for prompts and training): equal to the recurrent form within float32's rounding, not bit
// for bit. The backward keeps each chunk's starting state (T/64 states per head) and recomputes the rest.
constexpr int64_t kDeltaRuleChunk = 64;
void delta_rule_forward_chunked(const DeltaRuleDims& dims, const float* q, const float* k, const float* v,
                                const float* g, const float* beta, const float* initial, float* o, float* final_state);
void delta_rule_backward_chunked(const DeltaRuleDims& dims, const float* q, const float* k, const float* v,
                                 const float* g, const float* beta, const float* initial, const float* d_o, float* dq,
                                 float* dk, float* dv, float* dg, float* dbeta);
// Writes dq, dk, dv (like q, k, v), dg and dbeta (like g) from do (like o); the state is recomputed, kept every 64
// tokens and rebuilt within each stretch, so memory is O(T/64 · Dk · Dv) per head. Reverse through time:
//   dS += q_t do_tᵀ;  dq_t = S_t do_t;  dk_t = dS u_t;  du = dSᵀ k_t;  dβ_t = du·(v_t − m_t);  dv_t = β_t du;
//   dm = −β_t du;  dS' = dS + k_t dmᵀ;  dk_t += S' dm;  dg_t = e^(g_t) Σ dS' ∘ S_{t−1};  dS_{t−1} = e^(g_t) dS'
// (m_t = S'ᵀ k_t). The initial state's gradient is not returned (it starts at zero in training).
void delta_rule_backward(const DeltaRuleDims& dims, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* initial, const float* d_o, float* dq, float* dk, float* dv,
                         float* dg, float* dbeta);
// The same in double with every state kept: the forward written from the definition, the backward the same reverse
// pass without the stretches (central differences check it through the op, tests/test_kernel_table.cpp).
void delta_rule_forward_reference(const DeltaRuleDims& dims, const float* q, const float* k, const float* v,
                                  const float* g, const float* beta, const float* initial, float* o);
void delta_rule_backward_reference(const DeltaRuleDims& dims, const float* q, const float* k, const float* v,
                                   const float* g, const float* beta, const float* initial, const float* d_o, float* dq,
                                   float* dk, float* dv, float* dg, float* dbeta);

}  // namespace qkv::kernels
