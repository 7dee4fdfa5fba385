// What a language model attends to, written out for people and for programs: a grid of every chosen layer × head, one
// heatmap per head, the weights themselves (attention.safetensors, (layers, heads, T, T)) and a self-contained
// HTML page (no network, the data inline) in which hovering or clicking a token shows what it attends to in each
// layer and head, in the style of bertviz's head view.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/viz/picture.hpp"

namespace qkv::viz {

// What write_attention_report draws: every chosen head's weights for one prompt, with what names them
struct AttentionReport {
  std::string title;                  // what model, e.g. "checkpoint runs/gpt/checkpoint.safetensors"
  std::vector<std::string> tokens;    // the T tokens as text
  std::vector<int64_t> token_ids;     // and as ids
  std::vector<int64_t> layers, heads;  // 1-based numbers of maps' first two dimensions
  Tensor maps;                        // (layers, heads, T, T): row i = what token i attends to
  int64_t kv_group = 1;               // query heads per K/V head (grouped-query attention); 1: every head its own
  std::vector<int64_t> windows;       // per layer shown: its sliding window, 0 for full causal (empty: all full)
  // Attention sinks (gpt-oss): (layers, heads, T), the weight each query row gave its head's sink, 1 − the row's sum
  // in maps (undefined: no sinks)
  Tensor sink_share;
  // A mixture of experts: the routed layers (1-based) and (routed layers, T, experts) routing weights, 0 where a
  // token did not choose the expert (undefined: a dense model)
  std::vector<int64_t> expert_layers;
  Tensor routing;
};

// Writes into `dir` (created if needed), each file atomically: attention-grid.png, layerLL-headHH.png per head
// (unless per_head is false; .svg or .pdf as the options say), sinks.png with sinks, routing-layerLL.png per routed
// layer with experts, attention.safetensors (with sink_share and routing) and attention.html. Tokens are
// labelled with token_label(). Returns the paths written.
std::vector<std::string> write_attention_report(const std::string& dir, const AttentionReport& report,
                                                bool per_head = true, const PictureOptions& pictures = {});

}  // namespace qkv::viz
