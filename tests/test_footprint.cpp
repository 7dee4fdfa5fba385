// The memory estimates (nn/footprint.hpp) against the figures the book's chapter-4 bonus folders print from the same
// settings, and `qkv memory` printing them.
#include <filesystem>
#include <fstream>

#include "helpers.hpp"
#include "qkv/nn/footprint.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// Runs f, expecting a ValueError whose message holds `fragment`.
template <typename F>
::testing::AssertionResult refuses(F&& f, const std::string& fragment) {
  try {
    f();
  } catch (const ValueError& e) {
    if (std::string(e.what()).find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message \"" << e.what() << "\" lacks \"" << fragment << "\"";
  }
  return ::testing::AssertionFailure() << "no ValueError";
}

TEST(Footprint, ReproducesTheBooksKvCacheFigures) {
  const std::vector<nn::MemorySettings> book = nn::book_memory_settings();
  ASSERT_EQ(book.size(), 4u);
  const nn::MemoryFigures gqa = nn::memory_figures(book[0]);
  EXPECT_EQ(gqa.head_dim, 128);
  EXPECT_EQ(gqa.mha_bytes, 17179869184);  // 32,768 · 128 · 32 heads · 2 · 2 bytes · 32 layers
  EXPECT_EQ(nn::gigabytes(gqa.mha_bytes), "17.18 GB");
  EXPECT_EQ(nn::gigabytes(gqa.gqa_bytes), "4.29 GB");
  const nn::MemoryFigures mla = nn::memory_figures(book[1]);
  EXPECT_EQ(mla.head_dim, 86);  // ⌈2048 / 24⌉, as the book rounds up
  EXPECT_EQ(nn::gigabytes(mla.mha_bytes), "3.25 GB");
  EXPECT_EQ(nn::gigabytes(mla.gqa_bytes), "0.81 GB");
  EXPECT_EQ(mla.mla_bytes, 8192LL * 48 * 1024 * 2);
  EXPECT_EQ(nn::gigabytes(mla.mla_bytes), "0.81 GB");
  const nn::MemoryFigures swa = nn::memory_figures(book[2]);
  EXPECT_EQ(swa.sliding_layers, 27);  // 32 layers at 5:1: five blocks of six, then two more sliding
  EXPECT_EQ(swa.full_layers, 5);
  EXPECT_EQ(swa.mha_swa_bytes, 27LL * 16777216 + 5LL * 536870912);
  EXPECT_EQ(nn::gigabytes(swa.mha_swa_bytes), "3.14 GB");
  EXPECT_EQ(nn::gigabytes(swa.gqa_swa_bytes), "0.78 GB");
}

TEST(Footprint, ReproducesTheBooksMixtureOfExpertsCounts) {
  const nn::MemoryFigures moe = nn::memory_figures(nn::book_memory_settings()[3]);
  EXPECT_EQ(moe.dense_params, 308281344);
  EXPECT_EQ(moe.expert_hidden, 1792);
  EXPECT_EQ(moe.moe_params, 308338688);
  EXPECT_EQ(moe.moe_active_params, 77127680);
  EXPECT_EQ(moe.router_params, 7168 * 8);
}

TEST(Footprint, SplitsSlidingLayersAsTheBookDoes) {
  EXPECT_EQ(nn::split_sliding_layers(32, 5, 1), (std::pair<int64_t, int64_t>{27, 5}));
  EXPECT_EQ(nn::split_sliding_layers(32, 1, 0), (std::pair<int64_t, int64_t>{32, 0}));
  EXPECT_EQ(nn::split_sliding_layers(7, 1, 5), (std::pair<int64_t, int64_t>{2, 5}));
  EXPECT_EQ(nn::gigabytes(1234567890123), "1,234.57 GB");
}

TEST(Footprint, RefusesBadSettingsNamingThem) {
  nn::MemorySettings s = nn::book_memory_settings()[0];
  s.kv_groups = 5;
  EXPECT_TRUE(refuses([&] { nn::memory_figures(s); }, "kv_groups = 5 must divide heads = 32"));
  s = nn::book_memory_settings()[3];
  s.top_k = 9;
  EXPECT_TRUE(refuses([&] { nn::memory_figures(s); }, "top_k = 9"));
  s = nn::book_memory_settings()[0];
  s.context = int64_t{1} << 50;
  EXPECT_TRUE(refuses([&] { nn::memory_figures(s); }, "overflows"));
}

TEST(Footprint, CliPrintsTheBooksFiguresAndAFoldersCache) {
  const CliResult r = run_cli("memory");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* figure : {"17.18 GB", "4.29 GB", "3.25 GB", "0.81 GB", "3.14 GB", "0.78 GB", "308,281,344",
                             "308,338,688", "77,127,680"})
    EXPECT_NE(r.out.find(figure), std::string::npos) << figure << " missing from\n" << r.out;
  const CliResult custom = run_cli("memory --emb 4096 --heads 32 --layers 32 --context 32768 --kv-groups 8 --dtype fp32");
  ASSERT_EQ(custom.code, 0) << custom.out;
  EXPECT_NE(custom.out.find("34.36 GB"), std::string::npos) << custom.out;  // MHA in fp32: twice 17.18
  EXPECT_NE(custom.out.find("4.29 GB"), std::string::npos) << custom.out;   // 4 K/V heads in fp32
  EXPECT_EQ(run_cli("memory --emb 64 --heads 6 --layers 2 --kv-groups 4").code, 1);  // 4 does not divide 6
  // qwen2's fixture: 2 layers, 1 K/V head of 6, the second layer sliding (window 5)
  const CliResult folder = run_cli("memory " + fixture("hf/qwen2") + " --context 100 --dtype fp32");
  ASSERT_EQ(folder.code, 0) << folder.out;
  EXPECT_NE(folder.out.find("1 full layers"), std::string::npos) << folder.out;
  EXPECT_NE(folder.out.find("4,800 bytes"), std::string::npos) << folder.out;  // 100 · 6 · 1 · 2 · 4 · 1
  EXPECT_NE(folder.out.find("1 sliding (5) layers"), std::string::npos) << folder.out;
  EXPECT_NE(folder.out.find("5,040 bytes"), std::string::npos) << folder.out;  // + 5 · 6 · 2 · 4
  // qwen3_moe's fixture: 27,408 parameters, of which 2 layers × 2 idle experts × 3 · 12 · 32 sit out for each token
  const CliResult moe = run_cli("memory " + fixture("hf/qwen3_moe") + " --context 100 --dtype fp32");
  ASSERT_EQ(moe.code, 0) << moe.out;
  EXPECT_NE(moe.out.find("27,408 parameters (22,800 active per token)"), std::string::npos) << moe.out;
  EXPECT_NE(moe.out.find("3 full layers"), std::string::npos) << moe.out;
  EXPECT_NE(moe.out.find("38,400 bytes"), std::string::npos) << moe.out;  // 100 · 8 · 2 K/V heads · 2 · 4 · 3
}

// gpt-oss-20b's released config.json: OpenAI's model card gives 20.91 B parameters, 3.61 B active without the
// embedding table (579,133,440); qkv counts the table as used, so 4,187,440,704. The KV cache at 4,096 tokens: 12
// full layers of 4,096 and 12 sliding layers of 128, 8 K/V heads of 64, bf16.
TEST(Memory, GptOss20bFromItsConfigJson) {
  const fs::path dir = fs::temp_directory_path() / "qkv_memory_gpt_oss_20b";
  fs::create_directories(dir);
  std::string layer_types;
  for (int i = 0; i < 24; ++i) layer_types += std::string(i ? ", " : "") + (i % 2 == 0 ? "\"sliding_attention\"" : "\"full_attention\"");
  std::ofstream(dir / "config.json") << R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true,
    "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4,
    "num_local_experts": 32, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": [)" + layer_types + R"(], "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": false, "vocab_size": 201088})";
  const CliResult r = run_cli("memory " + dir.string() + " --context 4096 --dtype bf16");
  fs::remove_all(dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("20,914,757,184 parameters (4,187,440,704 active per token)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("12 full layers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("12 sliding (128) layers"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace qkv::test
