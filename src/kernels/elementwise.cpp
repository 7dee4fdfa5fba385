// Elementwise kernels (see qkv/kernels/elementwise.hpp): broadcasting arithmetic, unary maps, sums, masks,
// copies, transposes and counter-based dropout.
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/elementwise.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "parallel.hpp"
#include "simd.hpp"

namespace qkv::kernels {

namespace {

constexpr int64_t kChunkRows = 64;  // reduction chunk: independent of the thread count

bool contiguous(const std::array<int64_t, 4>& stride, const std::array<int64_t, 4>& dims) {
  int64_t expected = 1;
  for (int i = 3; i >= 0; --i) {
    if (dims[static_cast<size_t>(i)] != 1 && stride[static_cast<size_t>(i)] != expected) return false;
    expected *= dims[static_cast<size_t>(i)];
  }
  return true;
}

// Elements of an operand seen through strides: the output's dims it is not stretched over.
int64_t operand_size(const std::array<int64_t, 4>& stride, const std::array<int64_t, 4>& dims) {
  int64_t n = 1;
  for (size_t i = 0; i < 4; ++i)
    if (stride[i] != 0) n *= dims[i];
  return n;
}

// b repeats a contiguous block of `inner` elements over the leading dimensions (a bias, a position table):
// its strides are 0 for dims [0, split) and contiguous for [split, 4).
int64_t suffix_block(const Broadcast& s) {
  for (int split = 0; split <= 4; ++split) {
    bool ok = true;
    int64_t expected = 1;
    for (int i = 3; i >= split && ok; --i) {
      const size_t k = static_cast<size_t>(i);
      ok = s.dims[k] == 1 || s.b_stride[k] == expected;
      expected *= s.dims[k];
    }
    for (int i = 0; i < split && ok; ++i) ok = s.dims[static_cast<size_t>(i)] == 1 || s.b_stride[static_cast<size_t>(i)] == 0;
    if (ok) return expected;
  }
  return 0;
}

inline float apply(BinaryOp op, float x, float y) {
  switch (op) {
    case BinaryOp::Add: return x + y;
    case BinaryOp::Sub: return x - y;
    case BinaryOp::Mul: return x * y;
    case BinaryOp::Div: return x / y;
  }
  return 0.0f;
}

// ∂/∂a and ∂/∂b of a op b, times g.
inline float grad_a(BinaryOp op, float g, float, float y) {
  return op == BinaryOp::Mul ? g * y : op == BinaryOp::Div ? g / y : g;
}
inline float grad_b(BinaryOp op, float g, float x, float y) {
  switch (op) {
    case BinaryOp::Add: return g;
    case BinaryOp::Sub: return -g;
    case BinaryOp::Mul: return g * x;
    case BinaryOp::Div: return -g * x / (y * y);
  }
  return 0.0f;
}

// Visits every output element in order with the offsets of a and b.
template <typename F>
void for_each(const Broadcast& s, F&& f) {
  int64_t o = 0;
  for (int64_t i0 = 0; i0 < s.dims[0]; ++i0)
    for (int64_t i1 = 0; i1 < s.dims[1]; ++i1)
      for (int64_t i2 = 0; i2 < s.dims[2]; ++i2) {
        const int64_t base_a = i0 * s.a_stride[0] + i1 * s.a_stride[1] + i2 * s.a_stride[2];
        const int64_t base_b = i0 * s.b_stride[0] + i1 * s.b_stride[1] + i2 * s.b_stride[2];
        for (int64_t i3 = 0; i3 < s.dims[3]; ++i3, ++o) f(o, base_a + i3 * s.a_stride[3], base_b + i3 * s.b_stride[3]);
      }
}

// Calls f with the op as a compile-time constant, so each loop body is specialised and vectorises.
template <typename F>
void dispatch(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::Add: return f(std::integral_constant<BinaryOp, BinaryOp::Add>{});
    case BinaryOp::Sub: return f(std::integral_constant<BinaryOp, BinaryOp::Sub>{});
    case BinaryOp::Mul: return f(std::integral_constant<BinaryOp, BinaryOp::Mul>{});
    case BinaryOp::Div: return f(std::integral_constant<BinaryOp, BinaryOp::Div>{});
  }
}

}  // namespace

namespace {
template <BinaryOp op>
void binary_forward_impl(const Broadcast& s, const float* a, const float* b, float* out) {
  const int64_t n = s.numel();
  const bool a_full = contiguous(s.a_stride, s.dims);
  if (a_full && contiguous(s.b_stride, s.dims)) {  // same shapes: one flat loop
    parallel_for(n, worth_parallel(n), [&](int64_t i) { out[i] = apply(op, a[i], b[i]); });
    return;
  }
  const int64_t inner = a_full ? suffix_block(s) : 0;
  if (inner > 0) {  // (…, C) op (C) or (B, T, C) op (T, C): rows in parallel
    const int64_t outer = n / inner;
    parallel_for(outer, worth_parallel(n), [&](int64_t r) {
      for (int64_t i = 0; i < inner; ++i) out[r * inner + i] = apply(op, a[r * inner + i], b[i]);
    });
    return;
  }
  for_each(s, [&](int64_t o, int64_t ia, int64_t ib) { out[o] = apply(op, a[ia], b[ib]); });
}

}  // namespace

void binary_forward_reference(BinaryOp op, const Broadcast& s, const float* a, const float* b, float* out) {
  for_each(s, [&](int64_t o, int64_t ia, int64_t ib) {
    const double x = a[ia], y = b[ib];
    const double r = op == BinaryOp::Add ? x + y : op == BinaryOp::Sub ? x - y : op == BinaryOp::Mul ? x * y : x / y;
    out[o] = static_cast<float>(r);
  });
}

namespace {
template <BinaryOp op>
void binary_backward_impl(const Broadcast& s, const float* a, const float* b, const float* g, float* da, float* db,
                          bool accumulate_a, bool accumulate_b) {
  const int64_t n = s.numel();
  const bool a_full = contiguous(s.a_stride, s.dims), b_full = contiguous(s.b_stride, s.dims);
  if (a_full && b_full) {  // the common case (residual connections): one index, in parallel, one pass per gradient
    parallel_for(n, worth_parallel(n), [&](int64_t i) {
      if (da) da[i] = (accumulate_a ? da[i] : 0.0f) + grad_a(op, g[i], a[i], b[i]);
      if (db) db[i] = (accumulate_b ? db[i] : 0.0f) + grad_b(op, g[i], a[i], b[i]);
    });
    return;
  }
  // The broadcasting paths add into their gradients: a written one starts from zero.
  if (da && !accumulate_a) std::fill_n(da, operand_size(s.a_stride, s.dims), 0.0f);
  if (db && !accumulate_b) std::fill_n(db, operand_size(s.b_stride, s.dims), 0.0f);
  const int64_t inner = a_full ? suffix_block(s) : 0;
  if (inner > 0 && (op == BinaryOp::Add || op == BinaryOp::Sub)) {  // residual + position table, bias
    const int64_t outer = n / inner;
    if (da) accumulate(da, g, n);
    if (db) {
      if (op == BinaryOp::Add) {
        add_column_sums(g, db, outer, inner);
      } else {
        memory::Buffer<float> sums(static_cast<size_t>(inner));
        std::fill_n(sums.data(), inner, 0.0f);
        add_column_sums(g, sums.data(), outer, inner);
        for (int64_t i = 0; i < inner; ++i) db[i] -= sums[static_cast<size_t>(i)];
      }
    }
    return;
  }
  for_each(s, [&](int64_t o, int64_t ia, int64_t ib) {
    if (da) da[ia] += grad_a(op, g[o], a[ia], b[ib]);
    if (db) db[ib] += grad_b(op, g[o], a[ia], b[ib]);
  });
}

}  // namespace

void binary_forward(BinaryOp op, const Broadcast& s, const float* a, const float* b, float* out) {
  dispatch(op, [&](auto c) { binary_forward_impl<c()>(s, a, b, out); });
}

void binary_backward(BinaryOp op, const Broadcast& s, const float* a, const float* b, const float* g, float* da,
                     float* db, bool accumulate_a, bool accumulate_b) {
  dispatch(op, [&](auto c) { binary_backward_impl<c()>(s, a, b, g, da, db, accumulate_a, accumulate_b); });
}

void binary_backward_reference(BinaryOp op, const Broadcast& s, const float* a, const float* b, const float* g,
                               float* da, float* db) {
  for_each(s, [&](int64_t o, int64_t ia, int64_t ib) {
    if (da) da[ia] += grad_a(op, g[o], a[ia], b[ib]);
    if (db) db[ib] += grad_b(op, g[o], a[ia], b[ib]);
  });
}

// ---- unary ----

namespace {
inline float unary(UnaryOp op, float s, float x) {
  switch (op) {
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::DivScalar: return x / s;
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return std::exp(x);
    case UnaryOp::Log: return std::log(x);
    case UnaryOp::SoftCap: return s * std::tanh(x / s);
    case UnaryOp::Sigmoid: return 1.0f / (1.0f + std::exp(-x));
    case UnaryOp::Softplus: return x > 20.0f ? x : std::log1p(std::exp(x));
  }
  return 0.0f;
}
inline float derivative(UnaryOp op, float s, float x, float y) {
  switch (op) {
    case UnaryOp::AddScalar: return 1.0f;
    case UnaryOp::MulScalar: return s;
    case UnaryOp::DivScalar: return 1.0f / s;
    case UnaryOp::Neg: return -1.0f;
    case UnaryOp::Exp: return y;
    case UnaryOp::Log: return 1.0f / x;
    case UnaryOp::SoftCap: {  // d/dx s·tanh(x/s) = 1 − tanh²(x/s) = 1 − (y/s)²
      const float t = y / s;
      return 1.0f - t * t;
    }
    case UnaryOp::Sigmoid: return y * (1.0f - y);
    case UnaryOp::Softplus: return x > 20.0f ? 1.0f : 1.0f / (1.0f + std::exp(-x));  // σ(x), 1 where softplus is x
  }
  return 0.0f;
}
}  // namespace

namespace {
template <UnaryOp op>
void unary_forward_impl(float s, const float* x, float* y, int64_t n) {
  parallel_for(n, worth_parallel(n), [&](int64_t i) { y[i] = unary(op, s, x[i]); });
}
template <UnaryOp op>
void unary_backward_impl(float s, const float* x, const float* y, const float* g, float* dx, int64_t n) {
  parallel_for(n, worth_parallel(n), [&](int64_t i) { dx[i] += g[i] * derivative(op, s, x[i], y[i]); });
}
template <typename F>
void dispatch(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::AddScalar: return f(std::integral_constant<UnaryOp, UnaryOp::AddScalar>{});
    case UnaryOp::MulScalar: return f(std::integral_constant<UnaryOp, UnaryOp::MulScalar>{});
    case UnaryOp::DivScalar: return f(std::integral_constant<UnaryOp, UnaryOp::DivScalar>{});
    case UnaryOp::Neg: return f(std::integral_constant<UnaryOp, UnaryOp::Neg>{});
    case UnaryOp::Exp: return f(std::integral_constant<UnaryOp, UnaryOp::Exp>{});
    case UnaryOp::Log: return f(std::integral_constant<UnaryOp, UnaryOp::Log>{});
    case UnaryOp::SoftCap: return f(std::integral_constant<UnaryOp, UnaryOp::SoftCap>{});
    case UnaryOp::Sigmoid: return f(std::integral_constant<UnaryOp, UnaryOp::Sigmoid>{});
    case UnaryOp::Softplus: return f(std::integral_constant<UnaryOp, UnaryOp::Softplus>{});
  }
}
}  // namespace

void unary_forward(UnaryOp op, float s, const float* x, float* y, int64_t n) {
  dispatch(op, [&](auto c) { unary_forward_impl<c()>(s, x, y, n); });
}

void unary_backward(UnaryOp op, float s, const float* x, const float* y, const float* g, float* dx, int64_t n) {
  dispatch(op, [&](auto c) { unary_backward_impl<c()>(s, x, y, g, dx, n); });
}

void unary_forward_reference(UnaryOp op, float s, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    double r = 0.0;
    switch (op) {
      case UnaryOp::AddScalar: r = v + s; break;
      case UnaryOp::MulScalar: r = v * s; break;
      case UnaryOp::DivScalar: r = v / s; break;
      case UnaryOp::Neg: r = -v; break;
      case UnaryOp::Exp: r = std::exp(v); break;
      case UnaryOp::Log: r = std::log(v); break;
      case UnaryOp::SoftCap: r = s * std::tanh(v / s); break;
      case UnaryOp::Sigmoid: r = 1.0 / (1.0 + std::exp(-v)); break;
      case UnaryOp::Softplus: r = v > 20.0 ? v : std::log1p(std::exp(v)); break;
    }
    y[i] = static_cast<float>(r);
  }
}

// ---- sums ----

void sum_middle(const float* x, float* out, int64_t outer, int64_t n, int64_t inner) {
  parallel_for(outer, worth_parallel(outer * n * inner) && outer > 1, [&](int64_t o) {
    float* dst = out + o * inner;
    std::fill_n(dst, inner, 0.0f);
    for (int64_t k = 0; k < n; ++k)
      for (int64_t i = 0; i < inner; ++i) dst[i] += x[(o * n + k) * inner + i];
  });
}

void sum_middle_reference(const float* x, float* out, int64_t outer, int64_t n, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      double acc = 0.0;
      for (int64_t k = 0; k < n; ++k) acc += x[(o * n + k) * inner + i];
      out[o * inner + i] = static_cast<float>(acc);
    }
}

void repeat_middle_accumulate(const float* g, float* dx, int64_t outer, int64_t n, int64_t inner) {
#pragma omp parallel for schedule(static) if (worth_parallel(outer * n * inner) && outer > 1)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t i = 0; i < inner; ++i) dx[(o * n + k) * inner + i] += g[o * inner + i];
}

void add_column_sums(const float* x, float* out, int64_t rows, int64_t cols) {
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  if (chunks <= 1) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[c] += x[r * cols + c];
    return;
  }
  memory::Buffer<float> partial(static_cast<size_t>(chunks * cols));
  std::fill_n(partial.data(), chunks * cols, 0.0f);
  parallel_for(chunks, worth_parallel(rows * cols), [&](int64_t k) {
    float* p = partial.data() + k * cols;
    for (int64_t r = k * kChunkRows; r < std::min(rows, (k + 1) * kChunkRows); ++r)
      for (int64_t c = 0; c < cols; ++c) p[c] += x[r * cols + c];
  });
  for (int64_t k = 0; k < chunks; ++k)
    for (int64_t c = 0; c < cols; ++c) out[c] += partial[static_cast<size_t>(k * cols + c)];
}

void add_column_sums_reference(const float* x, float* out, int64_t rows, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    double acc = 0.0;
    for (int64_t r = 0; r < rows; ++r) acc += x[r * cols + c];
    out[c] += static_cast<float>(acc);
  }
}

// ---- copies and masks ----

void accumulate(float* dst, const float* src, int64_t n) {
  parallel_for(n, worth_parallel(n), [&](int64_t i) { dst[i] += src[i]; });
}

void multiply(const float* a, const float* b, float* dst, int64_t n, bool add) {
  parallel_for(n, worth_parallel(n), [&](int64_t i) { dst[i] = add ? dst[i] + a[i] * b[i] : a[i] * b[i]; });
}

void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows, int64_t width,
               bool add) {
  parallel_for(rows, worth_parallel(rows * width), [&](int64_t r) {
    const float* s = src + r * src_stride;
    float* d = dst + r * dst_stride;
    if (add)
      for (int64_t i = 0; i < width; ++i) d[i] += s[i];
    else
      std::copy_n(s, width, d);
  });
}

void masked_fill(const float* x, const float* mask, float value, float* y, int64_t outer, int64_t inner) {
#pragma omp parallel for schedule(static) if (worth_parallel(outer * inner))
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) y[o * inner + i] = mask[i] != 0.0f ? value : x[o * inner + i];
}

void masked_fill_backward(const float* mask, const float* g, float* dx, int64_t outer, int64_t inner) {
#pragma omp parallel for schedule(static) if (worth_parallel(outer * inner))
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i)
      if (mask[i] == 0.0f) dx[o * inner + i] += g[o * inner + i];
}

void causal_mask(float* mask, int64_t T) {
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < T; ++j) mask[i * T + j] = j > i ? 1.0f : 0.0f;
}

void transpose_batched(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 32;  // tiles keep both the read and the write side in cache
  parallel_for(batch, worth_parallel(batch * rows * cols) && batch > 1, [&](int64_t b) {
    const float* s = src + b * rows * cols;
    float* d = dst + b * rows * cols;
    for (int64_t i0 = 0; i0 < rows; i0 += kBlock)
      for (int64_t j0 = 0; j0 < cols; j0 += kBlock)
        for (int64_t i = i0; i < std::min(rows, i0 + kBlock); ++i)
          for (int64_t j = j0; j < std::min(cols, j0 + kBlock); ++j) d[j * rows + i] = s[i * cols + j];
  });
}

void transpose_strided(const float* src, int64_t rows, int64_t cols, int64_t src_stride, float* dst) {
  constexpr int64_t kBlock = 32;
#pragma omp parallel for schedule(static) if (worth_parallel(rows * cols))
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
    for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
      for (int64_t c = c0; c < std::min(cols, c0 + kBlock); ++c)
        for (int64_t r = r0; r < std::min(rows, r0 + kBlock); ++r) dst[c * rows + r] = src[r * src_stride + c];
}

void transpose_batched_reference(const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) dst[(b * cols + j) * rows + i] = src[(b * rows + i) * cols + j];
}

void swap_axes(const float* src, float* dst, int64_t outer, int64_t n0, int64_t mid, int64_t n1, int64_t inner,
               bool add) {
  if (!add && mid == 1 && inner == 1) {
    transpose_batched(src, dst, outer, n0, n1);
    return;
  }
#pragma omp parallel for schedule(static) if (worth_parallel(outer * n0 * mid * n1 * inner) && outer > 1)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < n0; ++i)
      for (int64_t m = 0; m < mid; ++m)
        for (int64_t j = 0; j < n1; ++j) {
          const float* from = src + (((o * n0 + i) * mid + m) * n1 + j) * inner;
          float* to = dst + (((o * n1 + j) * mid + m) * n0 + i) * inner;
          if (add)
            for (int64_t e = 0; e < inner; ++e) to[e] += from[e];
          else
            std::copy_n(from, inner, to);
        }
}

// ---- dropout ----

namespace {
uint32_t dropout_key(uint64_t seed) {
  return simd::mix32(static_cast<uint32_t>(seed) ^ simd::mix32(static_cast<uint32_t>(seed >> 32) + 0x6a09e667u));
}
// Indices above 2³² wrap; their high half goes into the key so they still get fresh decisions.
uint32_t block_key(uint32_t key, int64_t first) {
  return simd::mix32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32));
}
constexpr int64_t kDropoutBlock = 4096;
}  // namespace

void hashed_dropout(const float* x, float* y, int64_t n, uint64_t seed, float p, bool add) {
  const uint32_t threshold = simd::drop_threshold(p);
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint32_t key = dropout_key(seed);
  const int64_t blocks = (n + kDropoutBlock - 1) / kDropoutBlock;
  parallel_for(blocks, worth_parallel(n), [&](int64_t b) {
    const int64_t first = b * kDropoutBlock, count = std::min(kDropoutBlock, n - first);
    simd::apply_keep(x + first, y + first, count, block_key(key, first), static_cast<uint32_t>(first), threshold, scale,
                     add);
  });
}

void hashed_dropout_reference(const float* x, float* y, int64_t n, uint64_t seed, float p, bool add) {
  const uint32_t threshold = simd::drop_threshold(p);
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint32_t key = dropout_key(seed);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t first = i / kDropoutBlock * kDropoutBlock;
    const bool keep = simd::keep_hash(block_key(key, first), static_cast<uint32_t>(i)) >= threshold;
    const float v = keep ? x[i] * scale : 0.0f;
    y[i] = add ? y[i] + v : v;
  }
}

}  // namespace qkv::kernels
