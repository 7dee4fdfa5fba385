// A Hugging Face model folder as a checkpoint: config.json read into a DecoderConfig, the weights from
// model.safetensors or the shards a model.safetensors.index.json names (F32, BF16 or F16), and the same layout
// written back. Every tensor's name and shape is checked against the config before the model is allocated.
// Families: llama (Llama 3.x), qwen2, qwen3, gemma3 (gemma3_text); a gpt2 folder loads into the decoder's gpt2 configuration (the book's GPTModel).
// Not here: the tokenizer files (text/), the decoder itself (decoder.hpp).
#pragma once

#include <memory>
#include <string>

#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

// config.json's text → a decoder configuration. IoError naming `source`, the key and what qkv supports for an
// unknown model_type, a missing or malformed key, or a setting qkv lacks (a RoPE type, an activation, …).
DecoderConfig decoder_config_from_hf(const std::string& json_text, const std::string& source = "config.json");
// The config.json text Hugging Face's transformers would read back as this configuration.
std::string decoder_config_to_hf(const DecoderConfig& config);

// Whether `path` is a directory holding a config.json.
bool is_hf_folder(const std::string& path);
// config.json's model_type ("llama", "gpt2", …); IoError when the folder has no readable config.json.
std::string hf_model_type(const std::string& dir);

// Loads a folder's decoder (not gpt2: load_language_model takes both). IoError naming the file for a missing shard,
// a missing, truncated or misshapen tensor, an unexpected one, or a bad config. With `matrices` BF16 every matrix
// parameter is read as bfloat16 (Module::weights_to_bf16: BF16 tensors read as they are, others rounded a chunk at a
// time), so no float32 copy of the weights is ever made: for inference at half the memory.
std::unique_ptr<Decoder> load_hf_decoder(const std::string& dir, DType matrices = DType::F32);

// The element type save_hf_decoder writes: float32, or bfloat16 (half the bytes).
enum class HfDType { F32, BF16 };
// Writes config.json and model.safetensors (tensors under the family's names; bf16 rounds to nearest even) into
// `dir`, created if missing. Files already there are replaced whole, each atomically.
void save_hf_folder(const std::string& dir, Decoder& model, HfDType dtype = HfDType::F32);

}  // namespace qkv::nn
