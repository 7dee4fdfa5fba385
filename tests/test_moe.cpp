// Mixture-of-experts and latent-attention models: the qwen3_moe and deepseek_v3 families' config keys and layout
// (their logits, loss, gradients and greedy text against PyTorch run in test_decoder.cpp's family table), the
// layer's routing, latent attention's absorbed decoding against its expanded form, and bad configs refused naming
// the key.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <fstream>

#include "helpers.hpp"
#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/weights.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/gguf_export.hpp"
#include "qkv/nn/gguf_model.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// config.json of a family's fixture with one key's text replaced
std::string edited_in(const std::string& family, const std::string& from, const std::string& to) {
  std::string c = read(fs::path(fixture("hf/" + family)) / "config.json");
  const size_t at = c.find(from);
  if (at == std::string::npos) ADD_FAILURE() << from << " not in " << family << "'s config.json";
  return at == std::string::npos ? c : c.replace(at, from.size(), to);
}
std::string edited(const std::string& from, const std::string& to) { return edited_in("qwen3_moe", from, to); }

std::string refusal(const std::string& json) {
  try {
    nn::decoder_config_from_hf(json);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(MoeFamily, ReadsTheExpertsAndWhichLayersHaveThem) {
  const auto model = nn::load_hf_decoder(fixture("hf/qwen3_moe"));
  const nn::DecoderConfig& c = model->config;
  EXPECT_EQ(c.family->name, "qwen3_moe");
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.experts_per_token, 2);
  EXPECT_EQ(c.expert_intermediate_size, 12);
  EXPECT_TRUE(c.norm_topk_prob);
  ASSERT_EQ(c.layers.size(), 3u);
  EXPECT_TRUE(c.layers[0].experts);
  EXPECT_FALSE(c.layers[1].experts);  // mlp_only_layers: [1]
  EXPECT_TRUE(c.layers[2].experts);
  // the layout names each expert's projections as transformers' state dict does
  int64_t experts = 0;
  for (const auto& p : c.layout())
    if (p.expert >= 0) ++experts;
  EXPECT_EQ(experts, 2 * 4 * 3);
  EXPECT_EQ(model->blocks[0].expert_gate.size(), 4u);
  EXPECT_TRUE(model->blocks[1].expert_gate.empty());
  bool found = false;
  for (const auto& [name, t] : model->named_parameters())
    if (name == "model.layers.2.mlp.experts.3.down_proj.weight") found = t.shape() == Shape{32, 12};
  EXPECT_TRUE(found);
  EXPECT_EQ(nn::decoder_config_from_hf(nn::decoder_config_to_hf(c)), c);  // written back, read the same
  // a new model of this config (Hugging Face's initialisation) runs and its loss falls from ln V
  nn::DecoderConfig fresh = c;
  fresh.source = {};
  Generator gen(7);
  nn::Decoder made(fresh, gen);
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6}, targets = {2, 3, 4, 5, 6, 7};
  // its loss: ln V, plus the load-balancing loss (≈ k for a router still near uniform) × router_aux_loss_coef
  EXPECT_EQ(c.router_aux_loss_coef, 0.05);
  EXPECT_NEAR(made.loss(ids, 1, 6, targets).item(), std::log(72.0) + 0.05 * 2.0, 0.05);
}

// The load-balancing loss by hand: two tokens, three experts, top 1. Token 0's probabilities (0.5, 0.3, 0.2) choose
// expert 0, token 1's (0.1, 0.2, 0.7) expert 2: f = (1/2, 0, 1/2), P = (0.3, 0.25, 0.45), so the loss is
// 3 · (0.15 + 0 + 0.225) = 1.125, and d/dP_e = 3 · f_e reaches the logits through each row's softmax. Without
// output_router_logits in config.json the training loss is the cross-entropy alone (transformers' default).
TEST(MoeFamily, TheLoadBalancingLossIsSwitchTransformersAndOnlyWhenAsked) {
  const Tensor probs = Tensor::from({0.5f, 0.3f, 0.2f, 0.1f, 0.2f, 0.7f}, {2, 3});
  Tensor logits = Tensor::empty({2, 3});
  for (int64_t i = 0; i < 6; ++i) logits.data()[i] = std::log(probs.data()[i]);
  logits.requires_grad_();
  const Tensor aux = nn::load_balancing_loss({logits}, 1);
  EXPECT_NEAR(aux.item(), 1.125, 1e-6);
  aux.backward();
  // d aux / d logit_nj = Σ_e (3 f_e / N) · p_ne (δ_ej − p_nj) = (3 / N) · p_nj · (f_j − Σ_e f_e p_ne)
  const float f[3] = {0.5f, 0.0f, 0.5f};
  for (int64_t n = 0; n < 2; ++n) {
    float fp = 0.0f;
    for (int64_t e = 0; e < 3; ++e) fp += f[e] * probs.data()[n * 3 + e];
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_NEAR(logits.grad().data()[n * 3 + j], 1.5f * probs.data()[n * 3 + j] * (f[j] - fp), 1e-6) << n << " " << j;
  }
  EXPECT_THROW(nn::load_balancing_loss({logits}, 4), ShapeError);
  // Without output_router_logits: no load-balancing loss in the config, and so none in the loss
  const nn::DecoderConfig plain = nn::decoder_config_from_hf(edited("\"output_router_logits\": true", "\"output_router_logits\": false"));
  EXPECT_EQ(plain.router_aux_loss_coef, 0.0);
  const nn::DecoderConfig asked = nn::decoder_config_from_hf(read(fs::path(fixture("hf/qwen3_moe")) / "config.json"));
  auto model = nn::load_hf_decoder(fixture("hf/qwen3_moe"));
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6}, targets = {2, 3, 4, 5, 6, 7};
  const float with = model->loss(ids, 1, 6, targets).item();
  const float without = nn::language_model_loss(model->forward(ids, 1, 6), targets).item();
  EXPECT_GT(with - without, 0.05f * 0.99f) << "the fixture's coefficient 0.05 × a loss of at least 1 (k = 2 here)";
  EXPECT_EQ(asked.router_aux_loss_coef, 0.05);
}

TEST(MoeFamily, BadConfigsAreRefusedNamingTheKey) {
  EXPECT_NE(refusal(edited("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5")).find("num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(refusal(edited("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 0")).find("num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(refusal(edited("\"moe_intermediate_size\": 12", "\"moe_intermediate_size\": 0")).find("moe_intermediate_size"),
            std::string::npos);
  EXPECT_NE(refusal(edited("\"mlp_only_layers\": [\n    1\n  ]", "\"mlp_only_layers\": [7]")).find("mlp_only_layers"),
            std::string::npos);
  EXPECT_NE(refusal(edited("\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 0")).find("decoder_sparse_step"),
            std::string::npos);
}

TEST(MoeFamily, AMissingExpertTensorIsListed) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_moe_missing_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // four experts in the weights, five in the config: expert 4 of layers 0 and 2 is missing
  std::ofstream(dir / "config.json") << edited("\"num_experts\": 4", "\"num_experts\": 5");
  fs::copy(fs::path(fixture("hf/qwen3_moe")) / "model.safetensors", dir / "model.safetensors");
  std::string message = "(loaded)";
  try {
    nn::load_hf_decoder(dir.string());
  } catch (const IoError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("model.layers.0.mlp.experts.4.gate_proj.weight"), std::string::npos) << message;
  fs::remove_all(dir);
}

std::string edited_gpt_oss(const std::string& from, const std::string& to) { return edited_in("gpt_oss", from, to); }

TEST(GptOssFamily, ReadsItsKeysAndLayout) {
  const auto model = nn::load_hf_decoder(fixture("hf/gpt_oss"));
  const nn::DecoderConfig& c = model->config;
  EXPECT_EQ(c.family->name, "gpt_oss");
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.experts_per_token, 2);
  EXPECT_EQ(c.expert_intermediate_size, 12);  // gpt-oss's intermediate_size is the experts' width
  EXPECT_EQ(c.swiglu_limit, 1.0);
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
  EXPECT_EQ(c.layers[0].window, 4);  // layer_types: sliding, then full
  EXPECT_EQ(c.layers[1].window, 0);
  EXPECT_TRUE(c.layers[0].experts && c.layers[1].experts);
  EXPECT_FALSE(c.ropes[0].truncate);
  EXPECT_EQ(c.router_aux_loss_coef, 0.05);
  EXPECT_EQ(model->parameter(nn::Role::Sinks, 0).shape(), (Shape{4}));
  EXPECT_EQ(model->parameter(nn::Role::StackedGateUp, 1).shape(), (Shape{4, 32, 24}));
  EXPECT_EQ(model->parameter(nn::Role::StackedDown, 1).shape(), (Shape{4, 12, 32}));
}

TEST(GptOssFamily, BadConfigsAreRefusedNamingTheKey) {
  EXPECT_NE(refusal(edited_gpt_oss("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5")).find("num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(refusal(edited_gpt_oss("\"num_local_experts\": 4", "\"num_local_experts\": 0")).find("num_local_experts"),
            std::string::npos);
  EXPECT_NE(refusal(edited_gpt_oss("\"swiglu_limit\": 1.0", "\"swiglu_limit\": -1")).find("swiglu_limit"), std::string::npos);
  EXPECT_NE(refusal(edited_gpt_oss("\"rope_type\": \"yarn\"", "\"rope_type\": \"ntk\"")).find("rope_type"), std::string::npos);
}

// gpt-oss-120b's experts in float32 (458 GB) are refused before anything is allocated, saying why; the tiny folder's
// fit.
TEST(GptOssFamily, ExpertsTooLargeToWidenAreRefusedFirst) {
  std::string big = edited_gpt_oss("\"num_local_experts\": 4", "\"num_local_experts\": 128");
  for (auto [from, to] : {std::pair{"\"hidden_size\": 32", "\"hidden_size\": 2880"},
                          {"\"intermediate_size\": 12", "\"intermediate_size\": 2880"},
                          {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": 36"}}) {
    const size_t at = big.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    big.replace(at, std::string(from).size(), to);
  }
  const size_t types = big.find("\"layer_types\"");
  big.replace(types, big.find(']', types) + 1 - types, "\"sliding_window\": 4");  // the default pattern for 36 layers
  const nn::DecoderConfig config = nn::decoder_config_from_hf(big);
  try {
    nn::check_stacked_experts_fit(config);
    ADD_FAILURE() << "458 GB of experts were accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("experts widened to float32 need 458 GB"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(nn::check_stacked_experts_fit(nn::load_hf_decoder(fixture("hf/gpt_oss"))->config));
}

TEST(GptOssFamily, AMissingExpertTensorIsListed) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_gpt_oss_missing_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // five experts in the config, four in the weights: every stacked tensor has the wrong shape
  std::ofstream(dir / "config.json") << edited_gpt_oss("\"num_local_experts\": 4", "\"num_local_experts\": 5");
  fs::copy(fs::path(fixture("hf/gpt_oss")) / "model.safetensors", dir / "model.safetensors");
  std::string message = "(loaded)";
  try {
    nn::load_hf_decoder(dir.string());
  } catch (const IoError& e) {
    message = e.what();
  }
  fs::remove_all(dir);
  EXPECT_NE(message.find("model.layers.0.mlp.experts.gate_up_proj is (4, 32, 24), the configuration says (5, 32, 24)"),
            std::string::npos) << message;
}

// A gpt-oss folder as OpenAI publishes them: the experts' matrices as MXFP4 (gate_up_proj_blocks, _scales …, in
// transformers' packing: byte i of a block holds values 2i and 2i + 1), config.json with its quantization_config. Made
// from a float32 model whose experts are rounded to MXFP4, which it returns beside the folder: the reference.
struct Mxfp4Folder {
  fs::path dir;
  std::unique_ptr<nn::Decoder> rounded;  // the float32 model with the experts' MXFP4 values
  std::map<std::string, std::vector<unsigned char>> ggml_rows;  // each stacked matrix as ggml's MXFP4 rows
};
Mxfp4Folder mxfp4_folder(const std::string& tag) {
  Mxfp4Folder out;
  out.dir = fs::temp_directory_path() / ("qkv_gpt_oss_mxfp4_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(out.dir);
  fs::create_directories(out.dir);
  std::string config = edited_gpt_oss("\"intermediate_size\": 12", "\"intermediate_size\": 32");
  config.insert(config.rfind('}'), R"(, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
      ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})");
  Generator gen(5);
  out.rounded = std::make_unique<nn::Decoder>(nn::decoder_config_from_hf(config), gen);
  nn::Decoder& m = *out.rounded;
  std::vector<io::TensorData> tensors;
  for (const nn::DecoderConfig::Parameter& p : m.config.layout()) {
    Tensor& t = m.parameter(p);
    if (p.role() != nn::Role::StackedGateUp && p.role() != nn::Role::StackedDown) {
      tensors.push_back(io::TensorData::from_tensor(p.name, t));
      continue;
    }
    const int64_t E = p.shape[0], K = p.shape[1], R = p.shape[2];  // (E, K, R) used as x·W: rows of R outputs
    std::vector<float> rows(static_cast<size_t>(E * R * K));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < K; ++k) rows[static_cast<size_t>((e * R + r) * K + k)] = t.data()[(e * K + k) * R + r];
    std::vector<unsigned char>& q = out.ggml_rows[p.name];
    q.resize(static_cast<size_t>(E * R * kernels::row_bytes(kernels::WeightType::MXFP4, K)));
    kernels::quantize_rows(kernels::WeightType::MXFP4, rows.data(), q.data(), E * R, K);
    kernels::dequantize_rows(kernels::WeightType::MXFP4, q.data(), rows.data(), E * R, K);
    for (int64_t e = 0; e < E; ++e)  // the reference holds the rounded values
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < K; ++k) t.data()[(e * K + k) * R + r] = rows[static_cast<size_t>((e * R + r) * K + k)];
    // transformers' packing of the same codes and exponents
    const int64_t groups = E * R * K / 32;
    io::TensorData blocks{p.name + "_blocks", io::DType::U8, {E, R, K / 32, 16}, std::vector<std::byte>(groups * 16)};
    io::TensorData scales{p.name + "_scales", io::DType::U8, {E, R, K / 32}, std::vector<std::byte>(groups)};
    for (int64_t g = 0; g < groups; ++g) {
      const unsigned char* block = q.data() + g * 17;
      auto code = [&](int v) { return v < 16 ? block[1 + v] & 0x0f : block[1 + v - 16] >> 4; };
      scales.bytes[static_cast<size_t>(g)] = std::byte{block[0]};
      for (int i = 0; i < 16; ++i) blocks.bytes[static_cast<size_t>(g * 16 + i)] = std::byte(static_cast<unsigned char>(code(2 * i) | (code(2 * i + 1) << 4)));
    }
    tensors.push_back(std::move(blocks));
    tensors.push_back(std::move(scales));
  }
  io::save_safetensors((out.dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  std::ofstream(out.dir / "config.json") << config;
  return out;
}

// The published gpt-oss folders' MXFP4 experts are read and kept as MXFP4 (their bytes as ggml's blocks: the file's
// size, not 4× it widened), and give the logits of float32 experts holding the same values within the 8-bit
// activations' rounding, and the same greedy tokens.
TEST(GptOssFamily, Mxfp4ExpertsAreReadAndKeptAsMxfp4) {
  const Mxfp4Folder folder = mxfp4_folder("read");
  const auto model = nn::load_hf_decoder(folder.dir.string());
  for (int64_t layer = 0; layer < 2; ++layer)
    for (nn::Role role : {nn::Role::StackedGateUp, nn::Role::StackedDown}) {
      const Tensor& t = model->parameter(role, layer);
      const bool gate_up = role == nn::Role::StackedGateUp;
      EXPECT_EQ(t.weight_type(), kernels::WeightType::MXFP4);
      EXPECT_EQ(t.shape(), gate_up ? (Shape{4 * 64, 32}) : (Shape{4 * 32, 32}));  // E·2F × C, E·C × F
      const std::string name = "model.layers." + std::to_string(layer) + ".mlp.experts." + (gate_up ? "gate_up_proj" : "down_proj");
      const std::vector<unsigned char>& want = folder.ggml_rows.at(name);
      ASSERT_EQ(t.storage_bytes(), static_cast<int64_t>(want.size()));
      EXPECT_EQ(0, std::memcmp(t.stored_bytes(), want.data(), want.size())) << name << ": other bytes than ggml's rows";
    }
  const std::vector<int64_t> ids = {1, 5, 9, 2, 33, 7, 60, 12, 4, 4, 18};
  NoGradGuard no_grad;
  const Tensor got = model->forward(ids, 1, static_cast<int64_t>(ids.size()));
  const Tensor want = folder.rounded->forward(ids, 1, static_cast<int64_t>(ids.size()));
  float range = 0.0f, diff = 0.0f;
  for (int64_t i = 0; i < want.numel(); ++i) {
    range = std::max(range, std::fabs(want.data()[i]));
    diff = std::max(diff, std::fabs(got.data()[i] - want.data()[i]));
  }
  EXPECT_GT(diff, 0.0f);  // 8-bit activations: the stored path ran
  EXPECT_LT(diff, 0.02f * range);
  fs::remove_all(folder.dir);
}

// PyTorch's view of a published-style folder (tools/decoder_reference.py: random MXFP4 codes and exponents unpacked
// as transformers' convert_moe_packed_tensors unpacks them, then GptOss's forward): the same logits within the 8-bit
// activations' rounding (4.5% of their range measured), and PyTorch's greedy tokens or near ties.
TEST(GptOssFamily, Mxfp4FolderGivesPyTorchsLogitsAndGreedyText) {
  const auto model = nn::load_hf_decoder(fixture("hf/gpt_oss_mxfp4"));
  EXPECT_EQ(model->parameter(nn::Role::StackedGateUp, 0).weight_type(), kernels::WeightType::MXFP4);
  const io::SafetensorsFile expected = io::SafetensorsFile::open(fixture("hf/gpt_oss_mxfp4.expected.safetensors"));
  const std::vector<int64_t> ids = expected.int64s("ids");
  NoGradGuard no_grad;
  const Tensor got = model->forward(ids, 2, 12), want = expected.tensor("logits");
  ASSERT_EQ(got.numel(), want.numel());
  float range = 0.0f, diff = 0.0f;
  for (int64_t i = 0; i < want.numel(); ++i) {
    range = std::max(range, std::fabs(want.data()[i]));
    diff = std::max(diff, std::fabs(got.data()[i] - want.data()[i]));
  }
  EXPECT_LT(diff, 0.06f * range) << "range " << range;
  EXPECT_GT(diff, 0.0f);
  // The same experts widened to float32 (E, K, R) take the float32 path: PyTorch's logits to float32's rounding, so
  // the codes' order, the exponents and the transposition are transformers'
  auto widened = nn::load_hf_decoder(fixture("hf/gpt_oss_mxfp4"));
  for (nn::DecoderBlock& b : widened->blocks)
    for (nn::Role role : {nn::Role::StackedGateUp, nn::Role::StackedDown}) {
      const Tensor rows = b[role];
      const int64_t E = 4, R = role == nn::Role::StackedGateUp ? 64 : 32, K = rows.size(1);
      std::vector<float> values(static_cast<size_t>(rows.numel()));
      kernels::dequantize_rows(kernels::WeightType::MXFP4, rows.stored_bytes(), values.data(), E * R, K);
      Tensor t = Tensor::empty({E, K, R});
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t k = 0; k < K; ++k) t.data()[(e * K + k) * R + r] = values[static_cast<size_t>((e * R + r) * K + k)];
      b[role] = t;
    }
  const Tensor exact = widened->forward(ids, 2, 12);
  float exact_diff = 0.0f;
  for (int64_t i = 0; i < want.numel(); ++i) exact_diff = std::max(exact_diff, std::fabs(exact.data()[i] - want.data()[i]));
  EXPECT_LT(exact_diff, 1e-4f * range);
  // Saved as a float32 folder (qkv convert --to hf: the experts widened into gate_up_proj and down_proj): the widened
  // model's logits, bit for bit
  const fs::path saved = fs::temp_directory_path() / ("qkv_gpt_oss_mxfp4_saved_" + std::to_string(::getpid()));
  nn::save_hf_folder(saved.string(), *model);
  const Tensor reread = nn::load_hf_decoder(saved.string())->forward(ids, 2, 12);
  fs::remove_all(saved);
  EXPECT_EQ(0, std::memcmp(reread.data(), exact.data(), static_cast<size_t>(exact.numel()) * 4));
  // Written to GGUF (float32: the experts widened from their rows, split into llama.cpp's gate and up) and read back:
  // PyTorch's logits again
  const std::string path = (fs::temp_directory_path() / ("qkv_gpt_oss_mxfp4_" + std::to_string(::getpid()) + ".gguf")).string();
  nn::GgufExportOptions options;
  options.type = nn::GgufFileType::F32;
  nn::write_gguf(*model, {}, path, options);
  const Tensor from_gguf = nn::load_gguf_decoder(path)->forward(ids, 2, 12);
  fs::remove(path);
  float gguf_diff = 0.0f;
  for (int64_t i = 0; i < want.numel(); ++i) gguf_diff = std::max(gguf_diff, std::fabs(from_gguf.data()[i] - want.data()[i]));
  EXPECT_LT(gguf_diff, 1e-4f * range);
  // Greedy text, PyTorch's tokens fed back: each is qkv's best, or within 3% of the logits' range of it (two random
  // logits that close may swap under the 8-bit activations)
  std::vector<int64_t> sequence = expected.int64s("prompt");
  int same = 0;
  for (int64_t token : expected.int64s("greedy")) {
    const Tensor logits = model->forward(sequence, 1, static_cast<int64_t>(sequence.size()));
    const float* last = logits.data() + (static_cast<int64_t>(sequence.size()) - 1) * 80;
    const int64_t best = std::max_element(last, last + 80) - last;
    same += best == token;
    EXPECT_GE(last[token], last[best] - 0.03f * range) << "step " << sequence.size();
    sequence.push_back(token);
  }
  EXPECT_GE(same, 8);
}

// A folder whose MXFP4 pair is broken, or that names another quantization method, is refused naming the tensor or key
TEST(GptOssFamily, BrokenMxfp4TensorsAreRefusedByName) {
  const Mxfp4Folder folder = mxfp4_folder("broken");
  const io::SafetensorsFile file = io::SafetensorsFile::open((folder.dir / "model.safetensors").string());
  auto rewrite = [&](const std::function<bool(io::TensorData&)>& edit) {  // false: drop the tensor
    std::vector<io::TensorData> kept;
    for (const io::TensorInfo& info : file.tensors()) {
      const auto bytes = file.bytes(info);
      io::TensorData t{info.name, info.dtype, info.shape, std::vector<std::byte>(bytes.begin(), bytes.end())};
      if (edit(t)) kept.push_back(std::move(t));
    }
    const fs::path dir = folder.dir / "edited";
    fs::create_directories(dir);
    fs::copy_file(folder.dir / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    io::save_safetensors((dir / "model.safetensors").string(), kept);
    try {
      nn::load_hf_decoder(dir.string());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  const std::string missing = rewrite([](io::TensorData& t) { return t.name != "model.layers.1.mlp.experts.down_proj_scales"; });
  EXPECT_NE(missing.find("model.layers.1.mlp.experts.down_proj_blocks has no _scales beside it"), std::string::npos) << missing;
  const std::string misshapen = rewrite([](io::TensorData& t) {
    if (t.name == "model.layers.0.mlp.experts.gate_up_proj_scales") t.dtype = io::DType::I8;
    return true;
  });
  EXPECT_NE(misshapen.find("gate_up_proj_scales is I8 (4, 64, 1); for the configuration's (4, 32, 64) an MXFP4 tensor is U8 (4, 64, 1)"),
            std::string::npos) << misshapen;
  std::string gptq = refusal(edited_gpt_oss("\"num_local_experts\": 4", "\"quantization_config\": {\"quant_method\": \"gptq\"}, \"num_local_experts\": 4"));
  EXPECT_NE(gptq.find("'quantization_config' names quant_method 'gptq'"), std::string::npos) << gptq;
  fs::remove_all(folder.dir);
}

std::string edited_latent(const std::string& from, const std::string& to) { return edited_in("deepseek_v3", from, to); }

TEST(LatentFamily, ReadsTheLatentAttentionAndTheRouter) {
  const auto model = nn::load_hf_decoder(fixture("hf/deepseek_v3"));
  const nn::DecoderConfig& c = model->config;
  EXPECT_EQ(c.family->name, "deepseek_v3");
  EXPECT_TRUE(c.latent());
  EXPECT_EQ(c.kv_lora_rank, 16);
  EXPECT_EQ(c.q_lora_rank, 12);
  EXPECT_EQ(c.qk_nope_head_dim, 8);
  EXPECT_EQ(c.head_dim, 4);  // qk_rope_head_dim
  EXPECT_EQ(c.v_head_dim, 6);
  EXPECT_EQ(c.rope_layout, RopeLayout::Interleaved);
  const double mscale = 0.1 * std::log(4.0) + 1.0;  // yarn_get_mscale(factor 4, mscale_all_dim 1)
  EXPECT_NEAR(c.attention_scale, mscale * mscale / std::sqrt(12.0), 1e-12);
  EXPECT_TRUE(c.sigmoid_router);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.expert_groups, 4);
  EXPECT_EQ(c.expert_groups_kept, 2);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.shared_expert_intermediate_size, 10);
  ASSERT_EQ(c.layers.size(), 3u);
  EXPECT_FALSE(c.layers[0].experts);  // first_k_dense_replace: 1
  EXPECT_TRUE(c.layers[1].experts);
  bool bias = false, kv_b = false;
  for (const auto& [name, t] : model->named_parameters()) {
    if (name == "model.layers.2.mlp.gate.e_score_correction_bias") bias = t.shape() == Shape{8};
    if (name == "model.layers.0.self_attn.kv_b_proj.weight") kv_b = t.shape() == Shape{4 * (8 + 6), 16};
  }
  EXPECT_TRUE(bias);
  EXPECT_TRUE(kv_b);
  EXPECT_EQ(nn::decoder_config_from_hf(nn::decoder_config_to_hf(c)), c);
}

// The logits of a whole forward's last token, and of absorbed and expanded decoding from the cache (a prompt in one
// chunk, then one token at a time), agree; the absorbed cache holds kv_lora_rank + qk_rope_head_dim values a token.
void expect_same_decoding(nn::Decoder& model, const std::vector<int64_t>& tokens) {
  model.eval();
  NoGradGuard no_grad;
  const int64_t prompt = 5, L = model.config.num_layers, n = static_cast<int64_t>(tokens.size());
  std::vector<std::vector<float>> logits[2];
  int64_t bytes[2] = {0, 0};
  for (int mode = 0; mode < 2; ++mode) {
    model.latent_decode = mode == 0 ? nn::Decoder::LatentDecode::Absorbed : nn::Decoder::LatentDecode::Expanded;
    nn::KVCache cache = model.make_cache(1, 32);
    bytes[mode] = cache.bytes();
    logits[mode].push_back(model.forward_cached(std::span(tokens).first(static_cast<size_t>(prompt)), 1, prompt, cache).to_vector());
    for (int64_t t = prompt; t < n; ++t)
      logits[mode].push_back(model.forward_cached(std::span(tokens).subspan(static_cast<size_t>(t), 1), 1, 1, cache).to_vector());
  }
  const nn::DecoderConfig& c = model.config;
  EXPECT_EQ(bytes[0], L * 32 * (c.kv_lora_rank + c.head_dim) * 4);
  EXPECT_EQ(bytes[1], L * 32 * 2 * c.num_heads * std::max(c.qk_head_dim(), c.v_head_dim) * 4);
  for (int64_t step = 0; step < static_cast<int64_t>(logits[0].size()); ++step) {
    const int64_t T = prompt + step;
    const Tensor full = model.forward(std::span(tokens).first(static_cast<size_t>(T)), 1, T);
    const int64_t V = c.vocab_size;
    const std::vector<float> all = full.to_vector();
    const Tensor last = Tensor::from(std::span<const float>(all).subspan(static_cast<size_t>((T - 1) * V), static_cast<size_t>(V)), Shape{1, V});
    for (int mode = 0; mode < 2; ++mode)
      EXPECT_TRUE(all_close(Tensor::from(logits[mode][static_cast<size_t>(step)], Shape{1, V}), last, 1e-4, 2e-5))
          << (mode == 0 ? "absorbed" : "expanded") << " decoding, step " << step;
  }
}

TEST(LatentAttention, AbsorbedDecodingGivesTheExpandedLogits) {
  const auto model = nn::load_hf_decoder(fixture("hf/deepseek_v3"));
  expect_same_decoding(*model, {3, 17, 42, 8, 66, 12, 9, 30, 51, 2, 7});
  // a dense DeepSeek-style model (every layer a SwiGLU MLP) with a plain q_proj (q_lora_rank null), drawn afresh,
  // and its values wider than its query/key heads (the expanded form pads the other way)
  nn::DecoderConfig dense = model->config;
  dense.source = {};
  dense.q_lora_rank = 0;
  dense.v_head_dim = 16;
  for (auto& layer : dense.layers) layer.experts = false;
  Generator gen(11);
  nn::Decoder fresh(dense, gen);
  {
    NoGradGuard no_grad;
    fresh.for_each_parameter([&](const std::string&, Tensor& p) {  // larger weights than 0.02: attention not flat
      if (p.rank() == 2) p.copy_(mul(p, 12.0f));
    });
  }
  expect_same_decoding(fresh, {1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST(LatentFamily, BadConfigsAreRefusedNamingTheKey) {
  auto refused = [](const std::string& json, const char* key) {
    const std::string message = refusal(json);
    return message.find(key) != std::string::npos ? ::testing::AssertionSuccess()
                                                  : ::testing::AssertionFailure() << key << " not named in: " << message;
  };
  EXPECT_TRUE(refused(edited_latent("\"kv_lora_rank\": 16", "\"kv_lora_rank\": 0"), "kv_lora_rank"));
  EXPECT_TRUE(refused(edited_latent("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"), "num_experts_per_tok"));
  EXPECT_TRUE(refused(edited_latent("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5"), "num_experts_per_tok"));  // > 2 groups of 2
  EXPECT_TRUE(refused(edited_latent("\"topk_group\": 2", "\"topk_group\": 5"), "topk_group"));
  EXPECT_TRUE(refused(edited_latent("\"n_group\": 4", "\"n_group\": 3"), "n_group"));
  EXPECT_TRUE(refused(edited_latent("\"rope_type\": \"yarn\"", "\"rope_type\": \"spiral\""), "rope_type"));
  EXPECT_TRUE(refused(edited_latent("\"qk_rope_head_dim\": 4", "\"qk_rope_head_dim\": 3"), "qk_rope_head_dim"));
  EXPECT_TRUE(refused(edited_latent("\"attention_bias\": false", "\"attention_bias\": true"), "attention_bias"));
  EXPECT_TRUE(refused(edited_latent("\"norm_topk_prob\": true", "\"norm_topk_prob\": true, \"scoring_func\": \"softmax\""),
                      "scoring_func"));
}

TEST(MoeLayer, RoutesEachTokenToItsTopKAndReportsThem) {
  // Two experts, top-1, not renormalised: each token's output is its likelier expert's times that probability.
  Tensor x = random_tensor({3, 4}, 1), router = random_tensor({2, 4}, 2, 3.0f);
  std::vector<Tensor> gate = {random_tensor({5, 4}, 3), random_tensor({5, 4}, 4)};
  std::vector<Tensor> up = {random_tensor({5, 4}, 5), random_tensor({5, 4}, 6)};
  std::vector<Tensor> down = {random_tensor({4, 5}, 7), random_tensor({4, 5}, 8)};
  std::vector<int32_t> chosen;
  std::vector<float> weights;
  MoeConfig config;
  config.experts_per_token = 1;
  config.norm_topk_prob = false;
  config.chosen = &chosen;
  config.weights = &weights;
  const Tensor out = mixture_of_experts(x, router, gate, up, down, config);
  ASSERT_EQ(chosen.size(), 3u);
  const Tensor probs = softmax(linear(x, router, Tensor()));
  for (int64_t t = 0; t < 3; ++t) {
    const int32_t e = probs.data()[t * 2] >= probs.data()[t * 2 + 1] ? 0 : 1;
    EXPECT_EQ(chosen[static_cast<size_t>(t)], e);
    EXPECT_FLOAT_EQ(weights[static_cast<size_t>(t)], probs.data()[t * 2 + e]);
  }
  const Tensor expert0 = linear(mul(silu(linear(x, gate[0], Tensor())), linear(x, up[0], Tensor())), down[0], Tensor());
  for (int64_t t = 0; t < 3; ++t)
    if (chosen[static_cast<size_t>(t)] == 0)
      for (int64_t c = 0; c < 4; ++c)
        EXPECT_NEAR(out.data()[t * 4 + c], weights[static_cast<size_t>(t)] * expert0.data()[t * 4 + c], 1e-5);
  config.experts_per_token = 3;
  EXPECT_THROW(mixture_of_experts(x, router, gate, up, down, config), ValueError);
}

// Experts kept as a GGUF keeps them (q8_0) or as bf16: each chosen expert's rows are multiplied in place by
// gemm_weight, none widened — the output is, bit for bit, each token's chosen experts run one token at a time through
// gemm_weight (whose rows do not depend on the rows beside them), weighted in the kernel's order; the routing is the
// float32 router's; and the values stay near the float32 experts'.
TEST(MoeLayer, StoredExpertsAreMultipliedInPlace) {
  const int64_t N = 5, C = 64, F = 32, E = 4;
  const Tensor x = random_tensor({N, C}, 11), router = random_tensor({E, C}, 12, 2.0f);
  for (const bool deepseek : {false, true})  // softmax top-k (Qwen3-MoE); sigmoid, selection bias, groups (DeepSeek-V3)
  for (const kernels::WeightType type : {kernels::WeightType::Q8_0, kernels::WeightType::BF16}) {
    SCOPED_TRACE(std::string(kernels::weight_type_name(type)) + (deepseek ? ", DeepSeek-V3's router" : ""));
    std::vector<Tensor> gate, up, down, gate32, up32, down32;
    for (int64_t e = 0; e < E; ++e) {
      gate32.push_back(random_tensor({F, C}, 20 + e)), up32.push_back(random_tensor({F, C}, 30 + e));
      down32.push_back(random_tensor({C, F}, 40 + e));
      for (auto [from, to] : {std::pair{&gate32, &gate}, {&up32, &up}, {&down32, &down}}) {
        Tensor t = Tensor::empty(from->back().shape());
        t.copy_(from->back());
        t.to_weight_type_(type);
        to->push_back(t);
      }
    }
    std::vector<int32_t> chosen, chosen32;
    std::vector<float> weights, weights32;
    MoeConfig config;
    config.experts_per_token = 2;
    config.chosen = &chosen, config.weights = &weights;
    if (deepseek) {
      config.sigmoid = true, config.groups = 2, config.groups_kept = 1, config.scaling = 2.5f;
      config.selection_bias = random_tensor({E}, 13, 0.5f);
    }
    NoGradGuard no_grad;
    const Tensor out = mixture_of_experts(x, router, gate, up, down, config);
    config.chosen = &chosen32, config.weights = &weights32;
    const Tensor out32 = mixture_of_experts(x, router, gate32, up32, down32, config);
    EXPECT_EQ(chosen, chosen32);
    EXPECT_EQ(weights, weights32);
    auto view = [](const Tensor& t) {
      const void* bytes = t.dtype() == DType::BF16 ? static_cast<const void*>(t.bf16()) : t.stored_bytes();
      return kernels::WeightView{t.weight_type(), bytes, t.size(0), t.size(1)};
    };
    float range = 0.0f;
    for (int64_t i = 0; i < out32.numel(); ++i) range = std::max(range, std::fabs(out32.data()[i]));
    for (int64_t t = 0; t < N; ++t) {
      std::vector<float> expected(static_cast<size_t>(C), 0.0f), g(F), u(F), h(F), y(C);
      for (int64_t s = 0; s < 2; ++s) {
        const size_t e = static_cast<size_t>(chosen[static_cast<size_t>(t * 2 + s)]);
        kernels::gemm_weight(view(gate[e]), 1, x.data() + t * C, C, 0.0f, g.data(), F);
        kernels::gemm_weight(view(up[e]), 1, x.data() + t * C, C, 0.0f, u.data(), F);
        kernels::silu_forward(g.data(), h.data(), F);
        for (int64_t f = 0; f < F; ++f) h[static_cast<size_t>(f)] *= u[static_cast<size_t>(f)];
        kernels::gemm_weight(view(down[e]), 1, h.data(), F, 0.0f, y.data(), C);
        for (int64_t c = 0; c < C; ++c)
          expected[static_cast<size_t>(c)] = std::fma(weights[static_cast<size_t>(t * 2 + s)], y[static_cast<size_t>(c)],
                                                      expected[static_cast<size_t>(c)]);  // as the kernel adds
      }
      for (int64_t c = 0; c < C; ++c) {
        EXPECT_EQ(out.data()[t * C + c], expected[static_cast<size_t>(c)]) << "token " << t << " channel " << c;
        EXPECT_NEAR(out.data()[t * C + c], out32.data()[t * C + c], 0.03f * range);
      }
    }
  }
  // A float32 expert beside stored ones is read as a view of its values
  std::vector<Tensor> gate = {random_tensor({F, C}, 1), random_tensor({F, C}, 2)}, up = gate;
  std::vector<Tensor> down = {random_tensor({C, F}, 3), random_tensor({C, F}, 4)};
  gate[1].to_weight_type_(kernels::WeightType::Q8_0);
  MoeConfig config;
  config.experts_per_token = 1;
  NoGradGuard no_grad;
  const Tensor ok = mixture_of_experts(x, random_tensor({2, C}, 5), gate, up, down, config);
  EXPECT_EQ(ok.shape(), x.shape());
}

// gpt-oss's experts kept as its published files store them — MXFP4 rows of each expert's outputs, gate and up
// alternating — give the routing of float32 experts holding the same values, and their outputs and gradients within
// the 8-bit activations' rounding.
TEST(MoeLayer, StoredStackedExpertsAreGptOssExpertsInPlace) {
  const int64_t N = 6, C = 64, F = 32, E = 4;
  const Tensor x = random_tensor({N, C}, 51), router = random_tensor({E, C}, 52, 2.0f), router_bias = random_tensor({E}, 53);
  const Tensor gate_up_bias = random_tensor({E, 2 * F}, 54), down_bias = random_tensor({E, C}, 55);
  const Tensor gate_up = random_tensor({E, C, 2 * F}, 56), down = random_tensor({E, F, C}, 57);
  // the rows as the files hold them: row e·2F + j is column j of expert e's (C, 2F); row e·C + c column c of (F, C)
  Tensor gate_up_rows = Tensor::empty({E * 2 * F, C}), down_rows = Tensor::empty({E * C, F});
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t j = 0; j < 2 * F; ++j)
      for (int64_t c = 0; c < C; ++c) gate_up_rows.data()[(e * 2 * F + j) * C + c] = gate_up.data()[(e * C + c) * 2 * F + j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t f = 0; f < F; ++f) down_rows.data()[(e * C + c) * F + f] = down.data()[(e * F + f) * C + c];
  }
  gate_up_rows.to_weight_type_(kernels::WeightType::MXFP4);
  down_rows.to_weight_type_(kernels::WeightType::MXFP4);
  // float32 experts of the stored values, in the stacked layout
  Tensor gate_up32 = Tensor::empty(gate_up.shape()), down32 = Tensor::empty(down.shape());
  {
    std::vector<float> gu(static_cast<size_t>(E * 2 * F * C)), d(static_cast<size_t>(E * C * F));
    kernels::dequantize_rows(kernels::WeightType::MXFP4, gate_up_rows.stored_bytes(), gu.data(), E * 2 * F, C);
    kernels::dequantize_rows(kernels::WeightType::MXFP4, down_rows.stored_bytes(), d.data(), E * C, F);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t j = 0; j < 2 * F; ++j)
        for (int64_t c = 0; c < C; ++c) gate_up32.data()[(e * C + c) * 2 * F + j] = gu[static_cast<size_t>((e * 2 * F + j) * C + c)];
      for (int64_t c = 0; c < C; ++c)
        for (int64_t f = 0; f < F; ++f) down32.data()[(e * F + f) * C + c] = d[static_cast<size_t>((e * C + c) * F + f)];
    }
  }
  std::vector<int32_t> chosen, chosen32;
  std::vector<float> weights, weights32;
  MoeConfig config;
  config.experts_per_token = 2;
  config.top_k_then_softmax = true;
  config.swiglu_limit = 7.0f;
  config.chosen = &chosen, config.weights = &weights;
  Tensor out;
  {
    NoGradGuard no_grad;
    out = mixture_of_experts(x, router, router_bias, gate_up_rows, gate_up_bias, down_rows, down_bias, config);
  }
  config.chosen = &chosen32, config.weights = &weights32;
  const Tensor out32 = mixture_of_experts(x, router, router_bias, gate_up32, gate_up_bias, down32, down_bias, config);
  EXPECT_EQ(chosen, chosen32);
  EXPECT_EQ(weights, weights32);
  float range = 0.0f;
  for (int64_t i = 0; i < out32.numel(); ++i) range = std::max(range, std::fabs(out32.data()[i]));
  ASSERT_GT(range, 0.1f);
  double worst = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) worst = std::max(worst, double{std::fabs(out.data()[i] - out32.data()[i])});
  EXPECT_LT(worst, 0.02 * range);
  EXPECT_GT(worst, 0.0);  // the 8-bit activations round: equal bits would mean the stored path was not taken
  // gradients reach x, the router and the biases through the frozen rows (gemm_weight_backward), as through float32
  // experts of the same values, within the forward's 8-bit activations
  auto gradients = [&](const Tensor& gu, const Tensor& dn) {
    std::vector<Tensor> leaves = {x.detach(), router.detach(), router_bias.detach(), gate_up_bias.detach(), down_bias.detach()};
    for (Tensor& t : leaves) t.requires_grad_(true);
    MoeConfig c = config;
    c.chosen = nullptr, c.weights = nullptr;
    const Tensor y = mixture_of_experts(leaves[0], leaves[1], leaves[2], gu, leaves[3], dn, leaves[4], c);
    sum(mul(y, random_tensor(y.shape(), 58))).backward();
    return leaves;
  };
  const std::vector<Tensor> got = gradients(gate_up_rows, down_rows), want = gradients(gate_up32, down32);
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("gradient " + std::to_string(i));
    ASSERT_TRUE(got[i].grad().defined());
    float size = 0.0f, diff = 0.0f;
    for (int64_t j = 0; j < want[i].numel(); ++j) {
      size = std::max(size, std::fabs(want[i].grad().data()[j]));
      diff = std::max(diff, std::fabs(got[i].grad().data()[j] - want[i].grad().data()[j]));
    }
    EXPECT_GT(size, 0.0f);
    EXPECT_LT(diff, 0.06f * size);  // the router bias's sums over tokens cancel most: 3.2% measured
  }
  // a wrong shape names both
  NoGradGuard no_grad;
  EXPECT_THROW(mixture_of_experts(x, router, router_bias, gate_up_rows, gate_up_bias, gate_up_rows, down_bias, config),
               ShapeError);
}

TEST(MoeDemo, SinksAndExpertSectionsPrintTheirWeights) {
  const CliResult r = run_cli("demo --no-color --section sinks --section moe");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* part : {"7. Attention sinks", "the sink's share", "8. Mixture of experts", "routing weights (top-2, renormalised)"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
  // every token's two routing weights sum to 1 (the row-sum column of the routing matrix)
  const size_t routing = r.out.find("routing weights");
  ASSERT_NE(routing, std::string::npos);
  int ones = 0;
  for (size_t at = r.out.find("1.0000", routing); at != std::string::npos && at < r.out.find("y = ", routing);
       at = r.out.find("1.0000", at + 1))
    ++ones;
  EXPECT_EQ(ones, 6) << r.out.substr(routing, 600);
  EXPECT_EQ(run_cli("demo --section moo").code, 2);
}

// The number after `marker` in `text` (the first), or NaN
double number_after(const std::string& text, const std::string& marker) {
  const size_t at = text.find(marker);
  return at == std::string::npos ? std::nan("") : std::strtod(text.c_str() + at + marker.size(), nullptr);
}

// GQA, sliding windows, latent attention and Gated DeltaNet on the book's sentence: each prints its matrices and what
// it saves, the latent's absorbed scores equal the expanded ones, the recurrence equals the kernel, and the pictures
// (a GIF of the DeltaNet state) are written; on a learner's own sentence too.
TEST(MoeDemo, AttentionVariantSectionsShowWhatTheySave) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_demo_variants_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const CliResult r = run_cli("demo --no-color --section gqa --section swa --section mla --section deltanet --pictures " +
                              dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* part : {"9. Grouped-query attention", "head 4 (K/V head 2)", "would keep 2 · 4 · 2 = 16 values, grouped-query keeps 2 · 2 · 2 = 8",
                           "10. Sliding-window attention", "A, causal with a window of 3", "11. Multi-head latent attention",
                           "2 latent values against 2 · 2 · 2 = 8", "12. Gated DeltaNet", "S after 'step'"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from\n" << r.out;
  EXPECT_LT(number_after(r.out, "The two agree to "), 1e-5) << r.out;
  EXPECT_LT(number_after(r.out, "gated_delta_rule kernel gives the same outputs to "), 1e-5) << r.out;
  // the window: 'step' (row 6) sees only 'with', 'one' and 'step'
  const size_t window = r.out.find("A, causal with a window of 3");
  const size_t step = r.out.find("\nstep ", window);
  ASSERT_NE(step, std::string::npos);
  const std::string row = r.out.substr(step, r.out.find('\n', step + 1) - step);
  EXPECT_NE(row.find("0.0000   0.0000   0.0000   0.3255"), std::string::npos) << row;
  for (const char* file : {"09-gqa-heads.png", "10-swa-window3.png", "11-mla-heads.png", "12-deltanet-state.gif"})
    EXPECT_TRUE(fs::exists(dir / file)) << file;
  fs::remove_all(dir);
  const CliResult own = run_cli("demo --no-color --sentence \"the cat sat on the mat\" --d-in 4 --section mla --section deltanet");
  ASSERT_EQ(own.code, 0) << own.out;
  EXPECT_LT(number_after(own.out, "The two agree to "), 1e-5) << own.out;
  EXPECT_LT(number_after(own.out, "gated_delta_rule kernel gives the same outputs to "), 1e-5) << own.out;
}

// Qwen3-Next's keys: its hybrid stack read as config.json says, and a bad value refused by its name
TEST(Qwen3NextFamily, ReadsTheHybridStackAndRefusesBadKeysByName) {
  const nn::DecoderConfig c = nn::decoder_config_from_hf(read(fs::path(fixture("hf/qwen3_next")) / "config.json"));
  std::vector<bool> linear;
  for (const auto& l : c.layers) linear.push_back(l.linear);
  EXPECT_EQ(linear, (std::vector<bool>{true, true, true, false}));  // full_attention_interval 4
  EXPECT_TRUE(c.gated_attention);
  EXPECT_TRUE(c.shared_expert_gate);
  EXPECT_EQ(c.shared_expert_intermediate_size, 12);
  EXPECT_EQ(c.ropes.at(0).rotary_dim, 4);  // partial_rotary_factor 0.5 of head_dim 8
  EXPECT_EQ(c.norm, nn::NormKind::GemmaRMSNorm);
  EXPECT_EQ(c.linear_conv_width(), 2 * 2 * 6 + 4 * 5);
  EXPECT_FALSE(c.layers[1].experts);  // mlp_only_layers
  // layer_types, when given, wins over the interval; without partial_rotary_factor a quarter of each head rotates
  const nn::DecoderConfig listed = nn::decoder_config_from_hf(edited_in(
      "qwen3_next", "\"partial_rotary_factor\": 0.5,",
      "\"layer_types\": [\"full_attention\", \"linear_attention\", \"full_attention\", \"linear_attention\"],"));
  linear.clear();
  for (const auto& l : listed.layers) linear.push_back(l.linear);
  EXPECT_EQ(linear, (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(listed.ropes.at(0).rotary_dim, 2);
  auto refused = [](const std::string& from, const std::string& to, const char* key) {
    const std::string message = refusal(edited_in("qwen3_next", from, to));
    return message.find(key) != std::string::npos ? ::testing::AssertionSuccess()
                                                  : ::testing::AssertionFailure() << key << " not named in: " << message;
  };
  EXPECT_TRUE(refused("\"linear_num_value_heads\": 4", "\"linear_num_value_heads\": 3", "linear_num_value_heads"));
  EXPECT_TRUE(refused("\"linear_key_head_dim\": 6", "\"linear_key_head_dim\": 0", "linear_key_head_dim"));
  EXPECT_TRUE(refused("\"linear_conv_kernel_dim\": 4", "\"linear_conv_kernel_dim\": -1", "linear_conv_kernel_dim"));
  EXPECT_TRUE(refused("\"full_attention_interval\": 4", "\"full_attention_interval\": 0", "full_attention_interval"));
  EXPECT_TRUE(refused("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "num_experts_per_tok"));
  EXPECT_TRUE(refused("\"full_attention_interval\": 4,", "\"layer_types\": [\"linear_attention\", \"mamba\", "
                      "\"full_attention\", \"full_attention\"],", "layer_types"));
  // a family without Gated DeltaNet does not take linear_attention layers
  EXPECT_NE(refusal(edited_in("qwen3", "\"eos_token_id\": 5", "\"eos_token_id\": 5, \"layer_types\": [\"linear_attention\", "
                              "\"full_attention\"]")).find("layer_types"), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
