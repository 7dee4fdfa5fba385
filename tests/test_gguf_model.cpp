// GGUF files as decoders: llama.cpp's own quantized file gives llama.cpp's greedy tokens, its matrices mapped as
// stored; a file written from a qkv model (llama.cpp's names, q/k rows permuted as its converter does) gives the
// model's logits back; files qkv cannot run are refused with the reason.
// Not here: the GGUF reader's own checks (test_gguf.cpp), the products (test_quant.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <random>

#include "helpers.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/io/gguf.hpp"
#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/gguf_model.hpp"
#include "qkv/nn/pretrained.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// Greedy continuation by full forward passes (the fixture is tiny).
std::vector<int64_t> greedy(const nn::Decoder& model, std::vector<int64_t> ids, int n) {
  NoGradGuard no_grad;
  std::vector<int64_t> out;
  for (int step = 0; step < n; ++step) {
    const Tensor logits = model.forward(ids, 1, static_cast<int64_t>(ids.size()));
    const int64_t V = logits.size(-1);
    const float* last = logits.data() + (static_cast<int64_t>(ids.size()) - 1) * V;
    const int64_t next = std::max_element(last, last + V) - last;
    out.push_back(next);
    ids.push_back(next);
  }
  return out;
}

// Writes tools/tiny_llama_gguf.cpp's model (the same draws, so the same bytes): a random llama of 2 layers, 64 channels
// and an SPM vocabulary of 265 tokens, in float32.
void write_tiny_llama(const std::string& path) {
  const int C = 64, H = 4, KV = 2, D = C / H, F = 128, L = 2;
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char s[8];
    std::snprintf(s, sizeof s, "<0x%02X>", b);
    tokens.push_back(s), types.push_back(6), scores.push_back(0);
  }
  for (const char* w : {"\u2581hello", "\u2581world", "\u2581the", "\u2581a", "\u2581cat", "\u2581sat"})
    tokens.push_back(w), types.push_back(1), scores.push_back(-1.0f * static_cast<float>(tokens.size()));
  const int V = static_cast<int>(tokens.size());
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 0.5f);
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
      {"token_embd.weight", {C, V}}, {"output_norm.weight", {C}}, {"output.weight", {C, V}}};
  for (int l = 0; l < L; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    for (const auto& s : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {p + "attn_norm.weight", {C}}, {p + "attn_q.weight", {C, C}}, {p + "attn_k.weight", {C, KV * D}},
             {p + "attn_v.weight", {C, KV * D}}, {p + "attn_output.weight", {C, C}}, {p + "ffn_norm.weight", {C}},
             {p + "ffn_gate.weight", {C, F}}, {p + "ffn_up.weight", {C, F}}, {p + "ffn_down.weight", {F, C}}})
      specs.push_back(s);
  }
  std::vector<std::vector<float>> store;
  for (const auto& [name, dims] : specs) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dims.size() == 1 ? 1.f : normal(rng);
    store.push_back(std::move(v));
  }
  std::vector<io::GgufTensorData> tensors;
  for (size_t i = 0; i < specs.size(); ++i)
    tensors.push_back({specs[i].first, specs[i].second, io::GgmlType::F32, std::as_bytes(std::span(store[i]))});
  io::save_gguf(path,
                {{"general.architecture", io::GgufValue::string("llama")}, {"general.name", io::GgufValue::string("qkv tiny llama")},
                 {"llama.context_length", io::GgufValue::u32(256)}, {"llama.embedding_length", io::GgufValue::u32(C)},
                 {"llama.block_count", io::GgufValue::u32(L)}, {"llama.feed_forward_length", io::GgufValue::u32(F)},
                 {"llama.attention.head_count", io::GgufValue::u32(H)}, {"llama.attention.head_count_kv", io::GgufValue::u32(KV)},
                 {"llama.rope.dimension_count", io::GgufValue::u32(D)}, {"llama.rope.freq_base", io::GgufValue::f32(10000.f)},
                 {"llama.attention.layer_norm_rms_epsilon", io::GgufValue::f32(1e-5f)}, {"general.file_type", io::GgufValue::u32(0)},
                 {"tokenizer.ggml.model", io::GgufValue::string("llama")}, {"tokenizer.ggml.tokens", io::GgufValue::strings(tokens)},
                 {"tokenizer.ggml.scores", io::GgufValue::f32s(scores)}, {"tokenizer.ggml.token_type", io::GgufValue::i32s(types)},
                 {"tokenizer.ggml.bos_token_id", io::GgufValue::u32(1)}, {"tokenizer.ggml.eos_token_id", io::GgufValue::u32(2)},
                 {"tokenizer.ggml.unknown_token_id", io::GgufValue::u32(0)}},
                tensors);
}

// llama.cpp's prompt ids for "hello world the cat" in the tiny vocabulary (<s> and byte tokens).
const std::vector<int64_t> kPrompt = {1,   229, 153, 132, 107, 104, 111, 111, 114, 229, 153, 132, 122, 114, 117,
                                      111, 103, 229, 153, 132, 119, 107, 104, 229, 153, 132, 102, 100, 119};

// The float32 file gives llama.cpp's greedy tokens, token for token (llama.cpp through node-llama-cpp 3.22.1's libllama:
//   ./tiny_llama_gguf tiny-f32.gguf; tools/llamacpp.sh generate tiny-f32.gguf "hello world the cat" 12 1).
TEST(GgufModel, LlamaCppsFloat32FileGivesLlamaCppsGreedyTokens) {
  const fs::path path = fs::temp_directory_path() / "qkv-gguf-tiny-f32.gguf";
  write_tiny_llama(path.string());
  const auto model = nn::load_gguf_decoder(path.string());
  fs::remove(path);  // mapped: the model keeps the file's pages
  EXPECT_EQ(model->head.weight_type(), kernels::WeightType::F32);
  EXPECT_EQ(greedy(*model, kPrompt, 12), (std::vector<int64_t>{103, 145, 184, 262, 62, 230, 145, 30, 231, 62, 150, 200}));
}

// The same model quantized by llama.cpp (llama_model_quantize, Q4_K_M: its 64-value rows take Q5_0 and Q8_0), its
// matrices used as stored. llama.cpp's greedy tokens (tools/llamacpp.sh generate tests/fixtures/gguf/
// tiny-llama-q4_k_m.gguf "hello world the cat" 12 1) fed back one by one: qkv's next token is llama.cpp's at 11 of the
// 12 steps, and at the other llama.cpp's token is within 2% of the logits' range of qkv's first (this random model
// amplifies every rounding: llama.cpp keeps its KV cache in f16; the float32 file above agrees at every step).
TEST(GgufModel, LlamaCppsQuantizedFileAgreesWithLlamaCppsGreedyTokens) {
  const std::string path = fixture("gguf/tiny-llama-q4_k_m.gguf");
  EXPECT_EQ(nn::detect_checkpoint_format(path), nn::CheckpointFormat::Gguf);
  const auto model = nn::load_gguf_decoder(path);
  const nn::DecoderConfig& c = model->config;
  EXPECT_EQ(c.family, &nn::family("llama"));
  EXPECT_EQ(c.vocab_size, 265);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_NEAR(c.norm_eps, 1e-5, 1e-11);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  // Q8_0 tensors are used where the file is mapped (no copy); Q5_0 ones became Q8_0 (exactly), token_embd too
  const io::GgufFile file = io::GgufFile::open(path);
  const auto mapped = [&](const Tensor& t, const char* name) {
    return std::memcmp(t.stored_bytes(), file.tensor(name).data, file.tensor(name).bytes) == 0;
  };
  EXPECT_EQ(model->head.weight_type(), kernels::WeightType::Q8_0);
  EXPECT_TRUE(mapped(model->head, "output.weight"));
  EXPECT_EQ(model->blocks[1][nn::Role::Down].weight_type(), kernels::WeightType::Q8_0);
  EXPECT_TRUE(mapped(model->blocks[1][nn::Role::Down], "blk.1.ffn_down.weight"));
  EXPECT_EQ(model->blocks[0][nn::Role::Down].weight_type(), kernels::WeightType::Q8_0);  // Q5_0 in the file
  EXPECT_EQ(model->tok_emb.weight_type(), kernels::WeightType::Q8_0);
  const std::vector<int64_t> llama_cpp = {103, 145, 249, 193, 32, 179, 238, 32, 252, 160, 162, 145};
  std::vector<int64_t> ids = kPrompt;
  int agree = 0;
  NoGradGuard no_grad;
  for (int64_t want : llama_cpp) {
    const Tensor logits = model->forward(ids, 1, static_cast<int64_t>(ids.size()));
    const int64_t V = logits.size(-1);
    const float* last = logits.data() + (static_cast<int64_t>(ids.size()) - 1) * V;
    const float top = *std::max_element(last, last + V), bottom = *std::min_element(last, last + V);
    agree += last[want] == top;
    EXPECT_GE(last[want], top - 0.02f * (top - bottom)) << "step " << ids.size() - kPrompt.size();
    ids.push_back(want);
  }
  EXPECT_GE(agree, 11);
}

// load_pretrained takes a .gguf whole: its model and the tokenizer from its metadata, which gives llama.cpp's prompt ids.
TEST(GgufModel, LoadPretrainedReadsTheModelAndItsTokenizer) {
  const auto m = nn::load_pretrained(fixture("gguf/tiny-llama-q4_k_m.gguf"));
  EXPECT_EQ(m->format, nn::CheckpointFormat::Gguf);
  ASSERT_TRUE(m->tokenizer);
  EXPECT_EQ(m->tokenizer->encode("hello world the cat"), kPrompt);
  EXPECT_EQ(m->stop_ids, std::vector<int64_t>{2});
  EXPECT_EQ(m->model->tok_emb.weight_type(), kernels::WeightType::Q8_0);
}

// A llama model of qkv written as llama.cpp's converter writes it (names, q and k rows interleaved for its RoPE,
// float32) loads back with the same logits, bit for bit; a Gemma 3 model's norms are written with the 1 added and
// read back without it.
TEST(GgufModel, AFileWrittenAsLlamaCppsConverterDoesGivesTheModelBack) {
  for (const char* family : {"llama", "gemma3"}) {
    nn::DecoderConfig c;
    c.family = &nn::family(family);
    const bool gemma = std::string(family) == "gemma3";
    c.vocab_size = 40, c.hidden_size = 32, c.intermediate_size = 48, c.num_layers = 2, c.num_heads = 4, c.num_kv_heads = 2;
    c.head_dim = 8, c.max_positions = 64, c.norm_eps = 1e-5;
    c.ropes = {kernels::RopeFrequencies{.theta = 10000.0}};
    c.layers = {{0, 0}, {0, 0}};
    if (gemma) {
      c.norm = nn::NormKind::GemmaRMSNorm, c.mlp = nn::MlpKind::GeGLU, c.placement = nn::NormPlacement::Sandwich;
      c.qk_norm = nn::QkNorm::PerHead, c.tie_word_embeddings = true, c.embedding_scale = std::sqrt(32.0);
      c.attention_scale = 1.0 / std::sqrt(8.0);
      c.ropes.push_back(kernels::RopeFrequencies{.theta = 10000.0});
    }
    c.bos_token_id = 1, c.eos_token_ids = {2};
    Generator gen(9);
    nn::Decoder model(c, gen);
    for (const nn::DecoderConfig::Parameter& p : c.layout()) {  // norms away from their identity, so the +1 shows
      if (p.shape.rank() == 1) {
        Tensor& t = model.parameter(p);
        for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = 0.1f * static_cast<float>(i % 7) - 0.2f;
      }
    }
    std::vector<std::vector<float>> store;
    std::vector<io::GgufTensorData> tensors;
    const auto own = c.layout(), names = c.layout(nn::Names::Gguf);
    for (size_t i = 0; i < own.size(); ++i) {
      const Tensor& t = model.parameter(own[i]);
      std::vector<float> v = t.to_vector();
      if (!gemma && (own[i].role() == nn::Role::Query || own[i].role() == nn::Role::Key)) {
        // convert_hf_to_gguf's permute: file row h·D + 2i + s = model row h·D + s·D/2 + i
        const int64_t D = c.head_dim, rows = t.size(0), cols = t.size(1);
        std::vector<float> p(v.size());
        for (int64_t h = 0; h < rows / D; ++h)
          for (int64_t s = 0; s < 2; ++s)
            for (int64_t k = 0; k < D / 2; ++k)
              std::copy_n(v.data() + (h * D + s * D / 2 + k) * cols, cols, p.data() + (h * D + 2 * k + s) * cols);
        v = p;
      }
      if (gemma && own[i].shape.rank() == 1 && own[i].role() != nn::Role::QueryBias)
        for (float& x : v) x += 1.0f;
      store.push_back(std::move(v));
      std::vector<int64_t> dims(own[i].shape.dims().rbegin(), own[i].shape.dims().rend());
      tensors.push_back({names[i].name, dims, io::GgmlType::F32, {}});
    }
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].bytes = std::as_bytes(std::span(store[i]));
    const std::string arch = c.family->gguf_architecture;
    std::vector<std::pair<std::string, io::GgufValue>> meta = {
        {"general.architecture", io::GgufValue::string(arch)},
        {arch + ".context_length", io::GgufValue::u32(64)},
        {arch + ".embedding_length", io::GgufValue::u32(32)},
        {arch + ".block_count", io::GgufValue::u32(2)},
        {arch + ".feed_forward_length", io::GgufValue::u32(48)},
        {arch + ".attention.head_count", io::GgufValue::u32(4)},
        {arch + ".attention.head_count_kv", io::GgufValue::u32(2)},
        {arch + ".attention.key_length", io::GgufValue::u32(8)},
        {arch + ".rope.freq_base", io::GgufValue::f32(10000.0f)},
        {arch + ".attention.layer_norm_rms_epsilon", io::GgufValue::f32(1e-5f)},
        {"tokenizer.ggml.bos_token_id", io::GgufValue::u32(1)},
        {"tokenizer.ggml.eos_token_id", io::GgufValue::u32(2)}};
    const fs::path path = fs::temp_directory_path() / (std::string("qkv-gguf-model-") + family + ".gguf");
    io::save_gguf(path.string(), meta, tensors);
    const auto loaded = nn::load_gguf_decoder(path.string());
    EXPECT_EQ(loaded->config.family, c.family) << family;
    EXPECT_EQ(loaded->config.tie_word_embeddings, c.tie_word_embeddings) << family;
    const std::vector<int64_t> ids = {1, 5, 9, 33, 2, 17, 8};
    NoGradGuard no_grad;
    const Tensor want = model.forward(ids, 1, 7), got = loaded->forward(ids, 1, 7);
    EXPECT_TRUE(all_close(got, want, 1e-5, 1e-5)) << family;
    fs::remove(path);
  }
}

// A file qkv cannot run says why: an architecture it lacks, a missing tensor, a type it cannot compute with.
TEST(GgufModel, FilesQkvCannotRunAreRefusedWithTheReason) {
  const fs::path path = fs::temp_directory_path() / "qkv-gguf-model-bad.gguf";
  std::vector<float> table(8 * 4, 0.5f);
  const std::vector<io::GgufTensorData> tensors = {{"token_embd.weight", {4, 8}, io::GgmlType::F32, std::as_bytes(std::span(table))}};
  auto expect_refusal = [&](const std::vector<std::pair<std::string, io::GgufValue>>& meta, const char* words) {
    io::save_gguf(path.string(), meta, tensors);
    try {
      (void)nn::load_gguf_decoder(path.string());
      ADD_FAILURE() << "loaded; expected a refusal naming " << words;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_refusal({{"general.architecture", io::GgufValue::string("mamba")}}, "general.architecture is 'mamba'");
  expect_refusal({{"general.architecture", io::GgufValue::string("llama")}}, "llama.embedding_length");
  expect_refusal({{"general.architecture", io::GgufValue::string("llama")}, {"llama.embedding_length", io::GgufValue::u32(4)},
                  {"llama.feed_forward_length", io::GgufValue::u32(8)}, {"llama.block_count", io::GgufValue::u32(1)},
                  {"llama.attention.head_count", io::GgufValue::u32(2)}, {"llama.context_length", io::GgufValue::u32(16)}},
                 "has no tensor 'blk.0.attn_q.weight'");
  fs::remove(path);
}

}  // namespace
}  // namespace qkv::test
