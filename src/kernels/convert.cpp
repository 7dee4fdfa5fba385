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
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));
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

void bf16_to_f32(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);  // float and uint32 share a size; bits are copied, not punned
#pragma omp parallel for schedule(static) if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(src[i]) << 16;
}

void f32_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src);
#pragma omp parallel for schedule(static) if (worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = in[i];
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
  }
}

void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32_reference(src[i]);
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
