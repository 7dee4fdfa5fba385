// Mixture-of-experts models: the qwen3_moe family's config keys and layout (its logits, loss, gradients and greedy
// text against PyTorch run in test_decoder.cpp's family table), the layer's routing, and bad configs refused naming
// the key.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "helpers.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// config.json of the qwen3_moe fixture with one key's text replaced
std::string edited(const std::string& from, const std::string& to) {
  std::string c = read(fs::path(fixture("hf/qwen3_moe")) / "config.json");
  const size_t at = c.find(from);
  if (at == std::string::npos) ADD_FAILURE() << from << " not in the fixture's config.json";
  return at == std::string::npos ? c : c.replace(at, from.size(), to);
}

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
  EXPECT_NEAR(made.loss(ids, 1, 6, targets).item(), std::log(72.0), 0.05);
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

}  // namespace
}  // namespace qkv::test
