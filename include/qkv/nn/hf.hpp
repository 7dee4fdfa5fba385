// A Hugging Face model folder as a checkpoint: config.json read into a DecoderConfig (as the family table says,
// family.hpp), the weights from model.safetensors or the shards a model.safetensors.index.json names (F32, BF16 or
// F16), and the same layout written back. Every tensor's name and shape is checked against the config before the
// model is allocated. Reading and writing go through the layout (DecoderConfig::layout): a checkpoint whose naming
// fuses or transposes what the model keeps apart (GPT-2's c_attn) is read part by part into the model's tensors.
// Not here: the tokenizer files (text/), the decoder itself (decoder.hpp).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qkv/io/safetensors.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

// The element type a folder's weights are written in: float32, or bfloat16 (half the bytes).
enum class HfDType { F32, BF16 };

// config.json's text → a decoder configuration. IoError naming `source`, the key and what qkv supports for an
// unknown model_type, a missing or malformed key, or a setting qkv lacks (a RoPE type, an activation, …).
// The text is kept in the configuration (DecoderConfig::source), so writing it back keeps every key.
DecoderConfig decoder_config_from_hf(const std::string& json_text, const std::string& source = "config.json");
// The config.json text Hugging Face's transformers would read back as this configuration, for weights stored as
// `dtype` (its torch_dtype). A configuration read from a file is that file with the values qkv knows written over
// (no key added, none lost); one made here gets every key its family reads.
std::string decoder_config_to_hf(const DecoderConfig& config, HfDType dtype = HfDType::F32);

// Whether `path` is a directory holding a config.json.
bool is_hf_folder(const std::string& path);
// config.json's model_type ("llama", "gpt2", …); IoError when the folder has no readable config.json.
std::string hf_model_type(const std::string& dir);

// Loads a folder's decoder (not gpt2: load_language_model takes both). IoError naming the file for a missing shard,
// a missing, truncated or misshapen tensor, an unexpected one, or a bad config. With `matrices` BF16 every matrix
// parameter is read as bfloat16 (Module::weights_to_bf16: BF16 tensors read as they are, others rounded a chunk at a
// time), so no float32 copy of the weights is ever made: for inference at half the memory. A BF16 matrix of the file
// is then used where the file is mapped, not copied (its values still checked finite): the model's memory is the
// page cache's, and loading costs one read of the file.
std::unique_ptr<Decoder> load_hf_decoder(const std::string& dir, DType matrices = DType::F32);

// Writes config.json and model.safetensors (tensors under the family's names; bf16 rounds to nearest even) into
// `dir`, created if missing. Files already there are replaced whole, each atomically.
void save_hf_folder(const std::string& dir, Decoder& model, HfDType dtype = HfDType::F32);

// A classifier fine-tuned from a folder's model, written as transformers' <Family>ForSequenceClassification folder:
// config.json (the base's, with architectures, id2label/label2id and pad_token_id) and model.safetensors (the base's
// tensors without its language-model head, and score.weight = `score`, classes × C, no bias). The folder's tokenizer
// files are copied from `tokenizer_from` when given. ValueError when the base is not a Hugging Face family.
void save_hf_classifier(const std::string& dir, Decoder& base, const Tensor& score, const std::vector<std::string>& labels,
                        int64_t pad_token_id, const std::string& tokenizer_from = "", HfDType dtype = HfDType::F32);

// ---- any checkpoint's layout ↔ the model ----

// A checkpoint's tensor by name (nullptr when it has none).
using TensorLookup = std::function<const io::TensorInfo*(const std::string& name)>;
// Reads a layout entry's stored values into `dst` (a tensor of the entry's stored shape).
using TensorReader = std::function<void(const DecoderConfig::Parameter& entry, Tensor& dst)>;
// That a checkpoint holds exactly the layout of `config` under `names`: every entry present with its shape, and no
// tensor in `present` beyond them but those `ignorable` accepts. IoError naming `source` and listing what is
// missing, misshapen and unexpected — before anything is allocated.
void check_layout(const DecoderConfig& config, Names names, const TensorLookup& find,
                  const std::vector<std::string>& present, const std::string& source,
                  const std::function<bool(const std::string&)>& ignorable = {});
// Every entry of the layout under `names`, read into the model: straight into its registered tensor where the entry
// is one, else whole and then part by part (transposed where it is stored so).
void read_layout(Decoder& model, Names names, const TensorReader& read);
// The model's tensors under `names`, gathered part by part where the naming fuses or transposes them (zeros for a
// part the model lacks, such as GPT-2's q/k/v bias of a model without one).
std::vector<io::TensorData> layout_tensors(Decoder& model, Names names, HfDType dtype);
// A registered tensor as its checkpoint entry of `shape` holds it: itself, or — gpt-oss's experts kept as stored rows
// (E·R, K), from a published MXFP4 folder or a GGUF file — widened to float32 in the (E, K, R) layout.
Tensor stacked_experts_as_checkpoint(const Tensor& t, const Shape& shape);

}  // namespace qkv::nn
