// The attention kernel's packs (see attention_packs.hpp): K and V per K/V head, Q·scale and dO per query head, in
// float32 blocks or bf16 pair rows, each read once from the caller's strided layout.
#include "attention_packs.hpp"

namespace qkv::kernels::attention_detail {

void pack_transposed(const Plan& p, const float* first, int64_t token, float* dst) {
  constexpr int64_t kTile = 16;
  const int64_t D = p.dims.D, T = p.dims.Tk;
  for (int64_t k0 = 0; k0 < p.Tk_pad; k0 += kBc) {
    float* block = dst + k0 * D;  // (k0 / kBc) · D · kBc
    const int64_t cols = std::clamp<int64_t>(T - k0, 0, kBc);
    for (int64_t t0 = 0; t0 < cols; t0 += kTile) {
      const int64_t n = std::min(kTile, cols - t0);
      const float* rows[kTile];
      for (int64_t t = 0; t < n; ++t) rows[t] = first + (k0 + t0 + t) * token;
      for (int64_t t = 0; t < n; ++t) prefetch_row(first, token, k0 + t0 + kTile + t, T, D);
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < n; ++t) block[d * kBc + t0 + t] = rows[t][d];
    }
    for (int64_t d = 0; d < D; ++d) std::fill(block + d * kBc + cols, block + (d + 1) * kBc, 0.0f);
  }
}

void pack_rows(const Plan& p, const float* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
               float* dst) {
  const int64_t D = p.dims.D, ld = p.Dp;
  for (int64_t t = 0; t < T; ++t) {
    prefetch_row(first, token, t + kRowsAhead, T, D);
    scaled_copy(first + t * token, dst + t * ld, D, factor);
    std::fill(dst + t * ld + D, dst + (t + 1) * ld, 0.0f);
  }
  std::fill(dst + T * ld, dst + rows_pad * ld, 0.0f);
}

#ifdef QKV_ATTENTION_BF16
template <typename Src>
void pack_pairs_transposed(const Plan& p, const Src* first, int64_t token, ScratchOf<uint16_t>& tile, uint16_t* dst) {
  constexpr int64_t kTile = 16;
  const int64_t D = p.dims.D, T = p.dims.Tk, De = pair_width(p), pairs = De / 2;
  uint16_t* rows = tile.get(static_cast<size_t>(kTile * De));
  for (int64_t k0 = 0; k0 < p.Tk_pad; k0 += kBc) {
    uint16_t* block = dst + k0 * De;
    const int64_t cols = std::clamp<int64_t>(T - k0, 0, kBc);
    for (int64_t t0 = 0; t0 < cols; t0 += kTile) {
      const int64_t n = std::min(kTile, cols - t0);
      for (int64_t t = 0; t < n; ++t) {
        prefetch_row(first, token, k0 + t0 + kTile + t, T, D);
        to_bf16_scaled(first + (k0 + t0 + t) * token, D, De, 1.0f, rows + t * De);  // or copied
      }
      // Pair dd of the n tokens: one gather of 16 words (rows past n read row 0 and are not stored).
      alignas(64) int32_t step[kTile];
      for (int64_t t = 0; t < kTile; ++t) step[t] = static_cast<int32_t>((t < n ? t : 0) * pairs);
      const __m512i index = _mm512_load_si512(step);
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
      for (int64_t dd = 0; dd < pairs; ++dd)
        _mm512_mask_storeu_epi32(block + 2 * (dd * kBc + t0), keep, _mm512_i32gather_epi32(index, rows + 2 * dd, 4));
    }
    for (int64_t dd = 0; dd < pairs; ++dd) std::fill(block + 2 * (dd * kBc + cols), block + 2 * (dd + 1) * kBc, uint16_t{0});
  }
}

template <typename Src>
void pack_pair_rows(const Plan& p, const Src* first, int64_t token, int64_t T, int64_t rows_pad, float factor,
                    uint16_t* dst) {
  for (int64_t t = 0; t < rows_pad; t += 2) {
    prefetch_row(first, token, t + kRowsAhead, T, p.dims.D);
    prefetch_row(first, token, t + kRowsAhead + 1, T, p.dims.D);
    const Src* r0 = t < T ? first + t * token : nullptr;
    const Src* r1 = t + 1 < T ? first + (t + 1) * token : nullptr;
    if (r0) interleave_bf16(r0, r1, p.dims.D, p.Dp, factor, dst + t * p.Dp);
    else std::fill_n(dst + t * p.Dp, 2 * p.Dp, uint16_t{0});
  }
}

// K and V as float32, or as a bf16 KV cache holds them
template void pack_pairs_transposed<float>(const Plan&, const float*, int64_t, ScratchOf<uint16_t>&, uint16_t*);
template void pack_pairs_transposed<uint16_t>(const Plan&, const uint16_t*, int64_t, ScratchOf<uint16_t>&, uint16_t*);
template void pack_pair_rows<float>(const Plan&, const float*, int64_t, int64_t, int64_t, float, uint16_t*);
template void pack_pair_rows<uint16_t>(const Plan&, const uint16_t*, int64_t, int64_t, int64_t, float, uint16_t*);
#endif

}  // namespace qkv::kernels::attention_detail
