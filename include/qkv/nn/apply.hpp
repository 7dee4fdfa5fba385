// Running a stored module on an input with gradients: the engine of `qkv apply`, which is how users
// (and our parity tests) check qkv against PyTorch.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qkv/nn/module.hpp"

namespace qkv::nn {

// Reads a safetensors file holding one of the book's modules: __metadata__ "module" plus its constructor
// arguments, and the state dict under PyTorch names. Throws IoError naming the file and the problem.
std::unique_ptr<UnaryModule> load_attention_module(const std::string& path);

// How qkv apply runs a module: training mode (dropout) or not, and the seed
struct ApplyOptions {
  // Dropout on; the default generator is seeded with `seed` just before forward, and attention takes the
  // plain path so the masks are torch.nn.Dropout's. In eval mode the fused kernel runs.
  bool train = false;
  uint64_t seed = 0;
};

// Forward, and with a defined grad_output also backward. Returns "output", then "grad.input" and
// "grad.<parameter>" for every trainable parameter (zeros where the output does not depend on it).
// grad_output is taken by value: moved in, its memory is freed as soon as the backward pass has used it.
std::vector<std::pair<std::string, Tensor>> apply_module(UnaryModule& module, const Tensor& input,
                                                         Tensor grad_output, const ApplyOptions& options);

}  // namespace qkv::nn
