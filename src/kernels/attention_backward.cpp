// The fused attention kernel's backward pass (FlashAttention-2 style), float32 or bf16 products: dQ, dK and dV from
// dO, recomputing the probabilities tile by tile from the forward's log-sum-exp. The plan, packs and products it
// runs on: attention_plan.hpp, attention_packs.hpp, micro_kernels.hpp.
//
// With Di = rowsum(dO ∘ O), P = exp(S − lse), G = dO Vᵀ_j, dS = P ∘ (G ∘ Z − Di).
// Grouped-query attention: the H / H_kv query heads that read one K/V head are one unit of work, so dK and dV are
// summed over the group in head order by one owner, and K/V are packed once per group.
//   With at least as many K/V groups as threads, one pass, a whole group per thread: per key block j, each query
//   block i that sees it gives S and G once, then dV_j += (P∘Z)ᵀ dO_i, dK_j += dSᵀ Qs_i and dQ_i += dS K_j into
//   the thread's own dQ buffer for the head — five products per tile.
//   With fewer heads than threads, two passes split a head by blocks, each thread owning what it writes:
//     pass 1, per key block:   dV_j = Σ_i (P∘Z)ᵀ dO_i,  dK_j = Σ_i dSᵀ Qs_i
//     pass 2, per query block: dQ_i = scale · Σ_j dS K_j   (S and G recomputed: seven products per tile)
// Either way no atomics and no reduction across threads: for a given thread count the bits never vary.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/gemm.hpp"  // amx_bf16_ready
#include "attention_packs.hpp"
#include "attention_plan.hpp"
#include "micro_kernels.hpp"
#include "simd.hpp"

namespace qkv::kernels {

using namespace attention_detail;

namespace {

#ifdef QKV_ATTENTION_BF16
// Σ bf16(a[j]) · b[j] over j < n, in float32.
float dot_rounded_bf16(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + j)));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    sum = _mm512_fmadd_ps(rounded, _mm512_maskz_loadu_ps(m, b + j), sum);
  }
  return simd::reduce_add(sum);
}
#endif

#ifdef QKV_AVX2
// The vector part of probabilities_and_dscores_row in L's lanes, from j on; returns where it stopped.
template <typename L>
int64_t probabilities_and_dscores_lanes(float* p, float* g, int64_t j, int64_t valid, float lse, float di) {
  const typename L::V l = L::set1(lse), d = L::set1(di);
  for (; j + L::kLanes <= valid; j += L::kLanes) {
    const typename L::V e = L::exp(L::sub(L::load(p + j), l));
    L::store(p + j, e);
    L::store(g + j, L::mul(e, L::sub(L::load(g + j), d)));
  }
  return j;
}
#endif

// Without dropout, one pass per row of a backward tile: p[j] = exp(p[j] − lse) (S in, P out) and
// g[j] = p[j]·(g[j] − di) (dO·Vᵀ in, dS out) for j < valid; both 0 from valid to n.
void probabilities_and_dscores_row(float* p, float* g, int64_t valid, int64_t n, float lse, float di) {
  int64_t j = 0;
#ifdef QKV_AVX512
  j = probabilities_and_dscores_lanes<Avx512Lanes>(p, g, j, valid, lse, di);
#endif
#ifdef QKV_AVX2
  j = probabilities_and_dscores_lanes<Avx2Lanes>(p, g, j, valid, lse, di);
#endif
  for (; j < valid; ++j) {
    p[j] = simd::exp_flushed(p[j] - lse);
    g[j] = p[j] * (g[j] - di);
  }
  std::fill(p + valid, p + n, 0.0f);
  std::fill(g + valid, g + n, 0.0f);
}

#ifdef QKV_ATTENTION_BF16
// The float32 tile (rows × kBc, the first cols_pad columns) as bf16 pair rows over its rows: (rows_even / 2) pair
// rows of kBc columns.
void tile_pair_rows(const float* tile, int64_t rows, int64_t cols_pad, uint16_t* dst) {
  for (int64_t r = 0; r < rows; r += 2)
    interleave_bf16(tile + r * kBc, r + 1 < rows ? tile + (r + 1) * kBc : nullptr, cols_pad, cols_pad, 1.0f,
                    dst + r * kBc);
}

#ifdef QKV_ATTENTION_AMX
// dst (C × R 32-bit words, rows R apart) = srcᵀ, src (R × C words, rows C apart): pair rows of queries turned into
// rows of k-contiguous pairs, 16 words a gather.
void transpose_words(const uint16_t* src, int64_t R, int64_t C, uint16_t* dst) {
  alignas(64) int32_t step[16];
  for (int i = 0; i < 16; ++i) step[i] = static_cast<int32_t>(i * C);
  const __m512i index = _mm512_load_si512(step);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const __mmask16 keep = R - r0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (R - r0)) - 1);
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, index, src + 2 * (r0 * C + c), 4);
      _mm512_mask_storeu_epi32(dst + 2 * (c * R + r0), keep, words);
    }
}

// dst (cols × rows, rows ld_dst apart) = the first `cols` columns of src (rows × ld_src), transposed.
void transpose_block(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t d = 0; d < rows; ++d) dst[j * ld_dst + d] = src[d * ld_src + j];
}
#endif
#endif

// The dK and dV rows of key block k0 (cols keys) out of their (kBc × Dp) accumulators.
void store_key_block(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc,
                     float* dk, float* dv) {
  for (int64_t j = 0; j < cols; ++j) {
    std::copy_n(dk_acc + j * p.Dp, p.dims.D, p.kv_row(dk, p.layout.k, bkv, k0 + j));
    std::copy_n(dv_acc + j * p.Dp, p.dims.D, p.kv_row(dv, p.layout.v, bkv, k0 + j));
  }
}

// The packs of one K/V head and of the `group` query heads that read it, for the backward pass, owned by one
// thread, and the backward's five products in float32: Kᵀ, Vᵀ (and K row-major) of the K/V head; Q·scale and dO of
// each query head, one after another.
struct BackwardF32 {
  Scratch kt_buf, vt_buf, k_buf, qs_buf, do_buf;
  float *kt = nullptr, *vt = nullptr, *kp = nullptr, *qs = nullptr, *dop = nullptr;
  int64_t head_floats = 0;  // Tq_pad · Dp: the offset between query heads in qs and dop
  void reserve(const Plan& p, bool need_k) {
    for (Scratch* b : {&kt_buf, &vt_buf}) b->get(static_cast<size_t>(p.dims.D * p.Tk_pad));
    for (Scratch* b : {&qs_buf, &do_buf}) b->get(static_cast<size_t>(p.group * p.Tq_pad * p.Dp));
    if (need_k) k_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
  }
  void pack(const Plan& p, const float* q, const float* k, const float* v, const float* d_o, int64_t bkv, bool need_k) {
    const int64_t D = p.dims.D, Dp = p.Dp;
    head_floats = p.Tq_pad * Dp;
    kt = kt_buf.get(static_cast<size_t>(D * p.Tk_pad));
    vt = vt_buf.get(static_cast<size_t>(D * p.Tk_pad));
    qs = qs_buf.get(static_cast<size_t>(p.group * head_floats));
    dop = do_buf.get(static_cast<size_t>(p.group * head_floats));
    pack_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, kt);
    pack_transposed(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, vt);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      pack_rows(p, p.row(q, p.layout.q, bh, 0), p.layout.q.token, p.dims.Tq, p.Tq_pad, p.scale, qs + g * head_floats);
      pack_rows(p, p.row(d_o, p.layout.o, bh, 0), p.layout.o.token, p.dims.Tq, p.Tq_pad, 1.0f, dop + g * head_floats);
    }
    if (need_k) {
      kp = k_buf.get(static_cast<size_t>(p.Tk_pad * Dp));
      pack_rows(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, p.dims.Tk, p.Tk_pad, 1.0f, kp);
    }
  }
  // S = Qs Kᵀ_j into pz and G = dO Vᵀ_j into ds for query block (q0, rows) of query head g.
  void scores(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t k0, int64_t cols_pad, float* pz, float* ds,
              Trim trim, int64_t diag) {
    const int64_t D = p.dims.D, Dp = p.Dp;
    block_gemm(rows, cols_pad, D, qs + g * head_floats + q0 * Dp, Dp, 1, kt + k0 * D, kBc, pz, kBc, false, trim, diag, p.band());
    block_gemm(rows, cols_pad, D, dop + g * head_floats + q0 * Dp, Dp, 1, vt + k0 * D, kBc, ds, kBc, false, trim, diag, p.band());
  }
  // dV_j += (P∘Z)ᵀ dO and dK_j += dSᵀ Qs: accumulators (cols × Dp).
  void add_dv_dk(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t cols, const float* pz, const float* ds,
                 float* dv_acc, float* dk_acc, int64_t diag) {
    const int64_t Dp = p.Dp;
    const Trim k_begin = p.options.causal ? Trim::KBegin : Trim::None;
    block_gemm(cols, Dp, rows, pz, 1, kBc, dop + g * head_floats + q0 * Dp, Dp, dv_acc, Dp, true, k_begin, diag, p.band());
    block_gemm(cols, Dp, rows, ds, 1, kBc, qs + g * head_floats + q0 * Dp, Dp, dk_acc, Dp, true, k_begin, diag, p.band());
  }
  // dq_acc (rows × Dp) += dS K_j
  void add_dq(const Plan& p, int64_t rows, int64_t k0, int64_t cols_pad, const float* ds, float* dq_acc, int64_t diag) {
    block_gemm(rows, p.Dp, cols_pad, ds, kBc, 1, kp + k0 * p.Dp, p.Dp, dq_acc, p.Dp, true,
               p.options.causal ? Trim::KEnd : Trim::None, diag, p.band());
  }
  void store(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc, float* dk,
             float* dv) const {
    store_key_block(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
  }
};

#ifdef QKV_ATTENTION_BF16
// The backward with bf16 operands. S and G sum over D (Qs, dO row-major; Kᵀ, Vᵀ in pair rows per key block, as the
// forward's Kᵀ); dQ += dS K_j sums over keys (K in pair rows of keys, dS rounded row-major); dV += (P∘Z)ᵀ dO and
// dK += dSᵀ Qs sum over queries: dO and Qs in pair rows of queries, the tiles of P∘Z and dS turned into pair rows of
// queries and read transposed. Accumulators as float32's, (kBc × Dp).
struct BackwardBf16 {
  ScratchOf<uint16_t> kt_buf, vt_buf, k_buf, qs_buf, do_buf, qsp_buf, dop_buf, tile_buf, pair_buf, ds_buf;
  uint16_t *kt = nullptr, *vt = nullptr, *kp = nullptr, *qs = nullptr, *dop = nullptr, *qs_pairs = nullptr,
           *do_pairs = nullptr, *pairs = nullptr, *dsb = nullptr;
  int64_t head = 0;  // Tq_pad · Dp: the offset between query heads in every per-head pack
#ifdef QKV_ATTENTION_AMX
  // On AMX tiles A must have k contiguous in its rows, so dV and dK are summed transposed: dVᵀ += dOᵀ (P∘Z) and
  // dKᵀ += Qsᵀ dS, with Qsᵀ and dOᵀ (Dp × Tq_pad: the pair-row packs turned word for word) and the tiles of P∘Z and
  // dS in pair rows as B. The accumulators hold (Dp × kBc) and are turned back as the key block is stored.
  bool amx = false;
  ScratchOf<uint16_t> qst_buf, dot_buf;
  ScratchOf<float> turned_buf;
  uint16_t *qs_t = nullptr, *do_t = nullptr;
#endif
  void reserve(const Plan& p, bool need_k) {
    const size_t kv = static_cast<size_t>(pair_width(p) * p.Tk_pad), per_group = static_cast<size_t>(p.group * p.Tq_pad * p.Dp);
    kt = kt_buf.get(kv);
    vt = vt_buf.get(kv);
    qs = qs_buf.get(per_group);
    dop = do_buf.get(per_group);
    qs_pairs = qsp_buf.get(per_group);
    do_pairs = dop_buf.get(per_group);
    tile_buf.get(static_cast<size_t>(16 * pair_width(p)));
    pairs = pair_buf.get(static_cast<size_t>(p.Br * kBc));
    dsb = ds_buf.get(static_cast<size_t>(p.Br * kBc));
    if (need_k) kp = k_buf.get(static_cast<size_t>(p.Tk_pad * p.Dp));
#ifdef QKV_ATTENTION_AMX
    amx = amx_bf16_ready();
    if (amx) {
      qs_t = qst_buf.get(per_group);
      do_t = dot_buf.get(per_group);
      turned_buf.get(static_cast<size_t>(2 * kBc * p.Dp));
    }
#endif
  }
  void pack(const Plan& p, const float* q, const float* k, const float* v, const float* d_o, int64_t bkv, bool need_k) {
    const int64_t Dp = p.Dp, Tq = p.dims.Tq;
    head = p.Tq_pad * Dp;
    pack_pairs_transposed(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, tile_buf, kt);
    pack_pairs_transposed(p, p.kv_row(v, p.layout.v, bkv, 0), p.layout.v.token, tile_buf, vt);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      const float* qh = p.row(q, p.layout.q, bh, 0);
      const float* oh = p.row(d_o, p.layout.o, bh, 0);
      for (int64_t t = 0; t < p.Tq_pad; ++t) {
        if (t < Tq) {
          prefetch_row(qh, p.layout.q.token, t + kRowsAhead, Tq, p.dims.D);
          prefetch_row(oh, p.layout.o.token, t + kRowsAhead, Tq, p.dims.D);
          to_bf16_scaled(qh + t * p.layout.q.token, p.dims.D, Dp, p.scale, qs + g * head + t * Dp);
          to_bf16_scaled(oh + t * p.layout.o.token, p.dims.D, Dp, 1.0f, dop + g * head + t * Dp);
        } else {
          std::fill_n(qs + g * head + t * Dp, Dp, uint16_t{0});
          std::fill_n(dop + g * head + t * Dp, Dp, uint16_t{0});
        }
      }
      pack_pair_rows(p, qh, p.layout.q.token, Tq, p.Tq_pad, p.scale, qs_pairs + g * head);
      pack_pair_rows(p, oh, p.layout.o.token, Tq, p.Tq_pad, 1.0f, do_pairs + g * head);
#ifdef QKV_ATTENTION_AMX
      if (amx) {
        transpose_words(qs_pairs + g * head, p.Tq_pad / 2, Dp, qs_t + g * head);
        transpose_words(do_pairs + g * head, p.Tq_pad / 2, Dp, do_t + g * head);
      }
#endif
    }
    if (need_k) pack_pair_rows(p, p.kv_row(k, p.layout.k, bkv, 0), p.layout.k.token, p.dims.Tk, p.Tk_pad, 1.0f, kp);
  }
  void scores(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t k0, int64_t cols_pad, float* pz, float* ds,
              Trim trim, int64_t diag) {
    const int64_t De = pair_width(p), Dp = p.Dp;
    block_gemm_bf16(rows, cols_pad, De, qs + g * head + q0 * Dp, Dp, 2, kt + k0 * De, 2 * kBc, pz, kBc, false, trim, diag, p.band());
    block_gemm_bf16(rows, cols_pad, De, dop + g * head + q0 * Dp, Dp, 2, vt + k0 * De, 2 * kBc, ds, kBc, false, trim, diag, p.band());
  }
  // dV += (P∘Z)ᵀ dO and dK += dSᵀ Qs over the block's query rows (rounded up to a pair: the packs are zero there).
  void add_dv_dk(const Plan& p, int64_t g, int64_t q0, int64_t rows, int64_t cols, const float* pz, const float* ds,
                 float* dv_acc, float* dk_acc, int64_t diag) {
    const int64_t cols_pad = round_up(cols, kNR), rows_even = round_up(rows, 2), Dp = p.Dp;
    const Trim k_begin = p.options.causal ? Trim::KBegin : Trim::None;
    tile_pair_rows(pz, rows, cols_pad, pairs);
#ifdef QKV_ATTENTION_AMX
    if (amx) {  // transposed (see above); the tiles are zero where masked, so no trim is needed
      block_gemm_amx(Dp, cols_pad, rows_even, do_t + g * head + q0, p.Tq_pad, pairs, 2 * kBc, dv_acc, kBc, true,
                     Trim::None, 0, 0);
      tile_pair_rows(ds, rows, cols_pad, pairs);
      block_gemm_amx(Dp, cols_pad, rows_even, qs_t + g * head + q0, p.Tq_pad, pairs, 2 * kBc, dk_acc, kBc, true,
                     Trim::None, 0, 0);
      return;
    }
#endif
    block_gemm_bf16(cols, Dp, rows_even, pairs, 2, 2 * kBc, do_pairs + g * head + q0 * Dp, 2 * Dp, dv_acc, Dp, true,
                    k_begin, diag, p.band());
    tile_pair_rows(ds, rows, cols_pad, pairs);
    block_gemm_bf16(cols, Dp, rows_even, pairs, 2, 2 * kBc, qs_pairs + g * head + q0 * Dp, 2 * Dp, dk_acc, Dp, true,
                    k_begin, diag, p.band());
  }
  void add_dq(const Plan& p, int64_t rows, int64_t k0, int64_t cols_pad, const float* ds, float* dq_acc, int64_t diag) {
    for (int64_t r = 0; r < rows; ++r) to_bf16_scaled(ds + r * kBc, cols_pad, cols_pad, 1.0f, dsb + r * kBc);
    block_gemm_bf16(rows, p.Dp, cols_pad, dsb, kBc, 2, kp + k0 * p.Dp, 2 * p.Dp, dq_acc, p.Dp, true,
                    p.options.causal ? Trim::KEnd : Trim::None, diag, p.band());
  }
  void store(const Plan& p, int64_t bkv, int64_t k0, int64_t cols, const float* dk_acc, const float* dv_acc, float* dk,
             float* dv) {
#ifdef QKV_ATTENTION_AMX
    if (amx) {
      float* turned = turned_buf.get(static_cast<size_t>(2 * kBc * p.Dp));
      transpose_block(dk_acc, p.dims.D, cols, kBc, turned, p.Dp);
      transpose_block(dv_acc, p.dims.D, cols, kBc, turned + kBc * p.Dp, p.Dp);
      return store_key_block(p, bkv, k0, cols, turned, turned + kBc * p.Dp, dk, dv);
    }
#endif
    store_key_block(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
  }
};
#endif

// For query block (q0, rows) of query head g of the group × key block (k0, cols): P (or P∘Z when `dropped`) into pz
// and dS into ds, both (rows × kBc), zero outside the visible region. With soft-capping, S is capped before the
// exponential and dS carries its derivative: d(cap·tanh(s/cap))/ds = 1 − (capped / cap)².
template <typename Group>
void probabilities_and_dscores(const Plan& p, Group& group, int64_t g, const float* lse_head, const float* delta_head,
                               int64_t bh, int64_t q0, int64_t rows, int64_t k0, int64_t cols, float* pz, float* ds) {
  const int64_t cols_pad = round_up(cols, kNR);
  group.scores(p, g, q0, rows, k0, cols_pad, pz, ds, p.options.causal ? Trim::Columns : Trim::None,
               q0 + p.offset - k0 + 1);  // S and G
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = q0 + r;
    float* pr = pz + r * kBc;
    float* dr = ds + r * kBc;
    const auto [lo, hi] = p.visible_in_block(i, k0, cols);
    if (hi - lo == 1 && p.visible(i) == 1 && !p.options.sinks) {
      // One key in all, and no sink sharing the softmax: its softmax is exactly 1 whatever the score, so dS = 0 (G − Di
      // is rounding alone: the two dot products dO·V and dO·O come from different loops) and P = 1, as PyTorch has them.
      std::fill_n(pr, cols_pad, 0.0f);
      std::fill_n(dr, cols_pad, 0.0f);
      pr[lo] = 1.0f;
      if (p.dropout) apply_dropout_row(pr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // P ∘ Z for dV
      continue;
    }
    if (!p.dropout && p.softcap == 0.0f) {  // P = exp(S − lse), dS = P ∘ (G − Di) on [lo, hi), zero elsewhere
      if (hi <= lo) {
        std::fill_n(pr, cols_pad, 0.0f);
        std::fill_n(dr, cols_pad, 0.0f);
        continue;
      }
      probabilities_and_dscores_row(pr + lo, dr + lo, hi - lo, cols_pad - lo, lse_head[i], delta_head[i]);
      std::fill_n(pr, lo, 0.0f);
      std::fill_n(dr, lo, 0.0f);
      continue;
    }
    if (hi <= lo) {
      std::fill_n(pr, cols_pad, 0.0f);
      std::fill_n(dr, cols_pad, 0.0f);
      continue;
    }
    p.cap_scores(pr, lo, hi);
    exp_range(pr, pr, lo, hi, cols_pad, lse_head[i]);  // P = exp(S − lse)
    if (p.dropout) apply_dropout_row(dr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // G ∘ Z
    const float di = delta_head[i];
    for (int64_t j = lo; j < hi; ++j) dr[j] = pr[j] * (dr[j] - di);
    if (p.softcap != 0.0f) {
      // pr holds exp(capped − lse); the capped score itself is lse + log P, but recomputing it from S would need S
      // again: take it from P instead, which is exact where P > 0 and irrelevant where P = 0 (dS = 0 there).
      const float inv = 1.0f / p.softcap;
      for (int64_t j = lo; j < hi; ++j) {
        if (pr[j] == 0.0f) continue;
        const float t = (lse_head[i] + std::log(pr[j])) * inv;
        dr[j] *= 1.0f - t * t;
      }
    }
    if (p.dropout) apply_dropout_row(pr, hi, p.options.seed, p.threshold, p.inv_keep, bh, i, k0);  // P ∘ Z for dV
    std::fill(dr, dr + lo, 0.0f);
    std::fill(dr + hi, dr + cols_pad, 0.0f);
  }
}

// One key block (k0) of one K/V head against every query block of every query head of its group that sees it, in
// head order: dK and dV of the block, written to dk and dv; with dq_acc (the group's Tq_pad × Dp accumulators, one
// per query head) also dQ += dS K, so S and dO·Vᵀ are computed once per tile.
template <typename Group>
void key_block_backward(const Plan& p, Group& group, const float* lse, const float* delta, int64_t bkv, int64_t k0,
                        float* pz, float* ds, float* dk_acc, float* dv_acc, float* dq_acc, float* dk, float* dv) {
  const int64_t cols = std::min(kBc, p.dims.Tk - k0), cols_pad = round_up(cols, kNR);
  std::fill_n(dk_acc, kBc * p.Dp, 0.0f);
  std::fill_n(dv_acc, kBc * p.Dp, 0.0f);
  // The query rows that see some key of the block: from the first that sees key k0 to the last that sees its last.
  const int64_t first_row = p.query_begin(k0), end_row = p.query_end(k0 + cols - 1);
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t bh = p.query_head(bkv, g);
    for (int64_t q0 = first_row / p.Br * p.Br; q0 < end_row; q0 += p.Br) {
      const int64_t rows = std::min(p.Br, p.dims.Tq - q0);
      probabilities_and_dscores(p, group, g, lse + bh * p.dims.Tq, delta + bh * p.dims.Tq, bh, q0, rows, k0, cols, pz,
                                ds);
      const int64_t diag = q0 + p.offset - k0 + 1;
      group.add_dv_dk(p, g, q0, rows, cols, pz, ds, dv_acc, dk_acc, diag);  // dV += (P∘Z)ᵀ dO, dK += dSᵀ Qs
      if (dq_acc) group.add_dq(p, rows, k0, cols_pad, ds, dq_acc + g * p.Tq_pad * p.Dp + q0 * p.Dp, diag);  // dQ += dS K
    }
  }
  group.store(p, bkv, k0, cols, dk_acc, dv_acc, dk, dv);
}

template <typename Group>
void backward_blocks(const Plan& p, const float* q, const float* k, const float* v, const float* lse,
                     const float* delta, const float* d_o, float* dq, float* dk, float* dv) {
  const AttentionDims& dims = p.dims;
  const int64_t D = dims.D, Dp = p.Dp, units = dims.B * p.kv_heads;
  // Per thread: the group's packs, the P and dS tiles, up to two block accumulators, and with whole groups per
  // thread the group's dQ accumulators.
  struct Workspace {
    Group group;
    Scratch pz_buf, ds_buf, acc_a, acc_b, dq_buf;
    float *pz, *ds;
    void reserve(const Plan& p, bool whole_groups) {
      group.reserve(p, true);
      pz = pz_buf.get(static_cast<size_t>(p.Br * kBc));
      ds = ds_buf.get(static_cast<size_t>(p.Br * kBc));
      acc_a.get(static_cast<size_t>(std::max(kBc, p.Br) * p.Dp));
      acc_b.get(static_cast<size_t>(kBc * p.Dp));
      if (whole_groups) dq_buf.get(static_cast<size_t>(p.group * p.Tq_pad * p.Dp));
    }
  };

  // One pass when every thread can own whole K/V groups: for each key block, each query block of each head of the
  // group that sees it gives S = QKᵀ and dP = dO Vᵀ once, and from them dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K —
  // five products instead of the two-pass scheme's seven — with dQ accumulated in the thread's own buffers. A group
  // is computed by one thread from start to end, so the bits do not depend on the number of threads.
  const int threads = p.threads();
  const bool whole_groups = units >= threads && (units % threads == 0 || units >= 4 * threads);
  auto spaces = workspaces<Workspace>(threads, p, whole_groups);
  if (whole_groups) {
#pragma omp parallel num_threads(threads)
    {
      Workspace& ws = spaces[static_cast<size_t>(omp_get_thread_num())];
      float* dq_acc = ws.dq_buf.get(static_cast<size_t>(p.group * p.Tq_pad * Dp));
#pragma omp for schedule(dynamic, 1)
      for (int64_t bkv = 0; bkv < units; ++bkv) {
        ws.group.pack(p, q, k, v, d_o, bkv, true);
        float* dk_acc = ws.acc_a.get(static_cast<size_t>(kBc * Dp));
        float* dv_acc = ws.acc_b.get(static_cast<size_t>(kBc * Dp));
        std::fill_n(dq_acc, p.group * p.Tq_pad * Dp, 0.0f);
        for (int64_t k0 = 0; k0 < dims.Tk; k0 += kBc)
          key_block_backward(p, ws.group, lse, delta, bkv, k0, ws.pz, ws.ds, dk_acc, dv_acc, dq_acc, dk, dv);
        for (int64_t g = 0; g < p.group; ++g) {
          const int64_t bh = p.query_head(bkv, g);
          for (int64_t i = 0; i < dims.Tq; ++i)
            scaled_copy(dq_acc + g * p.Tq_pad * Dp + i * Dp, p.row(dq, p.layout.q, bh, i), D, p.scale);
        }
      }
    }
    return;
  }

  // Fewer groups than threads: two passes that split each group by blocks. Pass 1: dK and dV, one key block per item.
  parallel_items(spaces, units, p.k_blocks, [&](Workspace& ws, int64_t bkv, int64_t kb, bool new_group) {
    if (new_group) ws.group.pack(p, q, k, v, d_o, bkv, false);
    key_block_backward(p, ws.group, lse, delta, bkv, kb * kBc, ws.pz, ws.ds, ws.acc_a.get(static_cast<size_t>(kBc * Dp)),
                       ws.acc_b.get(static_cast<size_t>(kBc * Dp)), nullptr, dk, dv);
  });

  // Pass 2: dQ, one query block (of every head of the group) per item.
  parallel_items(spaces, units, p.q_blocks, [&](Workspace& ws, int64_t bkv, int64_t qb, bool new_group) {
    if (new_group) ws.group.pack(p, q, k, v, d_o, bkv, true);
    Group& group = ws.group;
    float *pz = ws.pz, *ds = ws.ds;
    float* dq_acc = ws.acc_a.get(static_cast<size_t>(p.Br * Dp));
    const int64_t q0 = qb * p.Br, rows = std::min(p.Br, dims.Tq - q0);
    const int64_t key_end = p.key_end(q0 + rows - 1);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t bh = p.query_head(bkv, g);
      std::fill_n(dq_acc, rows * Dp, 0.0f);
      for (int64_t k0 = p.first_key_block(q0); k0 < key_end; k0 += kBc) {
        const int64_t cols = std::min(kBc, dims.Tk - k0), cols_pad = round_up(cols, kNR);
        probabilities_and_dscores(p, group, g, lse + bh * dims.Tq, delta + bh * dims.Tq, bh, q0, rows, k0, cols, pz, ds);
        group.add_dq(p, rows, k0, cols_pad, ds, dq_acc, q0 + p.offset - k0 + 1);  // dQ += dS K
      }
      for (int64_t r = 0; r < rows; ++r) scaled_copy(dq_acc + r * Dp, p.row(dq, p.layout.q, bh, q0 + r), D, p.scale);
    }
  });
}

}  // namespace

void attention_backward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                        const float* q, const float* k, const float* v, const float* o, const float* lse,
                        const float* d_o, float* dq, float* dk, float* dv) {
  if (dims.B <= 0 || dims.H <= 0) return;
  const Plan p(dims, layout, options);
  const int64_t D = dims.D, heads = dims.B * dims.H, units = dims.B * p.kv_heads;
  if (dims.Tq <= 0 || dims.Tk <= 0 || D <= 0) {
    for (int64_t bh = 0; bh < heads; ++bh)
      for (int64_t t = 0; t < dims.Tq; ++t) std::fill_n(p.row(dq, layout.q, bh, t), D, 0.0f);
    for (int64_t bkv = 0; bkv < units; ++bkv)
      for (int64_t t = 0; t < dims.Tk; ++t) {
        std::fill_n(p.kv_row(dk, layout.k, bkv, t), D, 0.0f);
        std::fill_n(p.kv_row(dv, layout.v, bkv, t), D, 0.0f);
      }
    return;
  }
  // Di = rowsum(dO ∘ O), one per query row; with bf16 products from dO as they round it, so that dS = P ∘ (G − Di)
  // is zero where it should be (one visible key: G = Di exactly), not bf16's rounding error.
  [[maybe_unused]] const bool bf16 = options.bf16 && attention_bf16_available();  // read only where bf16 is built
  Scratch delta_buf;
  float* delta = delta_buf.get(static_cast<size_t>(heads * dims.Tq));
#pragma omp parallel for num_threads(p.threads()) schedule(static)
  for (int64_t row = 0; row < heads * dims.Tq; ++row) {
    const int64_t bh = row / dims.Tq, i = row % dims.Tq;
    const float* d_o_row = p.row(d_o, layout.o, bh, i);
    const float* o_row = p.row(o, layout.o, bh, i);
#ifdef QKV_ATTENTION_BF16
    if (bf16) {
      delta[row] = dot_rounded_bf16(d_o_row, o_row, D);
      continue;
    }
#endif
    delta[row] = simd::dot(d_o_row, o_row, D);
  }

#ifdef QKV_ATTENTION_BF16
  if (bf16) return backward_blocks<BackwardBf16>(p, q, k, v, lse, delta, d_o, dq, dk, dv);
#endif
  backward_blocks<BackwardF32>(p, q, k, v, lse, delta, d_o, dq, dk, dv);
}

}  // namespace qkv::kernels
