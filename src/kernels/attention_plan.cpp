// The attention kernel's per-call choices (see attention_plan.hpp): which micro-kernels and bf16 products this build
// and CPU run, the query block height that follows, and the dropout stream's keys.
#include "attention_plan.hpp"

#include "qkv/kernels/gemm.hpp"  // bf16_native, amx_bf16_ready

namespace qkv::kernels {

namespace attention_detail {

uint32_t dropout_row_key(uint64_t seed, int64_t bh, int64_t i) {
  const uint32_t key = simd::mix32(static_cast<uint32_t>(seed) ^ simd::mix32(static_cast<uint32_t>(seed >> 32) + 0x9E3779B9u));
  const uint32_t row = simd::mix32(static_cast<uint32_t>(bh) * 0x85ebca6bu ^ simd::mix32(static_cast<uint32_t>(i) + 0x27d4eb2fu) ^
                                   static_cast<uint32_t>(static_cast<uint64_t>(bh) >> 32));
  return simd::mix32(key ^ row);
}

// z[j] *= keep(bh, i, j0 + j) / (1 − p) for j < n.
void apply_dropout_row(float* z, int64_t n, uint64_t seed, uint32_t threshold, float inv_keep, int64_t bh, int64_t i,
                       int64_t j0) {
  simd::apply_keep(z, z, n, dropout_row_key(seed, bh, i), static_cast<uint32_t>(j0), threshold, inv_keep, false);
}

int64_t query_block_rows(const AttentionOptions& o) {
#ifdef QKV_ATTENTION_AMX
  if (o.bf16 && attention_bf16_available() && amx_bf16_ready()) return kBrAmx;
#endif
  static_cast<void>(o);
  return kBrF32;
}

}  // namespace attention_detail

using namespace attention_detail;

const char* attention_isa() {
#if defined(QKV_AVX512)
  return "avx512f";
#elif defined(QKV_AVX2)
  return "avx2+fma";
#else
  return "portable";
#endif
}

bool attention_dropout_keep(uint64_t seed, float p, int64_t bh, int64_t i, int64_t j) {
  if (p <= 0.0f) return true;
  return simd::keep_hash(dropout_row_key(seed, bh, i), static_cast<uint32_t>(j)) >= simd::drop_threshold(p);
}

bool attention_bf16_available() {
#ifdef QKV_ATTENTION_BF16
  return bf16_native();
#else
  return false;
#endif
}

const char* attention_bf16_products() {
  if (!attention_bf16_available()) return "none";
#ifdef QKV_ATTENTION_AMX
  if (amx_bf16_ready()) return "AMX tiles (TDPBF16PS)";
#endif
  return "VDPBF16PS";
}

}  // namespace qkv::kernels
