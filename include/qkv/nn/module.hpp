// Module: the base of every layer. It owns one registry of named parameters and buffers with
// PyTorch's state-dict names ("W_query.weight", "heads.0.W_key.weight"), and that one registry serves
// state_dict save/load, zero_grad, optimisers and parameter counts.
// Not here: the layers themselves (linear.hpp, attention.hpp).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/ops.hpp"
#include "qkv/core/tensor.hpp"

namespace qkv {
class Generator;
}

namespace qkv::nn {

// Named tensors in registration order, as PyTorch's OrderedDict state_dict.
class StateDict {
 public:
  void insert(std::string name, Tensor tensor);  // replaces an existing entry of that name
  const Tensor* find(const std::string& name) const;  // The entry named `name`, or nullptr
  // Every entry, in registration order
  const std::vector<std::pair<std::string, Tensor>>& entries() const { return entries_; }
  // Entries
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::pair<std::string, Tensor>> entries_;
};

// How attention layers compute softmax(QKᵀ/√d)V:
//   Fused  the tiled kernel (kernels::attention_forward): no T×T matrix, fast; dropout masks from a
//          counter-based stream;
//   Plain  the book's composition, materialising scores and weights; dropout masks identical to
//          torch.nn.Dropout's for the same seed. trace() always takes this path.
enum class AttentionPath { Fused, Plain };

class Module;

// A low-rank adapter on a projection W (out, in): W x + scale·B A x with A (rank, in), B (out, rank), PEFT's layout.
using LoraWeights = LowRankUpdate;

// What a LoRA site projects to, as bits: LoRA's presets choose sites by them ("attention": q, k, v and o; "mlp": gate,
// up and down), whatever the checkpoint calls the module. A fused qkv_proj carries three.
enum LoraRoleBits : unsigned {
  kLoraQuery = 1, kLoraKey = 2, kLoraValue = 4, kLoraOutput = 8, kLoraGate = 16, kLoraUp = 32, kLoraDown = 64,
};

// A projection a LoRA adapter can attach to: a Linear layer, or a weight a model keeps bare (Decoder's q/k/v/o and MLP
// projections). The adapter's parameters are registered in `owner` as owner_prefix + "lora_A.weight", "lora_B.weight".
struct LoraSite {
  std::string name;        // the module name PEFT uses: "trf_blocks.0.att.W_query", "model.layers.0.self_attn.q_proj"
  Tensor weight;           // (out, in)
  LoraWeights* lora = nullptr;  // the adapter at this site (nullptr: none)
  Module* owner = nullptr;  // the module its parameters are registered in
  std::string owner_prefix;  // their name prefix there
  unsigned roles = 0;       // LoraRoleBits: what it projects to (0: a projection of no named role)
  // > 0: `weight` holds this many experts stacked (gpt-oss's gate_up_proj, down_proj), each used as x·W_e with `in`
  // inputs and `out` outputs, and the adapter is PEFT's for a parameter (target_parameters): rank r per expert, A
  // (r·E, in), B (out, r·E) (kernels::MoeStackedLora). `name` is then the parameter's ("…mlp.experts.gate_up_proj").
  int64_t experts = 0;
  int64_t in = 0, out = 0;
  // Each (expert's) projection's inputs and outputs
  int64_t in_features() const { return experts > 0 ? in : weight.size(1); }
  int64_t out_features() const { return experts > 0 ? out : weight.size(0); }
};

// The base of every layer and model: one registry of named parameters, buffers and children, with PyTorch's names, that serves state dicts, optimisers, counts, train()/eval() and LoRA
class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Walks the trainable parameters depth-first in registration order, with dotted names. A tensor shared by
  // two names (tied weights) is visited once, under its first name, as PyTorch's named_parameters does.
  void for_each_parameter(const std::function<void(const std::string& name, Tensor& parameter)>& fn);
  std::vector<std::pair<std::string, Tensor>> named_parameters();
  // Every submodule, depth-first in registration order, with its dotted name ("trf_blocks.0.att.W_query").
  void for_each_module(const std::function<void(const std::string& name, Module& module)>& fn);
  std::vector<Tensor> parameters();
  int64_t parameter_count();
  // For inference in bf16: every matrix parameter (rank 2: projections, embedding tables, the head) becomes a BF16
  // tensor in place (Tensor::to_bf16_: half the memory, read as is by bf16 products and lookups); vectors (norms,
  // biases) stay float32. Such a model no longer trains or saves: load it again in float32 for that.
  void weights_to_bf16();
  // The parameters that train (requires_grad): what optimisers, gradient clipping and the all-reduce cover. A frozen
  // parameter (requires_grad_(false)) gets no gradient, and no backward product is run for it alone.
  std::vector<std::pair<std::string, Tensor>> named_trainable_parameters();
  int64_t trainable_parameter_count();
  void zero_grad();  // sets every parameter's gradient to zeros

  // Dropout and similar layers act only in training mode. Modules start in training mode, like PyTorch.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Sets the attention path of this module and every submodule (Fused by default).
  void set_attention_path(AttentionPath path);
  AttentionPath attention_path() const { return attention_path_; }

  // Parameters and persistent buffers. Derived buffers (the causal masks) are made here, on demand, unless
  // with_derived is false.
  StateDict state_dict(bool with_derived = true);
  // Strict: every parameter must be present with its shape and nothing unknown may be given; the error
  // lists all missing keys, unexpected keys and shape mismatches at once. Optional buffers (the causal
  // mask) are accepted when present and checked for shape.
  void load_state_dict(const StateDict& state);

  // The PyTorch class name, e.g. "SelfAttention_v2".
  virtual std::string type_name() const = 0;

  // The projections of this module itself (not of its submodules) that LoRA can adapt, names relative to it.
  virtual std::vector<LoraSite> own_lora_sites() { return {}; }
  // Every LoRA site of this module and its submodules, in module order, with dotted names.
  std::vector<LoraSite> lora_sites();
  // Attaches an adapter at `site` (A drawn as the book's LoRALayer draws its (in, rank) matrix — kaiming_uniform_(a = √5)
  // over that shape — and stored transposed; B zeros) and registers its two parameters. ValueError for a rank outside
  // 1…min(in, out), a non-positive alpha, or a site that already has one.
  static void add_lora(LoraSite& site, int64_t rank, double alpha, Generator& gen);
  // W ← W + scale·B·A, then the adapter is removed; remove_lora drops it unmerged.
  static void merge_lora(LoraSite& site);
  static void remove_lora(LoraSite& site);

 protected:
  // Registers a trainable parameter under `name` and returns it
  Tensor& register_parameter(std::string name, Tensor tensor);
  // A buffer is state that is not trained. `optional_on_load` buffers may be absent from a loaded dict.
  Tensor& register_buffer(std::string name, Tensor tensor, bool optional_on_load = false);
  // A buffer that is a pure function of the configuration and never read by forward (PyTorch's causal "mask"):
  // nothing is stored; state_dict() calls `make`, and load_state_dict accepts it when present with `shape`.
  void register_derived_buffer(std::string name, const Shape& shape, std::function<Tensor()> make);
  void register_module(std::string name, Module& child);
  // Makes the registered parameter `name` of this module be `tensor` (weight tying); the shapes must match, or with
  // `reshaped` only the number of values (a weight kept as its file's rows, widened into the shape it is used in).
  void replace_parameter(const std::string& name, const Tensor& tensor, bool reshaped = false);
  // Drops the registered parameter `name` of this module (an adapter merged away); ValueError if there is none.
  void remove_parameter(const std::string& name);

 private:
  struct Entry {
    std::string name;
    Tensor tensor;
    bool optional_on_load = false;
    std::function<Tensor()> make;  // derived buffers: tensor stays undefined
    Shape shape;
  };
  void walk(const std::string& prefix, const std::function<void(const std::string&, Entry&, bool is_parameter)>& fn);

  std::vector<Entry> parameters_;
  std::vector<Entry> buffers_;
  std::vector<std::pair<std::string, Module*>> children_;
  bool training_ = true;
  AttentionPath attention_path_ = AttentionPath::Fused;
};

// A module that maps one tensor to one tensor: Linear and every attention class.
class UnaryModule : public Module {
 public:
  virtual Tensor forward(const Tensor& x) const = 0;  // The module's output for x
  // The same as forward(x), as PyTorch's module(x)
  Tensor operator()(const Tensor& x) const { return forward(x); }
};

}  // namespace qkv::nn
