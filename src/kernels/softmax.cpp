// Row softmax and cross-entropy, each beside its scalar reference.
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "qkv/kernels/elementwise.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/gemm.hpp"

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
  parallel_for(rows, worth_parallel(rows * n), [&](int64_t r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float max_value = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max_value = std::max(max_value, xr[j]);
    // std::max skips a NaN, but the NaN still reaches the sum, so the whole row becomes NaN as in PyTorch.
    const float sum = simd::exp_shifted_sum(xr, yr, n, max_value);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) yr[j] = flush_denormal(yr[j] * inv);
    if (lse) lse[r] = max_value + std::log(sum);
  });
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
  parallel_for(rows, worth_parallel(rows * n), [&](int64_t r) {
    const float* yr = y + r * n;
    const float* dyr = dy + r * n;
    float* dxr = dx + r * n;
    float dot = 0.0f;
    for (int64_t j = 0; j < n; ++j) dot += yr[j] * dyr[j];
    for (int64_t j = 0; j < n; ++j) dxr[j] += yr[j] * (dyr[j] - dot);
  });
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
  memory::Buffer<float> lse(static_cast<size_t>(rows));
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
  parallel_for(rows, worth_parallel(rows * V), [&](int64_t r) {
    if (targets[r] == ignore_index) return;
    const float* p = probs + r * V;
    float* dz = dlogits + r * V;
    for (int64_t j = 0; j < V; ++j) dz[j] += flush_denormal(scale * p[j]);
    dz[targets[r]] -= scale;
  });
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

namespace {
// Targets are checked before any work: the index of the first one outside [0, V) (and not ignored), else −1;
// with the number of counted rows.
int64_t check_targets(const int64_t* targets, int64_t N, int64_t V, int64_t ignore_index, int64_t* counted) {
  *counted = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (targets[r] == ignore_index) continue;
    if (targets[r] < 0 || targets[r] >= V) return r;
    ++*counted;
  }
  return -1;
}
}  // namespace

// Rows per block: 16M floats (64 MiB) of logits, or C rows when that is more (the block is then the size of the
// (V × C) weight, whose gradient the pass holds anyway), up to 64M floats (256 MiB) for wide models. Every block
// streams the whole weight three times (logits, dx, dW) and its rows are the weight-gradient GEMM's K, so fewer,
// taller blocks are faster: the GPT-2 head (V = 50,257, C = 768) takes 768 rows instead of 333, and 2,048 rows on
// 2 threads measured 1,644–1,710 → 1,530–1,611 ms.
int64_t linear_cross_entropy_block_rows(int64_t N, int64_t C, int64_t V) {
  if (N <= 0 || V <= 0) return 1;
  return std::clamp<int64_t>(std::max((int64_t{16} << 20) / V, std::min(C, (int64_t{64} << 20) / V)), 1, N);
}

CrossEntropySum linear_cross_entropy(const float* x, const float* weight, const float* bias, const int64_t* targets,
                                     int64_t N, int64_t C, int64_t V, int64_t ignore_index, float* dx, float* dweight,
                                     float* dbias, int64_t block_rows, const uint16_t* x_bf16,
                                     const uint16_t* weight_bf16) {
  CrossEntropySum out;
  out.bad_row = check_targets(targets, N, V, ignore_index, &out.counted);
  if (out.bad_row >= 0 || N <= 0 || V <= 0) return out;
  const bool grad = dx || dweight || dbias;
  const float scale = out.counted > 0 ? 1.0f / static_cast<float>(out.counted) : 0.0f;
  const int64_t R = block_rows > 0 ? std::min(block_rows, N) : linear_cross_entropy_block_rows(N, C, V);
  memory::Buffer<float> block(static_cast<size_t>(R * V));
  memory::Buffer<double> row_loss(static_cast<size_t>(N));
  const bool half = x_bf16 && weight_bf16;
  memory::Buffer<uint16_t> block_bf16(half && grad ? static_cast<size_t>(R * V) : 1);  // dlogits in bf16
  std::fill_n(row_loss.data(), N, 0.0);
  if (dbias) std::fill_n(dbias, V, 0.0f);
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t rows = std::min(R, N - r0);
    float* z = block.data();
    if (bias) copy_rows(bias, 0, z, V, rows, V, false);
    if (half)
      gemm_bf16(false, true, rows, V, C, 1.0f, x_bf16 + r0 * C, C, weight_bf16, C, bias ? 1.0f : 0.0f, z, V);
    else
      gemm(false, true, rows, V, C, 1.0f, x + r0 * C, C, weight, C, bias ? 1.0f : 0.0f, z, V);  // logits
    parallel_for(rows, worth_parallel(rows * V), [&](int64_t r) {
      float* zr = z + r * V;
      const int64_t t = targets[r0 + r];
      const float target_logit = t == ignore_index ? 0.0f : zr[t];
      float max_value = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) max_value = std::max(max_value, zr[j]);
      const float sum = simd::exp_shifted_sum(zr, zr, V, max_value);  // zr ← e^(z − max)
      if (t != ignore_index) row_loss[static_cast<size_t>(r0 + r)] = static_cast<double>(max_value + std::log(sum)) - target_logit;
      if (!grad) return;
      if (t == ignore_index) {
        std::fill_n(zr, V, 0.0f);
        return;
      }
      // The same roundings as cross_entropy's probabilities and gradient: p = e/Σ, then p / counted.
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < V; ++j) zr[j] = flush_denormal(flush_denormal(zr[j] * inv) * scale);
      zr[t] -= scale;
    });
    if (!grad) continue;
    // dz holds probabilities down to 1.2e-38; their products with small weights would be denormals (gemm.hpp).
    const Denormals flush = Denormals::Flush;
    if (half) {  // bf16 products flush denormals in hardware (VDPBF16PS): no assists to avoid
      uint16_t* dz = block_bf16.data();
      f32_to_bf16(z, dz, rows * V);
      if (dx) gemm_bf16(false, false, rows, C, V, 1.0f, dz, V, weight_bf16, C, 0.0f, dx + r0 * C, C);
      if (dweight) gemm_bf16(true, false, V, C, rows, 1.0f, dz, V, x_bf16 + r0 * C, C, r0 == 0 ? 0.0f : 1.0f, dweight, C);
    } else {
      if (dx) gemm(false, false, rows, C, V, 1.0f, z, V, weight, C, 0.0f, dx + r0 * C, C, flush);  // dx = dz W
      if (dweight) gemm(true, false, V, C, rows, 1.0f, z, V, x + r0 * C, C, r0 == 0 ? 0.0f : 1.0f, dweight, C, flush);  // += dzᵀ x
    }
    if (dbias) add_column_sums(z, dbias, rows, V);
  }
  for (int64_t r = 0; r < N; ++r) out.total += row_loss[static_cast<size_t>(r)];
  return out;
}

CrossEntropySum linear_cross_entropy_reference(const float* x, const float* weight, const float* bias,
                                               const int64_t* targets, int64_t N, int64_t C, int64_t V,
                                               int64_t ignore_index, float* dx, float* dweight, float* dbias) {
  CrossEntropySum out;
  out.bad_row = check_targets(targets, N, V, ignore_index, &out.counted);
  if (out.bad_row >= 0) return out;
  std::vector<double> dw(static_cast<size_t>(V * C), 0.0), db(static_cast<size_t>(V), 0.0), z(static_cast<size_t>(V));
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t v = 0; v < V; ++v) {
      double acc = bias ? bias[v] : 0.0;
      for (int64_t c = 0; c < C; ++c) acc += static_cast<double>(x[r * C + c]) * weight[v * C + c];
      z[static_cast<size_t>(v)] = acc;
    }
    const int64_t t = targets[r];
    std::vector<double> dxr(static_cast<size_t>(C), 0.0);
    if (dx) std::fill_n(dx + r * C, C, 0.0f);
    if (t == ignore_index) continue;
    const double max_value = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (double v : z) sum += std::exp(v - max_value);
    out.total += max_value + std::log(sum) - z[static_cast<size_t>(t)];
    for (int64_t v = 0; v < V; ++v) {
      const double g = (std::exp(z[static_cast<size_t>(v)] - max_value) / sum - (v == t)) / static_cast<double>(out.counted);
      db[static_cast<size_t>(v)] += g;
      for (int64_t c = 0; c < C; ++c) {
        dxr[static_cast<size_t>(c)] += g * weight[v * C + c];
        dw[static_cast<size_t>(v * C + c)] += g * x[r * C + c];
      }
    }
    if (dx)
      for (int64_t c = 0; c < C; ++c) dx[r * C + c] = static_cast<float>(dxr[static_cast<size_t>(c)]);
  }
  if (dweight)
    for (size_t i = 0; i < dw.size(); ++i) dweight[i] = static_cast<float>(dw[i]);
  if (dbias)
    for (size_t i = 0; i < db.size(); ++i) dbias[i] = static_cast<float>(db[i]);
  return out;
}

}  // namespace qkv::kernels
