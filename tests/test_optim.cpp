// SGD and AdamW against torch.optim trajectories (fixtures/optim.safetensors).
#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::test {
namespace {

template <typename Make>
void check_trajectory(const std::string& name, Make make) {
  const auto file = io::SafetensorsFile::open(fixture("optim.safetensors"));
  const Tensor grads = file.tensor("grads"), expected = file.tensor(name);
  Tensor p = file.tensor("start").requires_grad_();
  auto optimizer = make(optim::NamedTensors{{"p", p}});
  for (int step = 0; step < 5; ++step) {
    Tensor g = Tensor::empty({4, 3});
    std::copy_n(grads.data() + step * 12, 12, g.data());
    p.set_grad(g);
    optimizer.step();
    Tensor want = Tensor::empty({4, 3});
    std::copy_n(expected.data() + step * 12, 12, want.data());
    EXPECT_TRUE(all_close(p, want, 1e-6, 1e-7)) << name << " step " << step;
  }
}

TEST(Optim, SGDMatchesPyTorch) {
  check_trajectory("sgd_plain", [](auto params) { return optim::SGD(params, {.lr = 0.1}); });
  check_trajectory("sgd_momentum", [](auto params) {
    return optim::SGD(params, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  });
  check_trajectory("sgd_nesterov",
                   [](auto params) { return optim::SGD(params, {.lr = 0.05, .momentum = 0.8, .nesterov = true}); });
}

TEST(Optim, AdamWMatchesPyTorch) {
  check_trajectory("adamw_default", [](auto params) { return optim::AdamW(params, {}); });
  check_trajectory("adamw_custom", [](auto params) {
    return optim::AdamW(params, {.lr = 0.02, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1});
  });
}

TEST(Optim, RejectsBadSettingsAndFrozenTensors) {
  Tensor p = Tensor::zeros({2}).requires_grad_();
  EXPECT_THROW(optim::AdamW({{"p", p}}, {.lr = -1}), ValueError);
  EXPECT_THROW(optim::AdamW({{"p", p}}, {.beta1 = 1.0}), ValueError);
  EXPECT_THROW(optim::SGD({{"p", p}}, {.nesterov = true}), ValueError);
  EXPECT_THROW(optim::SGD({{"frozen", Tensor::zeros({2})}}, {}), ValueError);
}

TEST(Optim, TrainingReducesALoss) {
  manual_seed(0);
  nn::SelfAttentionV2 attention(4, 4);
  const Tensor x = random_tensor({5, 4}, 3), target = random_tensor({5, 4}, 4, 0.1f);
  optim::AdamW optimizer(attention.named_parameters(), {.lr = 0.05});
  float first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    optimizer.zero_grad();
    const Tensor diff = attention(x) - target;
    const Tensor loss = mean(diff * diff);
    (step == 0 ? first : last) = loss.item();
    loss.backward();
    optimizer.step();
  }
  EXPECT_LT(last, 0.2f * first);
}

// Dropping gradients (set_to_none) instead of zeroing them changes where the backward writes, not what: the same
// parameters bit for bit after a few AdamW steps, and a parameter the loss never reached is left alone.
TEST(Optim, SetToNoneTrainsExactlyAsZeroing) {
  const Tensor x = random_tensor({5, 4}, 3), target = random_tensor({5, 4}, 4, 0.1f);
  std::vector<Tensor> finals;
  for (bool set_to_none : {false, true}) {
    manual_seed(0);
    nn::SelfAttentionV2 attention(4, 4);
    Tensor unused = Tensor::ones({3}).requires_grad_();
    optim::NamedTensors params = attention.named_parameters();
    params.emplace_back("unused", unused);
    optim::AdamW optimizer(params, {.lr = 0.05});
    for (int step = 0; step < 4; ++step) {
      optimizer.zero_grad(set_to_none);
      const Tensor diff = attention(x) - target;
      mean(diff * diff).backward();
      optimizer.step();
    }
    if (set_to_none) {
      EXPECT_FALSE(unused.grad().defined());
      EXPECT_TRUE(all_close(unused, Tensor::ones({3}), 0, 0));  // no gradient, no step (PyTorch's rule)
    }
    for (const auto& [name, p] : attention.named_parameters()) finals.push_back(p.clone());
  }
  const size_t n = finals.size() / 2;
  for (size_t i = 0; i < n; ++i) EXPECT_TRUE(all_close(finals[i + n], finals[i], 0, 0)) << i;
}

}  // namespace
}  // namespace qkv::test
