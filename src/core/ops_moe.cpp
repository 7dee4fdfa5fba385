// The mixture-of-experts layer as a differentiable op (kernels::moe_forward / moe_backward): the forward keeps the
// routing and the experts' activations, the backward runs the kernel's and hands each input its gradient.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/moe.hpp"
#include "product.hpp"

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

namespace {
// The kernel's router and activation settings, checked against E experts
kernels::MoeOptions kernel_options(const MoeConfig& config, int64_t E) {
  kernels::MoeOptions options;
  options.norm_topk_prob = config.norm_topk_prob;
  options.sigmoid = config.sigmoid;
  options.groups = config.groups;
  options.groups_kept = config.groups_kept;
  options.scaling = config.scaling;
  options.top_k_then_softmax = config.top_k_then_softmax;
  options.swiglu_limit = config.swiglu_limit;
  options.swiglu_alpha = config.swiglu_alpha;
  if (config.experts_per_token < 1 || config.experts_per_token > E)
    throw ValueError("mixture_of_experts: experts_per_token = " + std::to_string(config.experts_per_token) +
                     " must lie in 1…" + std::to_string(E) + " (the experts)");
  if (config.groups < 1 || E % config.groups != 0 || config.groups_kept < 1 || config.groups_kept > config.groups ||
      (config.groups > 1 && E / config.groups < 2))
    throw ValueError("mixture_of_experts: " + std::to_string(E) + " experts in " + std::to_string(config.groups) +
                     " groups keeping " + std::to_string(config.groups_kept) +
                     ": the groups must divide the experts (two or more each) and 1 ≤ kept ≤ groups");
  if (config.experts_per_token > config.groups_kept * (E / config.groups))
    throw ValueError("mixture_of_experts: experts_per_token = " + std::to_string(config.experts_per_token) +
                     " is more than the kept groups hold (" + std::to_string(config.groups_kept * (E / config.groups)) + ")");
  if (!(config.swiglu_limit >= 0.0f) || !std::isfinite(config.swiglu_limit))
    throw ValueError("mixture_of_experts: swiglu_limit must be a finite value ≥ 0 (0: no clamp)");
  if (config.top_k_then_softmax && config.sigmoid)
    throw ValueError("mixture_of_experts: a router is either sigmoid (DeepSeek-V3) or top-k then softmax (gpt-oss)");
  return options;
}

// The per-expert adapters as the kernel takes them (`lora` points into a and b), their shapes checked: per projection
// an empty list or one with no update (none), or E updates, each undefined or A (r, in), B (out, r) float32 with one r
// and scale. A model without adapters (inference) allocates nothing here.
struct ExpertLoraPointers {
  std::vector<const float*> a[3], b[3];
  kernels::MoeExpertLora lora;
  std::vector<Tensor> tensors;  // A and B of every defined update, projection by projection, expert by expert
};
ExpertLoraPointers expert_lora(const ExpertsLora& lora, int64_t E, int64_t C, int64_t F) {
  ExpertLoraPointers p;
  const std::span<const LowRankUpdate> lists[3] = {lora.gate, lora.up, lora.down};
  const char* names[3] = {"gate", "up", "down"};
  kernels::MoeLoraList* out[3] = {&p.lora.gate, &p.lora.up, &p.lora.down};
  for (int k = 0; k < 3; ++k) {
    const auto& list = lists[k];
    if (std::none_of(list.begin(), list.end(), [](const LowRankUpdate& l) { return l.defined(); })) continue;
    if (static_cast<int64_t>(list.size()) != E)
      throw ShapeError("mixture_of_experts: " + std::to_string(list.size()) + " LoRA pairs on the experts' " + names[k] +
                       " for " + std::to_string(E) + " experts");
    const int64_t in = k < 2 ? C : F, outs = k < 2 ? F : C;
    int64_t rank = 0;
    float scale = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      const LowRankUpdate& l = list[static_cast<size_t>(e)];
      if (!l.defined()) {
        p.a[k].push_back(nullptr), p.b[k].push_back(nullptr);
        continue;
      }
      const int64_t r = l.rank();
      if (!(l.a.shape() == Shape{r, in}) || !(l.b.shape() == Shape{outs, r}) || (rank && (r != rank || l.scale != scale)))
        throw ShapeError("mixture_of_experts: expert " + std::to_string(e) + "'s LoRA pair on " + names[k] + " is " +
                         l.a.shape().str() + " and " + l.b.shape().str() + "; expected (r, " + std::to_string(in) + ") and (" +
                         std::to_string(outs) + ", r), one r and scale for every expert");
      if (l.a.dtype() != DType::F32 || l.b.dtype() != DType::F32)
        throw ValueError("mixture_of_experts: LoRA pairs on the experts must be float32");
      rank = r, scale = l.scale;
      p.a[k].push_back(l.a.data()), p.b[k].push_back(l.b.data());
      p.tensors.push_back(l.a), p.tensors.push_back(l.b);
    }
    *out[k] = {p.a[k].data(), p.b[k].data(), rank, scale};
  }
  return p;
}

// The adapters' gradient pointers, per projection and expert, from `slot(i)` for the i-th of p.tensors (A, then B,
// of each defined update in order)
struct LoraGradLists {
  std::vector<float*> lists[6];  // gate A, gate B, up A, up B, down A, down B: E pointers each (or none)
  kernels::MoeExpertLoraGrads grads() {
    auto data = [&](int i) { return lists[i].empty() ? nullptr : lists[i].data(); };
    return {data(0), data(1), data(2), data(3), data(4), data(5)};
  }
};
template <class Slot>
LoraGradLists lora_grad_lists(const ExpertLoraPointers& p, Slot&& slot) {
  LoraGradLists out;
  size_t next = 0;
  for (int k = 0; k < 3; ++k) {
    if (p.a[k].empty()) continue;
    out.lists[2 * k].assign(p.a[k].size(), nullptr);
    out.lists[2 * k + 1].assign(p.b[k].size(), nullptr);
    for (size_t e = 0; e < p.a[k].size(); ++e) {
      if (!p.a[k][e]) continue;
      out.lists[2 * k][e] = slot(next++);
      out.lists[2 * k + 1][e] = slot(next++);
    }
  }
  return out;
}
}  // namespace

Tensor mixture_of_experts(const Tensor& x, const Tensor& router, std::span<const Tensor> gate,
                          std::span<const Tensor> up, std::span<const Tensor> down, const MoeConfig& config,
                          const ExpertsLora& lora) {
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
  if (x.dtype() != DType::F32) throw ValueError("mixture_of_experts: x must be float32");
  const kernels::MoeDims dims{N, C, F, E, config.experts_per_token};
  kernels::MoeOptions options = kernel_options(config, E);
  // the bias only chooses: read as float32 values (a bf16 copy widened), never given a gradient
  Tensor bias;
  if (config.selection_bias.defined()) {
    if (config.selection_bias.numel() != E) fail("the selection bias has " + std::to_string(config.selection_bias.numel()) + " values for " + std::to_string(E) + " experts");
    bias = Tensor::empty({E});
    bias.copy_(config.selection_bias);
    options.selection_bias = bias.data();
  }
  // Experts kept narrow for inference (bf16, or a block format — q8_0, q4_K… — from a GGUF file or --weights): the
  // rows of the experts this call's tokens choose are multiplied in place (kernels::moe_forward on weight views, as a
  // stored Linear layer's are), none widened; the router, E × C, is widened if it is narrow.
  auto narrow = [](const Tensor& t) { return t.dtype() == DType::BF16 || t.dtype() == DType::Stored; };
  bool narrowed = narrow(router);
  for (const auto* list : {&gate, &up, &down})
    for (const Tensor& t : *list) narrowed = narrowed || narrow(t);
  const auto adapters = std::make_shared<ExpertLoraPointers>(expert_lora(lora, E, C, F));
  if (narrowed) {
    for (const auto* list : {&gate, &up, &down})
      for (const Tensor& t : *list)
        if (grad_enabled() && t.requires_grad())
          throw ValueError("mixture_of_experts: experts stored as bfloat16 or a block format are frozen; train them "
                           "through LoRA (qkv finetune --lora-rank), or load the model in float32 to train them");
    Tensor r = router;
    if (narrow(router)) {
      r = Tensor::empty(router.shape());
      r.copy_(router);
    }
    auto view = [](const Tensor& t) {  // a float32 expert beside stored ones is a view of its values
      if (t.dtype() == DType::F32) return kernels::WeightView{kernels::WeightType::F32, t.data(), t.size(0), t.size(1)};
      return detail::weight_rows(t, 0, t.size(0));
    };
    std::vector<kernels::WeightView> g, u, d;
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(e);
      g.push_back(view(gate[i]));
      u.push_back(view(up[i]));
      d.push_back(view(down[i]));
    }
    auto saved = std::make_shared<kernels::MoeSaved>();
    Tensor out = Tensor::empty(x.shape());
    try {
      kernels::moe_forward(dims, options, x.data(), r.data(), g.data(), u.data(), d.data(), adapters->lora, out.data(), *saved);
    } catch (const std::invalid_argument& e) {
      throw ValueError(std::string("mixture_of_experts: ") + e.what());
    }
    if (config.chosen) config.chosen->assign(saved->experts.begin(), saved->experts.end());
    if (config.weights) config.weights->assign(saved->weights.begin(), saved->weights.end());
    // Frozen experts: gradients reach x through their rows, the router where it is a float32 parameter, the adapters
    std::vector<Tensor> inputs = {x, router};
    inputs.insert(inputs.end(), adapters->tensors.begin(), adapters->tensors.end());
    auto learns = [](const Tensor& t) { return t.dtype() == DType::F32 && t.requires_grad(); };
    std::vector<Tensor> recorded;
    for (const Tensor& t : inputs)
      if (learns(t)) recorded.push_back(t);
    if (recorded.empty() || !grad_enabled()) return out;
    struct Views {
      std::vector<kernels::WeightView> g, u, d;
      std::vector<Tensor> experts;  // the stored tensors the views read
      Tensor router;                // float32 values
    };
    auto views = std::make_shared<Views>(Views{std::move(g), std::move(u), std::move(d), {}, r});
    for (const auto* list : {&gate, &up, &down}) views->experts.insert(views->experts.end(), list->begin(), list->end());
    detail::record(out, "MixtureOfExpertsBackward", recorded, [inputs, dims, options, saved, bias, views, adapters, learns](const Tensor& dout) {
      std::vector<Tensor> grads(inputs.size());
      auto slot = [&](size_t i) -> float* {
        if (!learns(inputs[i])) return nullptr;
        grads[i] = Tensor::empty(inputs[i].shape());
        return grads[i].data();
      };
      float* dx = slot(0);
      float* dr = slot(1);
      LoraGradLists dl = lora_grad_lists(*adapters, [&](size_t i) { return slot(2 + i); });
      kernels::moe_backward(dims, options, inputs[0].data(), views->router.data(), views->g.data(), views->u.data(),
                            views->d.data(), adapters->lora, *saved, dout.data(), dx, dr, dl.grads());
      for (size_t i = 0; i < inputs.size(); ++i)
        if (grads[i].defined()) detail::add_grad(inputs[i], std::move(grads[i]));
    });
    return out;
  }
  std::vector<const float*> g(static_cast<size_t>(E)), u(static_cast<size_t>(E)), d(static_cast<size_t>(E));
  for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
    g[e] = gate[e].data();
    u[e] = up[e].data();
    d[e] = down[e].data();
  }
  auto saved = std::make_shared<kernels::MoeSaved>();
  Tensor out = Tensor::empty(x.shape());
  kernels::moe_forward(dims, options, x.data(), router.data(), g.data(), u.data(), d.data(), adapters->lora, out.data(), *saved);
  if (config.chosen) config.chosen->assign(saved->experts.begin(), saved->experts.end());
  if (config.weights) config.weights->assign(saved->weights.begin(), saved->weights.end());
  std::vector<Tensor> inputs = {x, router};
  for (const auto* list : {&gate, &up, &down}) inputs.insert(inputs.end(), list->begin(), list->end());
  inputs.insert(inputs.end(), adapters->tensors.begin(), adapters->tensors.end());  // after the experts
  bool any = false;
  for (const Tensor& t : inputs) any = any || t.requires_grad();
  if (!any || !grad_enabled()) return out;
  detail::record(out, "MixtureOfExpertsBackward", inputs, [inputs, dims, options, saved, bias, adapters](const Tensor& dout) {
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
    LoraGradLists dl = lora_grad_lists(*adapters, [&](size_t i) { return slot(2 + 3 * static_cast<size_t>(E) + i); });
    kernels::moe_backward(dims, options, inputs[0].data(), inputs[1].data(), g.data(), u.data(), d.data(), adapters->lora,
                          *saved, dout.data(), dx, dr, dg.data(), du.data(), dd.data(), dl.grads());
    for (size_t i = 0; i < inputs.size(); ++i)
      if (grads[i].defined()) detail::add_grad(inputs[i], std::move(grads[i]));
  });
  return out;
}

namespace {
// The adapters on stacked experts as the kernel takes them, their shapes checked: gate_up's A (r·E, C), B (2F, r·E),
// down's A (r·E, F), B (C, r·E), float32
kernels::MoeStackedLora stacked_lora(const StackedExpertsLora& lora, int64_t E, int64_t C, int64_t F) {
  kernels::MoeStackedLora k;
  auto part = [&](const LowRankUpdate& l, const char* name, int64_t in, int64_t out, const float*& a, const float*& b,
                  int64_t& rank, float& scale) {
    if (!l.defined()) return;
    const int64_t rows = l.a.rank() == 2 ? l.a.size(0) : 0, r = E > 0 ? rows / E : 0;
    if (l.a.rank() != 2 || l.b.rank() != 2 || r < 1 || r * E != rows || !(l.a.shape() == Shape{r * E, in}) ||
        !(l.b.shape() == Shape{out, r * E}))
      throw ShapeError(std::string("mixture_of_experts: the LoRA pair on ") + name + " is " + l.a.shape().str() + " and " +
                       l.b.shape().str() + "; for " + std::to_string(E) + " experts of " + std::to_string(in) + " × " +
                       std::to_string(out) + " expected (r·E, " + std::to_string(in) + ") and (" + std::to_string(out) +
                       ", r·E)");
    if (l.a.dtype() != DType::F32 || l.b.dtype() != DType::F32)
      throw ValueError(std::string("mixture_of_experts: the LoRA pair on ") + name + " must be float32");
    a = l.a.data(), b = l.b.data(), rank = r, scale = l.scale;
  };
  part(lora.gate_up, "gate_up", C, 2 * F, k.gate_up_a, k.gate_up_b, k.gate_up_rank, k.gate_up_scale);
  part(lora.down, "down", F, C, k.down_a, k.down_b, k.down_rank, k.down_scale);
  return k;
}

// The adapters' four tensors, in the order the backward's inputs list them after the layer's own
std::vector<Tensor> lora_tensors(const StackedExpertsLora& lora) {
  return {lora.gate_up.a, lora.gate_up.b, lora.down.a, lora.down.b};
}

// Fills the kernel's adapter gradients from `slot` (a function of the input index, nullptr when not needed), the
// adapters' inputs starting at `first`
template <class Slot>
kernels::MoeStackedLoraGrads lora_grads(Slot&& slot, size_t first) {
  return {slot(first), slot(first + 1), slot(first + 2), slot(first + 3)};
}

// gpt-oss's experts as their files store them (see ops.hpp): each chosen expert's rows multiplied in place
Tensor stored_stacked_experts(const Tensor& x, const Tensor& router, const Tensor& router_bias, const Tensor& gate_up,
                              const Tensor& gate_up_bias, const Tensor& down, const Tensor& down_bias,
                              const MoeConfig& config, const StackedExpertsLora& lora) {
  auto fail = [&](const std::string& why) { throw ShapeError("mixture_of_experts (stored stacked experts): " + why); };
  if (x.rank() < 1 || router.rank() != 2 || gate_up.rank() != 2 || down.rank() != 2)
    fail("x must be (..., C), the router (E, C), gate_up (E·2F, C) and down (E·C, F)");
  const int64_t C = x.size(-1), E = router.size(0), N = x.numel() / std::max<int64_t>(C, 1);
  const int64_t F = E > 0 ? gate_up.size(0) / (2 * E) : 0;
  if (router.size(1) != C || !(gate_up.shape() == Shape{E * 2 * F, C}) || !(down.shape() == Shape{E * C, F}))
    fail("the router is " + router.shape().str() + ", gate_up " + gate_up.shape().str() + " and down " +
         down.shape().str() + " for " + std::to_string(C) + " channels; expected (E, C), (E·2F, C), (E·C, F)");
  if (router_bias.defined() && router_bias.numel() != E) fail("the router bias is " + router_bias.shape().str() + "; expected (E)");
  if (gate_up_bias.defined() && gate_up_bias.numel() != E * 2 * F) fail("gate_up_bias is " + gate_up_bias.shape().str() + "; expected (E, 2F)");
  if (down_bias.defined() && down_bias.numel() != E * C) fail("down_bias is " + down_bias.shape().str() + "; expected (E, C)");
  if (x.dtype() != DType::F32) throw ValueError("mixture_of_experts: x must be float32");
  auto wide = [](const Tensor& t) {  // the router and biases as float32 values
    if (!t.defined() || t.dtype() == DType::F32) return t;
    Tensor w = Tensor::empty(t.shape());
    w.copy_(t);
    return w;
  };
  const Tensor r = wide(router), rb = wide(router_bias), gb = wide(gate_up_bias), db = wide(down_bias);
  auto rows = [](const Tensor& t, int64_t first, int64_t count) {
    if (t.dtype() == DType::F32)
      return kernels::WeightView{kernels::WeightType::F32, t.data() + first * t.size(1), count, t.size(1)};
    return detail::weight_rows(t, first * t.size(1), count);
  };
  // the views and the float32 values the backward reads again, kept with it (the stored tensors keep their bytes)
  struct Kept {
    std::vector<kernels::WeightView> gate_up, down;
    std::vector<Tensor> tensors;  // the stored matrices and the float32 router and biases
    kernels::MoeSaved saved;
  };
  auto kept = std::make_shared<Kept>();
  for (int64_t e = 0; e < E; ++e) {
    kept->gate_up.push_back(rows(gate_up, e * 2 * F, 2 * F));
    kept->down.push_back(rows(down, e * C, C));
  }
  kept->tensors = {gate_up, down, r, rb, gb, db};
  auto pointer = [](const Tensor& t) { return t.defined() ? t.data() : static_cast<const float*>(nullptr); };
  const auto adapters = std::make_shared<kernels::MoeStackedLora>(stacked_lora(lora, E, C, F));
  const kernels::MoeStackedStored w{kept->gate_up.data(), pointer(gb), kept->down.data(), pointer(db), adapters.get()};
  const kernels::MoeDims dims{N, C, F, E, config.experts_per_token};
  const kernels::MoeOptions options = kernel_options(config, E);
  Tensor out = Tensor::empty(x.shape());
  try {
    kernels::moe_forward(dims, options, x.data(), r.data(), pointer(rb), w, out.data(), kept->saved);
  } catch (const std::invalid_argument& e) {
    throw ValueError(std::string("mixture_of_experts: ") + e.what());
  }
  if (config.chosen) config.chosen->assign(kept->saved.experts.begin(), kept->saved.experts.end());
  if (config.weights) config.weights->assign(kept->saved.weights.begin(), kept->saved.weights.end());
  // Gradients reach x, the router, the biases and the adapters where they are float32 parameters; the stored
  // matrices are frozen
  std::vector<Tensor> inputs = {x, router, router_bias, gate_up_bias, down_bias};
  for (const Tensor& t : lora_tensors(lora)) inputs.push_back(t);
  auto learns = [](const Tensor& t) { return t.defined() && t.dtype() == DType::F32 && t.requires_grad(); };
  std::vector<Tensor> recorded;
  for (const Tensor& t : inputs)
    if (learns(t)) recorded.push_back(t);
  if (recorded.empty() || !grad_enabled()) return out;
  detail::record(out, "MixtureOfExpertsBackward", recorded, [inputs, dims, options, kept, learns, adapters](const Tensor& dout) {
    std::vector<Tensor> grads(inputs.size());
    auto slot = [&](size_t i) -> float* {
      if (!learns(inputs[i])) return nullptr;
      grads[i] = Tensor::empty(inputs[i].shape());
      return grads[i].data();
    };
    const Kept& k = *kept;
    auto pointer = [](const Tensor& t) { return t.defined() ? t.data() : static_cast<const float*>(nullptr); };
    const kernels::MoeStackedStored w{k.gate_up.data(), pointer(k.tensors[4]), k.down.data(), pointer(k.tensors[5]),
                                      adapters.get()};
    float* dx = slot(0);
    float* dr = slot(1);
    float* drb = slot(2);
    kernels::MoeStackedGrads dw{nullptr, slot(3), nullptr, slot(4)};
    dw.lora = lora_grads(slot, 5);
    kernels::moe_backward(dims, options, inputs[0].data(), k.tensors[2].data(), pointer(k.tensors[3]), w, k.saved,
                          dout.data(), dx, dr, drb, dw);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (grads[i].defined()) detail::add_grad(inputs[i], std::move(grads[i]));
  });
  return out;
}
}  // namespace

Tensor mixture_of_experts(const Tensor& x, const Tensor& router, const Tensor& router_bias, const Tensor& gate_up,
                          const Tensor& gate_up_bias, const Tensor& down, const Tensor& down_bias,
                          const MoeConfig& config, const StackedExpertsLora& lora) {
  if (gate_up.rank() == 2 && down.rank() == 2)
    return stored_stacked_experts(x, router, router_bias, gate_up, gate_up_bias, down, down_bias, config, lora);
  auto fail = [&](const std::string& why) { throw ShapeError("mixture_of_experts (stacked experts): " + why); };
  if (x.rank() < 1 || router.rank() != 2 || gate_up.rank() != 3 || down.rank() != 3)
    fail("x must be (..., C), the router (E, C), gate_up (E, C, 2F) and down (E, F, C)");
  const int64_t C = x.size(-1), E = router.size(0), N = x.numel() / std::max<int64_t>(C, 1);
  const int64_t F = gate_up.size(2) / 2;
  if (router.size(1) != C || !(gate_up.shape() == Shape{E, C, 2 * F}) || !(down.shape() == Shape{E, F, C}))
    fail("the router is " + router.shape().str() + ", gate_up " + gate_up.shape().str() + " and down " +
         down.shape().str() + " for " + std::to_string(C) + " channels; expected (E, C), (E, C, 2F), (E, F, C)");
  if (router_bias.defined() && !(router_bias.shape() == Shape{E})) fail("the router bias is " + router_bias.shape().str() + "; expected (E)");
  if (gate_up_bias.defined() && !(gate_up_bias.shape() == Shape{E, 2 * F})) fail("gate_up_bias is " + gate_up_bias.shape().str() + "; expected (E, 2F)");
  if (down_bias.defined() && !(down_bias.shape() == Shape{E, C})) fail("down_bias is " + down_bias.shape().str() + "; expected (E, C)");
  const std::vector<Tensor> inputs = {x, router, router_bias, gate_up, gate_up_bias, down, down_bias};
  if (x.dtype() != DType::F32) throw ValueError("mixture_of_experts: x must be float32");
  // A router or experts kept narrow (bf16, a block format) for inference: widened to float32 for this call
  bool narrowed = false;
  for (const Tensor& t : inputs) narrowed = narrowed || (t.defined() && t.dtype() != DType::F32);
  if (narrowed) {
    if (grad_enabled() && x.requires_grad())
      throw ValueError("mixture_of_experts: experts or a router stored as bfloat16 or a block format are for "
                       "inference; run it under NoGradGuard, or load the model in float32 to train it");
    NoGradGuard no_grad;
    auto wide = [](const Tensor& t) {
      if (!t.defined() || t.dtype() == DType::F32) return t;
      Tensor w = Tensor::empty(t.shape());
      w.copy_(t);
      return w;
    };
    return mixture_of_experts(x, wide(router), wide(router_bias), wide(gate_up), wide(gate_up_bias), wide(down),
                              wide(down_bias), config, lora);
  }
  const kernels::MoeDims dims{N, C, F, E, config.experts_per_token};
  const kernels::MoeOptions options = kernel_options(config, E);
  auto pointer = [](const Tensor& t) { return t.defined() ? t.data() : static_cast<const float*>(nullptr); };
  const auto adapters = std::make_shared<kernels::MoeStackedLora>(stacked_lora(lora, E, C, F));
  const kernels::MoeStacked w{pointer(gate_up), pointer(gate_up_bias), pointer(down), pointer(down_bias), adapters.get()};
  auto saved = std::make_shared<kernels::MoeSaved>();
  Tensor out = Tensor::empty(x.shape());
  kernels::moe_forward(dims, options, x.data(), router.data(), pointer(router_bias), w, out.data(), *saved);
  if (config.chosen) config.chosen->assign(saved->experts.begin(), saved->experts.end());
  if (config.weights) config.weights->assign(saved->weights.begin(), saved->weights.end());
  std::vector<Tensor> all = inputs;  // the layer's own, then the adapters'
  for (const Tensor& t : lora_tensors(lora)) all.push_back(t);
  std::vector<Tensor> recorded;
  bool any = false;
  for (const Tensor& t : all)
    if (t.defined()) {
      recorded.push_back(t);
      any = any || t.requires_grad();
    }
  if (!any || !grad_enabled()) return out;
  detail::record(out, "MixtureOfExpertsBackward", recorded, [inputs = all, dims, options, saved, adapters](const Tensor& dout) {
    std::vector<Tensor> grads(inputs.size());
    auto slot = [&](size_t i) -> float* {
      if (!inputs[i].defined() || !inputs[i].requires_grad()) return nullptr;
      grads[i] = Tensor::empty(inputs[i].shape());
      return grads[i].data();
    };
    auto pointer = [&](size_t i) { return inputs[i].defined() ? inputs[i].data() : static_cast<const float*>(nullptr); };
    float* dx = slot(0);
    float* dr = slot(1);
    float* drb = slot(2);
    kernels::MoeStackedGrads dw{slot(3), slot(4), slot(5), slot(6)};
    dw.lora = lora_grads(slot, 7);
    const kernels::MoeStacked w{pointer(3), pointer(4), pointer(5), pointer(6), adapters.get()};
    kernels::moe_backward(dims, options, pointer(0), pointer(1), pointer(2), w, *saved, dout.data(), dx, dr, drb, dw);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (grads[i].defined()) detail::add_grad(inputs[i], std::move(grads[i]));
  });
  return out;
}

}  // namespace qkv
