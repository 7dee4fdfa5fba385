// Model files of every kind qkv meets, told apart by content (not by name), and the model in each read into a Decoder:
//   Hugging Face folder   config.json + safetensors (any family of family.hpp; a *ForSequenceClassification folder
//                         with its score head) — hf.hpp does the reading
//   qkv checkpoint        qkv train's safetensors (weights, AdamW, settings, generator)
//   .pth                  torch.save of the book's GPTModel: a state dict (model.pth) or
//                         {"model_state_dict", "optimizer_state_dict"} (model_and_optimizer.pth)
//   book safetensors      the same state dict under the book's names in a safetensors file
//   Hugging Face GPT-2    model.safetensors of OpenAI's weights (Conv1D layout; gpt2.hpp)
//   GGUF                  llama.cpp's files: the weights mapped as stored, the configuration from its metadata
//                         (gguf_model.hpp)
// A book state dict carries no configuration: it is read off the tensor shapes (vocabulary, context, width, layers,
// Q/K/V biases, tied head) and completed by a ConfigHint (the book's GPT_CONFIG dict as JSON, a preset
// gpt2-small|medium|large|xl, or the head count alone), which must agree with the shapes.
// Not here: the tokenizer and everything else a loaded model carries (pretrained.hpp); optimiser state and training
// settings (train/model_file.hpp).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qkv/nn/decoder.hpp"
#include "qkv/nn/gpt.hpp"

namespace qkv::io {
class GgufFile;
}

namespace qkv::nn {

// The kinds of file (or folder) a checkpoint path can hold
enum class CheckpointFormat { QkvCheckpoint, Pth, BookSafetensors, HuggingFaceGPT2, HuggingFaceFolder, Gguf };
const char* checkpoint_format_name(CheckpointFormat format);  // "qkv checkpoint", "PyTorch .pth", …
// What the path holds, from its first bytes and, for safetensors, its tensor names. IoError naming the file and what it
// is instead (text, a GGUF file, a folder without config.json, …) when it is none of the above.
CheckpointFormat detect_checkpoint_format(const std::string& path);

// The tag in a qkv training checkpoint's __metadata__ "format".
inline constexpr const char* kQkvCheckpointFormat = "qkv-gpt-checkpoint-1";

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
GPTConfig resolve_book_config(const std::vector<std::pair<std::string, Shape>>& shapes, const ConfigHint& hint,
                              const std::string& label);

// The model of a file of any format above, with what the file says about it
struct CheckpointModel {
  std::unique_ptr<Decoder> model;  // in eval mode
  CheckpointFormat format = CheckpointFormat::QkvCheckpoint;  // which of the formats it was
  std::string tokenizer;      // the book's files: gpt2 or bytes; a Hugging Face folder: empty (its own files)
  std::string description;    // "checkpoint runs/gpt/checkpoint.safetensors"
  std::map<std::string, std::string> settings;  // a qkv checkpoint's (or a .pth written by qkv) training settings
  // A classifier's head: the book's chapter 6 out_head = Linear(C, classes) (whose rows are fewer than the
  // vocabulary's: the model is then built with its vocabulary head tied to tok_emb), or a Hugging Face
  // *ForSequenceClassification folder's score.weight (no bias)
  Tensor classifier_weight, classifier_bias;
  std::vector<std::string> labels;  // a classifier folder's id2label, in id order (empty: unnamed)
};
// Opens any of the formats above. IoError naming the file for everything wrong with it. With `matrices` BF16 every
// matrix parameter is read as bfloat16 (rounded to nearest even) one tensor at a time, never as a float32 model first.
// `gguf`: the GGUF file at `path` when the caller opened it already (its metadata is parsed once).
CheckpointModel open_checkpoint(const std::string& path, const ConfigHint& hint = {}, DType matrices = DType::F32,
                                std::shared_ptr<const io::GgufFile> gguf = nullptr);

}  // namespace qkv::nn
