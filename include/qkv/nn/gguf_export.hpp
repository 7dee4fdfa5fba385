// A decoder written as a GGUF file llama.cpp loads (`qkv quantize`): llama.cpp's metadata keys and tensor names, q and
// k rows interleaved for its RoPE where its converter does so, the matrices in one of ggml's types chosen per tensor as
// llama-quantize chooses, the tokenizer as convert_hf_to_gguf.py writes it. Streamed a tensor at a time into a
// temporary file renamed into place at the end, so a big model is never whole in memory twice and nothing half-written
// is left. Not here: the GGUF format (io/gguf.hpp), reading GGUF models (gguf_model.hpp), the block formats (kernels).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/io/gguf.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

// What a whole file is quantized to (llama.cpp's "ftype"). The plain types store every matrix — the token embedding
// and the head too — in that type, as `llama-quantize --pure` does; Q4_K_M and Q5_K_M are llama.cpp's mixes
// (gguf_tensor_type). Norms and biases stay float32 in every type, as in llama.cpp's files.
// MXFP4_MOE: llama.cpp's type for gpt-oss as published — every mixture-of-experts matrix MXFP4, the other matrices Q8_0
enum class GgufFileType { F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q4_K_M, Q5_K_M, MXFP4_MOE };
// The type named "q4_k_m", "Q8_0", "bf16", … (case-insensitive), or nothing
std::optional<GgufFileType> gguf_file_type_from_name(std::string_view name);
const char* gguf_file_type_name(GgufFileType type);  // "q4_k_m"
// Every type's name, in the order above ("f32, f16, …"), for messages
std::string gguf_file_type_names();

// The storage type of one matrix of `config` (a Names::Own layout entry of rank 2) in a file of `type`. llama.cpp's
// rule (llama-quant.cpp, llama_tensor_get_type) for Q4_K_M and Q5_K_M, without an importance matrix: the head — and
// the token embedding when the head is tied to it — Q6_K; attn_v and ffn_down Q6_K in the layers where
// use_more_bits(layer, layers) holds (the first and last eighth of the layers and every third one between); every
// other matrix Q4_K (Q5_K). A matrix whose rows are not a multiple of its type's block falls back as llama.cpp's
// tensor_type_fallback does, except that a K-quant falls back to Q8_0 (llama.cpp: Q4_K → Q5_0, Q5_K → Q5_1, Q6_K →
// Q8_0; qkv writes none of Q5_0 and Q5_1), and to F16 when not a multiple of 32.
kernels::WeightType gguf_tensor_type(GgufFileType type, const DecoderConfig& config, const DecoderConfig::Parameter& p);

// How write_gguf writes
struct GgufExportOptions {
  GgufFileType type = GgufFileType::F32;  // the matrices' types
  std::string name;                       // general.name ("" : none)
  // Called after each tensor with the bytes of tensor data written so far and the total (for a progress bar)
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// What a written file holds
struct GgufExportReport {
  uint64_t file_bytes = 0;                      // the file's size
  uint64_t parameters = 0;                      // values in its tensors
  uint64_t tensor_bytes = 0;                    // bytes of its tensors (the file less metadata and padding)
  std::map<std::string, int64_t> tensors_by_type;  // "Q4_K" → how many tensors
  std::string architecture;                     // general.architecture
};

// The families write_gguf writes ("llama, qwen2, qwen3"): llama.cpp's llama (Llama 2/3, Mistral, SmolLM2, …), qwen2
// and qwen3 architectures.
std::string gguf_export_families();

// Writes `model` to `path` as GGUF version 3 (alignment 32) of type options.type, with `tokenizer` (the tokenizer.*
// keys: text::gguf_tokenizer_metadata, or a GGUF's own) after the model's keys. The model's matrices may be float32,
// bfloat16 or stored in any type (a GGUF model's are widened a few rows at a time and quantized again). ValueError
// for a model llama.cpp's architectures cannot hold as written here (another family, experts, RoPE scaled otherwise
// than Llama 3.1's — written as llama.cpp's rope_freqs.weight — or partial, sliding windows, a classifier) or a
// non-finite weight in a block type; IoError when `path` cannot be written.
GgufExportReport write_gguf(Decoder& model, const std::vector<std::pair<std::string, io::GgufValue>>& tokenizer,
                            const std::string& path, const GgufExportOptions& options);

// `qkv quantize`: the model at `source` (a Hugging Face folder with its tokenizer.json, or a GGUF file) written to
// `path` (write_gguf). The source's matrices are read as stored (a bfloat16 folder stays bfloat16, a GGUF stays mapped),
// so the memory needed is about the source's size plus a few rows.
GgufExportReport quantize_to_gguf(const std::string& source, const std::string& path, const GgufExportOptions& options);

}  // namespace qkv::nn
