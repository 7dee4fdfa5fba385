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

// What every optimiser shares: the parameters it updates by name, the step count, zero_grad and the state
class Optimizer {
 public:
  // Updates `parameters` (name, tensor), in order; the names key the state for checkpoints
  explicit Optimizer(NamedTensors parameters);
  virtual ~Optimizer() = default;
  virtual void step() = 0;  // One update of every parameter that has a gradient
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
  NamedTensors parameters_;  // the parameters updated, in order
  int64_t steps_ = 0;  // steps taken
  float gradient_scale_ = 1.0f;  // reset to 1 after each step
};

// The part every optimiser with an options struct shares: the learning rate lives in options().lr.
template <typename Options>
class OptimizerWithOptions : public Optimizer {
 public:
  // Updates `parameters` with `options`
  OptimizerWithOptions(NamedTensors parameters, Options options)
      : Optimizer(std::move(parameters)), options_(options) {}
  // The learning rate of the next step
  double lr() const override { return options_.lr; }
  // Sets it (schedules call this before each step)
  void set_lr(double lr) override { options_.lr = lr; }
  // The options, the learning rate as it is now
  const Options& options() const { return options_; }

 protected:
  Options options_;  // the options, lr kept current
};

// torch.optim.SGD's options and defaults
struct SGDOptions {
  double lr = 1e-3;  // learning rate
  double momentum = 0.0;  // momentum factor (0: none)
  double dampening = 0.0;  // dampening of the momentum
  double weight_decay = 0.0;  // L2 penalty added to the gradient
  bool nesterov = false;  // Nesterov momentum
};

// torch.optim.SGD: momentum, dampening, weight decay and Nesterov as PyTorch computes them
class SGD : public OptimizerWithOptions<SGDOptions> {
 public:
  // Updates `parameters` with `options` (ValueError for a negative rate or an impossible combination)
  SGD(NamedTensors parameters, SGDOptions options);
  void step() override;  // One SGD update
  // The momentum buffers, "momentum_buffer.<parameter>"
  void for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) override;
  void ensure_state() override;

 private:
  std::vector<Tensor> momentum_buffers_;
};

// torch.optim.AdamW's options and defaults
struct AdamWOptions {
  double lr = 1e-3;  // learning rate
  double beta1 = 0.9;  // decay of the first moment
  double beta2 = 0.999;  // decay of the second moment
  double eps = 1e-8;  // added to the second moment's root
  double weight_decay = 1e-2;  // decoupled weight decay (times lr)
};

// torch.optim.AdamW: decoupled weight decay, bias-corrected moments, as PyTorch 1.13 computes it (fused: one pass)
class AdamW : public OptimizerWithOptions<AdamWOptions> {
 public:
  // Updates `parameters` with `options` (ValueError for a negative rate or betas outside [0, 1))
  AdamW(NamedTensors parameters, AdamWOptions options);
  void step() override;  // One AdamW update
  // The moments, "exp_avg.<parameter>" and "exp_avg_sq.<parameter>"
  void for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) override;
  void ensure_state() override;

 private:
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
};

}  // namespace qkv::optim
