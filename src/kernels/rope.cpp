// Rotary embeddings (see qkv/kernels/rope.hpp), beside their reference.
// RoPE is its own kernel pair, applied to the projected q and k in place of a copy, not fused into the attention
// kernel's pack: the pack runs once per (head, thread) and a rotation there would be redone by every thread that
// packs the head; as a pass of its own it reads and writes q and k once (measured in bench/attention_bench.cpp's
// rope rows against the attention forward).
#include "qkv/kernels/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "parallel.hpp"

namespace qkv::kernels {

std::vector<float> RopeFrequencies::inverse_frequencies(int64_t D, bool long_context) const {
  const int64_t R = rotary_dim > 0 ? rotary_dim : D, P = R / 2;
  std::vector<float> inv(static_cast<size_t>(P));
  // Hugging Face: base ** (arange(0, R, 2).float() / R), in float32.
  auto power = [&](int64_t i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(R);
    return static_cast<float>(std::pow(theta, static_cast<double>(exponent)));
  };
  for (int64_t i = 0; i < P; ++i) inv[static_cast<size_t>(i)] = static_cast<float>(1.0 / static_cast<double>(power(i)));
  if (scaling == Scaling::Linear) {
    for (float& f : inv) f = static_cast<float>(f / factor);
  } else if (scaling == Scaling::Proportional) {
    // transformers' _compute_proportional_rope_parameters: the head's first rotated_pairs frequencies, zeros after,
    // all divided by `factor`
    for (int64_t i = 0; i < P; ++i)
      inv[static_cast<size_t>(i)] = i < rotated_pairs ? static_cast<float>(inv[static_cast<size_t>(i)] / factor) : 0.0f;
  } else if (scaling == Scaling::Llama3) {
    // Llama 3.1's wavelength bands: long wavelengths are divided by `factor`, short ones kept, the band between
    // interpolated smoothly (transformers' _compute_llama3_parameters).
    const double old_len = original_max_position_embeddings;
    const double low_wavelen = old_len / low_freq_factor, high_wavelen = old_len / high_freq_factor;
    for (float& f : inv) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      double scaled = wavelen > low_wavelen ? f / factor : f;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const double smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        scaled = (1.0 - smooth) * scaled / factor + smooth * scaled;
      }
      f = static_cast<float>(scaled);
    }
  } else if (scaling == Scaling::Yarn) {
    // transformers' _compute_yarn_parameters: pairs that turn fewer than beta_slow times over the original context
    // are divided by `factor`, those turning more than beta_fast times kept, a linear ramp between (in pairs).
    auto correction = [&](double rotations) {
      return static_cast<double>(R) * std::log(original_max_position_embeddings / (rotations * 2.0 * std::numbers::pi)) /
             (2.0 * std::log(theta));
    };
    double low = correction(beta_fast), high = correction(beta_slow);
    if (truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(R - 1));
    if (low == high) high += 0.001;  // as transformers: no division by zero
    for (int64_t i = 0; i < P; ++i) {
      const float pos_freq = power(i);
      const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (static_cast<float>(factor) * pos_freq);
      const float ramp = std::clamp(static_cast<float>((static_cast<float>(i) - low) / (high - low)), 0.0f, 1.0f);
      const float keep = 1.0f - ramp;
      inv[static_cast<size_t>(i)] = interpolation * (1.0f - keep) + extrapolation * keep;
    }
  } else if (scaling == Scaling::LongRope) {
    // transformers' _compute_longrope_parameters: 1 / (ext_i · base^(2i/R)), ext the short or long factors
    const std::vector<double>& ext = long_context ? long_factor : short_factor;
    for (int64_t i = 0; i < P; ++i)
      inv[static_cast<size_t>(i)] = 1.0f / (static_cast<float>(ext[static_cast<size_t>(i)]) * power(i));
  }
  return inv;
}

RopeTable RopeTable::make(const std::vector<float>& inv_freq, int64_t positions, float scale) {
  RopeTable t;
  t.positions = positions;
  t.P = static_cast<int64_t>(inv_freq.size());
  t.cos.resize(static_cast<size_t>(positions * t.P));
  t.sin.resize(static_cast<size_t>(positions * t.P));
#pragma omp parallel for schedule(static) if (worth_parallel(positions * t.P * 16))
  for (int64_t pos = 0; pos < positions; ++pos)
    for (int64_t i = 0; i < t.P; ++i) {
      const float angle = static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)];
      // Hugging Face: emb.cos() * attention_scaling, both float32
      t.cos[static_cast<size_t>(pos * t.P + i)] = static_cast<float>(std::cos(static_cast<double>(angle))) * scale;
      t.sin[static_cast<size_t>(pos * t.P + i)] = static_cast<float>(std::sin(static_cast<double>(angle))) * scale;
    }
  return t;
}

namespace {
// Rows of row_stride floats, row r at position position_of(r): one implementation for a (B, T, …) block and for a
// batch of sequences whose rows each have their own position.
template <typename PositionOf>
void rotate_rows(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows,
                 int64_t row_stride, int64_t heads, int64_t D, bool inverse, PositionOf position_of) {
  const int64_t P = table.P;  // pairs rotated per head: D / 2, or fewer with a partial rotation
  const float sign = inverse ? -1.0f : 1.0f;
  parallel_for(rows, worth_parallel(rows * row_stride), [&](int64_t r) {
    const int64_t pos = position_of(r);
    const float* c = table.cos.data() + pos * table.P;
    const float* s = table.sin.data() + pos * table.P;
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = src + r * row_stride + h * D;
      float* out = dst + r * row_stride + h * D;
      if (layout == RopeLayout::RotateHalf) {
        for (int64_t i = 0; i < P; ++i) {  // vectorised by GCC: contiguous halves
          const float ai = in[i], bi = in[i + P], si = sign * s[i];
          out[i] = ai * c[i] - bi * si;
          out[i + P] = bi * c[i] + ai * si;
        }
      } else {
        for (int64_t i = 0; i < P; ++i) {
          const float ai = in[2 * i], bi = in[2 * i + 1], si = sign * s[i];
          out[2 * i] = ai * c[i] - bi * si;
          out[2 * i + 1] = bi * c[i] + ai * si;
        }
      }
      if (src != dst && 2 * P < D) std::copy(in + 2 * P, in + D, out + 2 * P);  // a partial rotation's rest
    }
    if (src != dst)  // the heads that are not rotated (a packed projection's v)
      std::copy(src + r * row_stride + heads * D, src + (r + 1) * row_stride, dst + r * row_stride + heads * D);
  });
}
}  // namespace

void rope_apply(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows, int64_t T,
                int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse) {
  rotate_rows(table, layout, src, dst, rows, row_stride, heads, D, inverse,
              [&](int64_t r) { return position0 + r % T; });
}

void rope_apply_rows(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows,
                     const int64_t* positions, int64_t row_stride, int64_t heads, int64_t D, bool inverse) {
  rotate_rows(table, layout, src, dst, rows, row_stride, heads, D, inverse, [&](int64_t r) { return positions[r]; });
}

void rope_apply_reference(const std::vector<float>& inv_freq, RopeLayout layout, float* x, int64_t rows, int64_t T,
                          int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse, float scale) {
  const int64_t P = static_cast<int64_t>(inv_freq.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = position0 + r % T;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * D;
      for (int64_t i = 0; i < P; ++i) {
        const double angle = static_cast<double>(static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)]);
        const double c = std::cos(angle) * scale, s = (inverse ? -1.0 : 1.0) * std::sin(angle) * scale;
        float& a = layout == RopeLayout::RotateHalf ? v[i] : v[2 * i];
        float& b = layout == RopeLayout::RotateHalf ? v[i + P] : v[2 * i + 1];
        const double ai = a, bi = b;
        a = static_cast<float>(ai * c - bi * s);
        b = static_cast<float>(bi * c + ai * s);
      }
    }
  }
}

}  // namespace qkv::kernels
