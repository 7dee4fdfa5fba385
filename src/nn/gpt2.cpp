// load_gpt2: Hugging Face GPT-2 safetensors → the decoder in its gpt2 configuration (see qkv/nn/gpt2.hpp).
#include "qkv/nn/gpt2.hpp"

#include <algorithm>
#include <cstring>
#include <set>

#include "qkv/io/safetensors.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::nn {

std::unique_ptr<Decoder> load_gpt2(const std::string& path, DType matrices) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  std::string prefix;
  if (!file.contains("wte.weight") && file.contains("transformer.wte.weight")) prefix = "transformer.";
  auto shape_of = [&](const std::string& name) {
    const io::TensorInfo* info = file.find(prefix + name);
    if (!info) throw IoError(path + ": not a GPT-2 model.safetensors: missing tensor '" + prefix + name + "'");
    if (info->shape.size() > static_cast<size_t>(kMaxRank)) throw IoError(path + ": tensor '" + prefix + name + "' has too many dimensions");
    return Shape(std::span<const int64_t>(info->shape));
  };
  // The configuration, read off the shapes: vocabulary and width from wte, context from wpe, the blocks counted.
  const Shape wte = shape_of("wte.weight"), wpe = shape_of("wpe.weight");
  if (wte.rank() != 2 || wpe.rank() != 2 || wte[1] != wpe[1]) {
    throw IoError(path + ": wte.weight " + wte.str() + " and wpe.weight " + wpe.str() +
                  " must be (vocab, C) and (context, C) with the same C");
  }
  GPTConfig config;
  config.vocab_size = wte[0];
  config.emb_dim = wte[1];
  config.context_length = wpe[0];
  config.n_layers = 0;
  while (file.contains(prefix + "h." + std::to_string(config.n_layers) + ".ln_1.weight")) ++config.n_layers;
  if (auto it = file.metadata().find("n_head"); it != file.metadata().end()) {
    try {
      config.n_heads = parse_int(it->second, "__metadata__ n_head");
    } catch (const ValueError& e) {
      throw IoError(path + ": " + e.what());
    }
  } else {
    switch (config.emb_dim) {
      case 768: config.n_heads = 12; break;   // 124M
      case 1024: config.n_heads = 16; break;  // 355M
      case 1280: config.n_heads = 20; break;  // 774M
      case 1600: config.n_heads = 25; break;  // 1558M
      default:
        throw IoError(path + ": emb_dim " + std::to_string(config.emb_dim) +
                      " is not a GPT-2 size; add __metadata__ \"n_head\" to say how many heads");
    }
  }
  config.drop_rate = 0.0;
  config.qkv_bias = true;
  config.tie_weights = true;
  try {
    config.validate();
  } catch (const ValueError& e) {
    throw IoError(path + ": " + e.what());
  }
  // Every tensor of GPT-2's layout with its shape, checked before the model is allocated: a small file listing many
  // empty layers must not make qkv build a large model. Buffers of older checkpoints (the causal mask) and the head
  // (tied to wte anyway) may be there too.
  const DecoderConfig decoder = config.decoder_config();
  std::vector<std::string> present;
  for (const auto& info : file.tensors())
    present.push_back(info.name.rfind(prefix, 0) == 0 ? info.name.substr(prefix.size()) : info.name);
  const auto ignorable = [](const std::string& name) {
    auto ends_with = [&](const std::string& tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    return name == "lm_head.weight" || ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  };
  check_layout(decoder, Names::HuggingFace, [&](const std::string& name) { return file.find(prefix + name); }, present,
               path + " (GPT-2)", ignorable);
  auto model = Decoder::for_loading(decoder);  // every parameter is written below
  // With `matrices` BF16 every matrix is bfloat16 before anything is read: no float32 copy of the model is made.
  if (matrices == DType::BF16)
    model->for_each_parameter([](const std::string&, Tensor& p) {
      if (p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    });
  read_layout(*model, Names::HuggingFace,
              [&](const DecoderConfig::Parameter& p, Tensor& dst) { file.read_weights(prefix + p.name, dst); });
  model->eval();
  return model;
}

void save_gpt2(const std::string& path, Decoder& model) {
  const GPTConfig config = GPTConfig::of(model.config);
  if (!config.tie_weights) {
    const Tensor& head = model.head;
    const Tensor& wte = model.tok_emb;
    if (std::memcmp(head.data(), wte.data(), static_cast<size_t>(wte.numel()) * sizeof(float)) != 0) {
      throw ValueError("GPT-2's safetensors layout ties the output head to wte, but this model has its own out_head.weight "
                       "(different from tok_emb.weight), which would be lost; keep it as a .pth or book safetensors");
    }
  }
  io::save_safetensors(path, layout_tensors(model, Names::HuggingFace, HfDType::F32),
                       {{"format", "pt"}, {"n_head", std::to_string(config.n_heads)}});
}

}  // namespace qkv::nn
