// The gated delta rule's recurrent form (qkv/kernels/delta_rule.hpp): one (Dk × Dv) state per head carried token by
// token, the forward, the backward through time with the state rebuilt from checkpoints every kStretch tokens, and
// the double-precision reference that keeps every state.
#include "qkv/kernels/delta_rule.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace qkv::kernels {

namespace {

constexpr int64_t kStretch = 64;  // tokens between kept states in the backward: T/64 states, not T

// Where token t of head h of sequence b starts in a (B, T, H, width) tensor
inline int64_t at(const DeltaRuleDims& d, int64_t b, int64_t t, int64_t h, int64_t width) {
  return ((b * d.T + t) * d.H + h) * width;
}

// One token on the state S (Dk × Dv, in place): S' = e^g S; m = S'ᵀ k; u = β (v − m); S = S' + k uᵀ; o = Sᵀ q.
// m and u (Dv each) are written for the backward; o may be null.
template <typename Real>
void step(const DeltaRuleDims& d, const float* q, const float* k, const float* v, float g, float beta, Real* S,
          Real* m, Real* u, Real* o) {
  const Real a = std::exp(static_cast<Real>(g));
  const int64_t Dk = d.Dk, Dv = d.Dv;
  std::fill(m, m + Dv, Real(0));
  for (int64_t i = 0; i < Dk; ++i) {
    Real* row = S + i * Dv;
    const Real ki = k[i];
    for (int64_t j = 0; j < Dv; ++j) {
      row[j] *= a;
      m[j] += row[j] * ki;
    }
  }
  for (int64_t j = 0; j < Dv; ++j) u[j] = static_cast<Real>(beta) * (static_cast<Real>(v[j]) - m[j]);
  for (int64_t i = 0; i < Dk; ++i) {
    Real* row = S + i * Dv;
    const Real ki = k[i];
    for (int64_t j = 0; j < Dv; ++j) row[j] += ki * u[j];
  }
  if (!o) return;
  std::fill(o, o + Dv, Real(0));
  for (int64_t i = 0; i < Dk; ++i) {
    const Real* row = S + i * Dv;
    const Real qi = q[i];
    for (int64_t j = 0; j < Dv; ++j) o[j] += row[j] * qi;
  }
}

// One token backward (see the header), given S_{t−1} (prev), S_t (now), m_t and u_t; dS (Dk × Dv) is the gradient
// of S_t on entry and of S_{t−1} on exit. Writes the token's dq, dk, dv, dg, dβ.
template <typename Real>
void step_backward(const DeltaRuleDims& d, const float* q, const float* k, const float* v, float g, float beta,
                   const Real* prev, const Real* now, const Real* m, const Real* u, const float* d_o, Real* dS, Real* du,
                   Real* dm, Real* dq, Real* dk, Real* dv, Real& dg, Real& dbeta) {
  const int64_t Dk = d.Dk, Dv = d.Dv;
  const Real a = std::exp(static_cast<Real>(g));
  std::fill(du, du + Dv, Real(0));
  for (int64_t i = 0; i < Dk; ++i) {
    Real* ds = dS + i * Dv;
    const Real* s = now + i * Dv;
    const Real qi = q[i], ki = k[i];
    Real dqi = 0, dki = 0;
    for (int64_t j = 0; j < Dv; ++j) {
      ds[j] += qi * d_o[j];   // o = Sᵀ q
      dqi += s[j] * d_o[j];
      dki += ds[j] * u[j];    // S = S' + k uᵀ
      du[j] += ds[j] * ki;
    }
    dq[i] = dqi;
    dk[i] = dki;
  }
  Real db = 0;
  for (int64_t j = 0; j < Dv; ++j) {
    db += du[j] * (static_cast<Real>(v[j]) - m[j]);  // u = β (v − m)
    dv[j] = static_cast<Real>(beta) * du[j];
    dm[j] = -static_cast<Real>(beta) * du[j];
  }
  dbeta = db;
  Real da = 0;
  for (int64_t i = 0; i < Dk; ++i) {
    Real* ds = dS + i * Dv;
    const Real* sp = prev + i * Dv;
    const Real ki = k[i];
    Real dki = 0;
    for (int64_t j = 0; j < Dv; ++j) {
      dki += a * sp[j] * dm[j];  // m = S'ᵀ k, S' = a S_{t−1}
      ds[j] += ki * dm[j];       // now dS'
      da += ds[j] * sp[j];
      ds[j] *= a;                // dS_{t−1} = a dS'
    }
    dk[i] += dki;
  }
  dg = da * a;  // d(e^g)/dg = e^g
}

}  // namespace

void delta_rule_forward(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g,
                        const float* beta, const float* initial, float* o, float* final_state) {
  const int64_t heads = d.B * d.H, state = d.Dk * d.Dv;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    std::vector<float> S(static_cast<size_t>(state), 0.0f), m(static_cast<size_t>(d.Dv)), u(static_cast<size_t>(d.Dv));
    if (initial) std::copy_n(initial + bh * state, state, S.data());
    for (int64_t t = 0; t < d.T; ++t) {
      const int64_t s = (b * d.T + t) * d.H + h;
      step<float>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s], beta[s],
                  S.data(), m.data(), u.data(), o + at(d, b, t, h, d.Dv));
    }
    if (final_state) std::copy_n(S.data(), state, final_state + bh * state);
  }
}

void delta_rule_backward(const DeltaRuleDims& d, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* initial, const float* d_o, float* dq, float* dk, float* dv,
                         float* dg, float* dbeta) {
  const int64_t heads = d.B * d.H, state = d.Dk * d.Dv, stretches = (d.T + kStretch - 1) / kStretch;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    // The state before every stretch, from one forward pass.
    std::vector<float> kept(static_cast<size_t>(std::max<int64_t>(stretches, 1) * state), 0.0f);
    std::vector<float> S(static_cast<size_t>(state), 0.0f), m(static_cast<size_t>(d.Dv)), u(static_cast<size_t>(d.Dv));
    if (initial) std::copy_n(initial + bh * state, state, S.data());
    for (int64_t t = 0; t < d.T; ++t) {
      if (t % kStretch == 0) std::copy_n(S.data(), state, kept.data() + (t / kStretch) * state);
      const int64_t s = (b * d.T + t) * d.H + h;
      step<float>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s], beta[s],
                  S.data(), m.data(), u.data(), static_cast<float*>(nullptr));
    }
    // Backward, stretch by stretch from the last: its states rebuilt from the kept one, then undone token by token.
    std::vector<float> states(static_cast<size_t>((kStretch + 1) * state)), ms(static_cast<size_t>(kStretch * d.Dv)),
        us(static_cast<size_t>(kStretch * d.Dv)), dS(static_cast<size_t>(state), 0.0f), du(static_cast<size_t>(d.Dv)),
        dm(static_cast<size_t>(d.Dv));
    for (int64_t c = stretches - 1; c >= 0; --c) {
      const int64_t t0 = c * kStretch, n = std::min(kStretch, d.T - t0);
      std::copy_n(kept.data() + c * state, state, states.data());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i, s = (b * d.T + t) * d.H + h;
        std::copy_n(states.data() + i * state, state, states.data() + (i + 1) * state);
        step<float>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s], beta[s],
                    states.data() + (i + 1) * state, ms.data() + i * d.Dv, us.data() + i * d.Dv, static_cast<float*>(nullptr));
      }
      for (int64_t i = n - 1; i >= 0; --i) {
        const int64_t t = t0 + i, s = (b * d.T + t) * d.H + h;
        step_backward<float>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s],
                             beta[s], states.data() + i * state, states.data() + (i + 1) * state, ms.data() + i * d.Dv,
                             us.data() + i * d.Dv, d_o + at(d, b, t, h, d.Dv), dS.data(), du.data(), dm.data(),
                             dq + at(d, b, t, h, d.Dk), dk + at(d, b, t, h, d.Dk), dv + at(d, b, t, h, d.Dv), dg[s],
                             dbeta[s]);
      }
    }
  }
}

// ---- the reference: double, every state kept, no stretches ----

void delta_rule_forward_reference(const DeltaRuleDims& d, const float* q, const float* k, const float* v,
                                  const float* g, const float* beta, const float* initial, float* o) {
  const int64_t state = d.Dk * d.Dv;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      std::vector<double> S(static_cast<size_t>(state), 0.0);
      if (initial)
        for (int64_t i = 0; i < state; ++i) S[static_cast<size_t>(i)] = initial[(b * d.H + h) * state + i];
      for (int64_t t = 0; t < d.T; ++t) {
        const float* qt = q + at(d, b, t, h, d.Dk);
        const float* kt = k + at(d, b, t, h, d.Dk);
        const float* vt = v + at(d, b, t, h, d.Dv);
        const int64_t s = (b * d.T + t) * d.H + h;
        const double a = std::exp(static_cast<double>(g[s]));
        for (double& x : S) x *= a;
        for (int64_t j = 0; j < d.Dv; ++j) {  // column j: m_j = Σ_i S'_ij k_i, u_j = β (v_j − m_j)
          double mj = 0;
          for (int64_t i = 0; i < d.Dk; ++i) mj += S[static_cast<size_t>(i * d.Dv + j)] * kt[i];
          const double uj = beta[s] * (vt[j] - mj);
          for (int64_t i = 0; i < d.Dk; ++i) S[static_cast<size_t>(i * d.Dv + j)] += kt[i] * uj;
          double oj = 0;
          for (int64_t i = 0; i < d.Dk; ++i) oj += S[static_cast<size_t>(i * d.Dv + j)] * qt[i];
          o[at(d, b, t, h, d.Dv) + j] = static_cast<float>(oj);
        }
      }
    }
}

void delta_rule_backward_reference(const DeltaRuleDims& d, const float* q, const float* k, const float* v,
                                   const float* g, const float* beta, const float* initial, const float* d_o, float* dq,
                                   float* dk, float* dv, float* dg, float* dbeta) {
  const int64_t state = d.Dk * d.Dv;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      // every state S_0 … S_T, and each token's m and u
      std::vector<double> S(static_cast<size_t>((d.T + 1) * state), 0.0), m(static_cast<size_t>(d.T * d.Dv)),
          u(static_cast<size_t>(d.T * d.Dv));
      if (initial)
        for (int64_t i = 0; i < state; ++i) S[static_cast<size_t>(i)] = initial[(b * d.H + h) * state + i];
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t s = (b * d.T + t) * d.H + h;
        std::copy_n(S.begin() + t * state, state, S.begin() + (t + 1) * state);
        step<double>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s], beta[s],
                     S.data() + (t + 1) * state, m.data() + t * d.Dv, u.data() + t * d.Dv, static_cast<double*>(nullptr));
      }
      std::vector<double> dS(static_cast<size_t>(state), 0.0), du(static_cast<size_t>(d.Dv)), dm(static_cast<size_t>(d.Dv)),
          dqt(static_cast<size_t>(d.Dk)), dkt(static_cast<size_t>(d.Dk)), dvt(static_cast<size_t>(d.Dv));
      for (int64_t t = d.T - 1; t >= 0; --t) {
        const int64_t s = (b * d.T + t) * d.H + h;
        double dgt = 0, dbt = 0;
        step_backward<double>(d, q + at(d, b, t, h, d.Dk), k + at(d, b, t, h, d.Dk), v + at(d, b, t, h, d.Dv), g[s],
                              beta[s], S.data() + t * state, S.data() + (t + 1) * state, m.data() + t * d.Dv,
                              u.data() + t * d.Dv, d_o + at(d, b, t, h, d.Dv), dS.data(), du.data(), dm.data(), dqt.data(),
                              dkt.data(), dvt.data(), dgt, dbt);
        for (int64_t i = 0; i < d.Dk; ++i) {
          dq[at(d, b, t, h, d.Dk) + i] = static_cast<float>(dqt[static_cast<size_t>(i)]);
          dk[at(d, b, t, h, d.Dk) + i] = static_cast<float>(dkt[static_cast<size_t>(i)]);
        }
        for (int64_t j = 0; j < d.Dv; ++j) dv[at(d, b, t, h, d.Dv) + j] = static_cast<float>(dvt[static_cast<size_t>(j)]);
        dg[s] = static_cast<float>(dgt);
        dbeta[s] = static_cast<float>(dbt);
      }
    }
}

}  // namespace qkv::kernels
