// The GPT model against the book's PyTorch GPTModel (fixtures from tools/gpt_reference.py): same seed, same
// weights; logits, loss and every parameter gradient; ten AdamW steps; GPT-2 weights in Hugging Face's layout;
// and the KV cache against full forward passes.
#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::test {
namespace {

class TinyGPT : public ::testing::Test {
 protected:
  void SetUp() override {
    file_ = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(fixture("gpt_tiny.safetensors")));
    config_ = nn::GPTConfig::from_strings(file_->metadata());
    ids_ = file_->int64s("ids");
    targets_ = file_->int64s("targets");
  }
  // Every parameter's gradient against PyTorch's. The gradient's own scale sets the absolute floor: 1e-4 of its
  // largest entry, but at least 1e-7 — the key biases' gradients are exactly 0 in theory (a constant added to a
  // whole row of scores), ~1e-10 in float.
  void expect_pytorchs_gradients(nn::Decoder& model) const {
    for (const auto& [name, p] : model.named_parameters()) {
      const Tensor expected = file_->tensor("grad." + name);
      double largest = 0;
      for (float v : expected.values()) largest = std::max(largest, std::fabs(static_cast<double>(v)));
      EXPECT_TRUE(all_close(p.grad(), expected, 1e-4, 1e-4 * std::max(largest, 1e-3))) << name;
    }
  }
  std::unique_ptr<io::SafetensorsFile> file_;
  nn::GPTConfig config_;
  std::vector<int64_t> ids_, targets_;
};

TEST_F(TinyGPT, SameSeedGivesPyTorchsWeights) {
  manual_seed(123);
  nn::Decoder model(config_);
  const nn::StateDict state = model.state_dict();
  int compared = 0;
  for (const auto& [name, t] : state.entries()) {
    ASSERT_TRUE(file_->contains("param." + name)) << name;
    EXPECT_TRUE(all_close(t, file_->tensor("param." + name), 0, 0)) << name;
    ++compared;
  }
  int in_file = 0;
  for (const auto& info : file_->tensors()) in_file += info.name.rfind("param.", 0) == 0;
  EXPECT_EQ(compared, in_file);  // the same state-dict names, masks included
}

TEST_F(TinyGPT, LogitsLossAndEveryGradientMatchPyTorch) {
  manual_seed(123);
  nn::Decoder model(config_);
  const Tensor logits = model.forward(ids_, 4, 16);
  EXPECT_TRUE(all_close(logits, file_->tensor("logits"), 1e-4, 1e-5));
  const Tensor loss = nn::language_model_loss(logits, targets_);
  EXPECT_NEAR(loss.item(), file_->tensor("loss").item(), 1e-4 * std::fabs(file_->tensor("loss").item()));
  loss.backward();
  expect_pytorchs_gradients(model);
}

// The training path: GPTModel::loss runs the head and the cross-entropy fused in blocks of rows, and must give
// PyTorch's loss and gradients as the separate head and loss do.
TEST_F(TinyGPT, FusedHeadLossAndEveryGradientMatchPyTorch) {
  manual_seed(123);
  nn::Decoder model(config_);
  const Tensor loss = model.loss(ids_, 4, 16, targets_);
  EXPECT_NEAR(loss.item(), file_->tensor("loss").item(), 1e-4 * std::fabs(file_->tensor("loss").item()));
  loss.backward();
  expect_pytorchs_gradients(model);
}

// Tied head (the embedding table is the head's weight, so both paths add into one gradient), a loss scaled
// before backward, and ignored targets: fused and separate agree.
TEST_F(TinyGPT, FusedHeadEqualsTheSeparateHeadAndLoss) {
  nn::GPTConfig tied = config_;
  tied.tie_weights = true;
  tied.drop_rate = 0.0;
  std::vector<int64_t> targets = targets_;
  targets[5] = targets[40] = -100;
  std::vector<std::vector<Tensor>> grads(2);
  float losses[2];
  for (int fused = 0; fused < 2; ++fused) {
    manual_seed(7);
    nn::Decoder model(tied);
    const Tensor loss = fused ? model.loss(ids_, 4, 16, targets) : nn::language_model_loss(model.forward(ids_, 4, 16), targets);
    losses[fused] = loss.item();
    mul(loss, Tensor::scalar(2.5f)).backward();
    for (const auto& [name, p] : model.named_parameters()) grads[static_cast<size_t>(fused)].push_back(p.grad().clone());
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-6 * std::fabs(losses[0]));
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(all_close(grads[1][i], grads[0][i], 1e-5, 1e-7)) << i;
  nn::Decoder model(tied);
  std::vector<int64_t> bad = targets_;
  bad[9] = config_.vocab_size;
  EXPECT_THROW(model.loss(ids_, 4, 16, bad), ValueError);
  EXPECT_THROW(model.loss(ids_, 4, 16, std::span<const int64_t>(targets_).first(10)), ShapeError);
}

TEST_F(TinyGPT, TenAdamWStepsGiveTheSameLosses) {
  manual_seed(123);
  nn::Decoder model(config_);
  optim::AdamW optimizer(model.named_parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  const Tensor expected = file_->tensor("adamw_losses");
  for (int step = 0; step < 10; ++step) {
    optimizer.zero_grad();
    const Tensor loss = model.loss(ids_, 4, 16, targets_);  // as train::Trainer computes it
    EXPECT_NEAR(loss.item(), expected.data()[step], 1e-4 * std::fabs(expected.data()[step])) << "step " << step;
    loss.backward();
    optimizer.step();
  }
}

TEST_F(TinyGPT, ErrorsForBadInputs) {
  nn::Decoder model(config_);
  std::vector<int64_t> too_long(4 * 17, 1);
  EXPECT_THROW(model.forward(too_long, 4, 17), ShapeError);  // T > context_length
  std::vector<int64_t> bad_id(16, 1);
  bad_id[3] = 97;
  EXPECT_THROW(model.forward(bad_id, 1, 16), ValueError);   // id outside the vocabulary
  EXPECT_THROW(model.forward(bad_id, 2, 16), ShapeError);   // ids do not fill (2, 16)
  nn::GPTConfig bad = config_;
  bad.n_heads = 5;
  EXPECT_THROW(nn::Decoder{bad}, ValueError);
}

TEST_F(TinyGPT, WeightTyingSharesOneTensor) {
  nn::GPTConfig tied = config_;
  tied.tie_weights = true;
  nn::Decoder model(tied);
  EXPECT_TRUE(model.head.shares_storage_with(model.tok_emb));
  nn::Decoder untied(config_);
  EXPECT_EQ(untied.parameter_count() - model.parameter_count(), config_.vocab_size * config_.emb_dim);
  // The state dict lists the table once; the book's files get out_head.weight beside it (save_book_pth).
  EXPECT_EQ(model.state_dict().find("out_head.weight"), nullptr);
}

// GPTConfig's attention: book is the book's GPTModel; the others are today's decoder of the same widths, each read
// back from its decoder configuration (what a checkpoint stores); a checkpoint written before these settings existed
// means the book's model; a downloaded decoder is none of them.
TEST(GPTConfig, TodaysAttentionsAreDecodersOfTheSameWidthsAndReadBack) {
  nn::GPTConfig g;
  g.vocab_size = 64, g.context_length = 16, g.emb_dim = 32, g.n_heads = 4, g.n_layers = 5, g.drop_rate = 0.0;
  EXPECT_EQ(g.decoder_config().family->name, "gpt2");
  const std::map<std::string, std::pair<std::string, std::string>> expected = {
      {"mha", {"qwen3", "qwen3_moe"}}, {"gqa", {"qwen3", "qwen3_moe"}}, {"mla", {"deepseek_v3", "deepseek_v3"}},
      {"deltanet-hybrid", {"qwen3_next", "qwen3_next"}}};
  for (const auto& [attention, families] : expected)
    for (const int64_t experts : {0, 4}) {
      nn::GPTConfig v = g;
      v.attention = attention;
      v.experts = experts;
      const nn::DecoderConfig d = v.decoder_config();
      EXPECT_EQ(d.family->name, experts ? families.second : families.first) << attention;
      EXPECT_EQ(d.hidden_size, 32);
      EXPECT_EQ(d.intermediate_size, 88) << "SwiGLU of 8·C/3: 3 × 88 ≈ GELU's 2 × 128";
      EXPECT_EQ(d.num_experts, experts);
      if (experts) EXPECT_EQ(d.expert_intermediate_size, 22) << "the experts together as wide as the dense MLP";
      EXPECT_EQ(nn::GPTConfig::of(d), v) << attention << " " << experts;
      if (attention == "gqa") EXPECT_EQ(d.num_kv_heads, 1);
      if (attention == "mla") EXPECT_EQ(d.kv_lora_rank, 16);
      if (attention == "deltanet-hybrid") {  // layers 4 (every fourth) and 5 (the last) attend
        std::vector<bool> linear;
        for (const auto& l : d.layers) linear.push_back(l.linear);
        EXPECT_EQ(linear, (std::vector<bool>{true, true, true, false, false}));
      }
      nn::Decoder model(v);  // and it runs
      const NoGradGuard no_grad;
      EXPECT_EQ(model.forward(std::vector<int64_t>{1, 2, 3}, 1, 3).shape(), (Shape{1, 3, 64}));
    }
  std::map<std::string, std::string> old = g.to_strings();
  for (const char* key : {"attention", "experts", "experts_per_token"}) old.erase(key);
  EXPECT_EQ(nn::GPTConfig::from_strings(old), g) << "a checkpoint without the new keys is the book's model";
  EXPECT_THROW(nn::GPTConfig::of(nn::load_hf_decoder(fixture("hf/qwen3"))->config), ValueError);
}

TEST(GPT2Weights, HuggingFaceLayoutGivesPyTorchsLogits) {
  auto model = nn::load_gpt2(fixture("gpt2_tiny_hf.safetensors"));
  EXPECT_EQ(model->config.num_layers, 3);
  EXPECT_EQ(model->config.num_heads, 4);
  EXPECT_TRUE(model->config.tie_word_embeddings);
  const auto expected = io::SafetensorsFile::open(fixture("gpt2_tiny_hf.expected.safetensors"));
  const std::vector<int64_t> ids = expected.int64s("ids");
  NoGradGuard no_grad;
  EXPECT_TRUE(all_close(model->forward(ids, 2, 20), expected.tensor("logits"), 1e-4, 1e-5));
  EXPECT_THROW(nn::load_gpt2(fixture("gpt_tiny.safetensors")), IoError);  // the book's names, not GPT-2's
}

TEST(KVCache, CachedDecodingEqualsFullForwardPasses) {
  auto model = nn::load_gpt2(fixture("gpt2_tiny_hf.safetensors"));
  const auto expected = io::SafetensorsFile::open(fixture("gpt2_tiny_hf.expected.safetensors"));
  const std::vector<int64_t> ids = expected.int64s("ids");  // (2, 20)
  NoGradGuard no_grad;
  const Tensor full = model->forward(ids, 2, 20);
  nn::KVCache cache = model->make_cache(2);
  // A prompt of 7 tokens, then one token at a time.
  std::vector<int64_t> prompt;
  for (int b = 0; b < 2; ++b) prompt.insert(prompt.end(), ids.begin() + b * 20, ids.begin() + b * 20 + 7);
  Tensor last = model->forward_cached(prompt, 2, 7, cache);
  for (int64_t t = 7; t < 20; ++t) {
    for (int b = 0; b < 2; ++b)
      for (int64_t v = 0; v < 101; ++v)
        ASSERT_NEAR(last.at({b, v}), full.at({b, t - 1, v}), 1e-4) << "position " << t - 1;
    const std::vector<int64_t> next = {ids[static_cast<size_t>(t)], ids[static_cast<size_t>(20 + t)]};
    last = model->forward_cached(next, 2, 1, cache);
  }
  EXPECT_EQ(cache.length, 20);
  const std::vector<int64_t> more(2 * 5, 1);
  EXPECT_THROW(model->forward_cached(more, 2, 5, cache), ShapeError);  // 25 > context_length 24
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

// What a trained GPT attends to, from the fused path (q, k and the saved log-sum-exp), against PyTorch's
// materialised weights for the same model and tokens.
TEST(AttentionMaps, FusedPathWeightsEqualPyTorchs) {
  const auto file = io::SafetensorsFile::open(fixture("gpt_tiny_attention.safetensors"));
  manual_seed(123);
  nn::Decoder model(nn::GPTConfig::from_strings(file.metadata()));
  model.eval();
  const std::vector<int64_t> ids = file.int64s("ids");
  const Tensor maps = model.attention_maps(ids, {}, {});
  EXPECT_TRUE(all_close(maps, file.tensor("attention"), 1e-5, 1e-6));
  // A selection: layer 2, heads 4 and 1 (0-based 1; 3, 0), in that order.
  const Tensor some = model.attention_maps(ids, {1}, {3, 0});
  ASSERT_EQ(some.shape(), (Shape{1, 2, 16, 16}));
  const Tensor all = file.tensor("attention");
  for (int64_t i = 0; i < 16 * 16; ++i) {
    EXPECT_NEAR(some.data()[i], all.data()[(1 * 4 + 3) * 256 + i], 1e-5);
    EXPECT_NEAR(some.data()[256 + i], all.data()[(1 * 4 + 0) * 256 + i], 1e-5);
  }
  EXPECT_THROW(model.attention_maps(ids, {2}, {}), ValueError);  // the model has 2 layers
  EXPECT_THROW(model.attention_maps(ids, {}, {4}), ValueError);  // and 4 heads
}

// The recomputed weights equal the plain path's materialised softmax, over several tiles (T = 150, D = 16).
TEST(AttentionMaps, RecomputedWeightsEqualThePlainPath) {
  manual_seed(5);
  nn::MultiHeadAttention mha(24, 32, 200, 0.0, 2);
  mha.eval();
  const Tensor x = random_tensor({2, 150, 24}, 3);
  const Tensor plain = mha.trace(x).weights;  // (B, H, T, T)
  nn::AttentionStep::Record record;
  nn::AttentionStep step;
  step.record = &record;
  const Tensor fused = mha.forward(x, step);
  EXPECT_TRUE(all_close(fused, mha.trace(x).context, 1e-5, 1e-6));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      const Tensor w = mha.weights(record, b, h);
      const Tensor expected = Tensor::from(std::span<const float>(plain.data() + (b * 2 + h) * 150 * 150, 150 * 150), {150, 150});
      EXPECT_TRUE(all_close(w, expected, 1e-5, 1e-7)) << "b " << b << " h " << h;
    }
}

// Training asks the system for memory only while its block cache warms up: from the third step on, every tensor and
// kernel buffer (activations, gradients, the fused head's logits, attention scratch) comes back from the cache, so
// a long run neither faults pages in nor grows its heap. (Step 1 allocates everything; step 2 a few more blocks of
// a size, since gradients freed at its start are needed again while activations of that size still live.)
// Dropout on, gradient clipping on, as `qkv train` runs. On one thread and on two: each kernel sizes its per-thread
// buffers before its threads start, so what a step holds cannot depend on how the threads were scheduled.
void expect_allocation_free_training(int threads) {
  train::TrainSettings settings;
  settings.model = nn::GPTConfig{.vocab_size = 61, .context_length = 16, .emb_dim = 24, .n_heads = 3, .n_layers = 2,
                                 .drop_rate = 0.1, .qkv_bias = true};
  settings.batch_size = 4;
  settings.max_steps = 30;
  settings.warmup_steps = 2;
  settings.learning_rate = 1e-2;
  settings.eval_every = 0;
  settings.checkpoint_every = 0;
  std::vector<int64_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7 + i / 13) % 61);
  std::vector<int64_t> fresh;  // fresh_blocks() after each step
  std::vector<double> losses;
  {
    const ThreadCount scope(threads);
    train::Trainer trainer(settings, tokens);
    trainer.run([&](const train::StepReport& r) {
          fresh.push_back(memory::fresh_blocks());
          losses.push_back(r.loss);
        },
        [](const train::EvalReport&) {}, [](int64_t) {}, nullptr);
  }
  ASSERT_EQ(fresh.size(), 30u);
  std::string counts;
  for (int64_t f : fresh) counts += " " + std::to_string(f);
  for (size_t i = 2; i < fresh.size(); ++i)
    EXPECT_EQ(fresh[i], fresh[1]) << threads << " threads: step " << i + 1 << " took fresh blocks:" << counts;
  EXPECT_LT(losses.back(), losses.front());  // and it trained
}

TEST(Training, AllocatesNothingFromTheSystemOnceWarm) {
  expect_allocation_free_training(1);
  expect_allocation_free_training(2);
}

}  // namespace
}  // namespace qkv::test
