// matmul, linear, transpose, reshape: forward and backward side by side.
#include <algorithm>
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/core/ops.hpp"
#include "product.hpp"

namespace qkv {

namespace {

std::string shapes_message(const char* op, const Tensor& a, const Tensor& b, const std::string& why) {
  return std::string(op) + ": " + why + " (shapes " + a.shape().str() + " and " + b.shape().str() + ")";
}

int64_t leading(const Shape& s, int keep_last) {  // product of all dims except the last keep_last
  int64_t n = 1;
  for (int i = 0; i < s.rank() - keep_last; ++i) n *= s[i];
  return n;
}

}  // namespace

// matmul. Three layouts, all of them (batch, M, K) @ (batch?, K, N):
//   shared B: a (...,M,K), b (K,N)       → fold the leading dims into M: one GEMM.
//   shared A: a (M,K),     b (...,K,N)   → one GEMM per batch entry.
//   batched:  a (...,M,K), b (...,K,N)   → one GEMM per batch entry; leading dims equal.
// Backward of C = A B:  dA = dC Bᵀ,  dB = Aᵀ dC  (summed over the batch when B or A is shared).
Tensor matmul(const Tensor& a, const Tensor& b) {
  if (a.rank() < 2 || b.rank() < 2) {
    throw ShapeError(shapes_message("matmul", a, b, "both operands need at least 2 dimensions"));
  }
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (b.size(-2) != K) {
    throw ShapeError(shapes_message("matmul", a, b,
                                    "inner dimensions differ: " + std::to_string(K) + " vs " + std::to_string(b.size(-2))));
  }
  enum class Layout { SharedB, SharedA, Batched } layout;
  int64_t batch = 1;
  Shape out_shape;
  if (b.rank() == 2) {
    layout = Layout::SharedB;
    out_shape = a.shape();
    out_shape[-1] = N;
    batch = leading(a.shape(), 2);
  } else if (a.rank() == 2) {
    layout = Layout::SharedA;
    out_shape = b.shape();
    out_shape[-2] = M;
    batch = leading(b.shape(), 2);
  } else {
    if (a.rank() != b.rank()) throw ShapeError(shapes_message("matmul", a, b, "batch ranks differ"));
    for (int i = 0; i < a.rank() - 2; ++i)
      if (a.size(i) != b.size(i)) throw ShapeError(shapes_message("matmul", a, b, "batch dimensions differ"));
    layout = Layout::Batched;
    out_shape = a.shape();
    out_shape[-1] = N;
    batch = leading(a.shape(), 2);
  }
  Tensor out = Tensor::empty(out_shape);
  const int64_t a_step = layout == Layout::SharedA ? 0 : M * K;
  const int64_t b_step = layout == Layout::SharedB ? 0 : K * N;
  const Precision pr = precision();
  if (layout == Layout::SharedB) {
    detail::product(pr, false, false, batch * M, N, K, 1.0f, a, 0, K, b, 0, N, 0.0f, out.data(), N);
  } else {
    float* c = out.data();
    for (int64_t i = 0; i < batch; ++i)
      detail::product(pr, false, false, M, N, K, 1.0f, a, i * a_step, K, b, i * b_step, N, 0.0f, c + i * M * N, N);
  }
  if (detail::needs_grad({&a, &b})) {
    detail::record(out, "MatmulBackward", {a, b}, [a, b, layout, batch, M, N, K, a_step, b_step, pr](const Tensor& dout) {
      if (float* da = detail::grad_buffer(a)) {  // dA (M,K) += dC (M,N) @ Bᵀ
        if (layout == Layout::SharedB) {
          detail::product(pr, false, true, batch * M, K, N, 1.0f, dout, 0, N, b, 0, N, 1.0f, da, K);
        } else {
          for (int64_t i = 0; i < batch; ++i)
            detail::product(pr, false, true, M, K, N, 1.0f, dout, i * M * N, N, b, i * b_step, N, 1.0f, da + i * a_step, K);
        }
      }
      if (float* db = detail::grad_buffer(b)) {  // dB (K,N) += Aᵀ @ dC (M,N)
        if (layout == Layout::SharedB) {
          detail::product(pr, true, false, K, N, batch * M, 1.0f, a, 0, K, dout, 0, N, 1.0f, db, N);
        } else {
          for (int64_t i = 0; i < batch; ++i)
            detail::product(pr, true, false, K, N, M, 1.0f, a, i * a_step, K, dout, i * M * N, N, 1.0f, db + i * b_step, N);
        }
      }
    });
  }
  return out;
}

// linear: y (R,out) = x (R,in) @ Wᵀ + bias, R = all leading dims of x folded together.
// Backward: dx = dy W;  dW = dyᵀ x;  dbias = column sums of dy.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (weight.rank() != 2) throw ShapeError("linear: weight must be 2-D (out, in), got " + weight.shape().str());
  if (x.rank() < 1 || x.size(-1) != weight.size(1)) {
    throw ShapeError(shapes_message("linear", x, weight,
                                    "the input's last dimension must equal the weight's in-features (dim 1)"));
  }
  const int64_t in = weight.size(1), out_features = weight.size(0);
  if (bias.defined() && !(bias.shape() == Shape{out_features})) {
    throw ShapeError(shapes_message("linear", weight, bias, "bias must have shape (out_features)"));
  }
  detail::refuse_training_stored(weight, "linear");
  const int64_t rows = leading(x.shape(), 1);
  Shape out_shape = x.shape();
  out_shape[-1] = out_features;
  Tensor out = Tensor::empty(out_shape);
  float* y = out.data();
  if (bias.defined()) kernels::copy_rows(bias.data(), 0, y, out_features, rows, out_features, false);  // y = bias
  const Precision pr = precision();
  detail::product(pr, false, true, rows, out_features, in, 1.0f, x, 0, in, weight, 0, in, bias.defined() ? 1.0f : 0.0f, y,
                  out_features);
  if (detail::needs_grad({&x, &weight, &bias})) {
    detail::record(out, "LinearBackward", {x, weight, bias}, [x, weight, bias, rows, in, out_features, pr](const Tensor& dout) {
      if (const auto dx = detail::grad_target(x); dx.data)
        detail::product(pr, false, false, rows, in, out_features, 1.0f, dout, 0, out_features, weight, 0, in,
                        dx.accumulate ? 1.0f : 0.0f, dx.data, in);
      if (const auto dw = detail::grad_target(weight); dw.data)
        detail::product(pr, true, false, out_features, in, rows, 1.0f, dout, 0, out_features, x, 0, in,
                        dw.accumulate ? 1.0f : 0.0f, dw.data, in);
      if (float* db = detail::grad_buffer(bias)) kernels::add_column_sums(dout.data(), db, rows, out_features);
    });
  }
  return out;
}

// lora_linear: y = x Wᵀ + b + s·u Bᵀ with u = x Aᵀ (R, r). Backward: du = s·dy B; dx = dy W + du A; dA = duᵀ x;
// dB = s·dyᵀ u.
Tensor lora_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& lora_a, const Tensor& lora_b,
                   float scale) {
  if (weight.rank() != 2) throw ShapeError("lora_linear: weight must be 2-D (out, in), got " + weight.shape().str());
  const int64_t in = weight.size(1), out_features = weight.size(0);
  if (lora_a.rank() != 2 || lora_a.size(1) != in || lora_a.size(0) < 1) {
    throw ShapeError(shapes_message("lora_linear", weight, lora_a, "lora_A must be (rank, in_features)"));
  }
  const int64_t r = lora_a.size(0);
  if (!(lora_b.shape() == Shape{out_features, r})) {
    throw ShapeError(shapes_message("lora_linear", lora_a, lora_b, "lora_B must be (out_features, rank)"));
  }
  if (x.rank() < 1 || x.size(-1) != in) {
    throw ShapeError(shapes_message("lora_linear", x, weight, "the input's last dimension must equal the weight's in-features (dim 1)"));
  }
  if (bias.defined() && !(bias.shape() == Shape{out_features})) {
    throw ShapeError(shapes_message("lora_linear", weight, bias, "bias must have shape (out_features)"));
  }
  detail::refuse_training_stored(weight, "lora_linear");
  const int64_t rows = leading(x.shape(), 1);
  Shape out_shape = x.shape();
  out_shape[-1] = out_features;
  Tensor out = Tensor::empty(out_shape);
  float* y = out.data();
  if (bias.defined()) kernels::copy_rows(bias.data(), 0, y, out_features, rows, out_features, false);
  const Precision pr = precision();
  detail::product(pr, false, true, rows, out_features, in, 1.0f, x, 0, in, weight, 0, in, bias.defined() ? 1.0f : 0.0f, y,
                  out_features);
  Tensor u = Tensor::empty({rows, r});
  detail::product(pr, false, true, rows, r, in, 1.0f, x, 0, in, lora_a, 0, in, 0.0f, u.data(), r);
  detail::product(pr, false, true, rows, out_features, r, scale, u, 0, r, lora_b, 0, r, 1.0f, y, out_features);
  if (detail::needs_grad({&x, &weight, &bias, &lora_a, &lora_b})) {
    detail::record(out, "LoraLinearBackward", {x, weight, bias, lora_a, lora_b},
                   [x, weight, bias, lora_a, lora_b, u, rows, in, out_features, r, scale, pr](const Tensor& dout) {
      Tensor du;
      if (x.requires_grad() || lora_a.requires_grad()) {
        du = Tensor::empty({rows, r});
        detail::product(pr, false, false, rows, r, out_features, scale, dout, 0, out_features, lora_b, 0, r, 0.0f, du.data(), r);
      }
      if (const auto dx = detail::grad_target(x); dx.data) {
        detail::product(pr, false, false, rows, in, out_features, 1.0f, dout, 0, out_features, weight, 0, in,
                        dx.accumulate ? 1.0f : 0.0f, dx.data, in);
        detail::product(pr, false, false, rows, in, r, 1.0f, du, 0, r, lora_a, 0, in, 1.0f, dx.data, in);
      }
      if (const auto dw = detail::grad_target(weight); dw.data)
        detail::product(pr, true, false, out_features, in, rows, 1.0f, dout, 0, out_features, x, 0, in,
                        dw.accumulate ? 1.0f : 0.0f, dw.data, in);
      if (float* db = detail::grad_buffer(bias)) kernels::add_column_sums(dout.data(), db, rows, out_features);
      if (const auto da = detail::grad_target(lora_a); da.data)
        detail::product(pr, true, false, r, in, rows, 1.0f, du, 0, r, x, 0, in, da.accumulate ? 1.0f : 0.0f, da.data, in);
      if (const auto dbb = detail::grad_target(lora_b); dbb.data)
        detail::product(pr, true, false, out_features, r, rows, scale, dout, 0, out_features, u, 0, r,
                        dbb.accumulate ? 1.0f : 0.0f, dbb.data, r);
    });
  }
  return out;
}

bool contiguous_run(std::span<const Tensor> parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].defined()) return false;
    if (i > 0 && !(parts[i].shares_storage_with(parts[0]) && parts[i].data() == parts[i - 1].data() + parts[i - 1].numel()))
      return false;
  }
  return true;
}

// linear_concat: y (R, Σout) = x (R,in) @ Wᵀ + b with W the weights stacked by rows (out_i, in) → (Σout, in).
// Backward as linear's, each product done once for the whole stack.
Tensor linear_concat(const Tensor& x, std::span<const Tensor> weights, std::span<const Tensor> biases,
                     std::span<const LowRankUpdate> updates) {
  if (weights.empty()) throw ValueError("linear_concat: no weights given");
  if (!updates.empty() && updates.size() != weights.size()) {
    throw ValueError("linear_concat: " + std::to_string(updates.size()) + " low-rank updates for " +
                     std::to_string(weights.size()) + " weights; give one per weight (undefined where none) or none");
  }
  if (!biases.empty() && biases.size() != weights.size()) {
    throw ValueError("linear_concat: " + std::to_string(biases.size()) + " biases for " +
                     std::to_string(weights.size()) + " weights; give one per weight or none");
  }
  const bool has_bias = !biases.empty() && biases[0].defined();
  for (const Tensor& w : weights) detail::refuse_training_stored(w, "linear_concat");
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    if (!w.defined() || w.rank() != 2) throw ShapeError("linear_concat: weight " + std::to_string(i) + " must be 2-D (out, in)");
    if (w.size(1) != weights[0].size(1)) {
      throw ShapeError(shapes_message("linear_concat", weights[0], w, "every weight must have the same in-features (dim 1)"));
    }
    if (!biases.empty() && biases[i].defined() != has_bias) {
      throw ValueError("linear_concat: either every weight has a bias or none does (bias " + std::to_string(i) + ")");
    }
    if (has_bias && !(biases[i].shape() == Shape{w.size(0)})) {
      throw ShapeError(shapes_message("linear_concat", w, biases[i], "bias must have shape (out_features)"));
    }
    total += w.size(0);
  }
  const int64_t in = weights[0].size(1);
  if (x.rank() < 1 || x.size(-1) != in) {
    throw ShapeError(shapes_message("linear_concat", x, weights[0],
                                    "the input's last dimension must equal the weights' in-features (dim 1)"));
  }
  // The stacked weight (and bias): the parameters themselves when they lie back to back, else a copy. In bf16 each
  // part's product reads the part's own bf16 copy (Tensor::bf16, made once per optimiser step): a stacked copy would
  // be made and rounded again at every call, reading every float32 weight once per generated token.
  const Precision pr = precision();
  const bool by_part = weights.size() > 1 && (pr == Precision::BF16 || std::any_of(weights.begin(), weights.end(), [](const Tensor& w) {
                         return w.dtype() != DType::F32;
                       }));
  auto stack = [](std::span<const Tensor> parts, const Shape& shape) {
    if (contiguous_run(parts)) return parts[0];  // its data() starts the whole run
    Tensor out = Tensor::empty(shape);
    int64_t at = 0;
    for (const Tensor& p : parts) {
      std::copy_n(p.data(), p.numel(), out.data() + at);
      at += p.numel();
    }
    return out;
  };
  const Tensor b = has_bias ? stack(biases, {total}) : Tensor();
  const int64_t rows = leading(x.shape(), 1);
  Shape out_shape = x.shape();
  out_shape[-1] = total;
  Tensor out = Tensor::empty(out_shape);
  if (has_bias) kernels::copy_rows(b.data(), 0, out.data(), total, rows, total, false);
  // What the products read, each with its rows of the stack: in bf16 every part, else the whole stack at once (whose
  // tensor may be the first part, its data() starting the run).
  std::vector<std::pair<Tensor, int64_t>> parts;
  if (by_part)
    for (const Tensor& part : weights) parts.emplace_back(part, part.size(0));
  else
    parts.emplace_back(stack(weights, {total, in}), total);
  detail::product_parts(pr, rows, in, x, parts, has_bias ? 1.0f : 0.0f, out.data(), total);  // out[:, column + j] = x · part[j]
  // The low-rank updates: u_i = x A_iᵀ (rows, r_i) kept for the backward, then s_i·u_i B_iᵀ added into part i's columns.
  struct Part {
    LowRankUpdate update;
    Tensor u;
    int64_t column = 0, width = 0;
  };
  std::vector<Part> low_rank;
  for (size_t i = 0, column = 0; i < weights.size(); column += static_cast<size_t>(weights[i].size(0)), ++i) {
    if (updates.empty() || !updates[i].defined()) continue;
    const LowRankUpdate& up = updates[i];
    const int64_t out_i = weights[i].size(0), r = up.rank();
    if (!(up.a.shape() == Shape{r, in}) || !(up.b.shape() == Shape{out_i, r})) {
      throw ShapeError(shapes_message("linear_concat", up.a, up.b, "a low-rank update needs A (rank, in) and B (out, rank)"));
    }
    Part p{up, Tensor::empty({rows, r}), static_cast<int64_t>(column), out_i};
    detail::product(pr, false, true, rows, r, in, 1.0f, x, 0, in, up.a, 0, in, 0.0f, p.u.data(), r);
    detail::product(pr, false, true, rows, out_i, r, up.scale, p.u, 0, r, up.b, 0, r, 1.0f, out.data() + p.column, total);
    low_rank.push_back(std::move(p));
  }
  std::vector<Tensor> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  if (has_bias) inputs.insert(inputs.end(), biases.begin(), biases.end());
  for (const Part& p : low_rank) inputs.insert(inputs.end(), {p.update.a, p.update.b});
  if (grad_enabled() && std::any_of(inputs.begin(), inputs.end(), [](const Tensor& t) { return t.requires_grad(); })) {
    const std::vector<Tensor> ws(weights.begin(), weights.end());
    const std::vector<Tensor> bs = has_bias ? std::vector<Tensor>(biases.begin(), biases.end()) : std::vector<Tensor>{};
    detail::record(out, "LinearConcatBackward", inputs, [x, parts, ws, bs, low_rank, rows, in, total, pr](const Tensor& dout) {
      const auto dx = detail::grad_target(x);
      for (int64_t column = 0; const auto& [part, width] : parts) {  // dx = Σ dy_i W_i
        if (dx.data)
          detail::product(pr, false, false, rows, in, width, 1.0f, dout, column, total, part, 0, in,
                          dx.accumulate || column > 0 ? 1.0f : 0.0f, dx.data, in);
        column += width;
      }
      for (const Part& p : low_rank) {  // du = s·dy_i B;  dx += du A;  dA = duᵀ x;  dB = s·dy_iᵀ u
        const int64_t r = p.update.rank();
        if (dx.data || p.update.a.requires_grad()) {
          Tensor du = Tensor::empty({rows, r});
          detail::product(pr, false, false, rows, r, p.width, p.update.scale, dout, p.column, total, p.update.b, 0, r, 0.0f,
                          du.data(), r);
          if (dx.data) detail::product(pr, false, false, rows, in, r, 1.0f, du, 0, r, p.update.a, 0, in, 1.0f, dx.data, in);
          if (const auto da = detail::grad_target(p.update.a); da.data)
            detail::product(pr, true, false, r, in, rows, 1.0f, du, 0, r, x, 0, in, da.accumulate ? 1.0f : 0.0f, da.data, in);
        }
        if (const auto db = detail::grad_target(p.update.b); db.data)
          detail::product(pr, true, false, p.width, r, rows, p.update.scale, dout, p.column, total, p.u, 0, r,
                          db.accumulate ? 1.0f : 0.0f, db.data, r);
      }
      // Each part's gradient is a row block of one product (or of one column-sum vector): views, no copies.
      auto hand_out = [](const std::vector<Tensor>& parts, const Tensor& whole) {
        int64_t at = 0;
        for (const Tensor& p : parts) {
          detail::add_grad(p, whole.view_at(at, p.shape()));
          at += p.numel();
        }
      };
      auto wanted = [](const std::vector<Tensor>& parts) {
        return std::any_of(parts.begin(), parts.end(), [](const Tensor& p) { return p.requires_grad(); });
      };
      if (wanted(ws)) {
        Tensor dw = Tensor::empty({total, in});
        for (int64_t at = 0; const auto& [part, width] : parts) {  // dW_i = dy_iᵀ x: row block i of dw
          detail::product(pr, true, false, width, in, rows, 1.0f, dout, at, total, x, 0, in, 0.0f, dw.data() + at * in, in);
          at += width;
        }
        hand_out(ws, dw);
      }
      if (wanted(bs)) {
        Tensor db = Tensor::zeros({total});
        kernels::add_column_sums(dout.data(), db.data(), rows, total);
        hand_out(bs, db);
      }
    });
  }
  return out;
}

// transpose(t, d0, d1): viewed as (outer, n0, mid, n1, inner) the result is (outer, n1, mid, n0, inner).
// Backward: the same swap applied to the gradient.
namespace {
void swap_dims(const float* src, float* dst, const Shape& s, int d0, int d1, bool accumulate) {
  int64_t outer = 1, mid = 1, inner = 1;
  for (int i = 0; i < d0; ++i) outer *= s[i];
  for (int i = d0 + 1; i < d1; ++i) mid *= s[i];
  for (int i = d1 + 1; i < s.rank(); ++i) inner *= s[i];
  kernels::swap_axes(src, dst, outer, s[d0], mid, s[d1], inner, accumulate);
}
}  // namespace

Tensor transpose(const Tensor& t, int d0, int d1) {
  int a = t.shape().normalize(d0, "transpose"), b = t.shape().normalize(d1, "transpose");
  if (a > b) std::swap(a, b);
  Shape out_shape = t.shape();
  std::swap(out_shape[a], out_shape[b]);
  if (a == b) return reshape(t, out_shape);
  Tensor out = Tensor::empty(out_shape);
  swap_dims(t.data(), out.data(), t.shape(), a, b, false);
  if (detail::needs_grad({&t})) {
    detail::record(out, "TransposeBackward", {t}, [t, out_shape, a, b](const Tensor& dout) {
      if (float* dt = detail::grad_buffer(t)) swap_dims(dout.data(), dt, out_shape, a, b, true);
    });
  }
  return out;
}

Tensor reshape(const Tensor& t, const Shape& shape) {
  Tensor out = t.view_as_shape(shape);
  if (detail::needs_grad({&t})) {
    detail::record(out, "ReshapeBackward", {t}, [t](const Tensor& dout) {
      kernels::accumulate(detail::grad_buffer(t), dout.data(), t.numel());
    });
  }
  return out;
}

Tensor reshape(const Tensor& t, std::initializer_list<int64_t> dims) {
  std::vector<int64_t> resolved(dims);
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1) {
      if (infer >= 0) throw ShapeError("reshape: only one dimension may be -1");
      infer = static_cast<int>(i);
    } else {
      known *= resolved[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || t.numel() % known != 0) {
      throw ShapeError("reshape: cannot infer the -1 dimension to reshape " + t.shape().str());
    }
    resolved[static_cast<size_t>(infer)] = t.numel() / known;
  }
  return reshape(t, Shape(std::span<const int64_t>(resolved)));
}

}  // namespace qkv
