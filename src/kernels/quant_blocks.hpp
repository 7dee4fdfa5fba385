// ggml's block layouts as C++ structs (internal to src/kernels/): the formats of qkv/kernels/quant.hpp and the
// 8-bit activation blocks the integer products use. Every field is a byte, an int8 or a little-endian 16-bit half, so
// a block has alignment 2 (Q8_K 4) and no padding: the static_asserts pin the sizes to ggml-common.h's.
#pragma once

#include <cstdint>
#include <cstring>

#include "qkv/kernels/convert.hpp"

namespace qkv::kernels::quant {

inline constexpr int kQK = 32;    // values in a Q8_0 or Q4_0 block
inline constexpr int kQK_K = 256;  // values in a K-quant super-block

struct BlockQ8_0 {
  uint16_t d;         // scale (half)
  int8_t qs[kQK];     // x = d·q
};
struct BlockQ4_0 {
  uint16_t d;             // scale (half)
  uint8_t qs[kQK / 2];    // byte j: value j in the low nibble, value j + 16 in the high one; x = d·(q − 8)
};
struct BlockQ4_K {
  uint16_t d, dmin;       // super-block scales of the sub-block scales and mins (halves)
  uint8_t scales[12];     // 8 six-bit scales and 8 six-bit mins (packed: see scale_min_k4)
  uint8_t qs[kQK_K / 2];  // per 64 values, 32 bytes: value j low nibble, value j + 32 high; x = d·sc·q − dmin·m
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQK_K / 8];  // the fifth bit: bit 2i (2i + 1) of byte j for value j (j + 32) of the i-th 64
  uint8_t qs[kQK_K / 2];  // the low four bits, as Q4_K's
};
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];   // per 128 values, 64 bytes: value j and j + 32 low nibbles, j + 64 and j + 96 high
  uint8_t qh[kQK_K / 4];   // per 128 values, 32 bytes: bits 2i..2i+1 of byte j are the high bits of value j + 32i
  int8_t scales[kQK_K / 16];  // one per 16 values
  uint16_t d;                 // x = d·sc·(q − 32)
};
// OCP's MXFP4 as ggml holds it (gpt-oss's experts): an E8M0 exponent and 32 four-bit E2M1 codes, value j in byte j's low
// nibble and value j + 16 in its high one (Q4_0's order); x = kMxfp4Values[code]·2^(e − 128), the E2M1 values doubled
// so they are integers (ggml-common.h's kvalues_mxfp4) and the scale halved to match (ggml's e8m0_to_fp32_half).
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[kQK / 2];
};
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// 2^(e − 128) as float32 bits: (e − 1)·2²³ for e ≥ 2; the two subnormals 2^-128 and 2^-127 below
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// The activations of a product with a K-quant weight (ggml's block_q8_K, never stored in files): a float scale, 256
// int8 and the sums of each 16 (the K-quants' mins and Q6_K's offset of 32 multiply those sums).
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};

static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292 && sizeof(BlockMXFP4) == 17,
              "block layouts must match ggml-common.h");

inline float half_to_float(uint16_t h) { return f16_to_f32_reference(h); }

// Sub-block j's six-bit scale and min of a Q4_K/Q5_K block: j < 4 in the low six bits of bytes j and j + 4; j ≥ 4 in
// the nibbles of byte j + 4, their top two bits in the top bits of bytes j − 4 (scale) and j (min).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = static_cast<uint8_t>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *min = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

}  // namespace qkv::kernels::quant
