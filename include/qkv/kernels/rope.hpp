// Rotary position embeddings (RoPE): the inverse frequencies of one layer (default, linear or Llama 3 scaling), their
// cos/sin table, and the rotation of q and k heads in place or into a copy, beside a double-precision reference.
// Rows run in parallel; each output is computed from its own row, so results do not depend on the thread count.
// Not here: the autograd op (core/ops_decoder.cpp), which heads a family rotates (nn/).
#pragma once

#include <cstdint>
#include <vector>

namespace qkv::kernels {

// ---- rotary position embeddings ----
//
// Per head of D = 2·P values at position t, pair i (i < P) is rotated by the angle t·inv_freq[i]:
//   (a, b) → (a·cos − b·sin, b·cos + a·sin).
// Which two values form pair i is the layout: Hugging Face's rotate-half pairs (i, i + P); Meta's original
// checkpoints interleave (2i, 2i + 1).
enum class RopeLayout { RotateHalf, Interleaved };

// The frequencies of one layer's rotation: inv_freq[i] = 1 / theta^(2i / R) for the R rotated values of a head (all
// D, or the first rotary_dim: a partial rotation), then scaled as rope_scaling says.
struct RopeFrequencies {
  double theta = 10000.0;  // rope_theta: the base of the frequencies
  // rope_scaling's rope_type: none, linear, Llama 3's, YaRN, LongRoPE (Phi-3), or proportional (Gemma 4's global
  // layers: below)
  enum class Scaling { None, Linear, Llama3, Yarn, LongRope, Proportional } scaling = Scaling::None;
  double factor = 1.0;  // linear, proportional: inv_freq / factor; llama3 and YaRN: the low-frequency divisor
  // Llama 3's: wavelengths below original/high_freq_factor stay, above original/low_freq_factor are divided by factor
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  // The context the model was first trained with (Llama 3, YaRN, LongRoPE)
  double original_max_position_embeddings = 8192.0;
  // YaRN: the rotation counts bounding the blend between kept and divided frequencies, and whether the correction
  // range is rounded outwards to whole pairs
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
  // LongRoPE: per-pair divisors, the short ones up to original_max_position_embeddings positions, the long beyond
  std::vector<double> short_factor, long_factor;
  // YaRN, LongRoPE: cos and sin are multiplied by this (so attention logits by its square); 1 otherwise
  double attention_factor = 1.0;
  // Partial RoPE, in its two published forms:
  // - rotary_dim (GPT-NeoX, Phi-3, Qwen3-Next; GLM with the interleaved layout): the first rotary_dim = R values of
  //   each head rotate among themselves — rotate-half pairs (i, i + R/2) — at 1 / theta^(2i / R), the rest pass;
  // - Proportional with rotated_pairs = int(p·D / 2) (Gemma 4's "proportional"): every value of the head is in a pair
  //   (i, i + D/2), the first rotated_pairs at 1 / theta^(2i / D) — the whole head's frequencies — and the rest at
  //   frequency 0, which leaves them as they are (rotary_dim stays 0).
  int64_t rotary_dim = 0;  // the first rotary_dim values of each head rotate, the rest pass (0: all of them)
  int64_t rotated_pairs = 0;  // Proportional: the pairs that turn (the others' frequencies are 0)

  // The R / 2 inverse frequencies for heads of D values, in float as Hugging Face computes them (float32 tensors);
  // `long_context` picks LongRoPE's long factors.
  std::vector<float> inverse_frequencies(int64_t D, bool long_context = false) const;
  // Whether a call reaching `positions` positions rotates with the long factors: LongRoPE, beyond the original
  // context (Hugging Face decides per forward call, from the largest position in it).
  bool long_context(int64_t positions) const {
    return scaling == Scaling::LongRope && static_cast<double>(positions) > original_max_position_embeddings;
  }
  bool operator==(const RopeFrequencies&) const = default;  // the same rotation
};

// cos and sin of t·inv_freq[i] for positions [0, positions), times `scale` (RopeFrequencies::attention_factor):
// (positions × P) each, row-major. The angle is the float32 product t·inv_freq[i], as Hugging Face forms it, and its
// cos/sin are rounded from double, then multiplied by the scale in float32.
struct RopeTable {
  int64_t positions = 0, P = 0;  // positions tabulated, and P frequencies per position (P pairs of a head rotate)
  std::vector<float> cos, sin;  // (positions × P) each, row-major
  // The table of `inv_freq` for positions [0, positions)
  static RopeTable make(const std::vector<float>& inv_freq, int64_t positions, float scale = 1.0f);
};

// src → dst (the same layout; src == dst rotates in place): rows of row_stride floats whose first `heads` heads of D
// values are rotated — each head's first 2·table.P values, the rest of it kept (a partial rotation) — and whose rest
// is copied. Row r is token position0 + (r % T) of a (B, T, …) layout; its head h
// starts at r·row_stride + h·D. inverse rotates by −angle: the backward of the forward (a rotation's transpose). One
// read of src and one write of dst. position0 + T must not exceed table.positions (checked by the caller).
void rope_apply(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows, int64_t T,
                int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse);
// The same with a position per row (a batch of sequences, each token at its own position): row r is the token at
// positions[r], each below table.positions (checked by the caller).
void rope_apply_rows(const RopeTable& table, RopeLayout layout, const float* src, float* dst, int64_t rows,
                     const int64_t* positions, int64_t row_stride, int64_t heads, int64_t D, bool inverse = false);
// The same in double, from first principles (angles and trig per element): the reference.
void rope_apply_reference(const std::vector<float>& inv_freq, RopeLayout layout, float* x, int64_t rows, int64_t T,
                          int64_t row_stride, int64_t heads, int64_t D, int64_t position0, bool inverse,
                          float scale = 1.0f);

}  // namespace qkv::kernels
