// SGD and AdamW, following PyTorch 1.13's single-tensor update code line by line (float tensors,
// double hyper-parameters rounded to float where PyTorch passes them as scalars).
#include "qkv/optim.hpp"

#include <cmath>

namespace qkv::optim {

Optimizer::Optimizer(NamedTensors parameters) : parameters_(std::move(parameters)) {
  for (const auto& [name, p] : parameters_) {
    if (!p.defined() || !p.requires_grad()) {
      throw ValueError("optimizer: parameter '" + name + "' does not require grad; only trainable tensors can be optimised");
    }
  }
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : parameters_) p.zero_grad();
}

SGD::SGD(NamedTensors parameters, SGDOptions options) : Optimizer(std::move(parameters)), options_(options) {
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
  const float lr = static_cast<float>(options_.lr), wd = static_cast<float>(options_.weight_decay);
  const float momentum = static_cast<float>(options_.momentum);
  const float keep = static_cast<float>(1.0 - options_.dampening);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Tensor& p = parameters_[i].second;
    const Tensor grad = p.grad();
    if (!grad.defined()) continue;
    float* w = p.data();
    const float* g = grad.data();
    const int64_t n = p.numel();
    const bool first = !momentum_buffers_[i].defined() || steps_ == 0;
    if (momentum != 0.0f && !momentum_buffers_[i].defined()) momentum_buffers_[i] = Tensor::zeros(p.shape());
    float* buf = momentum != 0.0f ? momentum_buffers_[i].data() : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      float d = g[j];
      if (wd != 0.0f) d += wd * w[j];
      if (buf) {
        buf[j] = first ? d : buf[j] * momentum + keep * d;  // the first step copies d (PyTorch clones it)
        d = options_.nesterov ? d + momentum * buf[j] : buf[j];
      }
      w[j] -= lr * d;
    }
  }
  ++steps_;
}

AdamW::AdamW(NamedTensors parameters, AdamWOptions options) : Optimizer(std::move(parameters)), options_(options) {
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
  const float step_size = static_cast<float>(options_.lr / bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float decay = static_cast<float>(1.0 - options_.lr * options_.weight_decay);
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - options_.beta1);
  const float one_minus_b2 = static_cast<float>(1.0 - options_.beta2);
  const float eps = static_cast<float>(options_.eps);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    Tensor& p = parameters_[i].second;
    const Tensor grad = p.grad();
    if (!grad.defined()) continue;
    if (!exp_avg_[i].defined()) exp_avg_[i] = Tensor::zeros(p.shape());
    if (!exp_avg_sq_[i].defined()) exp_avg_sq_[i] = Tensor::zeros(p.shape());
    float* w = p.data();
    const float* g = grad.data();
    float* m = exp_avg_[i].data();
    float* v = exp_avg_sq_[i].data();
    const int64_t n = p.numel();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t j = 0; j < n; ++j) {
      w[j] *= decay;
      m[j] = m[j] * b1 + one_minus_b1 * g[j];
      v[j] = v[j] * b2 + one_minus_b2 * g[j] * g[j];
      const float denom = std::sqrt(v[j]) / bc2_sqrt + eps;
      w[j] -= step_size * (m[j] / denom);
    }
  }
}

}  // namespace qkv::optim
