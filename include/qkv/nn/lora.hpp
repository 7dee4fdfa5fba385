// Which parameters train, and LoRA: freezing by name, low-rank adapters added to a model's projections (appendix E's
// LinearWithLoRA), merged on request, and PEFT's adapter folders (adapter_config.json, adapter_model.safetensors) read,
// written and applied — the model and its adapters, used by fine-tuning and by loading a model with an adapter.
// Not here: the training loops (train/classify.hpp, train/instruct.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/nn/module.hpp"

namespace qkv::nn {

// ---- which parameters train ----

// A pattern matches a parameter name when it is the name, a prefix of it ending at a dot ("trf_blocks.11" matches
// "trf_blocks.11.att.W_query.weight"), or a glob with '*' (any run of characters) matching it whole.
bool name_matches(const std::string& pattern, const std::string& name);
// Every parameter of `model` trains where a pattern matches its name and is frozen elsewhere. ValueError naming a
// pattern that matches no parameter (with a few of the names there are).
void set_trainable(Module& model, const std::vector<std::string>& patterns);

// ---- LoRA ----

// LoRA adapters to add: rank, alpha and the layers they adapt (appendix E's LinearWithLoRA)
struct LoraOptions {
  int64_t rank = 0;  // 0: no LoRA
  double alpha = 0;  // 0: alpha = rank
  // Presets all (every Linear layer), attention (W_query, W_key, W_value, out_proj / q,k,v,o_proj), qkv, mlp
  // (the feed-forward's Linear layers), or module-name patterns as name_matches takes them.
  std::vector<std::string> targets = {"all"};
};
// Adds an adapter to every Linear layer of `model` that the targets select and `exclude` does not (module names, such
// as the output head), in module order, drawing each A from `gen`. Returns the adapted modules' names. ValueError when
// the targets select nothing or the rank does not fit a layer.
std::vector<std::string> add_lora(Module& model, const LoraOptions& options, Generator& gen,
                                  const std::vector<std::string>& exclude = {});
// Folds every adapter into its weight (W + (α/r)·B·A) and removes it.
void merge_lora(Module& model);

// PEFT's adapter folder: adapter_model.safetensors ("base_model.model.<module>.lora_A.weight" (r, in),
// ".lora_B.weight" (out, r), and fully trained modules' tensors under "base_model.model.<name>") and
// adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, modules_to_save, base_model_name_or_path).
struct PeftAdapter {
  int64_t rank = 0;  // r
  double alpha = 0;  // lora_alpha: the update is scaled by alpha / r
  // the adapted modules' names; the fully trained ones (a new head)
  std::vector<std::string> target_modules, modules_to_save;
  // PEFT's LoRA on parameters (target_parameters, PEFT ≥ 0.17): gpt-oss's stacked experts, "…mlp.experts.gate_up_proj"
  // and "…down_proj" (entries match a parameter's name whole or as its end after a dot). Their pairs sit under the
  // experts module, nested as PEFT nests its wrappers ("…experts.lora_A.weight" the last adapted parameter's,
  // "…experts.base_layer.lora_A.weight" the one before), A (r·E, in) and B (out, r·E); the swapped orientation some
  // PEFT and transformers versions write (A (r·E, out), B (in, r·E)) is read too, told by gate_up_proj's shapes.
  // Writing, the stacked sites among target_modules move here.
  std::vector<std::string> target_parameters;
  std::string base_model;  // base_model_name_or_path: the model the adapter was trained on
  std::string task_type;   // PEFT's task: SEQ_CLS for a classifier, CAUSAL_LM for a language model (empty: null)
  std::map<std::string, Tensor> tensors;  // names without the "base_model.model." prefix
};
// Writes the model's adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors) with the fully
// trained modules (a new head) beside them; IoError when the folder cannot be written.
void save_peft_adapter(const std::string& dir, Module& model, const PeftAdapter& description,
                       const std::vector<std::pair<std::string, Tensor>>& saved_modules);
// IoError for a folder that is not a PEFT LoRA adapter (or one qkv cannot apply: another peft_type, dropout in
// inference is ignored, fan_in_fan_out).
PeftAdapter read_peft_adapter(const std::string& dir);
// Adds the adapter's LoRA layers to `model` with its weights, and copies its fully trained tensors (modules_to_save)
// into the parameters of the same names and shapes. ValueError, before anything changes, when it adapts a layer `model`
// does not have or a shape differs (an adapter for another model). Returns the tensors it found no place for (a
// classifier head, whose shape is not the vocabulary head's), for the caller.
std::map<std::string, Tensor> apply_peft_adapter(Module& model, const PeftAdapter& adapter);

}  // namespace qkv::nn
