// SGD and AdamW, following PyTorch 1.13's single-tensor update code line by line (float tensors,
// double hyper-parameters rounded to float where PyTorch passes them as scalars).
#include "qkv/train/optim.hpp"

#include <cmath>

#include "qkv/kernels/optim.hpp"

namespace qkv::optim {

Optimizer::Optimizer(NamedTensors parameters) : parameters_(std::move(parameters)) {
  for (const auto& [name, p] : parameters_) {
    if (!p.defined() || !p.requires_grad()) {
      throw ValueError("optimizer: parameter '" + name + "' does not require grad; only trainable tensors can be optimised");
    }
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& [name, p] : parameters_) {
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      p.zero_grad();
    }
  }
}

SGD::SGD(NamedTensors parameters, SGDOptions options) : OptimizerWithOptions(std::move(parameters), options) {
  if (options_.lr < 0) throw ValueError("SGD: learning rate must be >= 0, got " + std::to_string(options_.lr));
  if (options_.nesterov && (options_.momentum <= 0 || options_.dampening != 0)) {
    throw ValueError("SGD: Nesterov momentum requires a momentum > 0 and zero dampening");
  }
  momentum_buffers_.resize(parameters_.size());
}

void SGD::ensure_state() {
  if (options_.momentum == 0.0) return;
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (!momentum_buffers_[i].defined()) momentum_buffers_[i] = Tensor::zeros(parameters_[i].second.shape());
}

void SGD::for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) {
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (momentum_buffers_[i].defined()) fn("momentum_buffer." + parameters_[i].first, momentum_buffers_[i]);
}

void SGD::step() {
  kernels::SGDStep step{static_cast<float>(options_.lr), static_cast<float>(options_.weight_decay),
                        static_cast<float>(options_.momentum), static_cast<float>(1.0 - options_.dampening),
                        options_.nesterov, false, gradient_scale_};
  gradient_scale_ = 1.0f;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Tensor& p = parameters_[i].second;
    const Tensor grad = p.grad();
    if (!grad.defined()) continue;
    step.first = !momentum_buffers_[i].defined() || steps_ == 0;
    if (step.momentum != 0.0f && !momentum_buffers_[i].defined()) momentum_buffers_[i] = Tensor::zeros(p.shape());
    kernels::sgd_update(p.data(), grad.data(), step.momentum != 0.0f ? momentum_buffers_[i].data() : nullptr, p.numel(),
                        step);
  }
  ++steps_;
}

AdamW::AdamW(NamedTensors parameters, AdamWOptions options) : OptimizerWithOptions(std::move(parameters), options) {
  if (options_.lr < 0) throw ValueError("AdamW: learning rate must be >= 0, got " + std::to_string(options_.lr));
  if (options_.beta1 < 0 || options_.beta1 >= 1 || options_.beta2 < 0 || options_.beta2 >= 1) {
    throw ValueError("AdamW: betas must lie in [0, 1)");
  }
  if (options_.eps < 0) throw ValueError("AdamW: eps must be >= 0");
  exp_avg_.resize(parameters_.size());
  exp_avg_sq_.resize(parameters_.size());
}

void AdamW::ensure_state() {
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!exp_avg_[i].defined()) exp_avg_[i] = Tensor::zeros(parameters_[i].second.shape());
    if (!exp_avg_sq_[i].defined()) exp_avg_sq_[i] = Tensor::zeros(parameters_[i].second.shape());
  }
}

void AdamW::for_each_state(const std::function<void(const std::string&, Tensor&)>& fn) {
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (exp_avg_[i].defined()) fn("exp_avg." + parameters_[i].first, exp_avg_[i]);
    if (exp_avg_sq_[i].defined()) fn("exp_avg_sq." + parameters_[i].first, exp_avg_sq_[i]);
  }
}

// One step t (1-based):
//   θ ← θ · (1 − lr·λ)                       decoupled weight decay
//   m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
//   θ ← θ − (lr / (1−β1ᵗ)) · m / (√v / √(1−β2ᵗ) + ε)
void AdamW::step() {
  ++steps_;
  const double t = static_cast<double>(steps_);
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(options_.beta2, t);
  const kernels::AdamWStep step{static_cast<float>(1.0 - options_.lr * options_.weight_decay),
                                 static_cast<float>(options_.beta1),
                                 static_cast<float>(options_.beta2),
                                 static_cast<float>(1.0 - options_.beta1),
                                 static_cast<float>(1.0 - options_.beta2),
                                 static_cast<float>(options_.lr / bias_correction1),
                                 static_cast<float>(std::sqrt(bias_correction2)),
                                 static_cast<float>(options_.eps),
                                 gradient_scale_};
  gradient_scale_ = 1.0f;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Tensor& p = parameters_[i].second;
    const Tensor grad = p.grad();
    if (!grad.defined()) continue;
    if (!exp_avg_[i].defined()) exp_avg_[i] = Tensor::zeros(p.shape());
    if (!exp_avg_sq_[i].defined()) exp_avg_sq_[i] = Tensor::zeros(p.shape());
    kernels::adamw_update(p.data(), grad.data(), exp_avg_[i].data(), exp_avg_sq_[i].data(), p.numel(), step);
  }
}

}  // namespace qkv::optim
