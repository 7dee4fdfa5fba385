// Ops the attention classes need beyond arithmetic: masking, dropout and concatenation.
#include <cmath>
#include <string>

#include "qkv/autograd.hpp"
#include "qkv/kernels.hpp"
#include "qkv/ops.hpp"
#include "qkv/random.hpp"

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
  Tensor out = t.clone();
  const float* m = mask.data();
  float* y = out.data();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i)
      if (m[i] != 0.0f) y[o * inner + i] = value;
  if (detail::needs_grad({&t})) {
    detail::record(out, "MaskedFillBackward", {t}, [t, mask, outer, inner](const Tensor& dout) {
      float* dt = detail::grad_buffer(t);
      const float* g = dout.data();
      const float* m = mask.data();
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t i = 0; i < inner; ++i)
          if (m[i] == 0.0f) dt[o * inner + i] += g[o * inner + i];
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
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out.data()[r * cols + c] = t.data()[r * t.size(1) + c];
  return out;
}

Tensor causal_mask(int64_t T) {
  Tensor mask = Tensor::zeros({T, T});
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = i + 1; j < T; ++j) mask.data()[i * T + j] = 1.0f;
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
    const float scale = 1.0f / static_cast<float>(1.0 - p);  // PyTorch divides the mask by (1 − p) in float
    for (float& k : keep.values()) k *= scale;
  }
  Tensor out = Tensor::empty(t.shape());
  for (int64_t i = 0, n = t.numel(); i < n; ++i) out.data()[i] = t.data()[i] * keep.data()[i];
  if (detail::needs_grad({&t})) {
    detail::record(out, "DropoutBackward", {t}, [t, keep](const Tensor& dout) {
      float* dt = detail::grad_buffer(t);
      for (int64_t i = 0, n = t.numel(); i < n; ++i) dt[i] += dout.data()[i] * keep.data()[i];
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
    for (int64_t o = 0; o < outer; ++o)
      std::copy_n(t.data() + o * w, w, out.data() + o * total * inner + at);
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
          for (int64_t o = 0; o < outer; ++o)
            for (int64_t i = 0; i < w; ++i) dt[o * w + i] += dout.data()[o * total * inner + at + i];
        at += w;
      }
    });
  }
  return out;
}

}  // namespace qkv
