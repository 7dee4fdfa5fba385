// Fine-tuning against the book's PyTorch recipes (fixtures from tools/finetune_reference.py): the classifier head's
// initial weights, the frozen model's gradients and several AdamW steps; LoRA's A as the book draws it, its forward,
// every gradient, AdamW steps and the merged weight; the instruction collate; torch.randperm. Then the data readers,
// freezing by name and PEFT adapters.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/train/finetune.hpp"
#include "qkv/train/optim.hpp"

namespace qkv::test {
namespace {

class Finetune : public ::testing::Test {
 protected:
  void SetUp() override {
    file_ = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(fixture("finetune.safetensors")));
    config_ = nn::GPTConfig::from_strings(file_->metadata());
  }
  std::unique_ptr<nn::Decoder> base() const {
    Generator gen(123);
    auto model = std::make_unique<nn::Decoder>(config_, gen);
    model->eval();
    return model;
  }
  train::ClassificationSplit split(const std::string& prefix, int64_t rows) const {
    train::ClassificationSplit s;
    s.ids = file_->int64s(prefix + "ids");
    s.labels = file_->int64s(prefix + "labels");
    s.length = static_cast<int64_t>(s.ids.size()) / rows;
    s.last_real.assign(static_cast<size_t>(rows), s.length - 1);
    return s;
  }
  void expect_close(const Tensor& actual, const std::string& name, double rtol = 1e-4) const {
    ASSERT_TRUE(actual.defined()) << name << ": no value (no gradient reached it)";
    const Tensor expected = file_->tensor(name);
    double largest = 0;
    for (float v : expected.values()) largest = std::max(largest, std::fabs(static_cast<double>(v)));
    EXPECT_TRUE(all_close(actual, expected, rtol, 1e-4 * std::max(largest, 1e-3))) << name;
  }
  std::unique_ptr<io::SafetensorsFile> file_;
  nn::GPTConfig config_;
};

TEST_F(Finetune, RandpermIsPyTorchs) {
  Generator gen(123);
  EXPECT_EQ(train::randperm(12, gen), file_->int64s("randperm"));
}

TEST_F(Finetune, ClassifierHeadGradientsAndAdamWStepsMatchPyTorch) {
  auto model = base();
  const nn::StateDict state = model->state_dict(false);
  for (const auto& [name, t] : state.entries())
    EXPECT_TRUE(all_close(t, file_->tensor("param." + name), 0, 0)) << name;
  Generator head_gen(123);
  train::SequenceClassifier classifier(*model, 3, head_gen);
  EXPECT_TRUE(all_close(classifier.head.weight, file_->tensor("classify.head_init.weight"), 0, 0));
  EXPECT_TRUE(all_close(classifier.head.bias, file_->tensor("classify.head_init.bias"), 0, 0));
  const int64_t total = model->parameter_count() - model->head.numel() + classifier.head.parameter_count();
  nn::set_trainable(*model, {model->block_prefix(1), model->final_norm_prefix()});
  auto trainable = classifier.trainable_parameters();
  int64_t count = 0;
  for (const auto& [name, p] : trainable) count += p.numel();
  EXPECT_LT(count, total);
  const train::ClassificationSplit data = split("classify.", 12);

  // The first step's gradients: the last block, the final norm and the head get PyTorch's; the frozen rest none.
  Generator order_gen(123);
  const std::vector<int64_t> order = train::randperm(12, order_gen);
  std::vector<int64_t> ids, labels, positions(4, data.length - 1);
  for (int k = 0; k < 4; ++k) {
    ids.insert(ids.end(), data.ids.begin() + order[k] * data.length, data.ids.begin() + (order[k] + 1) * data.length);
    labels.push_back(data.labels[static_cast<size_t>(order[k])]);
  }
  cross_entropy(classifier.logits(ids, 4, data.length, positions), labels).backward();
  for (const auto& [name, p] : trainable) expect_close(p.grad(), "classify.grad." + name);
  for (const auto& [name, p] : model->named_parameters())
    if (!p.requires_grad()) {
      EXPECT_FALSE(p.grad().defined()) << name << " is frozen but got a gradient";
    }
  for (auto& [name, p] : trainable) p.set_grad(Tensor());

  train::ClassifierOptions options;
  options.lr = 1e-3;
  options.batch_size = 4;
  options.epochs = 2;
  std::vector<float> losses;
  train::train_classifier(classifier, data, data, options, {.on_step = [&](const train::ClassifierProgress& p) {
                                                              losses.push_back(static_cast<float>(p.loss));
                                                            }});
  EXPECT_TRUE(all_close(Tensor::from(losses, {6}), file_->tensor("classify.losses"), 1e-4, 1e-5));
  expect_close(classifier.head.weight, "classify.final.out_head.weight");
  const auto metrics = train::evaluate_classifier(classifier, data, 8, 0, train::Pooling::Last);
  EXPECT_NEAR(metrics.accuracy, file_->tensor("classify.accuracy").item(), 1e-6);
}

TEST_F(Finetune, TheFrozenPrefixCacheChangesNothingButTheWork) {
  const train::ClassificationSplit data = split("classify.", 12);
  std::vector<std::vector<float>> runs;
  for (int64_t cache : {int64_t{0}, int64_t{1} << 30}) {
    auto model = base();
    Generator gen(123);
    train::SequenceClassifier classifier(*model, 3, gen);
    nn::set_trainable(*model, {model->block_prefix(1), model->final_norm_prefix()});
    EXPECT_EQ(classifier.enable_prefix_cache(cache), cache ? 1 : 0);  // block 0 is frozen: its output is kept
    train::ClassifierOptions options;
    options.lr = 1e-3;
    options.batch_size = 4;
    options.epochs = 3;
    options.prefix_cache_bytes = cache;
    std::vector<float> losses;
    train::train_classifier(classifier, data, data, options,
                            {.on_step = [&](const train::ClassifierProgress& p) { losses.push_back(static_cast<float>(p.loss)); }});
    runs.push_back(losses);
  }
  EXPECT_TRUE(all_close(Tensor::from(runs[1], {9}), Tensor::from(runs[0], {9}), 1e-6, 1e-7));
  // Something before the blocks trains (the position table): nothing can be cached.
  auto model = base();
  Generator gen(123);
  train::SequenceClassifier classifier(*model, 3, gen);
  nn::set_trainable(*model, {"pos_emb", "final_norm"});
  EXPECT_EQ(classifier.enable_prefix_cache(int64_t{1} << 30), 0);
  nn::set_trainable(*model, {"final_norm"});
  EXPECT_EQ(classifier.enable_prefix_cache(int64_t{1} << 30), 2);  // only the norm and the head: every block cached
}

TEST_F(Finetune, LoraDrawsTheBooksAMatchesPyTorchsGradientsStepsAndMerge) {
  auto model = base();
  Generator gen(123);
  train::SequenceClassifier classifier(*model, 3, gen);
  nn::set_trainable(*model, {});
  EXPECT_EQ(model->trainable_parameter_count(), 0);
  const std::vector<std::string> adapted = nn::add_lora(*model, {.rank = 2, .alpha = 4, .targets = {"all"}}, gen, {"out_head"});
  ASSERT_EQ(adapted.size(), 12u);  // six Linear layers per block
  EXPECT_EQ(adapted[0], "trf_blocks.0.att.W_query");
  EXPECT_EQ(model->trainable_parameter_count() + classifier.head.parameter_count(), file_->int64s("lora.trainable")[0]);
  std::map<std::string, nn::LoraSite> layers;
  for (const nn::LoraSite& site : model->lora_sites())
    if (site.lora && site.lora->defined()) layers[site.name] = site;
  for (const std::string& name : adapted) {
    EXPECT_TRUE(all_close(layers.at(name).lora->a, file_->tensor("lora.A_init." + name), 0, 0)) << name;
    layers.at(name).lora->b.copy_(file_->tensor("lora.B_set." + name));
  }
  const std::vector<int64_t> ids = file_->int64s("lora.ids"), labels = file_->int64s("lora.labels"), last(4, 9);
  const Tensor logits = classifier.logits(ids, 4, 10, last);
  expect_close(logits, "lora.logits");
  cross_entropy(logits, labels).backward();
  for (const std::string& name : adapted) {
    expect_close(layers.at(name).lora->a.grad(), "lora.grad_A." + name);
    expect_close(layers.at(name).lora->b.grad(), "lora.grad_B." + name);
    EXPECT_FALSE(layers.at(name).weight.grad().defined()) << name;
  }
  expect_close(classifier.head.weight.grad(), "lora.grad.out_head.weight");

  optim::AdamW optimizer(classifier.trainable_parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  std::vector<float> losses;
  for (int s = 0; s < 3; ++s) {
    optimizer.zero_grad(true);
    const Tensor loss = cross_entropy(classifier.logits(ids, 4, 10, last), labels);
    losses.push_back(loss.item());
    loss.backward();
    optimizer.step();
  }
  EXPECT_TRUE(all_close(Tensor::from(losses, {3}), file_->tensor("lora.losses"), 1e-4, 1e-5));
  int states = 0;
  optimizer.for_each_state([&](const std::string&, Tensor&) { ++states; });
  EXPECT_EQ(states, 2 * (2 * 12 + 2));  // AdamW's two moments for the adapters and the head, none for the frozen base
  expect_close(layers.at(adapted[0]).lora->b, "lora.final_B." + adapted[0]);
  const Tensor before = classifier.logits(ids, 4, 10, last);
  nn::merge_lora(*model);
  expect_close(layers.at(adapted[0]).weight, "lora.merged." + adapted[0]);
  EXPECT_FALSE(layers.at(adapted[0]).lora->defined());
  EXPECT_TRUE(all_close(classifier.logits(ids, 4, 10, last), before, 1e-4, 1e-5));  // merged computes the same
}

TEST_F(Finetune, InstructionCollateAndAdamWStepsMatchTheBook) {
  const std::vector<int64_t> flat = file_->int64s("instruct.entries"), lengths = file_->int64s("instruct.lengths"),
                             prompts = file_->int64s("instruct.prompt_tokens");
  std::vector<train::EncodedInstruction> entries;
  size_t at = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    entries.push_back({{flat.begin() + static_cast<int64_t>(at), flat.begin() + static_cast<int64_t>(at + lengths[i])}, prompts[i]});
    at += static_cast<size_t>(lengths[i]);
  }
  std::vector<const train::EncodedInstruction*> rows;
  for (const auto& e : entries) rows.push_back(&e);
  for (bool masked : {false, true}) {
    const train::InstructionBatch b = train::collate_instructions(rows, 96, 9, masked);
    const std::string key = masked ? "instruct.masked." : "instruct.";
    EXPECT_EQ(b.inputs, file_->int64s(key + "inputs")) << key;
    EXPECT_EQ(b.targets, file_->int64s(key + "targets")) << key;
    EXPECT_EQ(b.batch, 4);
    EXPECT_EQ(b.tokens, 9);
  }
  auto model = base();
  const train::InstructionBatch b = train::collate_instructions(rows, 96, 9, false);
  optim::AdamW optimizer(model->named_trainable_parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  std::vector<float> losses;
  for (int s = 0; s < 3; ++s) {
    optimizer.zero_grad(true);
    const Tensor loss = model->loss(b.inputs, b.batch, b.tokens, b.targets);
    losses.push_back(loss.item());
    loss.backward();
    optimizer.step();
  }
  EXPECT_TRUE(all_close(Tensor::from(losses, {3}), file_->tensor("instruct.losses"), 1e-4, 1e-5));
}

TEST_F(Finetune, TrainableByNameAndItsErrors) {
  auto model = base();
  EXPECT_TRUE(nn::name_matches("trf_blocks.1", "trf_blocks.1.att.W_query.weight"));
  EXPECT_FALSE(nn::name_matches("trf_blocks.1", "trf_blocks.10.att.W_query.weight"));
  EXPECT_TRUE(nn::name_matches("*.norm1.*", "trf_blocks.0.norm1.scale"));
  EXPECT_FALSE(nn::name_matches("*.norm1", "trf_blocks.0.norm1.scale"));
  nn::set_trainable(*model, {"final_norm", "*.norm2.*"});
  EXPECT_EQ(model->trainable_parameter_count(), 2 * 32 + 2 * 2 * 32);
  try {
    nn::set_trainable(*model, {"trf_blocks.7"});
    FAIL() << "a pattern that matches nothing must be an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("trf_blocks.7"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model->trainable_parameter_count(), 2 * 32 + 2 * 2 * 32);  // unchanged by the refused call
  Generator gen(1);
  EXPECT_THROW(nn::add_lora(*model, {.rank = 0}, gen), ValueError);
  EXPECT_THROW(nn::add_lora(*model, {.rank = 33}, gen), ValueError);  // larger than the 32-wide layers
  EXPECT_THROW(nn::add_lora(*model, {.rank = 2, .targets = {"*nothing*"}}, gen), ValueError);
  int adapted = 0;
  model->for_each_module([&](const std::string&, nn::Module& m) {
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) adapted += l->has_lora();
  });
  EXPECT_EQ(adapted, 0);  // a refused call adds nothing
  EXPECT_EQ(train::with_commas(124441346), "124,441,346");
  EXPECT_EQ(train::with_commas(512), "512");
}

TEST_F(Finetune, PeftAdapterRoundTripsAndRefusesAnotherModel) {
  auto model = base();
  Generator gen(4);
  nn::set_trainable(*model, {});
  const auto names = nn::add_lora(*model, {.rank = 4, .alpha = 8, .targets = {"attention"}}, gen, {"out_head"});
  EXPECT_EQ(names.size(), 8u);
  nn::LoraWeights* first = nullptr;
  for (const nn::LoraSite& site : model->lora_sites())
    if (site.name == names[0]) first = site.lora;
  ASSERT_NE(first, nullptr);
  first->b.copy_(random_tensor(first->b.shape(), 3));
  const std::string dir = ::testing::TempDir() + "/qkv_adapter";
  std::filesystem::remove_all(dir);
  nn::save_peft_adapter(dir, *model, {.rank = 4, .alpha = 8, .target_modules = names, .base_model = "tiny"},
                           {{"out_head.weight", random_tensor({3, 32}, 5)}});
  const nn::PeftAdapter adapter = nn::read_peft_adapter(dir);
  EXPECT_EQ(adapter.rank, 4);
  EXPECT_EQ(adapter.alpha, 8);
  EXPECT_EQ(adapter.tensors.count("trf_blocks.0.att.W_query.lora_A.weight"), 1u);
  EXPECT_EQ(adapter.tensors.count("out_head.weight"), 1u);
  auto fresh = base();
  nn::apply_peft_adapter(*fresh, adapter);
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6};
  EXPECT_TRUE(all_close(fresh->forward(ids, 1, 6), model->forward(ids, 1, 6), 0, 0));
  nn::GPTConfig other = config_;
  other.emb_dim = 16;
  other.n_heads = 2;
  nn::Decoder wrong(other);
  EXPECT_THROW(nn::apply_peft_adapter(wrong, adapter), ValueError);
  EXPECT_THROW(nn::read_peft_adapter(::testing::TempDir()), IoError);
}

// One step down the gradient of `model`'s LoRA adapters (0.05 × each), the loss of (ids, targets) taken before and
// after: it must fall. With `only_adapters`, every other parameter must have no gradient.
void expect_adapters_train(nn::Decoder& model, const std::vector<int64_t>& ids, const std::vector<int64_t>& targets,
                           int64_t T, bool only_adapters = true) {
  const Tensor before = model.loss(ids, 2, T, targets);
  before.backward();
  {
    NoGradGuard no_grad;
    for (auto& [name, p] : model.named_parameters()) {
      if (name.find(".lora_") == std::string::npos) {
        if (only_adapters) EXPECT_FALSE(p.grad().defined()) << name;
        continue;
      }
      ASSERT_TRUE(p.grad().defined()) << name;
      for (int64_t i = 0; i < p.numel(); ++i) p.data()[i] -= 0.05f * p.grad().data()[i];
    }
  }
  EXPECT_LT(model.loss(ids, 2, T, targets).item(), before.item() - 1e-4);
}

// LoRA on today's decoders: every block's q/k/v/o and MLP projections (every expert's too) under PEFT's names; an
// adapted model computes what
// its merged weights do (values and the loss), only the adapters (and no frozen weight) get gradients, and a PEFT
// folder written from one model applies to a fresh one.
class DecoderLora : public ::testing::TestWithParam<std::string> {};

TEST_P(DecoderLora, AdaptsEveryProjectionAndEqualsItsMergedWeights) {
  const std::string folder = fixture("hf/" + GetParam());
  auto model = nn::load_hf_decoder(folder);
  nn::set_trainable(*model, {});
  Generator gen(5);
  const auto names = nn::add_lora(*model, {.rank = 2, .alpha = 4}, gen);
  const nn::DecoderConfig& c = model->config;
  if (c.num_experts == 0) {
    const int64_t per_block = c.mlp == nn::MlpKind::GELU ? 6 : 7;
    EXPECT_EQ(static_cast<int64_t>(names.size()), per_block * c.num_layers);
  } else if (c.family->stacked_experts) {  // gpt-oss: q, k, v, o and the two stacked parameters of every layer
    EXPECT_EQ(static_cast<int64_t>(names.size()), 6 * c.num_layers);
    for (const std::string part : {"gate_up_proj", "down_proj"})
      EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.mlp.experts." + part), names.end()) << part;
  } else {  // every expert's gate, up and down in every mixture-of-experts layer, under PEFT's names
    int64_t moe_layers = 0, expert_sites = 0;
    for (const auto& layer : c.layers) moe_layers += layer.experts;
    for (const auto& name : names) expert_sites += name.find(".mlp.experts.") != std::string::npos;
    EXPECT_GT(moe_layers, 0);
    EXPECT_EQ(expert_sites, 3 * c.num_experts * moe_layers);
    int64_t first_moe = 0;
    while (!c.layers[static_cast<size_t>(first_moe)].experts) ++first_moe;
    const std::string expert = "model.layers." + std::to_string(first_moe) + ".mlp.experts." + std::to_string(c.num_experts - 1);
    for (const std::string part : {".gate_proj", ".up_proj", ".down_proj"})
      EXPECT_NE(std::find(names.begin(), names.end(), expert + part), names.end()) << expert + part;
  }
  EXPECT_EQ(names[0], c.layers[0].linear ? "model.layers.0.linear_attn.in_proj_qkvz"
                     : c.latent()          ? "model.layers.0.self_attn.q_a_proj"
                                           : "model.layers.0.self_attn.q_proj");
  for (auto& site : model->lora_sites()) site.lora->b.copy_(random_tensor(site.lora->b.shape(), 7, 0.1f));
  const int64_t T = 6;
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < 2 * T; ++i) ids.push_back((7 * i + 3) % model->vocab_size()), targets.push_back((5 * i + 1) % model->vocab_size());
  model->eval();
  const Tensor adapted = model->forward(ids, 2, T);
  const Tensor loss = model->loss(ids, 2, T, targets);
  loss.backward();
  for (const auto& [name, p] : model->named_parameters()) {
    const bool adapter = name.find(".lora_") != std::string::npos;
    EXPECT_EQ(p.grad().defined(), adapter) << name;
  }
  const std::string dir = ::testing::TempDir() + "/qkv_decoder_adapter_" + GetParam();
  std::filesystem::remove_all(dir);
  nn::save_peft_adapter(dir, *model, {.rank = 2, .alpha = 4, .target_modules = names}, {});
  auto fresh = nn::load_hf_decoder(folder);
  nn::apply_peft_adapter(*fresh, nn::read_peft_adapter(dir));
  fresh->eval();
  EXPECT_TRUE(all_close(fresh->forward(ids, 2, T), adapted, 0, 0));
  nn::merge_lora(*model);
  EXPECT_TRUE(model->lora_sites()[0].lora->defined() == false);
  // (Qwen3-Next's delta rule carries float32 rounding on: merged and adapted differ by 1.3e-5 of the largest logit,
  // the noise its family test allows)
  float largest = 0.0f;
  for (int64_t i = 0; i < adapted.numel(); ++i) largest = std::max(largest, std::abs(adapted.data()[i]));
  const float atol = GetParam() == "qwen3_next" ? 1e-4f * largest : 1e-5f;
  EXPECT_TRUE(all_close(model->forward(ids, 2, T), adapted, 1e-4, atol));
  EXPECT_NEAR(model->loss(ids, 2, T, targets).item(), loss.item(), GetParam() == "qwen3_next" ? 1e-4 : 1e-5);
  // A step down the adapters' gradient lowers the loss: they train (the experts' through the fused kernel's backward)
  nn::set_trainable(*fresh, {"*.lora_A.weight", "*.lora_B.weight"});
  expect_adapters_train(*fresh, ids, targets, T);
}

INSTANTIATE_TEST_SUITE_P(Families, DecoderLora,
                         ::testing::Values("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "deepseek_v3", "qwen3_next",
                                           "gpt_oss"));

// PEFT's LoRA on gpt-oss's stacked experts (target_parameters), as tools/decoder_reference.py writes it from PEFT's
// get_delta_weight: the adapter folder read and applied gives PyTorch's logits, loss (with the router's auxiliary
// loss) and the gradient of every lora_A and lora_B, under PEFT's nested names; the same updates in the swapped
// orientation other PEFT/transformers versions write give the same logits; qkv's own folder round-trips.
TEST(GptOssLora, PeftsExpertAdapterGivesPyTorchsLogitsLossAndGradients) {
  const auto expected = io::SafetensorsFile::open(fixture("hf/gpt_oss_lora.expected.safetensors"));
  const std::vector<int64_t> ids = expected.int64s("ids"), targets = expected.int64s("targets");
  const int64_t B = 2, T = static_cast<int64_t>(ids.size()) / B;
  auto model = nn::load_hf_decoder(fixture("hf/gpt_oss"));
  nn::set_trainable(*model, {});
  const nn::PeftAdapter adapter = nn::read_peft_adapter(fixture("hf/gpt_oss_lora"));
  EXPECT_EQ(adapter.target_parameters, (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  EXPECT_TRUE(nn::apply_peft_adapter(*model, adapter).empty());
  model->eval();
  const Tensor want = expected.tensor("logits");
  Tensor logits;
  {
    NoGradGuard no_grad;
    logits = model->forward(ids, B, T);
    EXPECT_TRUE(all_close(logits, want, 1e-4, 1e-5));
    Tensor base = nn::load_hf_decoder(fixture("hf/gpt_oss"))->forward(ids, B, T);
    EXPECT_FALSE(all_close(base, want, 1e-2, 1e-2));  // the adapter changes them
  }
  Tensor loss = model->loss(ids, B, T, targets);
  EXPECT_NEAR(loss.item(), expected.tensor("loss").item(), 1e-5);
  loss.backward();
  // qkv registers a stacked parameter's pair under the parameter's name; PEFT's key is the nested wrapper's
  const std::map<std::string, std::string> peft = {{"mlp.experts.gate_up_proj.", "mlp.experts.base_layer."},
                                                   {"mlp.experts.down_proj.", "mlp.experts."}};
  int checked = 0;
  for (auto& [name, p] : model->named_parameters()) {
    if (name.find(".lora_") == std::string::npos) {
      EXPECT_FALSE(p.grad().defined()) << name;
      continue;
    }
    std::string key = name;
    for (const auto& [ours, theirs] : peft)
      if (const size_t at = key.find(ours); at != std::string::npos) key.replace(at, ours.size(), theirs);
    const Tensor w = expected.tensor("grad." + key);
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_TRUE(all_close(p.grad(), w, 1e-4, 1e-5)) << name << " (" << key << ")";
    ++checked;
  }
  EXPECT_EQ(checked, 2 * 3 * 2);  // q_proj, gate_up_proj and down_proj's pairs in 2 layers
  // the swapped orientation
  auto swapped = nn::load_hf_decoder(fixture("hf/gpt_oss"));
  nn::apply_peft_adapter(*swapped, nn::read_peft_adapter(fixture("hf/gpt_oss_lora_swapped")));
  swapped->eval();
  {
    NoGradGuard no_grad;
    EXPECT_TRUE(all_close(swapped->forward(ids, B, T), want, 1e-4, 1e-5));
  }
  // written by qkv: PEFT's keys and config, read back to the same logits
  const std::string dir = ::testing::TempDir() + "/qkv_gpt_oss_expert_adapter";
  std::filesystem::remove_all(dir);
  std::vector<std::string> names;
  for (const auto& site : model->lora_sites())
    if (site.lora->defined()) names.push_back(site.name);
  nn::save_peft_adapter(dir, *model, {.rank = 2, .alpha = 3, .target_modules = names}, {});
  const nn::PeftAdapter written = nn::read_peft_adapter(dir);
  EXPECT_EQ(written.target_parameters.size(), 4u);  // both parameters of both layers, by full name
  EXPECT_EQ(written.target_modules.size(), 2u);
  for (const auto& [key, t] : adapter.tensors) {
    ASSERT_TRUE(written.tensors.count(key)) << key;
    EXPECT_TRUE(all_close(written.tensors.at(key), t, 0, 0)) << key;
  }
  auto fresh = nn::load_hf_decoder(fixture("hf/gpt_oss"));
  nn::apply_peft_adapter(*fresh, written);
  fresh->eval();
  NoGradGuard no_grad;
  EXPECT_TRUE(all_close(fresh->forward(ids, B, T), logits, 0, 0));
  // an adapter whose config lost its target_parameters cannot say which parameter a pair adapts
  nn::PeftAdapter unnamed = adapter;
  unnamed.target_parameters.clear();
  auto other = nn::load_hf_decoder(fixture("hf/gpt_oss"));
  try {
    nn::apply_peft_adapter(*other, unnamed);
    ADD_FAILURE() << "applied";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("target_parameters"), std::string::npos) << e.what();
  }
}

// gpt-oss as published, its experts MXFP4: LoRA on the attention trains over the frozen MXFP4 experts (the gradient
// reaches the adapters through them), and the experts stay MXFP4
TEST(GptOssLora, AttentionTrainsOverMxfp4Experts) {
  auto model = nn::load_hf_decoder(fixture("hf/gpt_oss_mxfp4"));
  nn::set_trainable(*model, {});
  Generator gen(6);
  const auto names = nn::add_lora(*model, {.rank = 2, .alpha = 4, .targets = {"attention"}}, gen);
  ASSERT_FALSE(names.empty());
  for (const auto& name : names) EXPECT_NE(name.find(".self_attn."), std::string::npos) << name;
  nn::set_trainable(*model, {"*.lora_A.weight", "*.lora_B.weight"});
  for (auto& site : model->lora_sites())
    if (site.lora->defined()) site.lora->b.copy_(random_tensor(site.lora->b.shape(), 8, 0.1f));
  const int64_t T = 6;
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < 2 * T; ++i) ids.push_back((7 * i + 3) % 80), targets.push_back((5 * i + 1) % 80);
  expect_adapters_train(*model, ids, targets, T);
  EXPECT_EQ(model->parameter(nn::Role::StackedDown, 1).weight_type(), kernels::WeightType::MXFP4);
}

// QLoRA on a mixture of experts kept one tensor per expert (Qwen3-MoE) stored as Q8_0: adapters on every expert and
// on the attention train through the frozen rows (the experts' side path, nothing widened). Against the same adapters
// on the float32 model: the logits differ by what the two bases differ by (Q8_0's rounding: 5% of the range on this
// random model, whose routers flip near-ties), and each adapter's gradient points the same way (cosine ≥ 0.95).
TEST(MoeLora, ExpertAdaptersTrainOverQ8_0Experts) {
  auto model = nn::load_hf_decoder(fixture("hf/qwen3_moe"));
  auto wide = nn::load_hf_decoder(fixture("hf/qwen3_moe"));
  const int64_t T = 6;
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < 2 * T; ++i) ids.push_back((7 * i + 3) % 64), targets.push_back((5 * i + 1) % 64);
  auto gap = [](const Tensor& a, const Tensor& b) {
    float d = 0.0f;
    for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.data()[i] - b.data()[i]));
    return d;
  };
  model->store_matrices(kernels::WeightType::Q8_0);
  auto first_expert = [&] {
    for (auto& b : model->blocks)
      if (!b.expert_gate.empty()) return b.expert_gate.front();  // (F, C): down's rows of F = 10 stay float32
    return Tensor();
  };
  ASSERT_EQ(first_expert().weight_type(), kernels::WeightType::Q8_0);
  model->eval();
  wide->eval();
  float bases = 0.0f;
  {
    NoGradGuard no_grad;
    bases = gap(model->forward(ids, 2, T), wide->forward(ids, 2, T));
  }
  for (auto* m : {model.get(), wide.get()}) {
    nn::set_trainable(*m, {});
    Generator gen(11);
    nn::add_lora(*m, {.rank = 2, .alpha = 4}, gen);
    for (auto& site : m->lora_sites())
      if (site.lora->defined()) site.lora->b.copy_(random_tensor(site.lora->b.shape(), 12, 0.1f));
  }
  {
    NoGradGuard no_grad;
    const float adapted = gap(model->forward(ids, 2, T), wide->forward(ids, 2, T));
    EXPECT_LT(adapted, 2.0f * bases) << "the bases differ by " << bases;
  }
  const Tensor before = model->loss(ids, 2, T, targets);
  before.backward();
  wide->loss(ids, 2, T, targets).backward();
  std::map<std::string, Tensor> wide_grads;
  for (auto& [name, p] : wide->named_parameters())
    if (p.grad().defined()) wide_grads[name] = p.grad();
  int experts = 0;
  {
    NoGradGuard no_grad;
    for (auto& [name, p] : model->named_parameters()) {
      if (name.find(".lora_") == std::string::npos) {
        EXPECT_FALSE(p.grad().defined()) << name;
        continue;
      }
      ASSERT_TRUE(p.grad().defined()) << name;
      const Tensor& w = wide_grads.at(name);
      double dot = 0.0, a2 = 0.0, b2 = 0.0;
      for (int64_t i = 0; i < w.numel(); ++i) {
        dot += static_cast<double>(p.grad().data()[i]) * w.data()[i];
        a2 += static_cast<double>(p.grad().data()[i]) * p.grad().data()[i];
        b2 += static_cast<double>(w.data()[i]) * w.data()[i];
      }
      if (b2 > 0.0) {  // an expert no token chose has none in either
        experts += name.find(".mlp.experts.") != std::string::npos;
        EXPECT_GE(dot / std::sqrt(a2 * b2), 0.95) << name;
      }
      for (int64_t i = 0; i < p.numel(); ++i) p.data()[i] -= 0.05f * p.grad().data()[i];
    }
  }
  EXPECT_GT(experts, 0);
  EXPECT_LT(model->loss(ids, 2, T, targets).item(), before.item() - 1e-4);
  EXPECT_EQ(first_expert().weight_type(), kernels::WeightType::Q8_0);
}

// QLoRA on the experts themselves: adapters on gpt-oss's MXFP4 stacked experts train through the frozen blocks (the
// kernel's side path, no expert widened), and give what the same adapters give on the experts widened to float32
TEST(GptOssLora, ExpertAdaptersTrainOverMxfp4Experts) {
  auto model = nn::load_hf_decoder(fixture("hf/gpt_oss_mxfp4"));
  ASSERT_EQ(model->parameter(nn::Role::StackedGateUp, 0).weight_type(), kernels::WeightType::MXFP4);
  nn::set_trainable(*model, {});
  Generator gen(6);
  const auto names = nn::add_lora(*model, {.rank = 2, .alpha = 4, .targets = {"mlp"}}, gen);
  EXPECT_EQ(names, (std::vector<std::string>{"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                                             "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}));
  for (auto& site : model->lora_sites())
    if (site.lora->defined()) site.lora->b.copy_(random_tensor(site.lora->b.shape(), 9, 0.2f));
  const int64_t T = 6;
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < 2 * T; ++i) ids.push_back((7 * i + 3) % 80), targets.push_back((5 * i + 1) % 80);
  model->eval();
  const std::string dir = ::testing::TempDir() + "/qkv_gpt_oss_mxfp4_expert_adapter";
  std::filesystem::remove_all(dir);
  nn::save_peft_adapter(dir, *model, {.rank = 2, .alpha = 4, .target_modules = names}, {});
  // the same adapter on the experts widened to float32 (--weights f32). The MXFP4 path quantizes activations to 8 bits
  // (6% of the logits' range from PyTorch's on this model, test_moe.cpp), so the adapted models differ by what the
  // bases differ by, and the adapter moves the logits far more than that
  nn::PretrainedOptions wide;
  wide.weights = kernels::WeightType::F32;
  wide.tokenizer = false;
  const auto widened_base = nn::load_pretrained(fixture("hf/gpt_oss_mxfp4"), wide);
  wide.adapter = dir;
  const auto widened = nn::load_pretrained(fixture("hf/gpt_oss_mxfp4"), wide);
  EXPECT_EQ(widened->model->parameter(nn::Role::StackedGateUp, 0).weight_type(), kernels::WeightType::F32);
  const auto base = nn::load_hf_decoder(fixture("hf/gpt_oss_mxfp4"));
  base->eval();
  {
    NoGradGuard no_grad;
    auto gap = [](const Tensor& a, const Tensor& b) {
      float d = 0.0f;
      for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.data()[i] - b.data()[i]));
      return d;
    };
    const Tensor got = model->forward(ids, 2, T), want = widened->model->forward(ids, 2, T);
    const float bases = gap(base->forward(ids, 2, T), widened_base->model->forward(ids, 2, T)), adapted = gap(got, want);
    EXPECT_LT(adapted, 1.5f * bases + 1e-3f) << "the bases differ by " << bases;
    EXPECT_GT(gap(want, widened_base->model->forward(ids, 2, T)), 2.0f * adapted);
    // merged into the float32 experts: the adapted logits
    nn::merge_lora(*widened->model);
    EXPECT_TRUE(all_close(widened->model->forward(ids, 2, T), want, 1e-4, 1e-5));
    // merging into MXFP4 blocks is refused, naming the fix
    try {
      nn::merge_lora(*model);
      ADD_FAILURE() << "merged into MXFP4";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("--weights f32"), std::string::npos) << e.what();
    }
  }
  expect_adapters_train(*model, ids, targets, T);
  EXPECT_EQ(model->parameter(nn::Role::StackedGateUp, 1).weight_type(), kernels::WeightType::MXFP4);
}

TEST(LabelledTexts, CsvWithQuotesCommasAndNewlinesTsvAndJsonLines) {
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
    return dir + "/" + name;
  };
  const auto csv = text::read_labelled_texts(
      write("a.csv", "Label,Text\r\nspam,\"Win, now!\"\nham,\"She said \"\"hi\"\"\nand left\"\n\nham,plain\n"));
  ASSERT_EQ(csv.size(), 3u);
  EXPECT_EQ(csv[0].text, "Win, now!");
  EXPECT_EQ(csv[1].text, "She said \"hi\"\nand left");
  EXPECT_EQ(csv[2].label, "ham");
  EXPECT_EQ(csv[2].line, 6);
  const auto tsv = text::read_labelled_texts(write("SMSSpamCollection.tsv", "ham\tGo until jurong point\nspam\tFree entry\n"));
  ASSERT_EQ(tsv.size(), 2u);
  EXPECT_EQ(tsv[1].label, "spam");
  const auto jsonl = text::read_labelled_texts(write("b.jsonl", "{\"text\": \"a\", \"label\": 1}\n\n{\"text\": \"b\", \"label\": 0}\n"));
  ASSERT_EQ(jsonl.size(), 2u);
  EXPECT_EQ(jsonl[0].label, "1");
  EXPECT_EQ(train::label_names(jsonl), (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(train::label_names(csv), (std::vector<std::string>{"spam", "ham"}));
  auto message = [&](const std::string& name, const std::string& text) -> std::string {
    try {
      text::read_labelled_texts(write(name, text));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message("c.csv", "Label,Body\nham,x\n").find("no column 'Text'"), std::string::npos);
  EXPECT_NE(message("d.csv", "Label,Text\nham,x\nspam\n").find("d.csv:3"), std::string::npos);
  EXPECT_NE(message("e.csv", "Label,Text\nham,\"never closed\n").find("never ends"), std::string::npos);
  EXPECT_NE(message("f.jsonl", "{\"text\": \"a\"}\n").find("f.jsonl:1: no \"Label\""), std::string::npos);
  EXPECT_NE(message("g.csv", "Label,Text\nham,say \"hi\"\n").find("column 2"), std::string::npos);
  EXPECT_THROW(text::read_text_file("/dev/zero"), IoError);
}

TEST(Instructions, TheBooksPromptSplitAndErrors) {
  const auto entries = text::parse_instructions(
      R"([{"instruction": "Add", "input": "1 and 2", "output": "3"}, {"instruction": "Greet", "output": "Hi"}])", "x.json");
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(text::alpaca_prompt(entries[0]),
            "Below is an instruction that describes a task. Write a response that appropriately completes the request."
            "\n\n### Instruction:\nAdd\n\n### Input:\n1 and 2");
  EXPECT_EQ(text::alpaca_prompt(entries[1]).find("### Input"), std::string::npos);
  EXPECT_EQ(text::alpaca_response(entries[1]), "\n\n### Response:\nHi");
  try {
    text::parse_instructions(R"([{"instruction": "a", "output": "b"}, {"instruction": "c"}])", "data.json");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("entry 1 has no \"output\""), std::string::npos) << e.what();
  }
  std::vector<text::Instruction> many(100, entries[0]);
  for (size_t i = 0; i < many.size(); ++i) many[i].output = std::to_string(i);
  const auto book = train::split_instructions(many, 0);
  EXPECT_EQ(book.train.size(), 85u);
  EXPECT_EQ(book.test.size(), 10u);
  EXPECT_EQ(book.validation.size(), 5u);
  EXPECT_EQ(book.test[0].output, "85");  // the book's split keeps the file's order
  const auto shuffled = train::split_instructions(many, 7);
  EXPECT_EQ(shuffled.train.size(), 85u);
  EXPECT_NE(shuffled.test[0].output, "85");
}


// ---- the commands, end to end on a tiny byte-level model ----

namespace fs = std::filesystem;

class FinetuneCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("qkv_finetune_cli_" + std::to_string(::getpid()));  // ctest runs each test in its own process
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string text;
    for (int i = 0; i < 200; ++i) text += "In the beginning God created the heaven and the earth. ";
    std::ofstream(dir_ / "text.txt") << text;
    const CliResult r = run_cli("train --text " + path("text.txt") + " --tokenizer bytes --vocab-size 256 --context-length 192 "
                                "--emb-dim 32 --n-heads 2 --n-layers 2 --batch-size 4 --eval-every 0 --sample-tokens 0 "
                                "--lr 3e-3 --warmup 5 --steps 20 --out " + path("base"));
    ASSERT_EQ(r.code, 0) << r.out;
    // Two classes a byte model separates quickly: words of the first half of the alphabet, or of the second.
    Generator gen(3);
    auto words = [&](bool low) {
      std::string s;
      const int n = 2 + static_cast<int>(gen.next_u32() % 4);
      for (int w = 0; w < n; ++w) {
        if (w) s += ' ';
        for (int c = 0, len = 2 + static_cast<int>(gen.next_u32() % 5); c < len; ++c)
          s += static_cast<char>((low ? 'a' : 'n') + gen.next_u32() % 13);
      }
      return s;
    };
    for (const auto& [split, n] : {std::pair{"train", 48}, {"val", 16}, {"test", 16}}) {
      std::ofstream csv(dir_ / (std::string(split) + ".csv"));
      csv << "Label,Text\n";
      for (int i = 0; i < n; ++i) csv << (i % 2 ? "high" : "low") << ",\"" << words(i % 2 == 0) << "\"\n";
    }
    std::ofstream json(dir_ / "data.json");
    json << "[";
    for (int i = 0; i < 24; ++i)
      json << (i ? "," : "") << R"({"instruction": "Say )" << "abc"[i % 3] << R"(.", "input": ")" << (i % 2 ? "" : "now")
           << R"(", "output": ")" << std::string(3, "abc"[i % 3]) << "\"}";
    json << "]";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string path(const std::string& name) { return (dir_ / name).string(); }
  static std::string read(const std::string& name) {
    std::ifstream in(dir_ / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static std::string classify_args(const std::string& out) {
    return "finetune classify --checkpoint " + path("base/checkpoint.safetensors") + " --train " + path("train.csv") +
           " --val " + path("val.csv") + " --test " + path("test.csv") + " --out " + path(out) +
           " --epochs 3 --batch-size 4 --lr 3e-3 --pooling last-real --overwrite";
  }
  static fs::path dir_;
};
fs::path FinetuneCli::dir_;

TEST_F(FinetuneCli, ClassifyTrainsWritesItsFilesAndClassifiesAgain) {
  const CliResult r = run_cli(classify_args("clf") + " --trainable all");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("Total trainable parameters before: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Ep 1 (Step 000000): Train loss"), std::string::npos) << r.out;
  for (const char* f : {"model.pth", "config.json", "metrics.json", "losses.csv", "loss.png", "accuracy.png", "confusion.png"})
    EXPECT_TRUE(fs::exists(dir_ / "clf" / f)) << f;
  const auto metrics = nlohmann::json::parse(read("clf/metrics.json"));
  EXPECT_EQ(metrics["labels"], (std::vector<std::string>{"low", "high"}));
  EXPECT_GE(metrics["test"]["accuracy"].get<double>(), 0.8) << metrics.dump();
  int confusion = 0;
  for (const auto& row : metrics["confusion_matrix"]["rows_true_columns_predicted"])
    for (const auto& c : row) confusion += c.get<int>();
  EXPECT_EQ(confusion, 16);
  const CliResult c = run_cli("classify --checkpoint " + path("clf/model.pth") + " --text \"abc def\" --text \"xyz uvw rst\" --json");
  ASSERT_EQ(c.code, 0) << c.out;
  const auto labels = nlohmann::json::parse(c.out);
  EXPECT_EQ(labels[0]["label"], "low") << c.out;
  EXPECT_EQ(labels[1]["label"], "high") << c.out;
  // Converting it would drop its head: refused, naming why.
  const CliResult converted = run_cli("convert " + path("clf/model.pth") + " " + path("clf.safetensors") + " --config " +
                                      path("clf/config.json"));
  EXPECT_EQ(converted.code, 2) << converted.out;
  EXPECT_NE(converted.out.find("fine-tuned classifier"), std::string::npos) << converted.out;
  // A finished run is kept unless --overwrite says otherwise.
  std::string again = classify_args("clf");
  again.erase(again.find(" --overwrite"));
  EXPECT_EQ(run_cli(again).code, 2);
  EXPECT_TRUE(fs::exists(dir_ / "clf" / "model.pth"));
}

TEST_F(FinetuneCli, LoraAdapterIsPeftsLayoutAndEqualsTheMergedModel) {
  const CliResult r = run_cli(classify_args("lora") + " --lora-rank 4 --lora-alpha 8");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("Total trainable parameters after: 4,674"), std::string::npos) << r.out;  // 12 × 4·(in+out) + head
  const auto config = nlohmann::json::parse(read("lora/adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8.0);
  EXPECT_EQ(config["modules_to_save"], std::vector<std::string>{"out_head"});
  const io::SafetensorsFile adapter = io::SafetensorsFile::open(path("lora/adapter_model.safetensors"));
  EXPECT_TRUE(adapter.contains("base_model.model.trf_blocks.0.att.W_query.lora_A.weight"));
  EXPECT_TRUE(adapter.contains("base_model.model.out_head.weight"));
  const std::string text = " --text \"abc de fgh\" --text \"xyz uvw\" --json";
  const CliResult merged = run_cli("classify --checkpoint " + path("lora/model.pth") + text);
  const CliResult applied = run_cli("classify --checkpoint " + path("base/checkpoint.safetensors") + " --adapter " + path("lora") + text);
  ASSERT_EQ(merged.code, 0) << merged.out;
  ASSERT_EQ(applied.code, 0) << applied.out;
  const auto a = nlohmann::json::parse(merged.out), b = nlohmann::json::parse(applied.out);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a[i]["label"], b[i]["label"]);
    EXPECT_NEAR(a[i]["probability"].get<double>(), b[i]["probability"].get<double>(), 1e-5);
  }
}

// QLoRA on a CPU: the base's matrices stored as q8_0 (--weights, as a GGUF file holds them), LoRA adapters trained in
// float32 through them. The loss falls, the adapter is the result (the base stays as stored, no merged model.pth),
// and it applies to the same base; training the stored weights themselves is refused before anything runs.
TEST_F(FinetuneCli, QloraTrainsAdaptersOnAQuantizedBase) {
  const std::string base = "finetune instruct --checkpoint " + path("base/checkpoint.safetensors") + " --weights q8_0 --data " +
                           path("data.json") + " --epochs 2 --batch-size 4 --max-new-tokens 2 --eval-freq 1 --overwrite";
  const CliResult refused = run_cli(base + " --out " + path("qlora_full"));
  EXPECT_EQ(refused.code, 2) << refused.out;
  EXPECT_NE(refused.out.find("stored as q8_0"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--lora-rank"), std::string::npos) << refused.out;
  EXPECT_FALSE(fs::exists(dir_ / "qlora_full" / "losses.csv"));
  const CliResult r = run_cli(base + " --out " + path("qlora") + " --lora-rank 4 --lr 1e-2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("the base stays q8_0"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "qlora" / "adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "qlora" / "model.pth"));
  std::istringstream losses(read("qlora/losses.csv"));
  std::string line;
  std::vector<double> train_losses;
  std::getline(losses, line);  // step,tokens_seen,train_loss,val_loss
  while (std::getline(losses, line)) {
    std::istringstream fields(line);
    std::string field;
    for (int column = 0; column < 3 && std::getline(fields, field, ','); ++column)
      if (column == 2) train_losses.push_back(std::stod(field));
  }
  ASSERT_GE(train_losses.size(), 3u) << read("qlora/losses.csv");
  EXPECT_LT(train_losses.back(), train_losses.front() - 0.1) << read("qlora/losses.csv");
  const CliResult applied = run_cli("generate --checkpoint " + path("base/checkpoint.safetensors") + " --weights q8_0 --adapter " +
                                    path("qlora") + " --prompt abc --greedy --max-new-tokens 3");
  EXPECT_EQ(applied.code, 0) << applied.out;
}

TEST_F(FinetuneCli, InstructWritesResponsesForTheTestSplit) {
  const CliResult r = run_cli("finetune instruct --checkpoint " + path("base/checkpoint.safetensors") + " --data " +
                              path("data.json") + " --out " + path("ins") + " --epochs 1 --batch-size 4 --max-new-tokens 4 "
                              "--mask-prompt --overwrite");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto responses = nlohmann::json::parse(read("ins/instruction-data-with-response.json"));
  ASSERT_EQ(responses.size(), 2u);  // 24 entries: 20 train, 2 test, 2 validation
  EXPECT_TRUE(responses[0].contains("model_response"));
  EXPECT_EQ(responses[0]["output"], "ccc");  // the file's entry 20 (the book keeps the order)
  EXPECT_TRUE(fs::exists(dir_ / "ins" / "model.pth"));
  EXPECT_TRUE(fs::exists(dir_ / "ins" / "loss.png"));
}

TEST_F(FinetuneCli, BadInputIsNamedWithTheDocumentedExitCode) {
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return path(name);
  };
  const std::string base = " --checkpoint " + path("base/checkpoint.safetensors");
  const std::string good = " --train " + path("train.csv") + " --val " + path("val.csv") + " --out " + path("bad");
  // The data files' problems exit 1, the command line's 2 (docs/robustness.md).
  const struct {
    std::string args, says;
    int code;
  } cases[] = {
      {"finetune classify" + base + " --train " + write("nocol.csv", "Label,Body\nlow,abc\n") + " --val " + path("val.csv") +
           " --out " + path("bad"), "no column 'Text'", 1},
      {"finetune classify" + base + " --train " + path("train.csv") + " --val " + write("other.csv", "Label,Text\nmid,abc\n") +
           " --out " + path("bad"), "label 'mid' is not in the training set", 1},
      {"finetune classify" + base + " --train " + path("train.csv") + " --val " + write("empty.csv", "Label,Text\n") +
           " --out " + path("bad"), "empty split", 1},
      {"finetune classify" + base + good + " --lora-rank 1000", "rank 1000 is larger than", 2},
      {"finetune classify" + base + good + " --lora-rank 2 --lora-targets nothing_here", "match no layer LoRA can adapt", 2},
      {"finetune classify" + base + good + " --trainable trf_blocks.9", "no parameter matches 'trf_blocks.9'", 2},
      {"finetune classify" + base + good + " --batch-size 0", "--batch-size: must be at least 1", 2},
      {"finetune instruct" + base + " --data " + write("nooutput.json", R"([{"instruction": "a"}])") + " --out " + path("bad"),
       "has no \"output\"", 1},
      {"finetune instruct" + base + " --data " + write("two.json", R"([{"instruction": "a", "output": "b"},
           {"instruction": "c", "output": "d"}])") + " --out " + path("bad"), "2 entries; the 85/10/5 split needs more", 1},
      {"finetune instruct" + base + " --format chat --data " + path("data.json") + " --out " + path("bad"),
       "--format chat needs a model folder with a chat template", 1},
  };
  for (const auto& c : cases) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.code, c.code) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.says), std::string::npos) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "model.pth"));
  // An adapter made for another model: a base of another width.
  ASSERT_EQ(run_cli("train --text " + path("text.txt") + " --tokenizer bytes --vocab-size 256 --context-length 64 --emb-dim 16 "
                    "--n-heads 2 --n-layers 1 --batch-size 2 --eval-every 0 --sample-tokens 0 --steps 2 --out " + path("narrow")).code, 0);
  ASSERT_EQ(run_cli(classify_args("adapter") + " --lora-rank 2").code, 0);
  const CliResult wrong = run_cli("classify --checkpoint " + path("narrow/checkpoint.safetensors") + " --adapter " + path("adapter") + " --text abc");
  EXPECT_EQ(wrong.code, 2) << wrong.out;
  EXPECT_NE(wrong.out.find("for another model"), std::string::npos) << wrong.out;
}
}  // namespace
}  // namespace qkv::test
