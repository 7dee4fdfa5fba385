#!/usr/bin/python3
"""Llama 3, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, DeepSeek-V3, gpt-oss, Gemma 3, Mistral, Phi-3, OLMo 2 and 3, SmolLM3 and Gemma 2 in plain PyTorch, written from
the published formulas (Hugging Face transformers' modeling_<family>.py and modeling_rope_utils.py are the
specification; the transformers package is not in Debian), and the tiny random Hugging Face folders the C++ tests
load and compare against.

  /usr/bin/python3 tools/decoder_reference.py [--out tests/fixtures/hf] [--families qwen3_moe …]

Writes, per family, a folder FAMILY/ with config.json and model.safetensors (qwen3's as two shards and
model.safetensors.index.json), and FAMILY.expected.safetensors with the token ids, targets (some -100), logits,
the mean loss, the gradient of every parameter ("grad.<name>") and a greedy continuation of a prompt.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from torch_reference import save_safetensors  # noqa: E402

FAMILIES = {
    # Llama 3.2-style: GQA (4 query heads on 2 K/V heads), llama3 frequency scaling, tied head.
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=16),
                  bos_token_id=1, eos_token_id=[2, 3]),
    # Qwen2: q/k/v biases, multi-query attention, an untied head, a sliding window on the second layer.
    "qwen2": dict(model_type="qwen2", vocab_size=80, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=True,
                  sliding_window=5, max_window_layers=1, eos_token_id=4),
    # Qwen3: q_norm/k_norm per head, head_dim (16) unlike hidden/heads (8), tied; its weights in two shards.
    "qwen3": dict(model_type="qwen3", vocab_size=72, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
                  attention_bias=False, eos_token_id=5),
    # Gemma 3 (text): (1 + w) RMSNorms, four per block, GeGLU, √C embedding scale, query_pre_attn_scalar, two
    # sliding layers (window 4, local RoPE base) then a global one (linear-scaled RoPE).
    "gemma3": dict(model_type="gemma3_text", vocab_size=88, hidden_size=24, intermediate_size=36, num_hidden_layers=3,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling=dict(rope_type="linear", factor=2.0), query_pre_attn_scalar=12,
                   sliding_window=4, sliding_window_pattern=3, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None,
                   eos_token_id=[1, 6]),
    # Mistral: Llama with a sliding window (5) on every layer and no biases.
    "mistral": dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", sliding_window=5,
                    bos_token_id=1, eos_token_id=2),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, half of each head rotated, LongRoPE whose long factors
    # apply once a sequence passes 8 positions (the greedy continuation crosses it).
    "phi3": dict(model_type="phi3", vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 original_max_position_embeddings=8, rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
                 rope_scaling=dict(type="longrope", short_factor=[1.0, 1.5], long_factor=[2.0, 4.0]),
                 tie_word_embeddings=False, hidden_act="silu", sliding_window=None, bos_token_id=1, eos_token_id=7,
                 pad_token_id=7),
    # OLMo 2: no norm before attention or the MLP, one after each; q/k RMSNorm over the whole projection.
    "olmo2": dict(model_type="olmo2", vocab_size=72, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False, hidden_act="silu",
                  pad_token_id=1, eos_token_id=3),
    # OLMo 3: OLMo 2 with layers 0-2 sliding (window 4) on plain RoPE and layer 3 full with YaRN, as trained.
    "olmo3": dict(model_type="olmo3", vocab_size=72, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4, attention_bias=False,
                  rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                                    attention_factor=1.2079441541679836, beta_fast=32.0, beta_slow=1.0),
                  tie_word_embeddings=False, hidden_act="silu", pad_token_id=1, eos_token_id=3),
    # SmolLM3: no RoPE on layer 3 (no_rope_layers 0), tied head.
    "smollm3": dict(model_type="smollm3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                    rope_theta=2000000.0, no_rope_layers=[1, 1, 1, 0], use_sliding_window=False,
                    tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
                    bos_token_id=1, eos_token_id=2),
    # Gemma 2: four (1 + w) norms a block, layers 0 and 2 sliding (window 4), attention and final logits soft-capped
    # (small caps, so that tanh bends these tiny models' logits).
    "gemma2": dict(model_type="gemma2", vocab_size=88, hidden_size=24, intermediate_size=36, num_hidden_layers=3,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                   rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=12, sliding_window=4,
                   hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   tie_word_embeddings=True, eos_token_id=1, bos_token_id=2, pad_token_id=0),
    # Qwen3-MoE: Qwen3's attention; layers 0 and 2 a mixture of 4 SwiGLU experts (top-2, renormalised), layer 1 dense
    # (mlp_only_layers); an untied head; the routers' load-balancing loss in the loss (output_router_logits).
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=72, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu",
                      attention_bias=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], eos_token_id=5,
                      output_router_logits=True, router_aux_loss_coef=0.05),
    # DeepSeek-V3: multi-head latent attention (q through a rank-12 path, a rank-16 KV latent, 8 + 4 query/key values
    # per head, 6 values, the 4 rotated ones interleaved), YaRN with mscale_all_dim (the softmax scale × mscale²);
    # layer 0 dense (first_k_dense_replace), layers 1-2 a sigmoid router over 8 experts in 4 groups (the best 2
    # kept), top-2 renormalised × 2.5, one shared expert. rms_norm_eps 1e-5 (the latent norms keep their 1e-6).
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=72, hidden_size=32, intermediate_size=40,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                        attention_bias=False, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                          mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0),
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        moe_intermediate_size=10, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=1, eos_token_id=5),
    # gpt-oss: attention with biases and a sink logit per head, a sliding layer (window 4) then a full one, YaRN
    # without truncation; every layer 4 experts stacked with biases (gate/up columns interleaved), a biased router
    # taking the top 2 logits and softmaxing them, SwiGLU clamped at 1.0 (low enough to cut these random weights); the
    # load-balancing loss on the raw router logits.
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=80, hidden_size=32, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                    rms_norm_eps=1e-5, rope_theta=150000.0, tie_word_embeddings=False, hidden_act="silu",
                    attention_bias=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                      original_max_position_embeddings=16, truncate=False),
                    num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0, output_router_logits=True,
                    router_aux_loss_coef=0.05, eos_token_id=79, pad_token_id=0),
    # Qwen3-Next: Gated DeltaNet layers 0-2 (2 key heads of 6, 4 value heads of 5: each key head serves two; a conv of
    # 4 taps) and gated attention on layer 3 (q_proj doubled, half of each head rotated); (1 + w) norms; 4 experts,
    # top-2 renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate x); layer 1 dense; the
    # load-balancing loss on the raw router logits.
    "qwen3_next": dict(model_type="qwen3_next", vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                       max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                       hidden_act="silu", attention_bias=False, full_attention_interval=4, linear_conv_kernel_dim=4,
                       linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10,
                       shared_expert_intermediate_size=12, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.05, eos_token_id=5),
    # Qwen3 with the other partial RoPE (Gemma 4's "proportional", transformers 5's rope_parameters): every value of a
    # 16-value head pairs with the one 8 after it; the first int(0.25·16 // 2) = 2 pairs turn at the whole head's
    # frequencies 1/theta^(2i/16) (halved by factor 2), the other 6 pairs at frequency 0.
    "qwen3_proportional": dict(model_type="qwen3", vocab_size=72, hidden_size=32, intermediate_size=40,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               rope_parameters=dict(rope_type="proportional", partial_rotary_factor=0.25, factor=2.0,
                                                    rope_theta=1000000.0),
                               tie_word_embeddings=True, hidden_act="silu", attention_bias=False, eos_token_id=5),
}

GEMMA = ("gemma3_text", "gemma2")
OLMO = ("olmo2", "olmo3")


def head_dim(c):
    if c["model_type"] == "deepseek_v3":  # DeepseekV3Config: head_dim = qk_rope_head_dim (what RoPE rotates)
        return c["qk_rope_head_dim"]
    return c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])


def rotary_dim(c):
    return int(head_dim(c) * c.get("partial_rotary_factor", 1.0))


def inverse_frequencies(c, local=False, seq_len=0):
    """(inv_freq, attention_scaling) as transformers' ROPE_INIT_FUNCTIONS compute them."""
    dim = rotary_dim(c)
    theta = c["rope_local_base_freq"] if local and c["model_type"] == "gemma3_text" else c["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else (c.get("rope_scaling") or c.get("rope_parameters"))
    rope_type = scaling and scaling.get("rope_type", scaling.get("type"))
    if rope_type == "proportional":  # _compute_proportional_rope_parameters (Gemma 4): the whole head's frequencies,
        D = head_dim(c)              # only the first int(p·D//2) nonzero, all divided by factor
        angles = int(scaling.get("partial_rotary_factor", 1.0) * D // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / D))
        inv = torch.cat((inv, torch.zeros(D // 2 - angles)))
        return inv / scaling.get("factor", 1.0), 1.0
    if rope_type in ("su", "yarn") and c["model_type"] == "phi3":
        rope_type = "longrope"
    if rope_type == "linear":
        inv = inv / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":  # _compute_yarn_parameters
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            if scaling.get("mscale") and scaling.get("mscale_all_dim"):
                attention_factor = get_mscale(factor, scaling["mscale"]) / get_mscale(factor, scaling["mscale_all_dim"])
            else:
                attention_factor = get_mscale(factor)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))
        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation_factor = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
        return inv, attention_factor
    elif rope_type == "longrope":  # _compute_longrope_parameters; long factors past the original context
        original = c["original_max_position_embeddings"]
        factor = scaling.get("factor") or c["max_position_embeddings"] / original
        attention_factor = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        ext = torch.tensor(scaling["long_factor"] if seq_len > original else scaling["short_factor"], dtype=torch.float32)
        inv = 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, attention_factor
    return inv, 1.0


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x, inv, positions, scaling=1.0):  # x (B, H, T, D); the first 2·len(inv) values of each head rotate
    freqs = positions[:, None].float() * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    R = emb.shape[-1]
    x_rot, x_pass = x[..., :R], x[..., R:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def is_sparse(c, i):
    """Qwen3MoeDecoderLayer (and Qwen3-Next's): experts unless mlp_only_layers names the layer, every
    decoder_sparse_step-th layer."""
    return (c["model_type"] in ("qwen3_moe", "qwen3_next") and c["num_experts"] > 0
            and i not in c.get("mlp_only_layers", []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0)


def is_linear(c, i):
    """Qwen3NextConfig's layer_types: Gated DeltaNet on all but every full_attention_interval-th layer."""
    if c["model_type"] != "qwen3_next":
        return False
    if c.get("layer_types"):
        return c["layer_types"][i] == "linear_attention"
    return (i + 1) % c.get("full_attention_interval", 4) != 0


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta):
    """torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel: q, k (B, T, H, Dk), v (B, T, H, Dv), g and beta
    (B, T, H); token by token S ← e^g S; S ← S + k (β (v − Sᵀk))ᵀ; o = Sᵀ q, q L2-normed and × Dk^−½."""
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    B, T, H, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kv_mem = (S * k[:, t, :, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((S * q[:, t, :, :, None]).sum(dim=-2))
    return torch.stack(out, dim=1)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk=64):
    """torch_chunk_gated_delta_rule, what transformers runs for a prompt (the same sums regrouped in chunks of 64):
    checked against the recurrent form above, so the reference is the function transformers calls."""
    q, k = l2norm(q), l2norm(k)
    q, k, v, beta, g = (x.transpose(1, 2) for x in (q, k, v, beta, g))  # (B, H, T, ·)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q = q * Dk ** -0.5
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v, k_beta, v_beta = (x.reshape(B, H, -1, chunk, x.shape[-1]) for x in (q, k, v, k_beta, v_beta))
    g = g.reshape(B, H, -1, chunk).cumsum(dim=-1)
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=0)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, chunk):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk, dtype=attn.dtype)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp()[..., None])
    S = torch.zeros(B, H, Dk, Dv, dtype=q.dtype)
    out = torch.zeros_like(value)
    strict_upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=1)
    for n in range(q.shape[2]):
        q_n, k_n, v_n = q[:, :, n], k[:, :, n], value[:, :, n]
        a = (q_n @ k_n.transpose(-1, -2) * decay[:, :, n]).masked_fill(strict_upper, 0)
        v_new = v_n - k_cumdecay[:, :, n] @ S
        out[:, :, n] = (q_n * g[:, :, n, :, None].exp()) @ S + a @ v_new
        S = S * g[:, :, n, -1, None, None].exp() + (k_n * (g[:, :, n, -1, None] - g[:, :, n]).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, Dv)[:, :, :T]
    return out.transpose(1, 2)


def gated_delta_net(c, w, p, h):
    """Qwen3NextGatedDeltaNet: in_proj_qkvz grouped per key head as q | k | v (r heads) | z (r heads), in_proj_ba as
    b (r) | a (r); the causal depthwise conv (padding K − 1, cut to T) + SiLU over q, k and v of all heads; β = σ(b),
    g = −e^A_log · softplus(a + dt_bias); q and k repeated for the r value heads each key head serves; the gated delta
    rule; RMSNorm of each head (plain w) × silu(z); out_proj."""
    B, T, C = h.shape
    nk, nv, dk, dv, K = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                         c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    r = nv // nk
    qkvz = F.linear(h, w[p + "linear_attn.in_proj_qkvz.weight"]).view(B, T, nk, 2 * dk + 2 * r * dv)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
    b, a = torch.split(F.linear(h, w[p + "linear_attn.in_proj_ba.weight"]).view(B, T, nk, 2 * r), [r, r], dim=-1)
    v, z, b, a = v.reshape(B, T, nv, dv), z.reshape(B, T, nv, dv), b.reshape(B, T, nv), a.reshape(B, T, nv)
    mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1).transpose(1, 2)
    conv = w[p + "linear_attn.conv1d.weight"]
    mixed = F.silu(F.conv1d(mixed, conv, padding=K - 1, groups=conv.shape[0])[..., :T]).transpose(1, 2)
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.reshape(B, T, nk, dk), k.reshape(B, T, nk, dk), v.reshape(B, T, nv, dv)
    beta = b.sigmoid()
    g = -w[p + "linear_attn.A_log"].float().exp() * F.softplus(a.float() + w[p + "linear_attn.dt_bias"])
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    o = recurrent_gated_delta_rule(q, k, v, g, beta)
    with torch.no_grad():
        chunked = chunk_gated_delta_rule(q, k, v, g, beta)
        assert torch.allclose(chunked, o, atol=1e-5, rtol=1e-4), (chunked - o).abs().max()
    o = rms_norm(o, w[p + "linear_attn.norm.weight"], c["rms_norm_eps"], False) * F.silu(z)
    return F.linear(o.reshape(B, T, nv * dv), w[p + "linear_attn.out_proj.weight"])


def qwen3_next_attention(c, w, p, h, positions):
    """Qwen3NextAttention: q_proj's rows per head are D query values then D gate values; q and k RMSNormed per head
    ((1 + w)), the first rotary_dim values of each head rotated; the context × sigmoid(gate), then o_proj."""
    B, T, C = h.shape
    H, Hkv, D, eps = c["num_attention_heads"], c["num_key_value_heads"], head_dim(c), c["rms_norm_eps"]
    q, gate = torch.chunk(F.linear(h, w[p + "self_attn.q_proj.weight"]).view(B, T, H, 2 * D), 2, dim=-1)
    gate = gate.reshape(B, T, H * D)
    k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(B, T, Hkv, D)
    v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(B, T, Hkv, D)
    q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, True).transpose(1, 2)
    k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, True).transpose(1, 2)
    v = v.transpose(1, 2)
    inv, attention_scaling = inverse_frequencies(c, seq_len=T)
    q, k = rope(q, inv, positions, attention_scaling), rope(k, inv, positions, attention_scaling)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5
    visible = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    ctx = (attn @ v).transpose(1, 2).reshape(B, T, H * D)
    return F.linear(ctx * torch.sigmoid(gate), w[p + "self_attn.o_proj.weight"])


def qwen3_next_moe(c, w, p, h):
    """Qwen3NextSparseMoeBlock: Qwen3-MoE's routed experts plus a shared SwiGLU expert scaled per token by
    sigmoid(shared_expert_gate x)."""
    s = p + "mlp.shared_expert."
    shared = F.linear(F.silu(F.linear(h, w[s + "gate_proj.weight"])) * F.linear(h, w[s + "up_proj.weight"]),
                      w[s + "down_proj.weight"])
    return moe(c, w, p, h) + torch.sigmoid(F.linear(h, w[p + "mlp.shared_expert_gate.weight"])) * shared


ROUTER_LOGITS = []  # each routed layer's router logits (B·T, E) of the last forward, for the load-balancing loss


def load_balancing_loss(router_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func without an attention mask (Qwen3-MoE's, Mixtral's): the layers' router
    logits joined, E · Σ over the k choices and the experts of (share of tokens choosing e) · (mean probability of e)."""
    logits = torch.cat(router_logits, dim=0)
    routing_weights = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def moe(c, w, p, h):
    """Qwen3MoeSparseMoeBlock: softmax over the router's logits (float32), the top k, renormalised with
    norm_topk_prob, each chosen expert's SwiGLU weighted by its share. Every expert runs on every token here (tiny
    sizes) and the chosen outputs are gathered: the same sums as transformers' per-expert index_add_, and the same
    gradients (an expert reaches the loss only through the tokens that chose it)."""
    B, T, C = h.shape
    x = h.reshape(B * T, C)
    router_logits = F.linear(x, w[p + "mlp.gate.weight"])
    ROUTER_LOGITS.append(router_logits)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
    if c.get("norm_topk_prob"):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    outs = []
    for e in range(c["num_experts"]):
        ex = p + f"mlp.experts.{e}."
        gate, up = F.linear(x, w[ex + "gate_proj.weight"]), F.linear(x, w[ex + "up_proj.weight"])
        outs.append(F.linear(F.silu(gate) * up, w[ex + "down_proj.weight"]))
    outs = torch.stack(outs, dim=1)  # (N, E, C)
    picked = outs.gather(1, chosen[:, :, None].expand(-1, -1, C))  # (N, k, C)
    return (picked * weights[:, :, None]).sum(dim=1).reshape(B, T, C)


def gpt_oss_moe(c, w, p, h):
    """GptOssMLP: the router's logits (with its bias), the top k of them softmaxed; each expert's gate_up (C, 2F) used
    as x·W, gate the even columns and up the odd ones, gate clamped above and up both ways at swiglu_limit,
    (up + 1)·gate·σ(1.702·gate), then down (F, C) and its bias, weighted. Every expert runs on every token here."""
    B, T, C = h.shape
    x = h.reshape(B * T, C)
    logits = F.linear(x, w[p + "mlp.router.weight"], w[p + "mlp.router.bias"])
    ROUTER_LOGITS.append(logits)
    top, chosen = torch.topk(logits, c["num_experts_per_tok"], dim=-1)
    weights = torch.softmax(top, dim=1)
    limit = c["swiglu_limit"]
    outs = []
    for e in range(c["num_local_experts"]):
        ex = p + "mlp.experts."
        gu = x @ w[ex + "gate_up_proj"][e] + w[ex + "gate_up_proj_bias"][e]
        gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * 1.702)
        outs.append(((up + 1) * glu) @ w[ex + "down_proj"][e] + w[ex + "down_proj_bias"][e])
    outs = torch.stack(outs, dim=1)
    picked = outs.gather(1, chosen[:, :, None].expand(-1, -1, C))
    return (picked * weights[:, :, None]).sum(dim=1).reshape(B, T, C)


def deepseek_moe(c, w, p, h):
    """DeepseekV3MoE: DeepseekV3TopkRouter (sigmoid scores; the choice, without gradient, over scores +
    e_score_correction_bias, limited to the topk_group groups whose two best choice values sum highest, the others
    masked to 0; weights the chosen scores, renormalised (+1e-20) and × routed_scaling_factor), the experts as moe()
    runs them, plus the shared experts."""
    B, T, C = h.shape
    x = h.reshape(B * T, C)
    E, G, k = c["n_routed_experts"], c["n_group"], c["num_experts_per_tok"]
    scores = torch.sigmoid(F.linear(x, w[p + "mlp.gate.weight"]))
    with torch.no_grad():
        choice = scores + w[p + "mlp.gate.e_score_correction_bias"][None, :]
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=c["topk_group"], dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
        chosen = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if c.get("norm_topk_prob"):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * c["routed_scaling_factor"]
    outs = []
    for e in range(E):
        ex = p + f"mlp.experts.{e}."
        gate, up = F.linear(x, w[ex + "gate_proj.weight"]), F.linear(x, w[ex + "up_proj.weight"])
        outs.append(F.linear(F.silu(gate) * up, w[ex + "down_proj.weight"]))
    outs = torch.stack(outs, dim=1)
    picked = outs.gather(1, chosen[:, :, None].expand(-1, -1, C))
    routed = (picked * weights[:, :, None]).sum(dim=1)
    sx = p + "mlp.shared_experts."
    shared = F.linear(F.silu(F.linear(x, w[sx + "gate_proj.weight"])) * F.linear(x, w[sx + "up_proj.weight"]),
                      w[sx + "down_proj.weight"])
    return (routed + shared).reshape(B, T, C)


def latent_attention(c, w, p, h, positions):
    """DeepseekV3Attention (eager): the low-rank q path or q_proj, the compressed KV latent and its norm (eps 1e-6,
    DeepseekV3RMSNorm's default: the module is built without the config's), kv_b_proj's per-head k_nope and v, the
    shared rotated key, RoPE after apply_rotary_pos_emb_interleave's de-interleave, the scale with mscale²."""
    B, T, C = h.shape
    H, R, dn, dr, dv = c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    lin = lambda t_, name: F.linear(t_, w[p + name + ".weight"])  # noqa: E731
    if c.get("q_lora_rank"):
        q = lin(rms_norm(lin(h, "self_attn.q_a_proj"), w[p + "self_attn.q_a_layernorm.weight"], 1e-6, False), "self_attn.q_b_proj")
    else:
        q = lin(h, "self_attn.q_proj")
    q = q.view(B, T, H, dn + dr).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [dn, dr], dim=-1)
    compressed = lin(h, "self_attn.kv_a_proj_with_mqa")
    k_pass, k_rot = torch.split(compressed, [R, dr], dim=-1)
    kv = lin(rms_norm(k_pass, w[p + "self_attn.kv_a_layernorm.weight"], 1e-6, False), "self_attn.kv_b_proj")
    kv = kv.view(B, T, H, dn + dv).transpose(1, 2)
    k_pass, v = torch.split(kv, [dn, dv], dim=-1)
    k_rot = k_rot.view(B, 1, T, dr)
    if c.get("rope_interleave", True):  # view(…, d/2, 2).transpose(-1, -2): evens first, then odds
        q_rot = q_rot.reshape(B, H, T, dr // 2, 2).transpose(4, 3).reshape(B, H, T, dr)
        k_rot = k_rot.reshape(B, 1, T, dr // 2, 2).transpose(4, 3).reshape(B, 1, T, dr)
    inv, attention_scaling = inverse_frequencies(c, seq_len=T)
    q_rot, k_rot = rope(q_rot, inv, positions, attention_scaling), rope(k_rot, inv, positions, attention_scaling)
    k_rot = k_rot.expand(B, H, T, dr)
    query, key = torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_pass, k_rot), dim=-1)
    scale = (dn + dr) ** -0.5
    scaling = c.get("rope_scaling")
    if scaling and scaling.get("mscale_all_dim"):
        factor = scaling["factor"]
        m = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * m * m
    scores = (query @ key.transpose(-1, -2)) * scale
    qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
    scores = scores.masked_fill(~(kj <= qi), float("-inf"))
    ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * dv)
    return lin(ctx, "self_attn.o_proj")


def rms_norm(x, w, eps, gemma):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if gemma else w * y


def parameter_names(c):
    """The state dict's names and shapes, in transformers' registration order."""
    C, F_, D, H, Hkv, V = c["hidden_size"], c["intermediate_size"], head_dim(c), c["num_attention_heads"], \
        c["num_key_value_heads"], c["vocab_size"]
    t = c["model_type"]
    gemma, qwen2, olmo, phi3 = t in GEMMA, t == "qwen2", t in OLMO, t == "phi3"
    out = [("model.embed_tokens.weight", (V, C))]
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        if t == "deepseek_v3":  # DeepseekV3Attention, then DeepseekV3MoE (experts, gate, shared_experts) or the MLP
            R, Rq, dn, dv = c["kv_lora_rank"], c.get("q_lora_rank"), c["qk_nope_head_dim"], c["v_head_dim"]
            if Rq:
                out += [(b + "self_attn.q_a_proj.weight", (Rq, C)), (b + "self_attn.q_a_layernorm.weight", (Rq,)),
                        (b + "self_attn.q_b_proj.weight", (H * (dn + D), Rq))]
            else:
                out.append((b + "self_attn.q_proj.weight", (H * (dn + D), C)))
            out += [(b + "self_attn.kv_a_proj_with_mqa.weight", (R + D, C)), (b + "self_attn.kv_a_layernorm.weight", (R,)),
                    (b + "self_attn.kv_b_proj.weight", (H * (dn + dv), R)), (b + "self_attn.o_proj.weight", (C, H * dv))]
            if i >= c["first_k_dense_replace"]:
                E, Fe = c["n_routed_experts"], c["moe_intermediate_size"]
                for e in range(E):
                    out += [(b + f"mlp.experts.{e}.gate_proj.weight", (Fe, C)), (b + f"mlp.experts.{e}.up_proj.weight", (Fe, C)),
                            (b + f"mlp.experts.{e}.down_proj.weight", (C, Fe))]
                Fs = Fe * c["n_shared_experts"]
                out += [(b + "mlp.gate.weight", (E, C)), (b + "mlp.gate.e_score_correction_bias", (E,)),
                        (b + "mlp.shared_experts.gate_proj.weight", (Fs, C)), (b + "mlp.shared_experts.up_proj.weight", (Fs, C)),
                        (b + "mlp.shared_experts.down_proj.weight", (C, Fs))]
            else:
                out += [(b + "mlp.gate_proj.weight", (F_, C)), (b + "mlp.up_proj.weight", (F_, C)),
                        (b + "mlp.down_proj.weight", (C, F_))]
            out += [(b + "input_layernorm.weight", (C,)), (b + "post_attention_layernorm.weight", (C,))]
            continue
        if phi3:  # Phi3Attention registers o_proj before qkv_proj; Phi3MLP gate_up_proj, then down_proj
            out += [(b + "self_attn.o_proj.weight", (C, H * D)), (b + "self_attn.qkv_proj.weight", (H * D + 2 * Hkv * D, C)),
                    (b + "mlp.gate_up_proj.weight", (2 * F_, C)), (b + "mlp.down_proj.weight", (C, F_)),
                    (b + "input_layernorm.weight", (C,)), (b + "post_attention_layernorm.weight", (C,))]
            continue
        if t == "gpt_oss":  # GptOssAttention: its sinks, the four projections with biases; GptOssMLP: router, experts
            E, Fe = c["num_local_experts"], F_
            out.append((b + "self_attn.sinks", (H,)))
            for name, rows, cols in (("q_proj", H * D, C), ("k_proj", Hkv * D, C), ("v_proj", Hkv * D, C), ("o_proj", C, H * D)):
                out += [(b + f"self_attn.{name}.weight", (rows, cols)), (b + f"self_attn.{name}.bias", (rows,))]
            out += [(b + "mlp.router.weight", (E, C)), (b + "mlp.router.bias", (E,)),
                    (b + "mlp.experts.gate_up_proj", (E, C, 2 * Fe)), (b + "mlp.experts.gate_up_proj_bias", (E, 2 * Fe)),
                    (b + "mlp.experts.down_proj", (E, Fe, C)), (b + "mlp.experts.down_proj_bias", (E, C)),
                    (b + "input_layernorm.weight", (C,)), (b + "post_attention_layernorm.weight", (C,))]
            continue
        if is_linear(c, i):  # Qwen3NextGatedDeltaNet, in its registration order
            nk, nv, dk, dv, K = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                                 c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
            conv = 2 * nk * dk + nv * dv
            out += [(b + "linear_attn.conv1d.weight", (conv, 1, K)),
                    (b + "linear_attn.in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, C)),
                    (b + "linear_attn.in_proj_ba.weight", (2 * nv, C)), (b + "linear_attn.dt_bias", (nv,)),
                    (b + "linear_attn.A_log", (nv,)), (b + "linear_attn.norm.weight", (dv,)),
                    (b + "linear_attn.out_proj.weight", (C, nv * dv))]
        for name, rows in (() if is_linear(c, i) else
                           (("q_proj", H * D * (2 if t == "qwen3_next" else 1)), ("k_proj", Hkv * D), ("v_proj", Hkv * D))):
            out.append((b + f"self_attn.{name}.weight", (rows, C)))
            if qwen2:
                out.append((b + f"self_attn.{name}.bias", (rows,)))
        if not is_linear(c, i):
            out.append((b + "self_attn.o_proj.weight", (C, H * D)))
        if t in ("gemma3_text", "qwen3", "qwen3_moe") or (t == "qwen3_next" and not is_linear(c, i)):
            out += [(b + "self_attn.q_norm.weight", (D,)), (b + "self_attn.k_norm.weight", (D,))]
        if olmo:  # over the whole projection
            out += [(b + "self_attn.q_norm.weight", (H * D,)), (b + "self_attn.k_norm.weight", (Hkv * D,))]
        if is_sparse(c, i):  # the router, then each expert's gate, up and down
            E, Fe = c["num_experts"], c["moe_intermediate_size"]
            out.append((b + "mlp.gate.weight", (E, C)))
            for e in range(E):
                out += [(b + f"mlp.experts.{e}.gate_proj.weight", (Fe, C)), (b + f"mlp.experts.{e}.up_proj.weight", (Fe, C)),
                        (b + f"mlp.experts.{e}.down_proj.weight", (C, Fe))]
            if t == "qwen3_next":  # the shared expert, then its gate
                Fs = c["shared_expert_intermediate_size"]
                out += [(b + "mlp.shared_expert.gate_proj.weight", (Fs, C)), (b + "mlp.shared_expert.up_proj.weight", (Fs, C)),
                        (b + "mlp.shared_expert.down_proj.weight", (C, Fs)), (b + "mlp.shared_expert_gate.weight", (1, C))]
        else:
            out += [(b + "mlp.gate_proj.weight", (F_, C)), (b + "mlp.up_proj.weight", (F_, C)),
                    (b + "mlp.down_proj.weight", (C, F_))]
        if olmo:
            out += [(b + "post_attention_layernorm.weight", (C,)), (b + "post_feedforward_layernorm.weight", (C,))]
        else:
            out += [(b + "input_layernorm.weight", (C,)), (b + "post_attention_layernorm.weight", (C,))]
        if gemma:
            out += [(b + "pre_feedforward_layernorm.weight", (C,)), (b + "post_feedforward_layernorm.weight", (C,))]
    out.append(("model.norm.weight", (C,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, C)))
    return out


def random_weights(c, seed):
    g = torch.Generator().manual_seed(seed)
    gemma = c["model_type"] in GEMMA or c["model_type"] == "qwen3_next"  # (1 + w) norms
    w = {}
    for name, shape in parameter_names(c):
        if name.endswith("linear_attn.norm.weight"):  # Qwen3-Next's gated norm: a plain w
            w[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("linear_attn.A_log"):  # log of decay rates in (0.5, 4), as log(U(0, 16)) draws them
            w[name] = torch.log(0.5 + 3.5 * torch.rand(shape, generator=g))
        elif name.endswith("linear_attn.out_proj.weight"):
            # smaller, so that four layers' outputs stay near their inputs' size: with 0.25 the residual stream
            # grew fivefold a layer and float32's rounding reached 4e-5 in the logits (PyTorch's as qkv's)
            w[name] = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("norm.weight") or "layernorm" in name:
            # norms near their identity (1 for w·x̂, 0 for (1 + w)·x̂), not at it, so their gradients matter
            w[name] = (0.0 if gemma else 1.0) + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):  # a buffer: no gradient (it only chooses)
            w[name] = 0.1 * torch.randn(shape, generator=g)
            continue
        elif name.endswith("self_attn.sinks"):  # logits of the scores' size, so that a sink takes a real share
            w[name] = torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            w[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            w[name] = 0.25 * torch.randn(shape, generator=g)
    return {k: (v if k.endswith("e_score_correction_bias") else v.requires_grad_()) for k, v in w.items()}


def layer_is_sliding(c, i):
    t = c["model_type"]
    if t == "gemma3_text":
        return (i + 1) % c["sliding_window_pattern"] != 0
    if t == "gemma2":  # layer 0 slides, then every other one
        return (i + 1) % 2 != 0
    if t == "olmo3":  # three of four
        return (i + 1) % 4 != 0
    if t in ("mistral", "phi3"):
        return c.get("sliding_window") is not None
    if t == "gpt_oss":
        return c["layer_types"][i] == "sliding_attention"
    if t in ("qwen2", "qwen3", "qwen3_moe") and c.get("use_sliding_window"):
        return i >= c["max_window_layers"]
    return False


def uses_rope(c, i):
    return c["model_type"] != "smollm3" or c["no_rope_layers"][i] == 1


def softcap(x, cap):
    return torch.tanh(x / cap) * cap


def forward(c, w, ids, hidden=False):
    """ids (B, T) → logits (B, T, V), the family's forward pass written out; with hidden, the final norm's output
    (B, T, C), what a *ForSequenceClassification's score reads."""
    t = c["model_type"]
    gemma, olmo = t in GEMMA, t in OLMO
    B, T = ids.shape
    C, D, H, Hkv, eps = c["hidden_size"], head_dim(c), c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    positions = torch.arange(T)
    x = w["model.embed_tokens.weight"][ids]
    if gemma:
        x = x * torch.tensor(C ** 0.5, dtype=x.dtype)
    scale = c["query_pre_attn_scalar"] ** -0.5 if gemma else D ** -0.5
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        lin = lambda t_, name: F.linear(t_, w[p + name + ".weight"], w.get(p + name + ".bias"))  # noqa: E731
        if t == "deepseek_v3":  # pre-norm blocks: latent attention, then the dense MLP or the mixture of experts
            x = x + latent_attention(c, w, p, rms_norm(x, w[p + "input_layernorm.weight"], eps, False), positions)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, False)
            if i >= c["first_k_dense_replace"]:
                x = x + deepseek_moe(c, w, p, h)
            else:
                x = x + lin(F.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
            continue
        if t == "qwen3_next":  # pre-norm blocks ((1 + w) norms): Gated DeltaNet or gated attention, then the MLP
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps, True)
            x = x + (gated_delta_net(c, w, p, h) if is_linear(c, i) else qwen3_next_attention(c, w, p, h, positions))
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, True)
            if is_sparse(c, i):
                x = x + qwen3_next_moe(c, w, p, h)
            else:
                x = x + lin(F.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
            continue
        h = x if olmo else rms_norm(x, w[p + "input_layernorm.weight"], eps, gemma)
        if t == "phi3":  # rows q | k | v of qkv_proj
            qkv = lin(h, "self_attn.qkv_proj")
            q, k, v = qkv[..., :H * D], qkv[..., H * D:(H + Hkv) * D], qkv[..., (H + Hkv) * D:]
        else:
            q, k, v = lin(h, "self_attn.q_proj"), lin(h, "self_attn.k_proj"), lin(h, "self_attn.v_proj")
        if olmo:  # RMSNorm over all heads of a token, before the split into heads
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, False)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, False)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if t in ("qwen3", "qwen3_moe", "gemma3_text"):
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sliding = layer_is_sliding(c, i)
        if uses_rope(c, i):
            # Gemma 3's sliding layers: the local base; OLMo 3's: plain RoPE (scaling on full layers only)
            local = sliding and t in ("gemma3_text", "olmo3")
            inv, attention_scaling = inverse_frequencies(c, local=local, seq_len=T)
            q, k = rope(q, inv, positions, attention_scaling), rope(k, inv, positions, attention_scaling)
        k = k.repeat_interleave(H // Hkv, dim=1)  # repeat_kv: query head h reads K/V head h // group
        v = v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale
        if c.get("attn_logit_softcapping"):  # after the scale, before the mask
            scores = softcap(scores, c["attn_logit_softcapping"])
        qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
        visible = kj <= qi
        if sliding:
            visible = visible & (qi - kj < c["sliding_window"])
        scores = scores.masked_fill(~visible, float("-inf"))
        if t == "gpt_oss":  # the sink: one more logit per head in each row's softmax, its column dropped after
            sinks = w[p + "self_attn.sinks"].reshape(1, H, 1, 1).expand(B, H, T, 1)
            attn = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            attn = torch.softmax(scores, dim=-1)
        ctx = (attn @ v).transpose(1, 2).reshape(B, T, H * D)
        a = lin(ctx, "self_attn.o_proj")
        if gemma:
            a = rms_norm(a, w[p + "post_attention_layernorm.weight"], eps, gemma)
            x = x + a
            h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps, gemma)
        elif olmo:
            x = x + rms_norm(a, w[p + "post_attention_layernorm.weight"], eps, False)
            h = x
        else:
            x = x + a
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, gemma)
        if is_sparse(c, i):
            x = x + moe(c, w, p, h)
            continue
        if t == "gpt_oss":
            x = x + gpt_oss_moe(c, w, p, h)
            continue
        if t == "phi3":  # the first half of gate_up_proj is the gate
            gate, up = lin(h, "mlp.gate_up_proj").chunk(2, dim=-1)
        else:
            gate, up = lin(h, "mlp.gate_proj"), lin(h, "mlp.up_proj")
        act = F.gelu(gate, approximate="tanh") if gemma else F.silu(gate)
        m = lin(act * up, "mlp.down_proj")
        if gemma:
            m = rms_norm(m, w[p + "post_feedforward_layernorm.weight"], eps, gemma)
        elif olmo:
            m = rms_norm(m, w[p + "post_feedforward_layernorm.weight"], eps, False)
        x = x + m
    x = rms_norm(x, w["model.norm.weight"], eps, gemma or t == "qwen3_next")
    if hidden:
        return x
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    logits = x @ head.t()
    if c.get("final_logit_softcapping"):
        logits = softcap(logits, c["final_logit_softcapping"])
    return logits


def write_folder(c, w, folder, shards):
    os.makedirs(folder, exist_ok=True)
    config = dict(c)
    config["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
                                "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
                                "smollm3": "SmolLM3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                                "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}[c["model_type"]]]
    config["torch_dtype"] = "float32"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = [n for n, _ in parameter_names(c)]
    if shards == 1:
        save_safetensors(os.path.join(folder, "model.safetensors"), {n: w[n] for n in names}, {"format": "pt"})
        return
    split = len(names) // 2
    parts = [names[:split], names[split:]]
    weight_map = {}
    for s, part in enumerate(parts):
        file = f"model-{s + 1:05d}-of-{len(parts):05d}.safetensors"
        save_safetensors(os.path.join(folder, file), {n: w[n] for n in part}, {"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(w[n].numel() * 4 for n in names)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# gpt-oss as OpenAI publishes it: the experts' matrices as MXFP4 (transformers' Mxfp4 quantizer format)
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_dequantized(blocks, scales):
    """transformers' convert_moe_packed_tensors: blocks (E, R, G, 16) uint8, scales (E, R, G) uint8 exponents with
    bias 127; byte i of a group gives values 2i (its low nibble) and 2i + 1 (its high one); the (E, R, G·32) values
    transposed to (E, G·32, R), the matrix GptOssExperts uses as x·W."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    E, R, G, B = blocks.shape
    out = torch.empty(E, R, G, B * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None].float())
    return out.reshape(E, R, G * B * 2).transpose(1, 2).contiguous()


def write_gpt_oss_mxfp4(out_dir):
    """gpt_oss_mxfp4/: gpt-oss's tiny configuration with experts 32 wide clamped at 7, its gate_up_proj and
    down_proj held as random MXFP4 codes and exponents (_blocks, _scales) and config.json's quantization_config, as
    the published folders are; gpt_oss_mxfp4.expected.safetensors: ids, the logits and greedy tokens of the dequantized model."""
    c = dict(FAMILIES["gpt_oss"], intermediate_size=32, swiglu_limit=7.0)  # llama.cpp's clamp: the GGUF writer takes it
    w = random_weights(c, 4242)
    g = torch.Generator().manual_seed(4243)
    E, C, Fe = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
    packed = {}
    for i in range(c["num_hidden_layers"]):
        for name, R, K in [("gate_up_proj", 2 * Fe, C), ("down_proj", C, Fe)]:
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks = torch.randint(0, 256, (E, R, K // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
            scales = (127 + torch.randint(-5, -1, (E, R, K // 32), generator=g)).to(torch.uint8)
            w[key] = mxfp4_dequantized(blocks, scales)
            packed[key] = (blocks, scales)
    B, T = 2, 12
    ids = torch.randint(0, c["vocab_size"], (B, T), generator=g)
    with torch.no_grad():
        logits = forward(c, w, ids)
        sequence = ids[0, :5].tolist()
        for _ in range(10):
            sequence.append(int(forward(c, w, torch.tensor([sequence]))[0, -1].argmax()))
    folder = os.path.join(out_dir, "gpt_oss_mxfp4")
    os.makedirs(folder, exist_ok=True)
    config = dict(c, architectures=["GptOssForCausalLM"], torch_dtype="bfloat16",
                  quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
                      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {}
    for n, _ in parameter_names(c):
        if n in packed:
            tensors[n + "_blocks"], tensors[n + "_scales"] = (t.numpy() for t in packed[n])
        else:
            tensors[n] = w[n].detach()
    save_safetensors(os.path.join(folder, "model.safetensors"), tensors, {"format": "pt"})
    save_safetensors(os.path.join(out_dir, "gpt_oss_mxfp4.expected.safetensors"),
                     {"ids": ids, "logits": logits.float(), "greedy": torch.tensor(sequence[5:]),
                      "prompt": torch.tensor(sequence[:5])},
                     {"tool": "tools/decoder_reference.py", "torch": torch.__version__})
    print(f"gpt_oss_mxfp4: greedy {sequence[5:]}")


def write_gpt_oss_lora(out_dir):
    """gpt_oss_lora/: a PEFT LoRA adapter on the gpt_oss folder's stacked experts (target_parameters gate_up_proj and
    down_proj, rank 2 per expert, lora_alpha 3) and on its q_proj, laid out as PEFT >= 0.19.1 with transformers 5
    writes it: lora_A (r*E, in), lora_B (out, r*E); down_proj's pair (the outer ParamWrapper) under
    "...mlp.experts.lora_A.weight", gate_up_proj's under "...mlp.experts.base_layer.lora_A.weight". Each update is
    PEFT's get_delta_weight, einsum("o r e, e r i -> e i o", B.reshape(out, r, E), A.reshape(E, r, in)) * scale,
    added to the frozen weights. gpt_oss_lora_swapped/: the same updates in the orientation PEFT 0.19.0 with
    transformers 5 writes (in and out swapped: lora_A (r*E, out), lora_B (in, r*E), einsum "... -> e o i").
    gpt_oss_lora.expected.safetensors: ids, targets, logits, the loss and every adapter tensor's gradient
    ("grad.<PEFT key>")."""
    family = "gpt_oss"
    c = FAMILIES[family]
    seed = list(FAMILIES).index(family)
    w = {k: v.detach() for k, v in random_weights(c, 2000 + seed).items()}  # the gpt_oss folder's weights, frozen
    g = torch.Generator().manual_seed(5150)
    r, alpha = 2, 3.0
    scale = alpha / r
    E, C, Fe = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
    H, D = c["num_attention_heads"], c["head_dim"]
    adapter, swapped = {}, {}
    effective = dict(w)
    for i in range(c["num_hidden_layers"]):
        experts = f"model.layers.{i}.mlp.experts"
        # registration order gate_up_proj, down_proj: the first wrapped innermost
        for name, keyed, d_in, d_out in [("gate_up_proj", experts + ".base_layer", C, 2 * Fe),
                                         ("down_proj", experts, Fe, C)]:
            A = (0.3 * torch.randn(r * E, d_in, generator=g)).requires_grad_()
            B = (0.3 * torch.randn(d_out, r * E, generator=g)).requires_grad_()
            adapter[keyed + ".lora_A.weight"], adapter[keyed + ".lora_B.weight"] = A, B
            delta = torch.einsum("o r e, e r i -> e i o", B.reshape(d_out, r, E), A.reshape(E, r, d_in)) * scale
            effective[experts + "." + name] = w[experts + "." + name] + delta
            # the swapped orientation of the same update: A_s (r*E, out), B_s (in, r*E), delta[e] = scale * B_s,e A_s,e
            A3, B3 = A.detach().reshape(E, r, d_in), B.detach().reshape(d_out, r, E)
            B_s = A3.permute(2, 1, 0).reshape(d_in, r * E)
            A_s = B3.permute(2, 1, 0).reshape(E * r, d_out)
            delta_s = torch.einsum("o r e, e r i -> e o i", B_s.reshape(d_in, r, E), A_s.reshape(E, r, d_out)) * scale
            assert torch.allclose(delta_s, delta.detach(), atol=1e-6), name
            swapped[keyed + ".lora_A.weight"], swapped[keyed + ".lora_B.weight"] = A_s, B_s
        q = f"model.layers.{i}.self_attn.q_proj"
        A = (0.3 * torch.randn(r, C, generator=g)).requires_grad_()
        B = (0.3 * torch.randn(H * D, r, generator=g)).requires_grad_()
        adapter[q + ".lora_A.weight"], adapter[q + ".lora_B.weight"] = A, B
        swapped[q + ".lora_A.weight"], swapped[q + ".lora_B.weight"] = A.detach(), B.detach()
        effective[q + ".weight"] = w[q + ".weight"] + scale * (B @ A)
    B_, T = 2, 12
    ids = torch.randint(0, c["vocab_size"], (B_, T), generator=g)
    targets = torch.randint(0, c["vocab_size"], (B_, T), generator=g)
    targets[0, 2] = -100
    ROUTER_LOGITS.clear()
    logits = forward(c, effective, ids)
    loss = F.cross_entropy(logits.reshape(B_ * T, -1), targets.reshape(-1), ignore_index=-100)
    loss = loss + c["router_aux_loss_coef"] * load_balancing_loss(ROUTER_LOGITS, E, c["num_experts_per_tok"])
    loss.backward()
    expected = {"ids": ids, "targets": targets, "logits": logits.detach().float(), "loss": loss.detach().reshape(1)}
    for key, t in adapter.items():
        expected["grad." + key] = t.grad.float()
    for folder_name, tensors in [("gpt_oss_lora", adapter), ("gpt_oss_lora_swapped", swapped)]:
        folder = os.path.join(out_dir, folder_name)
        os.makedirs(folder, exist_ok=True)
        config = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path="gpt_oss", r=r,
                      lora_alpha=alpha, lora_dropout=0.0, bias="none", fan_in_fan_out=False, inference_mode=True,
                      target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      peft_version="0.19.0" if folder_name.endswith("swapped") else "0.19.1")
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_safetensors(os.path.join(folder, "adapter_model.safetensors"),
                         {"base_model.model." + k: v.detach().contiguous() for k, v in tensors.items()}, {"format": "pt"})
    save_safetensors(os.path.join(out_dir, "gpt_oss_lora.expected.safetensors"), expected,
                     {"tool": "tools/decoder_reference.py", "torch": torch.__version__})
    print(f"gpt_oss_lora: loss {loss.item():.6f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    parser.add_argument("--families", nargs="*", help="only these (default: all, gpt_oss_mxfp4 and gpt_oss_lora); each keeps its seed")
    args = parser.parse_args()
    for seed, (family, c) in enumerate(FAMILIES.items()):
        if args.families and family not in args.families:
            continue
        torch.manual_seed(1000 + seed)
        w = random_weights(c, 2000 + seed)
        # Qwen3-Next's expected values are computed in float64 from the same float32 weights: its gated delta rule and
        # L2 norms amplify float32's rounding (PyTorch's float32 is up to 8e-5 of a tensor's largest value from float64),
        # so float64 is the reference both float32 implementations are measured against.
        exact = family == "qwen3_next"
        saved = w
        if exact:
            w = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in w.items()}
        B, T = 2, 12
        g = torch.Generator().manual_seed(3000 + seed)
        ids = torch.randint(0, c["vocab_size"], (B, T), generator=g)
        targets = torch.randint(0, c["vocab_size"], (B, T), generator=g)
        targets[0, 3] = targets[1, 7] = -100
        ROUTER_LOGITS.clear()
        logits = forward(c, w, ids)
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1), ignore_index=-100)
        if c.get("output_router_logits"):  # Qwen3MoeForCausalLM: loss + router_aux_loss_coef · aux_loss
            experts = c.get("num_experts", c.get("num_local_experts"))
            loss = loss + c["router_aux_loss_coef"] * load_balancing_loss(ROUTER_LOGITS, experts, c["num_experts_per_tok"])
        loss.backward()
        # Greedy decoding: the whole sequence again for every new token, as the book's generate_text_simple.
        with torch.no_grad():
            sequence = ids[0, :5].tolist()
            for _ in range(14):
                sequence.append(int(forward(c, w, torch.tensor([sequence]))[0, -1].argmax()))
        expected = {"ids": ids, "targets": targets, "logits": logits.float(), "loss": loss.reshape(1).float(),
                    "greedy": torch.tensor(sequence[5:]), "prompt": torch.tensor(sequence[:5])}
        for name, shape in parameter_names(c):
            expected["grad." + name] = w[name].grad.float() if w[name].grad is not None else torch.zeros(shape)
        folder = os.path.join(args.out, family)
        write_folder(c, saved, folder, shards=2 if family == "qwen3" else 1)
        save_safetensors(os.path.join(args.out, family + ".expected.safetensors"), expected,
                         {"tool": "tools/decoder_reference.py", "torch": torch.__version__})
        print(f"{family}: loss {loss.item():.6f}, greedy {sequence[5:]}")
    if not args.families or "gpt_oss_mxfp4" in args.families:
        write_gpt_oss_mxfp4(args.out)
    if not args.families or "gpt_oss_lora" in args.families:
        write_gpt_oss_lora(args.out)


if __name__ == "__main__":
    main()
