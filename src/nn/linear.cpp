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

Tensor linear_with_lora(const Tensor& x, const Tensor& weight, const Tensor& bias, const LoraWeights& lora) {
  return lora.defined() ? lora_linear(x, weight, bias, lora.a, lora.b, lora.scale) : linear(x, weight, bias);
}

Tensor Linear::forward(const Tensor& x) const { return linear_with_lora(x, weight, bias, lora); }

void Linear::add_lora(int64_t rank, double alpha, Generator& gen) {
  LoraSite site = own_lora_sites()[0];
  Module::add_lora(site, rank, alpha, gen);
}

void Linear::merge_lora() {
  LoraSite site = own_lora_sites()[0];
  Module::merge_lora(site);
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

}  // namespace qkv::nn
