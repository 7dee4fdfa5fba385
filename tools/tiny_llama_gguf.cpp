// A tiny random-weight llama-architecture model (2 layers, 64 channels, an SPM vocabulary of 265 tokens: 3 specials,
// 256 byte tokens, 6 words) written as F32 GGUF by qkv's GgufWriter, for llama.cpp to load and quantize (tools/llamacpp.c)
// and for qkv to read back. A developer tool, not built by CMake:
//   g++ -std=c++20 -O1 -Iinclude tools/tiny_llama_gguf.cpp build/libqkv_core.a build/libqkv_kernels.a -fopenmp -o tiny_llama_gguf
//   ./tiny_llama_gguf tiny-f32.gguf
#include "qkv/io/gguf.hpp"
#include <cstdio>
#include <random>
#include <vector>
using namespace qkv::io;
int main(int, char** argv) {
  const int C = 64, H = 4, KV = 2, D = C / H, F = 128, L = 2;
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) { char s[8]; snprintf(s, sizeof s, "<0x%02X>", b); tokens.push_back(s); types.push_back(6); scores.push_back(0); }
  for (const char* w : {"\u2581hello", "\u2581world", "\u2581the", "\u2581a", "\u2581cat", "\u2581sat"}) { tokens.push_back(w); types.push_back(1); scores.push_back(-1.0f * tokens.size()); }
  const int V = tokens.size();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 0.5f);
  std::vector<std::vector<float>> store;
  std::vector<GgufTensorData> tensors;
  auto add = [&](std::string name, std::vector<int64_t> dims, bool ones = false) {
    int64_t n = 1; for (auto d : dims) n *= d;
    std::vector<float> v(n); for (auto& x : v) x = ones ? 1.f : normal(rng);
    store.push_back(std::move(v));
  };
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {{"token_embd.weight", {C, V}}, {"output_norm.weight", {C}}, {"output.weight", {C, V}}};
  for (int l = 0; l < L; ++l) {
    std::string p = "blk." + std::to_string(l) + ".";
    for (auto s : std::vector<std::pair<std::string, std::vector<int64_t>>>{{p + "attn_norm.weight", {C}}, {p + "attn_q.weight", {C, C}}, {p + "attn_k.weight", {C, KV * D}},
          {p + "attn_v.weight", {C, KV * D}}, {p + "attn_output.weight", {C, C}}, {p + "ffn_norm.weight", {C}}, {p + "ffn_gate.weight", {C, F}},
          {p + "ffn_up.weight", {C, F}}, {p + "ffn_down.weight", {F, C}}}) specs.push_back(s);
  }
  for (auto& [name, dims] : specs) add(name, dims, dims.size() == 1);
  for (size_t i = 0; i < specs.size(); ++i) tensors.push_back({specs[i].first, specs[i].second, GgmlType::F32, std::as_bytes(std::span(store[i]))});
  save_gguf(argv[1],
            {{"general.architecture", GgufValue::string("llama")}, {"general.name", GgufValue::string("qkv tiny llama")},
             {"llama.context_length", GgufValue::u32(256)}, {"llama.embedding_length", GgufValue::u32(C)},
             {"llama.block_count", GgufValue::u32(L)}, {"llama.feed_forward_length", GgufValue::u32(F)},
             {"llama.attention.head_count", GgufValue::u32(H)}, {"llama.attention.head_count_kv", GgufValue::u32(KV)},
             {"llama.rope.dimension_count", GgufValue::u32(D)}, {"llama.rope.freq_base", GgufValue::f32(10000.f)},
             {"llama.attention.layer_norm_rms_epsilon", GgufValue::f32(1e-5f)}, {"general.file_type", GgufValue::u32(0)},
             {"tokenizer.ggml.model", GgufValue::string("llama")}, {"tokenizer.ggml.tokens", GgufValue::strings(tokens)},
             {"tokenizer.ggml.scores", GgufValue::f32s(scores)}, {"tokenizer.ggml.token_type", GgufValue::i32s(types)},
             {"tokenizer.ggml.bos_token_id", GgufValue::u32(1)}, {"tokenizer.ggml.eos_token_id", GgufValue::u32(2)},
             {"tokenizer.ggml.unknown_token_id", GgufValue::u32(0)}},
            tensors);
  printf("wrote %s: %d tensors, vocab %d\n", argv[1], (int)tensors.size(), V);
}
