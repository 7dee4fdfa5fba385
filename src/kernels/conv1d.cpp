// The causal depthwise convolution of Gated DeltaNet (qkv/kernels/conv1d.hpp).
#include "qkv/kernels/conv1d.hpp"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "parallel.hpp"

namespace qkv::kernels {

namespace {

// x̃[b, s, ·] for s in [−(K − 1), T): the state's rows before the first token, x's after, null for zeros
inline const float* input_row(const CausalConvDims& d, const float* x, const float* state, int64_t b, int64_t s) {
  if (s >= 0) return x + (b * d.T + s) * d.C;
  if (!state) return nullptr;
  return state + (b * (d.K - 1) + (d.K - 1) + s) * d.C;
}

bool worth_threads(const CausalConvDims& d) { return d.B * d.T * d.C * d.K >= 32768; }

}  // namespace

void causal_conv1d_forward(const CausalConvDims& d, const float* x, const float* w, const float* state, float* y) {
  const int64_t rows = d.B * d.T, C = d.C, K = d.K;
  // w transposed to (K, C), so each tap is one contiguous row multiplied into a row of channels
  std::vector<float> taps(static_cast<size_t>(K * C));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) taps[static_cast<size_t>(j * C + c)] = w[c * K + j];
  parallel_for(rows, worth_threads(d), [&](int64_t r) {
    const int64_t b = r / d.T, t = r % d.T;
    float* out = y + r * C;
    std::fill_n(out, C, 0.0f);
    for (int64_t j = 0; j < K; ++j) {
      const float* in = input_row(d, x, state, b, t - (K - 1) + j);
      if (!in) continue;
      const float* tap = taps.data() + j * C;
      for (int64_t c = 0; c < C; ++c) out[c] += tap[c] * in[c];
    }
  });
}

void causal_conv1d_backward(const CausalConvDims& d, const float* x, const float* w, const float* state,
                            const float* dy, float* dx, float* dw) {
  const int64_t C = d.C, K = d.K;
  if (dx) {
    std::vector<float> taps(static_cast<size_t>(K * C));
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < K; ++j) taps[static_cast<size_t>(j * C + c)] = w[c * K + j];
    parallel_for(d.B * d.T, worth_threads(d), [&](int64_t r) {
      const int64_t b = r / d.T, t = r % d.T;
      float* out = dx + r * C;
      std::fill_n(out, C, 0.0f);
      for (int64_t j = 0; j < K; ++j) {  // output t + (K − 1) − j read x[t] through tap j
        const int64_t s = t + (K - 1) - j;
        if (s >= d.T) continue;
        const float* g = dy + (b * d.T + s) * C;
        const float* tap = taps.data() + j * C;
        for (int64_t c = 0; c < C; ++c) out[c] += tap[c] * g[c];
      }
    });
  }
  if (dw) {
    // Each thread owns a range of channels and runs over every row in order, so the sums do not depend on threads.
    const int threads = worth_threads(d) && !omp_in_parallel() ? omp_get_max_threads() : 1;
    const int64_t per = (C + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int p = 0; p < threads; ++p) {
      const int64_t c0 = std::min(C, p * per), c1 = std::min(C, c0 + per);
      if (c0 == c1) continue;
      std::vector<float> acc(static_cast<size_t>(K * (c1 - c0)), 0.0f);  // (K, c1 − c0)
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t t = 0; t < d.T; ++t) {
          const float* g = dy + (b * d.T + t) * C;
          for (int64_t j = 0; j < K; ++j) {
            const float* in = input_row(d, x, state, b, t - (K - 1) + j);
            if (!in) continue;
            float* a = acc.data() + j * (c1 - c0);
            for (int64_t c = c0; c < c1; ++c) a[c - c0] += g[c] * in[c];
          }
        }
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t j = 0; j < K; ++j) dw[c * K + j] = acc[static_cast<size_t>(j * (c1 - c0) + (c - c0))];
    }
  }
}

void causal_conv1d_forward_reference(const CausalConvDims& d, const float* x, const float* w, const float* state,
                                     float* y) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.C; ++c) {
        double sum = 0.0;
        for (int64_t j = 0; j < d.K; ++j)
          if (const float* in = input_row(d, x, state, b, t - (d.K - 1) + j)) sum += double(w[c * d.K + j]) * in[c];
        y[(b * d.T + t) * d.C + c] = static_cast<float>(sum);
      }
}

void causal_conv1d_backward_reference(const CausalConvDims& d, const float* x, const float* w, const float* state,
                                      const float* dy, float* dx, float* dw) {
  std::vector<double> gx(static_cast<size_t>(d.B * d.T * d.C), 0.0), gw(static_cast<size_t>(d.C * d.K), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.C; ++c) {
        const double g = dy[(b * d.T + t) * d.C + c];
        for (int64_t j = 0; j < d.K; ++j) {
          const int64_t s = t - (d.K - 1) + j;
          if (const float* in = input_row(d, x, state, b, s)) gw[static_cast<size_t>(c * d.K + j)] += g * in[c];
          if (s >= 0) gx[static_cast<size_t>((b * d.T + s) * d.C + c)] += g * w[c * d.K + j];
        }
      }
  if (dx) std::transform(gx.begin(), gx.end(), dx, [](double v) { return static_cast<float>(v); });
  if (dw) std::transform(gw.begin(), gw.end(), dw, [](double v) { return static_cast<float>(v); });
}

}  // namespace qkv::kernels
