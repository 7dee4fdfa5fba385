// Model files for training: what nn/checkpoint.hpp reads of a file's model, plus what training resumes from — a qkv
// checkpoint's or a .pth's settings, AdamW state and generator — and the files written back (.pth, book safetensors,
// qkv checkpoints, GPT-2's layout), converted between each other bit for bit.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkv/io/pth.hpp"
#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/settings.hpp"

namespace qkv::train {

// The formats qkv reads (nn/checkpoint.hpp); the CLI's convert writes the book's and qkv's.
using ModelFormat = nn::CheckpointFormat;
using nn::ConfigHint;
inline const char* model_format_name(ModelFormat format) { return nn::checkpoint_format_name(format); }

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
TrainSettings settings_for(const ModelFile& file, const TrainSettings& base);
TrainSettings settings_for(const ModelFile& file);  // with TrainSettings' defaults as the base

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
