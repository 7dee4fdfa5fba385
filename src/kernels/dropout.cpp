// Counter-based dropout for whole tensors (see kernels.hpp: hashed_dropout).
#include <algorithm>

#include "qkv/kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

void hashed_dropout(const float* x, float* y, int64_t n, uint64_t seed, float p, bool accumulate) {
  const double t = static_cast<double>(p) * 4294967296.0;
  const uint32_t threshold = t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint32_t key = simd::mix32(static_cast<uint32_t>(seed) ^ simd::mix32(static_cast<uint32_t>(seed >> 32) + 0x6a09e667u));
  constexpr int64_t kBlock = 4096;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t i = b * kBlock;
    const int64_t end = std::min(n, i + kBlock);
    // Indices above 2³² wrap; the block number goes into the key so they still get fresh decisions.
    const uint32_t block_key = simd::mix32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32));
#ifdef QKV_AVX2
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i thr = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(threshold)), sign);
    const __m256i golden = _mm256_set1_epi32(static_cast<int>(0x9E3779B9u));
    const __m256i k = _mm256_set1_epi32(static_cast<int>(block_key));
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= end; i += 8) {
      const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256i h = simd::mix32(_mm256_xor_si256(k, _mm256_mullo_epi32(idx, golden)));
      const __m256 drop = _mm256_castsi256_ps(_mm256_cmpgt_epi32(thr, _mm256_xor_si256(h, sign)));
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_andnot_ps(drop, s));
      _mm256_storeu_ps(y + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(y + i), v) : v);
    }
#endif
    for (; i < end; ++i) {
      const uint32_t h = simd::mix32(block_key ^ (static_cast<uint32_t>(i) * 0x9E3779B9u));
      const float v = h >= threshold ? x[i] * scale : 0.0f;
      y[i] = accumulate ? y[i] + v : v;
    }
  }
}

}  // namespace qkv::kernels
