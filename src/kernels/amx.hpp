// AMX tiles for qkv's own bf16 products (the fused attention kernel, short-K products in gemm_bf16). Internal.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QKV_AMX 1
#include <immintrin.h>

#include <cstdint>

namespace qkv::kernels {

// Every tile 16 rows × 64 bytes: a 16 × 16 float32 block of C, a 16 × 32 bf16 block of A (k contiguous), or 16
// pair rows of B (16 columns × 2 k). Loaded before each product (cheap next to one): oneDNN's AMX kernels, on the
// same threads, load their own. Callers check amx_bf16_ready() first.
inline void configure_tiles() {
  struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

}  // namespace qkv::kernels
#endif
