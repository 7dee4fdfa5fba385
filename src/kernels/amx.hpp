// AMX tiles for qkv's own bf16 products (the fused attention kernel, short-K products in gemm_bf16). Internal.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QKV_AMX 1
#include <cstdint>

#include "simd.hpp"  // <immintrin.h>, without GCC 12's false warnings

namespace qkv::kernels {

// The tile configuration qkv's products use, for the scope of one object on one thread: every tile 16 rows × 64
// bytes (a 16 × 16 float32 block of C, a 16 × 32 bf16 block of A with k contiguous, or 16 pair rows of B: 16 columns
// × 2 k). It puts back the configuration it found (or releases the tiles if none was loaded), so other AMX code on
// the same threads (oneDNN's kernels) never finds qkv's configuration in place of its own, whatever it assumes about
// the state it left. Callers check amx_bf16_ready() first.
class Tiles {
 public:
  Tiles() {
    _tile_storeconfig(&found_);
    static const Config ours = [] {
      Config c;
      for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
      }
      c.palette = 1;
      return c;
    }();
    _tile_loadconfig(&ours);
  }
  ~Tiles() {
    if (found_.palette != 0) _tile_loadconfig(&found_);
    else _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  struct alignas(64) Config {
    uint8_t palette = 0, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  Config found_;
};

// C (16·MT × 16·NT) (+)= A · B over pair steps [kb, ke) (multiples of 16 but ke may pass KK: then the step's B
// pair rows come from b_last, a zero-padded copy with rows 64 bf16 apart). A: rows la bf16 apart, k contiguous;
// B: pair rows ldb bf16 apart, the strip's first column at b.
template <int MT, int NT>
void amx_tiles(int64_t kb, int64_t ke, int64_t KK, const uint16_t* a, int64_t la, const uint16_t* b, int64_t ldb,
               const uint16_t* b_last, float* c, int64_t ldc, bool accumulate) {
  const int64_t sa = la * 2, sc = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if constexpr (NT == 2) _tile_loadd(1, c + 16, sc);
    if constexpr (MT == 2) _tile_loadd(2, c + 16 * ldc, sc);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  for (int64_t kk = kb; kk < ke; kk += 16) {
    const bool last = kk + 16 > KK;
    const uint16_t* bk = last ? b_last : b + kk * ldb;
    const int64_t sb = (last ? 64 : ldb) * 2;
    _tile_loadd(6, bk, sb);
    if constexpr (NT == 2) _tile_loadd(7, bk + 32, sb);
    _tile_loadd(4, a + 2 * kk, sa);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, a + 16 * la + 2 * kk, sa);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, sc);
  if constexpr (NT == 2) _tile_stored(1, c + 16, sc);
  if constexpr (MT == 2) _tile_stored(2, c + 16 * ldc, sc);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 16 * ldc + 16, sc);
}

}  // namespace qkv::kernels
#endif
