// A GGUF file (llama.cpp's format) as a Decoder: the configuration from its {architecture}.* metadata, the weights
// from its tensors under llama.cpp's names (DecoderConfig::layout(Names::Gguf)) used where the file is mapped — a
// block-quantized matrix is not copied, so the model's resident memory is about the file — and the conventions of
// llama.cpp's converter undone where they differ from Hugging Face's: llama-architecture files store q and k with
// their rows interleaved for llama.cpp's RoPE (un-permuted here, a copy of those two matrices), and Gemma's store
// their norms with the 1 already added (taken off). Not here: the GGUF reader (io/gguf.hpp), the tokenizer from
// tokenizer.ggml.* (text/), the products with stored weights (kernels/weights.hpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qkv/io/gguf.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

// The family whose gguf_architecture is `architecture` (the first such row: "llama" is Llama's, Mistral's files say
// "llama" too), or nullptr.
const Family* family_of_gguf_architecture(std::string_view architecture);

// Llama 3.1's RoPE scaling as llama.cpp holds it: rope_freqs.weight, a divisor for each of the head's head_dim / 2
// frequencies — 1 for short wavelengths, rope.factor for long ones, interpolated between — computed as
// convert_hf_to_gguf.py does from `rope` (a Llama3-scaled rotation). What qkv quantize writes, and what the reader
// checks a file's factors against.
std::vector<float> llama3_rope_factors(const kernels::RopeFrequencies& rope, int64_t head_dim);

// The configuration a GGUF file's metadata and tensor shapes describe. IoError naming the file and the key when the
// architecture is not one qkv runs, a key is missing or wrong, or the file uses something qkv does not compute
// (rope_freqs factors that are not Llama 3.1's scaling, a per-layer feed-forward width). Llama 3.1's factors are read
// back into its llama3 scaling: with the settings qkv quantize records (qkv.rope.llama3: factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings), else Meta's published ones (1, 4, 8192, the factor of the
// lowest frequency), checked against every factor in the file.
DecoderConfig decoder_config_from_gguf(const io::GgufFile& file);

// What a GGUF file says beside the weights, for load_pretrained.
struct GgufExtras {
  std::string chat_template;    // tokenizer.chat_template ("" when absent)
  int64_t bos_id = -1, eos_id = -1;  // tokenizer.ggml.bos_token_id, eos_token_id (−1 when absent)
};
GgufExtras gguf_extras(const io::GgufFile& file);  // the chat template and special ids of a GGUF file

// The model of a GGUF file, in eval mode. Its matrices keep the file's storage type (F32, F16, BF16, Q8_0, Q4_0,
// Q4_K, Q5_K, Q6_K, mapped), except: Q5_0 blocks become Q8_0 (exactly: the same scale and levels, so the products
// are ggml's), Q4_1 and Q5_1 are widened to float32; norms and biases are float32. The mapping stays alive as long
// as any of the model's tensors. IoError naming the file and the tensor for a missing or unexpected tensor, a shape
// that differs from the configuration's, or a type qkv cannot compute with.
std::unique_ptr<Decoder> load_gguf_decoder(const std::string& path);
// The same from a file already opened (io::MapAccess::Random suits it: the model reads its tensors where they lie),
// kept open by the model; the caller may read its metadata too (load_pretrained: the tokenizer) without parsing again.
std::unique_ptr<Decoder> load_gguf_decoder(std::shared_ptr<const io::GgufFile> file);

// The tensors whose GGUF entries rearrange the model's values — gpt-oss's stacked experts (Role::Stacked*) and
// DeepSeek's kv_b_proj (Role::LatentB) — between the model's tensor `t` and one GGUF entry's values (`entry` from
// DecoderConfig::layout(Names::Gguf): gate or up rows (E, F, C), down rows (E, C, F), their biases; attn_k_b
// (H, R, dn), each head's key rows transposed, attn_v_b (H, dv, R)), gathered into `file` (to_file) or scattered
// back into t (float32).
bool is_stacked(Role role);     // one of the Stacked* roles
bool gguf_rearranged(Role role);  // is_stacked, LatentB, or Qwen3-Next's DeltaQkvz, DeltaConv, DeltaALog
bool is_norm(Role role);     // a norm's weight (Gemma's are stored in GGUF as 1 + w)
// Whether convert_hf_to_gguf interleaves an architecture's q and k rows for llama.cpp's RoPE (LlamaModel's permute:
// llama and smollm3); qkv undoes it on reading and does it on writing
bool gguf_permutes_qk(std::string_view architecture);
// Qwen3-Next's in_proj_qkvz (regrouped into attn_qkv and attn_gate: `config` gives the heads), conv1d ((C, 1, K) as
// (C, K)) and A_log (as −exp(A_log)) are rearranged likewise.
void gguf_stacked_values(const Tensor& t, const DecoderConfig::Parameter& entry, float* file, bool to_file,
                         const DecoderConfig* config = nullptr);

}  // namespace qkv::nn
