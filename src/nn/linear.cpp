// Linear layer with torch.nn.Linear's initialisation.
#include "qkv/nn/linear.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"

namespace qkv::nn {

void require_positive(int64_t value, const char* layer, const char* argument) {
  if (value <= 0) {
    throw ValueError(std::string(layer) + ": " + argument + " must be a positive size, got " + std::to_string(value));
  }
}

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, Generator& gen)
    : Linear(in_features, out_features, with_bias, gen, Tensor(), Tensor()) {}

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, Generator& gen, const Tensor& weight_home,
               const Tensor& bias_home) {
  require_positive(in_features, "Linear", "in_features");
  require_positive(out_features, "Linear", "out_features");
  auto home = [](const Tensor& given, const Shape& shape, const char* what) {
    if (!given.defined()) return Tensor::empty(shape);
    if (!(given.shape() == shape)) {
      throw ShapeError(std::string("Linear: the ") + what + " must go into a tensor of shape " + shape.str() + ", not " +
                       given.shape().str());
    }
    return given;
  };
  weight = register_parameter("weight", home(weight_home, {out_features, in_features}, "weight"));
  kaiming_uniform_(weight, std::sqrt(5.0), gen);
  if (with_bias) {
    bias = register_parameter("bias", home(bias_home, {out_features}, "bias"));
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    gen.uniform_(bias, -bound, bound);
  }
}

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, NoInit) {
  require_positive(in_features, "Linear", "in_features");
  require_positive(out_features, "Linear", "out_features");
  weight = register_parameter("weight", Tensor::zeros({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", Tensor::zeros({out_features}));
}

Tensor Linear::forward(const Tensor& x) const {
  return has_lora() ? lora_linear(x, weight, bias, lora_A, lora_B, lora_scale) : linear(x, weight, bias);
}

void Linear::add_lora(int64_t rank, double alpha, Generator& gen) {
  const int64_t in = weight.size(1), out = weight.size(0);
  if (has_lora()) throw ValueError("Linear: this layer already has a LoRA adapter");
  if (rank < 1 || rank > std::min(in, out)) {
    throw ValueError("LoRA: rank " + std::to_string(rank) + " does not fit a Linear(" + std::to_string(in) + ", " +
                     std::to_string(out) + "); use a rank from 1 to " + std::to_string(std::min(in, out)));
  }
  if (!(alpha > 0.0) || !std::isfinite(alpha)) throw ValueError("LoRA: alpha must be a positive number");
  Tensor drawn = Tensor::empty({in, rank});  // the book's A, (in_dim, rank)
  kaiming_uniform_(drawn, std::sqrt(5.0), gen);
  lora_A = register_parameter("lora_A.weight", transpose(drawn, 0, 1));
  lora_B = register_parameter("lora_B.weight", Tensor::zeros({out, rank}));
  lora_scale = static_cast<float>(alpha / static_cast<double>(rank));
}

void Linear::merge_lora() {
  if (!has_lora()) return;
  {
    NoGradGuard no_grad;
    const Tensor delta = matmul(lora_B.detach(), lora_A.detach());  // (out, in)
    float* w = weight.data();
    const float* d = delta.data();
    for (int64_t i = 0; i < weight.numel(); ++i) w[i] += lora_scale * d[i];
  }
  remove_lora();
}

void Linear::remove_lora() {
  if (!has_lora()) return;
  remove_parameter("lora_A.weight");
  remove_parameter("lora_B.weight");
  lora_A = Tensor();
  lora_B = Tensor();
  lora_scale = 0.0f;
}

void Linear::relocate(const Tensor& weight_home, const Tensor& bias_home) {
  auto move = [this](const char* name, Tensor& member, Tensor home) {
    home.copy_(member);  // ShapeError on a wrong shape, before anything changes
    home.requires_grad_(true);
    replace_parameter(name, home);
    member = home;
  };
  move("weight", weight, weight_home);
  if (bias.defined()) move("bias", bias, bias_home);
}

void Linear::tie_weight(const Tensor& shared) {
  replace_parameter("weight", shared);
  weight = shared;
}

}  // namespace qkv::nn
