// Hugging Face folders (see qkv/nn/hf.hpp): config.json per family, safetensors shards, and writing both.
// The specification of each family is its modeling and configuration code in transformers (Llama, Qwen2, Qwen3,
// Gemma 3): which keys exist, their defaults, and which settings change the arithmetic.
#include "qkv/nn/hf.hpp"

#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::nn {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kMaxLayers = 4096;  // far beyond any released model; keeps a hostile config from listing 10⁹ layers
const char* kSupported = "llama (Llama 3.x), qwen2, qwen3, gemma3_text (Gemma 3 text models) and gpt2";

// Typed reads of config.json keys with the file and key in every message.
class Keys {
 public:
  Keys(const json& j, std::string source) : j_(j), source_(std::move(source)) {}
  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw IoError(source_ + ": '" + key + "' " + problem);
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  int64_t integer(const std::string& key) const {
    if (!has(key)) fail(key, "is missing");
    return integer_of(key, j_[key]);
  }
  int64_t integer(const std::string& key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_number()) fail(key, "must be a number, got " + printable(j_[key].dump(), 60));
    const double v = j_[key].get<double>();
    if (!std::isfinite(v)) fail(key, "must be finite");
    return v;
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, "must be true or false, got " + printable(j_[key].dump(), 60));
    return j_[key].get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_string()) fail(key, "must be a string, got " + printable(j_[key].dump(), 60));
    return j_[key].get<std::string>();
  }
  const json& raw(const std::string& key) const { return j_[key]; }
  int64_t integer_of(const std::string& key, const json& v) const {
    if (!v.is_number_integer() && !(v.is_number_float() && v.get<double>() == std::trunc(v.get<double>())))
      fail(key, "must be a whole number, got " + printable(v.dump(), 60));
    const double d = v.get<double>();
    if (!(d >= -9.0e15 && d <= 9.0e15)) fail(key, "is out of range: " + printable(v.dump(), 60));
    return v.get<int64_t>();
  }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
};

// rope_theta and rope_scaling (or transformers 5's rope_parameters) → frequencies.
RopeFrequencies rope_of(const Keys& keys, double default_theta, bool allow_scaling = true) {
  RopeFrequencies r;
  r.theta = keys.number("rope_theta", default_theta);
  const char* key = keys.has("rope_scaling") ? "rope_scaling" : keys.has("rope_parameters") ? "rope_parameters" : nullptr;
  if (!key || !allow_scaling) return r;
  const json& s = keys.raw(key);
  if (!s.is_object()) keys.fail(key, "must be an object or null");
  const Keys scaling(s, keys.source() + " " + key);
  if (scaling.has("rope_theta")) r.theta = scaling.number("rope_theta", r.theta);
  const std::string type = scaling.has("rope_type") ? scaling.string("rope_type", "default") : scaling.string("type", "default");
  if (type == "default") return r;
  if (type == "linear") {
    r.scaling = RopeFrequencies::Scaling::Linear;
    r.factor = scaling.number("factor", 1.0);
  } else if (type == "llama3") {
    r.scaling = RopeFrequencies::Scaling::Llama3;
    r.factor = scaling.number("factor", 8.0);
    r.low_freq_factor = scaling.number("low_freq_factor", 1.0);
    r.high_freq_factor = scaling.number("high_freq_factor", 4.0);
    r.original_max_position_embeddings = static_cast<double>(scaling.integer("original_max_position_embeddings", 8192));
  } else {
    keys.fail(std::string(key) + ".rope_type", "is '" + printable(type, 40) +
                                                 "'; qkv supports the RoPE types default, linear and llama3");
  }
  if (!(r.factor > 0.0)) keys.fail(std::string(key) + ".factor", "must be positive");
  return r;
}

std::vector<int64_t> token_ids(const Keys& keys, const std::string& key) {
  std::vector<int64_t> ids;
  if (!keys.has(key)) return ids;
  const json& v = keys.raw(key);
  if (v.is_array()) {
    for (const json& e : v) ids.push_back(keys.integer_of(key, e));
  } else {
    ids.push_back(keys.integer_of(key, v));
  }
  return ids;
}

void require_activation(const Keys& keys, const std::string& key, const std::string& fallback,
                        std::initializer_list<const char*> allowed) {
  const std::string act = keys.string(key, fallback);
  for (const char* a : allowed)
    if (act == a) return;
  std::string list;
  for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
  keys.fail(key, "is '" + printable(act, 40) + "'; this family runs with " + list);
}

// Which layers slide: transformers' layer_types list when given, else the family's own rule.
std::vector<bool> sliding_layers(const Keys& keys, int64_t layers, const std::function<bool(int64_t)>& rule) {
  std::vector<bool> sliding(static_cast<size_t>(layers));
  if (keys.has("layer_types")) {
    const json& types = keys.raw("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      keys.fail("layer_types", "must list one type per layer (" + std::to_string(layers) + ")");
    for (int64_t i = 0; i < layers; ++i) {
      const json& t = types[static_cast<size_t>(i)];
      if (t == "sliding_attention") sliding[static_cast<size_t>(i)] = true;
      else if (t != "full_attention")
        keys.fail("layer_types", "entry " + std::to_string(i) + " is " + printable(t.dump(), 40) +
                                     "; qkv knows full_attention and sliding_attention");
    }
    return sliding;
  }
  for (int64_t i = 0; i < layers; ++i) sliding[static_cast<size_t>(i)] = rule(i);
  return sliding;
}

}  // namespace

DecoderConfig decoder_config_from_hf(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError(source + ": not valid JSON (" + std::string(e.what()) + "); a Hugging Face config.json is a JSON object");
  }
  if (!j.is_object()) throw IoError(source + ": not a JSON object; a Hugging Face config.json is one");
  const Keys keys(j, source);
  const std::string type = keys.string("model_type", "");
  if (type.empty()) keys.fail("model_type", "is missing; qkv reads " + std::string(kSupported));
  DecoderConfig c;
  if (type == "llama") c.family = "llama";
  else if (type == "qwen2") c.family = "qwen2";
  else if (type == "qwen3") c.family = "qwen3";
  else if (type == "gemma3_text") c.family = "gemma3";
  else if (type == "gemma3")
    keys.fail("model_type", "is 'gemma3', the multimodal Gemma 3 (4B and larger); qkv runs the text models "
                            "(model_type gemma3_text: Gemma 3 270M and 1B)");
  else if (type == "gpt2")
    keys.fail("model_type", "is 'gpt2': load it as GPT-2 (load_language_model), not as a decoder config");
  else
    keys.fail("model_type", "is '" + printable(type, 40) + "'; qkv reads " + std::string(kSupported));

  c.vocab_size = keys.integer("vocab_size");
  c.hidden_size = keys.integer("hidden_size");
  c.intermediate_size = keys.integer("intermediate_size");
  c.num_layers = keys.integer("num_hidden_layers");
  if (c.num_layers <= 0 || c.num_layers > kMaxLayers)
    keys.fail("num_hidden_layers", "is " + std::to_string(c.num_layers) + "; qkv takes 1 to " + std::to_string(kMaxLayers));
  c.num_heads = keys.integer("num_attention_heads");
  if (c.num_heads <= 0) keys.fail("num_attention_heads", "must be positive");
  c.num_kv_heads = keys.integer("num_key_value_heads", c.num_heads);
  c.head_dim = keys.integer("head_dim", c.hidden_size / c.num_heads);
  c.max_positions = keys.integer("max_position_embeddings", 0);
  c.norm_eps = keys.number("rms_norm_eps", 1e-6);
  c.eos_token_ids = token_ids(keys, "eos_token_id");
  const auto bos = token_ids(keys, "bos_token_id");
  if (!bos.empty()) c.bos_token_id = bos.front();
  c.attention_dropout = keys.number("attention_dropout", 0.0);
  if (!(c.attention_dropout >= 0.0 && c.attention_dropout < 1.0)) keys.fail("attention_dropout", "must lie in [0, 1)");
  if (keys.integer("pretraining_tp", 1) != 1) keys.fail("pretraining_tp", "must be 1 (the split only changes rounding)");
  if (keys.has("final_logit_softcapping"))
    keys.fail("final_logit_softcapping", "is set; qkv has no final logit soft-capping (Gemma 2)");

  std::vector<bool> sliding(static_cast<size_t>(std::max<int64_t>(c.num_layers, 0)), false);
  int64_t window = 0;
  if (c.family == "llama") {
    require_activation(keys, "hidden_act", "silu", {"silu"});
    c.qkv_bias = c.o_bias = keys.boolean("attention_bias", false);
    c.mlp_bias = keys.boolean("mlp_bias", false);
    c.tie_word_embeddings = keys.boolean("tie_word_embeddings", false);
    c.ropes = {rope_of(keys, 10000.0)};
  } else if (c.family == "qwen2" || c.family == "qwen3") {
    require_activation(keys, "hidden_act", "silu", {"silu"});
    c.qkv_bias = c.family == "qwen2" ? true : keys.boolean("attention_bias", false);
    c.o_bias = c.family == "qwen3" && c.qkv_bias;
    c.qk_norm = c.family == "qwen3";
    c.tie_word_embeddings = keys.boolean("tie_word_embeddings", false);
    c.ropes = {rope_of(keys, 10000.0)};
    if (keys.boolean("use_sliding_window", false)) {
      window = keys.integer("sliding_window", 4096);
      const int64_t first = keys.integer("max_window_layers", c.num_layers);
      sliding = sliding_layers(keys, c.num_layers, [&](int64_t i) { return i >= first; });
    } else if (keys.has("layer_types")) {
      sliding = sliding_layers(keys, c.num_layers, [](int64_t) { return false; });
      window = keys.integer("sliding_window", 4096);
    }
  } else {  // gemma3
    require_activation(keys, "hidden_activation", "gelu_pytorch_tanh", {"gelu_pytorch_tanh", "gelu_tanh"});
    c.norm = NormKind::GemmaRMSNorm;
    c.mlp = MlpKind::GeGLU;
    c.qk_norm = true;
    c.sandwich_norms = true;
    c.qkv_bias = c.o_bias = keys.boolean("attention_bias", false);
    c.tie_word_embeddings = keys.boolean("tie_word_embeddings", true);
    c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
    const double scalar = keys.number("query_pre_attn_scalar", static_cast<double>(c.head_dim));
    if (!(scalar > 0)) keys.fail("query_pre_attn_scalar", "must be positive");
    c.attention_scale = 1.0 / std::sqrt(scalar);
    c.attn_softcap = keys.number("attn_logit_softcapping", 0.0);
    window = keys.integer("sliding_window", 4096);
    const int64_t pattern = keys.integer("sliding_window_pattern", 6);
    if (pattern <= 0) keys.fail("sliding_window_pattern", "must be positive");
    sliding = sliding_layers(keys, c.num_layers, [&](int64_t i) { return (i + 1) % pattern != 0; });
    // Global layers: rope_theta with rope_scaling; local (sliding) layers: rope_local_base_freq, unscaled.
    c.ropes = {rope_of(keys, 1000000.0), rope_of(keys, 10000.0, false)};
    c.ropes[1].theta = keys.number("rope_local_base_freq", 10000.0);
  }
  if (window < 0) keys.fail("sliding_window", "must not be negative");
  c.layers.resize(sliding.size());
  for (size_t i = 0; i < sliding.size(); ++i) {
    c.layers[i].window = sliding[i] ? window : 0;
    c.layers[i].rope = c.family == "gemma3" && sliding[i] ? 1 : 0;
  }
  if (c.max_positions <= 0) keys.fail("max_position_embeddings", "must be positive");
  try {
    c.validate();
  } catch (const ValueError& e) {
    throw IoError(source + ": " + e.what());
  }
  return c;
}

std::string decoder_config_to_hf(const DecoderConfig& c) {
  json j;
  const bool gemma = c.family == "gemma3";
  const std::map<std::string, std::string> types = {
      {"llama", "llama"}, {"qwen2", "qwen2"}, {"qwen3", "qwen3"}, {"gemma3", "gemma3_text"}};
  const std::map<std::string, std::string> architectures = {{"llama", "LlamaForCausalLM"},
                                                            {"qwen2", "Qwen2ForCausalLM"},
                                                            {"qwen3", "Qwen3ForCausalLM"},
                                                            {"gemma3", "Gemma3ForCausalLM"}};
  if (!types.count(c.family)) throw ValueError("decoder_config_to_hf: the " + c.family + " family has no such config.json");
  j["model_type"] = types.at(c.family);
  j["architectures"] = {architectures.at(c.family)};
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_positions;
  j["rms_norm_eps"] = c.norm_eps;
  j["attention_dropout"] = c.attention_dropout;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = "float32";
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty()) j["eos_token_id"] = c.eos_token_ids;
  auto scaling = [](const RopeFrequencies& r) -> json {
    using S = RopeFrequencies::Scaling;
    if (r.scaling == S::None) return nullptr;
    if (r.scaling == S::Linear) return {{"rope_type", "linear"}, {"factor", r.factor}};
    return {{"rope_type", "llama3"}, {"factor", r.factor}, {"low_freq_factor", r.low_freq_factor},
            {"high_freq_factor", r.high_freq_factor},
            {"original_max_position_embeddings", static_cast<int64_t>(r.original_max_position_embeddings)}};
  };
  j["rope_theta"] = c.ropes.empty() ? 10000.0 : c.ropes[0].theta;
  j["rope_scaling"] = c.ropes.empty() ? json(nullptr) : scaling(c.ropes[0]);
  json layer_types = json::array();
  int64_t window = 0;
  for (const auto& l : c.layers) {
    layer_types.push_back(l.window > 0 ? "sliding_attention" : "full_attention");
    if (l.window > 0) window = l.window;
  }
  j["layer_types"] = layer_types;
  if (gemma) {
    j["hidden_activation"] = "gelu_pytorch_tanh";
    j["query_pre_attn_scalar"] = c.attention_scale > 0 ? 1.0 / (c.attention_scale * c.attention_scale) : c.head_dim;
    j["sliding_window"] = window;
    j["rope_local_base_freq"] = c.ropes.size() > 1 ? c.ropes[1].theta : 10000.0;
    j["attention_bias"] = c.qkv_bias;
    j["attn_logit_softcapping"] = c.attn_softcap > 0 ? json(c.attn_softcap) : json(nullptr);
    j["final_logit_softcapping"] = nullptr;
  } else {
    j["hidden_act"] = "silu";
    if (c.family == "llama") {
      j["attention_bias"] = c.qkv_bias;
      j["mlp_bias"] = c.mlp_bias;
    }
    if (c.family == "qwen3") j["attention_bias"] = c.qkv_bias;
    if (c.family != "llama") {
      j["use_sliding_window"] = window > 0;
      j["sliding_window"] = window > 0 ? window : 4096;
      j["max_window_layers"] = c.num_layers;
    }
  }
  return j.dump(2) + "\n";
}

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

namespace {
std::string read_text(const fs::path& p) {
  const std::vector<std::byte> bytes = io::read_file(p.string());
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// The folder's safetensors files and which holds each tensor: model.safetensors, or the shards the index names.
struct Shards {
  std::vector<io::SafetensorsFile> files;
  std::map<std::string, size_t> where;  // tensor name → files index
};

Shards open_shards(const fs::path& dir) {
  Shards s;
  const fs::path index = dir / "model.safetensors.index.json", single = dir / "model.safetensors";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    json j;
    try {
      j = json::parse(read_text(index));
    } catch (const json::exception& e) {
      throw IoError(index.string() + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw IoError(index.string() + ": has no 'weight_map' object naming each tensor's shard");
    std::map<std::string, size_t> shard_of;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw IoError(index.string() + ": weight_map['" + printable(name, 80) + "'] is not a file name");
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..")
        throw IoError(index.string() + ": shard name '" + printable(f, 80) + "' is not a plain file name in the folder");
      if (!shard_of.count(f)) {
        const fs::path shard = dir / f;
        if (!fs::exists(shard, ec))
          throw IoError(index.string() + ": names shard '" + printable(f, 80) + "', which is not in " + dir.string() +
                        "; download the whole folder again");
        shard_of[f] = s.files.size();
        s.files.push_back(io::SafetensorsFile::open(shard.string()));
      }
      s.where[name] = shard_of[f];
    }
    for (const auto& [name, i] : s.where)
      if (!s.files[i].contains(name))
        throw IoError(s.files[i].path() + ": has no tensor '" + printable(name, 80) + "', which " + index.string() + " puts there");
    return s;
  }
  if (!fs::exists(single, ec))
    throw IoError(dir.string() + ": has neither model.safetensors nor model.safetensors.index.json");
  s.files.push_back(io::SafetensorsFile::open(single.string()));
  for (const auto& t : s.files[0].tensors()) s.where[t.name] = 0;
  return s;
}

// Tensors a checkpoint may carry that the model does not need: a tied head saved anyway, old rotary buffers.
bool ignorable(const std::string& name, const DecoderConfig& c) {
  if (c.tie_word_embeddings && name == "lm_head.weight") return true;
  return name.size() > 22 && name.compare(name.size() - 22, 22, "rotary_emb.inv_freq") == 0;
}
}  // namespace

std::string hf_model_type(const std::string& dir) {
  const fs::path config = fs::path(dir) / "config.json";
  json j;
  try {
    j = json::parse(read_text(config));
  } catch (const json::exception& e) {
    throw IoError(config.string() + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("model_type") || !j["model_type"].is_string())
    throw IoError(config.string() + ": has no 'model_type' string; qkv reads " + std::string(kSupported));
  return j["model_type"].get<std::string>();
}

std::unique_ptr<Decoder> load_hf_decoder(const std::string& dir_name, DType matrices) {
  const fs::path dir(dir_name);
  const fs::path config_path = dir / "config.json";
  const DecoderConfig config = decoder_config_from_hf(read_text(config_path), config_path.string());
  const Shards shards = open_shards(dir);
  // Every tensor the layout needs, present with its shape and a float dtype, and nothing unknown — before allocating.
  std::vector<std::string> missing, misshapen, unexpected;
  std::set<std::string> wanted;
  for (const auto& p : config.layout()) {
    wanted.insert(p.name);
    const auto it = shards.where.find(p.name);
    if (it == shards.where.end()) {
      missing.push_back(p.name);
      continue;
    }
    const io::TensorInfo* info = shards.files[it->second].find(p.name);
    if (std::vector<int64_t>(p.shape.dims().begin(), p.shape.dims().end()) != info->shape) {
      std::string shape = "(";
      for (size_t i = 0; i < info->shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(info->shape[i]);
      misshapen.push_back(p.name + " is " + shape + ") in " + shards.files[it->second].path() + ", config.json says " +
                          p.shape.str());
    }
  }
  for (const auto& [name, i] : shards.where)
    if (!wanted.count(name) && !ignorable(name, config)) unexpected.push_back(name);
  if (!missing.empty() || !misshapen.empty() || !unexpected.empty()) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + printable(v[i], 120);
      if (v.size() > 5) s += " and " + std::to_string(v.size() - 5) + " more";
      return s;
    };
    std::string why = dir.string() + ": the weights do not match config.json (" + config.family + ")";
    if (!missing.empty()) why += "; missing: " + list(missing);
    if (!misshapen.empty()) why += "; wrong shape: " + list(misshapen);
    if (!unexpected.empty()) why += "; unexpected: " + list(unexpected);
    throw IoError(why);
  }
  auto model = Decoder::for_loading(config);  // every parameter is written below: no zero fill first
  model->for_each_parameter([&](const std::string& name, Tensor& parameter) {
    if (matrices == DType::BF16 && parameter.rank() == 2) parameter.to_bf16_(/*keep_values=*/false);  // read below
    shards.files[shards.where.at(name)].read_weights(name, parameter);
  });
  return model;
}

void save_hf_folder(const std::string& dir_name, Decoder& model, HfDType dtype) {
  const fs::path dir(dir_name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) throw IoError(dir.string() + ": cannot create the folder (" + ec.message() + ")");
  const std::string config = decoder_config_to_hf(model.config);
  std::vector<io::TensorData> tensors;
  model.for_each_parameter([&](const std::string& name, Tensor& t) {
    tensors.push_back(dtype == HfDType::F32 ? io::TensorData::from_tensor(name, t) : io::TensorData::from_tensor_bf16(name, t));
  });
  io::save_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  io::write_file_atomically((dir / "config.json").string(),
                            std::span(reinterpret_cast<const std::byte*>(config.data()), config.size()));
}

}  // namespace qkv::nn
