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
#include <stdexcept>
#include <string>
#include <tuple>

#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/softmax.hpp"
#include "qkv/kernels/weights.hpp"

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

// Routing from the router's scores: each token's experts and weights.
void route(const MoeDims& d, const MoeOptions& options, const float* probs, int32_t* experts, float* weights) {
  for (int64_t t = 0; t < d.N; ++t) {
    const float* p = probs + t * d.E;
    int32_t* chosen = experts + t * d.k;
    choose(d, options, p, chosen);
    if (options.top_k_then_softmax) {  // gpt-oss: the softmax of the k chosen logits (the largest is the first)
      double total = 0.0;
      for (int64_t s = 0; s < d.k; ++s) total += std::exp(static_cast<double>(p[chosen[s]]) - p[chosen[0]]);
      for (int64_t s = 0; s < d.k; ++s)
        weights[t * d.k + s] = static_cast<float>(std::exp(static_cast<double>(p[chosen[s]]) - p[chosen[0]]) / total * options.scaling);
      continue;
    }
    const double total = chosen_total(options, p, chosen, d.k);
    for (int64_t s = 0; s < d.k; ++s) {
      const double value = p[chosen[s]];
      weights[t * d.k + s] = static_cast<float>((options.norm_topk_prob ? value / total : value) * options.scaling);
    }
  }
}

// The routing's gradient: dz (N, E) from dw (N, k) through the scaling, the renormalisation and the softmax (or
// sigmoid; gpt-oss's softmax of the chosen: dz_s = a·w_s (dw_s − Σ_r w_r dw_r) with w the softmax, 0 elsewhere).
void route_backward(const MoeDims& d, const MoeOptions& options, const float* probs, const int32_t* experts,
                    const float* weights, const float* dw, float* dz) {
  std::vector<double> dp(static_cast<size_t>(d.E));
  const double a = options.scaling;
  for (int64_t t = 0; t < d.N; ++t) {
    const float* p = probs + t * d.E;
    if (options.top_k_then_softmax) {
      std::fill_n(dz + t * d.E, d.E, 0.0f);
      double weighted = 0.0;  // Σ_r softmax_r dw_r
      for (int64_t s = 0; s < d.k; ++s) weighted += static_cast<double>(weights[t * d.k + s]) / a * dw[t * d.k + s];
      for (int64_t s = 0; s < d.k; ++s)
        dz[t * d.E + experts[t * d.k + s]] = static_cast<float>(weights[t * d.k + s] * (dw[t * d.k + s] - weighted));
      continue;
    }
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

// Where the experts' weights live: one tensor per expert and projection, or a layer's stacked tensors (gpt-oss)
struct Experts {
  const float* const* gate = nullptr;
  const float* const* up = nullptr;
  const float* const* down = nullptr;
  const MoeStacked* stacked = nullptr;
  const MoeStackedStored* stacked_stored = nullptr;  // or stacked and stored (inference)
  // or each expert's matrices as stored (inference): multiplied by gemm_weight
  const WeightView* gate_stored = nullptr;
  const WeightView* up_stored = nullptr;
  const WeightView* down_stored = nullptr;
  const MoeExpertLora* lora = nullptr;  // adapters on one-tensor-per-expert projections (float32 or stored)
};
struct ExpertGrads {
  float* const* gate = nullptr;
  float* const* up = nullptr;
  float* const* down = nullptr;
  const MoeStackedGrads* stacked = nullptr;
  MoeExpertLoraGrads lora;
};

// ---- LoRA on the experts: a rank-r side path per expert, beside its product ----

// One adapted projection of every expert: stacked (MoeStackedLora: A (r·E × in), B (out × r·E), B_e's columns
// interleaved by expert) or a pair per expert (MoeLoraList: A_e (r × in), B_e (out × r), null where none)
struct LoraPart {
  const float* a = nullptr;
  const float* b = nullptr;
  const float* const* a_list = nullptr;
  const float* const* b_list = nullptr;
  int64_t r = 0;
  float scale = 0.0f;
  int64_t in = 0, out = 0, E = 0;
  explicit operator bool() const { return r > 0 && (a != nullptr || a_list != nullptr); }
  bool has(int64_t e) const { return r > 0 && (a_list ? a_list[e] != nullptr : a != nullptr); }
  const float* a_of(int64_t e) const { return a_list ? a_list[e] : a + e * r * in; }  // A_e: r contiguous rows
  double b_at(int64_t e, int64_t o, int64_t k) const { return b_list ? b_list[e][o * r + k] : b[(o * r + k) * E + e]; }
  // B_e (out × r): in place for a pair per expert, gathered into `scratch` for the stacked B
  const float* b_of(int64_t e, std::vector<float>& scratch) const {
    if (b_list) return b_list[e];
    scratch.resize(static_cast<size_t>(out * r));
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < r; ++k) scratch[static_cast<size_t>(o * r + k)] = b[(o * r + k) * E + e];
    return scratch.data();
  }
};
// Where a part's gradients go, in the same layout
struct LoraPartGrads {
  float* a = nullptr;
  float* b = nullptr;
  float* const* a_list = nullptr;
  float* const* b_list = nullptr;
  float* a_of(const LoraPart& l, int64_t e) const {
    return a_list ? a_list[e] : a ? a + e * l.r * l.in : nullptr;
  }
  bool wants_b(int64_t e) const { return b_list ? b_list[e] != nullptr : b != nullptr; }
  // B_e's gradient (out × r; null: zeros) stored
  void store_b(const LoraPart& l, int64_t e, const float* be) const {
    if (b_list) {
      if (!b_list[e]) return;
      if (be) std::copy_n(be, l.out * l.r, b_list[e]);
      else std::fill_n(b_list[e], l.out * l.r, 0.0f);
      return;
    }
    if (!b) return;
    for (int64_t o = 0; o < l.out; ++o)
      for (int64_t k = 0; k < l.r; ++k) b[(o * l.r + k) * l.E + e] = be ? be[o * l.r + k] : 0.0f;
  }
};
LoraPart gate_up_part(const MoeStackedLora* l, const MoeDims& d) {
  if (!l) return {};
  return {l->gate_up_a, l->gate_up_b, nullptr, nullptr, l->gate_up_rank, l->gate_up_scale, d.C, 2 * d.F, d.E};
}
LoraPart down_part(const MoeStackedLora* l, const MoeDims& d) {
  if (!l) return {};
  return {l->down_a, l->down_b, nullptr, nullptr, l->down_rank, l->down_scale, d.F, d.C, d.E};
}
LoraPart list_part(const MoeExpertLora* l, const MoeLoraList MoeExpertLora::*which, int64_t in, int64_t out, int64_t E) {
  if (!l) return {};
  const MoeLoraList& list = l->*which;
  return {nullptr, nullptr, list.a, list.b, list.rank, list.scale, in, out, E};
}

// A layer's adapters as forward() and backward() run them: gpt-oss's stacked gate_up and down, or each expert's gate,
// up and down (`down` is whichever of the two the experts have); parts the experts lack are empty
struct Adapters {
  LoraPart gate_up, gate, up, down;
};
Adapters adapters_of(const Experts& w, const MoeDims& d) {
  const MoeStackedLora* stacked = w.stacked ? w.stacked->lora : w.stacked_stored ? w.stacked_stored->lora : nullptr;
  if (w.stacked || w.stacked_stored) return {gate_up_part(stacked, d), {}, {}, down_part(stacked, d)};
  return {{}, list_part(w.lora, &MoeExpertLora::gate, d.C, d.F, d.E), list_part(w.lora, &MoeExpertLora::up, d.C, d.F, d.E),
          list_part(w.lora, &MoeExpertLora::down, d.F, d.C, d.E)};
}
// … and where their gradients go
struct AdapterGrads {
  LoraPartGrads gate_up, gate, up, down;
};
AdapterGrads adapter_grads_of(const ExpertGrads& g) {
  if (g.stacked) {
    const MoeStackedLoraGrads& l = g.stacked->lora;
    return {{l.gate_up_a, l.gate_up_b}, {}, {}, {l.down_a, l.down_b}};
  }
  const MoeExpertLoraGrads& l = g.lora;
  return {{}, {nullptr, nullptr, l.gate_a, l.gate_b}, {nullptr, nullptr, l.up_a, l.up_b}, {nullptr, nullptr, l.down_a, l.down_b}};
}

// Scratch for the side path, reused across experts
struct LoraScratch {
  std::vector<float> t, u, be, dbe;  // x A_eᵀ (n × r), dy B_e (n × r), B_e and its gradient (out × r)
};

// y (n × out, row stride ldy) += scale · (x A_eᵀ) B_eᵀ for x (n × in)
void lora_forward(const LoraPart& l, int64_t e, const float* x, int64_t n, float* y, int64_t ldy, LoraScratch& s) {
  if (!l.has(e)) return;
  s.t.resize(static_cast<size_t>(n * l.r));
  gemm(false, true, n, l.r, l.in, 1.0f, x, l.in, l.a_of(e), l.in, 0.0f, s.t.data(), l.r);
  gemm(false, true, n, l.out, l.r, l.scale, s.t.data(), l.r, l.b_of(e, s.be), l.r, 1.0f, y, ldy);
}
// From dy (n × out): u = dy B_e into the scratch, and dx (n × in, row stride in) += scale · u A_e when dx is set
void lora_input_grad(const LoraPart& l, int64_t e, const float* dy, int64_t n, int64_t ldy, float* dx, LoraScratch& s) {
  if (!l.has(e)) return;
  s.u.resize(static_cast<size_t>(n * l.r));
  gemm(false, false, n, l.r, l.out, 1.0f, dy, ldy, l.b_of(e, s.be), l.r, 0.0f, s.u.data(), l.r);
  if (dx) gemm(false, false, n, l.in, l.r, l.scale, s.u.data(), l.r, l.a_of(e), l.in, 1.0f, dx, l.in);
}
// … then, with the u above: dA_e = scale · uᵀ x and dB_e = scale · dyᵀ (x A_eᵀ)
void lora_weight_grads(const LoraPart& l, int64_t e, const float* x, const float* dy, int64_t n, int64_t ldy,
                       const LoraPartGrads& g, LoraScratch& s) {
  if (!l.has(e)) return;
  if (float* da = g.a_of(l, e)) gemm(true, false, l.r, l.in, n, l.scale, s.u.data(), l.r, x, l.in, 0.0f, da, l.in);
  if (!g.wants_b(e)) return;
  s.t.resize(static_cast<size_t>(n * l.r));
  s.dbe.resize(static_cast<size_t>(l.out * l.r));
  gemm(false, true, n, l.r, l.in, 1.0f, x, l.in, l.a_of(e), l.in, 0.0f, s.t.data(), l.r);
  gemm(true, false, l.out, l.r, n, l.scale, dy, ldy, s.t.data(), l.r, 0.0f, s.dbe.data(), l.r);
  g.store_b(l, e, s.dbe.data());
}
// An expert no token chose: zeros for its A and B
void lora_zero_grads(const LoraPart& l, int64_t e, const LoraPartGrads& g) {
  if (!l.has(e)) return;
  if (float* da = g.a_of(l, e)) std::fill_n(da, l.r * l.in, 0.0f);
  g.store_b(l, e, nullptr);
}

// H = act(G, U) over n values: silu(G) ∘ U, or gpt-oss's clamped form (MoeOptions::swiglu_limit).
void activate(const MoeOptions& o, const float* g, const float* u, float* h, int64_t n) {
  if (o.swiglu_limit <= 0.0f) {
    silu_forward(g, h, n);  // the vector SiLU: a scalar exp per value was a fifth of the forward
    for (int64_t i = 0; i < n; ++i) h[i] *= u[i];
    return;
  }
  const float limit = o.swiglu_limit, alpha = o.swiglu_alpha;
  for (int64_t i = 0; i < n; ++i) {
    const float gc = std::min(g[i], limit), uc = std::clamp(u[i], -limit, limit);
    h[i] = gc / (1.0f + std::exp(-alpha * gc)) * (uc + 1.0f);
  }
}

// From dH: dG and dU, and H itself (for the down projection's gradient). dh is overwritten.
void activate_backward(const MoeOptions& o, const float* g, const float* u, float* dh, float* h, float* dg, float* du,
                       int64_t n) {
  if (o.swiglu_limit <= 0.0f) {  // silu(G) into h, then H = silu(G) ∘ U and dU = dH ∘ silu(G); dG by SiLU's backward
    silu_forward(g, h, n);
    for (int64_t i = 0; i < n; ++i) {
      du[i] = dh[i] * h[i];
      h[i] *= u[i];
      dh[i] *= u[i];
    }
    silu_backward(g, dh, dg, n, /*accumulate=*/false);
    return;
  }
  // The clamps pass the gradient where the value lies within them (bounds included, as torch.clamp's backward).
  const float limit = o.swiglu_limit, alpha = o.swiglu_alpha;
  for (int64_t i = 0; i < n; ++i) {
    const float gc = std::min(g[i], limit), uc = std::clamp(u[i], -limit, limit);
    const float sg = 1.0f / (1.0f + std::exp(-alpha * gc)), glu = gc * sg;
    h[i] = glu * (uc + 1.0f);
    du[i] = u[i] >= -limit && u[i] <= limit ? dh[i] * glu : 0.0f;
    dg[i] = g[i] <= limit ? dh[i] * (uc + 1.0f) * (sg + alpha * gc * sg * (1.0f - sg)) : 0.0f;
  }
}

void forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
             const float* router_bias, const Experts& w, float* out, MoeSaved& saved) {
  const int64_t slots = d.N * d.k;
  saved.probs.assign(static_cast<size_t>(d.N * d.E), 0.0f);
  saved.experts.assign(static_cast<size_t>(slots), 0);
  saved.weights.assign(static_cast<size_t>(slots), 0.0f);
  if (d.N <= 0) return;
  // z = x Wrᵀ (+ b) (N × E), then the softmax or sigmoid in place (gpt-oss's router keeps the logits)
  gemm(false, true, d.N, d.E, d.C, 1.0f, x, d.C, router, d.C, 0.0f, saved.probs.data(), d.E);
  if (router_bias)
    for (int64_t t = 0; t < d.N; ++t)
      for (int64_t e = 0; e < d.E; ++e) saved.probs[static_cast<size_t>(t * d.E + e)] += router_bias[e];
  if (options.sigmoid) {
    for (float& v : saved.probs) v = 1.0f / (1.0f + std::exp(-v));  // N·E values: a scalar loop is enough
  } else if (!options.top_k_then_softmax) {
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
  const bool stacked = w.stacked || w.stacked_stored;
  std::vector<float> gate_up(stacked ? static_cast<size_t>(slots * 2 * d.F) : 0);
  for (int64_t row = 0; row < slots; ++row)
    std::copy_n(x + saved.token_of[static_cast<size_t>(row)] * d.C, d.C, xs.data() + row * d.C);
  const Adapters lora = adapters_of(w, d);
  LoraScratch scratch;
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t r0 = saved.offsets[static_cast<size_t>(e)], n = saved.offsets[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;  // an expert no token chose costs nothing
    float* g = saved.gate.data() + r0 * d.F;
    float* u = saved.up.data() + r0 * d.F;
    float* he = h.data() + r0 * d.F;
    float* y = saved.y.data() + r0 * d.C;
    const float* xe = xs.data() + r0 * d.C;
    if (stacked) {  // one product for gate and up (alternating), then the biases, split
      float* gu = gate_up.data() + r0 * 2 * d.F;
      const float* b;
      if (w.stacked) {
        gemm(false, false, n, 2 * d.F, d.C, 1.0f, xe, d.C, w.stacked->gate_up + e * d.C * 2 * d.F, 2 * d.F, 0.0f, gu,
             2 * d.F);
        b = w.stacked->gate_up_bias;
      } else {
        gemm_weight(w.stacked_stored->gate_up[e], n, xe, d.C, 0.0f, gu, 2 * d.F);
        b = w.stacked_stored->gate_up_bias;
      }
      lora_forward(lora.gate_up, e, xe, n, gu, 2 * d.F, scratch);
      if (b) b += e * 2 * d.F;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < d.F; ++f) {
          g[i * d.F + f] = gu[i * 2 * d.F + 2 * f] + (b ? b[2 * f] : 0.0f);
          u[i * d.F + f] = gu[i * 2 * d.F + 2 * f + 1] + (b ? b[2 * f + 1] : 0.0f);
        }
    } else if (w.gate_stored) {  // the chosen experts' rows read in place, in their own format
      gemm_weight(w.gate_stored[e], n, xe, d.C, 0.0f, g, d.F);
      gemm_weight(w.up_stored[e], n, xe, d.C, 0.0f, u, d.F);
    } else {
      gemm(false, true, n, d.F, d.C, 1.0f, xe, d.C, w.gate[e], d.C, 0.0f, g, d.F);
      gemm(false, true, n, d.F, d.C, 1.0f, xe, d.C, w.up[e], d.C, 0.0f, u, d.F);
    }
    lora_forward(lora.gate, e, xe, n, g, d.F, scratch);
    lora_forward(lora.up, e, xe, n, u, d.F, scratch);
    activate(options, g, u, he, n * d.F);
    if (stacked) {
      const float* down_bias;
      if (w.stacked) {
        gemm(false, false, n, d.C, d.F, 1.0f, he, d.F, w.stacked->down + e * d.F * d.C, d.C, 0.0f, y, d.C);
        down_bias = w.stacked->down_bias;
      } else {
        gemm_weight(w.stacked_stored->down[e], n, he, d.F, 0.0f, y, d.C);
        down_bias = w.stacked_stored->down_bias;
      }
      lora_forward(lora.down, e, he, n, y, d.C, scratch);  // before the bias
      if (down_bias)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t c = 0; c < d.C; ++c) y[i * d.C + c] += down_bias[e * d.C + c];
    } else if (w.down_stored) {
      gemm_weight(w.down_stored[e], n, he, d.F, 0.0f, y, d.C);
    } else {
      gemm(false, true, n, d.C, d.F, 1.0f, he, d.F, w.down[e], d.F, 0.0f, y, d.C);
    }
    if (!stacked) lora_forward(lora.down, e, he, n, y, d.C, scratch);
  }
  for (int64_t t = 0; t < d.N; ++t) {
    float* o = out + t * d.C;
    std::fill_n(o, d.C, 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const float wt = saved.weights[static_cast<size_t>(t * d.k + s)];
      const float* y = saved.y.data() + saved.position[static_cast<size_t>(t * d.k + s)] * d.C;
      for (int64_t c = 0; c < d.C; ++c) o[c] = std::fma(wt, y[c], o[c]);  // one rounding, whatever the compiler contracts
    }
  }
}

void backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router, const Experts& w,
              const MoeSaved& saved, const float* d_out, float* dx, float* d_router, float* d_router_bias,
              const ExpertGrads& dw_experts) {
  const int64_t slots = d.N * d.k;
  const MoeStackedGrads* ds = dw_experts.stacked;
  const Adapters lora = adapters_of(w, d);
  const AdapterGrads d_lora = adapter_grads_of(dw_experts);
  LoraScratch scratch;
  auto zero_expert = [&](int64_t e) {
    lora_zero_grads(lora.gate_up, e, d_lora.gate_up);
    lora_zero_grads(lora.gate, e, d_lora.gate);
    lora_zero_grads(lora.up, e, d_lora.up);
    lora_zero_grads(lora.down, e, d_lora.down);
    if (ds) {
      if (ds->gate_up) std::fill_n(ds->gate_up + e * d.C * 2 * d.F, d.C * 2 * d.F, 0.0f);
      if (ds->gate_up_bias) std::fill_n(ds->gate_up_bias + e * 2 * d.F, 2 * d.F, 0.0f);
      if (ds->down) std::fill_n(ds->down + e * d.F * d.C, d.F * d.C, 0.0f);
      if (ds->down_bias) std::fill_n(ds->down_bias + e * d.C, d.C, 0.0f);
      return;
    }
    if (dw_experts.gate && dw_experts.gate[e]) std::fill_n(dw_experts.gate[e], d.F * d.C, 0.0f);
    if (dw_experts.up && dw_experts.up[e]) std::fill_n(dw_experts.up[e], d.F * d.C, 0.0f);
    if (dw_experts.down && dw_experts.down[e]) std::fill_n(dw_experts.down[e], d.C * d.F, 0.0f);
  };
  if (d.N <= 0) {
    for (int64_t e = 0; e < d.E; ++e) zero_expert(e);
    if (d_router) std::fill_n(d_router, d.E * d.C, 0.0f);
    if (d_router_bias) std::fill_n(d_router_bias, d.E, 0.0f);
    return;
  }
  // dw_ts = dout_t · y_row and dY_row = w_ts · dout_t
  std::vector<float> dw(static_cast<size_t>(slots)), dy(static_cast<size_t>(slots * d.C));
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t t = slot / d.k, row = saved.position[static_cast<size_t>(slot)];
    const float* y = saved.y.data() + row * d.C;
    const float* g = d_out + t * d.C;
    const float wt = saved.weights[static_cast<size_t>(slot)];
    double dot = 0.0;
    for (int64_t c = 0; c < d.C; ++c) {
      dot += static_cast<double>(g[c]) * y[c];
      dy[static_cast<size_t>(row * d.C + c)] = wt * g[c];
    }
    dw[static_cast<size_t>(slot)] = static_cast<float>(dot);
  }
  std::vector<float> xs(static_cast<size_t>(slots * d.C)), dxs(static_cast<size_t>(slots * d.C));
  std::vector<float> h(static_cast<size_t>(slots * d.F)), dh(static_cast<size_t>(slots * d.F));
  std::vector<float> dg(static_cast<size_t>(slots * d.F)), du(static_cast<size_t>(slots * d.F));
  const bool stacked = w.stacked || w.stacked_stored;
  std::vector<float> dgu(stacked ? static_cast<size_t>(slots * 2 * d.F) : 0);
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
    float* dxe = dxs.data() + r0 * d.C;
    if (w.stacked) {  // dH = dY Downᵀ, Down (F, C) used as h·Down
      gemm(false, true, n, d.F, d.C, 1.0f, dye, d.C, w.stacked->down + e * d.F * d.C, d.C, 0.0f, dhe, d.F);
    } else if (w.stacked_stored) {  // Down's rows (C × F) as stored: dH = dY Down
      gemm_weight_backward(w.stacked_stored->down[e], n, dye, d.C, 0.0f, dhe, d.F);
    } else if (w.down_stored) {
      gemm_weight_backward(w.down_stored[e], n, dye, d.C, 0.0f, dhe, d.F);
    } else {  // dH = dY Down (n × F)
      gemm(false, false, n, d.F, d.C, 1.0f, dye, d.C, w.down[e], d.F, 0.0f, dhe, d.F);
    }
    lora_input_grad(lora.down, e, dye, n, d.C, dhe, scratch);  // dH += scale·(dY B_e) A_e
    activate_backward(options, g, u, dhe, he, dge, due, n * d.F);
    lora_weight_grads(lora.down, e, he, dye, n, d.C, d_lora.down, scratch);
    if (stacked) {
      if (ds && ds->down) gemm(true, false, d.F, d.C, n, 1.0f, he, d.F, dye, d.C, 0.0f, ds->down + e * d.F * d.C, d.C);  // Hᵀ dY
      if (ds && ds->down_bias)
        for (int64_t c = 0; c < d.C; ++c) {
          double total = 0.0;
          for (int64_t i = 0; i < n; ++i) total += dye[i * d.C + c];
          ds->down_bias[e * d.C + c] = static_cast<float>(total);
        }
      float* gu = dgu.data() + r0 * 2 * d.F;  // dG and dU interleaved as the stacked columns are
      for (int64_t i = 0; i < n; ++i)
        for (int64_t f = 0; f < d.F; ++f) {
          gu[i * 2 * d.F + 2 * f] = dge[i * d.F + f];
          gu[i * 2 * d.F + 2 * f + 1] = due[i * d.F + f];
        }
      if (ds && ds->gate_up)  // Xᵀ dGU
        gemm(true, false, d.C, 2 * d.F, n, 1.0f, xe, d.C, gu, 2 * d.F, 0.0f, ds->gate_up + e * d.C * 2 * d.F, 2 * d.F);
      if (ds && ds->gate_up_bias)
        for (int64_t j = 0; j < 2 * d.F; ++j) {
          double total = 0.0;
          for (int64_t i = 0; i < n; ++i) total += gu[i * 2 * d.F + j];
          ds->gate_up_bias[e * 2 * d.F + j] = static_cast<float>(total);
        }
      if (dx && w.stacked)
        gemm(false, true, n, d.C, 2 * d.F, 1.0f, gu, 2 * d.F, w.stacked->gate_up + e * d.C * 2 * d.F, 2 * d.F, 0.0f, dxe, d.C);
      else if (dx)  // the stored rows (2F × C), gate and up alternating as gu's columns
        gemm_weight_backward(w.stacked_stored->gate_up[e], n, gu, 2 * d.F, 0.0f, dxe, d.C);
      lora_input_grad(lora.gate_up, e, gu, n, 2 * d.F, dx ? dxe : nullptr, scratch);
      lora_weight_grads(lora.gate_up, e, xe, gu, n, 2 * d.F, d_lora.gate_up, scratch);
      continue;
    }
    if (dw_experts.down && dw_experts.down[e]) gemm(true, false, d.C, d.F, n, 1.0f, dye, d.C, he, d.F, 0.0f, dw_experts.down[e], d.F);  // dYᵀ H
    if (dw_experts.gate && dw_experts.gate[e]) gemm(true, false, d.F, d.C, n, 1.0f, dge, d.F, xe, d.C, 0.0f, dw_experts.gate[e], d.C);  // dGᵀ X
    if (dw_experts.up && dw_experts.up[e]) gemm(true, false, d.F, d.C, n, 1.0f, due, d.F, xe, d.C, 0.0f, dw_experts.up[e], d.C);  // dUᵀ X
    if (dx && w.gate_stored) {  // the stored rows (F × C): dX_e = dG Gate + dU Up
      gemm_weight_backward(w.gate_stored[e], n, dge, d.F, 0.0f, dxe, d.C);
      gemm_weight_backward(w.up_stored[e], n, due, d.F, 1.0f, dxe, d.C);
    } else if (dx) {  // dX_e = dG Gate + dU Up
      gemm(false, false, n, d.C, d.F, 1.0f, dge, d.F, w.gate[e], d.C, 0.0f, dxe, d.C);
      gemm(false, false, n, d.C, d.F, 1.0f, due, d.F, w.up[e], d.C, 1.0f, dxe, d.C);
    }
    lora_input_grad(lora.gate, e, dge, n, d.F, dx ? dxe : nullptr, scratch);
    lora_weight_grads(lora.gate, e, xe, dge, n, d.F, d_lora.gate, scratch);
    lora_input_grad(lora.up, e, due, n, d.F, dx ? dxe : nullptr, scratch);
    lora_weight_grads(lora.up, e, xe, due, n, d.F, d_lora.up, scratch);
  }
  // Through the router: dz (N × E), then d_router = dzᵀ X, d_bias = Σ_t dz and dx = Σ_s dX[position] + dz Wr
  std::vector<float> dz(static_cast<size_t>(d.N * d.E));
  route_backward(d, options, saved.probs.data(), saved.experts.data(), saved.weights.data(), dw.data(), dz.data());
  if (d_router) gemm(true, false, d.E, d.C, d.N, 1.0f, dz.data(), d.E, x, d.C, 0.0f, d_router, d.C);
  if (d_router_bias)
    for (int64_t e = 0; e < d.E; ++e) {
      double total = 0.0;
      for (int64_t t = 0; t < d.N; ++t) total += dz[static_cast<size_t>(t * d.E + e)];
      d_router_bias[e] = static_cast<float>(total);
    }
  if (dx) {
    gemm(false, false, d.N, d.C, d.E, 1.0f, dz.data(), d.E, router, d.C, 0.0f, dx, d.C);
    for (int64_t t = 0; t < d.N; ++t)
      for (int64_t s = 0; s < d.k; ++s) {
        const float* src = dxs.data() + saved.position[static_cast<size_t>(t * d.k + s)] * d.C;
        for (int64_t c = 0; c < d.C; ++c) dx[t * d.C + c] += src[c];
      }
  }
}

}  // namespace

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const float* const* gate, const float* const* up, const float* const* down, float* out,
                 MoeSaved& saved) {
  forward(d, options, x, router, nullptr, Experts{gate, up, down, nullptr}, out, saved);
}

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const float* const* gate, const float* const* up, const float* const* down, const MoeExpertLora& lora,
                 float* out, MoeSaved& saved) {
  Experts w{gate, up, down, nullptr};
  w.lora = &lora;
  forward(d, options, x, router, nullptr, w, out, saved);
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const float* const* gate, const float* const* up, const float* const* down, const MoeExpertLora& lora,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, float* const* d_gate,
                  float* const* d_up, float* const* d_down, const MoeExpertLoraGrads& d_lora) {
  Experts w{gate, up, down, nullptr};
  w.lora = &lora;
  ExpertGrads g{d_gate, d_up, d_down, nullptr};
  g.lora = d_lora;
  backward(d, options, x, router, w, saved, d_out, dx, d_router, nullptr, g);
}

namespace {
void check_view(const WeightView& view, int64_t e, int64_t rows, int64_t cols) {
  if (view.rows != rows || view.cols != cols || !view.data)
    throw std::invalid_argument("moe_forward: expert " + std::to_string(e) + " has a " + std::to_string(view.rows) +
                                " × " + std::to_string(view.cols) + " stored matrix where " + std::to_string(rows) +
                                " × " + std::to_string(cols) + " was expected");
}
}  // namespace

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const WeightView* gate, const WeightView* up, const WeightView* down, float* out, MoeSaved& saved) {
  for (int64_t e = 0; e < d.E; ++e) {
    check_view(gate[e], e, d.F, d.C);
    check_view(up[e], e, d.F, d.C);
    check_view(down[e], e, d.C, d.F);
  }
  Experts w;
  w.gate_stored = gate, w.up_stored = up, w.down_stored = down;
  forward(d, options, x, router, nullptr, w, out, saved);
}

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const WeightView* gate, const WeightView* up, const WeightView* down, const MoeExpertLora& lora,
                 float* out, MoeSaved& saved) {
  for (int64_t e = 0; e < d.E; ++e) {
    check_view(gate[e], e, d.F, d.C);
    check_view(up[e], e, d.F, d.C);
    check_view(down[e], e, d.C, d.F);
  }
  Experts w;
  w.gate_stored = gate, w.up_stored = up, w.down_stored = down, w.lora = &lora;
  forward(d, options, x, router, nullptr, w, out, saved);
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const WeightView* gate, const WeightView* up, const WeightView* down, const MoeExpertLora& lora,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, const MoeExpertLoraGrads& d_lora) {
  Experts w;
  w.gate_stored = gate, w.up_stored = up, w.down_stored = down, w.lora = &lora;
  ExpertGrads g;
  g.lora = d_lora;
  backward(d, options, x, router, w, saved, d_out, dx, d_router, nullptr, g);
}

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const float* router_bias, const MoeStacked& experts, float* out, MoeSaved& saved) {
  forward(d, options, x, router, router_bias, Experts{nullptr, nullptr, nullptr, &experts}, out, saved);
}

void moe_forward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                 const float* router_bias, const MoeStackedStored& experts, float* out, MoeSaved& saved) {
  for (int64_t e = 0; e < d.E; ++e) {
    check_view(experts.gate_up[e], e, 2 * d.F, d.C);
    check_view(experts.down[e], e, d.C, d.F);
  }
  Experts w;
  w.stacked_stored = &experts;
  forward(d, options, x, router, router_bias, w, out, saved);
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const float* const* gate, const float* const* up, const float* const* down, const MoeSaved& saved,
                  const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                  float* const* d_down) {
  backward(d, options, x, router, Experts{gate, up, down, nullptr}, saved, d_out, dx, d_router, nullptr,
           ExpertGrads{d_gate, d_up, d_down, nullptr});
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const float* /*router_bias: only in the saved logits*/, const MoeStacked& experts,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, float* d_router_bias,
                  const MoeStackedGrads& d_experts) {
  backward(d, options, x, router, Experts{nullptr, nullptr, nullptr, &experts}, saved, d_out, dx, d_router,
           d_router_bias, ExpertGrads{nullptr, nullptr, nullptr, &d_experts});
}

void moe_backward(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                  const float* /*router_bias: only in the saved logits*/, const MoeStackedStored& experts,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, float* d_router_bias,
                  const MoeStackedGrads& d_experts) {
  Experts w;
  w.stacked_stored = &experts;
  MoeStackedGrads grads = d_experts;  // the stored matrices are frozen
  grads.gate_up = grads.down = nullptr;
  backward(d, options, x, router, w, saved, d_out, dx, d_router, d_router_bias, ExpertGrads{nullptr, nullptr, nullptr, &grads});
}

// ---- the reference: one token at a time, in double ----

namespace {

// The experts' weights by their logical index, whatever the layout: gate(e, f, c), up(e, f, c), down(e, c, f) and the
// biases (0 without)
struct ReferenceWeights {
  const MoeDims& d;
  const float* const* gate_list = nullptr;
  const float* const* up_list = nullptr;
  const float* const* down_list = nullptr;
  const MoeStacked* stacked = nullptr;
  const MoeExpertLora* list_lora = nullptr;  // adapters on the per-expert lists
  // scale · Σ_k A_e(k, i) B_e(o, k): a LoRA part's update to expert e's weight from input i to output o (0 without)
  static double delta(const LoraPart& l, int64_t e, int64_t i, int64_t o) {
    if (!l.has(e)) return 0.0;
    double total = 0.0;
    for (int64_t k = 0; k < l.r; ++k) total += static_cast<double>(l.a_of(e)[k * l.in + i]) * l.b_at(e, o, k);
    return l.scale * total;
  }
  LoraPart gate_up_lora() const { return stacked ? gate_up_part(stacked->lora, d) : LoraPart{}; }
  LoraPart down_lora() const { return stacked ? down_part(stacked->lora, d) : LoraPart{}; }
  LoraPart gate_lora() const { return list_part(list_lora, &MoeExpertLora::gate, d.C, d.F, d.E); }
  LoraPart up_lora() const { return list_part(list_lora, &MoeExpertLora::up, d.C, d.F, d.E); }
  LoraPart list_down_lora() const { return list_part(list_lora, &MoeExpertLora::down, d.F, d.C, d.E); }
  double gate(int64_t e, int64_t f, int64_t c) const {
    return stacked ? stacked->gate_up[(e * d.C + c) * 2 * d.F + 2 * f] + delta(gate_up_lora(), e, c, 2 * f)
                   : gate_list[e][f * d.C + c] + delta(gate_lora(), e, c, f);
  }
  double up(int64_t e, int64_t f, int64_t c) const {
    return stacked ? stacked->gate_up[(e * d.C + c) * 2 * d.F + 2 * f + 1] + delta(gate_up_lora(), e, c, 2 * f + 1)
                   : up_list[e][f * d.C + c] + delta(up_lora(), e, c, f);
  }
  double down(int64_t e, int64_t c, int64_t f) const {
    return stacked ? stacked->down[(e * d.F + f) * d.C + c] + delta(down_lora(), e, f, c)
                   : down_list[e][c * d.F + f] + delta(list_down_lora(), e, f, c);
  }
  double gate_bias(int64_t e, int64_t f) const {
    return stacked && stacked->gate_up_bias ? stacked->gate_up_bias[e * 2 * d.F + 2 * f] : 0.0;
  }
  double up_bias(int64_t e, int64_t f) const {
    return stacked && stacked->gate_up_bias ? stacked->gate_up_bias[e * 2 * d.F + 2 * f + 1] : 0.0;
  }
  double down_bias(int64_t e, int64_t c) const {
    return stacked && stacked->down_bias ? stacked->down_bias[e * d.C + c] : 0.0;
  }
};

struct ReferenceRoute {
  std::vector<double> p;        // (E) softmax (sigmoid; gpt-oss: the logits)
  std::vector<int32_t> chosen;  // (k)
  std::vector<double> w;        // (k)
};

ReferenceRoute reference_route(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                               const float* router_bias) {
  ReferenceRoute r;
  r.p.assign(static_cast<size_t>(d.E), 0.0);
  double mx = -INFINITY;
  for (int64_t e = 0; e < d.E; ++e) {
    double z = router_bias ? router_bias[e] : 0.0;
    for (int64_t c = 0; c < d.C; ++c) z += static_cast<double>(x[c]) * router[e * d.C + c];
    r.p[static_cast<size_t>(e)] = z;
    mx = std::max(mx, z);
  }
  if (options.sigmoid) {
    for (double& v : r.p) v = sigmoid(v);
  } else if (!options.top_k_then_softmax) {
    double sum = 0.0;
    for (double& v : r.p) sum += (v = std::exp(v - mx));
    for (double& v : r.p) v /= sum;
  }
  std::vector<float> pf(r.p.begin(), r.p.end());  // chosen on the float values, as the kernel chooses
  r.chosen.assign(static_cast<size_t>(d.k), 0);
  choose(d, options, pf.data(), r.chosen.data());
  if (options.top_k_then_softmax) {  // the softmax of the chosen logits
    double total = 0.0;
    for (int32_t e : r.chosen) total += std::exp(r.p[static_cast<size_t>(e)]);
    for (int32_t e : r.chosen) r.w.push_back(std::exp(r.p[static_cast<size_t>(e)]) / total * options.scaling);
    return r;
  }
  double total = options.sigmoid ? 1e-20 : 0.0;
  for (int32_t e : r.chosen) total += r.p[static_cast<size_t>(e)];
  for (int32_t e : r.chosen)
    r.w.push_back((options.norm_topk_prob ? r.p[static_cast<size_t>(e)] / total : r.p[static_cast<size_t>(e)]) * options.scaling);
  return r;
}

// The activation and its two partial derivatives at one (g, u): SwiGLU or gpt-oss's clamped form
struct ReferenceActivation {
  double h, dh_dg, dh_du;
};
ReferenceActivation reference_activation(const MoeOptions& o, double g, double u) {
  if (o.swiglu_limit <= 0.0f) {
    const double sg = sigmoid(g);
    return {g * sg * u, u * sg * (1.0 + g * (1.0 - sg)), g * sg};
  }
  const double limit = o.swiglu_limit, alpha = o.swiglu_alpha;
  const double gc = std::min(g, limit), uc = std::clamp(u, -limit, limit), sg = sigmoid(alpha * gc);
  return {gc * sg * (uc + 1.0), g <= limit ? (uc + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)) : 0.0,
          u >= -limit && u <= limit ? gc * sg : 0.0};
}

// One expert on one token: g, u (F) before the activation, h (F) and y (C)
struct ReferenceExpert {
  std::vector<double> g, u, h, y;
};
ReferenceExpert reference_expert(const MoeDims& d, const MoeOptions& o, const ReferenceWeights& w, int64_t e,
                                 const float* x) {
  ReferenceExpert r;
  r.g.assign(static_cast<size_t>(d.F), 0.0);
  r.u.assign(static_cast<size_t>(d.F), 0.0);
  r.h.assign(static_cast<size_t>(d.F), 0.0);
  r.y.assign(static_cast<size_t>(d.C), 0.0);
  for (int64_t f = 0; f < d.F; ++f) {
    double g = w.gate_bias(e, f), u = w.up_bias(e, f);
    for (int64_t c = 0; c < d.C; ++c) {
      g += w.gate(e, f, c) * x[c];
      u += w.up(e, f, c) * x[c];
    }
    r.g[static_cast<size_t>(f)] = g;
    r.u[static_cast<size_t>(f)] = u;
    r.h[static_cast<size_t>(f)] = reference_activation(o, g, u).h;
  }
  for (int64_t c = 0; c < d.C; ++c) {
    double y = w.down_bias(e, c);
    for (int64_t f = 0; f < d.F; ++f) y += w.down(e, c, f) * r.h[static_cast<size_t>(f)];
    r.y[static_cast<size_t>(c)] = y;
  }
  return r;
}

void forward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                       const float* router_bias, const ReferenceWeights& w, float* out) {
  for (int64_t t = 0; t < d.N; ++t) {
    const float* xt = x + t * d.C;
    const ReferenceRoute r = reference_route(d, options, xt, router, router_bias);
    std::vector<double> o(static_cast<size_t>(d.C), 0.0);
    for (int64_t s = 0; s < d.k; ++s) {
      const ReferenceExpert ex = reference_expert(d, options, w, r.chosen[static_cast<size_t>(s)], xt);
      for (int64_t c = 0; c < d.C; ++c) o[static_cast<size_t>(c)] += r.w[static_cast<size_t>(s)] * ex.y[static_cast<size_t>(c)];
    }
    for (int64_t c = 0; c < d.C; ++c) out[t * d.C + c] = static_cast<float>(o[static_cast<size_t>(c)]);
  }
}

// The gradients by logical index (gate, up (E, F, C), down (E, C, F), biases (E, F), (E, F), (E, C)), in double
struct ReferenceGrads {
  std::vector<double> gate, up, down, gate_bias, up_bias, down_bias, router, router_bias;
};

ReferenceGrads backward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                                  const float* router_bias, const ReferenceWeights& w, const float* d_out, float* dx) {
  ReferenceGrads G;
  G.gate.assign(static_cast<size_t>(d.E * d.F * d.C), 0.0);
  G.up = G.gate;
  G.down = G.gate;
  G.gate_bias.assign(static_cast<size_t>(d.E * d.F), 0.0);
  G.up_bias = G.gate_bias;
  G.down_bias.assign(static_cast<size_t>(d.E * d.C), 0.0);
  G.router.assign(static_cast<size_t>(d.E * d.C), 0.0);
  G.router_bias.assign(static_cast<size_t>(d.E), 0.0);
  for (int64_t t = 0; t < d.N; ++t) {
    const float* xt = x + t * d.C;
    const float* g_out = d_out + t * d.C;
    const ReferenceRoute r = reference_route(d, options, xt, router, router_bias);
    std::vector<double> dxt(static_cast<size_t>(d.C), 0.0), dp(static_cast<size_t>(d.E), 0.0), dw(static_cast<size_t>(d.k));
    for (int64_t s = 0; s < d.k; ++s) {
      const int32_t e = r.chosen[static_cast<size_t>(s)];
      const ReferenceExpert ex = reference_expert(d, options, w, e, xt);
      const double wt = r.w[static_cast<size_t>(s)];
      double dot = 0.0;
      for (int64_t c = 0; c < d.C; ++c) {
        dot += g_out[c] * ex.y[static_cast<size_t>(c)];
        G.down_bias[static_cast<size_t>(e * d.C + c)] += wt * g_out[c];
      }
      dw[static_cast<size_t>(s)] = dot;
      // the expert: dy = w · dout; dh = Downᵀ dy; dg = dh · ∂h/∂g; du = dh · ∂h/∂u
      for (int64_t f = 0; f < d.F; ++f) {
        double dh = 0.0;
        for (int64_t c = 0; c < d.C; ++c) {
          dh += wt * g_out[c] * w.down(e, c, f);
          G.down[static_cast<size_t>((e * d.C + c) * d.F + f)] += wt * g_out[c] * ex.h[static_cast<size_t>(f)];
        }
        const ReferenceActivation a = reference_activation(options, ex.g[static_cast<size_t>(f)], ex.u[static_cast<size_t>(f)]);
        const double dgf = dh * a.dh_dg, duf = dh * a.dh_du;
        G.gate_bias[static_cast<size_t>(e * d.F + f)] += dgf;
        G.up_bias[static_cast<size_t>(e * d.F + f)] += duf;
        for (int64_t c = 0; c < d.C; ++c) {
          G.gate[static_cast<size_t>((e * d.F + f) * d.C + c)] += dgf * xt[c];
          G.up[static_cast<size_t>((e * d.F + f) * d.C + c)] += duf * xt[c];
          dxt[static_cast<size_t>(c)] += dgf * w.gate(e, f, c) + duf * w.up(e, f, c);
        }
      }
    }
    std::vector<double> dz(static_cast<size_t>(d.E), 0.0);
    const double a = options.scaling;
    if (options.top_k_then_softmax) {  // w_q = a·exp(z_q) / Σ_r exp(z_r) over the chosen: ∂w_q/∂z_s = w_q([q = s] − w_s/a)
      for (int64_t s = 0; s < d.k; ++s)
        for (int64_t q = 0; q < d.k; ++q)
          dz[static_cast<size_t>(r.chosen[static_cast<size_t>(s)])] +=
              dw[static_cast<size_t>(q)] * r.w[static_cast<size_t>(q)] * ((q == s ? 1.0 : 0.0) - r.w[static_cast<size_t>(s)] / a);
    } else {
      // the router, straight from w_s = p_s / Σ_r p_r (or p_s) and p = softmax(z)
      double total = options.sigmoid ? 1e-20 : 0.0;
      for (int32_t e : r.chosen) total += r.p[static_cast<size_t>(e)];
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
      for (int64_t e = 0; e < d.E; ++e) {  // softmax: ∂p_j/∂z_e = p_j([j = e] − p_e); sigmoid: [j = e] p_e (1 − p_e)
        double& v = dz[static_cast<size_t>(e)];
        if (options.sigmoid) {
          v = dp[static_cast<size_t>(e)] * r.p[static_cast<size_t>(e)] * (1.0 - r.p[static_cast<size_t>(e)]);
        } else {
          for (int64_t j = 0; j < d.E; ++j)
            v += dp[static_cast<size_t>(j)] * r.p[static_cast<size_t>(j)] * ((j == e ? 1.0 : 0.0) - r.p[static_cast<size_t>(e)]);
        }
      }
    }
    for (int64_t e = 0; e < d.E; ++e) {
      G.router_bias[static_cast<size_t>(e)] += dz[static_cast<size_t>(e)];
      for (int64_t c = 0; c < d.C; ++c) {
        G.router[static_cast<size_t>(e * d.C + c)] += dz[static_cast<size_t>(e)] * xt[c];
        dxt[static_cast<size_t>(c)] += dz[static_cast<size_t>(e)] * router[e * d.C + c];
      }
    }
    if (dx)
      for (int64_t c = 0; c < d.C; ++c) dx[t * d.C + c] = static_cast<float>(dxt[static_cast<size_t>(c)]);
  }
  return G;
}

void store(const std::vector<double>& from, float* to) {
  if (to) std::transform(from.begin(), from.end(), to, [](double v) { return static_cast<float>(v); });
}

// An adapter's gradients from the gradient of each expert's whole weight dW(e, i, o) (in → out):
// dA_e(k, i) = scale·Σ_o dW(i, o) B_e(o, k), dB_e(o, k) = scale·Σ_i dW(i, o) A_e(k, i)
template <class Grad>
void reference_lora_grads(const MoeDims& d, const LoraPart& l, const Grad& dW, const LoraPartGrads& g) {
  if (!l) return;
  for (int64_t e = 0; e < d.E; ++e) {
    if (!l.has(e)) continue;
    std::vector<float> be(static_cast<size_t>(l.out * l.r));
    float* da = g.a_of(l, e);
    for (int64_t k = 0; k < l.r; ++k) {
      for (int64_t i = 0; da && i < l.in; ++i) {
        double total = 0.0;
        for (int64_t o = 0; o < l.out; ++o) total += dW(e, i, o) * l.b_at(e, o, k);
        da[k * l.in + i] = static_cast<float>(l.scale * total);
      }
      for (int64_t o = 0; o < l.out; ++o) {
        double total = 0.0;
        for (int64_t i = 0; i < l.in; ++i) total += dW(e, i, o) * l.a_of(e)[k * l.in + i];
        be[static_cast<size_t>(o * l.r + k)] = static_cast<float>(l.scale * total);
      }
    }
    g.store_b(l, e, be.data());
  }
}

}  // namespace

void moe_forward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                           const float* const* gate, const float* const* up, const float* const* down, float* out,
                           const MoeExpertLora* lora) {
  forward_reference(d, options, x, router, nullptr, ReferenceWeights{d, gate, up, down, nullptr, lora}, out);
}

void moe_forward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                           const float* router_bias, const MoeStacked& experts, float* out) {
  forward_reference(d, options, x, router, router_bias, ReferenceWeights{d, nullptr, nullptr, nullptr, &experts}, out);
}

void moe_backward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                            const float* const* gate, const float* const* up, const float* const* down,
                            const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                            float* const* d_down, const MoeExpertLora* lora, const MoeExpertLoraGrads& d_lora) {
  const ReferenceWeights w{d, gate, up, down, nullptr, lora};
  const ReferenceGrads G = backward_reference(d, options, x, router, nullptr, w, d_out, dx);
  // gate and up: in c, out f ((E, F, C) logical); down: in f, out c ((E, C, F))
  auto in_out = [&](const std::vector<double>& g) {
    return [&g, &d](int64_t e, int64_t c, int64_t f) { return g[static_cast<size_t>((e * d.F + f) * d.C + c)]; };
  };
  reference_lora_grads(d, w.gate_lora(), in_out(G.gate), LoraPartGrads{nullptr, nullptr, d_lora.gate_a, d_lora.gate_b});
  reference_lora_grads(d, w.up_lora(), in_out(G.up), LoraPartGrads{nullptr, nullptr, d_lora.up_a, d_lora.up_b});
  reference_lora_grads(d, w.list_down_lora(), [&](int64_t e, int64_t f, int64_t c) {
    return G.down[static_cast<size_t>((e * d.C + c) * d.F + f)];
  }, LoraPartGrads{nullptr, nullptr, d_lora.down_a, d_lora.down_b});
  store(G.router, d_router);
  for (int64_t e = 0; e < d.E; ++e) {
    auto slice = [&](const std::vector<double>& v, int64_t size) {
      return std::vector<double>(v.begin() + e * size, v.begin() + (e + 1) * size);
    };
    if (d_gate) store(slice(G.gate, d.F * d.C), d_gate[e]);
    if (d_up) store(slice(G.up, d.F * d.C), d_up[e]);
    if (d_down) store(slice(G.down, d.C * d.F), d_down[e]);
  }
}

void moe_backward_reference(const MoeDims& d, const MoeOptions& options, const float* x, const float* router,
                            const float* router_bias, const MoeStacked& experts, const float* d_out, float* dx,
                            float* d_router, float* d_router_bias, const MoeStackedGrads& d_experts) {
  const ReferenceGrads G = backward_reference(d, options, x, router, router_bias,
                                              ReferenceWeights{d, nullptr, nullptr, nullptr, &experts}, d_out, dx);
  store(G.router, d_router);
  if (router_bias) store(G.router_bias, d_router_bias);
  for (int64_t e = 0; e < d.E; ++e)  // back to the stacked layout: gate_up (E, C, 2F) interleaved, down (E, F, C)
    for (int64_t f = 0; f < d.F; ++f) {
      for (int64_t c = 0; c < d.C; ++c) {
        const size_t logical = static_cast<size_t>((e * d.F + f) * d.C + c);
        if (d_experts.gate_up) {
          d_experts.gate_up[(e * d.C + c) * 2 * d.F + 2 * f] = static_cast<float>(G.gate[logical]);
          d_experts.gate_up[(e * d.C + c) * 2 * d.F + 2 * f + 1] = static_cast<float>(G.up[logical]);
        }
        if (d_experts.down) d_experts.down[(e * d.F + f) * d.C + c] = static_cast<float>(G.down[static_cast<size_t>((e * d.C + c) * d.F + f)]);
      }
      if (d_experts.gate_up_bias) {
        d_experts.gate_up_bias[e * 2 * d.F + 2 * f] = static_cast<float>(G.gate_bias[static_cast<size_t>(e * d.F + f)]);
        d_experts.gate_up_bias[e * 2 * d.F + 2 * f + 1] = static_cast<float>(G.up_bias[static_cast<size_t>(e * d.F + f)]);
      }
    }
  if (d_experts.down_bias) store(G.down_bias, d_experts.down_bias);
  // The adapters', from the gradient of each expert's whole weight
  const ReferenceWeights w{d, nullptr, nullptr, nullptr, &experts};
  reference_lora_grads(d, w.gate_up_lora(), [&](int64_t e, int64_t c, int64_t j) {  // in c, out j (gate and up alternating)
    return (j % 2 == 0 ? G.gate : G.up)[static_cast<size_t>((e * d.F + j / 2) * d.C + c)];
  }, LoraPartGrads{d_experts.lora.gate_up_a, d_experts.lora.gate_up_b});
  reference_lora_grads(d, w.down_lora(), [&](int64_t e, int64_t f, int64_t c) { return G.down[static_cast<size_t>((e * d.C + c) * d.F + f)]; },
                       LoraPartGrads{d_experts.lora.down_a, d_experts.lora.down_b});
}

}  // namespace qkv::kernels
