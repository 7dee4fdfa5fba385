// Model files by content: the book's .pth and safetensors state dicts with their configuration, exact continuation
// of the book's training from model_and_optimizer.pth, and the writers read back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/train/model_file.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::test {
namespace {

std::string pth(const std::string& name) { return fixture("pth/" + name); }

nn::ConfigHint config_json() { return {pth("config.json"), 0, ""}; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_weights(nn::Decoder& model, const std::string& prefix = "state.") {
  const io::SafetensorsFile expected = io::SafetensorsFile::open(pth("expected.safetensors"));
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor e = expected.tensor(prefix + name);
    ASSERT_EQ(p.shape(), e.shape()) << name;
    EXPECT_EQ(std::memcmp(p.data(), e.data(), p.numel() * sizeof(float)), 0) << name;
  }
}

TEST(ModelFile, DetectsEachFormatByContent) {
  EXPECT_EQ(nn::detect_checkpoint_format(pth("model.pth")), train::ModelFormat::Pth);
  EXPECT_EQ(nn::detect_checkpoint_format(pth("model.safetensors")), train::ModelFormat::BookSafetensors);
  EXPECT_EQ(nn::detect_checkpoint_format(fixture("gpt2_tiny_hf.safetensors")), train::ModelFormat::HuggingFaceGPT2);
  EXPECT_NE(error_of([] { nn::detect_checkpoint_format(fixture("optim.safetensors")); }).find("not a GPT model"), std::string::npos);
}

// Read for bf16 inference, every file kind gives its matrices as bf16 — each value the float32 load's rounded to nearest
// even — and its vectors in float32, read one tensor at a time (no float32 model first).
TEST(ModelFile, EveryFormatLoadsStraightIntoBf16) {
  train::TrainSettings settings;
  settings.model = {.vocab_size = 61, .context_length = 16, .emb_dim = 24, .n_heads = 4, .n_layers = 2, .drop_rate = 0.0};
  Generator gen(9);
  nn::Decoder made(settings.model, gen);
  const std::string dir = ::testing::TempDir();
  train::write_checkpoint(dir + "/bf16_check.safetensors", made, [](const auto&) {}, settings, 0, gen.state());
  std::vector<std::pair<std::string, nn::ConfigHint>> files = {
      {pth("model.pth"), config_json()}, {pth("model.safetensors"), config_json()},
      {pth("model_half.pth"), config_json()}, {fixture("gpt2_tiny_hf.safetensors"), {}},
      {dir + "/bf16_check.safetensors", {}}};
  for (const auto& [file, hint] : files) {
    SCOPED_TRACE(file);
    const train::ModelFile f32 = train::load_model_file(file, hint);
    const train::ModelFile b16 = train::load_model_file(file, hint, DType::BF16);
    auto a = f32.model->named_parameters(), b = b16.model->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const Tensor& x = a[i].second;
      const Tensor& y = b[i].second;
      ASSERT_EQ(y.dtype(), x.rank() == 2 ? DType::BF16 : DType::F32) << a[i].first;
      for (int64_t k = 0; k < x.numel(); ++k) {
        const float want = x.rank() == 2 ? kernels::bf16_to_f32_reference(kernels::f32_to_bf16_reference(x.data()[k])) : x.data()[k];
        const float got = y.rank() == 2 ? kernels::bf16_to_f32_reference(y.bf16()[k]) : y.data()[k];
        if (got != want) {
          ADD_FAILURE() << a[i].first << "[" << k << "]: " << got << " vs " << want;
          break;
        }
      }
    }
  }
}

TEST(ModelFile, BookPthAndSafetensorsWithTheBooksConfig) {
  for (const char* name : {"model.pth", "model.safetensors"}) {
    train::ModelFile f = train::load_model_file(pth(name), config_json());
    EXPECT_EQ(f.model->config.num_heads, 4);
    EXPECT_EQ(f.model->config.max_positions, 16);
    EXPECT_FALSE(f.model->config.qkv_bias);
    EXPECT_EQ(f.tokenizer, "bytes");  // a vocabulary of 256
    expect_weights(*f.model);
  }
}

TEST(ModelFile, InfersTheShapesAndAsksForTheHeads) {
  const std::string message = error_of([] { train::load_model_file(pth("model.pth")); });
  EXPECT_NE(message.find("--n-heads"), std::string::npos) << message;
  EXPECT_NE(message.find("--config"), std::string::npos) << message;
  train::ModelFile f = train::load_model_file(pth("model.pth"), {"", 4, ""});
  EXPECT_EQ(f.model->config.vocab_size, 256);
  EXPECT_EQ(f.model->config.num_layers, 2);
  // A configuration that contradicts the tensors is named with the tensor that says otherwise.
  const std::string wrong = error_of([] { train::load_model_file(pth("model.pth"), {"gpt2-small", 0, ""}); });
  EXPECT_NE(wrong.find("emb_dim = 768"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("tok_emb.weight"), std::string::npos) << wrong;
  EXPECT_NE(error_of([] { train::load_model_file(pth("model.pth"), {"gpt2-tiny", 0, ""}); }).find("neither a preset"),
            std::string::npos);
}

TEST(ModelFile, ReadsPythonStyleConfigurations) {
  const auto values = nn::read_config_hint(pth("config.json"));  // True/False, # comments, a trailing comma
  EXPECT_EQ(values.at("qkv_bias"), "false");
  EXPECT_EQ(values.at("drop_rate"), "0");
  EXPECT_EQ(values.at("n_heads"), "4");
  const std::string path = ::testing::TempDir() + "qkv_config.py";
  std::FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("GPT_CONFIG_124M = {\n 'vocab_size': 50257, 'qkv_bias': True, 'n_heads': 12,\n}\n", f);
  std::fclose(f);
  EXPECT_EQ(nn::read_config_hint(path).at("qkv_bias"), "true");
  f = std::fopen(path.c_str(), "w");
  std::fputs("{\"emb_dims\": 768}", f);
  std::fclose(f);
  EXPECT_NE(error_of([&] { nn::read_config_hint(path); }).find("unknown configuration key \"emb_dims\""), std::string::npos);
}

// The book's notebook stopped after 3 AdamW steps and saved model_and_optimizer.pth; PyTorch's next 5 steps on
// the fixture's batches gave continue.losses. qkv, resuming from the file, must take the same 5 steps.
TEST(ModelFile, ContinuesTheBooksTrainingExactly) {
  train::ModelFile f = train::load_model_file(pth("model_and_optimizer.pth"), config_json());
  ASSERT_TRUE(f.optimizer.has_value());
  const io::SafetensorsFile expected = io::SafetensorsFile::open(pth("expected.safetensors"));
  EXPECT_EQ(f.optimizer->step, expected.int64s("step")[0]);
  EXPECT_DOUBLE_EQ(f.optimizer->options.lr, 4e-4);
  EXPECT_DOUBLE_EQ(f.optimizer->options.weight_decay, 0.1);
  nn::Decoder& model = *f.model;
  expect_weights(model);
  optim::AdamW adamw(model.named_parameters(), f.optimizer->options);
  adamw.ensure_state();
  adamw.for_each_state([&](const std::string& name, Tensor& t) {
    const Tensor* source = f.optimizer->state(name);
    ASSERT_NE(source, nullptr) << name;
    const Tensor e = expected.tensor(name);
    EXPECT_EQ(std::memcmp(source->data(), e.data(), e.numel() * sizeof(float)), 0) << name;
    t.copy_(*source);
  });
  adamw.set_step_count(f.optimizer->step);
  model.train();
  const std::vector<int64_t> inputs = expected.int64s("continue.inputs"), targets = expected.int64s("continue.targets");
  const Tensor losses = expected.tensor("continue.losses");
  const int64_t B = 2, T = 16;
  for (int64_t s = 0; s < 5; ++s) {
    adamw.zero_grad();
    const std::span<const int64_t> x(inputs.data() + s * B * T, B * T), y(targets.data() + s * B * T, B * T);
    Tensor loss = nn::language_model_loss(model.forward(x, B, T), y);
    loss.backward();
    adamw.step();
    EXPECT_NEAR(loss.item(), losses.data()[s], 1e-5) << "step " << s + 4;
  }
}

TEST(ModelFile, WritersReadBack) {
  const std::string dir = ::testing::TempDir();
  train::ModelFile f = train::load_model_file(pth("model_and_optimizer.pth"), config_json());
  train::save_book_pth(dir + "qkv_model.pth", *f.model);
  train::save_book_safetensors(dir + "qkv_model.safetensors", *f.model);
  for (const char* name : {"qkv_model.pth", "qkv_model.safetensors"}) {
    train::ModelFile back = train::load_model_file(dir + name, {"", 4, ""});
    expect_weights(*back.model);
  }
  train::TrainSettings settings;
  settings.model = nn::GPTConfig::of(f.model->config);
  settings.tokenizer = "bytes";
  settings.learning_rate = 4e-4;
  std::vector<uint64_t> rng = Generator(5).state();
  train::save_book_pth_with_optimizer(dir + "qkv_both.pth", *f.model, *f.optimizer, settings, rng);
  train::ModelFile back = train::load_model_file(dir + "qkv_both.pth");  // its config and settings travel with it
  expect_weights(*back.model);
  ASSERT_TRUE(back.optimizer && back.settings);
  EXPECT_EQ(back.optimizer->step, f.optimizer->step);
  EXPECT_EQ(back.settings->to_strings(), settings.to_strings());
  EXPECT_EQ(back.rng_state, rng);
  EXPECT_EQ(back.tokenizer, "bytes");
  for (const auto& [name, t] : f.optimizer->exp_avg_sq) {
    EXPECT_EQ(std::memcmp(t.data(), back.optimizer->exp_avg_sq.at(name).data(), t.numel() * sizeof(float)), 0) << name;
  }
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

std::string fx(const std::string& name) { return fixture("pth/" + name); }

TEST(ModelFileCli, EvalEqualsPyTorch) {
  const io::SafetensorsFile expected = io::SafetensorsFile::open(fx("expected.safetensors"));
  for (int stride : {16, 5}) {
    const CliResult r = run_cli("eval --checkpoint " + fx("model.pth") + " --config " + fx("config.json") + " --text " +
                                fx("eval.txt") + " --stride " + std::to_string(stride) + " --json 2>/dev/null");
    ASSERT_EQ(r.code, 0) << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    const Tensor e = expected.tensor("eval.stride" + std::to_string(stride));
    EXPECT_NEAR(j["loss"].get<double>(), e.data()[0], 1e-5) << stride;
    EXPECT_EQ(j["scored_tokens"].get<int64_t>(), static_cast<int64_t>(e.data()[1]));
    EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(e.data()[0]), 1e-3);
  }
  // The same from the book-named safetensors file, and a progress bar on stderr without --json.
  const CliResult r = run_cli("eval --checkpoint " + fx("model.safetensors") + " --n-heads 4 --text " + fx("eval.txt"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("window 13/13"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("perplexity 341.13"), std::string::npos) << r.out;
}

TEST(ModelFileCli, GenerateAndAttentionFromTheBooksFiles) {
  const CliResult g = run_cli("generate --checkpoint " + fx("model.pth") + " --config " + fx("config.json") +
                              " --prompt 'In the' --max-new-tokens 5 --greedy");
  EXPECT_EQ(g.code, 0) << g.out;
  EXPECT_EQ(g.out.rfind("In the", 0), 0u) << g.out;
  const std::string out = ::testing::TempDir() + "qkv_pth_attention";
  const CliResult a = run_cli("attention --checkpoint " + fx("model_and_optimizer.pth") + " --n-heads 4 --prompt 'And God' --out " + out);
  EXPECT_EQ(a.code, 0) << a.out;
  EXPECT_TRUE(std::filesystem::exists(out + "/attention.html"));
  const CliResult missing = run_cli("generate --checkpoint " + fx("model.pth") + " --prompt x");
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.out.find("--n-heads N"), std::string::npos) << missing.out;
  const CliResult hostile = run_cli("generate --checkpoint " + fx("hostile/os_system.pth") + " --prompt x");
  EXPECT_EQ(hostile.code, 1);
  EXPECT_NE(hostile.out.find("posix.system"), std::string::npos) << hostile.out;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ModelFileCli, ConvertKeepsEverythingOrRefuses) {
  const std::string d = ::testing::TempDir() + "qkv_convert/";
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  const CliResult lossy = run_cli("convert " + fx("model_and_optimizer.pth") + " " + d + "w.safetensors --config " + fx("config.json"));
  EXPECT_EQ(lossy.code, 2) << lossy.out;
  EXPECT_NE(lossy.out.find("--weights-only"), std::string::npos) << lossy.out;
  EXPECT_FALSE(std::filesystem::exists(d + "w.safetensors"));
  ASSERT_EQ(run_cli("convert " + fx("model_and_optimizer.pth") + " " + d + "c.safetensors --to checkpoint --config " +
                    fx("config.json")).code, 0);
  ASSERT_EQ(run_cli("convert " + d + "c.safetensors " + d + "back.pth").code, 0);
  ASSERT_EQ(run_cli("convert " + d + "back.pth " + d + "c2.safetensors --to checkpoint").code, 0);
  // An existing output is kept unless --overwrite (as qkv train does).
  const std::string c2 = read_bytes(d + "c2.safetensors");
  const CliResult again = run_cli("convert " + d + "back.pth " + d + "c2.safetensors --to checkpoint --weights-only");
  EXPECT_EQ(again.code, 2) << again.out;
  EXPECT_NE(again.out.find("c2.safetensors already exists (a safetensors file); give --overwrite to replace it"),
            std::string::npos) << again.out;
  EXPECT_EQ(read_bytes(d + "c2.safetensors"), c2);
  ASSERT_EQ(run_cli("convert " + d + "back.pth " + d + "c2.safetensors --to checkpoint --overwrite").code, 0);
  // pth → qkv checkpoint → pth → qkv checkpoint: the two checkpoints hold the same tensors, bit for bit.
  const io::SafetensorsFile a = io::SafetensorsFile::open(d + "c.safetensors"), b = io::SafetensorsFile::open(d + "c2.safetensors");
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& info : a.tensors()) {
    const auto x = a.bytes(info), y = b.bytes(*b.find(info.name));
    EXPECT_TRUE(x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size()) == 0) << info.name;
  }
  EXPECT_EQ(a.metadata().at("step"), "3");
  EXPECT_EQ(a.metadata().at("learning_rate"), b.metadata().at("learning_rate"));
  const CliResult untied = run_cli("convert " + fx("model.pth") + " " + d + "hf.safetensors --to gpt2 --n-heads 4");
  EXPECT_EQ(untied.code, 2);
  EXPECT_NE(untied.out.find("out_head.weight"), std::string::npos) << untied.out;
}

TEST(ModelFileCli, TrainContinuesTheBooksRun) {
  const std::string out = ::testing::TempDir() + "qkv_pth_train";
  std::filesystem::remove_all(out);
  const CliResult r = run_cli("train --resume " + fx("model_and_optimizer.pth") + " --config " + fx("config.json") +
                              " --text " + fx("eval.txt") + " --out " + out +
                              " --steps 5 --batch-size 2 --eval-every 0 --train-fraction 0.5 --sample-tokens 5");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("at step 3 with its AdamW (lr 4e-04"), std::string::npos) << r.out;
  std::ifstream csv(out + "/losses.csv");
  std::string header, first;
  std::getline(csv, header);
  std::getline(csv, first);
  EXPECT_EQ(first.rfind("4,", 0), 0u) << first;  // the book's step 3 is followed by step 4
  EXPECT_NE(first.find("4.000000e-04"), std::string::npos) << first;
}

}  // namespace
}  // namespace qkv::test
