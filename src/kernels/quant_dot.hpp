// The one-row products of a stored weight row with a row of activations (internal to src/kernels/): the activations
// quantized once to 8-bit blocks, every block of the weight row multiplied in integers (vpdpbusd / vpmaddubsw), scaled
// in float. Used by weights.cpp's gemm_weight for generation's few rows.
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/kernels/quant.hpp"
#include "simd.hpp"

// The builds of the integer kernels: AVX-512 with VNNI, AVX2 (with F16C), or plain C++.
#if defined(QKV_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QKV_DOT512 1
#endif
#if defined(QKV_AVX2) && defined(__F16C__)
#define QKV_DOT256 1
#endif

namespace qkv::kernels::quant {

// A block of 32 activations as the Q8_0 and Q4_0 products read it: x ≈ dx·q (the first part of an ActivationRow's
// bytes for those types, one per 32 values, in order).
struct alignas(64) Q8Block {
  int8_t q[32];
  float dx;
  int32_t sum;      // Σ q
  int32_t q4_bias;  // −8·Σ q: a Q4_0 product starts here, its weights read as their nibbles q + 8
  int32_t q8_bias;  // −128·Σ q: a Q8_0 product starts here, its weights read as q + 128
  int32_t pad[4];
};
static_assert(sizeof(Q8Block) == 64, "activation blocks stay 64-byte multiples");

// One row of K activations quantized for the products with one weight type, as the kernels of this build read it.
// Q8_0 and Q4_0 weights: per 32 values a scale dx = max|x|/127 and q = x/dx rounded to nearest even (|q| ≤ 127) —
// ggml's q8_0 activations; the K-quants: per 256 values ggml's q8_K (dx = −max/127 for the signed largest value,
// q = nearest_int(x/dx), with the sums of each 16 q). A block holding a NaN or ±Inf gets dx = NaN: its products are NaN,
// as a float product's would be. The bytes are laid out for the kernel (see quant_dot.cpp); block_scale and value
// read them back in the natural order, for references and tests.
class ActivationRow {
 public:
  void quantize(WeightType type, const float* x, int64_t K);
  WeightType type() const { return type_; }
  int64_t size() const { return K_; }
  // The scale of block b (of 32 values for Q8_0/Q4_0, 256 for the K-quants) and the level of value k.
  float block_scale(int64_t b) const;
  int level(int64_t k) const;

  const unsigned char* data() const { return data_; }

 private:
  WeightType type_ = WeightType::Q8_0;
  int64_t K_ = 0;
  std::vector<unsigned char> storage_;
  unsigned char* data_ = nullptr;  // storage_, 64-byte aligned
};

#if defined(QKV_DOT256) && !defined(QKV_DOT512)
// The AVX2 build's Q4_0 (and MXFP4) activations, after the natural blocks: two blocks per 256-bit step, the low
// nibbles' partners of both (values 0 … 15 of block 2p, then of 2p + 1), then the high ones'; block k of the pair owns
// int32 lanes 4k … 4k + 3, which start from bias (−offset·Σq in the first, zeros after: Q4_0's offset 8, MXFP4's 12).
// Read by quant_lanes.cpp's Q4_0 kernel for few rows and quant_dot.cpp's MXFP4 kernel.
struct alignas(64) Q4_0Pair {
  int8_t low[32];
  int8_t high[32];
  int32_t bias[8];
  float dx[2];
  float pad[6];
};

// acc + Σ of four adjacent u8 × s8 products in each int32 lane: vpdpbusd where the build has a 256-bit one, else
// vpmaddubsw (pairs into int16: callers keep |u·s| pairs below 32768) and vpmaddwd with ones.
[[gnu::always_inline]] inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

// out[r·ld + n] = Σ_k W[n][k]·x_r[k] (+ beta·out[r·ld + n]; beta 0: out is not read) for the weight rows n < rows,
// `row_bytes` apart, of x_r's type (a block type) and size, and the `count` rows of quantized activations x_0 … x_{count−1}.
// Each block of a weight row is unpacked once for up to kMaxDotRows rows of activations.
inline constexpr int kMaxDotRows = 4;
void dot_rows(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count, float beta,
              float* out, int64_t ld);

// Whether dot_rows takes every row of activations at once for this type (and should be given them all: it reads W
// once for all of them, kLanesTileRows rows of W at a time), rather than kMaxDotRows at a time: Q4_0 and Q8_0 in the
// AVX-512 VNNI build and the AVX2 one.
constexpr bool takes_all_rows(WeightType type) {
#if defined(QKV_DOT512) || defined(QKV_DOT256)
  return type == WeightType::Q4_0 || type == WeightType::Q8_0;
#else
  (void)type;
  return false;
#endif
}
// The rows of W those kernels take at once (one per int32 lane); a thread's slice of W is a multiple of it. And the
// chains their blocks are summed in: a row of Y is the sum of kLanesChains float32 chains, chain j over the blocks
// b ≡ j (mod kLanesChains) in order (quant_lanes.cpp).
#if defined(QKV_DOT512)
inline constexpr int64_t kLanesTileRows = 16;
inline constexpr int kLanesChains = 1;
#else
inline constexpr int64_t kLanesTileRows = 8;
inline constexpr int kLanesChains = 8;
#endif
#if defined(QKV_DOT512) || defined(QKV_DOT256)
// dot_rows for the types of takes_all_rows, the rows of W in the lanes of a vector (quant_lanes.cpp)
void dot_rows_in_lanes(const void* w, int64_t row_bytes, int64_t rows, const ActivationRow* const* x, int count,
                     float beta, float* out, int64_t ld);
#endif

// The same for rows of K halves or bfloat16 (type F16 or BF16) and `count` rows of float32 activations, each row of W
// widened to float32 once in the loop (vcvtph2ps, or a 16-bit shift), products summed in float32.
void dot_rows_16bit(WeightType type, const void* w, int64_t row_bytes, int64_t rows, const float* const* x, int count,
                    int64_t K, float beta, float* out, int64_t ld);

// What dot_rows runs in this build, e.g. "AVX512-VNNI vpdpbusd/vpdpwssd, 512-bit".
const char* dot_backend();

}  // namespace qkv::kernels::quant
