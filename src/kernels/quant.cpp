// Rows to and from the storage types (see qkv/kernels/quant.hpp): ggml's reference quantizers and dequantizers, written
// anew from ggml-quants.c's arithmetic, operation for operation, so the bytes and floats are ggml's bit for bit.
// That needs every product and sum rounded on its own, as ggml's portable build does: this file is compiled with
// -ffp-contract=off (CMakeLists.txt), since a product fused into an add (FMA) rounds once instead of twice. Not here:
// the products (weights.cpp, quant_dot.cpp).
#include "qkv/kernels/quant.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "qkv/kernels/convert.hpp"
#include "parallel.hpp"
#include "quant_blocks.hpp"

namespace qkv::kernels {

namespace {

using namespace quant;

constexpr WeightTypeInfo kInfo[] = {
    {"f32", 0, 1, 4},         {"f16", 1, 1, 2},        {"bf16", 30, 1, 2},      {"q8_0", 8, kQK, sizeof(BlockQ8_0)},
    {"q4_0", 2, kQK, sizeof(BlockQ4_0)}, {"q4_K", 12, kQK_K, sizeof(BlockQ4_K)}, {"q5_K", 13, kQK_K, sizeof(BlockQ5_K)},
    {"q6_K", 14, kQK_K, sizeof(BlockQ6_K)}, {"mxfp4", 39, kQK, sizeof(BlockMXFP4)},
};
constexpr WeightType kTypes[] = {WeightType::F32,  WeightType::F16,  WeightType::BF16, WeightType::Q8_0,
                                 WeightType::Q4_0, WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K,
                                 WeightType::MXFP4};

uint16_t to_half(float f) { return f32_to_f16_reference(f); }

// ggml's nearest_int: adding 1.5·2²³ leaves x rounded to the nearest integer (ties to even) in the low 23 bits of the
// float; exact for |x| < 2²². Every K-quant rounding goes through it.
int nearest_int(float x) {
  const float shifted = x + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

// ---- Q8_0 and Q4_0: one absmax scale per 32 values ----

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = to_half(d);
    for (int j = 0; j < kQK; ++j) y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));  // halves away from 0
  }
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, x += kQK) {
    float amax = 0.0f, max = 0.0f;  // the value of largest magnitude, the first of equals, with its sign
    for (int j = 0; j < kQK; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    // It maps to −8, the one end of [−8, 7] that q − 8 reaches on both signs of d.
    const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = to_half(d);
    for (int j = 0; j < kQK / 2; ++j) {  // x·id + 8.5 lies in [0.5, 16.5]: truncating rounds, 16 is clamped
      const int low = std::min(15, static_cast<int>(x[j] * id + 8.5f));
      const int high = std::min(15, static_cast<int>(x[j + kQK / 2] * id + 8.5f));
      y[b].qs[j] = static_cast<uint8_t>(low | (high << 4));
    }
  }
}

// ---- MXFP4: a power-of-two scale per 32 values, each value the nearest of 16 E2M1 levels ----

// ggml's quantize_row_mxfp4_ref: e = floor(log2 max|x|) − 2 + 127, so d = 2^(e − 128) puts max|x|/d in [8, 16): the
// largest values take the top levels 8 and 12 (above 12·d they are clipped to it); each value takes the code of least
// |level·d − x|, the first of equals (so +0 before −0). The float-to-uint8 conversion of a negative exponent (max|x| < 2^-125) is
// undefined in C; x86 builds of ggml truncate to int32 and keep the low byte, as done here.
void quantize_mxfp4(const float* x, BlockMXFP4* y, int64_t blocks) {
  auto best = [](float v, float d) {
    int index = 0;
    float error = std::fabs(static_cast<float>(kMxfp4Values[0]) * d - v);
    for (int i = 1; i < 16; ++i) {
      const float e = std::fabs(static_cast<float>(kMxfp4Values[i]) * d - v);
      if (e < error) {
        index = i;
        error = e;
      }
    }
    return index;
  };
  for (int64_t b = 0; b < blocks; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const uint8_t e = amax > 0.0f ? static_cast<uint8_t>(static_cast<int32_t>(std::floor(std::log2(amax)) - 2.0f + 127.0f) & 0xff) : 0;
    const float d = e8m0_half(e);
    y[b].e = e;
    for (int j = 0; j < kQK / 2; ++j) y[b].qs[j] = static_cast<uint8_t>(best(x[j], d) | (best(x[j + kQK / 2], d) << 4));
  }
}

// ---- the K-quants' searches for a scale (and min) per sub-block ----

// ggml's make_qkx2_quants (use_mad false): levels L[i] ∈ [0, nmax] and a scale s, min m ≤ 0 minimising
// Σ w_i (s·L_i + m − x_i)². It starts from the range [min(x, 0), max x] and tries nstep + 1 other level spacings
// (nmax + rmin + rdelta·is steps over the range), each with the least-squares s and m for its levels, keeping the best.
// Returns s and sets *neg_min = −m.
float fit_scale_min(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* neg_min, uint8_t* trial,
                    float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += weights[i];
    sum_x += weights[i] * x[i];
  }
  if (min > 0.0f) min = 0.0f;
  if (max == min) {
    std::fill_n(L, n, uint8_t{0});
    *neg_min = -min;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (max - min), scale = 1.0f / iscale, best_error = 0.0f;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(std::clamp(nearest_int(iscale * (x[i] - min)), 0, nmax));
    const float diff = scale * L[i] + min - x[i];
    best_error += weights[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(iscale * (x[i] - min)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float wl = weights[i] * static_cast<float>(l);
      sum_l += wl;
      sum_l2 += wl * static_cast<float>(l);
      sum_xl += wl * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0.0f) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0.0f) {
        this_min = 0.0f;
        this_scale = sum_xl / sum_l2;
      }
      float error = 0.0f;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * trial[i] + this_min - x[i];
        error += weights[i] * (diff * diff);
      }
      if (error < best_error) {
        std::copy_n(trial, n, L);
        best_error = error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *neg_min = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 and no importance: signed levels L[i] − nmax ∈ [−nmax, nmax − 1] (stored as
// L[i] ∈ [0, 2·nmax)) and a scale s maximising the fit (Σ w x l)² / Σ w l² with w = x², over 19 spacings around
// nmax / max|x|. Returns s (negative when the largest magnitude is positive: it maps to −nmax).
float fit_scale(int n, int nmax, const float* x, int8_t* L) {
  float max = 0.0f, amax = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  if (amax < 1e-15f) {  // ggml's GROUP_MAX_EPS: all zero
    std::fill_n(L, n, int8_t{0});
    return 0.0f;
  }
  auto fit = [&](float iscale, float* sum_lx, float* sum_l2) {
    *sum_lx = *sum_l2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      *sum_lx += w * x[i] * static_cast<float>(l);
      *sum_l2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
  };
  auto set_levels = [&](float iscale) {
    for (int i = 0; i < n; ++i)
      L[i] = static_cast<int8_t>(nmax + std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1));
  };
  float iscale = static_cast<float>(-nmax) / max, sum_lx, sum_l2;
  set_levels(iscale);
  fit(iscale, &sum_lx, &sum_l2);
  float scale = sum_l2 != 0.0f ? sum_lx / sum_l2 : 0.0f, best = scale * sum_lx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    fit(iscale, &sum_lx, &sum_l2);
    if (sum_l2 > 0.0f && sum_lx * sum_lx > best * sum_l2) {
      set_levels(iscale);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  return scale;
}

// Q4_K and Q5_K share everything but the levels (15 or 31) and the search's spacings: per sub-block of 32, a scale and
// min from fit_scale_min weighted by √(mean x²) + |x|; the 8 scales and 8 mins quantized to 6 bits against the largest
// of each; then every value re-levelled against the scale and min as stored.
template <int nmax>
void quantize_k_sub_blocks(const float* x, uint16_t* d_out, uint16_t* dmin_out, uint8_t* packed_scales, uint8_t* L,
                           float rmin, int nstep) {
  float scales[8], mins[8], weights[32], max_scale = 0.0f, max_min = 0.0f;
  uint8_t trial[32];
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32.0f);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = fit_scale_min(32, nmax, xs, weights, L + 32 * j, &mins[j], trial, rmin, 0.1f, nstep);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  for (int j = 0; j < 8; ++j) {
    // ggml keeps these in uint8_t before clamping: a negative level wraps and clamps to 63, as here
    const uint8_t ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    const uint8_t lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      packed_scales[j] = ls;
      packed_scales[j + 4] = lm;
    } else {
      packed_scales[j + 4] = static_cast<uint8_t>((ls & 0xf) | ((lm & 0xf) << 4));
      packed_scales[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      packed_scales[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  *d_out = to_half(max_scale / 63.0f);
  *dmin_out = to_half(max_min / 63.0f);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, packed_scales, &sc, &m);
    const float d = half_to_float(*d_out) * sc;
    if (d == 0.0f) continue;  // the levels fit_scale_min chose stay
    const float dm = half_to_float(*dmin_out) * m;
    for (int i = 0; i < 32; ++i) L[32 * j + i] = static_cast<uint8_t>(std::clamp(nearest_int((x[32 * j + i] + dm) / d), 0, nmax));
  }
}

void quantize_q4_K(const float* x, BlockQ4_K* y, int64_t blocks) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < blocks; ++b, x += kQK_K) {
    quantize_k_sub_blocks<15>(x, &y[b].d, &y[b].dmin, y[b].scales, L, -1.0f, 20);
    for (int j = 0; j < kQK_K; j += 64)
      for (int l = 0; l < 32; ++l) y[b].qs[j / 2 + l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
  }
}

void quantize_q5_K(const float* x, BlockQ5_K* y, int64_t blocks) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < blocks; ++b, x += kQK_K) {
    quantize_k_sub_blocks<31>(x, &y[b].d, &y[b].dmin, y[b].scales, L, -0.5f, 15);
    std::memset(y[b].qh, 0, sizeof y[b].qh);
    for (int n = 0, pair = 0; n < kQK_K; n += 64, ++pair)
      for (int j = 0; j < 32; ++j) {
        const int l1 = L[n + j], l2 = L[n + j + 32];
        y[b].qh[j] |= static_cast<uint8_t>(((l1 >> 4) << (2 * pair)) | ((l2 >> 4) << (2 * pair + 1)));
        y[b].qs[n / 2 + j] = static_cast<uint8_t>((l1 & 0xf) | ((l2 & 0xf) << 4));
      }
  }
}

void quantize_q6_K(const float* x, BlockQ6_K* y, int64_t blocks) {
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int64_t b = 0; b < blocks; ++b, x += kQK_K) {
    float max_scale = 0.0f, max_abs_scale = 0.0f;
    for (int ib = 0; ib < kQK_K / 16; ++ib) {
      scales[ib] = fit_scale(16, 32, x + 16 * ib, L + 16 * ib);
      if (std::fabs(scales[ib]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[ib]);
        max_scale = scales[ib];
      }
    }
    if (max_abs_scale < 1e-15f) {  // all zero: ggml writes a zero block
      std::memset(&y[b], 0, sizeof y[b]);
      continue;
    }
    const float iscale = -128.0f / max_scale;  // the largest scale maps to −128
    y[b].d = to_half(1.0f / iscale);
    for (int ib = 0; ib < kQK_K / 16; ++ib) y[b].scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float d = half_to_float(y[b].d) * static_cast<float>(y[b].scales[j]);
      if (d == 0.0f) continue;
      for (int i = 0; i < 16; ++i) L[16 * j + i] = static_cast<int8_t>(std::clamp(nearest_int(x[16 * j + i] / d), -32, 31) + 32);
    }
    for (int j = 0; j < kQK_K; j += 128) {
      uint8_t* ql = y[b].ql + j / 2;
      uint8_t* qh = y[b].qh + j / 4;
      for (int l = 0; l < 32; ++l) {
        const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
        ql[l] = static_cast<uint8_t>((q1 & 0xf) | ((q3 & 0xf) << 4));
        ql[l + 32] = static_cast<uint8_t>((q2 & 0xf) | ((q4 & 0xf) << 4));
        qh[l] = static_cast<uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
    }
  }
}

// ---- dequantizers: each value the float rounding of ggml's expression, in ggml's order ----

void dequantize_q8_0(const BlockQ8_0* x, float* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, y += kQK) {
    const float d = half_to_float(x[b].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(x[b].qs[j]) * d;
  }
}

void dequantize_q4_0(const BlockQ4_0* x, float* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, y += kQK) {
    const float d = half_to_float(x[b].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((x[b].qs[j] & 0xf) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequantize_mxfp4(const BlockMXFP4* x, float* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, y += kQK) {
    const float d = e8m0_half(x[b].e);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(kMxfp4Values[x[b].qs[j] & 0xf]) * d;
      y[j + kQK / 2] = static_cast<float>(kMxfp4Values[x[b].qs[j] >> 4]) * d;
    }
  }
}

template <class Block, bool five_bits>
void dequantize_k(const Block* x, float* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float d = half_to_float(x[b].d), min = half_to_float(x[b].dmin);
    for (int j = 0; j < kQK_K; j += 64) {
      const int pair = j / 64;
      uint8_t sc, m;
      scale_min_k4(2 * pair, x[b].scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(2 * pair + 1, x[b].scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      const uint8_t* q = x[b].qs + j / 2;
      for (int l = 0; l < 32; ++l) {
        int low = q[l] & 0xf, high = q[l] >> 4;
        if constexpr (five_bits) {
          low += (x[b].qh[l] >> (2 * pair)) & 1 ? 16 : 0;
          high += (x[b].qh[l] >> (2 * pair + 1)) & 1 ? 16 : 0;
        }
        y[l] = d1 * static_cast<float>(low) - m1;
        y[l + 32] = d2 * static_cast<float>(high) - m2;
      }
      y += 64;
    }
  }
}

void dequantize_q6_K(const BlockQ6_K* x, float* y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float d = half_to_float(x[b].d);
    for (int n = 0; n < kQK_K; n += 128, y += 128) {
      const uint8_t* ql = x[b].ql + n / 2;
      const uint8_t* qh = x[b].qh + n / 4;
      const int8_t* sc = x[b].scales + n / 16;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

// `blocks` consecutive blocks (or values, for the float types) from x to y.
void quantize_blocks(WeightType type, const float* x, void* y, int64_t blocks) {
  switch (type) {
    case WeightType::F32: std::memcpy(y, x, static_cast<size_t>(blocks) * 4); break;
    case WeightType::F16: f32_to_f16(x, static_cast<uint16_t*>(y), blocks); break;
    case WeightType::BF16: f32_to_bf16(x, static_cast<uint16_t*>(y), blocks); break;
    case WeightType::Q8_0: quantize_q8_0(x, static_cast<BlockQ8_0*>(y), blocks); break;
    case WeightType::Q4_0: quantize_q4_0(x, static_cast<BlockQ4_0*>(y), blocks); break;
    case WeightType::Q4_K: quantize_q4_K(x, static_cast<BlockQ4_K*>(y), blocks); break;
    case WeightType::Q5_K: quantize_q5_K(x, static_cast<BlockQ5_K*>(y), blocks); break;
    case WeightType::Q6_K: quantize_q6_K(x, static_cast<BlockQ6_K*>(y), blocks); break;
    case WeightType::MXFP4: quantize_mxfp4(x, static_cast<BlockMXFP4*>(y), blocks); break;
  }
}

void dequantize_blocks(WeightType type, const void* x, float* y, int64_t blocks) {
  switch (type) {
    case WeightType::F32: std::memcpy(y, x, static_cast<size_t>(blocks) * 4); break;
    case WeightType::F16: f16_to_f32(static_cast<const uint16_t*>(x), y, blocks); break;
    case WeightType::BF16: bf16_to_f32(static_cast<const uint16_t*>(x), y, blocks); break;
    case WeightType::Q8_0: dequantize_q8_0(static_cast<const BlockQ8_0*>(x), y, blocks); break;
    case WeightType::Q4_0: dequantize_q4_0(static_cast<const BlockQ4_0*>(x), y, blocks); break;
    case WeightType::Q4_K: dequantize_k<BlockQ4_K, false>(static_cast<const BlockQ4_K*>(x), y, blocks); break;
    case WeightType::Q5_K: dequantize_k<BlockQ5_K, true>(static_cast<const BlockQ5_K*>(x), y, blocks); break;
    case WeightType::Q6_K: dequantize_q6_K(static_cast<const BlockQ6_K*>(x), y, blocks); break;
    case WeightType::MXFP4: dequantize_mxfp4(static_cast<const BlockMXFP4*>(x), y, blocks); break;
  }
}

// Blocks of the whole matrix (rows never split a block, so rows × cols values are just blocks one after another),
// split between threads in chunks; `work` is the cost of a block relative to a float copy.
template <class Body>
void for_block_chunks(int64_t blocks, int64_t values_per_block, int64_t work, Body&& body) {
  if (!worth_parallel(blocks * values_per_block * work)) return body(int64_t{0}, blocks);  // no team of one (convert.cpp)
  const int64_t chunk = std::max<int64_t>(1, 4096 / values_per_block), chunks = (blocks + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) body(c * chunk, std::min(blocks, c * chunk + chunk) - c * chunk);
}

}  // namespace

const WeightTypeInfo& weight_type_info(WeightType type) { return kInfo[static_cast<int>(type)]; }

std::optional<WeightType> weight_type_from_ggml(uint32_t ggml_type) {
  for (WeightType t : kTypes)
    if (weight_type_info(t).ggml_type == ggml_type) return t;
  return std::nullopt;
}

std::optional<WeightType> weight_type_from_name(std::string_view name) {
  for (WeightType t : kTypes) {
    const std::string_view known = weight_type_info(t).name;
    if (known.size() == name.size() &&
        std::equal(known.begin(), known.end(), name.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
        }))
      return t;
  }
  return std::nullopt;
}

int64_t row_bytes(WeightType type, int64_t cols) {
  const WeightTypeInfo& info = weight_type_info(type);
  if (cols < 0) throw std::invalid_argument("row_bytes: a row of " + std::to_string(cols) + " values (a count must be ≥ 0)");
  if (cols % info.block_elements != 0)
    throw std::invalid_argument(std::string("row_bytes: a ") + info.name + " row holds whole blocks of " +
                                std::to_string(info.block_elements) + " values, and " + std::to_string(cols) +
                                " is not a multiple of " + std::to_string(info.block_elements) +
                                " (store this matrix as another type, e.g. q8_0 for multiples of 32, or f16)");
  const int64_t blocks = cols / info.block_elements;
  if (blocks > INT64_MAX / info.block_bytes)
    throw std::invalid_argument("row_bytes: a row of " + std::to_string(cols) + " values overflows a 64-bit byte count");
  return blocks * info.block_bytes;
}

void quantize_rows(WeightType type, const float* src, void* dst, int64_t rows, int64_t cols) {
  (void)row_bytes(type, cols);  // checks cols
  if (rows <= 0 || cols == 0) return;
  const WeightTypeInfo& info = weight_type_info(type);
  if (is_block_quantized(type) && !all_finite(src, rows * cols)) {
    const int64_t at = std::find_if(src, src + rows * cols, [](float v) { return !std::isfinite(v); }) - src;
    throw std::invalid_argument(std::string("quantize_rows: value ") + std::to_string(src[at]) + " at row " +
                                std::to_string(at / cols) + ", column " + std::to_string(at % cols) + " cannot be stored as " +
                                info.name + " (block scales need finite values; fix the weights or keep them as f32/f16)");
  }
  // A K-quant block searches ~20-40 spacings over its values (~35 µs a block of 256 here): threads from 64 blocks on.
  const int64_t work = type == WeightType::Q4_K || type == WeightType::Q5_K || type == WeightType::Q6_K ? 2 : 1;
  unsigned char* out = static_cast<unsigned char*>(dst);
  for_block_chunks(rows * cols / info.block_elements, info.block_elements, work, [&](int64_t first, int64_t count) {
    quantize_blocks(type, src + first * info.block_elements, out + first * info.block_bytes, count);
  });
}

void dequantize_rows(WeightType type, const void* src, float* dst, int64_t rows, int64_t cols) {
  (void)row_bytes(type, cols);  // checks cols
  if (rows <= 0 || cols == 0) return;
  const WeightTypeInfo& info = weight_type_info(type);
  const unsigned char* in = static_cast<const unsigned char*>(src);
  for_block_chunks(rows * cols / info.block_elements, info.block_elements, 1, [&](int64_t first, int64_t count) {
    dequantize_blocks(type, in + first * info.block_bytes, dst + first * info.block_elements, count);
  });
}

float stored_value(WeightType type, const void* row, int64_t col) {
  const WeightTypeInfo& info = weight_type_info(type);
  float block[kQK_K];
  const int64_t b = col / info.block_elements;
  dequantize_blocks(type, static_cast<const unsigned char*>(row) + b * info.block_bytes, block, 1);
  return block[col % info.block_elements];
}

}  // namespace qkv::kernels
