// Counter-based dropout for whole tensors (see kernels.hpp: hashed_dropout).
#include <algorithm>

#include "qkv/kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

void hashed_dropout(const float* x, float* y, int64_t n, uint64_t seed, float p, bool accumulate) {
  const uint32_t threshold = simd::drop_threshold(p);
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  const uint32_t key = simd::mix32(static_cast<uint32_t>(seed) ^ simd::mix32(static_cast<uint32_t>(seed >> 32) + 0x6a09e667u));
  constexpr int64_t kBlock = 4096;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kBlock, count = std::min(kBlock, n - first);
    // Indices above 2³² wrap; their high half goes into the key so they still get fresh decisions.
    const uint32_t block_key = simd::mix32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32));
    simd::apply_keep(x + first, y + first, count, block_key, static_cast<uint32_t>(first), threshold, scale, accumulate);
  }
}

}  // namespace qkv::kernels
