// Elementwise ops with NumPy broadcasting, reductions, softmax and cross-entropy, each with its backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "qkv/autograd.hpp"
#include "qkv/kernels.hpp"
#include "qkv/ops.hpp"

namespace qkv {

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const int rank = std::max(a.rank(), b.rank());
  std::vector<int64_t> dims(static_cast<size_t>(rank));
  for (int i = 1; i <= rank; ++i) {
    const int64_t da = i <= a.rank() ? a[-i] : 1;
    const int64_t db = i <= b.rank() ? b[-i] : 1;
    if (da != db && da != 1 && db != 1) {
      throw ShapeError(std::string(op) + ": shapes " + a.str() + " and " + b.str() + " cannot be broadcast together");
    }
    dims[static_cast<size_t>(rank - i)] = da == 1 ? db : da;
  }
  return Shape(std::span<const int64_t>(dims));
}

namespace {

// Strides (in elements) that read `s` as if it had the broadcast shape `out` (padded to kMaxRank):
// a stretched dimension gets stride 0.
std::array<int64_t, kMaxRank> broadcast_strides(const Shape& s, const Shape& out) {
  std::array<int64_t, kMaxRank> strides{};
  int64_t stride = 1;
  for (int i = 1; i <= s.rank(); ++i) {
    strides[static_cast<size_t>(kMaxRank - i)] = s[-i] == 1 ? 0 : stride;
    stride *= s[-i];
  }
  (void)out;
  return strides;
}

std::array<int64_t, kMaxRank> padded_dims(const Shape& s) {
  std::array<int64_t, kMaxRank> dims;
  dims.fill(1);
  for (int i = 1; i <= s.rank(); ++i) dims[static_cast<size_t>(kMaxRank - i)] = s[-i];
  return dims;
}

// Visits every element of the broadcast shape `out` with the offsets of a and b.
template <typename F>
void for_each_broadcast(const Shape& out, const Shape& a, const Shape& b, F&& f) {
  const auto dims = padded_dims(out);
  const auto sa = broadcast_strides(a, out), sb = broadcast_strides(b, out);
  int64_t o = 0;
  for (int64_t i0 = 0; i0 < dims[0]; ++i0)
    for (int64_t i1 = 0; i1 < dims[1]; ++i1)
      for (int64_t i2 = 0; i2 < dims[2]; ++i2) {
        const int64_t base_a = i0 * sa[0] + i1 * sa[1] + i2 * sa[2];
        const int64_t base_b = i0 * sb[0] + i1 * sb[1] + i2 * sb[2];
        for (int64_t i3 = 0; i3 < dims[3]; ++i3, ++o) f(o, base_a + i3 * sa[3], base_b + i3 * sb[3]);
      }
}

enum class BinaryOp { Add, Sub, Mul, Div };

// b's shape is the trailing dimensions of a's (a bias or a position table repeated over leading dims).
bool b_is_suffix(const Shape& a, const Shape& b) {
  if (b.rank() > a.rank() || b.rank() == 0) return false;
  for (int i = 1; i <= b.rank(); ++i)
    if (a[-i] != b[-i]) return false;
  return true;
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add: return "add";
    case BinaryOp::Sub: return "sub";
    case BinaryOp::Mul: return "mul";
    case BinaryOp::Div: return "div";
  }
  return "?";
}

// One forward and one backward for the four arithmetic ops. Backward, per element:
//   add: da += g,     db += g          sub: da += g,     db -= g
//   mul: da += g·b,   db += g·a        div: da += g/b,   db -= g·a/b²
// and a broadcast operand sums the contributions of every position it was stretched over.
Tensor binary(const Tensor& a, const Tensor& b, BinaryOp op) {
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), binary_name(op));
  Tensor out = Tensor::empty(out_shape);
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.data();
  auto apply = [&](auto fn) {
    if (a.shape() == b.shape()) {
      const int64_t n = out.numel();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) po[i] = fn(pa[i], pb[i]);
    } else {
      const int64_t inner = b.numel();
      if (b_is_suffix(a.shape(), b.shape()) && inner > 0) {  // (…, C) op (C) or (B, T, C) op (T, C): rows in parallel
        const int64_t outer = a.numel() / inner;
#pragma omp parallel for schedule(static) if (a.numel() > (1 << 16))
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t i = 0; i < inner; ++i) po[o * inner + i] = fn(pa[o * inner + i], pb[i]);
      } else {
        for_each_broadcast(out_shape, a.shape(), b.shape(), [&](int64_t o, int64_t ia, int64_t ib) { po[o] = fn(pa[ia], pb[ib]); });
      }
    }
  };
  switch (op) {
    case BinaryOp::Add: apply([](float x, float y) { return x + y; }); break;
    case BinaryOp::Sub: apply([](float x, float y) { return x - y; }); break;
    case BinaryOp::Mul: apply([](float x, float y) { return x * y; }); break;
    case BinaryOp::Div: apply([](float x, float y) { return x / y; }); break;
  }
  if (detail::needs_grad({&a, &b})) {
    static constexpr const char* kNames[] = {"AddBackward", "SubBackward", "MulBackward", "DivBackward"};
    detail::record(out, kNames[static_cast<int>(op)], {a, b}, [a, b, op, out_shape](const Tensor& dout) {
      float* da = detail::grad_buffer(a);
      float* db = detail::grad_buffer(b);
      const float* g = dout.data();
      const float* pa = a.data();
      const float* pb = b.data();
      auto step = [&](int64_t o, int64_t ia, int64_t ib) {
        switch (op) {
          case BinaryOp::Add:
            if (da) da[ia] += g[o];
            if (db) db[ib] += g[o];
            break;
          case BinaryOp::Sub:
            if (da) da[ia] += g[o];
            if (db) db[ib] -= g[o];
            break;
          case BinaryOp::Mul:
            if (da) da[ia] += g[o] * pb[ib];
            if (db) db[ib] += g[o] * pa[ia];
            break;
          case BinaryOp::Div:
            if (da) da[ia] += g[o] / pb[ib];
            if (db) db[ib] -= g[o] * pa[ia] / (pb[ib] * pb[ib]);
            break;
        }
      };
      if (a.shape() == b.shape()) {  // the common case (residual connections): one index, in parallel
        const int64_t n = dout.numel();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
        for (int64_t i = 0; i < n; ++i) step(i, i, i);
      } else if (op == BinaryOp::Add && b_is_suffix(a.shape(), b.shape())) {  // residual + position table
        const int64_t inner = b.numel(), outer = a.numel() / std::max<int64_t>(inner, 1);
        if (da) {
#pragma omp parallel for schedule(static) if (a.numel() > (1 << 16))
          for (int64_t i = 0; i < a.numel(); ++i) da[i] += g[i];
        }
        if (db) kernels::add_column_sums(g, db, outer, inner);
      } else {
        for_each_broadcast(out_shape, a.shape(), b.shape(), step);
      }
    });
  }
  return out;
}

// y = f(x) elementwise; backward dx += g · f'(x, y).
template <typename Forward, typename Derivative>
Tensor unary(const Tensor& x, const char* name, Forward f, Derivative df) {
  Tensor out = Tensor::empty(x.shape());
  const float* px = x.data();
  float* py = out.data();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) py[i] = f(px[i]);
  if (detail::needs_grad({&x})) {
    detail::record(out, name, {x}, [x, out = out.detach(), df](const Tensor& dout) {
      float* dx = detail::grad_buffer(x);
      const float* g = dout.data();
      const float* px = x.data();
      const float* py = out.data();
      for (int64_t i = 0, n = x.numel(); i < n; ++i) dx[i] += g[i] * df(px[i], py[i]);
    });
  }
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Add); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Sub); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Mul); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Div); }

Tensor add(const Tensor& a, float b) {
  return unary(a, "AddScalarBackward", [b](float x) { return x + b; }, [](float, float) { return 1.0f; });
}
Tensor mul(const Tensor& a, float b) {
  return unary(a, "MulScalarBackward", [b](float x) { return x * b; }, [b](float, float) { return b; });
}
Tensor div(const Tensor& a, float b) {
  return unary(a, "DivScalarBackward", [b](float x) { return x / b; }, [b](float, float) { return 1.0f / b; });
}
Tensor neg(const Tensor& a) {
  return unary(a, "NegBackward", [](float x) { return -x; }, [](float, float) { return -1.0f; });
}
Tensor exp(const Tensor& a) {
  return unary(a, "ExpBackward", [](float x) { return std::exp(x); }, [](float, float y) { return y; });
}
Tensor log(const Tensor& a) {
  return unary(a, "LogBackward", [](float x) { return std::log(x); }, [](float x, float) { return 1.0f / x; });
}

// ---- reductions ----

// sum over `dim`: view t as (outer, n, inner) and add along n. Backward broadcasts g back over n.
Tensor sum(const Tensor& t, int dim, bool keepdim) {
  const int d = t.shape().normalize(dim, "sum");
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= t.size(i);
  for (int i = d + 1; i < t.rank(); ++i) inner *= t.size(i);
  const int64_t n = t.size(d);
  std::vector<int64_t> dims(t.shape().dims().begin(), t.shape().dims().end());
  if (keepdim) dims[static_cast<size_t>(d)] = 1;
  else dims.erase(dims.begin() + d);
  Tensor out = Tensor::zeros(Shape(std::span<const int64_t>(dims)));
  const float* src = t.data();
  float* dst = out.data();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t i = 0; i < inner; ++i) dst[o * inner + i] += src[(o * n + k) * inner + i];
  if (detail::needs_grad({&t})) {
    detail::record(out, "SumBackward", {t}, [t, outer, n, inner](const Tensor& dout) {
      float* dt = detail::grad_buffer(t);
      const float* g = dout.data();
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t k = 0; k < n; ++k)
          for (int64_t i = 0; i < inner; ++i) dt[(o * n + k) * inner + i] += g[o * inner + i];
    });
  }
  return out;
}

Tensor sum(const Tensor& t) {
  if (t.rank() == 0) return reshape(t, Shape{});
  return sum(reshape(t, Shape{t.numel()}), 0);
}

Tensor mean(const Tensor& t, int dim, bool keepdim) {
  const int64_t n = t.size(dim);
  return div(sum(t, dim, keepdim), static_cast<float>(n));
}

Tensor mean(const Tensor& t) { return div(sum(t), static_cast<float>(t.numel())); }

// softmax along the last dim. Backward from the output y: dx = y ⊙ (g − Σ g ⊙ y).
Tensor softmax(const Tensor& t) {
  if (t.rank() == 0) throw ShapeError("softmax: needs at least one dimension, got a scalar");
  const int64_t n = t.size(-1);
  const int64_t rows = n ? t.numel() / n : 0;
  Tensor out = Tensor::empty(t.shape());
  kernels::softmax_rows(t.data(), out.data(), rows, n);
  if (detail::needs_grad({&t})) {
    detail::record(out, "SoftmaxBackward", {t}, [t, y = out.detach(), rows, n](const Tensor& dout) {
      kernels::softmax_rows_backward(y.data(), dout.data(), detail::grad_buffer(t), rows, n);
    });
  }
  return out;
}

// cross_entropy: loss = (1/N') Σ_r [logsumexp(z_r) − z_r[target_r]] over the N' rows not ignored.
// Backward: dz_r = (softmax(z_r) − onehot(target_r)) · g / N'.
Tensor cross_entropy(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index) {
  if (logits.rank() != 2) throw ShapeError("cross_entropy: logits must be (N, V), got " + logits.shape().str());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (static_cast<int64_t>(targets.size()) != rows) {
    throw ShapeError("cross_entropy: " + std::to_string(targets.size()) + " targets for logits of shape " +
                     logits.shape().str());
  }
  Tensor probs = Tensor::empty(logits.shape());
  std::vector<float> lse(static_cast<size_t>(rows));
  kernels::softmax_rows_lse(logits.data(), probs.data(), lse.data(), rows, vocab);
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t target = targets[static_cast<size_t>(r)];
    if (target == ignore_index) continue;
    if (target < 0 || target >= vocab) {
      throw ValueError("cross_entropy: target " + std::to_string(target) + " at row " + std::to_string(r) +
                       " is outside [0, " + std::to_string(vocab) + ")");
    }
    // −log p_target = logsumexp(z) − z_target, from the logits so a tiny p cannot underflow to 0.
    total += static_cast<double>(lse[static_cast<size_t>(r)]) - logits.data()[r * vocab + target];
    ++counted;
  }
  // All rows ignored: PyTorch returns NaN (0/0); so do we.
  Tensor out = Tensor::scalar(static_cast<float>(total / static_cast<double>(counted)));
  if (detail::needs_grad({&logits})) {
    std::vector<int64_t> kept(targets.begin(), targets.end());
    detail::record(out, "CrossEntropyBackward", {logits},
                   [logits, probs, kept = std::move(kept), ignore_index, rows, vocab, counted](const Tensor& dout) {
                     float* dz = detail::grad_buffer(logits);
                     const float scale = dout.item() / static_cast<float>(counted);
#pragma omp parallel for schedule(static) if (rows * vocab > (1 << 16))
                     for (int64_t r = 0; r < rows; ++r) {
                       const int64_t target = kept[static_cast<size_t>(r)];
                       if (target == ignore_index) continue;
                       const float* p = probs.data() + r * vocab;
                       for (int64_t j = 0; j < vocab; ++j) dz[r * vocab + j] += scale * p[j];
                       dz[r * vocab + target] -= scale;
                     }
                   });
  }
  return out;
}

}  // namespace qkv
