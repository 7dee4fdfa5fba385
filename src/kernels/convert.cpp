// 16-bit float conversions (see qkv/kernels/convert.hpp). The bf16 loops are plain integer shifts and adds that GCC
// vectorises; the half conversion uses F16C's vcvtph2ps when compiled for it (every x86 CPU qkv targets has it).
#include "qkv/kernels/convert.hpp"

#include <algorithm>
#include <cstring>

#include "parallel.hpp"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace qkv::kernels {

namespace {
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace

float bf16_to_f32_reference(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_bf16_reference(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep it quiet
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);  // ties to even; overflow rounds to ±Inf as it should
}

float f16_to_f32_reference(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f)  // ±Inf, or NaN made quiet as vcvtph2ps and ggml's scalar conversion make it (its payload kept)
    return float_of(sign | 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u));
  if (exponent == 0) {
    if (mantissa == 0) return float_of(sign);
    int e = -1;  // subnormal: normalise
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    return float_of(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mantissa & 0x3ffu) << 13));
  }
  return float_of(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

uint16_t f32_to_f16_reference(float f) {
  const uint32_t u = bits_of(f), magnitude = u & 0x7fffffffu;
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN: ggml's one quiet NaN
  if (magnitude >= 0x38800000u) {                    // 2⁻¹⁴ and up: a normal half, or beyond the range
    uint32_t r = magnitude - ((127u - 15u) << 23);   // the exponent rebiased; 13 mantissa bits to drop
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;       // ties to even (a carry moves into the exponent as it should)
    return sign | static_cast<uint16_t>(r < 0x7c00u ? r : 0x7c00u);  // ±Inf past 65504 (and for ±Inf)
  }
  if (magnitude <= 0x33000000u) return sign;  // ≤ 2⁻²⁵: ±0 (2⁻²⁵ itself is a tie between 0 and 2⁻²⁴: even is 0)
  // A subnormal half: the value in units of 2⁻²⁴, rounded to nearest even. The float is m·2^(e−150) with the
  // implicit bit in m, so the units are m·2^(e−126): m shifted right by 126 − e (14…24 here).
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u, shift = 126u - (magnitude >> 23);
  const uint32_t kept = mantissa >> shift, dropped = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  const uint32_t r = kept + (dropped > half || (dropped == half && (kept & 1u)) ? 1u : 0u);  // 0x400: the least normal
  return sign | static_cast<uint16_t>(r);
}

namespace {
void bf16_to_f32_rows(const uint16_t* __restrict src, uint32_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(src[i]) << 16;
}

void f32_to_bf16_rows(const uint32_t* __restrict in, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = in[i];
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
  }
}
}  // namespace

// Below the grain the loop runs here, not in a parallel region with `if` false: libgomp still starts a team of one for
// that (about a microsecond), which the KV cache's many short runs of bf16 paid thousands of times a token.
void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // float and uint32 share a size; bits are copied, not punned
  if (!worth_parallel(n)) return bf16_to_f32_rows(src, out, n);
  for_blocks(n, [&](int64_t begin, int64_t end) { bf16_to_f32_rows(src + begin, out + begin, end - begin); });
}

void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src);
  if (!worth_parallel(n)) return f32_to_bf16_rows(in, dst, n);
  for_blocks(n, [&](int64_t begin, int64_t end) { f32_to_bf16_rows(in + begin, dst + begin, end - begin); });
}

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32_reference(src[i]);
}

void f32_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  // vcvtps2ph rounds as the reference for every non-NaN value; NaN lanes get ggml's 0x7e00 (with the sign) instead
  // of the truncated payload F16C keeps.
  const __m128i quiet = _mm_set1_epi16(0x7e00), sign_bit = _mm_set1_epi16(static_cast<short>(0x8000));
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(nan)),
                                          _mm256_extractf128_si256(_mm256_castps_si256(nan), 1));
    const __m128i fixed = _mm_or_si128(_mm_and_si128(h, sign_bit), quiet);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_blendv_epi8(h, fixed, nan16));
  }
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16_reference(src[i]);
}

bool copy_finite(const void* src, float* dst, int64_t n) {
  const unsigned char* in = static_cast<const unsigned char*>(src);
  // Any non-finite float has all exponent bits set: OR together (exponent bits of each) and compare once per block.
  bool finite = true;
  constexpr int64_t kBlock = 1 << 14;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (worth_parallel(n))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    std::memcpy(dst + begin, in + begin * 4, static_cast<size_t>(end - begin) * 4);
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(dst + begin);
    bool all = true;
    for (int64_t i = 0; i < end - begin; ++i) all &= (bits[i] & 0x7f800000u) != 0x7f800000u;
    finite = finite && all;
  }
  return finite;
}

bool all_finite(const float* x, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  bool finite = true;
  constexpr int64_t kBlock = 1 << 14;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (worth_parallel(n))
  for (int64_t b = 0; b < blocks; ++b) {
    bool all = true;
    for (int64_t i = b * kBlock, end = std::min(n, i + kBlock); i < end; ++i) all &= (bits[i] & 0x7f800000u) != 0x7f800000u;
    finite = finite && all;
  }
  return finite;
}

}  // namespace qkv::kernels
