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

std::vector<float> RopeFrequencies::inverse_frequencies(int64_t D) const {
  const int64_t P = D / 2;
  std::vector<float> inv(static_cast<size_t>(P));
  for (int64_t i = 0; i < P; ++i) {
    // Hugging Face: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in float32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(D);
    inv[static_cast<size_t>(i)] = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(exponent)));
  }
  if (scaling == Scaling::Linear) {
    for (float& f : inv) f = static_cast<float>(f / factor);
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
  }
  return inv;
}

RopeTable RopeTable::make(const std::vector<float>& inv_freq, int64_t positions) {
  RopeTable t;
  t.positions = positions;
  t.P = static_cast<int64_t>(inv_freq.size());
  t.cos.resize(static_cast<size_t>(positions * t.P));
  t.sin.resize(static_cast<size_t>(positions * t.P));
#pragma omp parallel for schedule(static) if (worth_parallel(positions * t.P * 16))
  for (int64_t pos = 0; pos < positions; ++pos)
    for (int64_t i = 0; i < t.P; ++i) {
      const float angle = static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)];
      t.cos[static_cast<size_t>(pos * t.P + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
      t.sin[static_cast<size_t>(pos * t.P + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  return t;
}

void rope_apply(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows, int64_t T,
                int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse) {
  const int64_t P = D / 2;
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) if (worth_parallel(rows * row_stride))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = position0 + r % T;
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
    }
    if (src != dst)  // the heads that are not rotated (a packed projection's v)
      std::copy(src + r * row_stride + heads * D, src + (r + 1) * row_stride, dst + r * row_stride + heads * D);
  }
}

void rope_apply_reference(const std::vector<float>& inv_freq, RopeLayout layout, float* x, int64_t rows, int64_t T,
                          int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse) {
  const int64_t P = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = position0 + r % T;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * D;
      for (int64_t i = 0; i < P; ++i) {
        const double angle = static_cast<double>(static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)]);
        const double c = std::cos(angle), s = (inverse ? -1.0 : 1.0) * std::sin(angle);
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
