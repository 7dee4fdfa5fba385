// Autograd: a dynamic tape at tensor granularity, micrograd's idea applied to tensors.
// Every differentiable op records a Node (its inputs and a backward closure) on its output; backward()
// sorts the nodes topologically and runs the closures in reverse, accumulating gradients with +=.
// Not here: the ops themselves (ops.hpp); each op's backward sits beside its forward in src/core/ops_*.cpp.
#pragma once

#include <functional>
#include <initializer_list>

#include "qkv/core/tensor.hpp"

namespace qkv {

// Whether ops record themselves for backward (true by default, per thread).
bool grad_enabled();

// Inside this scope nothing is recorded: inference, optimiser updates, evaluation.
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Inside this scope every backward() on this thread calls `ready(leaf)` as soon as a leaf's gradient is final (every
// op that reads the leaf has run its backward), while the walk goes on: what lets the trainer sum finished layers'
// gradients across processes during the backward. Leaves come in the walk's fixed order, the same for the same graph.
class GradientReadyGuard {
 public:
  // Calls `ready` for each leaf whose gradient is final, in every backward() on this thread until destroyed
  explicit GradientReadyGuard(std::function<void(const Tensor& leaf)> ready);
  ~GradientReadyGuard();
  GradientReadyGuard(const GradientReadyGuard&) = delete;
  GradientReadyGuard& operator=(const GradientReadyGuard&) = delete;

 private:
  std::function<void(const Tensor&)> ready_;
  const std::function<void(const Tensor&)>* previous_;
};

namespace detail {
// The innermost GradientReadyGuard's callback on this thread (null: none).
extern thread_local const std::function<void(const Tensor&)>* t_gradient_ready;

// True when an op with these inputs must be recorded: grad mode is on and one input requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs);

// Makes `output` a recorded result of op `name`. `backward` receives dL/d(output).
void record(Tensor& output, const char* name, std::vector<Tensor> inputs,
            std::function<void(const Tensor& grad_output)> backward);

// The gradient buffer of `t`, created as zeros on first use; backward closures add into it.
// Returns nullptr when t does not require grad, so closures can skip work nobody needs.
float* grad_buffer(const Tensor& t);

// For a backward kernel that can either overwrite its output or add into it (a GEMM's beta, the attention
// kernel): where to put t's gradient. t's first contribution goes straight into a new, unfilled buffer
// (accumulate = false: the kernel must write every element), later ones add into it (accumulate = true).
// data is nullptr when t does not require grad. Skipping the zero fill and the temporary saves one
// activation-sized buffer per input at the peak of a backward pass.
struct GradTarget {
  float* data = nullptr;
  bool accumulate = false;
};
GradTarget grad_target(const Tensor& t);

// Adds a finished gradient g (t's shape) to t's: g itself becomes t's gradient when t has none yet (no copy),
// else it is added. Nothing happens when t does not require grad.
void add_grad(const Tensor& t, Tensor g);

}  // namespace detail
}  // namespace qkv
