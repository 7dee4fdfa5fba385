// The decoder composed from a config against PyTorch: tiny random folders of every Hugging Face family in
// Hugging Face's layout (tools/decoder_reference.py) give PyTorch's logits, loss, every gradient and greedy text,
// with and without the KV cache; the loaders refuse bad folders with messages that name the file and the key.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/pretrained.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

std::string folder(const std::string& family) { return fixture("hf/" + family); }

// A tokenizer.json of one token per letter and the space, from id `first` on: a tiny folder's prompts in words
void write_letter_tokenizer(const fs::path& dir, int first) {
  std::string vocab;
  const std::string chars = " abcdefghijklmnopqrstuvwxyz";
  for (size_t i = 0; i < chars.size(); ++i)
    vocab += (i ? ", \"" : "\"") + std::string(1, chars[i]) + "\": " + std::to_string(static_cast<int>(i) + first);
  std::ofstream(dir / "tokenizer.json") << "{\"model\": {\"type\": \"BPE\", \"vocab\": {" << vocab << "}, \"merges\": []}}";
}

::testing::AssertionResult mentions(const std::string& text, std::initializer_list<const char*> parts) {
  for (const char* part : parts)
    if (text.find(part) == std::string::npos) return ::testing::AssertionFailure() << "'" << part << "' not in: " << text;
  return ::testing::AssertionSuccess();
}

class Family : public ::testing::TestWithParam<std::string> {};

TEST_P(Family, LogitsLossAndEveryGradientMatchPyTorch) {
  const auto model = nn::load_hf_decoder(folder(GetParam()));
  const auto expected = io::SafetensorsFile::open(fixture("hf/" + GetParam() + ".expected.safetensors"));
  const std::vector<int64_t> ids = expected.int64s("ids"), targets = expected.int64s("targets");
  const int64_t B = 2, T = static_cast<int64_t>(ids.size()) / B;
  // Qwen3-Next's expected values are float64 (tools/decoder_reference.py). Its recurrence and L2 norms amplify
  // float32's rounding: PyTorch's own float32 is up to 8e-5 of a tensor's largest value from them (2.6e-4 in
  // in_proj_qkvz's gradient, whose largest is 3.2), against 3e-6 in the other families. So its absolute tolerance is
  // 1e-4 of each tensor's largest value (a mistake moves values by 1e-2 of it or more).
  auto atol = [&](const Tensor& want) {
    if (GetParam() != "qwen3_next") return 1e-5;
    double largest = 0.0;
    for (int64_t i = 0; i < want.numel(); ++i) largest = std::max(largest, std::fabs(static_cast<double>(want.data()[i])));
    return std::max(1e-5, 1e-4 * largest);
  };
  model->eval();
  {
    NoGradGuard no_grad;
    const Tensor want = expected.tensor("logits");
    EXPECT_TRUE(all_close(model->forward(ids, B, T), want, 1e-4, atol(want))) << "logits";
  }
  model->zero_grad();
  Tensor loss = model->loss(ids, B, T, targets);
  EXPECT_NEAR(loss.item(), expected.tensor("loss").item(), 1e-5);
  loss.backward();
  int checked = 0;
  model->for_each_parameter([&](const std::string& name, Tensor& p) {
    // a parameter that takes no gradient (DeepSeek-V3's e_score_correction_bias: only chooses; a buffer in
    // transformers) has none, and PyTorch's is zero
    const Tensor grad = p.requires_grad() ? p.grad() : Tensor::zeros(p.shape());
    const Tensor want = expected.tensor("grad." + name);
    EXPECT_TRUE(all_close(grad, want, 1e-4, atol(want))) << name;
    ++checked;
  });
  EXPECT_EQ(checked, static_cast<int>(model->config.layout().size()));
  EXPECT_EQ(model->parameter_count(), model->config.parameter_count());
}

TEST_P(Family, GreedyTextMatchesPyTorchWithAndWithoutTheCache) {
  const auto model = nn::load_hf_decoder(folder(GetParam()));
  model->eval();
  const auto expected = io::SafetensorsFile::open(fixture("hf/" + GetParam() + ".expected.safetensors"));
  const std::vector<int64_t> prompt = expected.int64s("prompt"), greedy = expected.int64s("greedy");
  for (bool cache : {false, true}) {
    nn::SamplingOptions options;
    options.temperature = 0;
    options.max_new_tokens = static_cast<int64_t>(greedy.size());
    options.use_cache = cache;
    EXPECT_EQ(nn::generate(*model, prompt, options), greedy) << (cache ? "with" : "without") << " the KV cache";
  }
}

// The weights written back (F32) load bit for bit, and as BF16 they load as the weights rounded to bf16.
TEST_P(Family, FolderRoundTripsBitForBitAndInBf16) {
  const auto model = nn::load_hf_decoder(folder(GetParam()));
  const fs::path out = fs::temp_directory_path() / ("qkv_hf_roundtrip_" + GetParam());
  fs::remove_all(out);
  nn::save_hf_folder(out.string(), *model);
  const auto back = nn::load_hf_decoder(out.string());
  EXPECT_EQ(back->config, model->config);
  auto a = model->named_parameters(), b = back->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.to_vector(), b[i].second.to_vector()) << a[i].first;
  }
  nn::save_hf_folder(out.string(), *model, nn::HfDType::BF16);
  const auto half = nn::load_hf_decoder(out.string());
  auto h = half->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    std::vector<float> rounded = a[i].second.to_vector();
    for (float& v : rounded) v = kernels::bf16_to_f32_reference(kernels::f32_to_bf16_reference(v));
    EXPECT_EQ(h[i].second.to_vector(), rounded) << a[i].first;
  }
  // Read as bfloat16 matrices, the file's BF16 entries are used where it is mapped: the same values, and the model
  // works after the folder is gone (the mapping lives as long as the tensors over it).
  const auto mapped = nn::load_hf_decoder(out.string(), DType::BF16);
  fs::remove_all(out);
  auto m = mapped->named_parameters();
  ASSERT_EQ(m.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor& t = m[i].second;
    if (t.rank() == 2) EXPECT_EQ(t.dtype(), DType::BF16) << m[i].first;
    Tensor widened = Tensor::empty(t.shape());
    widened.copy_(t);
    EXPECT_EQ(widened.to_vector(), h[i].second.to_vector()) << m[i].first;
  }
  const std::vector<int64_t> ids = {1, 5, 2, 7};
  const NoGradGuard inference;  // bfloat16 matrices are for inference
  const std::vector<float> want = half->forward(ids, 1, 4).to_vector(), got = mapped->forward(ids, 1, 4).to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 + 1e-4 * std::abs(want[i])) << i;
  // A non-finite value in a mapped matrix is refused as it is when copied.
  if (GetParam() == "qwen3") {
    half->parameter(nn::Role::Down, 0).data()[3] = std::nanf("");
    nn::save_hf_folder(out.string(), *half, nn::HfDType::BF16);
    try {
      nn::load_hf_decoder(out.string(), DType::BF16);
      ADD_FAILURE() << "a NaN in a bf16 matrix was accepted";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
    }
    fs::remove_all(out);
  }
}

INSTANTIATE_TEST_SUITE_P(HuggingFace, Family, ::testing::Values("llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3", "olmo2",
                                                                  "olmo3", "smollm3", "gemma2", "qwen3_moe", "deepseek_v3", "gpt_oss",
                                                                  "qwen3_next", "qwen3_proportional"),
                         [](const auto& info) { return info.param; });

TEST(DecoderConfig, ReadsEachFamilysKeys) {
  const auto gemma = nn::load_hf_decoder(folder("gemma3"))->config;
  EXPECT_EQ(gemma.family, &nn::family("gemma3"));
  EXPECT_EQ(gemma.norm, nn::NormKind::GemmaRMSNorm);
  EXPECT_EQ(gemma.mlp, nn::MlpKind::GeGLU);
  EXPECT_EQ(gemma.placement, nn::NormPlacement::Sandwich);
  EXPECT_EQ(gemma.qk_norm, nn::QkNorm::PerHead);
  EXPECT_TRUE(gemma.tie_word_embeddings);
  EXPECT_NEAR(gemma.embedding_scale, std::sqrt(24.0), 1e-12);
  EXPECT_NEAR(gemma.attention_scale, 1.0 / std::sqrt(12.0), 1e-12);
  ASSERT_EQ(gemma.layers.size(), 3u);
  EXPECT_EQ(gemma.layers[0], (nn::DecoderLayerSettings{4, 1}));  // sliding, local RoPE
  EXPECT_EQ(gemma.layers[2], (nn::DecoderLayerSettings{0, 0}));  // global
  EXPECT_EQ(gemma.ropes[1].theta, 10000.0);
  EXPECT_EQ(gemma.ropes[0].scaling, kernels::RopeFrequencies::Scaling::Linear);
  EXPECT_EQ(gemma.eos_token_ids, (std::vector<int64_t>{1, 6}));
  const auto qwen2 = nn::load_hf_decoder(folder("qwen2"))->config;
  EXPECT_TRUE(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.tie_word_embeddings);
  EXPECT_EQ(qwen2.layers[0].window, 0);
  EXPECT_EQ(qwen2.layers[1].window, 5);
  const auto qwen3 = nn::load_hf_decoder(folder("qwen3"))->config;
  EXPECT_EQ(qwen3.head_dim, 16);
  EXPECT_EQ(qwen3.q_width(), 64);
  const auto llama = nn::load_hf_decoder(folder("llama"))->config;
  EXPECT_EQ(llama.ropes[0].scaling, kernels::RopeFrequencies::Scaling::Llama3);
  EXPECT_EQ(llama.num_kv_heads, 2);
  // and the config written back reads as the same configuration
  for (const auto* c : {&gemma, &qwen2, &qwen3, &llama}) EXPECT_EQ(nn::decoder_config_from_hf(nn::decoder_config_to_hf(*c)), *c);
  // attention_dropout (dropout on the attention weights in training) is read and written back
  nn::DecoderConfig dropped = llama;
  dropped.attention_dropout = 0.25;
  EXPECT_EQ(nn::decoder_config_from_hf(nn::decoder_config_to_hf(dropped)).attention_dropout, 0.25);
  EXPECT_THROW(nn::decoder_config_from_hf(R"({"model_type": "llama", "attention_dropout": 1.5, "vocab_size": 8,
      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "max_position_embeddings": 8})"), IoError);
}

// A sliding-window layer's cache keeps only window − 1 + one chunk of rows and shifts when full: decoding 300
// tokens one by one gives the full forward pass's logits at every step, and the cache is that small.
TEST(DecoderCache, SlidingWindowCacheShiftsAndMatchesTheFullForward) {
  nn::DecoderConfig c;
  c.family = &nn::family("gemma3");
  c.vocab_size = 50, c.hidden_size = 16, c.intermediate_size = 24, c.num_layers = 2, c.num_heads = 2, c.num_kv_heads = 1;
  c.head_dim = 8, c.max_positions = 400, c.norm = nn::NormKind::GemmaRMSNorm, c.mlp = nn::MlpKind::GeGLU;
  c.qk_norm = nn::QkNorm::PerHead;
  c.placement = nn::NormPlacement::Sandwich;
  c.tie_word_embeddings = true;
  c.embedding_scale = 4.0;
  c.ropes = {kernels::RopeFrequencies{.theta = 1e6}, kernels::RopeFrequencies{.theta = 1e4}};
  c.layers = {{3, 1}, {0, 0}};
  Generator gen(5);
  nn::Decoder model(c, gen);
  model.eval();
  std::vector<int64_t> ids(300);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7 + 3) % 50);
  NoGradGuard no_grad;
  // float32, and a bf16 cache (made under BF16, products in bf16) against the bf16 full forward, to bf16's tolerance
  for (const Precision precision : {Precision::FP32, Precision::BF16}) {
    const PrecisionGuard guard(precision);
    const bool bf16 = precision == Precision::BF16;
    const Tensor full = model.forward(ids, 1, 300);
    nn::KVCache cache = model.make_cache(1, 300);
    EXPECT_EQ(cache.layers[0].keys.dtype(), bf16 ? DType::BF16 : DType::F32);
    EXPECT_EQ(cache.layers[0].keys.size(1), 3 - 1 + nn::Decoder::kCacheChunk);
    EXPECT_EQ(cache.layers[1].keys.size(1), 300);
    Tensor last = model.forward_cached(std::span(ids).subspan(0, 10), 1, 10, cache);
    for (int64_t t = 10; t < 300; ++t) {
      if (t == 10 || t == 258 || t == 259 || t == 299) {
        const Tensor want = Tensor::from(std::span<const float>(full.data() + (t - 1) * 50, 50), {1, 50});
        EXPECT_TRUE(all_close(last, want, bf16 ? 3e-2 : 1e-4, bf16 ? 3e-2 : 1e-5)) << "position " << t - 1 << " bf16 " << bf16;
      }
      last = model.forward_cached(std::span(ids).subspan(static_cast<size_t>(t), 1), 1, 1, cache);
    }
    EXPECT_LT(cache.filled[0], 3 + nn::Decoder::kCacheChunk);
    EXPECT_EQ(cache.filled[1], 300);
    EXPECT_EQ(cache.bytes(), (2 * (258 + 300) * 8) * (bf16 ? 2 : 4));
  }
}

// Attention maps of a GQA model with windows: one map per query head, zero outside each layer's window.
TEST(DecoderAttention, MapsShowTheWindowAndSumToOne) {
  const auto model = nn::load_hf_decoder(folder("qwen2"));
  std::vector<int64_t> ids = {1, 5, 9, 3, 7, 2, 8, 4};
  const Tensor maps = model->attention_maps(ids, {}, {});
  ASSERT_EQ(maps.shape(), (Shape{2, 4, 8, 8}));
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 8; ++i) {
        double total = 0;
        for (int64_t j = 0; j < 8; ++j) {
          const float w = maps.at({l, h, i, j});
          const bool visible = j <= i && (l == 0 || i - j < 5);
          if (!visible) {
            EXPECT_EQ(w, 0.0f) << l << h << i << j;
          }
          total += w;
        }
        EXPECT_NEAR(total, 1.0, 1e-5);
      }
}

// One query's row, as the chat page asks for it: the same numbers as that row of the full maps, for every layer and
// head (windows, GQA, Gemma 2's soft-capped scores, Gemma 3's local and global layers), from a pass that never forms T × T.
TEST(DecoderAttention, OneRowIsThatRowOfTheMaps) {
  for (const char* name : {"qwen2", "gemma2", "gemma3", "deepseek_v3"}) {  // deepseek_v3: latent attention, expanded
    const auto model = nn::load_hf_decoder(folder(name));
    std::vector<int64_t> ids = {1, 5, 9, 3, 7, 2, 8, 4};
    const Tensor maps = model->attention_maps(ids, {}, {});
    const int64_t L = maps.size(0), H = maps.size(1);
    for (int64_t p : {0, 3, 7}) {
      const Tensor row = model->attention_row(ids, p);
      ASSERT_EQ(row.shape(), (Shape{L, H, p + 1})) << name;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < H; ++h) {
          double total = 0;
          for (int64_t j = 0; j <= p; ++j) {
            EXPECT_NEAR(row.at({l, h, j}), maps.at({l, h, p, j}), 1e-6) << name << " layer " << l << " head " << h << " " << p << "→" << j;
            total += row.at({l, h, j});
          }
          EXPECT_NEAR(total, 1.0, 1e-5);
        }
    }
    EXPECT_THROW(model->attention_row(ids, 8), ValueError);
    EXPECT_THROW(model->attention_row(ids, -1), ValueError);
  }
}

// GPT-2 is one configuration of the decoder: the book's configuration names map onto it and back, and a tied model
// draws every other weight as the untied one does (the book's GPTModel draws its out_head before tying it), so
// training with dropout takes the same random numbers. test_gpt.cpp checks the weights and gradients against PyTorch.
TEST(DecoderGpt2, IsTheBooksGPTModel) {
  nn::GPTConfig g{.vocab_size = 61, .context_length = 16, .emb_dim = 24, .n_heads = 4, .n_layers = 2, .drop_rate = 0.2,
                  .qkv_bias = true, .tie_weights = false};
  const nn::DecoderConfig c = g.decoder_config();
  EXPECT_EQ(c.family, &nn::family("gpt2"));
  EXPECT_EQ(c.attention_dropout, 0.2);
  EXPECT_EQ(nn::GPTConfig::of(c), g);
  nn::GPTConfig t = g;
  t.tie_weights = true;
  Generator gen_a(3), gen_b(3);
  nn::Decoder untied(g, gen_a), tied(t, gen_b);
  EXPECT_TRUE(tied.head.shares_storage_with(tied.tok_emb));
  EXPECT_EQ(gen_a.next_u32(), gen_b.next_u32());
  const nn::StateDict su = untied.state_dict(true), st = tied.state_dict(true);
  EXPECT_EQ(su.entries().size(), st.entries().size() + 1);  // out_head.weight
  for (const auto& [name, value] : st.entries()) {
    const Tensor* other = su.find(name);
    ASSERT_TRUE(other) << name;
    EXPECT_TRUE(all_close(value, *other, 0.0, 0.0)) << name;
  }
  ASSERT_TRUE(st.find("trf_blocks.1.att.mask"));  // the book's buffers, as its .pth files hold them
  EXPECT_EQ(st.find("trf_blocks.1.att.mask")->shape(), (Shape{16, 16}));
  nn::DecoderConfig llama = c;
  llama.family = &nn::family("llama");
  EXPECT_THROW(nn::GPTConfig::of(llama), ValueError);
  // Dropout on the attention weights alone (the residual dropout off): training draws masks, evaluation none, and
  // the same seed draws the same masks.
  nn::DecoderConfig attention_only = c;
  attention_only.drop_rate = 0.0;
  attention_only.attention_dropout = 0.5;
  Generator g1(5), g2(5);
  nn::Decoder a(attention_only, g1), b(attention_only, g2);
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6, 7, 8}, targets = {2, 3, 4, 5, 6, 7, 8, 9};
  a.train();
  b.train();
  const float trained = a.loss(ids, 1, 8, targets).item();
  EXPECT_EQ(trained, b.loss(ids, 1, 8, targets).item());
  a.eval();
  EXPECT_NE(trained, a.loss(ids, 1, 8, targets).item());
}

// qkv convert DIR OUT --to hf: the folder rewritten (here in BF16) loads as the weights rounded; a folder onto
// itself or a non-folder is refused.
TEST(DecoderCli, ConvertWritesAFolderThatLoadsBack) {
  const fs::path out = fs::temp_directory_path() / "qkv_convert_hf_gemma3";
  fs::remove_all(out);
  const CliResult r = run_cli("convert " + folder("gemma3") + " " + out.string() + " --to hf --dtype bf16");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("bf16 rounding"), std::string::npos) << r.out;
  const auto a = nn::load_hf_decoder(folder("gemma3")), b = nn::load_hf_decoder(out.string());
  EXPECT_EQ(a->config, b->config);
  // config.json says what the tensors are now and keeps the source's keys, adding none of its own.
  const auto source = nlohmann::json::parse(std::ifstream(folder("gemma3") + "/config.json"));
  const auto written = nlohmann::json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(written["torch_dtype"], "bfloat16");
  for (const auto& [key, value] : source.items())
    if (key != "torch_dtype") {
      EXPECT_EQ(written[key], value) << key;
    }
  for (const auto& [key, value] : written.items()) EXPECT_TRUE(source.contains(key)) << "added " << key;
  EXPECT_EQ(run_cli("convert " + folder("gemma3") + " " + folder("gemma3") + " --to hf").code, 2);
  EXPECT_EQ(run_cli("convert " + fixture("gpt_tiny.safetensors") + " " + out.string() + " --to hf").code, 2);
  fs::remove_all(out);
}

// qkv attention on a folder: one map per query head of a grouped-query model, each naming its K/V head, and the
// sliding-window layer's maps zero outside the window. The tiny folder gets a character-level tokenizer.json.
TEST(DecoderCli, AttentionPicturesOfAFolder) {
  const fs::path dir = fs::temp_directory_path() / "qkv_attention_qwen2_folder", out = dir / "att";
  fs::remove_all(dir);
  fs::copy(folder("qwen2"), dir);
  const CliResult refused = run_cli("attention --checkpoint " + dir.string() + " --prompt hi --out " + out.string());
  EXPECT_EQ(refused.code, 1);
  EXPECT_NE(refused.out.find("tokenizer.json"), std::string::npos) << refused.out;
  write_letter_tokenizer(dir, 0);
  const CliResult r = run_cli("attention --checkpoint " + dir.string() + " --prompt 'the cat sat on' --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto saved = io::SafetensorsFile::open((out / "attention.safetensors").string());
  const Tensor maps = saved.tensor("attention");
  const int64_t T = 14;
  ASSERT_EQ(maps.shape(), (Shape{2, 4, T, T}));
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j <= i; ++j) EXPECT_EQ(maps.at({1, h, i, j}) == 0.0f, i - j >= 5) << h << " " << i << " " << j;
  EXPECT_EQ(saved.metadata().at("kv_heads"), "1,1,1,1");
  EXPECT_EQ(saved.metadata().at("windows"), "0,5");
  std::ifstream html(out / "attention.html");
  const std::string page((std::istreambuf_iterator<char>(html)), {});
  EXPECT_NE(page.find("windows: [0,5]"), std::string::npos);
  EXPECT_NE(page.find("group: 4"), std::string::npos);
  fs::remove_all(dir);
}

// qkv attention on gpt-oss's folder: each query's weight on its head's sink (1 − its row's sum, saved and drawn), and
// a mixture of experts' routing per layer — each token's 2 weights summing to 1, as the model routed it. Also on the
// folder as OpenAI publishes it (experts in MXFP4, multiplied as stored).
class AttentionPictures : public ::testing::TestWithParam<std::string> {};

TEST_P(AttentionPictures, ShowSinksAndExpertRouting) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_attention_" + GetParam() + "_" + std::to_string(::getpid())),
                 out = dir / "att";
  fs::remove_all(dir);
  fs::copy(folder(GetParam()), dir);
  write_letter_tokenizer(dir, 6);
  const std::string checkpoint = dir.string();
  const CliResult r = run_cli("attention --checkpoint " + checkpoint + " --prompt 'the cat' --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto saved = io::SafetensorsFile::open((out / "attention.safetensors").string());
  const Tensor maps = saved.tensor("attention"), sinks = saved.tensor("sink_share"), routing = saved.tensor("routing");
  const int64_t T = 7;
  ASSERT_EQ(sinks.shape(), (Shape{2, 4, T}));
  ASSERT_EQ(routing.shape(), (Shape{2, T, 4}));
  EXPECT_EQ(saved.metadata().at("expert_layers"), "1,2");
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < T; ++i) {
        double row = 0.0;
        for (int64_t j = 0; j < T; ++j) row += maps.at({l, h, i, j});
        EXPECT_NEAR(row + sinks.at({l, h, i}), 1.0, 1e-5);
        EXPECT_GT(sinks.at({l, h, i}), 0.0f);  // the fixture's sinks are drawn from randn: every row gives some
      }
  // the routing the model computes: 2 experts a token, their softmax weights summing to 1
  const auto loaded = nn::load_pretrained(checkpoint, {.keep_stored = true, .tokenizer = false});  // as the CLI loads
  const nn::Decoder* model = loaded->model.get();
  const std::vector<int64_t> ids = saved.int64s("token_ids");  // "the cat" in the character vocabulary
  EXPECT_EQ(ids, (std::vector<int64_t>{26, 14, 11, 6, 9, 7, 26}));
  const nn::Decoder::Routing direct = model->expert_routing(ids);
  ASSERT_EQ(direct.layers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(direct.weights.to_vector(), routing.to_vector());
  if (GetParam() != "gpt_oss") {  // MXFP4 experts route as the same experts widened, within the 8-bit activations
    const nn::Decoder::Routing wide = nn::load_hf_decoder(folder(GetParam()))->expert_routing(ids);
    int same = 0;
    for (size_t i = 0; i < wide.weights.to_vector().size(); ++i)
      same += (wide.weights.to_vector()[i] > 0.0f) == (routing.to_vector()[i] > 0.0f);
    EXPECT_GE(same, static_cast<int>(routing.numel()) - 4) << "the experts chosen";
  }
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t t = 0; t < T; ++t) {
      int chosen = 0;
      double total = 0.0;
      for (int64_t e = 0; e < 4; ++e) {
        chosen += routing.at({l, t, e}) > 0.0f;
        total += routing.at({l, t, e});
      }
      EXPECT_EQ(chosen, 2);
      EXPECT_NEAR(total, 1.0, 1e-6);
    }
  for (const char* file : {"sinks.png", "routing-layer01.png", "routing-layer02.png"}) EXPECT_TRUE(fs::exists(out / file)) << file;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(GptOss, AttentionPictures, ::testing::Values("gpt_oss", "gpt_oss_mxfp4"));

// Qwen3-Next's folder through the CLI: generate keeps its Gated DeltaNet states in the session (the same text as
// without a cache), a prompts file runs as one batch, attention shows its attention layer and refuses a Gated
// DeltaNet one by name, and memory counts the states.
TEST(DecoderCli, Qwen3NextGeneratesShowsItsAttentionAndCountsItsStates) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_qwen3_next_" + std::to_string(::getpid())), out = dir / "att";
  fs::remove_all(dir);
  fs::copy(folder("qwen3_next"), dir);
  write_letter_tokenizer(dir, 6);
  const std::string model = "--checkpoint " + dir.string();
  const CliResult cached = run_cli("generate " + model + " --prompt 'the cat' --max-new-tokens 8 --temperature 0");
  ASSERT_EQ(cached.code, 0) << cached.out;
  EXPECT_NE(cached.out.find("3 Gated DeltaNet layers keeping a state"), std::string::npos) << cached.out;
  const CliResult plain = run_cli("generate " + model + " --prompt 'the cat' --max-new-tokens 8 --temperature 0 --no-cache");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_EQ(cached.out.substr(0, cached.out.find('\n')), plain.out.substr(0, plain.out.find('\n')));

  const CliResult maps = run_cli("attention " + model + " --prompt 'the cat' --out " + out.string());
  ASSERT_EQ(maps.code, 0) << maps.out;
  EXPECT_NE(maps.out.find("3 of the 4 layers are Gated DeltaNet"), std::string::npos) << maps.out;
  EXPECT_EQ(io::SafetensorsFile::open((out / "attention.safetensors").string()).tensor("attention").size(0), 1);
  const CliResult linear_layer = run_cli("attention " + model + " --prompt 'the cat' --layers 2 --out " + out.string());
  EXPECT_NE(linear_layer.code, 0);
  EXPECT_NE(linear_layer.out.find("layer 2 of this Qwen3-Next model is Gated DeltaNet"), std::string::npos) << linear_layer.out;
  EXPECT_NE(linear_layer.out.find("its attention layers are 4"), std::string::npos) << linear_layer.out;

  std::ofstream(dir / "prompts.jsonl") << "\"the cat\"\n";
  const CliResult batch = run_cli("generate " + model + " --prompts " + (dir / "prompts.jsonl").string() +
                                  " --max-new-tokens 8 --temperature 0");
  ASSERT_EQ(batch.code, 0) << batch.out;
  const std::string line = cached.out.substr(0, cached.out.find('\n'));  // "the cat" and its continuation
  EXPECT_NE(batch.out.find("\"text\":\"" + line.substr(7) + "\""), std::string::npos) << batch.out << "\n" << line;
  const CliResult memory = run_cli("memory " + dir.string() + " --context 1000");
  ASSERT_EQ(memory.code, 0) << memory.out;
  EXPECT_NE(memory.out.find("3 Gated DeltaNet layers"), std::string::npos) << memory.out;
  fs::remove_all(dir);
}

// qkv train --resume DIR continues pretraining a folder: the loss falls, the trained folder loads and scores the text
// better than the one it started from.
TEST(DecoderCli, ContinuedPretrainingOfAFolder) {
  const fs::path dir = fs::temp_directory_path() / "qkv_train_llama_folder", out = dir / "run";
  fs::remove_all(dir);
  fs::copy(folder("llama"), dir);
  write_letter_tokenizer(dir, 4);
  std::string text;
  for (int i = 0; i < 60; ++i) text += "the cat sat on the mat ";
  std::ofstream(dir / "text.txt") << text;
  const std::string t = (dir / "text.txt").string();
  const CliResult before = run_cli("eval --checkpoint " + dir.string() + " --text " + t + " --context 32 --json");
  ASSERT_EQ(before.code, 0) << before.out;
  const CliResult r = run_cli("train --resume " + dir.string() + " --text " + t + " --out " + out.string() +
                              " --steps 30 --batch-size 4 --context-length 32 --lr 3e-3 --warmup 2 --eval-every 10 --eval-batches 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out / "model" / "config.json") && fs::exists(out / "model" / "tokenizer.json") &&
              fs::exists(out / "losses.csv"));
  // qkv train's trainer: a validation split, evaluated every 10 steps and recorded beside the losses.
  EXPECT_NE(r.out.find("validation windows"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 30: train loss"), std::string::npos) << r.out;
  std::ifstream csv(out / "losses.csv");
  std::string header, line, row10;
  std::getline(csv, header);
  EXPECT_EQ(header, "step,loss,learning_rate,grad_norm,eval_train_loss,eval_validation_loss");
  while (std::getline(csv, line))
    if (line.rfind("10,", 0) == 0) row10 = line;
  EXPECT_EQ(std::count(row10.begin(), row10.end(), ','), 5) << row10;
  EXPECT_NE(row10.back(), ',') << row10;  // the evaluation's two losses filled in
  const CliResult after = run_cli("eval --checkpoint " + (out / "model").string() + " --text " + t + " --context 32 --json");
  ASSERT_EQ(after.code, 0) << after.out;
  auto loss_of = [](const std::string& json) { return std::stod(json.substr(json.find("\"loss\":") + 7)); };
  EXPECT_LT(loss_of(after.out), loss_of(before.out) - 0.5) << before.out << after.out;
  // A second run into the same folder is refused unless told to replace it.
  EXPECT_EQ(run_cli("train --resume " + dir.string() + " --text " + t + " --out " + out.string() + " --steps 1").code, 2);
  fs::remove_all(dir);
}

// ---- bad folders ----

struct BadFolder : ::testing::Test {
  // One folder per process: ctest runs each BadFolder test in a process of its own, in parallel.
  fs::path dir = fs::temp_directory_path() / ("qkv_bad_hf_" + std::to_string(::getpid()));
  void SetUp() override {
    fs::remove_all(dir);
    fs::copy(folder("llama"), dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir / name) << text; }
  std::string config() {
    std::ifstream in(dir / "config.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void replace(const std::string& from, const std::string& to) {
    std::string c = config();
    const size_t at = c.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    write("config.json", c.replace(at, from.size(), to));
  }
  std::string error() {
    try {
      nn::load_hf_decoder(dir.string());
    } catch (const IoError& e) {
      return e.what();
    }
    return "(loaded)";
  }
};

TEST_F(BadFolder, UnknownModelTypeNamesWhatQkvReads) {
  replace("\"llama\"", "\"mamba\"");
  EXPECT_TRUE(mentions(error(), {"model_type", "mamba", "qwen3"}));
}

TEST_F(BadFolder, MalformedConfigIsNamed) {
  write("config.json", "{\"model_type\": \"llama\", ");
  EXPECT_TRUE(mentions(error(), {"config.json", "not valid JSON"}));
  write("config.json", "[1, 2]");
  EXPECT_TRUE(mentions(error(), {"not a JSON object"}));
}

TEST_F(BadFolder, UnsupportedRopeTypeNamesTheSupportedOnes) {
  replace("\"llama3\"", "\"dynamic\"");
  EXPECT_TRUE(mentions(error(), {"dynamic", "rope_scaling.rope_type", "default, linear, llama3, yarn, longrope and proportional"}));
}

TEST_F(BadFolder, ShapeThatDisagreesWithTheConfig) {
  replace("\"intermediate_size\": 48", "\"intermediate_size\": 40");
  EXPECT_TRUE(mentions(error(), {"wrong shape", "mlp.gate_proj.weight"}));
}

TEST_F(BadFolder, HeadsThatDoNotGroup) {
  replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
  EXPECT_TRUE(mentions(error(), {"does not divide"}));
}

TEST_F(BadFolder, MissingTensorIsListed) {
  replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
  EXPECT_TRUE(mentions(error(), {"missing", "model.layers.2."}));
}

TEST_F(BadFolder, TruncatedWeightsFile) {
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 100);
  EXPECT_TRUE(mentions(error(), {"model.safetensors"}));
}

TEST_F(BadFolder, MissingShardAndUnsafeShardNames) {
  fs::remove_all(dir);
  fs::copy(folder("qwen3"), dir);
  fs::remove(dir / "model-00002-of-00002.safetensors");
  EXPECT_TRUE(mentions(error(), {"model-00002-of-00002.safetensors", "not in"}));
  write("model.safetensors.index.json", R"({"weight_map": {"model.norm.weight": "../../etc/passwd"}})");
  EXPECT_TRUE(mentions(error(), {"not a plain file name"}));
  write("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_TRUE(mentions(error(), {"weight_map"}));
}

TEST_F(BadFolder, NoWeightsAtAll) {
  fs::remove(dir / "model.safetensors");
  EXPECT_TRUE(mentions(error(), {"neither model.safetensors nor model.safetensors.index.json"}));
}

TEST_F(BadFolder, HugeSizesAreRefusedBeforeAllocating) {
  replace("\"vocab_size\": 96", "\"vocab_size\": 9000000000000");
  EXPECT_TRUE(mentions(error(), {"too large"}));
}

}  // namespace
}  // namespace qkv::test
