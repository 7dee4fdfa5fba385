// The parameter registry and strict state-dict loading.
#include "qkv/nn/module.hpp"
#include "qkv/core/random.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/autograd.hpp"

#include <algorithm>
#include <cmath>

namespace qkv::nn {

void StateDict::insert(std::string name, Tensor tensor) {
  for (auto& [existing, t] : entries_) {
    if (existing == name) {
      t = std::move(tensor);
      return;
    }
  }
  entries_.emplace_back(std::move(name), std::move(tensor));
}

const Tensor* StateDict::find(const std::string& name) const {
  for (const auto& [existing, t] : entries_)
    if (existing == name) return &t;
  return nullptr;
}

Tensor& Module::register_parameter(std::string name, Tensor tensor) {
  tensor.requires_grad_(true);
  parameters_.push_back({std::move(name), std::move(tensor), false, nullptr, Shape{}});
  return parameters_.back().tensor;
}

Tensor& Module::register_buffer(std::string name, Tensor tensor, bool optional_on_load) {
  buffers_.push_back({std::move(name), std::move(tensor), optional_on_load, nullptr, Shape{}});
  return buffers_.back().tensor;
}

void Module::register_derived_buffer(std::string name, const Shape& shape, std::function<Tensor()> make) {
  buffers_.push_back({std::move(name), Tensor(), true, std::move(make), shape});
}

void Module::register_module(std::string name, Module& child) { children_.emplace_back(std::move(name), &child); }

// PyTorch's order: a module's own parameters, then its own buffers... per module, recursing into
// children afterwards (named_parameters / state_dict both list self first, then children in order).
void Module::walk(const std::string& prefix,
                  const std::function<void(const std::string&, Entry&, bool is_parameter)>& fn) {
  for (auto& e : parameters_) fn(prefix + e.name, e, true);
  for (auto& e : buffers_) fn(prefix + e.name, e, false);
  for (auto& [name, child] : children_) child->walk(prefix + name + ".", fn);
}

void Module::for_each_module(const std::function<void(const std::string& name, Module& module)>& fn) {
  std::function<void(const std::string&, Module&)> visit = [&](const std::string& prefix, Module& m) {
    for (auto& [name, child] : m.children_) {
      fn(prefix + name, *child);
      visit(prefix + name + ".", *child);
    }
  };
  visit("", *this);
}

std::vector<LoraSite> Module::lora_sites() {
  std::vector<LoraSite> out = own_lora_sites();
  for_each_module([&](const std::string& name, Module& m) {
    for (LoraSite site : m.own_lora_sites()) {
      site.name = site.name.empty() ? name : name + "." + site.name;
      out.push_back(std::move(site));
    }
  });
  return out;
}

void Module::add_lora(LoraSite& site, int64_t rank, double alpha, Generator& gen) {
  const int64_t in = site.in_features(), out = site.out_features();
  if (site.lora->defined()) throw ValueError("LoRA: " + site.name + " already has an adapter");
  if (rank < 1 || rank > std::min(in, out)) {
    throw ValueError("LoRA: rank " + std::to_string(rank) + " does not fit " + (site.name.empty() ? "a layer" : site.name) +
                     " (" + std::to_string(out) + " × " + std::to_string(in) + "); use a rank from 1 to " +
                     std::to_string(std::min(in, out)));
  }
  if (!(alpha > 0.0) || !std::isfinite(alpha)) throw ValueError("LoRA: alpha must be a positive number");
  LoraWeights& l = *site.lora;
  if (site.experts > 0) {  // PEFT's ParamWrapper: lora_A an nn.Linear(in, r·E) drawn as one, lora_B zeros
    Tensor a = Tensor::empty({rank * site.experts, in});
    kaiming_uniform_(a, std::sqrt(5.0), gen);
    l.a = site.owner->register_parameter(site.owner_prefix + "lora_A.weight", a);
    l.b = site.owner->register_parameter(site.owner_prefix + "lora_B.weight", Tensor::zeros({out, rank * site.experts}));
    l.scale = static_cast<float>(alpha / static_cast<double>(rank));
    return;
  }
  Tensor drawn = Tensor::empty({in, rank});  // the book's A, (in_dim, rank)
  kaiming_uniform_(drawn, std::sqrt(5.0), gen);
  l.a = site.owner->register_parameter(site.owner_prefix + "lora_A.weight", transpose(drawn, 0, 1));
  l.b = site.owner->register_parameter(site.owner_prefix + "lora_B.weight", Tensor::zeros({out, rank}));
  l.scale = static_cast<float>(alpha / static_cast<double>(rank));
}

void Module::merge_lora(LoraSite& site) {
  LoraWeights& l = *site.lora;
  if (!l.defined()) return;
  if (site.experts > 0) {  // W_e (in × out) += scale · A_eᵀ B_eᵀ, expert by expert
    if (site.weight.dtype() != DType::F32 || site.weight.rank() != 3)
      throw ValueError("LoRA: " + site.name + " is kept as stored (bfloat16 or a block format such as MXFP4), so its "
                       "adapter cannot be merged into it; keep the adapter beside the model (qkv generate --adapter), or "
                       "load the model with --weights f32 to merge");
    const int64_t E = site.experts, in = site.in, out = site.out, r = l.a.size(0) / E;
    const float* a = l.a.data();
    const float* b = l.b.data();
    float* w = site.weight.data();
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) {
          double total = 0.0;
          for (int64_t k = 0; k < r; ++k) total += static_cast<double>(a[(e * r + k) * in + i]) * b[(o * r + k) * E + e];
          w[(e * in + i) * out + o] += l.scale * static_cast<float>(total);
        }
    remove_lora(site);
    return;
  }
  {
    NoGradGuard no_grad;
    const Tensor delta = matmul(l.b.detach(), l.a.detach());  // (out, in)
    float* w = site.weight.data();
    const float* d = delta.data();
    for (int64_t i = 0; i < site.weight.numel(); ++i) w[i] += l.scale * d[i];
  }
  remove_lora(site);
}

void Module::remove_lora(LoraSite& site) {
  if (!site.lora->defined()) return;
  site.owner->remove_parameter(site.owner_prefix + "lora_A.weight");
  site.owner->remove_parameter(site.owner_prefix + "lora_B.weight");
  *site.lora = LoraWeights{};
}

void Module::for_each_parameter(const std::function<void(const std::string& name, Tensor& parameter)>& fn) {
  std::vector<const void*> seen;
  walk("", [&](const std::string& name, Entry& e, bool is_parameter) {
    if (!is_parameter) return;
    if (std::find(seen.begin(), seen.end(), e.tensor.impl()) != seen.end()) return;
    seen.push_back(e.tensor.impl());
    fn(name, e.tensor);
  });
}

void Module::replace_parameter(const std::string& name, const Tensor& tensor, bool reshaped) {
  for (auto& e : parameters_) {
    if (e.name != name) continue;
    if (reshaped ? e.tensor.numel() != tensor.numel() : !(e.tensor.shape() == tensor.shape())) {
      throw ShapeError("replace_parameter: " + name + " has shape " + e.tensor.shape().str() + ", the new tensor " +
                       tensor.shape().str());
    }
    e.tensor = tensor;
    return;
  }
  throw ValueError("replace_parameter: " + type_name() + " has no parameter '" + name + "'");
}

void Module::remove_parameter(const std::string& name) {
  for (auto it = parameters_.begin(); it != parameters_.end(); ++it) {
    if (it->name == name) {
      parameters_.erase(it);
      return;
    }
  }
  throw ValueError("remove_parameter: " + type_name() + " has no parameter '" + name + "'");
}

std::vector<std::pair<std::string, Tensor>> Module::named_trainable_parameters() {
  std::vector<std::pair<std::string, Tensor>> out;
  for_each_parameter([&](const std::string& name, Tensor& p) {
    if (p.requires_grad()) out.emplace_back(name, p);
  });
  return out;
}

int64_t Module::trainable_parameter_count() {
  int64_t n = 0;
  for_each_parameter([&](const std::string&, Tensor& p) {
    if (p.requires_grad()) n += p.numel();
  });
  return n;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() {
  std::vector<std::pair<std::string, Tensor>> out;
  for_each_parameter([&](const std::string& name, Tensor& p) { out.emplace_back(name, p); });
  return out;
}

std::vector<Tensor> Module::parameters() {
  std::vector<Tensor> out;
  for_each_parameter([&](const std::string&, Tensor& p) { out.push_back(p); });
  return out;
}

void Module::weights_to_bf16() {
  for_each_parameter([](const std::string&, Tensor& p) {
    if (p.rank() == 2) p.to_bf16_();
  });
}

int64_t Module::parameter_count() {
  int64_t n = 0;
  for_each_parameter([&](const std::string&, Tensor& p) { n += p.numel(); });
  return n;
}

void Module::zero_grad() {
  for_each_parameter([](const std::string&, Tensor& p) { p.zero_grad(); });
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::set_attention_path(AttentionPath path) {
  attention_path_ = path;
  for (auto& [name, child] : children_) child->set_attention_path(path);
}

StateDict Module::state_dict(bool with_derived) {
  StateDict out;
  walk("", [&](const std::string& name, Entry& e, bool) {
    if (!e.make) out.insert(name, e.tensor);
    else if (with_derived) out.insert(name, e.make());
  });
  return out;
}

void Module::load_state_dict(const StateDict& state) {
  std::vector<std::string> missing, mismatched, unexpected;
  std::vector<std::pair<Tensor, const Tensor*>> copies;
  std::vector<std::string> known;
  walk("", [&](const std::string& name, Entry& e, bool) {
    known.push_back(name);
    const Tensor* source = state.find(name);
    if (!source) {
      if (!e.optional_on_load) missing.push_back(name);
    } else if (const Shape& expected = e.make ? e.shape : e.tensor.shape(); !(source->shape() == expected)) {
      mismatched.push_back(name + ": expected " + expected.str() + ", got " + source->shape().str());
    } else if (!e.make) {  // a derived buffer is checked, not copied: it is recomputed from the configuration
      copies.emplace_back(e.tensor, source);
    }
  });
  for (const auto& [name, t] : state.entries())
    if (std::find(known.begin(), known.end(), name) == known.end()) unexpected.push_back(name);
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::string message = "load_state_dict for " + type_name() + " failed:";
    auto list = [&](const char* what, const std::vector<std::string>& items) {
      if (items.empty()) return;
      message += std::string(" ") + what + ":";
      for (size_t i = 0; i < items.size(); ++i) message += (i ? ", " : " ") + items[i];
      message += ";";
    };
    list("missing keys", missing);
    list("unexpected keys", unexpected);
    list("shape mismatches", mismatched);
    message.pop_back();
    throw ShapeError(message + ". The file must come from the same class built with the same arguments.");
  }
  for (auto& [dest, source] : copies) dest.copy_(*source);  // all checked first: nothing half-loaded
}

}  // namespace qkv::nn
