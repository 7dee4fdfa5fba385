// The attention kernel's packs (internal to src/kernels/): each head's K, V, Q·scale and dO copied once per (head,
// thread) into the layouts the micro-kernels stream (micro_kernels.hpp), zero-padded to whole blocks, and the bf16
// conversions into pair rows that VDPBF16PS and AMX tiles read.
// Not here: the tiles of P and dS the backward turns into pair rows (attention_backward.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_plan.hpp"
#include "micro_kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels::attention_detail {

#ifdef QKV_ATTENTION_BF16
// Conversions into the products' layouts, rounding to nearest even (VCVTNE2PS2BF16: NaN stays NaN; float32
// denormals become zero, which at bf16's 8-bit mantissa is below its own rounding error).
// dst[j] = bf16(src[j] · factor) for j < n, zero for n ≤ j < n_pad.
inline void to_bf16_scaled(const float* src, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + j), f));
    _mm256_mask_storeu_epi16(dst + j, m, reinterpret_cast<__m256i>(h));
  }
  std::fill(dst + n, dst + n_pad, uint16_t{0});
}

// One pair row: dst[2j] = bf16(r0[j] · factor), dst[2j + 1] = bf16(r1[j] · factor) for j < n (r1 null: zeros),
// zero pairs for n ≤ j < n_pad.
// Words 0…15 and 16…31 of a vector of 32 bf16, interleaved: (0, 16, 1, 17, …)
alignas(64) inline constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Stores the 32 bf16 of `both` (values j… of row 0 in its low half, of row 1 in its high half) as pairs at dst + 2j,
// only the first `left` pairs when fewer than 16 are left.
inline void store_pairs(__m512i both, int64_t j, int64_t left, uint16_t* dst) {
  const __mmask32 keep = left >= 16 ? ~__mmask32(0) : static_cast<__mmask32>((uint64_t{1} << (2 * left)) - 1);
  _mm512_mask_storeu_epi16(dst + 2 * j, keep, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both));
}

inline void interleave_bf16(const float* r0, const float* r1, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  const __m512 f = _mm512_set1_ps(factor);
  int64_t j = 0;
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r0 + j), f);
    const __m512 x1 = r1 ? _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r1 + j), f) : _mm512_setzero_ps();
    store_pairs(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)), j, n - j, dst);  // x0 in the low half
  }
  std::fill(dst + 2 * n, dst + 2 * n_pad, uint16_t{0});
}

// The same from values already in bf16 (a bf16 KV cache): copied, zero-padded (factor must be 1).
inline void to_bf16_scaled(const uint16_t* src, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  static_cast<void>(factor);
  std::copy_n(src, n, dst);
  std::fill(dst + n, dst + n_pad, uint16_t{0});
}
inline void interleave_bf16(const uint16_t* r0, const uint16_t* r1, int64_t n, int64_t n_pad, float factor, uint16_t* dst) {
  static_cast<void>(factor);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256i x0 = _mm256_maskz_loadu_epi16(m, r0 + j);
    const __m256i x1 = r1 ? _mm256_maskz_loadu_epi16(m, r1 + j) : _mm256_setzero_si256();
    store_pairs(_mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1), j, n - j, dst);
  }
  std::fill(dst + 2 * n, dst + 2 * n_pad, uint16_t{0});
}
#endif

// A head's rows lie `token` floats apart (H·D in the (B, T, H·D) layout: 3 KiB at GPT-2's shape), a stride the
// hardware prefetcher does not follow, so a pack waited on every row it read (on AMX, 85% of a bf16 K pack's samples
// sat on its row loads and the packs were 18% of a forward + backward). The packs ask for the row kRowsAhead rows on.
constexpr int64_t kRowsAhead = 8;
template <typename Src>
[[gnu::always_inline]] inline void prefetch_row(const Src* first, int64_t token, int64_t t, int64_t T, int64_t n) {
  if (t < T) simd::prefetch(first + t * token, n * static_cast<int64_t>(sizeof(Src)));
}

// Kᵀ of one head, key block by key block: block j is (D × kBc) contiguous, zero beyond Tk. `first` is the head's
// token 0 and `token` its token stride. Whole-head (D × Tk) rows would put the D rows a block reads a multiple of
// 4 KiB apart — one L1 set for all of them. Tokens go 16 at a time: their rows stay in L1 while each of the D output
// rows gets 16 contiguous floats (a token-by-token loop scatters every token over D lines: measured 2.3 ns per
// float, 5% of a pass).
void pack_transposed(const Plan& p, const float* first, int64_t token, float* dst);

// Rows of one head (token 0 at `first`, token stride `token`): (rows_pad × Dp), values · factor, zero in the padding.
void pack_rows(const Plan& p, const float* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
               float* dst);

#ifdef QKV_ATTENTION_BF16
// De: D rounded up to a whole pair, the sum length of the products over the head width.
inline int64_t pair_width(const Plan& p) { return round_up(p.dims.D, 2); }

// Kᵀ (or Vᵀ) of one head as bf16 pair rows, key block by key block: block j holds De/2 pair rows of kBc words,
// word (dd, c) = (x[k0 + c][2dd], x[k0 + c][2dd + 1]); zero beyond Tk and D. Tokens go 16 at a time through `tile`.
template <typename Src>
void pack_pairs_transposed(const Plan& p, const Src* first, int64_t token, ScratchOf<uint16_t>& tile, uint16_t* dst);

// Rows of one head as bf16 pair rows of Dp columns: pair row kk = (x[2kk][n], x[2kk + 1][n]) · factor, T tokens,
// zero up to rows_pad (even).
template <typename Src>
void pack_pair_rows(const Plan& p, const Src* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
                    uint16_t* dst);
#endif

}  // namespace qkv::kernels::attention_detail
