// Optimiser updates and gradient norms over flat arrays (see qkv/kernels/optim.hpp).
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/optim.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "denormals.hpp"
#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s) {
  // One pass: each element's four values are read and written once; the loop vectorises (no branches). The
  // gradient scale is applied as the gradient is read (x · 1 = x, so an unclipped step is unchanged).
#pragma omp parallel if (worth_parallel(n))
  {
    const DenormalMode flush(Denormals::Flush);  // see optim.hpp
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      const float gj = g[j] * s.grad_scale;
      const float wj = w[j] * s.decay;
      const float mj = m[j] * s.beta1 + s.one_minus_beta1 * gj;
      const float vj = v[j] * s.beta2 + s.one_minus_beta2 * gj * gj;
      m[j] = mj;
      v[j] = vj;
      w[j] = wj - s.step_size * (mj / (std::sqrt(vj) / s.bc2_sqrt + s.eps));
    }
  }
}

void adamw_update_reference(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s) {
  for (int64_t j = 0; j < n; ++j) {
    const float gj = g[j] * s.grad_scale;
    w[j] *= s.decay;
    m[j] = m[j] * s.beta1 + s.one_minus_beta1 * gj;
    v[j] = v[j] * s.beta2 + s.one_minus_beta2 * gj * gj;
    const float denom = std::sqrt(v[j]) / s.bc2_sqrt + s.eps;
    w[j] -= s.step_size * (m[j] / denom);
  }
}

void sgd_update(float* w, const float* g, float* buf, int64_t n, const SGDStep& s) {
#pragma omp parallel if (worth_parallel(n))
  {
    const DenormalMode flush(Denormals::Flush);  // see optim.hpp
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      float d = g[j] * s.grad_scale;
      if (s.weight_decay != 0.0f) d += s.weight_decay * w[j];
      if (buf) {
        buf[j] = s.first ? d : buf[j] * s.momentum + s.keep * d;  // the first step copies d (PyTorch clones it)
        d = s.nesterov ? d + s.momentum * buf[j] : buf[j];
      }
      w[j] -= s.lr * d;
    }
  }
}

double sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  memory::Buffer<double> partial(static_cast<size_t>(chunks));
  parallel_for(chunks, chunks > 1, [&](int64_t c) {
    const int64_t begin = c * kChunk;
    const float* xc = x + begin;  // in double: a float's square is exact there, so fused or not, every ISA agrees
    partial[static_cast<size_t>(c)] = simd::lane_sum<double>(
        std::min(n - begin, kChunk), [&](int64_t i) { return static_cast<double>(xc[i]) * xc[i]; });
  });
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[static_cast<size_t>(c)];
  return total;
}

double sum_of_squares_reference(const float* x, int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

void scale(float* x, int64_t n, float factor) {
  parallel_for(n, worth_parallel(n), [&](int64_t i) { x[i] *= factor; });
}

}  // namespace qkv::kernels
