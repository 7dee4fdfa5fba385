// The mixture-of-experts layer's kernel (qkv/kernels/moe.hpp): routing, tokens grouped by expert so that each expert
// is three products over its tokens, the weighted sum back per token, and the backward through all of it; then the
// per-token reference in double.
//
// Forward, per expert e with its grouped tokens X_e (n_e × C):
//   G = X_e Gateᵀ, U = X_e Upᵀ (n_e × F);  H = silu(G) ∘ U;  Y = H Downᵀ (n_e × C)
//   out_t = Σ_s w_ts · Y[position(t, s)]                      (slots summed in order: no scatter races)
// Backward (dY_row = w_ts · dout_t for the row of slot (t, s)):
//   dw_ts = dout_t · Y_row;  dH = dY Down;  dDown = dYᵀ H;  dG = dH ∘ U ∘ silu'(G);  dU = dH ∘ silu(G)
//   dGate = dGᵀ X_e;  dUp = dUᵀ X_e;  dX_e = dG Gate + dU Up  → dx_t = Σ_s dX[position(t, s)] + dz_t Wr
#include "qkv/kernels/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/softmax.hpp"

namespace qkv::kernels {

namespace {

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// The k largest of p (n values), ties to the lower index, by falling value.
void top_k(const float* p, int64_t n, int64_t k, int32_t* chosen) {
  for (int64_t s = 0; s < k; ++s) {
    int32_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      if (std::find(chosen, chosen + s, static_cast<int32_t>(e)) != chosen + s) continue;
      if (best < 0 || p[e] > p[best]) best = static_cast<int32_t>(e);
    }
    chosen[s] = best;
  }
}

// Which k experts a token takes from its router scores p (E): the k largest (softmax router), or DeepSeek-V3's
// group-limited choice over p + selection_bias (MoeOptions::sigmoid).
void choose(const MoeDims& d, const MoeOptions& options, const float* p, int32_t* chosen) {
  if (!options.sigmoid) {
    top_k(p, d.E, d.k, chosen);
    return;
  }
  std::vector<float> choice(p, p + d.E);
  if (options.selection_bias)
    for (int64_t e = 0; e < d.E; ++e) choice[static_cast<size_t>(e)] += options.selection_bias[e];
  if (options.groups > 1) {  // each group scored by its two best choice values; the groups not kept score 0
    const int64_t size = d.E / options.groups;
    std::vector<float> group_score(static_cast<size_t>(options.groups));
    int32_t best[2];
    for (int64_t g = 0; g < options.groups; ++g) {
      top_k(choice.data() + g * size, size, 2, best);
      group_score[static_cast<size_t>(g)] = choice[static_cast<size_t>(g * size + best[0])] + choice[static_cast<size_t>(g * size + best[1])];
    }
    std::vector<int32_t> kept(static_cast<size_t>(options.groups_kept));
    top_k(group_score.data(), options.groups, options.groups_kept, kept.data());
    for (int64_t e = 0; e < d.E; ++e)
      if (std::find(kept.begin(), kept.end(), static_cast<int32_t>(e / size)) == kept.end()) choice[static_cast<size_t>(e)] = 0.0f;
  }
  top_k(choice.data(), d.E, d.k, chosen);
}

// The renormalisation's denominator: Σ of the chosen scores (+ 1e-20 for the sigmoid router, as transformers adds).
double chosen_total(const MoeOptions& options, const float* p, const int32_t* chosen, int64_t k) {
  double total = 0.0;
  for (int64_t s = 0; s < k; ++s) total += p[chosen[s]];
  return options.sigmoid ? total + 1e-20 : total;
}

// Routing from the probabilities: each token's experts and weights.
void route(const MoeDims& d, const MoeOptions& options, const float* probs, int32_t* experts, float* weights) {
  for (int64_t t = 0; t < d.N; ++t) {
    const float* p = probs + t * d.E;
    choose(d, options, p, experts + t * d.k);
    const double total = chosen_total(options, p, experts + t * d.k, d.k);
    for (int64_t s = 0; s < d.k; ++s) {
      const double chosen = p[experts[t * d.k + s]];
      weights[t * d.k + s] = static_cast<float>((options.norm_topk_prob ? chosen / total : chosen) * options.scaling);
    }
  }
}

// The routing's gradient: dz (N, E) from dw (N, k) through the scaling, the renormalisation and the softmax (or
// sigmoid).
void route_backward(const MoeDims& d, const MoeOptions& options, const float* probs, const int32_t* experts,
                    const float* weights, const float* dw, float* dz) {
  std::vector<double> dp(static_cast<size_t>(d.E));
  const double a = options.scaling;
  for (int64_t t = 0; t < d.N; ++t) {
    const float* p = probs + t * d.E;
    std::fill(dp.begin(), dp.end(), 0.0);
    const double total = chosen_total(options, p, experts + t * d.k, d.k);  // S
    double weighted = 0.0;  // Σ_r w_r dw_r
    for (int64_t s = 0; s < d.k; ++s) weighted += static_cast<double>(weights[t * d.k + s]) * dw[t * d.k + s];
    for (int64_t s = 0; s < d.k; ++s) {
      const int32_t e = experts[t * d.k + s];
      dp[static_cast<size_t>(e)] = options.norm_topk_prob ? (a * dw[t * d.k + s] - weighted) / total : a * dw[t * d.k + s];
    }
    if (options.sigmoid) {  // dz = dp · p (1 − p)
      for (int64_t e = 0; e < d.E; ++e) dz[t * d.E + e] = static_cast<float>(dp[static_cast<size_t>(e)] * p[e] * (1.0 - p[e]));
      continue;
    }
    double dot = 0.0;
    for (int64_t e = 0; e < d.E; ++e) dot += p[e] * dp[static_cast<size_t>(e)];
    for (int64_t e = 0; e < d.E; ++e) dz[t * d.E + e] = static_cast<float>(p[e] * (dp[static_cast<size_t>(e)] - dot));
  }
}

}  // namespace

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const float* const* gate, const float* const* up, const float* const* down, float* out,
                 MoeSaved& saved) {
  const int64_t slots = d.N * d.k;
  saved.probs.assign(static_cast<size_t>(d.N * d.E), 0.0f);
  saved.experts.assign(static_cast<size_t>(slots), 0);
  saved.weights.assign(static_cast<size_t>(slots), 0.0f);
  if (d.N <= 0) return;
  // z = x Wrᵀ (N × E), then the softmax in place
  gemm(false, true, d.N, d.E, d.C, 1.0f, x, d.C, router, d.C, 0.0f, saved.probs.data(), d.E);
  if (options.sigmoid) {
    for (float& v : saved.probs) v = 1.0f / (1.0f + std::exp(-v));  // N·E values: a scalar loop is enough
  } else {
    softmax_rows(saved.probs.data(), saved.probs.data(), d.N, d.E);
  }
  route(d, options, saved.probs.data(), saved.experts.data(), saved.weights.data());
  // Group the slots by expert, tokens in order within each group (a counting sort).
  saved.offsets.assign(static_cast<size_t>(d.E + 1), 0);
  for (int32_t e : saved.experts) ++saved.offsets[static_cast<size_t>(e) + 1];
  std::partial_sum(saved.offsets.begin(), saved.offsets.end(), saved.offsets.begin());
  saved.token_of.assign(static_cast<size_t>(slots), 0);
  saved.position.assign(static_cast<size_t>(slots), 0);
  std::vector<int64_t> next(saved.offsets.begin(), saved.offsets.end() - 1);
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t row = next[static_cast<size_t>(saved.experts[static_cast<size_t>(slot)])]++;
    saved.position[static_cast<size_t>(slot)] = row;
    saved.token_of[static_cast<size_t>(row)] = slot / d.k;
  }
  // every row is written by its expert's products: sized, not filled (a reused MoeSaved allocates nothing)
  saved.gate.resize(static_cast<size_t>(slots * d.F));
  saved.up.resize(static_cast<size_t>(slots * d.F));
  saved.y.resize(static_cast<size_t>(slots * d.C));
  std::vector<float> xs(static_cast<size_t>(slots * d.C)), h(static_cast<size_t>(slots * d.F));
  for (int64_t row = 0; row < slots; ++row)
    std::copy_n(x + saved.token_of[static_cast<size_t>(row)] * d.C, d.C, xs.data() + row * d.C);
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t r0 = saved.offsets[static_cast<size_t>(e)], n = saved.offsets[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;  // an expert no token chose costs nothing
    float* g = saved.gate.data() + r0 * d.F;
    float* u = saved.up.data() + r0 * d.F;
    float* he = h.data() + r0 * d.F;
    gemm(false, true, n, d.F, d.C, 1.0f, xs.data() + r0 * d.C, d.C, gate[e], d.C, 0.0f, g, d.F);
    gemm(false, true, n, d.F, d.C, 1.0f, xs.data() + r0 * d.C, d.C, up[e], d.C, 0.0f, u, d.F);
    silu_forward(g, he, n * d.F);  // H = silu(G) ∘ U (the vector SiLU: a scalar exp per value was a fifth of it)
    for (int64_t i = 0; i < n * d.F; ++i) he[i] *= u[i];
    gemm(false, true, n, d.C, d.F, 1.0f, he, d.F, down[e], d.F, 0.0f, saved.y.data() + r0 * d.C, d.C);
  }
  for (int64_t t = 0; t < d.N; ++t) {
    float* o = out + t * d.C;
    std::fill_n(o, d.C, 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const float w = saved.weights[static_cast<size_t>(t * d.k + s)];
      const float* y = saved.y.data() + saved.position[static_cast<size_t>(t * d.k + s)] * d.C;
      for (int64_t c = 0; c < d.C; ++c) o[c] += w * y[c];
    }
  }
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const float* const* gate, const float* const* up, const float* const* down, const MoeSaved& saved,
                  const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                  float* const* d_down) {
  const int64_t slots = d.N * d.k;
  auto zero_expert = [&](int64_t e) {
    if (d_gate && d_gate[e]) std::fill_n(d_gate[e], d.F * d.C, 0.0f);
    if (d_up && d_up[e]) std::fill_n(d_up[e], d.F * d.C, 0.0f);
    if (d_down && d_down[e]) std::fill_n(d_down[e], d.C * d.F, 0.0f);
  };
  if (d.N <= 0) {
    for (int64_t e = 0; e < d.E; ++e) zero_expert(e);
    if (d_router) std::fill_n(d_router, d.E * d.C, 0.0f);
    return;
  }
  // dw_ts = dout_t · y_row and dY_row = w_ts · dout_t
  std::vector<float> dw(static_cast<size_t>(slots)), dy(static_cast<size_t>(slots * d.C));
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t t = slot / d.k, row = saved.position[static_cast<size_t>(slot)];
    const float* y = saved.y.data() + row * d.C;
    const float* g = d_out + t * d.C;
    const float w = saved.weights[static_cast<size_t>(slot)];
    double dot = 0.0;
    for (int64_t c = 0; c < d.C; ++c) {
      dot += static_cast<double>(g[c]) * y[c];
      dy[static_cast<size_t>(row * d.C + c)] = w * g[c];
    }
    dw[static_cast<size_t>(slot)] = static_cast<float>(dot);
  }
  std::vector<float> xs(static_cast<size_t>(slots * d.C)), dxs(static_cast<size_t>(slots * d.C));
  std::vector<float> h(static_cast<size_t>(slots * d.F)), dh(static_cast<size_t>(slots * d.F));
  std::vector<float> dg(static_cast<size_t>(slots * d.F)), du(static_cast<size_t>(slots * d.F));
  for (int64_t row = 0; row < slots; ++row)
    std::copy_n(x + saved.token_of[static_cast<size_t>(row)] * d.C, d.C, xs.data() + row * d.C);
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t r0 = saved.offsets[static_cast<size_t>(e)], n = saved.offsets[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) {
      zero_expert(e);
      continue;
    }
    const float* g = saved.gate.data() + r0 * d.F;
    const float* u = saved.up.data() + r0 * d.F;
    float *he = h.data() + r0 * d.F, *dhe = dh.data() + r0 * d.F, *dge = dg.data() + r0 * d.F, *due = du.data() + r0 * d.F;
    const float* xe = xs.data() + r0 * d.C;
    const float* dye = dy.data() + r0 * d.C;
    // dH = dY Down (n × F); H recomputed from the saved G and U
    gemm(false, false, n, d.F, d.C, 1.0f, dye, d.C, down[e], d.F, 0.0f, dhe, d.F);
    // silu(G) into he, then H = silu(G) ∘ U and dU = dH ∘ silu(G); dG = (dH ∘ U) ∘ silu'(G) by the SiLU's backward
    silu_forward(g, he, n * d.F);
    for (int64_t i = 0; i < n * d.F; ++i) {
      due[i] = dhe[i] * he[i];
      he[i] *= u[i];
      dhe[i] *= u[i];
    }
    silu_backward(g, dhe, dge, n * d.F, /*accumulate=*/false);
    if (d_down && d_down[e]) gemm(true, false, d.C, d.F, n, 1.0f, dye, d.C, he, d.F, 0.0f, d_down[e], d.F);  // dYᵀ H
    if (d_gate && d_gate[e]) gemm(true, false, d.F, d.C, n, 1.0f, dge, d.F, xe, d.C, 0.0f, d_gate[e], d.C);  // dGᵀ X
    if (d_up && d_up[e]) gemm(true, false, d.F, d.C, n, 1.0f, due, d.F, xe, d.C, 0.0f, d_up[e], d.C);        // dUᵀ X
    if (dx) {  // dX_e = dG Gate + dU Up
      gemm(false, false, n, d.C, d.F, 1.0f, dge, d.F, gate[e], d.C, 0.0f, dxs.data() + r0 * d.C, d.C);
      gemm(false, false, n, d.C, d.F, 1.0f, due, d.F, up[e], d.C, 1.0f, dxs.data() + r0 * d.C, d.C);
    }
  }
  // Through the router: dz (N × E), then d_router = dzᵀ X and dx = Σ_s dX[position] + dz Wr
  std::vector<float> dz(static_cast<size_t>(d.N * d.E));
  route_backward(d, options, saved.probs.data(), saved.experts.data(), saved.weights.data(), dw.data(), dz.data());
  if (d_router) gemm(true, false, d.E, d.C, d.N, 1.0f, dz.data(), d.E, x, d.C, 0.0f, d_router, d.C);
  if (dx) {
    gemm(false, false, d.N, d.C, d.E, 1.0f, dz.data(), d.E, router, d.C, 0.0f, dx, d.C);
    for (int64_t t = 0; t < d.N; ++t)
      for (int64_t s = 0; s < d.k; ++s) {
        const float* src = dxs.data() + saved.position[static_cast<size_t>(t * d.k + s)] * d.C;
        for (int64_t c = 0; c < d.C; ++c) dx[t * d.C + c] += src[c];
      }
  }
}

// ---- the reference: one token at a time, in double ----

namespace {

struct ReferenceRoute {
  std::vector<double> p;        // (E) softmax
  std::vector<int32_t> chosen;  // (k)
  std::vector<double> w;        // (k)
};

ReferenceRoute reference_route(const MoeDims& d, const MoeOptions& options, const float* x, const float* router) {
  ReferenceRoute r;
  r.p.assign(static_cast<size_t>(d.E), 0.0);
  double mx = -INFINITY;
  for (int64_t e = 0; e < d.E; ++e) {
    double z = 0.0;
    for (int64_t c = 0; c < d.C; ++c) z += static_cast<double>(x[c]) * router[e * d.C + c];
    r.p[static_cast<size_t>(e)] = z;
    mx = std::max(mx, z);
  }
  if (options.sigmoid) {
    for (double& v : r.p) v = sigmoid(v);
  } else {
    double sum = 0.0;
    for (double& v : r.p) sum += (v = std::exp(v - mx));
    for (double& v : r.p) v /= sum;
  }
  std::vector<float> pf(r.p.begin(), r.p.end());  // chosen on the float probabilities, as the kernel chooses
  r.chosen.assign(static_cast<size_t>(d.k), 0);
  choose(d, options, pf.data(), r.chosen.data());
  double total = options.sigmoid ? 1e-20 : 0.0;
  for (int32_t e : r.chosen) total += r.p[static_cast<size_t>(e)];
  for (int32_t e : r.chosen)
    r.w.push_back((options.norm_topk_prob ? r.p[static_cast<size_t>(e)] / total : r.p[static_cast<size_t>(e)]) * options.scaling);
  return r;
}

// One expert on one token: g, u (F), h (F) and y (C)
struct ReferenceExpert {
  std::vector<double> g, u, h, y;
};
ReferenceExpert reference_expert(const MoeDims& d, const float* x, const float* gate, const float* up, const float* down) {
  ReferenceExpert r;
  r.g.assign(static_cast<size_t>(d.F), 0.0);
  r.u.assign(static_cast<size_t>(d.F), 0.0);
  r.h.assign(static_cast<size_t>(d.F), 0.0);
  r.y.assign(static_cast<size_t>(d.C), 0.0);
  for (int64_t f = 0; f < d.F; ++f) {
    for (int64_t c = 0; c < d.C; ++c) {
      r.g[static_cast<size_t>(f)] += static_cast<double>(gate[f * d.C + c]) * x[c];
      r.u[static_cast<size_t>(f)] += static_cast<double>(up[f * d.C + c]) * x[c];
    }
    const double g = r.g[static_cast<size_t>(f)];
    r.h[static_cast<size_t>(f)] = g * sigmoid(g) * r.u[static_cast<size_t>(f)];
  }
  for (int64_t c = 0; c < d.C; ++c)
    for (int64_t f = 0; f < d.F; ++f) r.y[static_cast<size_t>(c)] += static_cast<double>(down[c * d.F + f]) * r.h[static_cast<size_t>(f)];
  return r;
}

}  // namespace

void moe_forward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                           const float* const* gate, const float* const* up, const float* const* down, float* out) {
  for (int64_t t = 0; t < d.N; ++t) {
    const float* xt = x + t * d.C;
    const ReferenceRoute r = reference_route(d, options, xt, router);
    std::vector<double> o(static_cast<size_t>(d.C), 0.0);
    for (int64_t s = 0; s < d.k; ++s) {
      const int32_t e = r.chosen[static_cast<size_t>(s)];
      const ReferenceExpert ex = reference_expert(d, xt, gate[e], up[e], down[e]);
      for (int64_t c = 0; c < d.C; ++c) o[static_cast<size_t>(c)] += r.w[static_cast<size_t>(s)] * ex.y[static_cast<size_t>(c)];
    }
    for (int64_t c = 0; c < d.C; ++c) out[t * d.C + c] = static_cast<float>(o[static_cast<size_t>(c)]);
  }
}

void moe_backward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                            const float* const* gate, const float* const* up, const float* const* down,
                            const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                            float* const* d_down) {
  std::vector<double> dr(static_cast<size_t>(d.E * d.C), 0.0);
  std::vector<std::vector<double>> dgate(static_cast<size_t>(d.E), std::vector<double>(static_cast<size_t>(d.F * d.C), 0.0));
  std::vector<std::vector<double>> dup = dgate, ddown = dgate;
  for (int64_t t = 0; t < d.N; ++t) {
    const float* xt = x + t * d.C;
    const float* g_out = d_out + t * d.C;
    const ReferenceRoute r = reference_route(d, options, xt, router);
    std::vector<double> dxt(static_cast<size_t>(d.C), 0.0), dp(static_cast<size_t>(d.E), 0.0), dw(static_cast<size_t>(d.k));
    for (int64_t s = 0; s < d.k; ++s) {
      const int32_t e = r.chosen[static_cast<size_t>(s)];
      const ReferenceExpert ex = reference_expert(d, xt, gate[e], up[e], down[e]);
      const double w = r.w[static_cast<size_t>(s)];
      double dot = 0.0;
      for (int64_t c = 0; c < d.C; ++c) dot += g_out[c] * ex.y[static_cast<size_t>(c)];
      dw[static_cast<size_t>(s)] = dot;
      // the expert: dy = w · dout; dh = Downᵀ dy; dg = dh · u · silu'(g); du = dh · silu(g)
      for (int64_t f = 0; f < d.F; ++f) {
        double dh = 0.0;
        for (int64_t c = 0; c < d.C; ++c) {
          dh += w * g_out[c] * down[e][c * d.F + f];
          ddown[static_cast<size_t>(e)][static_cast<size_t>(c * d.F + f)] += w * g_out[c] * ex.h[static_cast<size_t>(f)];
        }
        const double g = ex.g[static_cast<size_t>(f)], sg = sigmoid(g);
        const double dgf = dh * ex.u[static_cast<size_t>(f)] * sg * (1.0 + g * (1.0 - sg)), duf = dh * g * sg;
        for (int64_t c = 0; c < d.C; ++c) {
          dgate[static_cast<size_t>(e)][static_cast<size_t>(f * d.C + c)] += dgf * xt[c];
          dup[static_cast<size_t>(e)][static_cast<size_t>(f * d.C + c)] += duf * xt[c];
          dxt[static_cast<size_t>(c)] += dgf * gate[e][f * d.C + c] + duf * up[e][f * d.C + c];
        }
      }
    }
    // the router, straight from w_s = p_s / Σ_r p_r (or p_s) and p = softmax(z)
    double total = options.sigmoid ? 1e-20 : 0.0;
    for (int32_t e : r.chosen) total += r.p[static_cast<size_t>(e)];
    const double a = options.scaling;
    for (int64_t s = 0; s < d.k; ++s) {
      const int32_t e = r.chosen[static_cast<size_t>(s)];
      if (!options.norm_topk_prob) {
        dp[static_cast<size_t>(e)] += a * dw[static_cast<size_t>(s)];
        continue;
      }
      for (int64_t q = 0; q < d.k; ++q) {  // ∂w_q/∂p_e = a·([q = s]/S − p_q/S²)
        const double pq = r.p[static_cast<size_t>(r.chosen[static_cast<size_t>(q)])];
        dp[static_cast<size_t>(e)] += a * dw[static_cast<size_t>(q)] * ((q == s ? 1.0 : 0.0) / total - pq / (total * total));
      }
    }
    for (int64_t e = 0; e < d.E; ++e) {
      double dz = 0.0;  // softmax: ∂p_j/∂z_e = p_j([j = e] − p_e); sigmoid: ∂p_j/∂z_e = [j = e] p_e (1 − p_e)
      if (options.sigmoid) {
        dz = dp[static_cast<size_t>(e)] * r.p[static_cast<size_t>(e)] * (1.0 - r.p[static_cast<size_t>(e)]);
      } else {
        for (int64_t j = 0; j < d.E; ++j)
          dz += dp[static_cast<size_t>(j)] * r.p[static_cast<size_t>(j)] * ((j == e ? 1.0 : 0.0) - r.p[static_cast<size_t>(e)]);
      }
      for (int64_t c = 0; c < d.C; ++c) {
        dr[static_cast<size_t>(e * d.C + c)] += dz * xt[c];
        dxt[static_cast<size_t>(c)] += dz * router[e * d.C + c];
      }
    }
    if (dx)
      for (int64_t c = 0; c < d.C; ++c) dx[t * d.C + c] = static_cast<float>(dxt[static_cast<size_t>(c)]);
  }
  auto store = [](const std::vector<double>& from, float* to) {
    if (to) std::transform(from.begin(), from.end(), to, [](double v) { return static_cast<float>(v); });
  };
  store(dr, d_router);
  for (int64_t e = 0; e < d.E; ++e) {
    if (d_gate) store(dgate[static_cast<size_t>(e)], d_gate[e]);
    if (d_up) store(dup[static_cast<size_t>(e)], d_up[e]);
    if (d_down) store(ddown[static_cast<size_t>(e)], d_down[e]);
  }
}

}  // namespace qkv::kernels
