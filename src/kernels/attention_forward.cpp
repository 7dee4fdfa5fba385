// The fused attention kernel's forward pass (FlashAttention-2 style), float32 or bf16 products, from float32 K/V
// or a bf16 KV cache, and the probabilities of one head recomputed from its log-sum-exp. The plan, packs and
// products it runs on: attention_plan.hpp, attention_packs.hpp, micro_kernels.hpp. Not here: the backward
// (attention_backward.cpp), the reference (attention_reference.cpp), the autograd op (core/ops_sdpa.cpp).
//
// Per query block (thread-owned):
//   S = Qs Kᵀ_j (Br × Bc);  m' = max(m, rowmax S);  P = exp(S − m');  l = l·e^(m−m') + rowsum P
//   O = O·e^(m−m') + (P ∘ Z) V_j           (Z: dropout keep / (1 − p), or 1)
//   finally O /= l and lse = m + log l.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/convert.hpp"  // bf16_to_f32
#include "attention_packs.hpp"
#include "attention_plan.hpp"
#include "micro_kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

using namespace attention_detail;

namespace {

#ifdef QKV_ATTENTION_BF16
// y[j] = bf16(exp(x[j] − shift)) for lo ≤ j < hi, 0 elsewhere below n; returns the float32 Σ exp (lanes of 16
// summed in order, then across lanes).
float exp_to_bf16(const float* x, uint16_t* y, int64_t lo, int64_t hi, int64_t n, float shift) {
  std::fill(y, y + std::min(lo, n), uint16_t{0});
  std::fill(y + std::max(hi, lo), y + n, uint16_t{0});
  if (hi <= lo) return 0.0f;
  const __m512 s16 = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = lo; j < hi; j += 16) {
    const __mmask16 m = hi - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (hi - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s16)));
    sum = _mm512_add_ps(sum, e);
    _mm256_mask_storeu_epi16(y + j, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return simd::reduce_add(sum);
}
#endif

float row_max(const float* x, int64_t n) {
  float m = kNegInf;
  int64_t j = 0;
#ifdef QKV_AVX512
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (j = 16; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + j));
    m = _mm512_reduce_max_ps(v);
  }
#elif defined(QKV_AVX2)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float l : lanes) m = std::max(m, l);
  }
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

void scale_row(float* x, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// The forward's packs and its two products per (query block × key block), in float32: S = Qs Kᵀ_j from Kᵀ in
// (D × kBc) blocks, and O += P V_j from V's rows padded to Dp.
struct ForwardF32 {
  Scratch kt_buf, v_buf, q_buf;
  float *kt = nullptr, *vp = nullptr, *qs = nullptr;
  void reserve(const Plan& p) {
    kt = kt_buf.get(static_cast<size_t>(p.dims.D * p.Tk_pad));
    vp = v_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
    qs = q_buf.get(static_cast<size_t>(p.Br * p.Dp));
  }
  void pack_kv(const Plan& p, const float* k, const float* v, int64_t bkv) {
    pack_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, kt);
    pack_rows(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, p.dims.Tk, p.Tk_pad, 1.0f, vp);
  }
  void pack_queries(const Plan& p, const float* q, int64_t bh, int64_t q0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) scaled_copy(p.row(q, p.layout.q, bh, q0 + r), qs + r * p.Dp, p.dims.D, p.scale);
  }
  void scores(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, float* s, Trim trim, int64_t diag) {
    block_gemm(rows, cols_pad, p.dims.D, qs, p.Dp, 1, kt + k0 * p.dims.D, kBc, s, kBc, false, trim, diag, p.band());
  }
  // Row r of the tile: P = exp(S − m) on the visible columns [lo, hi), 0 elsewhere, then dropout's Z; returns Σ P
  // before dropout. A row with nothing visible is all 0.
  float exp_row(const Plan& p, float* sr, int64_t r, int64_t lo, int64_t hi, int64_t cols_pad, float m, int64_t bh,
                int64_t i, int64_t k0) {
    static_cast<void>(r);
    const float sum = exp_range(sr, sr, lo, hi, cols_pad, m);
    if (p.dropout && hi > lo) apply_dropout_row(sr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);
    return sum;
  }
  void add_values(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, const float* s, float* acc, Trim trim,
                  int64_t diag) {
    block_gemm(rows, p.Dp, cols_pad, s, kBc, 1, vp + k0 * p.Dp, p.Dp, acc, p.Dp, true, trim, diag, p.band());
  }
};

#ifdef QKV_ATTENTION_BF16
// The forward with bf16 operands: Qs, P and the packs of K and V rounded to bf16, the sums and the online softmax
// in float32. Kᵀ in pair rows per key block (S = Qs Kᵀ_j sums over D), V in pair rows of keys (O += P V_j sums over
// keys), P rounded once per tile.
template <typename KV = float>  // K and V as the caller holds them: float32, or bf16 (a bf16 KV cache)
struct ForwardBf16 {
  ScratchOf<uint16_t> kt_buf, v_buf, q_buf, p_buf, tile;
  uint16_t *kt = nullptr, *vp = nullptr, *qs = nullptr, *pb = nullptr;
  void reserve(const Plan& p) {
    kt = kt_buf.get(static_cast<size_t>(pair_width(p) * p.Tk_pad));
    vp = v_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
    qs = q_buf.get(static_cast<size_t>(p.Br * p.Dp));
    pb = p_buf.get(static_cast<size_t>(p.Br * kBc));
    tile.get(static_cast<size_t>(16 * pair_width(p)));
  }
  void pack_kv(const Plan& p, const KV* k, const KV* v, int64_t bkv) {
    pack_pairs_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, tile, kt);
    pack_pair_rows(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, p.dims.Tk, p.Tk_pad, 1.0f, vp);
  }
  void pack_queries(const Plan& p, const float* q, int64_t bh, int64_t q0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      to_bf16_scaled(p.row(q, p.layout.q, bh, q0 + r), p.dims.D, p.Dp, p.scale, qs + r * p.Dp);
  }
  void scores(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, float* s, Trim trim, int64_t diag) {
    const int64_t De = pair_width(p);
    block_gemm_bf16(rows, cols_pad, De, qs, p.Dp, 2, kt + k0 * De, 2 * kBc, s, kBc, false, trim, diag, p.band());
  }
  // As ForwardF32's, with P written straight to its bf16 tile (through the float tile only with dropout).
  float exp_row(const Plan& p, float* sr, int64_t r, int64_t lo, int64_t hi, int64_t cols_pad, float m, int64_t bh,
                int64_t i, int64_t k0) {
    uint16_t* dst = pb + r * kBc;
    if (!p.dropout) return exp_to_bf16(sr, dst, lo, hi, cols_pad, m);
    const float sum = exp_range(sr, sr, lo, hi, cols_pad, m);
    if (hi > lo) apply_dropout_row(sr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);
    to_bf16_scaled(sr, cols_pad, cols_pad, 1.0f, dst);
    return sum;
  }
  void add_values(const Plan& p, int64_t rows, int64_t cols_pad, int64_t k0, const float* s, float* acc, Trim trim,
                  int64_t diag) {
    static_cast<void>(s);  // P is already in pb
    block_gemm_bf16(rows, p.Dp, cols_pad, pb, kBc, 2, vp + k0 * p.Dp, 2 * p.Dp, acc, p.Dp, true, trim, diag, p.band());
  }
};
#endif

template <typename Products, typename KV = float>
void forward_blocks(const Plan& p, const float* q, const KV* k, const KV* v, float* o, float* lse) {
  const AttentionDims& dims = p.dims;
  const AttentionOptions& options = p.options;
  const int64_t Dp = p.Dp;
  struct Workspace {
    Products products;
    Scratch s_buf, o_buf;
    float *s = nullptr, *acc = nullptr;
    int64_t packed_kv = -1;  // the K/V head the products hold: query heads of one group reuse them
    void reserve(const Plan& p) {
      products.reserve(p);
      s = s_buf.get(static_cast<size_t>(p.Br * kBc));
      acc = o_buf.get(static_cast<size_t>(p.Br * p.Dp));
    }
  };
  auto spaces = workspaces<Workspace>(p.threads(), p);
  parallel_items(spaces, dims.B * dims.H, p.q_blocks, [&](Workspace& ws, int64_t bh, int64_t qb, bool) {
    const int64_t bkv = p.kv_of(bh);
    if (bkv != ws.packed_kv) {
      ws.products.pack_kv(p, k, v, bkv);
      ws.packed_kv = bkv;
    }
    const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
    ws.products.pack_queries(p, q, bh, q0, rows);
    float* s = ws.s;
    float* acc = ws.acc;
    std::fill_n(acc, rows * Dp, 0.0f);
    float m[kBrMax], l[kBrMax], m_new[kBrMax], alpha[kBrMax];
    int64_t lo[kBrMax], hi[kBrMax];  // the keys of the current block each row sees: local columns [lo, hi)
    std::fill_n(m, rows, kNegInf);
    std::fill_n(l, rows, 0.0f);
    const int64_t key_end = p.key_end(q0 + rows - 1);  // keys beyond this are masked for every row
    for (int64_t k0 = p.first_key_block(q0); k0 < key_end; k0 += kBc) {
      const int64_t cols = std::min(kBc, dims.Tk - k0), cols_pad = round_up(cols, kNR);
      const Trim columns = options.causal ? Trim::Columns : Trim::None, k_end = options.causal ? Trim::KEnd : Trim::None;
      const int64_t diag = q0 + p.offset - k0 + 1;  // local key c visible to local row r iff c < r + diag
      ws.products.scores(p, rows, cols_pad, k0, s, columns, diag);  // S = Qs Kᵀ
      // The new running maxima, then every row's rescale factor e^(m − m') in one vector pass (e^−∞ = 0 for a
      // row's first visible block): a scalar exp per row and block was 2–4% of the pass.
      for (int64_t r = 0; r < rows; ++r) {
        std::tie(lo[r], hi[r]) = p.visible_in_block(q0 + r, k0, cols);
        p.cap_scores(s + r * kBc, lo[r], hi[r]);
        m_new[r] = hi[r] <= lo[r] ? m[r] : std::max(m[r], row_max(s + r * kBc + lo[r], hi[r] - lo[r]));
      }
      simd::exp_difference(m, m_new, alpha, rows);
      for (int64_t r = 0; r < rows; ++r) {
        const float sum = ws.products.exp_row(p, s + r * kBc, r, lo[r], hi[r], cols_pad, m_new[r], bh, q0 + r, k0);
        if (hi[r] <= lo[r]) continue;  // nothing visible in this block: P's row is 0
        l[r] = l[r] * alpha[r] + sum;
        if (alpha[r] != 1.0f) scale_row(acc + r * Dp, Dp, alpha[r]);
        m[r] = m_new[r];
      }
      ws.products.add_values(p, rows, cols_pad, k0, s, acc, k_end, diag);  // O += P V
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = p.row(o, p.layout.o, bh, q0 + r);
      // l = 0 (no visible key) gives NaN, as PyTorch does
      scaled_copy(acc + r * Dp, dst, dims.D, l[r] > 0.0f ? 1.0f / l[r] : std::numeric_limits<float>::quiet_NaN());
      lse[bh * dims.Tq + q0 + r] = m[r] + std::log(l[r]);
    }
  });
}

}  // namespace

void attention_forward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                       const float* q, const float* k, const float* v, float* o, float* lse) {
  if (dims.B <= 0 || dims.H <= 0 || dims.Tq <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D;
  if (dims.Tk <= 0 || D <= 0) {  // nothing to attend to (Tk = 0: NaN rows) or nothing to carry (D = 0)
    for (int64_t bh = 0; bh < dims.B * dims.H; ++bh)
      for (int64_t i = 0; i < dims.Tq; ++i) {
        std::fill_n(p.row(o, layout.o, bh, i), D, std::numeric_limits<float>::quiet_NaN());
        lse[bh * dims.Tq + i] = dims.Tk <= 0 ? kNegInf : std::log(static_cast<float>(p.visible(i)));
      }
    return;
  }
#ifdef QKV_ATTENTION_BF16
  if (options.bf16 && attention_bf16_available()) return forward_blocks<ForwardBf16<>>(p, q, k, v, o, lse);
#endif
  forward_blocks<ForwardF32>(p, q, k, v, o, lse);
}

void attention_forward_bf16_kv(const AttentionDims& dims, const AttentionLayout& layout,
                               const AttentionOptions& options, const float* q, const uint16_t* k, const uint16_t* v,
                               float* o, float* lse) {
  if (dims.B <= 0 || dims.H <= 0 || dims.Tq <= 0) return;
  const Plan p(dims, layout, options);
#ifdef QKV_ATTENTION_BF16
  if (attention_bf16_available() && dims.Tk > 0 && dims.D > 0) return forward_blocks<ForwardBf16<uint16_t>>(p, q, k, v, o, lse);
#endif
  // Without bf16 products: K and V widened (exactly) over their extent, then the float32 kernel.
  auto widen = [&](const uint16_t* x, const AttentionStrides& s) {
    std::vector<float> out(static_cast<size_t>(p.extent(s, p.kv_heads, dims.Tk)));
    bf16_to_f32(x, out.data(), static_cast<int64_t>(out.size()));
    return out;
  };
  const std::vector<float> kf = widen(k, layout.k), vf = widen(v, layout.v);
  AttentionOptions fp32 = options;
  fp32.bf16 = false;
  attention_forward(dims, layout, fp32, q, kf.data(), vf.data(), o, lse);
}

void attention_probabilities(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                             const float* q, const float* k, const float* lse, int64_t b, int64_t h, float* out) {
  if (dims.Tq <= 0 || dims.Tk <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D, Dp = p.Dp, bh = b * dims.H + h, Tk = dims.Tk;
  if (D <= 0) {  // every score is 0: uniform over the visible keys
    for (int64_t i = 0; i < dims.Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j)
        out[i * Tk + j] = j >= p.key_begin(i) && j < p.key_end(i) ? std::exp(-lse[bh * dims.Tq + i]) : 0.0f;
    return;
  }
  Scratch kt_buf;
  float* kt = kt_buf.get(static_cast<size_t>(D * p.Tk_pad));
  const int64_t bkv = p.kv_of(bh);
  pack_transposed(p, p.kv_row(k, layout.k, bkv, 0), layout.k.token, kt);
  const float* lse_head = lse + bh * dims.Tq;
#pragma omp parallel num_threads(p.threads())
  {
    Scratch qs_buf, s_buf;
    float* qs = qs_buf.get(static_cast<size_t>(p.Br * Dp));
    float* s = s_buf.get(static_cast<size_t>(p.Br * kBc));
#pragma omp for schedule(static, 1)
    for (int64_t qb = 0; qb < p.q_blocks; ++qb) {
      const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = p.row(q, layout.q, bh, q0 + r);
        scaled_copy(src, qs + r * Dp, D, p.scale);
      }
      for (int64_t k0 = 0; k0 < Tk; k0 += kBc) {
        const int64_t cols = std::min(kBc, Tk - k0), cols_pad = round_up(cols, kNR);
        const int64_t diag = q0 + p.offset - k0 + 1;
        // the whole tile is in the future of every row, or before every row's window
        if ((options.causal && rows - 1 + diag <= 0) || k0 + cols <= p.key_begin(q0)) {
          for (int64_t r = 0; r < rows; ++r) std::fill_n(out + (q0 + r) * Tk + k0, cols, 0.0f);
          continue;
        }
        block_gemm(rows, cols_pad, D, qs, Dp, 1, kt + k0 * D, kBc, s, kBc, false,
                   options.causal ? Trim::Columns : Trim::None, diag, p.band());  // S = Qs Kᵀ
        for (int64_t r = 0; r < rows; ++r) {
          const auto [lo, hi] = p.visible_in_block(q0 + r, k0, cols);
          p.cap_scores(s + r * kBc, lo, hi);
          exp_range(s + r * kBc, out + (q0 + r) * Tk + k0, lo, hi, cols, lse_head[q0 + r]);  // P = exp(S − lse)
        }
      }
    }
  }
}

}  // namespace qkv::kernels
