// Optimisers with PyTorch 1.13's defaults and update rules (torch.optim.SGD, torch.optim.AdamW).
// A parameter whose grad is undefined is skipped, as in PyTorch. Optimiser state is named after the
// parameters ("exp_avg.W_query.weight") so checkpoints can store it with the weights.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv::optim {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Optimizer {
 public:
  explicit Optimizer(NamedTensors parameters);
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // Gradients to zeros (PyTorch 1.13's default), or with set_to_none to no gradient at all (PyTorch 2's default):
  // the next backward then writes each gradient afresh instead of adding to zeros, which saves a pass over every
  // parameter-sized gradient (clearing, then accumulating) per step. Parameters left without a gradient are
  // skipped by step(), as in PyTorch.
  void zero_grad(bool set_to_none = false);
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  int64_t step_count() const { return steps_; }
  // The next step() uses every gradient times `scale` (gradient clipping folded into the update's one pass).
  void set_gradient_scale(float scale) { gradient_scale_ = scale; }
  void set_step_count(int64_t steps) { steps_ = steps; }
  // Every state tensor, named "<state>.<parameter name>"; created on first use, so call after step()
  // or after ensure_state() when loading a checkpoint.
  virtual void for_each_state(const std::function<void(const std::string& name, Tensor& state)>& fn) = 0;
  virtual void ensure_state() = 0;

 protected:
  NamedTensors parameters_;
  int64_t steps_ = 0;
  float gradient_scale_ = 1.0f;  // reset to 1 after each step
};

// The part every optimiser with an options struct shares: the learning rate lives in options().lr.
template <typename Options>
class OptimizerWithOptions : public Optimizer {
 public:
  OptimizerWithOptions(NamedTensors parameters, Options options)
      : Optimizer(std::move(parameters)), options_(options) {}
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override { options_.lr = lr; }
  const Options& options() const { return options_; }

 protected:
  Options options_;
};

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public OptimizerWithOptions<SGDOptions> {
 public:
  SGD(NamedTensors parameters, SGDOptions options);
  void step() override;
  void for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) override;
  void ensure_state() override;

 private:
  std::vector<Tensor> momentum_buffers_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class AdamW : public OptimizerWithOptions<AdamWOptions> {
 public:
  AdamW(NamedTensors parameters, AdamWOptions options);
  void step() override;
  void for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) override;
  void ensure_state() override;

 private:
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
};

}  // namespace qkv::optim
