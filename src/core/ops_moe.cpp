// The mixture-of-experts layer as a differentiable op (kernels::moe_forward / moe_backward): the forward keeps the
// routing and the experts' activations, the backward runs the kernel's and hands each input its gradient.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/moe.hpp"

namespace qkv {

void for_each_top_k(const float* values, int64_t rows, int64_t cols, int64_t k,
                    const std::function<void(int64_t, int64_t)>& chosen) {
  std::vector<int64_t> order(static_cast<size_t>(cols));
  for (int64_t n = 0; n < rows; ++n) {
    const float* v = values + n * cols;
    for (int64_t c = 0; c < cols; ++c) order[static_cast<size_t>(c)] = c;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
    for (int64_t j = 0; j < k; ++j) chosen(n, order[static_cast<size_t>(j)]);
  }
}

Tensor mixture_of_experts(const Tensor& x, const Tensor& router, std::span<const Tensor> gate,
                          std::span<const Tensor> up, std::span<const Tensor> down, const MoeConfig& config) {
  auto fail = [&](const std::string& why) { throw ShapeError("mixture_of_experts: " + why); };
  if (x.rank() < 1 || router.rank() != 2) fail("x must be (..., C) and the router (E, C)");
  const int64_t C = x.size(-1), E = router.size(0), N = x.numel() / std::max<int64_t>(C, 1);
  if (router.size(1) != C) fail("the router is " + router.shape().str() + " for " + std::to_string(C) + " channels");
  if (static_cast<int64_t>(gate.size()) != E || static_cast<int64_t>(up.size()) != E || static_cast<int64_t>(down.size()) != E)
    fail(std::to_string(E) + " router rows but " + std::to_string(gate.size()) + " gate, " + std::to_string(up.size()) +
         " up and " + std::to_string(down.size()) + " down projections");
  if (config.experts_per_token < 1 || config.experts_per_token > E)
    throw ValueError("mixture_of_experts: experts_per_token = " + std::to_string(config.experts_per_token) +
                     " must lie in 1…" + std::to_string(E) + " (the experts)");
  const int64_t F = E > 0 ? gate[0].size(0) : 0;
  for (int64_t e = 0; e < E; ++e) {
    const size_t i = static_cast<size_t>(e);
    if (!(gate[i].shape() == Shape{F, C}) || !(up[i].shape() == Shape{F, C}) || !(down[i].shape() == Shape{C, F}))
      fail("expert " + std::to_string(e) + "'s projections are " + gate[i].shape().str() + ", " + up[i].shape().str() +
           ", " + down[i].shape().str() + "; expected (F, C), (F, C), (C, F) with F = " + std::to_string(F));
  }
  // Experts kept narrow for inference (bf16, or a block format — q8_0, q4_K… — from a GGUF file or --weights): the
  // experts this call's tokens choose are widened to float32 for it; the others stand in as one zero matrix that no
  // token reaches. (Routers with a selection bias or groups choose in the kernel only: then every expert is widened.)
  auto narrow = [](const Tensor& t) { return t.dtype() == DType::BF16 || t.dtype() == DType::Stored; };
  bool narrowed = narrow(router);
  for (const auto* list : {&gate, &up, &down})
    for (const Tensor& t : *list) narrowed = narrowed || narrow(t);
  if (narrowed) {
    if (grad_enabled() && x.requires_grad())
      throw ValueError("mixture_of_experts: experts stored as bfloat16 or a block format are for inference; run it "
                       "under NoGradGuard (fine-tune such a model through LoRA on its attention)");
    NoGradGuard no_grad;
    auto wide = [&](const Tensor& t) {
      if (!narrow(t)) return t;
      Tensor w = Tensor::empty(t.shape());
      w.copy_(t);
      return w;
    };
    const Tensor r = wide(router);
    std::vector<char> used(static_cast<size_t>(E), 0);
    const bool plain = !config.sigmoid && config.groups == 1 && !config.selection_bias.defined();
    if (plain) {  // softmax is monotonic: the k largest logits are the k chosen
      const Tensor logits = linear(reshape(x, {N, C}), r, Tensor());
      for_each_top_k(logits.data(), N, E, config.experts_per_token,
                     [&](int64_t, int64_t e) { used[static_cast<size_t>(e)] = 1; });
    }
    const Tensor unused_in = Tensor::zeros({F, C}), unused_out = Tensor::zeros({C, F});
    std::vector<Tensor> g, u, d;
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(e);
      const bool take = !plain || used[i];
      g.push_back(take ? wide(gate[i]) : unused_in);
      u.push_back(take ? wide(up[i]) : unused_in);
      d.push_back(take ? wide(down[i]) : unused_out);
    }
    return mixture_of_experts(x, r, g, u, d, config);
  }
  if (x.dtype() != DType::F32) throw ValueError("mixture_of_experts: x must be float32");
  const kernels::MoeDims dims{N, C, F, E, config.experts_per_token};
  kernels::MoeOptions options;
  options.norm_topk_prob = config.norm_topk_prob;
  options.sigmoid = config.sigmoid;
  options.groups = config.groups;
  options.groups_kept = config.groups_kept;
  options.scaling = config.scaling;
  if (config.groups < 1 || E % config.groups != 0 || config.groups_kept < 1 || config.groups_kept > config.groups ||
      (config.groups > 1 && E / config.groups < 2))
    throw ValueError("mixture_of_experts: " + std::to_string(E) + " experts in " + std::to_string(config.groups) +
                     " groups keeping " + std::to_string(config.groups_kept) +
                     ": the groups must divide the experts (two or more each) and 1 ≤ kept ≤ groups");
  if (config.experts_per_token > config.groups_kept * (E / config.groups))
    throw ValueError("mixture_of_experts: experts_per_token = " + std::to_string(config.experts_per_token) +
                     " is more than the kept groups hold (" + std::to_string(config.groups_kept * (E / config.groups)) + ")");
  // the bias only chooses: read as float32 values (a bf16 copy widened), never given a gradient
  Tensor bias;
  if (config.selection_bias.defined()) {
    if (config.selection_bias.numel() != E) fail("the selection bias has " + std::to_string(config.selection_bias.numel()) + " values for " + std::to_string(E) + " experts");
    bias = Tensor::empty({E});
    bias.copy_(config.selection_bias);
    options.selection_bias = bias.data();
  }
  std::vector<const float*> g(static_cast<size_t>(E)), u(static_cast<size_t>(E)), d(static_cast<size_t>(E));
  for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
    g[e] = gate[e].data();
    u[e] = up[e].data();
    d[e] = down[e].data();
  }
  auto saved = std::make_shared<kernels::MoeSaved>();
  Tensor out = Tensor::empty(x.shape());
  kernels::moe_forward(dims, options, x.data(), router.data(), g.data(), u.data(), d.data(), out.data(), *saved);
  if (config.chosen) config.chosen->assign(saved->experts.begin(), saved->experts.end());
  if (config.weights) config.weights->assign(saved->weights.begin(), saved->weights.end());
  std::vector<Tensor> inputs = {x, router};
  for (const auto* list : {&gate, &up, &down}) inputs.insert(inputs.end(), list->begin(), list->end());
  bool any = false;
  for (const Tensor& t : inputs) any = any || t.requires_grad();
  if (!any || !grad_enabled()) return out;
  detail::record(out, "MixtureOfExpertsBackward", inputs, [inputs, dims, options, saved, bias](const Tensor& dout) {
    const int64_t E = dims.E;
    // Fresh gradients, one per input that wants one, each added to its input's (most are first contributions).
    std::vector<Tensor> grads(inputs.size());
    auto slot = [&](size_t i) -> float* {
      if (!inputs[i].requires_grad()) return nullptr;
      grads[i] = Tensor::empty(inputs[i].shape());
      return grads[i].data();
    };
    std::vector<const float*> g(static_cast<size_t>(E)), u(static_cast<size_t>(E)), d(static_cast<size_t>(E));
    std::vector<float*> dg(static_cast<size_t>(E)), du(static_cast<size_t>(E)), dd(static_cast<size_t>(E));
    for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
      g[e] = inputs[2 + e].data();
      u[e] = inputs[2 + E + e].data();
      d[e] = inputs[2 + 2 * E + e].data();
      dg[e] = slot(2 + e);
      du[e] = slot(2 + E + e);
      dd[e] = slot(2 + 2 * E + e);
    }
    float* dx = slot(0);
    float* dr = slot(1);
    kernels::moe_backward(dims, options, inputs[0].data(), inputs[1].data(), g.data(), u.data(), d.data(), *saved,
                          dout.data(), dx, dr, dg.data(), du.data(), dd.data());
    for (size_t i = 0; i < inputs.size(); ++i)
      if (grads[i].defined()) detail::add_grad(inputs[i], std::move(grads[i]));
  });
  return out;
}

}  // namespace qkv
