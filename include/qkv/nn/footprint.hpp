// What an attention variant costs in memory, from its settings: KV-cache bytes for multi-head, grouped-query,
// latent (MLA) and sliding-window attention, and the parameters of a dense feed-forward layer against a
// mixture of experts — computed as the book's chapter-4 bonus estimators compute them, so the same settings print
// the book's figures (book_memory_settings()). Arithmetic only: no model is built, nothing is allocated.
// Not here: the KV cache itself (language_model.hpp), parameter counts of a real model (DecoderConfig).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace qkv::nn {

// One model's settings, in the book's estimators' terms. Zero leaves a part out: no latent (latent_dim 0) prints
// no MLA line, no window no SWA lines, no hidden_dim no MoE lines.
struct MemorySettings {
  std::string title;                  // a heading for the report ("GQA (ch04/04_gqa)")
  int64_t batch = 1;                  // sequences held at once
  int64_t context = 1024;             // tokens cached per sequence (context_length)
  int64_t emb_dim = 0;                // residual width; head_dim = ⌈emb_dim / heads⌉ as the book takes it
  int64_t heads = 0;                  // query heads (= K/V heads in MHA)
  int64_t layers = 0;                 // transformer blocks
  int64_t kv_groups = 1;              // GQA: query heads per K/V head (divides heads)
  int64_t bytes_per_value = 2;        // fp32 4, bf16 / fp16 2, fp8 / int8 1
  int64_t latent_dim = 0;             // MLA: the compressed KV latent cached per token and layer (0: none)
  int64_t window = 0;                 // SWA: the window W of the sliding layers (0: none)
  int64_t swa_layers = 1, full_layers = 0;  // SWA: a:b, a sliding layers for every b full ones ("5:1")
  int64_t hidden_dim = 0;             // the dense FFN's inner width (0: no MoE section)
  int64_t ffn_matrices = 3;           // 3 for SwiGLU (gate, up, down), 2 for GELU (up, down)
  int64_t experts = 0, top_k = 0;     // MoE: experts and experts per token
  bool match_dense = true;            // each expert's hidden width chosen so total ≈ the dense FFN's parameters
  void validate() const;              // ValueError naming the setting and what is allowed
};

// KV-cache bytes of `layers` layers caching K and V of kv_heads heads of head_dim for batch × tokens:
// batch · tokens · head_dim · kv_heads · 2 · bytes · layers. ValueError on overflow.
int64_t kv_cache_bytes(int64_t batch, int64_t tokens, int64_t head_dim, int64_t kv_heads, int64_t layers,
                       int64_t bytes_per_value);
// MLA's cache as the book's estimator counts it: one latent of latent_dim per token and layer,
// batch · tokens · layers · latent_dim · bytes (DeepSeek's decoupled RoPE key adds its width to latent_dim).
int64_t latent_cache_bytes(int64_t batch, int64_t tokens, int64_t layers, int64_t latent_dim, int64_t bytes_per_value);
// How `layers` layers split into sliding and full ones at a:b (the book's rule: whole blocks of a + b, then the
// remainder's first a slide): {sliding, full}.
std::pair<int64_t, int64_t> split_sliding_layers(int64_t layers, int64_t a, int64_t b);

// The figures a MemorySettings gives (bytes and parameter counts; 0 where the part is left out)
struct MemoryFigures {
  int64_t head_dim = 0, kv_heads_gqa = 0;                  // ⌈emb/heads⌉, heads / kv_groups
  int64_t mha_bytes = 0, gqa_bytes = 0, mla_bytes = 0;     // every layer full, K and V (MLA: the latent)
  int64_t sliding_layers = 0, full_layers = 0;             // SWA's split
  int64_t mha_swa_bytes = 0, gqa_swa_bytes = 0;            // sliding layers cache min(context, W) tokens
  int64_t dense_params = 0, router_params = 0;             // the dense FFN; the router (emb × experts)
  int64_t expert_hidden = 0, per_expert_params = 0;        // each expert's inner width and parameters
  int64_t moe_params = 0, moe_active_params = 0;           // all experts + router; router + top_k experts
};
MemoryFigures memory_figures(const MemorySettings& settings);  // validates first

// "17.18 GB": bytes in decimal gigabytes (10⁹), two decimals, as the book prints them.
std::string gigabytes(int64_t bytes);
// The figures as lines of text (the CLI's `qkv memory` output), parameter counts with thousands separators.
std::string memory_report(const MemorySettings& settings);
// The four settings of the book's chapter-4 bonus folders (GQA, MLA, SWA, MoE), whose printed figures
// memory_report reproduces: 17.18 / 4.29 GB; 3.25 / 0.81 / 0.81 GB; 3.14 / 0.78 GB; 308,281,344 / 308,338,688 /
// 77,127,680 parameters.
std::vector<MemorySettings> book_memory_settings();

struct DecoderConfig;
// A real model's figures (a Hugging Face config.json read as a DecoderConfig): its parameters, and its KV cache for
// batch × context tokens at bytes_per_value, each layer caching K and V of its K/V heads for its window (a sliding
// layer min(context, window) tokens), in total and per kind of layer.
std::string memory_report(const DecoderConfig& config, int64_t batch, int64_t context, int64_t bytes_per_value);

}  // namespace qkv::nn
