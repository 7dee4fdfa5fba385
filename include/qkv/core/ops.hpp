// Differentiable operations on Tensors. Each records itself on the tape when an input requires grad;
// its backward sits beside its forward in src/core/ops_*.cpp. Shapes are checked on every call: a mismatch
// throws ShapeError naming the op and both shapes.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/kernels/rope.hpp"

namespace qkv {

class Generator;

// ---- linear algebra ----

// a (M,K) @ b (K,N) → (M,N). Batched: a (...,M,K) @ b (...,K,N) with equal leading dims, or a 2-D b
// shared by every batch entry (x (B,T,C) @ W (C,D)), or a 2-D a applied to every batch entry of b.
Tensor matmul(const Tensor& a, const Tensor& b);
// x (...,in) @ weightᵀ (out,in) + bias (out) → (...,out): torch.nn.functional.linear. bias may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
// A low-rank (LoRA) update of a weight W (out, in): W + scale·B·A with A (rank, in) and B (out, rank), PEFT's layout.
struct LowRankUpdate {
  Tensor a, b;  // A (rank, in) and B (out, rank)
  float scale = 0.0f;  // alpha / rank
  // Whether there is an update
  bool defined() const { return a.defined(); }
  // Its rank r (0 when there is none)
  int64_t rank() const { return a.defined() ? a.size(0) : 0; }
};

// torch.cat([linear(x, w, b) for w, b in zip(weights, biases)], -1) as one product: x (...,in) → (..., Σ out_i).
// biases is empty or has one entry per weight (all defined, or all undefined). When the weights lie one after
// another in one storage (and so do the biases), as ProjectedAttention keeps W_query, W_key and W_value, they
// are read in place as one (Σ out_i, in) matrix; otherwise they are copied together first. Backward: dx from one
// product with the whole matrix, and the weight gradients from one product whose row blocks become each
// weight's gradient.
// With `updates` (empty, or one per weight, undefined where a weight has none), each part gets its low-rank update as
// lora_linear gives it, written into its columns of the one result: the adapted q, k and v of a layer are still one
// tensor, and its gradient still flows back through one product with the stacked weights.
Tensor linear_concat(const Tensor& x, std::span<const Tensor> weights, std::span<const Tensor> biases = {},
                     std::span<const LowRankUpdate> updates = {});
// Whether `parts` lie back to back in one storage, in order (what lets linear_concat read them in place).
bool contiguous_run(std::span<const Tensor> parts);
// linear(x, weight, bias) + scale · (x Aᵀ) Bᵀ: a Linear layer with a low-rank (LoRA) update, A (r, in) and B (out, r) in
// PEFT's layout. One op: the rank-r product u = x Aᵀ is kept for the backward, which forms du = scale · dy B once and
// from it dx = dy W + du A, dA = duᵀ x and dB = scale · dyᵀ u; a frozen W (no requires_grad) costs no dW product.
Tensor lora_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& lora_a, const Tensor& lora_b,
                   float scale);
// Swaps dimensions d0 and d1 (negative counts from the back); the result is a contiguous copy.
Tensor transpose(const Tensor& t, int d0 = -2, int d1 = -1);
// Same values, another shape; one dimension may be -1 (inferred). Shares storage: no copy.
Tensor reshape(const Tensor& t, std::initializer_list<int64_t> dims);
Tensor reshape(const Tensor& t, const Shape& shape);

// ---- elementwise, with broadcasting (NumPy rules: dimensions align from the back; size 1 stretches) ----

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, float b);
Tensor mul(const Tensor& a, float b);
Tensor div(const Tensor& a, float b);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
// σ(a) = 1 / (1 + e^−a) (Gated DeltaNet's β, the shared expert's gate); backward σ(1 − σ) · g.
Tensor sigmoid(const Tensor& a);
// log(1 + e^a), a itself above 20 as torch's softplus (Gated DeltaNet's decay); backward σ(a) · g.
Tensor softplus(const Tensor& a);
// cap · tanh(a / cap) (cap > 0): Gemma 2's soft-capping of the final logits; backward (1 − tanh²(a / cap)) · g.
Tensor soft_cap(const Tensor& a, float cap);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator+(const Tensor& a, float b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, float b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, float b) { return mul(a, b); }
inline Tensor operator*(float a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, float b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }

// The shape NumPy broadcasting gives a and b, or ShapeError naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// ---- reductions and normalisation ----

Tensor sum(const Tensor& t);                                  // all elements → scalar
Tensor sum(const Tensor& t, int dim, bool keepdim = false);
Tensor mean(const Tensor& t);
Tensor mean(const Tensor& t, int dim, bool keepdim = false);
// Softmax along the last dimension, numerically stable (the row max is subtracted first).
Tensor softmax(const Tensor& t);

// Mean cross-entropy of logits (N,V) against class indices (N); rows whose target is ignore_index
// count neither in the loss nor in the mean (torch.nn.functional.cross_entropy).
Tensor cross_entropy(const Tensor& logits, std::span<const int64_t> targets, int64_t ignore_index = -100);
// cross_entropy(linear(x, weight, bias), targets) without the (N, V) logits: x (…, C) flattened to N rows, weight
// (V, C), bias (V) or undefined. Blocks of rows go through the head and the loss together, and when a gradient is
// wanted it is computed in the same pass (kernels::linear_cross_entropy), so the backward only scales it by
// dL/dloss. For a language model's head: it saves the logits, the probabilities and dlogits (3 × N × V floats).
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& bias, std::span<const int64_t> targets,
                            int64_t ignore_index = -100);

// ---- attention helpers ----

// Where mask != 0, the result holds `value`; elsewhere t. mask's shape is a suffix of t's shape
// (it repeats over t's leading dims), e.g. a (T,T) causal mask for (B,H,T,T) scores. mask gets no gradient.
Tensor masked_fill(const Tensor& t, const Tensor& mask, float value);
// The (rows, cols) top-left corner of a 2-D tensor, copied (the book's mask[:T, :T]). No gradient.
Tensor top_left(const Tensor& t, int64_t rows, int64_t cols);
// An upper-triangular (T,T) mask: 1 above the diagonal (the future), 0 on and below it.
Tensor causal_mask(int64_t T);
// Inverted dropout, PyTorch's recipe: in training, keep each element with probability 1 − p (one
// Bernoulli draw per element from `gen`, in row-major order) and scale kept ones by 1/(1 − p). Outside
// training, or with p = 0, the input passes through and no random numbers are drawn. p must lie in [0, 1].
Tensor dropout(const Tensor& t, double p, bool training, Generator& gen);
// Inverted dropout with a counter-based mask (kernels::hashed_dropout) seeded by one draw from `gen`: fast,
// parallel, and the mask is regenerated in backward rather than stored. Its masks differ from
// torch.nn.Dropout's; the decoder uses it for the residual and embedding dropout.
Tensor hashed_dropout(const Tensor& t, double p, bool training, Generator& gen);
// Copies src (B, T, C) into dst (B, capacity, C) at tokens [position, position + T): filling a KV cache (a BF16 dst:
// rounded to bf16).
// Records no gradient.
void write_tokens(const Tensor& src, Tensor& dst, int64_t position);
// Columns [first, first + count) of a 2-D m (rows, cols), transposed: (count, rows). Records no gradient.
Tensor transpose_columns(const Tensor& m, int64_t first, int64_t count);
// Token t of every batch row of x (B, T, C), as (B, C). Records no gradient.
Tensor select_token(const Tensor& x, int64_t t);
// Token positions[b] of batch row b of x (B, T, C), as (B, C): a sequence's pooled state for a classifier head.
// Differentiable (the gradient goes back to the chosen rows only). ShapeError for a position outside [0, T).
Tensor gather_tokens(const Tensor& x, std::span<const int64_t> positions);
// Joins tensors along `dim`; all other dimensions must agree.
Tensor concat(const std::vector<Tensor>& tensors, int dim);
// Columns [start, start + length) of x's last dimension, copied: (…, W) → (…, length), torch.narrow(x, -1, start,
// length). Backward: the gradient lands in those columns. ShapeError when the range leaves [0, W).
Tensor narrow(const Tensor& x, int64_t start, int64_t length);

// ---- GPT building blocks ----

// Rows of weight (V, C) picked by token ids: ids has ids_shape (e.g. (B, T)), the result (…, C).
// An id outside [0, V) is a ValueError naming it. Backward adds each row's gradient into its id's row.
Tensor embedding(const Tensor& weight, std::span<const int64_t> ids, const Shape& ids_shape);
// LayerNorm over the last dimension with the book's names: (x − mean) / √(var + eps) · scale + shift,
// var biased (÷C). scale and shift are (C).
Tensor layer_norm(const Tensor& x, const Tensor& scale, const Tensor& shift, float eps = 1e-5f);
// GELU, tanh approximation (GPT-2's): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
Tensor gelu(const Tensor& x);

// ---- today's decoders: RMSNorm, SiLU, rotary embeddings ----

// The rotation's settings and tables, as the kernels define them (qkv/kernels/rope.hpp).
using RopeLayout = kernels::RopeLayout;
using RopeFrequencies = kernels::RopeFrequencies;
using RopeTable = kernels::RopeTable;

// RMSNorm over the last dimension: x / √(mean(x²) + eps) · (weight + offset); weight is (C). offset 0 is Llama's and
// Qwen's, 1 Gemma's (1 + w).
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps, float offset = 0.0f);
// SiLU (swish): x·σ(x), the gate of SwiGLU.
Tensor silu(const Tensor& x);
// Rotary position embeddings on x (B, T, H·D): token t of every batch row is at position `position + t`, and each of
// its first `rotated_heads` heads (0: all H) is rotated as kernels::rope_apply says (its first 2·table.P values: all D,
// or fewer for a partial rotation); the others pass unchanged (so a
// packed (B, T, (H + 2·H_kv)·D) projection rotates its q and k heads and keeps v). The table must hold position + T
// positions (ShapeError otherwise). Backward: the inverse rotation of the gradient.
Tensor rope(const Tensor& x, std::shared_ptr<const kernels::RopeTable> table, kernels::RopeLayout layout,
            int64_t num_heads, int64_t position = 0, int64_t rotated_heads = 0);

// ---- fused attention ----

// How scaled_dot_product_attention reads its inputs and what it computes: heads, mask, window, scale, dropout
struct AttentionConfig {
  int64_t num_heads = 1;   // for rank-3 inputs (B, T, H·D): how many heads share the channel dimension
  // Key/value heads (grouped-query attention): for the packed input, how many of its heads are K and V heads each;
  // for separate q, k, v it is read from k's shape (0 here: any that divides num_heads), else k must have this many.
  int64_t num_kv_heads = 0;
  bool causal = false;     // key j visible to query i iff j ≤ i + (Tk − Tq)
  int64_t window = 0;      // sliding window: key j also needs j > i + (Tk − Tq) − window (0: none)
  float softcap = 0.0f;    // scores become softcap·tanh(score / softcap) (0: none)
  double dropout_p = 0.0;  // on the attention weights, in training only
  bool training = false;
  Generator* generator = nullptr;  // dropout seed source (one draw per call); default_generator() if null
  float scale = 0.0f;              // 0: 1/√D
  // Only the first kv_tokens tokens of k and v take part (0: all of them). A KV cache keeps keys and values
  // in (B, capacity, H·D) buffers and attends over the filled part; such a call records no gradient.
  int64_t kv_tokens = 0;
  // If set, receives the log-sum-exp of every query row's scaled scores, (B, H, Tq): with q and k it gives
  // the attention weights back without storing them (kernels::attention_probabilities).
  Tensor* lse = nullptr;
  // Attention sinks (gpt-oss): (H) learned logits, one per query head, each joining its rows' softmax denominator
  // with no value (kernels::AttentionOptions::sinks); a sink gets its gradient like any input. Undefined: none.
  Tensor sinks;
};

// softmax(scale · QKᵀ + causal mask) V without materialising the T×T weights (kernels::attention_forward),
// with the fused backward. q (B, Tq, H·D) and k, v (B, Tk, H_kv·D) — read with strides, no transposes — or
// q (B, H, Tq, D) and k, v (B, H_kv, Tk, D); H_kv divides H (grouped-query attention; H_kv = H is multi-head). The result has q's layout. Dropout masks come from a counter-based stream seeded by
// one draw from the generator, so they differ from torch.nn.Dropout's (use the plain path for those).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionConfig& config);
// The same from one (B, T, (H + 2·H_kv)·D) tensor that holds each token's query, key and value side by side (what
// linear_concat of the three projections gives; H_kv = config.num_kv_heads, 0 meaning H): read in place, and its
// gradient written as one tensor, so the three projections' backward is one product too. Result (B, T, H·D). Not
// for a key/value cache (kv_tokens 0).
Tensor scaled_dot_product_attention(const Tensor& qkv, const AttentionConfig& config);

// The attention weights (Tq, Tk) of head h of batch row b, recomputed from q and k (as given to
// scaled_dot_product_attention with the same config) and the log-sum-exp that call saved (config.lse):
// exp(scale·q·kᵀ − lse) where visible, 0 elsewhere, before dropout. Costs one QKᵀ for that head; no gradient.
Tensor attention_weights(const Tensor& q, const Tensor& k, const Tensor& lse, const AttentionConfig& config, int64_t b,
                         int64_t h);

// Gated attention (Qwen3-Next, Qwen3.5): context ∘ sigmoid(gate) per token and head, before the output projection.
// context (B, T, H·D); the gate is read in place from q_and_gate (B, T, H·2D), the doubled q projection whose
// head h holds its D query values then its D gate values (kernels::attention_gate_forward). Gradients reach both.
Tensor attention_output_gate(const Tensor& context, const Tensor& q_and_gate, int64_t num_heads);

// The gated delta rule (Gated DeltaNet's core, the recurrent form; kernels::delta_rule_forward): per head a (Dk × Dv)
// state decayed by e^g, corrected by β (v − Sᵀk) kᵀ and read by q, token by token. q, k (B, T, H, Dk); v (B, T, H,
// Dv); g, beta (B, T, H). Result (B, T, H, Dv). q and k as given (Qwen3-Next L2-normalises them and scales q by
// Dk^−½ first). Gradients reach all five. `initial` (B, H, Dk, Dv), if defined, is the state before the first token
// (a decoding cache; it gets no gradient); `final_state`, if given, receives the state after the last.
Tensor gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& initial = Tensor(), Tensor* final_state = nullptr);
// Gated DeltaNet's causal depthwise convolution (kernels::causal_conv1d_forward): x (B, T, C), weight (C, K) → (B, T,
// C), each channel the weighted sum of its last K inputs. `state` (B, K − 1, C), if defined, holds the inputs before
// x (a decoding cache; zeros otherwise; no gradient). Gradients reach x and the weight.
Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& state = Tensor());

// ---- mixture of experts ----

// A mixture-of-experts layer's router settings (Qwen3-MoE's): softmax over the experts, the top k, optionally
// renormalised.
struct MoeConfig {
  int64_t experts_per_token = 2;  // k (num_experts_per_tok)
  bool norm_topk_prob = true;     // the k weights divided by their sum
  // DeepSeek-V3's router (kernels::MoeOptions::sigmoid): sigmoid scores, the choice over scores + selection_bias
  // (E values, no gradient; undefined: 0) limited to the best groups_kept of `groups` groups, weights times scaling
  bool sigmoid = false;
  Tensor selection_bias;                 // e_score_correction_bias (E), or undefined
  int64_t groups = 1, groups_kept = 1;   // n_group, topk_group
  float scaling = 1.0f;                  // routed_scaling_factor
  // gpt-oss's router (kernels::MoeOptions::top_k_then_softmax): the k largest logits, weighted by their softmax
  bool top_k_then_softmax = false;
  // gpt-oss's clamped SwiGLU (kernels::MoeOptions::swiglu_limit): limit > 0 clamps gate and up; 0: SwiGLU
  float swiglu_limit = 0.0f, swiglu_alpha = 1.702f;
  // If set, receives each token's chosen experts (N·k, by falling weight) and their weights: for pictures of the
  // routing.
  std::vector<int32_t>* chosen = nullptr;
  std::vector<float>* weights = nullptr;  // with chosen: the k weights of each token
};
// The k largest of each of `rows` rows of `cols` values, as torch.topk picks them (the lower index first among
// equals): chosen(row, column) for each, largest first. A router's choice; 1 ≤ k ≤ cols.
void for_each_top_k(const float* values, int64_t rows, int64_t cols, int64_t k,
                    const std::function<void(int64_t, int64_t)>& chosen);
// Σ over the k experts a router picks per token of w · down_e(silu(gate_e x) ∘ up_e x) (kernels::moe_forward): x
// (..., C), router (E, C), gate[e] and up[e] (F, C), down[e] (C, F), one tensor per expert as checkpoints store
// them. Result x's shape. Gradients reach x, the router and every expert (zero for an expert no token chose).
// Experts stored narrow (bf16, a GGUF's block types) are multiplied as stored and frozen: gradients reach x (through
// their rows) and the router (float32), not them.
// `lora`: LoRA on the experts, per projection one LowRankUpdate per expert (or an empty list: none; an undefined one:
// that expert has none), A (r, in), B (out, r), one rank and scale per projection; their update runs beside each
// chosen expert's product (no W + ΔW is formed), over float32 or stored experts alike (QLoRA on the experts).
struct ExpertsLora {
  std::span<const LowRankUpdate> gate;  // E updates on the experts' gate (C → F), or none
  std::span<const LowRankUpdate> up;    // … on their up (C → F)
  std::span<const LowRankUpdate> down;  // … on their down (F → C)
};
Tensor mixture_of_experts(const Tensor& x, const Tensor& router, std::span<const Tensor> gate,
                          std::span<const Tensor> up, std::span<const Tensor> down, const MoeConfig& config,
                          const ExpertsLora& lora = {});
// LoRA on gpt-oss's stacked experts (below), PEFT's target_parameters layout (kernels::MoeStackedLora): for E experts of rank r,
// gate_up's A (r·E, C) and B (2F, r·E), down's A (r·E, F) and B (C, r·E), each update scale·(x A_eᵀ) B_eᵀ added to
// expert e's product as a side path (no expert's weight is formed). Either may be undefined. Gradients reach them
// with the experts stored (MXFP4 …) as well: QLoRA on the experts.
struct StackedExpertsLora {
  LowRankUpdate gate_up;  // A (r·E, C), B (2F, r·E)
  LowRankUpdate down;     // A (r·E, F), B (C, r·E)
};
// The same with gpt-oss's experts (kernels::MoeStacked): a layer's experts in the stacked tensors its checkpoints
// hold, each used as x·W — gate_up (E, C, 2F), gate and up columns alternating; gate_up_bias (E, 2F); down (E, F, C);
// down_bias (E, C) — and a router bias (E). Any bias may be undefined (none). Float32 only; gradients reach all.
// For inference the experts may instead be matrices of their output rows as gpt-oss's files store them (MXFP4, or
// any storage type): gate_up (E·2F, C), row e·2F + 2f expert e's gate f and the next its up f; down (E·C, F). Each
// chosen expert's rows are then multiplied in place (kernels::moe_forward on MoeStackedStored), and gradients reach
// x, the router and the biases (float32 ones), never those frozen matrices: LoRA on attention over MXFP4 experts;
// `lora` (StackedExpertsLora, above) adapts the experts themselves.
Tensor mixture_of_experts(const Tensor& x, const Tensor& router, const Tensor& router_bias, const Tensor& gate_up,
                          const Tensor& gate_up_bias, const Tensor& down, const Tensor& down_bias,
                          const MoeConfig& config, const StackedExpertsLora& lora = {});

}  // namespace qkv
