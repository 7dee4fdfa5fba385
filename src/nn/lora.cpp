// LoRA adapters and which parameters train (see qkv/nn/lora.hpp): freezing by name, adding, merging, and PEFT's
// adapter folders read, written and applied.
#include "qkv/nn/lora.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/text/records.hpp"

namespace qkv::nn {

// ---- which parameters train ----

namespace {

bool glob(const char* p, const char* s) {
  for (; *p; ++p, ++s) {
    if (*p == '*') {
      for (const char* t = s;; ++t) {
        if (glob(p + 1, t)) return true;
        if (!*t) return false;
      }
    }
    if (*s != *p) return false;
  }
  return *s == '\0';
}

std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 6; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 6) out += ", … (" + std::to_string(names.size()) + " in all)";
  return out;
}

}  // namespace

bool name_matches(const std::string& pattern, const std::string& name) {
  if (pattern.find('*') != std::string::npos) return glob(pattern.c_str(), name.c_str());
  if (name == pattern) return true;
  const std::string prefix = pattern.empty() || pattern.back() == '.' ? pattern : pattern + ".";
  return !prefix.empty() && name.compare(0, prefix.size(), prefix) == 0;
}

void set_trainable(Module& model, const std::vector<std::string>& patterns) {
  std::vector<std::string> names;
  model.for_each_parameter([&](const std::string& name, Tensor&) { names.push_back(name); });
  for (const std::string& p : patterns) {
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return name_matches(p, n); })) {
      throw ValueError("no parameter matches '" + p + "'; the model's parameters are " + some_names(names));
    }
  }
  model.for_each_parameter([&](const std::string& name, Tensor& t) {
    t.requires_grad_(std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return name_matches(p, name); }));
  });
}


// ---- LoRA ----

namespace {

// The roles a preset chooses (module.hpp's LoraRoleBits), or 0 when `target` is a name pattern instead.
constexpr unsigned kLoraQkv = kLoraQuery | kLoraKey | kLoraValue;
unsigned preset_roles(const std::string& target) {
  if (target == "all") return ~0u;
  if (target == "qkv") return kLoraQkv;
  if (target == "attention") return kLoraQkv | kLoraOutput;
  if (target == "mlp") return kLoraGate | kLoraUp | kLoraDown;
  return 0;
}

// Whether `site` is one of `targets`: a preset by the roles the site projects to, anything else a name pattern.
bool targeted(const std::vector<std::string>& targets, const LoraSite& site) {
  for (const std::string& t : targets) {
    const unsigned roles = preset_roles(t);
    if (roles == ~0u || (roles ? (site.roles & roles) != 0 : name_matches(t, site.name))) return true;
  }
  return false;
}

bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return name_matches(p, name); });
}

}  // namespace

std::vector<std::string> add_lora(Module& model, const LoraOptions& options, Generator& gen,
                                  const std::vector<std::string>& exclude) {
  if (options.rank < 1) throw ValueError("LoRA: the rank must be at least 1, got " + std::to_string(options.rank));
  const double alpha = options.alpha > 0 ? options.alpha : static_cast<double>(options.rank);
  std::vector<LoraSite> chosen, all = model.lora_sites();
  for (auto& site : all)
    if (targeted(options.targets, site) && !matches_any(exclude, site.name)) chosen.push_back(site);
  if (chosen.empty()) {
    std::vector<std::string> names;
    for (auto& site : all) names.push_back(site.name);
    std::string given;
    for (const auto& t : options.targets) given += (given.empty() ? "" : ",") + t;
    throw ValueError("LoRA: the targets '" + given + "' match no layer LoRA can adapt; the model's are " +
                     (names.empty() ? std::string("none") : some_names(names)) + " (presets: all, attention, qkv, mlp)");
  }
  for (auto& site : chosen) {  // every size checked before any adapter is added
    const int64_t in = site.in_features(), out = site.out_features();
    if (options.rank > std::min(in, out)) {
      throw ValueError("LoRA: rank " + std::to_string(options.rank) + " is larger than " + site.name + " (" +
                       std::to_string(out) + " × " + std::to_string(in) + (site.experts > 0 ? " per expert" : "") +
                       "); use at most " + std::to_string(std::min(in, out)));
    }
  }
  std::vector<std::string> names;
  for (auto& site : chosen) {
    Module::add_lora(site, options.rank, alpha, gen);
    names.push_back(site.name);
  }
  return names;
}

void merge_lora(Module& model) {
  for (auto& site : model.lora_sites()) Module::merge_lora(site);
}

namespace {
const std::string kPeftPrefix = "base_model.model.";

// PEFT's module name for each site `adapted` selects, by site name: a Linear layer's own name; for a stacked experts'
// parameter its module ("…mlp.experts") with one ".base_layer" per adapted parameter registered after it there.
// PEFT wraps each targeted parameter in a ParamWrapper around the module, the first registered innermost, so with
// gate_up_proj and down_proj both adapted down_proj's pair is "…experts.lora_A.weight" and gate_up_proj's
// "…experts.base_layer.lora_A.weight"; with one of them alone, its pair is "…experts.lora_A.weight".
template <class Adapted>
std::map<std::string, std::string> peft_names(const std::vector<LoraSite>& sites, Adapted&& adapted) {
  std::map<std::string, std::string> names;
  std::map<std::string, std::vector<std::string>> stacked;  // module → its adapted parameters, in registration order
  std::vector<std::string> modules;
  for (const LoraSite& site : sites) {
    if (!adapted(site)) continue;
    if (site.experts == 0) {
      names[site.name] = site.name;
      continue;
    }
    const std::string module = site.name.substr(0, site.name.rfind('.'));
    if (!stacked.count(module)) modules.push_back(module);
    stacked[module].push_back(site.name);
  }
  for (const std::string& module : modules) {
    const auto& parameters = stacked[module];
    for (size_t j = 0; j < parameters.size(); ++j) {
      std::string name = module;
      for (size_t k = j + 1; k < parameters.size(); ++k) name += ".base_layer";
      names[parameters[j]] = name;
    }
  }
  return names;
}

// Whether a target_parameters entry names a parameter: the whole name, or its end after a dot (PEFT's suffix match)
bool names_parameter(const std::string& target, const std::string& name) {
  return name == target || (name.size() > target.size() && name.compare(name.size() - target.size(), target.size(), target) == 0 &&
                            name[name.size() - target.size() - 1] == '.');
}
}  // namespace

void save_peft_adapter(const std::string& dir, Module& model, const PeftAdapter& d,
                       const std::vector<std::pair<std::string, Tensor>>& saved_modules) {
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<LoraSite> sites = model.lora_sites();
  const auto names = peft_names(sites, [](const LoraSite& site) { return site.lora->defined(); });
  std::set<std::string> stacked;  // the adapted parameters of stacked experts: target_parameters, not target_modules
  for (const auto& site : sites) {
    if (!site.lora->defined()) continue;
    if (site.experts > 0) stacked.insert(site.name);
    tensors.emplace_back(kPeftPrefix + names.at(site.name) + ".lora_A.weight", site.lora->a);
    tensors.emplace_back(kPeftPrefix + names.at(site.name) + ".lora_B.weight", site.lora->b);
  }
  std::vector<std::string> target_modules, target_parameters;
  for (const std::string& name : d.target_modules) (stacked.count(name) ? target_parameters : target_modules).push_back(name);
  for (const std::string& name : d.target_parameters)
    if (std::find(target_parameters.begin(), target_parameters.end(), name) == target_parameters.end()) target_parameters.push_back(name);
  for (const auto& [name, t] : saved_modules) tensors.emplace_back(kPeftPrefix + name, t);
  io::save_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"}, {"task_type", d.task_type.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(d.task_type)},
      {"base_model_name_or_path", d.base_model},
      {"r", d.rank}, {"lora_alpha", d.alpha}, {"lora_dropout", 0.0}, {"bias", "none"},
      {"fan_in_fan_out", false}, {"inference_mode", true}, {"init_lora_weights", true},
      {"target_modules", target_modules}, {"modules_to_save", d.modules_to_save.empty() ? nlohmann::ordered_json(nullptr)
                                                                                       : nlohmann::ordered_json(d.modules_to_save)}};
  // PEFT ≥ 0.17's LoRA on parameters (gpt-oss's stacked experts), its pairs laid out as PEFT ≥ 0.19.1 with
  // transformers 5 (and PEFT 0.17–0.18) lay them out: A (r·E, in), B (out, r·E)
  if (!target_parameters.empty()) config["target_parameters"] = target_parameters;
  const std::string text = config.dump(2) + "\n";
  io::write_file_atomically(dir + "/adapter_config.json", std::as_bytes(std::span(text.data(), text.size())));
}

PeftAdapter read_peft_adapter(const std::string& dir) {
  const std::string config_path = dir + "/adapter_config.json", weights_path = dir + "/adapter_model.safetensors";
  for (const std::string& p : {config_path, weights_path})
    if (!std::filesystem::is_regular_file(p)) throw IoError(dir + ": not a PEFT adapter folder (no " + p + ")");
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(text::read_text_file(config_path, 1 << 20));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(config_path + ": not valid JSON: " + e.what());
  }
  PeftAdapter a;
  try {
    if (c.value("peft_type", std::string()) != "LORA") throw IoError(config_path + ": peft_type is not LORA; qkv applies LoRA adapters");
    if (c.value("fan_in_fan_out", false)) throw IoError(config_path + ": fan_in_fan_out adapters (Conv1D layers) are not supported");
    a.rank = c.at("r").get<int64_t>();
    a.alpha = c.at("lora_alpha").get<double>();
    if (c.contains("target_modules") && c["target_modules"].is_array()) a.target_modules = c["target_modules"].get<std::vector<std::string>>();
    if (c.contains("modules_to_save") && c["modules_to_save"].is_array()) a.modules_to_save = c["modules_to_save"].get<std::vector<std::string>>();
    if (c.contains("target_parameters") && c["target_parameters"].is_array())
      a.target_parameters = c["target_parameters"].get<std::vector<std::string>>();
    if (!a.target_parameters.empty() && c.value("lora_dropout", 0.0) != 0.0)  // PEFT refuses it too
      throw IoError(config_path + ": lora_dropout must be 0 with target_parameters (PEFT cannot train such an adapter)");
    a.base_model = c.value("base_model_name_or_path", std::string());
    if (c.contains("task_type") && c["task_type"].is_string()) a.task_type = c["task_type"].get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw IoError(config_path + ": " + e.what());
  }
  if (a.rank < 1 || !(a.alpha > 0)) throw IoError(config_path + ": r and lora_alpha must be positive");
  const io::SafetensorsFile file = io::SafetensorsFile::open(weights_path);
  for (const auto& info : file.tensors()) {
    std::string name = info.name;
    if (name.compare(0, kPeftPrefix.size(), kPeftPrefix) == 0) name = name.substr(kPeftPrefix.size());
    a.tensors[name] = file.weights(info.name);
  }
  return a;
}

namespace {
// A pair on E stacked experts in the other orientation PEFT writes (0.19.0 with transformers 5, ≥ 0.19.1 with
// transformers 4: in and out features swapped, A (r·E, out), B (in, r·E), the update s·B_e A_e) turned into ours:
// A_e ← B_eᵀ, B_e ← A_eᵀ, the same update.
std::pair<Tensor, Tensor> unswapped(const Tensor& a, const Tensor& b, int64_t E) {
  const int64_t rE = a.size(0), r = rE / E, out = a.size(1), in = b.size(0);
  Tensor ca = Tensor::empty({rE, in}), cb = Tensor::empty({out, rE});
  const float *sa = a.data(), *sb = b.data();
  float *da = ca.data(), *db = cb.data();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t i = 0; i < in; ++i) da[(e * r + k) * in + i] = sb[i * rE + k * E + e];
      for (int64_t o = 0; o < out; ++o) db[o * rE + k * E + e] = sa[(e * r + k) * out + o];
    }
  return {ca, cb};
}
}  // namespace

std::map<std::string, Tensor> apply_peft_adapter(Module& model, const PeftAdapter& adapter) {
  std::map<std::string, LoraSite> layers;  // by PEFT's module name
  const std::vector<LoraSite> sites = model.lora_sites();
  const auto stacked_names = peft_names(sites, [&](const LoraSite& site) {
    return site.experts > 0 && std::any_of(adapter.target_parameters.begin(), adapter.target_parameters.end(),
                                           [&](const std::string& t) { return names_parameter(t, site.name); });
  });
  for (const auto& site : sites) {
    if (site.experts == 0) layers[site.name] = site;
    else if (stacked_names.count(site.name)) layers[stacked_names.at(site.name)] = site;
  }
  std::set<std::string> modules;
  const std::string a_suffix = ".lora_A.weight", b_suffix = ".lora_B.weight";
  for (const auto& [name, t] : adapter.tensors) {
    for (const std::string* suffix : {&a_suffix, &b_suffix}) {
      if (name.size() > suffix->size() && name.compare(name.size() - suffix->size(), suffix->size(), *suffix) == 0)
        modules.insert(name.substr(0, name.size() - suffix->size()));
    }
  }
  if (modules.empty()) throw ValueError("the adapter holds no lora_A/lora_B weights");
  std::map<std::string, Tensor> parameters, rest;
  for (auto& [name, p] : model.named_parameters()) parameters[name] = p;
  for (const auto& [name, t] : adapter.tensors) {
    if (name.find(".lora_") != std::string::npos) continue;
    const auto it = parameters.find(name);
    if (it == parameters.end() || !(it->second.shape() == t.shape())) rest[name] = t;
  }
  // Stacked experts' pairs: which orientation PEFT wrote them in, told by a pair whose expert is not square (gpt-oss's
  // gate_up_proj, C × 2F); square ones (its down_proj) follow, ours when none tells
  auto canonical = [&](const LoraSite& site, const Tensor& a, const Tensor& b) {
    const int64_t rE = adapter.rank * site.experts;
    return a.shape() == Shape{rE, site.in} && b.shape() == Shape{site.out, rE};
  };
  auto swapped = [&](const LoraSite& site, const Tensor& a, const Tensor& b) {
    const int64_t rE = adapter.rank * site.experts;
    return a.shape() == Shape{rE, site.out} && b.shape() == Shape{site.in, rE};
  };
  bool swap = false;
  for (const std::string& m : modules) {
    const auto it = layers.find(m);
    const auto a = adapter.tensors.find(m + a_suffix), b = adapter.tensors.find(m + b_suffix);
    if (it == layers.end() || it->second.experts == 0 || it->second.in == it->second.out || a == adapter.tensors.end() ||
        b == adapter.tensors.end())
      continue;
    if (swapped(it->second, a->second, b->second)) swap = true;
  }
  for (const std::string& m : modules) {  // everything checked before anything changes
    auto it = layers.find(m);
    if (it == layers.end()) {
      if (adapter.target_parameters.empty() && m.find(".experts") != std::string::npos)
        throw ValueError("the adapter adapts '" + m + "' but its adapter_config.json names no target_parameters, so which "
                         "of the experts' parameters it changes is unknown");
      throw ValueError("the adapter is for another model: it adapts '" + m + "', a layer this model does not have");
    }
    const auto a = adapter.tensors.find(m + a_suffix), b = adapter.tensors.find(m + b_suffix);
    if (a == adapter.tensors.end() || b == adapter.tensors.end()) throw ValueError("the adapter has only half of " + m + "'s LoRA pair");
    const LoraSite& site = it->second;
    const bool fits = site.experts == 0 ? a->second.shape() == Shape{adapter.rank, site.in_features()} &&
                                              b->second.shape() == Shape{site.out_features(), adapter.rank}
                                        : swap ? swapped(site, a->second, b->second) : canonical(site, a->second, b->second);
    if (!fits) {
      const std::string expected = site.experts == 0 ? "" : " (for " + std::to_string(site.experts) + " experts of " +
                                                                std::to_string(site.in) + " × " + std::to_string(site.out) + " at rank " +
                                                                std::to_string(adapter.rank) + ": (r·E, in) and (out, r·E))";
      throw ValueError("the adapter is for another model: " + (site.experts ? site.name : m) + " is " + site.weight.shape().str() +
                       " here, its LoRA pair is " + a->second.shape().str() + " and " + b->second.shape().str() + expected);
    }
    if (site.lora->defined()) throw ValueError(m + " already has an adapter");
  }
  Generator unused = Generator::drawing_nothing();
  for (const std::string& m : modules) {
    LoraSite& site = layers[m];
    Module::add_lora(site, adapter.rank, adapter.alpha, unused);
    Tensor a = adapter.tensors.at(m + a_suffix), b = adapter.tensors.at(m + b_suffix);
    if (site.experts > 0 && swap) {
      Tensor fa = Tensor::empty(a.shape()), fb = Tensor::empty(b.shape());  // float32 values to reorder
      fa.copy_(a);
      fb.copy_(b);
      std::tie(a, b) = unswapped(fa, fb, site.experts);
    }
    site.lora->a.copy_(a);
    site.lora->b.copy_(b);
  }
  for (const auto& [name, t] : adapter.tensors)
    if (name.find(".lora_") == std::string::npos && !rest.count(name)) parameters.at(name).copy_(t);
  return rest;
}

}  // namespace qkv::nn
