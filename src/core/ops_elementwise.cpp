// Elementwise ops with NumPy broadcasting, reductions, softmax and cross-entropy, each with its backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "qkv/core/autograd.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/kernels/optim.hpp"
#include "qkv/kernels/softmax.hpp"
#include "qkv/core/ops.hpp"
#include "product.hpp"

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

using kernels::BinaryOp;
using kernels::UnaryOp;

// a and b seen with the broadcast shape `out`, padded to 4 dimensions: a stretched dimension gets stride 0.
kernels::Broadcast broadcast_view(const Shape& out, const Shape& a, const Shape& b) {
  kernels::Broadcast v;
  for (int i = 1; i <= out.rank(); ++i) v.dims[static_cast<size_t>(kMaxRank - i)] = out[-i];
  auto strides = [&](const Shape& s, std::array<int64_t, 4>& dst) {
    int64_t stride = 1;
    for (int i = 1; i <= s.rank(); ++i) {
      dst[static_cast<size_t>(kMaxRank - i)] = s[-i] == 1 ? 0 : stride;
      stride *= s[-i];
    }
  };
  strides(a, v.a_stride);
  strides(b, v.b_stride);
  return v;
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

// One forward and one backward for the four arithmetic ops (kernels::binary_forward / binary_backward); a
// broadcast operand sums the contributions of every position it was stretched over.
Tensor binary(const Tensor& a, const Tensor& b, BinaryOp op) {
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), binary_name(op));
  const kernels::Broadcast view = broadcast_view(out_shape, a.shape(), b.shape());
  Tensor out = Tensor::empty(out_shape);
  kernels::binary_forward(op, view, a.data(), b.data(), out.data());
  if (detail::needs_grad({&a, &b})) {
    static constexpr const char* kNames[] = {"AddBackward", "SubBackward", "MulBackward", "DivBackward"};
    detail::record(out, kNames[static_cast<int>(op)], {a, b}, [a, b, op, view](const Tensor& dout) {
      const auto da = detail::grad_target(a), db = detail::grad_target(b);
      kernels::binary_backward(op, view, a.data(), b.data(), dout.data(), da.data, db.data, da.accumulate, db.accumulate);
    });
  }
  return out;
}

// y = f(x) elementwise (kernels::unary_forward); backward dx += g · f'(x).
Tensor unary(const Tensor& x, const char* name, UnaryOp op, float s = 0.0f) {
  Tensor out = Tensor::empty(x.shape());
  kernels::unary_forward(op, s, x.data(), out.data(), x.numel());
  if (detail::needs_grad({&x})) {
    detail::record(out, name, {x}, [x, out = out.detach(), op, s](const Tensor& dout) {
      kernels::unary_backward(op, s, x.data(), out.data(), dout.data(), detail::grad_buffer(x), x.numel());
    });
  }
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Add); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Sub); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Mul); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(a, b, BinaryOp::Div); }

Tensor add(const Tensor& a, float b) { return unary(a, "AddScalarBackward", UnaryOp::AddScalar, b); }
Tensor mul(const Tensor& a, float b) { return unary(a, "MulScalarBackward", UnaryOp::MulScalar, b); }
Tensor div(const Tensor& a, float b) { return unary(a, "DivScalarBackward", UnaryOp::DivScalar, b); }
Tensor neg(const Tensor& a) { return unary(a, "NegBackward", UnaryOp::Neg); }
Tensor exp(const Tensor& a) { return unary(a, "ExpBackward", UnaryOp::Exp); }
Tensor log(const Tensor& a) { return unary(a, "LogBackward", UnaryOp::Log); }
Tensor sigmoid(const Tensor& a) { return unary(a, "SigmoidBackward", UnaryOp::Sigmoid); }
Tensor softplus(const Tensor& a) { return unary(a, "SoftplusBackward", UnaryOp::Softplus); }
Tensor soft_cap(const Tensor& a, float cap) {
  if (!(cap > 0.0f)) throw ValueError("soft_cap: the cap must be positive, got " + std::to_string(cap));
  return unary(a, "SoftCapBackward", UnaryOp::SoftCap, cap);
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
  Tensor out = Tensor::empty(Shape(std::span<const int64_t>(dims)));
  kernels::sum_middle(t.data(), out.data(), outer, n, inner);
  if (detail::needs_grad({&t})) {
    detail::record(out, "SumBackward", {t}, [t, outer, n, inner](const Tensor& dout) {
      kernels::repeat_middle_accumulate(dout.data(), detail::grad_buffer(t), outer, n, inner);
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

namespace {
void check_target_row(const char* op, std::span<const int64_t> targets, int64_t bad_row, int64_t vocab) {
  if (bad_row < 0) return;
  throw ValueError(std::string(op) + ": target " + std::to_string(targets[static_cast<size_t>(bad_row)]) + " at row " +
                   std::to_string(bad_row) + " is outside [0, " + std::to_string(vocab) + ")");
}
}  // namespace

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
  int64_t counted = 0, bad_row = -1;
  const double total = kernels::cross_entropy_forward(logits.data(), targets.data(), probs.data(), rows, vocab,
                                                      ignore_index, &counted, &bad_row);
  check_target_row("cross_entropy", targets, bad_row, vocab);
  // All rows ignored: PyTorch returns NaN (0/0); so do we.
  Tensor out = Tensor::scalar(static_cast<float>(total / static_cast<double>(counted)));
  if (detail::needs_grad({&logits})) {
    std::vector<int64_t> kept(targets.begin(), targets.end());
    detail::record(out, "CrossEntropyBackward", {logits},
                   [logits, probs, kept = std::move(kept), ignore_index, rows, vocab, counted](const Tensor& dout) {
                     kernels::cross_entropy_backward(probs.data(), kept.data(), detail::grad_buffer(logits), rows,
                                                     vocab, ignore_index, dout.item() / static_cast<float>(counted));
                   });
  }
  return out;
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& bias, std::span<const int64_t> targets,
                            int64_t ignore_index) {
  if (weight.rank() != 2) throw ShapeError("linear_cross_entropy: weight must be (V, C), got " + weight.shape().str());
  const int64_t vocab = weight.size(0), C = weight.size(1);
  if (x.rank() < 1 || x.size(-1) != C) {
    throw ShapeError("linear_cross_entropy: x has shape " + x.shape().str() + "; its last dimension must equal the "
                     "weight's " + std::to_string(C) + " in-features");
  }
  if (bias.defined() && !(bias.shape() == Shape{vocab})) {
    throw ShapeError("linear_cross_entropy: bias must have shape (" + std::to_string(vocab) + "), got " + bias.shape().str());
  }
  const int64_t rows = C > 0 ? x.numel() / C : 0;
  if (static_cast<int64_t>(targets.size()) != rows) {
    throw ShapeError("linear_cross_entropy: " + std::to_string(targets.size()) + " targets for " + std::to_string(rows) +
                     " rows of x " + x.shape().str());
  }
  if (weight.dtype() == DType::Stored) {  // a quantized head: its logits by the stored product, then the loss
    detail::refuse_training_stored(weight, "linear_cross_entropy");
    return cross_entropy(reshape(linear(x, weight, bias), {rows, vocab}), targets, ignore_index);
  }
  const bool grad = detail::needs_grad({&x, &weight, &bias});
  Tensor dx, dweight, dbias;
  if (grad) {
    if (x.requires_grad()) dx = Tensor::empty(x.shape());
    if (weight.requires_grad()) dweight = Tensor::empty(weight.shape());
    if (bias.defined() && bias.requires_grad()) dbias = Tensor::empty(bias.shape());
  }
  auto data = [](Tensor& t) { return t.defined() ? t.data() : nullptr; };
  // The backward is computed here, in the same precision; a BF16 weight (Tensor::to_bf16_) is multiplied in bf16.
  const bool half = precision() == Precision::BF16 || weight.dtype() == DType::BF16;
  const kernels::CrossEntropySum sum = kernels::linear_cross_entropy(
      half ? nullptr : x.data(), half ? nullptr : weight.data(), bias.defined() ? bias.data() : nullptr, targets.data(),
      rows, C, vocab, ignore_index,
      data(dx), data(dweight), data(dbias), 0, half ? x.bf16() : nullptr, half ? weight.bf16() : nullptr);
  check_target_row("linear_cross_entropy", targets, sum.bad_row, vocab);
  // All rows ignored: NaN (0/0), as PyTorch.
  Tensor out = Tensor::scalar(static_cast<float>(sum.total / static_cast<double>(sum.counted)));
  if (grad) {
    // The gradient is already computed for dL/dloss = 1; the backward scales it (in place: the closure runs once).
    detail::record(out, "LinearCrossEntropyBackward", {x, weight, bias}, [x, weight, bias, dx, dweight, dbias](const Tensor& dout) mutable {
      const float g = dout.item();
      for (auto [input, gradient] : {std::pair{&x, &dx}, std::pair{&weight, &dweight}, std::pair{&bias, &dbias}}) {
        if (!gradient->defined()) continue;
        if (g != 1.0f) kernels::scale(gradient->data(), gradient->numel(), g);
        detail::add_grad(*input, *gradient);
      }
    });
  }
  return out;
}

}  // namespace qkv
