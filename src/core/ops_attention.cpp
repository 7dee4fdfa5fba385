// Ops the attention classes need beyond arithmetic: masking, dropout and concatenation.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/random.hpp"

namespace qkv {

// masked_fill: y = mask ? value : t. Backward: dt = mask ? 0 : g.
Tensor masked_fill(const Tensor& t, const Tensor& mask, float value) {
  const int mr = mask.rank();
  bool suffix = mr <= t.rank();
  for (int i = 1; suffix && i <= mr; ++i) suffix = mask.size(-i) == t.size(-i);
  if (!suffix) {
    throw ShapeError("masked_fill: mask shape " + mask.shape().str() + " must match the last dimensions of " +
                     t.shape().str());
  }
  const int64_t inner = mask.numel();
  const int64_t outer = inner ? t.numel() / inner : 0;
  Tensor out = Tensor::empty(t.shape());
  kernels::masked_fill(t.data(), mask.data(), value, out.data(), outer, inner);
  if (detail::needs_grad({&t})) {
    detail::record(out, "MaskedFillBackward", {t}, [t, mask, outer, inner](const Tensor& dout) {
      kernels::masked_fill_backward(mask.data(), dout.data(), detail::grad_buffer(t), outer, inner);
    });
  }
  return out;
}

Tensor top_left(const Tensor& t, int64_t rows, int64_t cols) {
  if (t.rank() != 2 || rows > t.size(0) || cols > t.size(1) || rows < 0 || cols < 0) {
    throw ShapeError("top_left: cannot take " + std::to_string(rows) + "×" + std::to_string(cols) + " from " +
                     t.shape().str());
  }
  Tensor out = Tensor::empty({rows, cols});
  kernels::copy_rows(t.data(), t.size(1), out.data(), cols, rows, cols, false);
  return out;
}

Tensor causal_mask(int64_t T) {
  Tensor mask = Tensor::empty({T, T});
  kernels::causal_mask(mask.data(), T);
  return mask;
}

// dropout: y = t ⊙ keep, keep = bernoulli(1 − p) / (1 − p). Backward: dt = g ⊙ keep.
Tensor dropout(const Tensor& t, double p, bool training, Generator& gen) {
  if (!(p >= 0.0 && p <= 1.0)) throw ValueError("dropout: probability must lie in [0, 1], got " + std::to_string(p));
  if (!training || p == 0.0 || t.numel() == 0) return t;
  Tensor keep = Tensor::empty(t.shape());
  if (p == 1.0) {
    keep.fill_(0.0f);
  } else {
    gen.bernoulli_(keep, 1.0 - p);
    // PyTorch divides the mask by (1 − p) in float.
    kernels::unary_forward(kernels::UnaryOp::MulScalar, 1.0f / static_cast<float>(1.0 - p), keep.data(), keep.data(),
                           keep.numel());
  }
  Tensor out = Tensor::empty(t.shape());
  kernels::multiply(t.data(), keep.data(), out.data(), t.numel(), false);
  if (detail::needs_grad({&t})) {
    detail::record(out, "DropoutBackward", {t}, [t, keep](const Tensor& dout) {
      kernels::multiply(dout.data(), keep.data(), detail::grad_buffer(t), t.numel(), true);
    });
  }
  return out;
}

Tensor hashed_dropout(const Tensor& t, double p, bool training, Generator& gen) {
  if (!(p >= 0.0 && p <= 1.0)) throw ValueError("dropout: probability must lie in [0, 1], got " + std::to_string(p));
  if (!training || p == 0.0 || t.numel() == 0) return t;
  const uint64_t seed = gen.next_u64();
  const float prob = static_cast<float>(p);
  Tensor out = Tensor::empty(t.shape());
  kernels::hashed_dropout(t.data(), out.data(), t.numel(), seed, prob, false);
  if (detail::needs_grad({&t})) {
    detail::record(out, "HashedDropoutBackward", {t}, [t, seed, prob](const Tensor& dout) {
      kernels::hashed_dropout(dout.data(), detail::grad_buffer(t), t.numel(), seed, prob, true);
    });
  }
  return out;
}

void write_tokens(const Tensor& src, Tensor& dst, int64_t position) {
  if (src.rank() != 3 || dst.rank() != 3 || src.size(0) != dst.size(0) || src.size(2) != dst.size(2) || position < 0 ||
      position + src.size(1) > dst.size(1)) {
    throw ShapeError("write_tokens: cannot write " + src.shape().str() + " into " + dst.shape().str() + " at token " +
                     std::to_string(position));
  }
  const int64_t T = src.size(1), C = src.size(2), capacity = dst.size(1);
  if (dst.dtype() == DType::BF16) {  // a bf16 KV cache: rounded as written
    const float* from = src.data();
    uint16_t* to = dst.bf16_data();
    for (int64_t b = 0; b < src.size(0); ++b)
      kernels::f32_to_bf16(from + b * T * C, to + (b * capacity + position) * C, T * C);
    return;
  }
  for (int64_t b = 0; b < src.size(0); ++b)
    kernels::copy_rows(src.data() + b * T * C, C, dst.data() + (b * capacity + position) * C, C, T, C, false);
}

Tensor transpose_columns(const Tensor& m, int64_t first, int64_t count) {
  if (m.rank() != 2 || first < 0 || count < 0 || first + count > m.size(1)) {
    throw ShapeError("transpose_columns: no columns " + std::to_string(first) + "…" + std::to_string(first + count) +
                     " in " + m.shape().str());
  }
  Tensor out = Tensor::empty({count, m.size(0)});
  kernels::transpose_strided(m.data() + first, m.size(0), count, m.size(1), out.data());
  return out;
}

Tensor select_token(const Tensor& x, int64_t t) {
  if (x.rank() != 3 || t < 0 || t >= x.size(1)) {
    throw ShapeError("select_token: no token " + std::to_string(t) + " in " + x.shape().str());
  }
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  Tensor out = Tensor::empty({B, C});
  kernels::copy_rows(x.data() + t * C, T * C, out.data(), C, B, C, false);
  return out;
}

// gather_tokens: out[b] = x[b, positions[b]]. Backward: each chosen row's gradient added into its row of dx.
Tensor gather_tokens(const Tensor& x, std::span<const int64_t> positions) {
  if (x.rank() != 3 || static_cast<int64_t>(positions.size()) != x.size(0)) {
    throw ShapeError("gather_tokens: " + std::to_string(positions.size()) + " positions for x " + x.shape().str() +
                     "; give one position per batch row of a (B, T, C) tensor");
  }
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  for (int64_t b = 0; b < B; ++b) {
    if (positions[static_cast<size_t>(b)] < 0 || positions[static_cast<size_t>(b)] >= T) {
      throw ShapeError("gather_tokens: position " + std::to_string(positions[static_cast<size_t>(b)]) + " of row " +
                       std::to_string(b) + " is outside the " + std::to_string(T) + " tokens");
    }
  }
  std::vector<int64_t> at(positions.begin(), positions.end());
  Tensor out = Tensor::empty({B, C});
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(x.data() + (b * T + at[static_cast<size_t>(b)]) * C, C, out.data() + b * C);
  if (detail::needs_grad({&x})) {
    detail::record(out, "GatherTokensBackward", {x}, [x, at, T, C](const Tensor& dout) {
      float* dx = detail::grad_buffer(x);
      if (!dx) return;
      for (size_t b = 0; b < at.size(); ++b)
        kernels::accumulate(dx + (static_cast<int64_t>(b) * T + at[b]) * C, dout.data() + static_cast<int64_t>(b) * C, C);
    });
  }
  return out;
}

// concat along dim: view each input as (outer, n_i, inner); the output interleaves them per outer index.
Tensor concat(const std::vector<Tensor>& tensors, int dim) {
  if (tensors.empty()) throw ValueError("concat: needs at least one tensor");
  const Shape& first = tensors[0].shape();
  const int d = first.normalize(dim, "concat");
  Shape out_shape = first;
  int64_t total = 0;
  for (const Tensor& t : tensors) {
    bool same = t.rank() == first.rank();
    for (int i = 0; same && i < first.rank(); ++i) same = i == d || t.size(i) == first[i];
    if (!same) throw ShapeError("concat: shapes " + first.str() + " and " + t.shape().str() + " differ outside dimension " + std::to_string(d));
    total += t.size(d);
  }
  out_shape[d] = total;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= first[i];
  for (int i = d + 1; i < first.rank(); ++i) inner *= first[i];
  Tensor out = Tensor::empty(out_shape);
  std::vector<int64_t> widths;
  int64_t at = 0;
  for (const Tensor& t : tensors) {
    const int64_t w = t.size(d) * inner;
    kernels::copy_rows(t.data(), w, out.data() + at, total * inner, outer, w, false);
    widths.push_back(w);
    at += w;
  }
  bool any = false;
  for (const Tensor& t : tensors) any = any || detail::needs_grad({&t});
  if (any) {
    detail::record(out, "ConcatBackward", tensors, [tensors, widths, outer, total, inner](const Tensor& dout) {
      int64_t at = 0;
      for (size_t k = 0; k < tensors.size(); ++k) {
        const int64_t w = widths[k];
        if (float* dt = detail::grad_buffer(tensors[k]))
          kernels::copy_rows(dout.data() + at, total * inner, dt, w, outer, w, true);
        at += w;
      }
    });
  }
  return out;
}

Tensor narrow(const Tensor& x, int64_t start, int64_t length) {
  const int64_t W = x.rank() > 0 ? x.size(-1) : 0;
  if (x.rank() == 0 || start < 0 || length < 0 || start > W || length > W - start)
    throw ShapeError("narrow: columns [" + std::to_string(start) + ", " + std::to_string(start + length) +
                     ") of " + x.shape().str());
  Shape shape = x.shape();
  shape[-1] = length;
  const int64_t rows = W > 0 ? x.numel() / W : 0;
  Tensor out = Tensor::empty(shape);
  kernels::copy_rows(x.data() + start, W, out.data(), length, rows, length, false);
  if (detail::needs_grad({&x})) {
    detail::record(out, "NarrowBackward", {x}, [x, start, length, rows, W](const Tensor& dout) {
      if (float* dx = detail::grad_buffer(x)) kernels::copy_rows(dout.data(), length, dx + start, W, rows, length, true);
    });
  }
  return out;
}

}  // namespace qkv
