// Row softmax and cross-entropy, each beside its scalar reference.
#include "qkv/kernels/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {
// A denormal result becomes 0: probabilities and gradients below float's smallest normal (1.2e-38) carry
// nothing, and denormals slow every product that reads them by ~100× (see simd::kExpFlushBelow).
inline float flush_denormal(float v) { return std::fabs(v) < std::numeric_limits<float>::min() ? 0.0f : v; }
}  // namespace

void softmax_rows(const float* x, float* y, int64_t rows, int64_t n) { softmax_rows_lse(x, y, nullptr, rows, n); }

void softmax_rows_lse(const float* x, float* y, float* lse, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (worth_parallel(rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float max_value = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max(max_value, xr[j]);
    // std::max skips a NaN, but the NaN still reaches the sum, so the whole row becomes NaN as in PyTorch.
    const float sum = simd::exp_shifted_sum(xr, yr, n, max_value);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) yr[j] = flush_denormal(yr[j] * inv);
    if (lse) lse[r] = max_value + std::log(sum);
  }
}

void softmax_rows_reference(const float* x, float* y, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    double max_value = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max<double>(max_value, x[r * n + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(static_cast<double>(x[r * n + j]) - max_value);
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = static_cast<float>(std::exp(x[r * n + j] - max_value) / sum);
  }
}

void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (worth_parallel(rows * n))
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * n;
    const float* dyr = dy + r * n;
    float* dxr = dx + r * n;
    float dot = 0.0f;
    for (int64_t j = 0; j < n; ++j) dot += yr[j] * dyr[j];
    for (int64_t j = 0; j < n; ++j) dxr[j] += yr[j] * (dyr[j] - dot);
  }
}

void softmax_rows_backward_reference(const float* y, const float* dy, float* dx, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0.0;
    for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(y[r * n + j]) * dy[r * n + j];
    for (int64_t j = 0; j < n; ++j) dx[r * n + j] += static_cast<float>(y[r * n + j] * (dy[r * n + j] - dot));
  }
}

double cross_entropy_forward(const float* logits, const int64_t* targets, float* probs, int64_t rows, int64_t V,
                             int64_t ignore_index, int64_t* counted, int64_t* bad_row) {
  *bad_row = -1;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] != ignore_index && (targets[r] < 0 || targets[r] >= V)) {
      *bad_row = r;
      *counted = 0;
      return 0.0;
    }
  }
  std::vector<float> lse(static_cast<size_t>(rows));
  softmax_rows_lse(logits, probs, lse.data(), rows, V);
  double total = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    // −log p_target = logsumexp(z) − z_target, from the logits so a tiny p cannot underflow to 0.
    total += static_cast<double>(lse[static_cast<size_t>(r)]) - logits[r * V + targets[r]];
    ++n;
  }
  *counted = n;
  return total;
}

double cross_entropy_forward_reference(const float* logits, const int64_t* targets, int64_t rows, int64_t V,
                                       int64_t ignore_index, int64_t* counted) {
  double total = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    double max_value = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < V; ++j) max_value = std::max<double>(max_value, logits[r * V + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[r * V + j] - max_value);
    total += max_value + std::log(sum) - logits[r * V + targets[r]];
    ++n;
  }
  *counted = n;
  return total;
}

void cross_entropy_backward(const float* probs, const int64_t* targets, float* dlogits, int64_t rows, int64_t V,
                            int64_t ignore_index, float scale) {
#pragma omp parallel for schedule(static) if (worth_parallel(rows * V))
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    const float* p = probs + r * V;
    float* dz = dlogits + r * V;
    for (int64_t j = 0; j < V; ++j) dz[j] += flush_denormal(scale * p[j]);
    dz[targets[r]] -= scale;
  }
}

void cross_entropy_backward_reference(const float* logits, const int64_t* targets, float* dlogits, int64_t rows,
                                      int64_t V, int64_t ignore_index, float scale) {
  std::vector<float> probs(static_cast<size_t>(V));
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    softmax_rows_reference(logits + r * V, probs.data(), 1, V);
    for (int64_t j = 0; j < V; ++j)
      dlogits[r * V + j] += static_cast<float>(static_cast<double>(scale) * (probs[static_cast<size_t>(j)] - (j == targets[r])));
  }
}

}  // namespace qkv::kernels
