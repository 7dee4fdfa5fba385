// The attention kernel's reference: scores and weights materialised per head, in double precision, straight from
// the definition (visibility, soft-capping, dropout's keep decisions, GQA's shared K/V heads). The fused kernel is
// tested against it (tests/test_attention_kernel.cpp, tests/test_kernel_table.cpp); it is never fast.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/convert.hpp"
#include "attention_plan.hpp"

namespace qkv::kernels {

using namespace attention_detail;

namespace {

// Visibility straight from the definition, not from the Plan's block bounds the fused kernel uses.
bool reference_visible(const AttentionDims& d, const AttentionOptions& o, int64_t i, int64_t j) {
  const int64_t shifted = i + (d.Tk - d.Tq);
  if (o.causal && j > shifted) return false;
  if (o.window > 0 && j <= shifted - o.window) return false;
  return true;
}

struct ReferenceHead {
  std::vector<double> weights;  // (Tq × Tk) after softmax, before dropout
  std::vector<double> zmask;    // dropout factor per weight
  std::vector<double> capping;  // d(capped score)/d(score) per weight: 1 − tanh², or 1 without soft-capping
  std::vector<bool> any_visible;  // per query row
};

ReferenceHead reference_weights(const Plan& p, const float* q, const float* k, int64_t bh) {
  const auto& d = p.dims;
  const int64_t bkv = p.kv_of(bh);
  ReferenceHead h;
  h.weights.assign(static_cast<size_t>(d.Tq * d.Tk), 0.0);
  h.zmask.assign(static_cast<size_t>(d.Tq * d.Tk), 1.0);
  h.capping.assign(static_cast<size_t>(d.Tq * d.Tk), 1.0);
  for (int64_t i = 0; i < d.Tq; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    std::vector<double> s(static_cast<size_t>(d.Tk), -std::numeric_limits<double>::infinity());
    for (int64_t j = 0; j < d.Tk; ++j) {
      if (!reference_visible(d, p.options, i, j)) continue;
      double acc = 0.0;
      for (int64_t e = 0; e < d.D; ++e)
        acc += static_cast<double>(p.row(q, p.layout.q, bh, i)[e]) * p.kv_row(k, p.layout.k, bkv, j)[e];
      acc *= p.scale;
      if (p.softcap != 0.0f) {
        const double t = std::tanh(acc / p.softcap);
        acc = p.softcap * t;
        h.capping[static_cast<size_t>(i * d.Tk + j)] = 1.0 - t * t;
      }
      s[static_cast<size_t>(j)] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < d.Tk; ++j) sum += std::exp(s[static_cast<size_t>(j)] - mx);
    h.any_visible.push_back(sum > 0.0);
    for (int64_t j = 0; j < d.Tk; ++j) {
      if (!reference_visible(d, p.options, i, j)) continue;
      h.weights[static_cast<size_t>(i * d.Tk + j)] = std::exp(s[static_cast<size_t>(j)] - mx) / sum;
      if (p.dropout)
        h.zmask[static_cast<size_t>(i * d.Tk + j)] =
            attention_dropout_keep(p.options.seed, p.options.dropout_p, bh, i, j) ? p.inv_keep : 0.0;
    }
  }
  return h;
}

// What options.bf16 rounds, as the fused kernel rounds it: a copy of a strided tensor (heads × T rows of D) with every
// value x → bf16(x · factor) / factor. (The kernel also rounds the tiles of P and dS; the reference does not.)
std::vector<float> rounded_bf16(const Plan& p, const AttentionStrides& s, int64_t heads, int64_t T, const float* x,
                                float factor) {
  std::vector<float> out(x, x + p.extent(s, heads, T));
  for (float& value : out) value = bf16_to_f32_reference(f32_to_bf16_reference(value * factor)) / factor;
  return out;
}

struct RoundedInputs {
  std::vector<float> q, k, v, d_o;
  RoundedInputs(const Plan& p, const float* q_in, const float* k_in, const float* v_in, const float* d_o_in) {
    const AttentionDims& d = p.dims;
    q = rounded_bf16(p, p.layout.q, d.H, d.Tq, q_in, p.scale);
    k = rounded_bf16(p, p.layout.k, p.kv_heads, d.Tk, k_in, 1.0f);
    v = rounded_bf16(p, p.layout.v, p.kv_heads, d.Tk, v_in, 1.0f);
    if (d_o_in) d_o = rounded_bf16(p, p.layout.o, d.H, d.Tq, d_o_in, 1.0f);
  }
};

}  // namespace

void attention_forward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                 const AttentionOptions& options, const float* q, const float* k, const float* v,
                                 float* o) {
  const Plan p(dims, layout, options);
  if (options.bf16 && dims.B > 0 && dims.H > 0 && dims.Tq > 0 && dims.Tk > 0 && dims.D > 0) {
    AttentionOptions exact = options;
    exact.bf16 = false;
    const RoundedInputs r(p, q, k, v, nullptr);
    return attention_forward_reference(dims, layout, exact, r.q.data(), r.k.data(), r.v.data(), o);
  }
  for (int64_t bh = 0; bh < dims.B * dims.H; ++bh) {
    const ReferenceHead h = reference_weights(p, q, k, bh);
    const int64_t bkv = p.kv_of(bh);
    for (int64_t i = 0; i < dims.Tq; ++i)
      for (int64_t e = 0; e < dims.D; ++e) {
        double acc = 0.0;
        for (int64_t j = 0; j < dims.Tk; ++j) {
          const size_t at = static_cast<size_t>(i * dims.Tk + j);
          acc += h.weights[at] * h.zmask[at] * p.kv_row(v, layout.v, bkv, j)[e];
        }
        p.row(o, layout.o, bh, i)[e] =
            h.any_visible[static_cast<size_t>(i)] ? static_cast<float>(acc) : std::numeric_limits<float>::quiet_NaN();
      }
  }
}

void attention_backward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                  const AttentionOptions& options, const float* q, const float* k, const float* v,
                                  const float* d_o, float* dq, float* dk, float* dv) {
  const Plan p(dims, layout, options);
  if (options.bf16 && dims.B > 0 && dims.H > 0 && dims.Tq > 0 && dims.Tk > 0 && dims.D > 0) {
    AttentionOptions exact = options;
    exact.bf16 = false;
    const RoundedInputs r(p, q, k, v, d_o);
    return attention_backward_reference(dims, layout, exact, r.q.data(), r.k.data(), r.v.data(), r.d_o.data(), dq, dk, dv);
  }
  const int64_t Tq = dims.Tq, Tk = dims.Tk, D = dims.D, units = dims.B * p.kv_heads;
  // dK and dV of every K/V head, summed over the query heads that read it.
  std::vector<double> dk_all(static_cast<size_t>(units * Tk * D), 0.0), dv_all(static_cast<size_t>(units * Tk * D), 0.0);
  for (int64_t bh = 0; bh < dims.B * dims.H; ++bh) {
    const ReferenceHead h = reference_weights(p, q, k, bh);
    const int64_t bkv = p.kv_of(bh);
    double* dk_h = dk_all.data() + bkv * Tk * D;
    double* dv_h = dv_all.data() + bkv * Tk * D;
    std::vector<double> dq_h(static_cast<size_t>(Tq * D), 0.0);
    for (int64_t i = 0; i < Tq; ++i) {
      // dA_ij = Z_ij · (dO_i · V_j);  dS_ij = A_ij (dA_ij − Σ_l A_il dA_il), times the capping derivative
      std::vector<double> da(static_cast<size_t>(Tk), 0.0);
      double dot = 0.0;
      for (int64_t j = 0; j < Tk; ++j) {
        const size_t at = static_cast<size_t>(i * Tk + j);
        double g = 0.0;
        for (int64_t e = 0; e < D; ++e)
          g += static_cast<double>(p.row(d_o, layout.o, bh, i)[e]) * p.kv_row(v, layout.v, bkv, j)[e];
        da[static_cast<size_t>(j)] = g * h.zmask[at];
        dot += h.weights[at] * da[static_cast<size_t>(j)];
        for (int64_t e = 0; e < D; ++e) dv_h[j * D + e] += h.weights[at] * h.zmask[at] * p.row(d_o, layout.o, bh, i)[e];
      }
      for (int64_t j = 0; j < Tk; ++j) {
        const size_t at = static_cast<size_t>(i * Tk + j);
        const double dsij = h.weights[at] * (da[static_cast<size_t>(j)] - dot) * h.capping[at] * p.scale;
        for (int64_t e = 0; e < D; ++e) {
          dq_h[static_cast<size_t>(i * D + e)] += dsij * p.kv_row(k, layout.k, bkv, j)[e];
          dk_h[j * D + e] += dsij * p.row(q, layout.q, bh, i)[e];
        }
      }
    }
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t e = 0; e < D; ++e) p.row(dq, layout.q, bh, i)[e] = static_cast<float>(dq_h[static_cast<size_t>(i * D + e)]);
  }
  for (int64_t bkv = 0; bkv < units; ++bkv)
    for (int64_t j = 0; j < Tk; ++j)
      for (int64_t e = 0; e < D; ++e) {
        const size_t at = static_cast<size_t>((bkv * Tk + j) * D + e);
        p.kv_row(dk, layout.k, bkv, j)[e] = static_cast<float>(dk_all[at]);
        p.kv_row(dv, layout.v, bkv, j)[e] = static_cast<float>(dv_all[at]);
      }
}

}  // namespace qkv::kernels
