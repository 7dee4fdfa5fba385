// Model files of every kind qkv meets, opened by content (not by name), and written back:
//   qkv checkpoint        qkv train's safetensors (weights, AdamW, settings, generator)
//   .pth                  torch.save of the book's GPTModel: a state dict (model.pth) or
//                         {"model_state_dict", "optimizer_state_dict"} (model_and_optimizer.pth)
//   book safetensors      the same state dict under the book's names in a safetensors file
//   Hugging Face GPT-2    model.safetensors of OpenAI's weights (Conv1D layout; nn/gpt2.hpp)
// A book state dict carries no configuration: it is read off the tensor shapes (vocabulary, context, width,
// layers, Q/K/V biases, tied head) and completed by a ConfigHint (the book's GPT_CONFIG dict as JSON, a preset
// gpt2-small|medium|large|xl, or the head count alone), which must agree with the shapes.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkv/io/pth.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/settings.hpp"

namespace qkv::train {

enum class ModelFormat { QkvCheckpoint, Pth, BookSafetensors, HuggingFaceGPT2 };
const char* model_format_name(ModelFormat format);  // "qkv checkpoint", ".pth state dict", …
// What the file holds, from its first bytes and, for safetensors, its tensor names. IoError if none of the above.
ModelFormat detect_model_format(const std::string& path);

// The book's chapter 5 presets (model_configs): emb_dim, n_layers, n_heads; vocabulary 50257, context 1024.
const std::vector<std::string>& preset_names();  // gpt2-small, gpt2-medium, gpt2-large, gpt2-xl
// The configuration keys a user gave, as strings: from a preset name or a JSON file with the book's keys
// (vocab_size, context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias; also tie_weights). Python's
// True/False/None, single quotes, # comments and trailing commas are accepted, as pasted from a notebook.
// Unknown keys are a ValueError naming them.
std::map<std::string, std::string> read_config_hint(const std::string& preset_or_path);

// What a user says about a book state dict that its tensors do not: its configuration, heads and tokenizer
struct ConfigHint {
  std::string config;       // preset name or JSON path (empty: none)
  int64_t n_heads = 0;      // 0: not given
  std::string tokenizer;    // empty: from the file (qkv), else bytes for a vocabulary of 256, else gpt2
};

// The GPTConfig of a book state dict (names → shapes): shapes first, then the hint's values, which must agree
// with them. IoError naming `label` when heads cannot be known, or a value contradicts a shape.
nn::GPTConfig resolve_book_config(const std::vector<std::pair<std::string, Shape>>& shapes, const ConfigHint& hint,
                                  const std::string& label);

// torch.optim.AdamW's state for a model's parameters (in named_parameters order, as model.parameters() in PyTorch).
struct TorchAdamW {
  optim::AdamWOptions options;  // lr, betas, eps and weight decay as saved
  int64_t step = 0;  // the optimiser's step count
  std::map<std::string, Tensor> exp_avg, exp_avg_sq;  // by parameter name
  // The moment qkv's AdamW names "exp_avg.<parameter>" or "exp_avg_sq.<parameter>" (optim::Optimizer::for_each_state);
  // nullptr if there is none.
  const Tensor* state(const std::string& name) const;
};

// A model read from any file qkv reads (told apart by content), with what came with it
struct ModelFile {
  std::unique_ptr<nn::Decoder> model;  // the book's GPTModel: the decoder in its gpt2 configuration, in eval mode
  ModelFormat format = ModelFormat::QkvCheckpoint;  // which of the formats it was
  std::string tokenizer = "gpt2";  // gpt2 or bytes
  std::string description;                // "checkpoint runs/gpt/checkpoint.safetensors"
  std::optional<TrainSettings> settings;  // a qkv checkpoint's (or a .pth written by qkv)
  std::optional<TorchAdamW> optimizer;    // a .pth with an optimizer_state_dict
  std::vector<uint64_t> rng_state;        // a .pth written by qkv: the dropout generator
  // A classifier's head (the book's chapter 6: out_head = Linear(C, classes)), when the file's out_head has fewer rows
  // than the vocabulary: (classes, C) and (classes); the model is then built without a vocabulary head of its own
  // (tied to tok_emb).
  Tensor classifier_weight, classifier_bias;
};
// Opens any of the formats above. IoError naming the file for everything wrong with it. With `matrices` BF16 every
// matrix parameter is read as bfloat16 (rounded to nearest even) one tensor at a time, never as a float32 model first:
// inference at half the memory (qkv generate --precision bf16).
ModelFile load_model_file(const std::string& path, const ConfigHint& hint = {}, DType matrices = DType::F32);

// ---- writing ----

// The book's state dict (with the causal masks, as PyTorch's state_dict() has them) as a .pth that
// torch.load(path, weights_only=True) reads and the book's GPTModel.load_state_dict accepts.
void save_book_pth(const std::string& path, nn::Decoder& model);
// {"model_state_dict", "optimizer_state_dict"} like the book's model_and_optimizer.pth, plus "config" (the book's
// dict) and qkv's own settings and generator state, so a qkv checkpoint survives the round trip whole.
void save_book_pth_with_optimizer(const std::string& path, nn::Decoder& model, const TorchAdamW& optimizer,
                                  const TrainSettings& settings, const std::vector<uint64_t>& rng_state);
// Any state dict (names → tensors, in order) as a .pth that torch.load reads: a fine-tuned classifier's model.pth.
void save_state_dict_pth(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& state);
// The book's state dict as safetensors (what safetensors.torch.save_file(model.state_dict()) writes).
void save_book_safetensors(const std::string& path, nn::Decoder& model);

// The optimizer state of a qkv checkpoint in torch's terms.
TorchAdamW read_checkpoint_optimizer(const std::string& checkpoint_path, nn::Decoder& model, const TrainSettings& settings,
                                     std::vector<uint64_t>* rng_state);

// The settings to train a model file on with: its own (a qkv checkpoint, or a .pth written by qkv), else `base`
// with the file's model configuration and tokenizer and, when it has a torch AdamW, that optimizer's learning rate
// (constant, no warmup, no clipping: the book's train_model_simple), weight decay, β and ε, and max_steps
// moved on to step + base.max_steps.
TrainSettings settings_for(const ModelFile& file, TrainSettings base = {});

// What convert_model_file did
struct Conversion {
  ModelFormat from = ModelFormat::Pth, to = ModelFormat::Pth;  // the formats read and written
  bool with_optimizer = false;  // the optimizer state went along
  std::string note;             // what the reader should know ("zero Q/K/V biases were written")
};
// The format a name asks for: "pth", "safetensors" (book names), "checkpoint", "gpt2"; empty: from the extension of
// `output` (.pth or .pt → pth, else safetensors).
ModelFormat output_format(const std::string& to, const std::string& output);
// Reads `input` (any format), writes `output` in `to`, and reads it back to check every parameter bit for bit.
// ValueError, before anything is written, when `to` cannot hold what the input has (an optimizer state in a
// weights-only format unless weights_only; an untied output head in GPT-2's layout).
Conversion convert_model_file(const std::string& input, const std::string& output, ModelFormat to,
                              const ConfigHint& hint = {}, bool weights_only = false);

}  // namespace qkv::train
