// The two output-side additions of 2025's attention to the fused kernel: the sink logit's gradient (gpt-oss; the
// sink's forward is inside attention_forward, whose softmax sum it joins) and gated attention's output gate
// (Qwen3-Next, Qwen3.5), each beside its double-precision reference. Not here: the fused kernel (attention_forward.cpp,
// attention_backward.cpp), the autograd ops (core/ops_sdpa.cpp).
#include <omp.h>

#include <cmath>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "attention_plan.hpp"
#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

using namespace attention_detail;

void attention_sink_backward(const AttentionDims& dims, const AttentionLayout& layout, const float* sinks,
                             const float* o, const float* lse, const float* d_o, float* d_sinks) {
  if (dims.H <= 0) return;
  const Plan p(dims, layout, AttentionOptions{});
  // One owner per head: its sum runs over batches and rows in order, so the bits never vary with the threads.
#pragma omp parallel for num_threads(p.threads()) schedule(static)
  for (int64_t h = 0; h < dims.H; ++h) {
    double total = 0.0;
    for (int64_t b = 0; b < dims.B; ++b) {
      const int64_t bh = b * dims.H + h;
      for (int64_t i = 0; i < dims.Tq; ++i) {
        const float* o_row = p.row(o, layout.o, bh, i);
        const float* d_o_row = p.row(d_o, layout.o, bh, i);
        double di = 0.0;  // Di = dO · O
        for (int64_t e = 0; e < dims.D; ++e) di += static_cast<double>(d_o_row[e]) * o_row[e];
        total -= std::exp(static_cast<double>(sinks[h]) - lse[bh * dims.Tq + i]) * di;
      }
    }
    d_sinks[h] = static_cast<float>(total);
  }
}

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// s[e] = σ(g[e]) for e < n: eight at a time with the kernels' vector exp (a scalar exp per value was 10% of a
// causal forward at T = 2048, measured on one thread), the tail scalar.
void sigmoid_row(const float* g, float* s, int64_t n) {
  int64_t e = 0;
#ifdef QKV_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; e + 8 <= n; e += 8)
    _mm256_storeu_ps(s + e, _mm256_div_ps(one, _mm256_add_ps(one, simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g + e))))));
#endif
  for (; e < n; ++e) s[e] = sigmoid(g[e]);
}
}  // namespace

void attention_gate_forward(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate, int64_t gate_row,
                            int64_t gate_head, float* out) {
  parallel_for(rows, rows * H * D > 16384, [&](int64_t r) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t at = (r * H + h) * D;
      sigmoid_row(gate + r * gate_row + h * gate_head, out + at, D);  // σ(G), then × O in place
      for (int64_t e = 0; e < D; ++e) out[at + e] *= o[at + e];
    }
  });
}

void attention_gate_backward(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate, int64_t gate_row,
                             int64_t gate_head, const float* d_out, float* d_o, float* d_gate) {
  parallel_for(rows, rows * H * D > 16384, [&](int64_t r) {
    for (int64_t h = 0; h < H; ++h) {
      const float* g = gate + r * gate_row + h * gate_head;
      float* dg = d_gate ? d_gate + r * gate_row + h * gate_head : nullptr;
      const int64_t at = (r * H + h) * D;
      for (int64_t e = 0; e < D; ++e) {
        const float s = sigmoid(g[e]);
        if (d_o) d_o[at + e] = d_out[at + e] * s;
        if (dg) dg[e] = d_out[at + e] * o[at + e] * s * (1.0f - s);  // σ' = σ(1 − σ)
      }
    }
  });
}

void attention_gate_forward_reference(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate,
                                      int64_t gate_row, int64_t gate_head, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) {
        const double g = gate[r * gate_row + h * gate_head + e];
        out[(r * H + h) * D + e] = static_cast<float>(o[(r * H + h) * D + e] / (1.0 + std::exp(-g)));
      }
}

void attention_gate_backward_reference(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate,
                                       int64_t gate_row, int64_t gate_head, const float* d_out, float* d_o,
                                       float* d_gate) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) {
        const int64_t at = (r * H + h) * D, g_at = r * gate_row + h * gate_head + e;
        const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(gate[g_at])));
        d_o[at + e] = static_cast<float>(d_out[at + e] * s);
        d_gate[g_at] = static_cast<float>(static_cast<double>(d_out[at + e]) * o[at + e] * s * (1.0 - s));
      }
}

}  // namespace qkv::kernels
