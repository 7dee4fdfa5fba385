// load_attention_module and apply_module (see qkv/nn/apply.hpp).
#include "qkv/nn/apply.hpp"

#include "qkv/io/safetensors.hpp"
#include "qkv/nn/attention.hpp"
#include "qkv/core/random.hpp"

namespace qkv::nn {

std::unique_ptr<UnaryModule> load_attention_module(const std::string& path) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (!file.metadata().count("module")) {
    throw IoError(path + ": __metadata__ has no \"module\" entry; expected one of SelfAttention_v1, SelfAttention_v2, "
                         "CausalAttention, MultiHeadAttentionWrapper, MultiHeadAttention");
  }
  try {
    // The arguments must describe the tensors the file holds: checked before the module is built, so a few bytes
    // of metadata cannot make qkv allocate a huge layer.
    // The causal masks are derived buffers: recomputed from the arguments, so only their shapes are checked.
    auto is_mask = [](const std::string& name) { return name == "mask" || name.find(".mask") != std::string::npos; };
    int64_t held = 0;
    for (const auto& info : file.tensors())
      if (!is_mask(info.name)) held += info.numel();
    const int64_t needed = attention_parameter_count(file.metadata());
    if (needed != held) {
      throw IoError(path + ": its metadata describes a " + file.metadata().at("module") + " with " + std::to_string(needed) +
                    " parameters, but the file holds " + std::to_string(held) + " values; the arguments do not "
                    "match the weights");
    }
    std::unique_ptr<UnaryModule> module = make_attention_module(file.metadata());
    StateDict state;
    // A mask stands in as an untouched tensor of its shape: reading the file's (context × context) floats would cost
    // their size in memory twice (the mapped pages and the copy) — 128 MiB at context 4096 — for nothing.
    for (const auto& info : file.tensors())
      state.insert(info.name, is_mask(info.name) ? Tensor::empty(Shape(info.shape)) : file.weights(info.name));
    module->load_state_dict(state);
    return module;
  } catch (const IoError&) {
    throw;
  } catch (const Error& e) {
    throw IoError(path + ": " + e.what());
  }
}

std::vector<std::pair<std::string, Tensor>> apply_module(UnaryModule& module, const Tensor& input,
                                                         Tensor grad_output, const ApplyOptions& options) {
  module.train(options.train);
  // In training, PyTorch's dropout masks come from its generator; only the plain path draws them that way.
  module.set_attention_path(options.train ? AttentionPath::Plain : AttentionPath::Fused);
  module.zero_grad();
  Tensor x = input.detach();  // shares the caller's values; the gradient flag stays on this handle
  const bool backward = grad_output.defined();
  if (backward) x.requires_grad_(true);
  if (options.train) manual_seed(options.seed);
  Tensor output = module.forward(x);
  std::vector<std::pair<std::string, Tensor>> result;
  result.emplace_back("output", output.detach());
  if (!backward) return result;
  if (!(grad_output.shape() == output.shape())) {
    throw ShapeError("grad_output has shape " + grad_output.shape().str() + " but the module's output has shape " +
                     output.shape().str());
  }
  output.backward(std::move(grad_output));
  result.emplace_back("grad.input", x.grad().defined() ? x.grad() : Tensor::zeros(x.shape()));
  module.for_each_parameter([&](const std::string& name, Tensor& p) {
    result.emplace_back("grad." + name, p.grad().defined() ? p.grad() : Tensor::zeros(p.shape()));
  });
  return result;
}

}  // namespace qkv::nn
