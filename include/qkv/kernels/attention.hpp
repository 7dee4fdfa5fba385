// The fused scaled-dot-product attention kernel (FlashAttention-2 style) and its double-precision reference.
// Pure compute on raw float pointers; the autograd op in core/ops_sdpa.cpp wraps it. Thread-safe: calls may run
// concurrently on different outputs.
#pragma once

#include <cstdint>

namespace qkv::kernels {

// ---- fused scaled-dot-product attention (FlashAttention-2 style) ----
//
// For every batch b and head h:  O = softmax(scale · Q Kᵀ + mask) V, with optional dropout on the
// softmax weights. Q is (Tq, D), K and V are (Tk, D), O is (Tq, D); the rows of each are D contiguous
// floats, and where they sit is given by strides, so the projections' (B, T, H·D) layout is read
// directly (token stride H·D, head stride D) as well as (B, H, T, D) (token stride D, head stride T·D).
//
// The forward pass never stores a Tq×Tk matrix: it walks key blocks with an online softmax and keeps
// one log-sum-exp per query row. The backward pass recomputes the probabilities tile by tile from that
// log-sum-exp. Threads own output rows (query blocks for O and dQ, key blocks for dK and dV); there
// are no atomics, and results do not depend on the number of threads.

// H query heads share H_kv key/value heads (grouped-query attention; H_kv = 1 is multi-query): query head h reads
// K/V head h / (H / H_kv), in place. H_kv = 0 means H (ordinary multi-head attention). H_kv must divide H.
struct AttentionDims {
  // batch, query heads, query and key tokens, head width, K/V heads (0: H)
  int64_t B = 1, H = 1, Tq = 0, Tk = 0, D = 0, H_kv = 0;
  // K/V heads (H when H_kv is 0)
  int64_t kv_heads() const { return H_kv > 0 ? H_kv : H; }
  int64_t group() const { return H / kv_heads(); }  // query heads per K/V head
};

// Strides in floats between consecutive batches, heads and tokens of one tensor.
struct AttentionStrides {
  int64_t batch = 0, head = 0, token = 0;  // floats between consecutive batches, heads and tokens
  // (B, T, H·D): the layout Linear projections produce.
  static AttentionStrides btc(const AttentionDims& d, int64_t T) { return btc(d.H, d.D, T); }
  static AttentionStrides btc(int64_t heads, int64_t D, int64_t T) { return {T * heads * D, D, heads * D}; }
  // (B, H, T, D)
  static AttentionStrides bhtd(const AttentionDims& d, int64_t T) { return bhtd(d.H, d.D, T); }
  static AttentionStrides bhtd(int64_t heads, int64_t D, int64_t T) { return {heads * T * D, T * D, D}; }
};

// What the fused attention computes besides softmax(QKᵀ·scale)V
struct AttentionOptions {
  bool causal = false;     // key j is visible to query i iff j ≤ i + (Tk − Tq)
  // Sliding window (Mistral, Gemma 3's local layers; Hugging Face's `sliding_window`): with window W > 0, key j is
  // visible to query i only if also j > i + (Tk − Tq) − W, i.e. a query sees itself and the W − 1 keys before it.
  // Key blocks wholly outside every row's window are skipped, so the cost grows as Tq·W, not Tq·Tk. 0: no window.
  int64_t window = 0;
  float scale = 0.0f;      // 0 means 1/√D (Gemma 3: query_pre_attn_scalar^−½)
  // Logit soft-capping (Gemma 2's attn_logit_softcapping): scores s = scale·q·k become cap·tanh(s / cap) before the
  // softmax. 0: none.
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): one learned logit per query head, sinks[h], joins every row's softmax denominator
  // and carries no value: P_ij = exp(s_ij) / (Σ_l exp(s_il) + exp(sink_h)), so a row may give less than all its
  // weight to the keys (a row with no visible key gives O = 0, not NaN). lse then includes the sink, and the
  // backward needs nothing else for dQ, dK, dV; the sink's own gradient is attention_sink_backward's. nullptr: none.
  const float* sinks = nullptr;
  float dropout_p = 0.0f;  // on the softmax weights; kept ones are scaled by 1/(1 − p)
  uint64_t seed = 0;       // dropout stream: element (b·H + h, i, j) is a pure function of the seed
  int threads = 0;         // 0: OpenMP's default
  // bf16 products (autocast): Q·scale, K, V, dO and the tiles of P and dS rounded to bf16 (nearest even) and multiplied
  // with AMX tiles or VDPBF16PS (attention_bf16_products()), every sum, the online softmax, the log-sum-exp and the outputs in float32. Only where
  // attention_bf16_available(); elsewhere the flag is ignored and the products stay float32.
  bool bf16 = false;
};

// The strides of the four tensors a fused attention call reads and writes
struct AttentionLayout {
  AttentionStrides q, k, v, o;  // dQ, dK, dV, dO use the strides of Q, K, V, O
};

// q, o (and dq, dO): (Tq, D) rows per (b, h), h < H; k, v (and dk, dv): (Tk, D) rows per (b, h_kv), h_kv < H_kv. With
// H_kv < H the backward sums dK and dV over each group of query heads in head order, so its bits are fixed.
// o: (Tq, D) rows per (b, h); lse: (B, H, Tq) contiguous, natural-log log-sum-exp of the scaled scores.
// A query row with no visible key (only when Tq > Tk with causal) gets NaN, like PyTorch.
void attention_forward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                       const float* q, const float* k, const float* v, float* o, float* lse);
// The forward with K and V held in bf16 (a bf16 KV cache; strides in elements): bf16 products as options.bf16 gives
// them, K and V read as they are. Where attention_bf16_available() is false, K and V are widened (exactly) to float32
// and the float32 kernel runs. Inference only: there is no backward for it.
void attention_forward_bf16_kv(const AttentionDims& dims, const AttentionLayout& layout,
                               const AttentionOptions& options, const float* q, const uint16_t* k, const uint16_t* v,
                               float* o, float* lse);
// The attention weights of one head, recomputed from q, k and the forward's lse instead of stored:
// out (Tq × Tk, row stride Tk) = exp(scale · q_i · k_j − lse_i) where key j is visible to query i, 0 elsewhere
// (before dropout). Memory is O(Tq·Tk) for the asked head only; rows in parallel.
void attention_probabilities(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                             const float* q, const float* k, const float* lse, int64_t b, int64_t h, float* out);
// Writes (overwrites) dq, dk, dv from dO, using the forward's o and lse.
void attention_backward(const AttentionDims& dims, const AttentionLayout& layout, const AttentionOptions& options,
                        const float* q, const float* k, const float* v, const float* o, const float* lse,
                        const float* d_o, float* dq, float* dk, float* dv);

// The plain composition, materialising scores and weights, in double: the reference the fused kernel
// is tested against. Same arguments; dropout uses the same keep decisions (attention_dropout_keep). With options.bf16
// the operands are first rounded as the kernel rounds them (Q·scale, K, V, dO to bf16); the kernel's rounding of the
// P and dS tiles is not modelled, so it agrees with this to bf16's precision (≈ 2⁻⁹ of each sum's magnitude).
void attention_forward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                 const AttentionOptions& options, const float* q, const float* k, const float* v,
                                 float* o);
void attention_backward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                  const AttentionOptions& options, const float* q, const float* k, const float* v,
                                  const float* d_o, float* dq, float* dk, float* dv);

// The gradient of the sink logits (options.sinks, H of them), written to d_sinks (H): with P_sink = exp(sink_h − lse)
// and Di = dO_i · O_i, d sink_h = −Σ_{b,i} P_sink(b,h,i) · Di (the sink carries no value, so its dP is 0). From the
// forward's o and lse; one owner per head, rows summed in order, in float64.
void attention_sink_backward(const AttentionDims& dims, const AttentionLayout& layout, const float* sinks,
                             const float* o, const float* lse, const float* d_o, float* d_sinks);
// The same from the definition (P materialised in double, as attention_backward_reference).
void attention_sink_backward_reference(const AttentionDims& dims, const AttentionLayout& layout,
                                       const AttentionOptions& options, const float* q, const float* k, const float* v,
                                       const float* d_o, float* d_sinks);

// Gated attention (Qwen3-Next, Qwen3.5): out = O ∘ sigmoid(G), per token and head. O and out: (rows, H·D)
// contiguous; G's D values of head h of row r at gate + r·gate_row + h·gate_head (Qwen3-Next reads them in place from
// its doubled q projection: gate_row = 2·H·D, gate_head = 2·D, gate = projection + D).
void attention_gate_forward(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate, int64_t gate_row,
                            int64_t gate_head, float* out);
// d_o = dout ∘ σ(G), d_gate = dout ∘ O ∘ σ(G)(1 − σ(G)) (written at the gate's strides; other elements untouched).
void attention_gate_backward(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate, int64_t gate_row,
                             int64_t gate_head, const float* d_out, float* d_o, float* d_gate);
// Both in double from the definition.
void attention_gate_forward_reference(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate,
                                      int64_t gate_row, int64_t gate_head, float* out);
void attention_gate_backward_reference(int64_t rows, int64_t H, int64_t D, const float* o, const float* gate,
                                       int64_t gate_row, int64_t gate_head, const float* d_out, float* d_o,
                                       float* d_gate);

// Whether dropout keeps weight (bh, i, j): a counter-based hash (murmur3's finalizer) of (seed, bh, i, j).
bool attention_dropout_keep(uint64_t seed, float p, int64_t bh, int64_t i, int64_t j);

// Whether options.bf16 takes effect: a build with AVX512_BF16 (-march=native on such a CPU), running on one.
bool attention_bf16_available();
// What multiplies bf16 there: "AMX tiles (TDPBF16PS)" where amx_bf16_ready(), "VDPBF16PS" elsewhere with
// AVX512_BF16, "none" where attention_bf16_available() is false.
const char* attention_bf16_products();

// Which micro-kernels this build uses: "avx2+fma" or "portable".
const char* attention_isa();

}  // namespace qkv::kernels
