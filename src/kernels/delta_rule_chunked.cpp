// The gated delta rule's chunked form (qkv/kernels/delta_rule.hpp): the same outputs and final state as the recurrent
// form, computed a chunk of tokens at a time with matrix products, for prompts.
//
// Within a chunk of n tokens starting from state S₀, with G_i = g_1 + … + g_i (so e^(G_i) is the decay from the chunk's
// start to token i), the state after token i is
//   S_i = e^(G_i) S₀ + Σ_{j ≤ i} e^(G_i − G_j) k_j u_jᵀ,
// and the recurrence's u_i = β_i (v_i − S'ᵀ k_i) becomes a unit lower-triangular system for all of the chunk's u at once:
//   u_i + β_i Σ_{j < i} e^(G_i − G_j) (k_i·k_j) u_j = β_i v_i − β_i e^(G_i) S₀ᵀ k_i,
// solved through (I + A)⁻¹ for both right-hand parts (U₀ from β v, W from β e^G k), then U = U₀ − W S₀. Then
//   o_i = e^(G_i) S₀ᵀ q_i + Σ_{j ≤ i} e^(G_i − G_j) (q_i·k_j) u_j,   S_n = e^(G_n) S₀ + Σ_j e^(G_n − G_j) k_j u_jᵀ.
// Every factor e^(G_i − G_j) with j ≤ i is at most 1. The products run in kernels::gemm (one thread per head).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qkv/kernels/delta_rule.hpp"
#include "qkv/kernels/gemm.hpp"
#include "simd.hpp"

namespace qkv::kernels {

void delta_rule_forward_chunked(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g,
                                const float* beta, const float* initial, float* o, float* final_state) {
  const int64_t heads = d.B * d.H, Dk = d.Dk, Dv = d.Dv, C = kDeltaRuleChunk, state = Dk * Dv;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    std::vector<float> S(static_cast<size_t>(state), 0.0f);
    if (initial) std::copy_n(initial + bh * state, state, S.data());
    std::vector<float> Q(static_cast<size_t>(C * Dk)), K(static_cast<size_t>(C * Dk)), Kd(static_cast<size_t>(C * Dk));
    std::vector<float> U(static_cast<size_t>(C * Dv)), W(static_cast<size_t>(C * Dk)), O(static_cast<size_t>(C * Dv));
    std::vector<float> KK(static_cast<size_t>(C * C)), M(static_cast<size_t>(C * C)), G(static_cast<size_t>(C));
    std::vector<float> Tinv(static_cast<size_t>(C * C)), Un(static_cast<size_t>(C * Dv)), Wn(static_cast<size_t>(C * Dk));
    // decay[i·C + j] = e^(G_i − G_j) for j ≤ i, 0 above the diagonal; minus_g = −G; gamma = e^G
    std::vector<float> decay(static_cast<size_t>(C * C)), minus_g(static_cast<size_t>(C)), gamma(static_cast<size_t>(C));
    for (int64_t t0 = 0; t0 < d.T; t0 += C) {
      const int64_t n = std::min(C, d.T - t0);
      // The chunk's rows, gathered, and its cumulative gates
      double cumulative = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        cumulative += g[(b * d.T + t0 + i) * d.H + h];
        G[static_cast<size_t>(i)] = static_cast<float>(cumulative);
        minus_g[static_cast<size_t>(i)] = -G[static_cast<size_t>(i)];
      }
      simd::exp_shifted_sum(G.data(), gamma.data(), n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {  // (vector exps: one std::exp per pair took half the chunked time)
        float* row = decay.data() + i * C;
        simd::exp_shifted_sum(minus_g.data(), row, i + 1, minus_g[static_cast<size_t>(i)]);
        std::fill(row + i + 1, row + n, 0.0f);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = (b * d.T + t0 + i) * d.H + h;
        std::copy_n(q + row * Dk, Dk, Q.data() + i * Dk);
        std::copy_n(k + row * Dk, Dk, K.data() + i * Dk);
        const float bi = beta[row], bg = bi * gamma[static_cast<size_t>(i)];
        for (int64_t c = 0; c < Dv; ++c) U[static_cast<size_t>(i * Dv + c)] = bi * v[row * Dv + c];
        for (int64_t c = 0; c < Dk; ++c) W[static_cast<size_t>(i * Dk + c)] = bg * K[static_cast<size_t>(i * Dk + c)];
      }
      // k_i·k_j and q_i·k_j for the chunk's pairs
      gemm(false, true, n, n, Dk, 1.0f, K.data(), Dk, K.data(), Dk, 0.0f, KK.data(), C);
      gemm(false, true, n, n, Dk, 1.0f, Q.data(), Dk, K.data(), Dk, 0.0f, M.data(), C);
      // (I + A)⁻¹ with A_ij = β_i e^(G_i − G_j) k_i·k_j below the diagonal, by forward substitution on its rows (C³/6
      // multiply-adds), then both right-hand parts through it in two products: faster than substituting their rows
      // (C²·(Dk + Dv)/2 multiply-adds in short vector loops)
      std::fill(Tinv.begin(), Tinv.end(), 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const float bi = beta[(b * d.T + t0 + i) * d.H + h];
        float* ti = Tinv.data() + i * C;
        ti[i] = 1.0f;
        for (int64_t j = 0; j < i; ++j) {
          const float a = bi * decay[static_cast<size_t>(i * C + j)] * KK[static_cast<size_t>(i * C + j)];
          const float* tj = Tinv.data() + j * C;
          for (int64_t c = 0; c <= j; ++c) ti[c] -= a * tj[c];
        }
      }
      gemm(false, false, n, Dv, n, 1.0f, Tinv.data(), C, U.data(), Dv, 0.0f, Un.data(), Dv);
      gemm(false, false, n, Dk, n, 1.0f, Tinv.data(), C, W.data(), Dk, 0.0f, Wn.data(), Dk);
      U.swap(Un);
      W.swap(Wn);
      // U = U₀ − W S₀; O = e^G ∘ (Q S₀) + (e^(G_i − G_j) q_i·k_j, j ≤ i) U
      gemm(false, false, n, Dv, Dk, -1.0f, W.data(), Dk, S.data(), Dv, 1.0f, U.data(), Dv);
      gemm(false, false, n, Dv, Dk, 1.0f, Q.data(), Dk, S.data(), Dv, 0.0f, O.data(), Dv);
      for (int64_t i = 0; i < n; ++i) {
        const float gi = gamma[static_cast<size_t>(i)];
        for (int64_t c = 0; c < Dv; ++c) O[static_cast<size_t>(i * Dv + c)] *= gi;
        for (int64_t j = 0; j < n; ++j) M[static_cast<size_t>(i * C + j)] *= decay[static_cast<size_t>(i * C + j)];
      }
      gemm(false, false, n, Dv, n, 1.0f, M.data(), C, U.data(), Dv, 1.0f, O.data(), Dv);
      for (int64_t i = 0; i < n; ++i) std::copy_n(O.data() + i * Dv, Dv, o + ((b * d.T + t0 + i) * d.H + h) * Dv);
      // S = e^(G_n) S₀ + (e^(G_n − G_j) k_j)ᵀ U
      for (int64_t j = 0; j < n; ++j) {
        const float to_end = decay[static_cast<size_t>((n - 1) * C + j)];
        for (int64_t c = 0; c < Dk; ++c) Kd[static_cast<size_t>(j * Dk + c)] = to_end * K[static_cast<size_t>(j * Dk + c)];
      }
      const float whole = gamma[static_cast<size_t>(n - 1)];
      for (float& s : S) s *= whole;
      gemm(true, false, Dk, Dv, n, 1.0f, Kd.data(), Dk, U.data(), Dv, 1.0f, S.data(), Dv);
    }
    if (final_state) std::copy_n(S.data(), state, final_state + bh * state);
  }
}

}  // namespace qkv::kernels
