// Vector helpers shared by the kernels (internal). QKV_AVX2 is set when the build targets AVX2 + FMA;
// every user keeps a scalar path for other CPUs.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QKV_AVX2 1
#endif

namespace qkv::kernels::simd {

#ifdef QKV_AVX2
// e^x = 2^n · e^r with n = round(x·log₂e), r = x − n·ln2 split in two parts; e^r by a degree-6
// polynomial (Taylor, |r| ≤ ln2/2, relative error < 2e-7). Very negative x gives ~0.
inline __m256 exp(__m256 x) {
  // Clamp to the normal range; the constant goes first so a NaN in x passes through (maxps/minps return
  // their second operand when either is NaN) and the result is NaN, as it would be in PyTorch.
  x = _mm256_max_ps(_mm256_set1_ps(-87.33f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.37f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// tanh u = 1 − 2 / (e^{2u} + 1); e^{2u} saturates to 0 or ∞ far out, giving exactly ∓1.
inline __m256 tanh(__m256 u) {
  const __m256 e = exp(_mm256_add_ps(u, u));
  return _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
}

// murmur3's 32-bit finalizer on 8 lanes.
inline __m256i mix32(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}
#endif

inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

}  // namespace qkv::kernels::simd
