// Model files by content, and the book's configurations (see qkv/nn/checkpoint.hpp).
#include "qkv/nn/checkpoint.hpp"

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "qkv/io/pth.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/gguf_model.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::nn {

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& problem) { throw IoError(label + ": " + problem); }

// The book's name of the parameter with `role` in `layer` (−1: outside the blocks), from the gpt2 family's layout:
// what tells a book state dict's configuration from its tensor names.
std::string book_name(Role role, int64_t layer = -1) {
  GPTConfig probe{.vocab_size = 2, .context_length = 2, .emb_dim = 2, .n_heads = 1, .n_layers = std::max<int64_t>(layer + 1, 1),
                  .drop_rate = 0.0, .qkv_bias = true, .tie_weights = false};
  DecoderConfig c = probe.decoder_config();
  for (const auto& p : c.layout())
    if (p.role() == role && p.layer == layer) return p.name;
  QKV_CHECK(false, std::string("the book's layout has no ") + role_name(role));
}
// The book's causal-mask buffer of a block: beside W_query in its attention module ("trf_blocks.3.att.mask").
std::string module_name(const std::string& parameter) { return parameter.substr(0, parameter.rfind('.') + 1); }
std::string book_mask_name(int64_t layer) {
  const std::string q = module_name(book_name(Role::Query, layer));  // "trf_blocks.3.att.W_query."
  return module_name(q.substr(0, q.size() - 1)) + "mask";
}

struct Preset {
  const char* name;
  int64_t emb_dim, n_layers, n_heads;
};
constexpr Preset kPresets[] = {
    {"gpt2-small", 768, 12, 12}, {"gpt2-medium", 1024, 24, 16}, {"gpt2-large", 1280, 36, 20}, {"gpt2-xl", 1600, 48, 25}};

// A Python dict literal, as pasted from a notebook, made into JSON: True/False/None, 'single quotes',
// # comments, trailing commas, and text before the first '{' (GPT_CONFIG_124M = {...}).
std::string pythonish_to_json(const std::string& text) {
  std::string out;
  size_t i = text.find('{');
  if (i == std::string::npos) return text;  // let the JSON parser say what is wrong
  const size_t n = text.size();
  while (i < n) {
    const char c = text[i];
    if (c == '"' || c == '\'') {  // a string: copied, re-quoted with "
      out += '"';
      for (++i; i < n && text[i] != c; ++i) {
        if (text[i] == '\\' && i + 1 < n) {
          out += text[i];
          out += text[++i];
        } else if (text[i] == '"') {
          out += "\\\"";
        } else {
          out += text[i];
        }
      }
      out += '"';
      ++i;
    } else if (c == '#') {
      while (i < n && text[i] != '\n') ++i;
    } else if (c == ',') {
      size_t j = i + 1;  // a trailing comma: only blanks and comments before } or ]
      while (j < n) {
        if (std::isspace(static_cast<unsigned char>(text[j]))) ++j;
        else if (text[j] == '#') while (j < n && text[j] != '\n') ++j;
        else break;
      }
      if (j >= n || (text[j] != '}' && text[j] != ']')) out += ',';
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < n && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_')) ++j;
      const std::string word = text.substr(i, j - i);
      out += word == "True" ? "true" : word == "False" ? "false" : word == "None" ? "null" : word;
      i = j;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

const Shape* find_shape(const std::vector<std::pair<std::string, Shape>>& shapes, const std::string& name) {
  for (const auto& [n, s] : shapes)
    if (n == name) return &s;
  return nullptr;
}

std::string names_sample(const std::vector<std::pair<std::string, Shape>>& shapes) {
  std::string s;
  for (size_t k = 0; k < shapes.size() && k < 6; ++k) s += (k ? ", " : "") + printable(shapes[k].first, 60);
  if (shapes.size() > 6) s += ", … (" + std::to_string(shapes.size()) + " in all)";
  return s.empty() ? "nothing" : s;
}

std::string tokenizer_for(const ConfigHint& hint, int64_t vocab_size) {
  if (!hint.tokenizer.empty()) return hint.tokenizer;
  return vocab_size == 256 ? "bytes" : "gpt2";
}

// Loads a book state dict (name → `read` into a parameter, on demand) into a new model, after checking every name
// and shape. One tensor at a time: nothing but the model (and one tensor's temporary) is held, and with `matrices`
// BF16 every matrix is bfloat16 from the start, so no float32 copy of the model is ever made.
std::unique_ptr<Decoder> build_book_model(const std::vector<std::pair<std::string, Shape>>& shapes,
                                              const std::function<void(const std::string&, Tensor&)>& read,
                                              const GPTConfig& config, const std::string& label, DType matrices) {
  std::string problems;
  const std::vector<std::pair<std::string, Shape>> wanted = config.parameter_shapes();
  for (const auto& [name, shape] : wanted) {
    const Shape* got = find_shape(shapes, name);
    if (!got) problems += "\n  missing " + name + " " + shape.str();
    else if (!(*got == shape)) problems += "\n  " + name + " is " + got->str() + ", the configuration needs " + shape.str();
  }
  if (!problems.empty()) fail(label, "does not fit the configuration " + config.to_strings().at("emb_dim") + " wide, " +
                                         std::to_string(config.n_layers) + " layers:" + problems);
  // Beyond the parameters, a file may hold only the book's causal masks (recomputed, so only their shape is checked).
  std::string unexpected;
  for (const auto& [name, shape] : shapes) {
    if (find_shape(wanted, name)) continue;
    bool mask = false;
    for (int64_t i = 0; i < config.n_layers && !mask; ++i) mask = name == book_mask_name(i);
    if (mask && shape == Shape{config.context_length, config.context_length}) continue;
    unexpected += (unexpected.empty() ? "" : ", ") + name + " " + shape.str();
  }
  if (!unexpected.empty()) fail(label, "holds tensors the book's GPTModel does not have: " + unexpected);
  auto model = Decoder::for_loading(config.decoder_config());
  model->for_each_parameter([&](const std::string& name, Tensor& p) {
    if (matrices == DType::BF16 && p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    read(name, p);
  });
  model->eval();
  return model;
}

// The book's configuration keys of a .pth written by qkv ("config"), as strings.
std::map<std::string, std::string> config_strings(const io::PyRef& ref) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : ref.items()) {
    const std::string key = k.as_string();
    if (v.is(io::PyKind::Bool)) out[key] = v.as_bool() ? "true" : "false";
    else if (v.is(io::PyKind::Int)) out[key] = std::to_string(v.as_int());
    else out[key] = format_real(v.as_number());
  }
  return out;
}

}  // namespace

const char* checkpoint_format_name(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::QkvCheckpoint: return "qkv checkpoint";
    case CheckpointFormat::Pth: return "PyTorch .pth";
    case CheckpointFormat::BookSafetensors: return "book-named safetensors";
    case CheckpointFormat::HuggingFaceGPT2: return "Hugging Face GPT-2 safetensors";
    case CheckpointFormat::HuggingFaceFolder: return "Hugging Face folder";
    case CheckpointFormat::Gguf: return "GGUF file";
  }
  return "?";
}

CheckpointFormat detect_checkpoint_format(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    if (is_hf_folder(path)) return CheckpointFormat::HuggingFaceFolder;
    fail(path, "a folder without config.json; a Hugging Face model folder holds config.json, the weights "
               "(model.safetensors or its shards) and tokenizer.json — download the whole folder");
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw IoError(path + ": cannot open: " + std::strerror(errno));
  unsigned char head[64] = {};
  const size_t n = std::fread(head, 1, sizeof head, f);
  std::fclose(f);
  if (n >= 4 && std::memcmp(head, "GGUF", 4) == 0) return CheckpointFormat::Gguf;  // llama.cpp's (gguf_model.hpp)
  // Text (a story, a config, a CSV given where a model belongs): printable UTF-8 from the first byte.
  bool text = n > 0;
  for (size_t i = 0; i < n && text; ++i) text = head[i] >= 0x20 || head[i] == '\n' || head[i] == '\r' || head[i] == '\t';
  if (text)
    fail(path, "a text file, not a model; give a qkv checkpoint, a .pth, a safetensors file or a Hugging Face folder");
  const bool safetensors = n >= 9 && head[8] == '{';  // a u64 header length, then the JSON header
  if (!safetensors && ((n >= 2 && head[0] == 'P' && head[1] == 'K') || (n >= 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5))) {
    return CheckpointFormat::Pth;  // the zip format, or the legacy pickle (refused with its own message)
  }
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (file.metadata().count("format") && file.metadata().at("format").rfind("qkv-gpt-checkpoint", 0) == 0) {
    return CheckpointFormat::QkvCheckpoint;
  }
  if (file.contains(book_name(Role::TokenEmbedding))) return CheckpointFormat::BookSafetensors;
  if (file.contains("wte.weight") || file.contains("transformer.wte.weight")) return CheckpointFormat::HuggingFaceGPT2;
  std::string names;
  for (size_t k = 0; k < file.tensors().size() && k < 5; ++k) names += (k ? ", " : "") + printable(file.tensors()[k].name, 60);
  throw IoError(path + ": a safetensors file, but not a GPT model qkv knows: no qkv checkpoint tag, no tok_emb.weight "
                "(the book's names) and no wte.weight (Hugging Face GPT-2); it holds " + (names.empty() ? "no tensors" : names));
}

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const Preset& p : kPresets) v.emplace_back(p.name);
    return v;
  }();
  return names;
}

std::map<std::string, std::string> read_config_hint(const std::string& preset_or_path) {
  for (const Preset& p : kPresets) {
    if (preset_or_path == p.name) {
      return {{"emb_dim", std::to_string(p.emb_dim)}, {"n_layers", std::to_string(p.n_layers)}, {"n_heads", std::to_string(p.n_heads)}};
    }
  }
  std::string text;
  {
    std::FILE* f = std::fopen(preset_or_path.c_str(), "rb");
    if (!f) {
      std::string presets;
      for (const Preset& p : kPresets) presets += std::string(presets.empty() ? "" : ", ") + p.name;
      throw ValueError("--config " + printable(preset_or_path) + ": neither a preset (" + presets +
                       ") nor a readable file (" + std::strerror(errno) + ")");
    }
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && text.size() < (1u << 20)) text.append(buf, n);
    std::fclose(f);
  }
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(pythonish_to_json(text));
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(preset_or_path + ": not a configuration dict (JSON, or a Python dict literal): " + e.what());
  }
  if (!json.is_object()) throw ValueError(preset_or_path + ": the configuration must be a dict like the book's GPT_CONFIG_124M");
  std::set<std::string> known;
  for (const auto& s : gpt_config_schema()) known.insert(s.key);
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : json.items()) {
    if (!known.count(key)) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw ValueError(preset_or_path + ": unknown configuration key \"" + printable(key) + "\"; the keys are " + list);
    }
    if (value.is_boolean()) out[key] = value.get<bool>() ? "true" : "false";
    else if (value.is_number_integer()) out[key] = std::to_string(value.get<int64_t>());
    else if (value.is_number()) out[key] = format_real(value.get<double>());
    else throw ValueError(preset_or_path + ": \"" + key + "\" must be a number or True/False, not " + value.dump());
  }
  return out;
}

GPTConfig resolve_book_config(const std::vector<std::pair<std::string, Shape>>& shapes, const ConfigHint& hint,
                                  const std::string& label) {
  const std::string tok_name = book_name(Role::TokenEmbedding), pos_name = book_name(Role::PositionEmbedding);
  const Shape* tok = find_shape(shapes, tok_name);
  const Shape* pos = find_shape(shapes, pos_name);
  if (!tok || !pos || tok->rank() != 2 || pos->rank() != 2) {
    fail(label, "not the book's GPTModel state dict: it needs " + tok_name + " and " + pos_name + " (2-D); it holds " +
                    names_sample(shapes));
  }
  // What the shapes say.
  std::map<std::string, std::string> inferred;
  inferred["vocab_size"] = std::to_string((*tok)[0]);
  inferred["emb_dim"] = std::to_string((*tok)[1]);
  inferred["context_length"] = std::to_string((*pos)[0]);
  int64_t layers = 0;
  while (layers < 65536 && find_shape(shapes, book_name(Role::Query, layers))) ++layers;
  inferred["n_layers"] = std::to_string(layers);
  inferred["qkv_bias"] = find_shape(shapes, book_name(Role::QueryBias, 0)) ? "true" : "false";
  inferred["tie_weights"] = find_shape(shapes, book_name(Role::Head)) ? "false" : "true";
  const std::map<std::string, const char*> evidence = {
      {"vocab_size", "tok_emb.weight's rows"}, {"emb_dim", "tok_emb.weight's columns"},
      {"context_length", "pos_emb.weight's rows"}, {"n_layers", "the trf_blocks.N in the file"},
      {"qkv_bias", "whether W_query.bias is in the file"}, {"tie_weights", "whether out_head.weight is in the file"}};
  // What the user said.
  std::map<std::string, std::string> given = hint.config.empty() ? std::map<std::string, std::string>{} : read_config_hint(hint.config);
  if (hint.n_heads > 0) {
    if (given.count("n_heads") && given["n_heads"] != std::to_string(hint.n_heads)) {
      throw ValueError("--n-heads " + std::to_string(hint.n_heads) + " contradicts --config " + hint.config + " (n_heads " +
                       given["n_heads"] + ")");
    }
    given["n_heads"] = std::to_string(hint.n_heads);
  }
  std::map<std::string, std::string> values = inferred;
  values["drop_rate"] = "0.1";  // the book's; it matters only for training
  for (const auto& entry : given) {
    const std::string& key = entry.first;
    const std::string& value = entry.second;
    auto it = inferred.find(key);
    if (it != inferred.end()) {
      GPTConfig a, b;  // compare parsed values, so 1e3 equals 1000
      const auto& setting = *std::find_if(gpt_config_schema().begin(), gpt_config_schema().end(),
                                          [&](const auto& s) { return key == s.key; });
      setting.set(a, value);
      setting.set(b, it->second);
      if (setting.get(a) != setting.get(b)) {
        fail(label, "the configuration (" + hint.config + ") says " + key + " = " + value + ", but the file says " +
                        it->second + " (" + evidence.at(key) + "); use the configuration the model was trained with");
      }
    }
    values[key] = value;
  }
  if (!values.count("n_heads")) {
    std::string suggestion;
    for (const Preset& p : kPresets) {
      if (std::to_string(p.emb_dim) == inferred["emb_dim"] && std::to_string(p.n_layers) == inferred["n_layers"]) {
        suggestion = " The shapes match " + std::string(p.name) + " (" + std::to_string(p.n_heads) + " heads): add --config " + p.name + ".";
      }
    }
    fail(label, "the number of attention heads cannot be read off the tensors (emb_dim " + inferred["emb_dim"] + ", " +
                    inferred["n_layers"] + " layers); add --n-heads N, or --config FILE.json with the book's "
                    "configuration dict, or --config gpt2-small|gpt2-medium|gpt2-large|gpt2-xl." + suggestion);
  }
  try {
    return GPTConfig::from_strings(values);
  } catch (const ValueError& e) {
    fail(label, e.what());
  }
}

namespace {

// A chapter-6 classifier keeps the book's names but its out_head has `classes` rows, not the vocabulary's: its head
// goes to the CheckpointModel and the rest is read as a model whose head is tied (none of its own).
void split_classifier_head(std::vector<std::pair<std::string, Shape>>& shapes, CheckpointModel& out,
                           const std::function<Tensor(const std::string&)>& tensor) {
  const std::string head_name = book_name(Role::Head), bias_name = module_name(head_name) + "bias";
  const Shape* emb = find_shape(shapes, book_name(Role::TokenEmbedding));
  const Shape* head = find_shape(shapes, head_name);
  if (!emb || !head || emb->rank() != 2 || head->rank() != 2 || (*head)[0] == (*emb)[0]) return;
  out.classifier_weight = tensor(head_name);
  if (find_shape(shapes, bias_name)) out.classifier_bias = tensor(bias_name);
  std::erase_if(shapes, [&](const auto& e) { return e.first == head_name || e.first == bias_name; });
}

}  // namespace

namespace {

// The book's configuration keys among a qkv file's settings strings (its training settings hold them by name).
GPTConfig model_config_of(const std::map<std::string, std::string>& settings, const std::string& label) {
  std::map<std::string, std::string> values;
  for (const auto& s : gpt_config_schema())
    if (auto it = settings.find(s.key); it != settings.end()) values[s.key] = it->second;
  try {
    return GPTConfig::from_strings(values);
  } catch (const ValueError& e) {
    fail(label, e.what());
  }
}

// A qkv training checkpoint's model: its settings in __metadata__, the weights under "model.".
void open_qkv_checkpoint(const std::string& path, CheckpointModel& out, DType matrices) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (!file.metadata().count("format") || file.metadata().at("format") != kQkvCheckpointFormat)
    fail(path, std::string("not a qkv training checkpoint (its __metadata__ has no format \"") + kQkvCheckpointFormat + "\")");
  out.settings = file.metadata();
  const GPTConfig config = model_config_of(out.settings, path);
  // Every tensor the configuration implies, with its shape, before anything is allocated: a small file cannot make
  // qkv build a huge model from its metadata alone.
  for (const auto& [name, shape] : config.parameter_shapes()) {
    const io::TensorInfo* info = file.find("model." + name);
    if (!info) fail(path, "missing tensor model." + name + "; the checkpoint is incomplete or not from qkv train");
    if (!(Shape(std::span<const int64_t>(info->shape)) == shape))
      fail(path, "model." + name + " has shape " + Shape(std::span<const int64_t>(info->shape)).str() +
                     ", but the checkpoint's own settings need " + shape.str());
  }
  out.model = Decoder::for_loading(config.decoder_config());  // every parameter is read below
  out.model->for_each_parameter([&](const std::string& name, Tensor& p) {
    if (matrices == DType::BF16 && p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    file.read_weights("model." + name, p);  // straight into the parameter, bf16 rounded where it is one
  });
  const auto tokenizer = out.settings.find("tokenizer");
  out.tokenizer = tokenizer != out.settings.end() ? tokenizer->second : "gpt2";
}

}  // namespace

CheckpointModel open_checkpoint(const std::string& path, const ConfigHint& hint, DType matrices,
                                std::shared_ptr<const io::GgufFile> gguf) {
  CheckpointModel out;
  out.format = gguf ? CheckpointFormat::Gguf : detect_checkpoint_format(path);
  out.description = std::string(checkpoint_format_name(out.format)) + " " + path;
  switch (out.format) {
    case CheckpointFormat::HuggingFaceFolder:
      out.model = load_hf_decoder(path, matrices);
      if (out.model->is_classifier()) {  // *ForSequenceClassification: score.weight is its head
        out.classifier_weight = out.model->head;
        out.labels = out.model->config.labels;
      }
      out.description = out.model->config.family->name + (out.model->is_classifier() ? " classifier folder " : " folder ") + path;
      break;
    case CheckpointFormat::Gguf:  // the weights mapped as stored (a bf16 `matrices` changes nothing: none is float32
                                  // unless the file's is)
      out.model = gguf ? load_gguf_decoder(std::move(gguf)) : load_gguf_decoder(path);
      out.tokenizer = "gguf";  // its own, from tokenizer.ggml.* (load_pretrained)
      out.description = out.model->config.family->name + " GGUF " + path;
      break;
    case CheckpointFormat::QkvCheckpoint:
      open_qkv_checkpoint(path, out, matrices);
      if (!hint.tokenizer.empty()) out.tokenizer = hint.tokenizer;
      out.description = "checkpoint " + path;
      break;
    case CheckpointFormat::HuggingFaceGPT2:
      out.model = load_gpt2(path, matrices);
      out.tokenizer = hint.tokenizer.empty() ? "gpt2" : hint.tokenizer;
      out.description = "GPT-2 weights " + path;
      break;
    case CheckpointFormat::BookSafetensors: {
      const io::SafetensorsFile file = io::SafetensorsFile::open(path);
      std::vector<std::pair<std::string, Shape>> shapes;
      for (const auto& info : file.tensors()) {
        if (info.shape.size() > static_cast<size_t>(kMaxRank)) fail(path, info.name + " has too many dimensions");
        shapes.emplace_back(info.name, Shape(std::span<const int64_t>(info.shape)));
      }
      split_classifier_head(shapes, out, [&](const std::string& name) { return file.weights(name); });
      const GPTConfig config = resolve_book_config(shapes, hint, path);
      out.model = build_book_model(shapes, [&](const std::string& name, Tensor& p) { file.read_weights(name, p); }, config,
                                   path, matrices);
      out.tokenizer = tokenizer_for(hint, config.vocab_size);
      break;
    }
    case CheckpointFormat::Pth: {
      const io::PthFile file = io::PthFile::open(path);
      const io::PyRef root = file.root();
      if (!root.is(io::PyKind::Dict)) fail(path, "holds " + root.describe() + ", not a state dict");
      std::optional<io::PyRef> sd;
      if (root.get(book_name(Role::TokenEmbedding))) sd = root;
      for (const char* key : {"model_state_dict", "state_dict", "model"})
        if (!sd)
          if (auto v = root.get(key); v && v->is(io::PyKind::Dict)) sd = *v;
      if (!sd) {
        fail(path, "holds " + root.describe() + "; qkv expects the book's GPTModel state dict (torch.save(model.state_dict())) "
                   "or {\"model_state_dict\": …, \"optimizer_state_dict\": …}");
      }
      std::vector<std::pair<std::string, Shape>> shapes;
      std::map<std::string, io::PyRef> refs;
      for (const auto& [k, v] : sd->items()) {
        const std::string name = k.as_string();
        const io::PthTensor& t = v.as_tensor();
        if (t.shape.size() > static_cast<size_t>(kMaxRank)) fail(path, name + " has too many dimensions");
        shapes.emplace_back(name, Shape(std::span<const int64_t>(t.shape)));
        refs.emplace(name, v);
      }
      split_classifier_head(shapes, out, [&](const std::string& name) { return file.weights(refs.at(name)); });
      ConfigHint effective = hint;
      if (auto qs = root.get("qkv_settings")) {  // written by qkv: its settings whole
        for (const auto& [k, v] : qs->items()) out.settings[k.as_string()] = v.as_string();
        if (effective.tokenizer.empty() && out.settings.count("tokenizer")) effective.tokenizer = out.settings.at("tokenizer");
      }
      GPTConfig config;
      if (!out.settings.empty() && hint.config.empty() && hint.n_heads == 0) {
        config = model_config_of(out.settings, path + " qkv_settings");
      } else if (auto c = root.get("config"); c && hint.config.empty() && hint.n_heads == 0) {
        std::map<std::string, std::string> values = config_strings(*c);
        config = resolve_book_config(shapes, {"", values.count("n_heads") ? parse_int(values["n_heads"], "n_heads") : 0, ""}, path);
      } else {
        config = resolve_book_config(shapes, effective, path);
      }
      out.model = build_book_model(shapes, [&](const std::string& name, Tensor& p) { file.read_weights(refs.at(name), p); },
                                   config, path, matrices);
      out.tokenizer = tokenizer_for(effective, config.vocab_size);
      break;
    }
  }
  out.model->eval();
  return out;
}

}  // namespace qkv::nn
