// The mixture-of-experts feed-forward layer (Qwen3-MoE, Mixtral, the book's ch04/07_moe) as one kernel, forward and
// backward, beside its double-precision reference: a router picks k of E SwiGLU experts per token and the layer
// returns their outputs weighted by the router. Tokens are grouped by expert, so each expert runs one product over
// its tokens. Pure compute on raw pointers; the autograd op is core/ops_moe.cpp. Routers: Qwen3-MoE's softmax then
// top-k, DeepSeek-V3's grouped sigmoid, gpt-oss's top-k then softmax with a bias. Experts: one tensor per expert and
// projection (Qwen3-MoE, DeepSeek-V3), or a layer's experts stacked with biases (gpt-oss, MoeStacked); SwiGLU, or
// gpt-oss's clamped SwiGLU. Not here: DeepSeek-V3's shared experts (a dense SwiGLU beside this, nn/decoder.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/kernels/weights.hpp"

namespace qkv::kernels {

// N tokens of C channels; E experts, each a SwiGLU of inner width F (moe_intermediate_size); k experts per token
struct MoeDims {
  int64_t N = 0, C = 0, F = 0, E = 0, k = 0;  // tokens, channels, expert hidden width, experts, experts per token
};

// How the router turns a token's logits z = Wr·x (E) into its k experts and their weights
struct MoeOptions {
  // Softmax over all E logits, then the k largest probabilities (ties: the lower expert first, as torch.topk gives
  // in practice); with norm_topk_prob those k are divided by their sum (Qwen3-MoE's norm_topk_prob, Mixtral always),
  // otherwise they are used as they are (Qwen2-MoE, Qwen3-MoE with norm_topk_prob false).
  bool norm_topk_prob = true;
  // DeepSeek-V3's router (DeepseekV3TopkRouter) instead of the softmax: scores p = sigmoid(z); the choice reads
  // p + selection_bias (e_score_correction_bias, E values; null: 0) and only that: the E experts fall in `groups`
  // groups, each group scored by the sum of its two best choice values, the best `groups_kept` groups kept (the
  // others' choice values become 0, as transformers' masked_fill does), then the k best; the weights are p of the
  // chosen (divided by their sum + 1e-20 with norm_topk_prob), times `scaling` (routed_scaling_factor).
  bool sigmoid = false;
  const float* selection_bias = nullptr;
  int64_t groups = 1, groups_kept = 1;  // n_group, topk_group
  float scaling = 1.0f;                 // routed_scaling_factor (the softmax router: 1)
  // gpt-oss's router (GptOssTopKRouter) instead: the k largest logits z (+ the router's bias, an input with a
  // gradient), their weights the softmax of those k alone (norm_topk_prob has nothing left to do).
  bool top_k_then_softmax = false;
  // gpt-oss's clamped SwiGLU (swiglu_limit > 0): g ← min(g, limit), u ← clamp(u, −limit, limit),
  // h = g·σ(alpha·g)·(u + 1); 0: SwiGLU, h = silu(g)·u.
  float swiglu_limit = 0.0f, swiglu_alpha = 1.702f;
};

// LoRA on a layer's stacked experts, in PEFT's layout for a parameter of E experts (lora.ParamWrapper with
// target_parameters): expert e's x·W_e (W_e in × out) becomes x·W_e + scale·(x A_eᵀ) B_eᵀ, where A (r·E × in) holds A_e
// (r × in) in rows e·r … e·r + r − 1 and B (out × r·E) holds B_e (out × r) in columns e, e + E, e + 2E … (the expert
// index fastest, as PEFT's reshape (out, r, E) reads them). gate_up's outputs are its 2F alternating gate and up
// columns (in × out = C × 2F), down's C (F × C). A part whose A is null has no update.
struct MoeStackedLora {
  const float* gate_up_a = nullptr;  // (r·E, C)
  const float* gate_up_b = nullptr;  // (2F, r·E)
  int64_t gate_up_rank = 0;          // r, per expert
  float gate_up_scale = 0.0f;        // alpha / r
  const float* down_a = nullptr;     // (r·E, F)
  const float* down_b = nullptr;     // (C, r·E)
  int64_t down_rank = 0;             // r, per expert
  float down_scale = 0.0f;           // alpha / r
};
// Their gradients, same shapes (overwritten; an expert no token chose gets zeros); a null pointer: not needed.
struct MoeStackedLoraGrads {
  float* gate_up_a = nullptr;  // (r·E, C)
  float* gate_up_b = nullptr;  // (2F, r·E)
  float* down_a = nullptr;     // (r·E, F)
  float* down_b = nullptr;     // (C, r·E)
};

// LoRA on experts kept one tensor per expert and projection (Qwen3-MoE, DeepSeek-V3, Qwen3-Next; PEFT's lora.Linear
// on mlp.experts.N.gate_proj …): expert e's gate x becomes W_e x + scale·B_e (A_e x), A_e (r × in), B_e (out × r),
// pointers per expert (null: that expert's projection has none), one rank and scale per projection.
struct MoeLoraList {
  const float* const* a = nullptr;  // E pointers to (r, in)
  const float* const* b = nullptr;  // E pointers to (out, r)
  int64_t rank = 0;                  // r (0: no adapter on this projection)
  float scale = 0.0f;                // alpha / r
};
// The adapters of a layer's three projections
struct MoeExpertLora {
  MoeLoraList gate, up, down;  // gate, up: C → F; down: F → C
};
// Their gradients (overwritten; zeros for an expert no token chose), E pointers each, null where not needed
struct MoeExpertLoraGrads {
  float* const* gate_a = nullptr;  // E pointers to (r, C)
  float* const* gate_b = nullptr;  // E pointers to (F, r)
  float* const* up_a = nullptr;    // (r, C) each
  float* const* up_b = nullptr;    // (F, r) each
  float* const* down_a = nullptr;  // (r, F) each
  float* const* down_b = nullptr;  // (C, r) each
};

// A layer's experts stacked as gpt-oss's checkpoints store them (GptOssExperts), each used as x·W: gate_up
// (E, C, 2F) whose columns alternate gate and up (gate = [..., 0::2], up = [..., 1::2]), gate_up_bias (E, 2F) in the
// same order, down (E, F, C), down_bias (E, C) added to each expert's output before its weight.
struct MoeStacked {
  const float* gate_up = nullptr;       // (E, C, 2F)
  const float* gate_up_bias = nullptr;  // (E, 2F); null: none
  const float* down = nullptr;          // (E, F, C)
  const float* down_bias = nullptr;     // (E, C); null: none
  const MoeStackedLora* lora = nullptr;  // adapters on gate_up and down (null: none)
};
// The same experts kept as their files store them, for inference (gpt-oss's published checkpoints and GGUF files hold
// them as MXFP4; any storage type works): per expert the rows of x·W's outputs — gate_up (2F × C), row 2f gate f and
// row 2f + 1 up f (the order of the checkpoints' gate_up_proj_blocks), down (C × F) — one WeightView each, and the
// float32 biases as in MoeStacked.
struct MoeStackedStored {
  const WeightView* gate_up = nullptr;  // E views of 2F × C
  const float* gate_up_bias = nullptr;  // (E, 2F); null: none
  const WeightView* down = nullptr;     // E views of C × F
  const float* down_bias = nullptr;     // (E, C); null: none
  const MoeStackedLora* lora = nullptr;  // adapters on gate_up and down, in float32 (null: none): QLoRA on the experts
};
// Their gradients, same shapes; a null pointer: not needed.
struct MoeStackedGrads {
  float* gate_up = nullptr;       // (E, C, 2F)
  float* gate_up_bias = nullptr;  // (E, 2F)
  float* down = nullptr;          // (E, F, C)
  float* down_bias = nullptr;     // (E, C)
  MoeStackedLoraGrads lora;       // the adapters' (with MoeStacked::lora or MoeStackedStored::lora)
};

// What the forward keeps for the backward (sized by moe_forward): the routing and each expert's activations, in
// grouped order — slot (token t, choice s) sits at row position[t·k + s] of its expert's contiguous group.
struct MoeSaved {
  std::vector<float> probs;          // (N, E) the router's softmax (sigmoid; top_k_then_softmax: its logits)
  std::vector<int32_t> experts;      // (N, k) chosen experts, by falling probability
  std::vector<float> weights;        // (N, k) their weights (renormalised with norm_topk_prob)
  std::vector<int64_t> offsets;      // (E + 1) expert e's rows are [offsets[e], offsets[e + 1]) of the grouped order
  std::vector<int64_t> token_of;     // (N·k) the token of each grouped row
  std::vector<int64_t> position;     // (N·k) the grouped row of slot t·k + s
  std::vector<float> gate, up;       // (N·k, F) gate x and up x per grouped row, before SiLU and the product
  std::vector<float> y;              // (N·k, C) each grouped row's expert output, before its weight
};

// out (N, C) = Σ_s weight[t, s] · down_e(silu(gate_e x_t) ∘ up_e x_t), e = experts[t, s].
// x (N, C); router (E, C); gate[e] and up[e] (F, C); down[e] (C, F): one pointer per expert, so each may live in
// its own tensor. Threads: the products run on gemm's threads; rows are summed in a fixed order, so results do not
// depend on the thread count.
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const float* const* gate, const float* const* up, const float* const* down, float* out,
                 MoeSaved& saved);
// Writes (overwrites) dx (N, C), d_router (E, C) and each expert's d_gate[e], d_up[e] (F, C), d_down[e] (C, F) (an
// expert no token chose gets zeros). Any output pointer (or the d_gate/d_up/d_down arrays) may be null: not needed.
// Through the router: with norm_topk_prob, w_s = p_s / S (S = Σ_r p_r over the chosen), so
// dp_s = (a·dw_s − Σ_r w_r dw_r) / S on the chosen (a: the scaling) and 0 elsewhere; then the softmax's
// dz = p ∘ (dp − p·dp), or the sigmoid's dz = dp ∘ p ∘ (1 − p). The selection bias gets no gradient (it only chooses).
void moe_backward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                  const float* const* gate, const float* const* up, const float* const* down, const MoeSaved& saved,
                  const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                  float* const* d_down);
// The same with LoRA on the experts (`lora`, given to the forward too): their update a rank-r side path beside each
// chosen expert's products, no expert's weight formed; their gradients into `d_lora`.
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const float* const* gate, const float* const* up, const float* const* down, const MoeExpertLora& lora,
                 float* out, MoeSaved& saved);
void moe_backward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                  const float* const* gate, const float* const* up, const float* const* down, const MoeExpertLora& lora,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, float* const* d_gate,
                  float* const* d_up, float* const* d_down, const MoeExpertLoraGrads& d_lora);

// The forward for inference with each expert's matrices kept as stored — bf16, f16 or a block format (a GGUF's q8_0,
// q4_K …), one WeightView per expert: gate[e] and up[e] F × C, down[e] C × F. Each chosen expert's rows are multiplied
// in place by gemm_weight (activations quantized to 8-bit blocks for the block types, as in a Linear layer's), none
// widened to float32. Routing and the fixed order of the sums are the float32 forward's. No backward: frozen weights.
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const WeightView* gate, const WeightView* up, const WeightView* down, float* out, MoeSaved& saved);
// … with LoRA on those frozen experts (QLoRA on a GGUF's or --weights' experts), and its backward: dx through the
// stored rows (gemm_weight_backward), the router and the adapters, never the stored matrices.
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const WeightView* gate, const WeightView* up, const WeightView* down, const MoeExpertLora& lora,
                 float* out, MoeSaved& saved);
void moe_backward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                  const WeightView* gate, const WeightView* up, const WeightView* down, const MoeExpertLora& lora,
                  const MoeSaved& saved, const float* d_out, float* dx, float* d_router, const MoeExpertLoraGrads& d_lora);

// The same with a router bias (E; null: none, then d_router_bias is ignored) and a layer's experts stacked (gpt-oss).
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const float* router_bias, const MoeStacked& experts, float* out, MoeSaved& saved);
// … and with those experts stored: each chosen expert's rows multiplied in place by gemm_weight, as for
// one-tensor-per-expert stored weights. Their backward reaches x (through the frozen rows, gemm_weight_backward), the
// router, its bias, the experts' biases and their LoRA adapters, never the stored matrices (d_experts.gate_up and
// .down are ignored): LoRA on attention, or on the experts themselves, over frozen MXFP4 experts.
void moe_forward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                 const float* router_bias, const MoeStackedStored& experts, float* out, MoeSaved& saved);
void moe_backward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                  const float* router_bias, const MoeStackedStored& experts, const MoeSaved& saved, const float* d_out,
                  float* dx, float* d_router, float* d_router_bias, const MoeStackedGrads& d_experts);
void moe_backward(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                  const float* router_bias, const MoeStacked& experts, const MoeSaved& saved, const float* d_out,
                  float* dx, float* d_router, float* d_router_bias, const MoeStackedGrads& d_experts);

// The plain composition per token in double, from the definition: route, then each chosen expert on the token
// alone. Same arguments (no saved state).
void moe_forward_reference(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                           const float* const* gate, const float* const* up, const float* const* down, float* out,
                           const MoeExpertLora* lora = nullptr);
void moe_backward_reference(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                            const float* const* gate, const float* const* up, const float* const* down,
                            const float* d_out, float* dx, float* d_router, float* const* d_gate, float* const* d_up,
                            float* const* d_down, const MoeExpertLora* lora = nullptr,
                            const MoeExpertLoraGrads& d_lora = {});
void moe_forward_reference(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                           const float* router_bias, const MoeStacked& experts, float* out);
void moe_backward_reference(const MoeDims& dims, const MoeOptions& options, const float* x, const float* router,
                            const float* router_bias, const MoeStacked& experts, const float* d_out, float* dx,
                            float* d_router, float* d_router_bias, const MoeStackedGrads& d_experts);

}  // namespace qkv::kernels
