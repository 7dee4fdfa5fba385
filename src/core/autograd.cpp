// The tape walk: topological order over recorded nodes, then each node's backward in reverse.
// Gradients accumulate (+=) so a tensor used twice gets both contributions, as in micrograd.
#include "qkv/core/autograd.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_set>

#include "qkv/core/profile.hpp"
#include "qkv/kernels/elementwise.hpp"

namespace qkv {

namespace {
thread_local bool g_grad_enabled = true;
}

bool grad_enabled() { return g_grad_enabled; }

NoGradGuard::NoGradGuard() : previous_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = previous_; }

namespace detail {
thread_local const std::function<void(const Tensor&)>* t_gradient_ready = nullptr;
}

GradientReadyGuard::GradientReadyGuard(std::function<void(const Tensor& leaf)> ready)
    : ready_(std::move(ready)), previous_(detail::t_gradient_ready) {
  detail::t_gradient_ready = &ready_;
}
GradientReadyGuard::~GradientReadyGuard() { detail::t_gradient_ready = previous_; }

namespace detail {

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!g_grad_enabled) return false;
  return std::any_of(inputs.begin(), inputs.end(), [](const Tensor* t) { return t && t->requires_grad(); });
}

// ---- the op profile (qkv/core/profile.hpp) ----
using Clock = std::chrono::steady_clock;
std::atomic<bool> g_profiling{false};
std::mutex g_profile_mutex;
std::map<std::string, OpTime> g_profile;
thread_local Clock::time_point t_last_mark = Clock::now();

void profile_forward(const char* name) {
  const auto now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - t_last_mark).count();
  t_last_mark = now;
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  OpTime& t = g_profile[name];
  t.forward_seconds += seconds;
  ++t.calls;
}

void profile_backward(const std::string& name, double seconds) {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  g_profile[name].backward_seconds += seconds;
  t_last_mark = Clock::now();
}

void record(Tensor& output, const char* name, std::vector<Tensor> inputs,
            std::function<void(const Tensor& grad_output)> backward) {
  if (g_profiling.load(std::memory_order_relaxed)) profile_forward(name);
  auto node = std::make_shared<Node>();
  node->name = name;
  node->inputs = std::move(inputs);
  node->backward = std::move(backward);
  output.impl()->node = std::move(node);
  output.impl()->requires_grad = true;
}

float* grad_buffer(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  TensorImpl* impl = t.impl();
  if (!impl->grad.defined()) impl->grad = Tensor::zeros(impl->shape);
  return impl->grad.data();
}

GradTarget grad_target(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  TensorImpl* impl = t.impl();
  if (impl->grad.defined()) return {impl->grad.data(), true};
  impl->grad = Tensor::empty(impl->shape);
  return {impl->grad.data(), false};
}

void add_grad(const Tensor& t, Tensor g) {
  if (!t.defined() || !t.requires_grad()) return;
  TensorImpl* impl = t.impl();
  if (!impl->grad.defined()) {
    impl->grad = std::move(g);
  } else {
    kernels::accumulate(impl->grad.data(), g.data(), g.numel());
  }
}

namespace {
// Depth-first post-order over tensors that require grad: each tensor comes after every tensor it was
// computed from, so walking the list backwards visits a tensor only after all its consumers.
// The list holds handles, which keeps every tensor alive until its own turn even though nodes
// (and the handles they hold) are released as the walk goes.
std::vector<Tensor> topo_sort(const Tensor& root) {
  std::vector<Tensor> order;
  std::unordered_set<TensorImpl*> visited;
  // Iterative DFS so deep graphs (many layers, many steps) cannot overflow the stack.
  std::vector<std::pair<Tensor, size_t>> stack;
  stack.emplace_back(root, 0);
  visited.insert(root.impl());
  while (!stack.empty()) {
    auto& [tensor, next_input] = stack.back();
    TensorImpl* impl = tensor.impl();
    if (impl->node && next_input < impl->node->inputs.size()) {
      const Tensor& child = impl->node->inputs[next_input++];
      if (child.requires_grad() && visited.insert(child.impl()).second) stack.emplace_back(child, 0);
    } else {
      order.push_back(std::move(tensor));
      stack.pop_back();
    }
  }
  return order;
}
}  // namespace

}  // namespace detail

void Tensor::backward() const {
  if (numel() != 1) {
    throw ShapeError("backward(): called without a gradient on a tensor of shape " + shape().str() +
                     "; pass grad_output of that shape, or reduce to a scalar loss first");
  }
  backward(Tensor::ones(shape()));
}

void Tensor::backward(const Tensor& grad_output) const { backward(Tensor(grad_output)); }

void Tensor::backward(Tensor&& grad_output) const {
  if (!requires_grad()) {
    throw ValueError("backward(): this tensor does not require grad; no input of its computation had "
                     "requires_grad_() set, or it was computed under NoGradGuard");
  }
  if (impl()->graph_released) {
    throw ValueError("backward(): the graph behind this tensor was already freed by an earlier backward(); "
                     "compute the result again before calling backward a second time");
  }
  if (!(grad_output.shape() == shape())) {
    throw ShapeError("backward(): grad_output has shape " + grad_output.shape().str() + " but the tensor has shape " +
                     shape().str());
  }
  std::vector<Tensor> order = detail::topo_sort(*this);
  // Seed: dL/d(root) += grad_output. A recorded root's gradient is only read by its own backward and dropped
  // right after, so it can share grad_output's storage instead of copying it; a leaf keeps its gradient for
  // the caller, who may change grad_output later, so that one is a copy.
  if (impl()->node && !impl()->grad.defined()) {
    impl()->grad = grad_output.detach();
    grad_output = Tensor();  // handed over: no second handle keeps it alive through the walk
  } else {
    kernels::accumulate(detail::grad_buffer(*this), grad_output.data(), numel());
  }

  NoGradGuard no_grad;  // backward closures compute with plain kernels; nothing they do is recorded
  using detail::Clock;
  using detail::g_profiling;
  using detail::profile_backward;
  const auto* ready = detail::t_gradient_ready;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    detail::TensorImpl* impl = it->impl();
    // The walk reaches a leaf only after every op that reads it: its gradient is final for this backward.
    if (ready && !impl->node && impl->grad.defined()) (*ready)(*it);
    if (impl->node) {  // a leaf has no node: its gradient stays for the caller
      std::shared_ptr<detail::Node> node = std::move(impl->node);  // frees the graph as we go
      impl->graph_released = true;
      if (impl->grad.defined()) {
        if (g_profiling.load(std::memory_order_relaxed)) {
          const auto start = Clock::now();
          node->backward(impl->grad);
          profile_backward(node->name, std::chrono::duration<double>(Clock::now() - start).count());
        } else {
          node->backward(impl->grad);
        }
      }
      impl->grad = Tensor();  // non-leaf gradients are not kept (as in PyTorch)
    }
    *it = Tensor();  // every consumer is done with this tensor: let its memory go
  }
}

void set_op_profiling(bool on) {
  detail::g_profiling.store(on);
  detail::t_last_mark = detail::Clock::now();
}
void op_profile_mark() { detail::t_last_mark = detail::Clock::now(); }
std::map<std::string, OpTime> op_profile() {
  std::lock_guard<std::mutex> lock(detail::g_profile_mutex);
  return detail::g_profile;
}
void reset_op_profile() {
  std::lock_guard<std::mutex> lock(detail::g_profile_mutex);
  detail::g_profile.clear();
}

}  // namespace qkv
