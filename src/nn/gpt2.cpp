// load_gpt2: Hugging Face GPT-2 safetensors → the decoder in its gpt2 configuration (see qkv/nn/gpt2.hpp).
#include "qkv/nn/gpt2.hpp"

#include <algorithm>
#include <cstring>
#include <set>

#include "qkv/io/safetensors.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/settings.hpp"

namespace qkv::nn {

namespace {

// dst (out, in) = columns [c0, c0 + out) of src [in, total]: a Conv1D slice, transposed.
void copy_transposed_columns(const Tensor& src, int64_t c0, Tensor& dst) {
  dst.copy_(transpose_columns(src, c0, dst.size(0)));  // rounded where dst is bf16
}

}  // namespace

std::unique_ptr<Decoder> load_gpt2(const std::string& path, DType matrices) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  std::string prefix;
  if (!file.contains("wte.weight") && file.contains("transformer.wte.weight")) prefix = "transformer.";
  std::set<std::string> used;
  auto get = [&](const std::string& name, const Shape& expected = Shape{}) {
    if (!file.contains(prefix + name)) {
      throw IoError(path + ": not a GPT-2 model.safetensors: missing tensor '" + prefix + name + "'");
    }
    used.insert(prefix + name);
    const io::TensorInfo& info = *file.find(prefix + name);
    if (info.shape.size() > static_cast<size_t>(kMaxRank)) throw IoError(path + ": tensor '" + prefix + name + "' has too many dimensions");
    const Shape shape(std::span<const int64_t>(info.shape));
    if (expected.rank() > 0 && !(shape == expected)) {
      throw IoError(path + ": tensor '" + prefix + name + "' has shape " + shape.str() + ", expected " + expected.str());
    }
    return shape;
  };
  // One tensor at a time, read with pread (no page of the file mapped), into a temporary or straight into its parameter.
  auto read = [&](const std::string& name, const Shape& expected) {
    Tensor t = Tensor::empty(get(name, expected));
    file.read_weights(prefix + name, t);
    return t;
  };
  const Shape wte = get("wte.weight"), wpe = get("wpe.weight");
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
  // Every layer's tensors with their shapes, checked before the model is allocated: a small file listing many
  // empty layers must not make qkv build a large model.
  const int64_t C = config.emb_dim;
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string h = prefix + "h." + std::to_string(i) + ".";
    const std::pair<const char*, Shape> expected[] = {
        {"ln_1.weight", {C}}, {"ln_1.bias", {C}}, {"attn.c_attn.weight", {C, 3 * C}}, {"attn.c_attn.bias", {3 * C}},
        {"attn.c_proj.weight", {C, C}}, {"attn.c_proj.bias", {C}}, {"ln_2.weight", {C}}, {"ln_2.bias", {C}},
        {"mlp.c_fc.weight", {C, 4 * C}}, {"mlp.c_fc.bias", {4 * C}}, {"mlp.c_proj.weight", {4 * C, C}}, {"mlp.c_proj.bias", {C}}};
    for (const auto& [name, shape] : expected) {
      const io::TensorInfo* info = file.find(h + name);
      if (!info) throw IoError(path + ": not a GPT-2 model.safetensors: missing tensor '" + h + name + "'");
      if (!(Shape(std::span<const int64_t>(info->shape)) == shape)) {
        throw IoError(path + ": tensor '" + h + name + "' has shape " + Shape(std::span<const int64_t>(info->shape)).str() +
                      ", expected " + shape.str());
      }
    }
  }
  auto model = Decoder::for_loading(config.decoder_config());  // every parameter is written below
  // With `matrices` BF16 every matrix is bfloat16 before anything is read: no float32 copy of the model is made.
  if (matrices == DType::BF16)
    model->for_each_parameter([](const std::string&, Tensor& p) {
      if (p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    });
  auto into = [&](const std::string& name, Tensor& dst) {
    get(name, dst.shape());
    file.read_weights(prefix + name, dst);
  };
  into("wte.weight", model->tok_emb);
  into("wpe.weight", model->pos_emb);
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    DecoderBlock& block = model->blocks[static_cast<size_t>(i)];
    into(h + "ln_1.weight", block.attn_norm);
    into(h + "ln_1.bias", block.attn_norm_bias);
    const Tensor c_attn = read(h + "attn.c_attn.weight", {C, 3 * C}), c_attn_bias = read(h + "attn.c_attn.bias", {3 * C});
    Tensor* projections[][2] = {{&block.wq, &block.bq}, {&block.wk, &block.bk}, {&block.wv, &block.bv}};
    for (int part = 0; part < 3; ++part) {
      copy_transposed_columns(c_attn, part * C, *projections[part][0]);
      std::copy_n(c_attn_bias.data() + part * C, C, projections[part][1]->data());
    }
    copy_transposed_columns(read(h + "attn.c_proj.weight", {C, C}), 0, block.wo);
    into(h + "attn.c_proj.bias", block.bo);
    into(h + "ln_2.weight", block.mlp_norm);
    into(h + "ln_2.bias", block.mlp_norm_bias);
    copy_transposed_columns(read(h + "mlp.c_fc.weight", {C, 4 * C}), 0, block.up);
    into(h + "mlp.c_fc.bias", block.up_bias);
    copy_transposed_columns(read(h + "mlp.c_proj.weight", {4 * C, C}), 0, block.down);
    into(h + "mlp.c_proj.bias", block.down_bias);
    // Buffers of older checkpoints: the causal mask, recomputed here.
    for (const char* buffer : {"attn.bias", "attn.masked_bias"})
      if (file.contains(prefix + h + buffer)) used.insert(prefix + h + buffer);
  }
  into("ln_f.weight", model->final_norm);
  into("ln_f.bias", model->final_norm_bias);
  if (file.contains(prefix + "lm_head.weight")) used.insert(prefix + "lm_head.weight");  // tied to wte anyway
  std::string unexpected;
  int extra = 0;
  for (const auto& info : file.tensors()) {
    if (used.count(info.name)) continue;
    if (++extra <= 10) unexpected += (unexpected.empty() ? "" : ", ") + printable(info.name);
  }
  if (extra > 10) unexpected += " and " + std::to_string(extra - 10) + " more";
  if (!unexpected.empty()) throw IoError(path + ": unexpected tensors for GPT-2: " + unexpected);
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
  const int64_t C = config.emb_dim;
  // Linear (out, in) → Conv1D [in, out], placed at column `at` of a [in, width] tensor.
  auto conv1d = [](const Tensor& weight, Tensor& into, int64_t at) {
    const Tensor t = transpose_columns(weight, 0, weight.size(1));  // (in, out)
    const int64_t in = t.size(0), out = t.size(1), width = into.size(1);
    for (int64_t r = 0; r < in; ++r) std::copy_n(t.data() + r * out, out, into.data() + r * width + at);
  };
  auto bias_of = [&](const Tensor& bias, int64_t n) { return bias.defined() ? bias : Tensor::zeros({n}); };
  std::vector<std::pair<std::string, Tensor>> tensors{{"wte.weight", model.tok_emb}, {"wpe.weight", model.pos_emb}};
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const DecoderBlock& b = model.blocks[static_cast<size_t>(i)];
    const std::string h = "h." + std::to_string(i) + ".";
    Tensor c_attn = Tensor::empty({C, 3 * C}), c_attn_bias = Tensor::empty({3 * C});
    const Tensor* parts[][2] = {{&b.wq, &b.bq}, {&b.wk, &b.bk}, {&b.wv, &b.bv}};
    for (int part = 0; part < 3; ++part) {
      conv1d(*parts[part][0], c_attn, part * C);
      const Tensor bias = bias_of(*parts[part][1], C);  // no Q/K/V bias (the book's default): zeros, the same function
      std::copy_n(bias.data(), C, c_attn_bias.data() + part * C);
    }
    Tensor c_proj = Tensor::empty({C, C}), c_fc = Tensor::empty({C, 4 * C}), mlp_proj = Tensor::empty({4 * C, C});
    conv1d(b.wo, c_proj, 0);
    conv1d(b.up, c_fc, 0);
    conv1d(b.down, mlp_proj, 0);
    tensors.insert(tensors.end(), {{h + "ln_1.weight", b.attn_norm}, {h + "ln_1.bias", b.attn_norm_bias},
                                   {h + "attn.c_attn.weight", c_attn}, {h + "attn.c_attn.bias", c_attn_bias},
                                   {h + "attn.c_proj.weight", c_proj}, {h + "attn.c_proj.bias", bias_of(b.bo, C)},
                                   {h + "ln_2.weight", b.mlp_norm}, {h + "ln_2.bias", b.mlp_norm_bias},
                                   {h + "mlp.c_fc.weight", c_fc}, {h + "mlp.c_fc.bias", bias_of(b.up_bias, 4 * C)},
                                   {h + "mlp.c_proj.weight", mlp_proj}, {h + "mlp.c_proj.bias", bias_of(b.down_bias, C)}});
  }
  tensors.emplace_back("ln_f.weight", model.final_norm);
  tensors.emplace_back("ln_f.bias", model.final_norm_bias);
  io::save_safetensors(path, tensors, {{"format", "pt"}, {"n_head", std::to_string(config.n_heads)}});
}

}  // namespace qkv::nn
