// The gated delta rule's chunked form (qkv/kernels/delta_rule.hpp): the same outputs, final state and gradients as the
// recurrent form, computed a chunk of tokens at a time with matrix products.
//
// Within a chunk of n tokens starting from state S₀, with G_i = g_1 + … + g_i (so γ_i = e^(G_i) is the decay from the
// chunk's start to token i, and D_ij = e^(G_i − G_j) ≤ 1 from token j to token i), the state after token i is
//   S_i = γ_i S₀ + Σ_{j ≤ i} D_ij k_j u_jᵀ,
// and the recurrence's u_i = β_i (v_i − S'ᵀ k_i) becomes one unit lower-triangular system for the chunk's u:
//   (I + A) U = diag(β) V − diag(β γ) K S₀,   A_ij = β_i D_ij (k_i·k_j) for j < i,
// solved through T = (I + A)⁻¹ (forward substitution on its rows): U = T·diag(β)V − (T·diag(βγ)K)·S₀ = U₀ − W S₀. Then
//   O = diag(γ) Q S₀ + M U with M_ij = D_ij (q_i·k_j) for j ≤ i,   S_n = γ_n S₀ + (diag(D_n·) K)ᵀ U.
// The backward runs the chunks in reverse, recomputing each chunk's quantities from its starting state (kept by a
// forward pass over the chunks), and takes every product above back by the chain rule. The products run in
// kernels::gemm, one head per thread.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qkv/kernels/delta_rule.hpp"
#include "qkv/kernels/gemm.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {

using Buffer = std::vector<float>;

// One head's chunk: its rows and everything the forward computes from them and its starting state
struct Chunk {
  int64_t C, Dk, Dv, n = 0;
  Buffer Q, K, V, beta, G, minus_g, gamma, D, KK, QK, T, RV, RK, U, W, Kd;
  Chunk(int64_t c, int64_t dk, int64_t dv)
      : C(c), Dk(dk), Dv(dv), Q(c * dk), K(c * dk), V(c * dv), beta(c), G(c), minus_g(c), gamma(c), D(c * c), KK(c * c),
        QK(c * c), T(c * c), RV(c * dv), RK(c * dk), U(c * dv), W(c * dk), Kd(c * dk) {}

  // Tokens t0 … t0 + rows of head h of sequence b, and their decays
  void load(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g, const float* b_,
            int64_t b, int64_t h, int64_t t0, int64_t rows) {
    n = rows;
    double cumulative = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = (b * d.T + t0 + i) * d.H + h;
      std::copy_n(q + row * Dk, Dk, Q.data() + i * Dk);
      std::copy_n(k + row * Dk, Dk, K.data() + i * Dk);
      std::copy_n(v + row * Dv, Dv, V.data() + i * Dv);
      beta[static_cast<size_t>(i)] = b_[row];
      cumulative += g[row];
      G[static_cast<size_t>(i)] = static_cast<float>(cumulative);
      minus_g[static_cast<size_t>(i)] = -G[static_cast<size_t>(i)];
    }
    // (vector exps: one std::exp per pair took half the forward's time)
    simd::exp_shifted_sum(G.data(), gamma.data(), n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      float* row = D.data() + i * C;
      simd::exp_shifted_sum(minus_g.data(), row, i + 1, minus_g[static_cast<size_t>(i)]);
      std::fill(row + i + 1, row + C, 0.0f);
    }
  }

  // From the starting state S₀: k·k, q·k, T = (I + A)⁻¹, the right-hand parts, U = U₀ − W S₀ and diag(D_n·) K
  void solve(const float* S0) {
    gemm(false, true, n, n, Dk, 1.0f, K.data(), Dk, K.data(), Dk, 0.0f, KK.data(), C);
    gemm(false, true, n, n, Dk, 1.0f, Q.data(), Dk, K.data(), Dk, 0.0f, QK.data(), C);
    // T's rows by forward substitution (C³/6 multiply-adds); both right-hand parts then go through it in two
    // products, faster than substituting their rows (C²·(Dk + Dv)/2 multiply-adds in short vector loops)
    std::fill(T.begin(), T.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      float* ti = T.data() + i * C;
      ti[i] = 1.0f;
      for (int64_t j = 0; j < i; ++j) {
        const float a = beta[static_cast<size_t>(i)] * D[static_cast<size_t>(i * C + j)] * KK[static_cast<size_t>(i * C + j)];
        const float* tj = T.data() + j * C;
        for (int64_t c = 0; c <= j; ++c) ti[c] -= a * tj[c];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const float bi = beta[static_cast<size_t>(i)], bg = bi * gamma[static_cast<size_t>(i)];
      for (int64_t c = 0; c < Dv; ++c) RV[static_cast<size_t>(i * Dv + c)] = bi * V[static_cast<size_t>(i * Dv + c)];
      for (int64_t c = 0; c < Dk; ++c) RK[static_cast<size_t>(i * Dk + c)] = bg * K[static_cast<size_t>(i * Dk + c)];
    }
    gemm(false, false, n, Dv, n, 1.0f, T.data(), C, RV.data(), Dv, 0.0f, U.data(), Dv);
    gemm(false, false, n, Dk, n, 1.0f, T.data(), C, RK.data(), Dk, 0.0f, W.data(), Dk);
    gemm(false, false, n, Dv, Dk, -1.0f, W.data(), Dk, S0, Dv, 1.0f, U.data(), Dv);
    for (int64_t j = 0; j < n; ++j) {
      const float to_end = D[static_cast<size_t>((n - 1) * C + j)];
      for (int64_t c = 0; c < Dk; ++c) Kd[static_cast<size_t>(j * Dk + c)] = to_end * K[static_cast<size_t>(j * Dk + c)];
    }
  }

  // M = D ∘ QKᵀ: q_i·k_j decayed from j to i, zero above the diagonal (D is), C × C
  void masked_scores(float* M) const {
    for (int64_t i = 0; i < n * C; ++i) M[i] = D[static_cast<size_t>(i)] * QK[static_cast<size_t>(i)];
  }

  // S ← S_n = γ_n S + Kdᵀ U (in place)
  void advance(float* S) const {
    const float whole = gamma[static_cast<size_t>(n - 1)];
    for (int64_t i = 0; i < Dk * Dv; ++i) S[i] *= whole;
    gemm(true, false, Dk, Dv, n, 1.0f, Kd.data(), Dk, U.data(), Dv, 1.0f, S, Dv);
  }
};

inline float row_dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void delta_rule_forward_chunked(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g,
                                const float* beta, const float* initial, float* o, float* final_state) {
  const int64_t heads = d.B * d.H, Dk = d.Dk, Dv = d.Dv, C = kDeltaRuleChunk, state = Dk * Dv;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    Buffer S(static_cast<size_t>(state), 0.0f), O(static_cast<size_t>(C * Dv)), M(static_cast<size_t>(C * C));
    if (initial) std::copy_n(initial + bh * state, state, S.data());
    Chunk c(C, Dk, Dv);
    for (int64_t t0 = 0; t0 < d.T; t0 += C) {
      c.load(d, q, k, v, g, beta, b, h, t0, std::min(C, d.T - t0));
      c.solve(S.data());
      // O = diag(γ) Q S₀ + M U
      gemm(false, false, c.n, Dv, Dk, 1.0f, c.Q.data(), Dk, S.data(), Dv, 0.0f, O.data(), Dv);
      for (int64_t i = 0; i < c.n; ++i) {
        const float gi = c.gamma[static_cast<size_t>(i)];
        for (int64_t x = 0; x < Dv; ++x) O[static_cast<size_t>(i * Dv + x)] *= gi;
      }
      c.masked_scores(M.data());
      gemm(false, false, c.n, Dv, c.n, 1.0f, M.data(), C, c.U.data(), Dv, 1.0f, O.data(), Dv);
      for (int64_t i = 0; i < c.n; ++i) std::copy_n(O.data() + i * Dv, Dv, o + ((b * d.T + t0 + i) * d.H + h) * Dv);
      c.advance(S.data());
    }
    if (final_state) std::copy_n(S.data(), state, final_state + bh * state);
  }
}

void delta_rule_backward_chunked(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g,
                                 const float* beta, const float* initial, const float* d_o, float* dq, float* dk,
                                 float* dv, float* dg, float* dbeta) {
  const int64_t heads = d.B * d.H, Dk = d.Dk, Dv = d.Dv, C = kDeltaRuleChunk, state = Dk * Dv;
  const int64_t chunks = (d.T + C - 1) / C;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    Chunk c(C, Dk, Dv);
    // Each chunk's starting state, from a forward pass over the chunks
    Buffer starts(static_cast<size_t>(chunks * state), 0.0f);
    if (initial) std::copy_n(initial + bh * state, state, starts.data());
    for (int64_t ci = 0; ci + 1 < chunks; ++ci) {
      c.load(d, q, k, v, g, beta, b, h, ci * C, C);
      c.solve(starts.data() + ci * state);
      std::copy_n(starts.data() + ci * state, state, starts.data() + (ci + 1) * state);
      c.advance(starts.data() + (ci + 1) * state);
    }
    Buffer dS(static_cast<size_t>(state), 0.0f), dS0(static_cast<size_t>(state));  // ∂/∂(the chunk's end, its start)
    Buffer dO(static_cast<size_t>(C * Dv)), dU(static_cast<size_t>(C * Dv)), dW(static_cast<size_t>(C * Dk));
    Buffer dQ(static_cast<size_t>(C * Dk)), dK(static_cast<size_t>(C * Dk)), dKd(static_cast<size_t>(C * Dk));
    Buffer P(static_cast<size_t>(C * Dv)), dRV(static_cast<size_t>(C * Dv)), dRK(static_cast<size_t>(C * Dk));
    Buffer M(static_cast<size_t>(C * C)), dM(static_cast<size_t>(C * C)), dD(static_cast<size_t>(C * C));
    Buffer dT(static_cast<size_t>(C * C)), tmp(static_cast<size_t>(C * C)), dA(static_cast<size_t>(C * C));
    Buffer dgamma(static_cast<size_t>(C)), dbet(static_cast<size_t>(C)), dG(static_cast<size_t>(C));
    for (int64_t ci = chunks - 1; ci >= 0; --ci) {
      const int64_t t0 = ci * C, n = std::min(C, d.T - t0);
      const float* S0 = starts.data() + ci * state;
      c.load(d, q, k, v, g, beta, b, h, t0, n);
      c.solve(S0);
      for (int64_t i = 0; i < n; ++i) std::copy_n(d_o + ((b * d.T + t0 + i) * d.H + h) * Dv, Dv, dO.data() + i * Dv);
      std::fill(dQ.begin(), dQ.end(), 0.0f);
      std::fill(dK.begin(), dK.end(), 0.0f);
      std::fill(dgamma.begin(), dgamma.end(), 0.0f);
      std::fill(dbet.begin(), dbet.end(), 0.0f);
      std::fill(dD.begin(), dD.end(), 0.0f);
      // S_n = γ_n S₀ + Kdᵀ U
      const float whole = c.gamma[static_cast<size_t>(n - 1)];
      dgamma[static_cast<size_t>(n - 1)] += row_dot(dS.data(), S0, state);
      for (int64_t i = 0; i < state; ++i) dS0[static_cast<size_t>(i)] = whole * dS[static_cast<size_t>(i)];
      gemm(false, true, n, Dk, Dv, 1.0f, c.U.data(), Dv, dS.data(), Dv, 0.0f, dKd.data(), Dk);
      gemm(false, false, n, Dv, Dk, 1.0f, c.Kd.data(), Dk, dS.data(), Dv, 0.0f, dU.data(), Dv);
      for (int64_t j = 0; j < n; ++j) {
        const float to_end = c.D[static_cast<size_t>((n - 1) * C + j)];
        const float* dkd = dKd.data() + j * Dk;
        for (int64_t x = 0; x < Dk; ++x) dK[static_cast<size_t>(j * Dk + x)] += to_end * dkd[x];
        dD[static_cast<size_t>((n - 1) * C + j)] += row_dot(dkd, c.K.data() + j * Dk, Dk);
      }
      // O = diag(γ) P + M U, P = Q S₀, M = D ∘ QK (j ≤ i)
      c.masked_scores(M.data());
      gemm(false, true, n, n, Dv, 1.0f, dO.data(), Dv, c.U.data(), Dv, 0.0f, dM.data(), C);
      gemm(true, false, n, Dv, n, 1.0f, M.data(), C, dO.data(), Dv, 1.0f, dU.data(), Dv);
      gemm(false, false, n, Dv, Dk, 1.0f, c.Q.data(), Dk, S0, Dv, 0.0f, P.data(), Dv);
      for (int64_t i = 0; i < n; ++i) {
        dgamma[static_cast<size_t>(i)] += row_dot(dO.data() + i * Dv, P.data() + i * Dv, Dv);
        const float gi = c.gamma[static_cast<size_t>(i)];
        for (int64_t x = 0; x < Dv; ++x) P[static_cast<size_t>(i * Dv + x)] = gi * dO[static_cast<size_t>(i * Dv + x)];  // dP
      }
      gemm(false, true, n, Dk, Dv, 1.0f, P.data(), Dv, S0, Dv, 1.0f, dQ.data(), Dk);
      gemm(true, false, Dk, Dv, n, 1.0f, c.Q.data(), Dk, P.data(), Dv, 1.0f, dS0.data(), Dv);
      for (int64_t i = 0; i < n; ++i)  // dQK = D ∘ dM (in dM), dD += QK ∘ dM, both for j ≤ i
        for (int64_t j = 0; j < C; ++j) {
          float& m = dM[static_cast<size_t>(i * C + j)];
          if (j > i || j >= n) {
            m = 0.0f;
            continue;
          }
          dD[static_cast<size_t>(i * C + j)] += c.QK[static_cast<size_t>(i * C + j)] * m;
          m *= c.D[static_cast<size_t>(i * C + j)];
        }
      gemm(false, false, n, Dk, n, 1.0f, dM.data(), C, c.K.data(), Dk, 1.0f, dQ.data(), Dk);
      gemm(true, false, n, Dk, n, 1.0f, dM.data(), C, c.Q.data(), Dk, 1.0f, dK.data(), Dk);
      // U = U₀ − W S₀
      gemm(false, true, n, Dk, Dv, -1.0f, dU.data(), Dv, S0, Dv, 0.0f, dW.data(), Dk);
      gemm(true, false, Dk, Dv, n, -1.0f, c.W.data(), Dk, dU.data(), Dv, 1.0f, dS0.data(), Dv);
      // U₀ = T RV, W = T RK
      gemm(false, true, n, n, Dv, 1.0f, dU.data(), Dv, c.RV.data(), Dv, 0.0f, dT.data(), C);
      gemm(false, true, n, n, Dk, 1.0f, dW.data(), Dk, c.RK.data(), Dk, 1.0f, dT.data(), C);
      gemm(true, false, n, Dv, n, 1.0f, c.T.data(), C, dU.data(), Dv, 0.0f, dRV.data(), Dv);
      gemm(true, false, n, Dk, n, 1.0f, c.T.data(), C, dW.data(), Dk, 0.0f, dRK.data(), Dk);
      // T = (I + A)⁻¹: dA = −Tᵀ dT Tᵀ, its part below the diagonal
      gemm(true, false, n, n, n, 1.0f, c.T.data(), C, dT.data(), C, 0.0f, tmp.data(), C);
      gemm(false, true, n, n, n, -1.0f, tmp.data(), C, c.T.data(), C, 0.0f, dA.data(), C);
      // A_ij = β_i D_ij KK_ij (j < i): dβ, dD, and dKK (into dT's storage, made symmetric for KK = K Kᵀ)
      std::fill(dT.begin(), dT.end(), 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const float bi = c.beta[static_cast<size_t>(i)];
        for (int64_t j = 0; j < i; ++j) {
          const size_t ij = static_cast<size_t>(i * C + j);
          const float da = dA[ij];
          dbet[static_cast<size_t>(i)] += da * c.D[ij] * c.KK[ij];
          dD[ij] += da * bi * c.KK[ij];
          const float dkk = da * bi * c.D[ij];
          dT[ij] += dkk;
          dT[static_cast<size_t>(j * C + i)] += dkk;
        }
      }
      gemm(false, false, n, Dk, n, 1.0f, dT.data(), C, c.K.data(), Dk, 1.0f, dK.data(), Dk);
      // RV = diag(β) V, RK = diag(β γ) K
      for (int64_t i = 0; i < n; ++i) {
        const float bi = c.beta[static_cast<size_t>(i)], gi = c.gamma[static_cast<size_t>(i)];
        const int64_t row = (b * d.T + t0 + i) * d.H + h;
        for (int64_t x = 0; x < Dv; ++x) dv[row * Dv + x] = bi * dRV[static_cast<size_t>(i * Dv + x)];
        dbet[static_cast<size_t>(i)] += row_dot(dRV.data() + i * Dv, c.V.data() + i * Dv, Dv);
        const float rk = row_dot(dRK.data() + i * Dk, c.K.data() + i * Dk, Dk);
        dbet[static_cast<size_t>(i)] += gi * rk;
        dgamma[static_cast<size_t>(i)] += bi * rk;
        for (int64_t x = 0; x < Dk; ++x) dK[static_cast<size_t>(i * Dk + x)] += bi * gi * dRK[static_cast<size_t>(i * Dk + x)];
      }
      // γ_i = e^(G_i), D_ij = e^(G_i − G_j): dG; then g's, the sums of dG from each token to the chunk's end
      for (int64_t i = 0; i < n; ++i) dG[static_cast<size_t>(i)] = c.gamma[static_cast<size_t>(i)] * dgamma[static_cast<size_t>(i)];
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < i; ++j) {  // (the diagonal's D_ii = 1 moves with neither)
          const size_t ij = static_cast<size_t>(i * C + j);
          const float e = dD[ij] * c.D[ij];
          dG[static_cast<size_t>(i)] += e;
          dG[static_cast<size_t>(j)] -= e;
        }
      float after = 0.0f;
      for (int64_t i = n - 1; i >= 0; --i) {
        after += dG[static_cast<size_t>(i)];
        const int64_t row = (b * d.T + t0 + i) * d.H + h;
        dg[row] = after;
        dbeta[row] = dbet[static_cast<size_t>(i)];
        std::copy_n(dQ.data() + i * Dk, Dk, dq + row * Dk);
        std::copy_n(dK.data() + i * Dk, Dk, dk + row * Dk);
      }
      dS.swap(dS0);
    }
  }
}

}  // namespace qkv::kernels
