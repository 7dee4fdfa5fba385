// OpenAI's GPT-2 weights in Hugging Face's model.safetensors layout, loaded into the decoder's gpt2 configuration (the book's GPTModel).
// Hugging Face stores GPT-2's linear layers as Conv1D, weight [in, out]: c_attn.weight [C, 3C] holds Wq, Wk
// and Wv side by side. That layout is the decoder's Names::HuggingFace naming of the gpt2 family (decoder.hpp), so
// reading and writing it is read_layout and layout_tensors (hf.hpp). The output
// head is tied to wte. The configuration (124M, 355M, 774M, 1558M, or any other size) is read off the
// tensor shapes; the head count from __metadata__ "n_head" if present, else from GPT-2's sizes.
#pragma once

#include <memory>
#include <string>

#include "qkv/nn/gpt.hpp"

namespace qkv::nn {

// Throws IoError naming the file and listing missing or unexpected tensors. Tensors are read one at a time; with
// `matrices` BF16 every matrix is held as bfloat16 from the start (half the memory, no float32 copy first).
std::unique_ptr<Decoder> load_gpt2(const std::string& path, DType matrices = DType::F32);
// Writes a model in that layout (with __metadata__ n_head). Q/K/V projections without bias get zero biases (the
// same function). ValueError when the model's output head is not tok_emb.weight: GPT-2's layout cannot hold it.
void save_gpt2(const std::string& path, Decoder& model);

}  // namespace qkv::nn
