// The register- and tile-blocked micro-kernels qkv's own products are built from (internal to src/kernels/): FMA
// (float32), VDPBF16PS (bf16 pairs) and AMX tiles, and products of blocks packed for them, C (M × N) (+)= A · B, with
// the trims the attention kernel's causal and windowed tiles need. gemm_bf16.cpp's AMX products use the tiles.
// Not here: how attention packs its operands (attention_packs.hpp), OpenBLAS's sgemm (gemm.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

#include "qkv/kernels/memory.hpp"
#include "simd.hpp"  // <immintrin.h>, without GCC 12's false warnings; QKV_AVX2, QKV_AVX512

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QKV_AMX 1
#endif
#if defined(QKV_AVX512) && defined(__AVX512BF16__)
#define QKV_ATTENTION_BF16 1  // bf16 products (options.bf16): VDPBF16PS micro-kernels
#if defined(QKV_AMX)
#define QKV_ATTENTION_AMX 1  // and AMX tiles where the CPU and the kernel allow them (amx_bf16_ready)
#endif
#endif

namespace qkv::kernels {

#if defined(QKV_AMX)
// ---- bf16 products on AMX tiles (Intel Sapphire Rapids and later) ----
// TDPBF16PS multiplies a 16 × 32 bf16 tile of A (rows with k contiguous, 64 bytes each) by a 16-pair-row tile of B
// in the same pair rows as VDPBF16PS reads (16 columns × 2 k, 64 bytes each) into a 16 × 16 float32 tile: 16,384
// flops an instruction. On a Xeon whose VDPBF16PS runs at half its FMA rate, the only way bf16 beats float32 here.
// The tile state is asked of Linux once per process (amx_bf16_ready).

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

#endif

constexpr int kMR = 6, kNR = 16;  // the AVX2 micro-kernel: 6 rows × 16 columns

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A buffer of T (floats, or bf16 bit patterns) aligned to 64 bytes, sized once per call and reused across blocks.
template <typename T>
class ScratchOf {
 public:
  ScratchOf() = default;
  ScratchOf(const ScratchOf&) = delete;
  ScratchOf& operator=(const ScratchOf&) = delete;
  T* get(size_t n) {
    if (n > capacity_) {
      release();
      data_ = static_cast<T*>(memory::allocate_block(n * sizeof(T)));
      if (!data_) throw std::bad_alloc();
      capacity_ = n;
    }
    return data_;
  }
  ~ScratchOf() { release(); }

 private:
  void release() {
    memory::free_block(data_, capacity_ * sizeof(T));
    data_ = nullptr;
    capacity_ = 0;
  }
  T* data_ = nullptr;
  size_t capacity_ = 0;
};
using Scratch = ScratchOf<float>;

#ifdef QKV_AVX2
// The vector operations the micro-kernel needs, for 8 and (with AVX-512) 16 lanes.
struct Avx2Lanes {
  using V = __m256;
  static constexpr int kLanes = 8, kMaxRows = 6;  // 12 accumulators of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V exp(V x) { return simd::exp(x); }
};
#ifdef QKV_AVX512
// 8 rows × 32 columns: the inner loop is 2 loads, 8 broadcasts and 16 FMAs, so the two FMA ports, not the load
// ports, set the pace.
struct Avx512Lanes {
  using V = __m512;
  static constexpr int kLanes = 16, kMaxRows = 8;  // 16 accumulators of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V exp(V x) { return simd::exp(x); }
};
constexpr int kMR512 = Avx512Lanes::kMaxRows;
#endif
#endif

// The causal triangle inside one (query block × key block) tile: local query row r may see local key
// column c iff c < r + diag. Products whose result or inputs are zero outside it skip that part, at the
// granularity of the micro-kernel (6 rows, 16 columns), so diagonal tiles cost about half.
enum class Trim {
  None,
  Columns,   // C = S-like (rows = queries, columns = keys): compute only columns < last row's limit
  KEnd,      // C rows = queries, K = keys (P·V, dS·K): the sum stops at the last row's limit
  KBegin,    // C rows = keys, K = queries (Pᵀ·dO, dSᵀ·Q): the sum starts at the first query that sees them
};

// C (M × N) (+)= A (M × K) · B (K × N); N a multiple of 16. A has row stride lda and column stride ak. The trims
// skip what lies in the future of a row (and, with a window, before it).
void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t ldb,
                float* C, int64_t ldc, bool accumulate, Trim trim = Trim::None, int64_t diag = 0, int64_t window = 0);

#ifdef QKV_ATTENTION_BF16
// VDPBF16PS adds to each float lane the products of one pair of k: c[n] += a[2kk]·b[2kk][n] + a[2kk+1]·b[2kk+1][n].
// So A is read a pair at a time (row r's pair kk is the 32-bit word at A + r·lda + 2·kk: k contiguous in A's rows)
// and B is packed in pair rows (pair row kk holds (b[2kk][n], b[2kk+1][n]) for every column n, ldb bf16 apart).
// K is even, and every operand is zero beyond its valid part, so a sum that runs one k too far adds 0 · 0.

// C (M × N) (+)= A (M × K) · B (K × N) with bf16 operands as above (K even, N a multiple of 16; A's pairs ak2 apart)
// and the float kernel's trims, each strip's k range widened to whole pairs.
void block_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, int64_t ak2, const uint16_t* B,
                     int64_t ldb, float* C, int64_t ldc, bool accumulate, Trim trim = Trim::None, int64_t diag = 0,
                     int64_t window = 0);
#endif

#ifdef QKV_ATTENTION_AMX
// block_gemm_bf16 for A with k contiguous in its rows (ak2 = 2), on tiles. Blocks of 32 × 32 (16 at the edges); the
// trims are widened to whole steps of 16 pairs (what they skip is zero or masked, never needed). Rows past M and
// pairs past K/2 are never read: A is copied zero-padded when M or K/2 is not a multiple of 16, B's last partial
// step per strip, and a block with rows past M goes through a float tile.
void block_gemm_amx(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                    float* C, int64_t ldc, bool accumulate, Trim trim, int64_t diag, int64_t window);
#endif

}  // namespace qkv::kernels
