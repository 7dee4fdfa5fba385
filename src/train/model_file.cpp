// Model files by content: qkv checkpoints, .pth, book-named safetensors, Hugging Face GPT-2 (see
// qkv/train/model_file.hpp).
#include "qkv/train/model_file.hpp"

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/core/random.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::train {

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& problem) { throw IoError(label + ": " + problem); }

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
std::unique_ptr<nn::Decoder> build_book_model(const std::vector<std::pair<std::string, Shape>>& shapes,
                                              const std::function<void(const std::string&, Tensor&)>& read,
                                              const nn::GPTConfig& config, const std::string& label, DType matrices) {
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
    const bool mask = name.size() > 9 && name.rfind("trf_blocks.", 0) == 0 && name.substr(name.size() - 9) == ".att.mask";
    if (mask && shape == Shape{config.context_length, config.context_length}) continue;
    unexpected += (unexpected.empty() ? "" : ", ") + name + " " + shape.str();
  }
  if (!unexpected.empty()) fail(label, "holds tensors the book's GPTModel does not have: " + unexpected);
  auto model = nn::Decoder::for_loading(config.decoder_config());
  model->for_each_parameter([&](const std::string& name, Tensor& p) {
    if (matrices == DType::BF16 && p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    read(name, p);
  });
  model->eval();
  return model;
}

TorchAdamW read_torch_adamw(const io::PthFile& file, const io::PyRef& ref, nn::Decoder& model) {
  const std::string& label = file.path();
  auto need = [&](const io::PyRef& r, const char* key) {
    auto v = r.get(key);
    if (!v) fail(label, (r.where().empty() ? std::string("the optimizer state") : r.where()) + " has no \"" + key + "\"");
    return *v;
  };
  TorchAdamW out;
  const io::PyRef groups = need(ref, "param_groups");
  if (groups.size() != 1) {
    fail(label, "the optimizer has " + std::to_string(groups.size()) + " parameter groups; qkv's AdamW takes one (all "
                "parameters with one learning rate and weight decay, as the book's)");
  }
  const io::PyRef g = groups[0];
  out.options.lr = need(g, "lr").as_number();
  const io::PyRef betas = need(g, "betas");
  out.options.beta1 = betas[0].as_number();
  out.options.beta2 = betas[1].as_number();
  out.options.eps = need(g, "eps").as_number();
  out.options.weight_decay = need(g, "weight_decay").as_number();
  for (const char* flag : {"amsgrad", "maximize"}) {
    if (auto v = g.get(flag); v && v->is(io::PyKind::Bool) && v->as_bool()) {
      fail(label, std::string("the optimizer uses ") + flag + "=True, which qkv's AdamW does not implement");
    }
  }
  const auto parameters = model.named_parameters();
  const io::PyRef params = need(g, "params");
  if (params.size() != parameters.size()) {
    fail(label, "the optimizer holds " + std::to_string(params.size()) + " parameters but the model has " +
                    std::to_string(parameters.size()) + "; it belongs to another model");
  }
  const io::PyRef state = need(ref, "state");
  size_t with_state = 0;
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (params[i].as_int() != static_cast<int64_t>(i)) fail(label, "the optimizer's parameters are not in the model's order");
    if (state.get(static_cast<int64_t>(i))) ++with_state;
  }
  if (with_state != 0 && with_state != parameters.size()) {
    fail(label, "the optimizer has state for " + std::to_string(with_state) + " of " + std::to_string(parameters.size()) +
                    " parameters; qkv resumes only when every parameter has been stepped");
  }
  for (size_t i = 0; i < parameters.size() && with_state; ++i) {
    const auto& [name, p] = parameters[i];
    const io::PyRef s = *state.get(static_cast<int64_t>(i));
    const io::PyRef step_ref = need(s, "step");
    const int64_t step = step_ref.is(io::PyKind::Tensor) ? file.int64s(step_ref).at(0) : step_ref.as_int();
    if (i == 0) out.step = step;
    else if (step != out.step) fail(label, "the optimizer's parameters were stepped different numbers of times");
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      Tensor t = file.weights(need(s, key));
      if (!(t.shape() == p.shape())) {
        fail(label, "optimizer state " + std::to_string(i) + " " + key + " is " + t.shape().str() + ", but parameter " +
                        std::to_string(i) + " (" + name + ") is " + p.shape().str() + "; it belongs to another model");
      }
      (std::string(key) == "exp_avg" ? out.exp_avg : out.exp_avg_sq)[name] = std::move(t);
    }
  }
  if (out.step < 0) fail(label, "the optimizer's step is negative");
  return out;
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

io::PyValue state_dict_value(nn::Decoder& model) {
  io::PyValue sd = io::PyValue::dict(/*ordered=*/true);
  const nn::StateDict state = model.state_dict(/*with_derived=*/true);
  for (const auto& [name, t] : state.entries()) sd.set(io::PyValue::of(name), io::PyValue::of(io::TensorData::from_tensor("", t)));
  // A tied model still gives the book's GPTModel its out_head.weight (a copy of tok_emb.weight).
  if (!state.find("out_head.weight")) {
    sd.set(io::PyValue::of("out_head.weight"), io::PyValue::of(io::TensorData::from_tensor("", model.tok_emb)));
  }
  return sd;
}

}  // namespace

const Tensor* TorchAdamW::state(const std::string& name) const {
  for (const auto& [prefix, moments] : {std::pair{std::string("exp_avg."), &exp_avg}, std::pair{std::string("exp_avg_sq."), &exp_avg_sq}}) {
    if (name.rfind(prefix, 0) == 0) {
      auto it = moments->find(name.substr(prefix.size()));
      return it == moments->end() ? nullptr : &it->second;
    }
  }
  return nullptr;
}

const char* model_format_name(ModelFormat format) {
  switch (format) {
    case ModelFormat::QkvCheckpoint: return "qkv checkpoint";
    case ModelFormat::Pth: return "PyTorch .pth";
    case ModelFormat::BookSafetensors: return "book-named safetensors";
    case ModelFormat::HuggingFaceGPT2: return "Hugging Face GPT-2 safetensors";
  }
  return "?";
}

ModelFormat detect_model_format(const std::string& path) {
  // What is not a model file at all is named for what it is (a folder without config.json, text, GGUF …).
  const io::FileFormat what = io::sniff_format(path);
  switch (what.kind) {
    case io::FileKind::Directory:
      throw IoError(path + ": is " + what.description + ", but no config.json: a Hugging Face model folder holds "
                    "config.json beside its *.safetensors and tokenizer.json");
    case io::FileKind::Gguf:
      throw IoError(path + ": is " + what.description + ", which qkv does not read yet; give the model's Hugging Face "
                    "folder (config.json, *.safetensors, tokenizer.json)");
    case io::FileKind::Empty: case io::FileKind::Text: case io::FileKind::Json: case io::FileKind::Npy:
    case io::FileKind::Gzip:
      throw IoError(path + ": is " + what.description + ", not a model: give a qkv checkpoint, a PyTorch .pth, a "
                    "safetensors file or a Hugging Face model folder");
    default:
      break;  // a model file, or a file to open and report on
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw IoError(path + ": cannot open: " + std::strerror(errno));
  unsigned char head[9] = {};
  const size_t n = std::fread(head, 1, sizeof head, f);
  std::fclose(f);
  const bool safetensors = n == 9 && head[8] == '{';  // a u64 header length, then the JSON header
  if (!safetensors && ((n >= 2 && head[0] == 'P' && head[1] == 'K') || (n >= 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5))) {
    return ModelFormat::Pth;  // the zip format, or the legacy pickle (refused with its own message)
  }
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (file.metadata().count("format") && file.metadata().at("format").rfind("qkv-gpt-checkpoint", 0) == 0) {
    return ModelFormat::QkvCheckpoint;
  }
  if (file.contains("tok_emb.weight")) return ModelFormat::BookSafetensors;
  if (file.contains("wte.weight") || file.contains("transformer.wte.weight")) return ModelFormat::HuggingFaceGPT2;
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
  for (const auto& s : nn::gpt_config_schema()) known.insert(s.key);
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

nn::GPTConfig resolve_book_config(const std::vector<std::pair<std::string, Shape>>& shapes, const ConfigHint& hint,
                                  const std::string& label) {
  const Shape* tok = find_shape(shapes, "tok_emb.weight");
  const Shape* pos = find_shape(shapes, "pos_emb.weight");
  if (!tok || !pos || tok->rank() != 2 || pos->rank() != 2) {
    fail(label, "not the book's GPTModel state dict: it needs tok_emb.weight and pos_emb.weight (2-D); it holds " +
                    names_sample(shapes));
  }
  // What the shapes say.
  std::map<std::string, std::string> inferred;
  inferred["vocab_size"] = std::to_string((*tok)[0]);
  inferred["emb_dim"] = std::to_string((*tok)[1]);
  inferred["context_length"] = std::to_string((*pos)[0]);
  int64_t layers = 0;
  while (find_shape(shapes, "trf_blocks." + std::to_string(layers) + ".att.W_query.weight")) ++layers;
  inferred["n_layers"] = std::to_string(layers);
  inferred["qkv_bias"] = find_shape(shapes, "trf_blocks.0.att.W_query.bias") ? "true" : "false";
  inferred["tie_weights"] = find_shape(shapes, "out_head.weight") ? "false" : "true";
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
      nn::GPTConfig a, b;  // compare parsed values, so 1e3 equals 1000
      const auto& setting = *std::find_if(nn::gpt_config_schema().begin(), nn::gpt_config_schema().end(),
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
    return nn::GPTConfig::from_strings(values);
  } catch (const ValueError& e) {
    fail(label, e.what());
  }
}

namespace {

// A chapter-6 classifier keeps the book's names but its out_head has `classes` rows, not the vocabulary's: its head
// goes to the ModelFile and the rest is read as a model whose head is tied (none of its own).
void split_classifier_head(std::vector<std::pair<std::string, Shape>>& shapes, ModelFile& out,
                           const std::function<Tensor(const std::string&)>& tensor) {
  const Shape* emb = find_shape(shapes, "tok_emb.weight");
  const Shape* head = find_shape(shapes, "out_head.weight");
  if (!emb || !head || emb->rank() != 2 || head->rank() != 2 || (*head)[0] == (*emb)[0]) return;
  out.classifier_weight = tensor("out_head.weight");
  if (find_shape(shapes, "out_head.bias")) out.classifier_bias = tensor("out_head.bias");
  std::erase_if(shapes, [](const auto& e) { return e.first == "out_head.weight" || e.first == "out_head.bias"; });
}

}  // namespace

ModelFile load_model_file(const std::string& path, const ConfigHint& hint, DType matrices) {
  ModelFile out;
  out.format = detect_model_format(path);
  out.description = std::string(model_format_name(out.format)) + " " + path;
  switch (out.format) {
    case ModelFormat::QkvCheckpoint: {
      TrainSettings settings;
      out.model = load_checkpoint_model(path, &settings, matrices);
      out.tokenizer = hint.tokenizer.empty() ? settings.tokenizer : hint.tokenizer;
      out.settings = settings;
      out.description = "checkpoint " + path;
      break;
    }
    case ModelFormat::HuggingFaceGPT2:
      out.model = nn::load_gpt2(path, matrices);
      out.tokenizer = hint.tokenizer.empty() ? "gpt2" : hint.tokenizer;
      out.description = "GPT-2 weights " + path;
      break;
    case ModelFormat::BookSafetensors: {
      const io::SafetensorsFile file = io::SafetensorsFile::open(path);
      std::vector<std::pair<std::string, Shape>> shapes;
      for (const auto& info : file.tensors()) {
        if (info.shape.size() > static_cast<size_t>(kMaxRank)) fail(path, info.name + " has too many dimensions");
        shapes.emplace_back(info.name, Shape(std::span<const int64_t>(info.shape)));
      }
      split_classifier_head(shapes, out, [&](const std::string& name) { return file.weights(name); });
      const nn::GPTConfig config = resolve_book_config(shapes, hint, path);
      out.model = build_book_model(shapes, [&](const std::string& name, Tensor& p) { file.read_weights(name, p); }, config,
                                   path, matrices);
      out.tokenizer = tokenizer_for(hint, config.vocab_size);
      break;
    }
    case ModelFormat::Pth: {
      const io::PthFile file = io::PthFile::open(path);
      const io::PyRef root = file.root();
      if (!root.is(io::PyKind::Dict)) fail(path, "holds " + root.describe() + ", not a state dict");
      std::optional<io::PyRef> sd;
      if (root.get("tok_emb.weight")) sd = root;
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
        std::map<std::string, std::string> strings;
        for (const auto& [k, v] : qs->items()) strings[k.as_string()] = v.as_string();
        try {
          out.settings = TrainSettings::from_strings(strings);
        } catch (const ValueError& e) {
          fail(path, std::string("qkv_settings: ") + e.what());
        }
        if (effective.tokenizer.empty()) effective.tokenizer = out.settings->tokenizer;
      }
      nn::GPTConfig config;
      if (out.settings && hint.config.empty() && hint.n_heads == 0) {
        config = out.settings->model;
      } else if (auto c = root.get("config"); c && hint.config.empty() && hint.n_heads == 0) {
        std::map<std::string, std::string> values = config_strings(*c);
        config = resolve_book_config(shapes, {"", values.count("n_heads") ? parse_int(values["n_heads"], "n_heads") : 0, ""}, path);
      } else {
        config = resolve_book_config(shapes, effective, path);
      }
      out.model = build_book_model(shapes, [&](const std::string& name, Tensor& p) { file.read_weights(refs.at(name), p); },
                                   config, path, matrices);
      if (auto opt = root.get("optimizer_state_dict")) out.optimizer = read_torch_adamw(file, *opt, *out.model);
      if (auto rng = root.get("qkv_rng_state")) {
        const std::vector<int64_t> words = file.int64s(*rng);
        out.rng_state.assign(words.begin(), words.end());
      }
      out.tokenizer = tokenizer_for(effective, config.vocab_size);
      break;
    }
  }
  out.model->eval();
  return out;
}

void save_book_pth(const std::string& path, nn::Decoder& model) { io::save_pth(path, state_dict_value(model)); }

void save_state_dict_pth(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& state) {
  io::PyValue sd = io::PyValue::dict(/*ordered=*/true);
  for (const auto& [name, t] : state) sd.set(io::PyValue::of(name), io::PyValue::of(io::TensorData::from_tensor("", t)));
  io::save_pth(path, sd);
}

void save_book_pth_with_optimizer(const std::string& path, nn::Decoder& model, const TorchAdamW& optimizer,
                                  const TrainSettings& settings, const std::vector<uint64_t>& rng_state) {
  io::PyValue root = io::PyValue::dict();
  root.set(io::PyValue::of("model_state_dict"), state_dict_value(model));
  io::PyValue opt = io::PyValue::dict();
  io::PyValue& state = opt.set(io::PyValue::of("state"), io::PyValue::dict());
  std::vector<io::PyValue> indices;
  const auto parameters = model.named_parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    const std::string& name = parameters[i].first;
    indices.push_back(io::PyValue::of(static_cast<int64_t>(i)));
    if (!optimizer.exp_avg.count(name)) continue;
    io::PyValue& s = state.set(io::PyValue::of(static_cast<int64_t>(i)), io::PyValue::dict());
    // PyTorch 1.13 keeps AdamW's step as a float32 scalar tensor.
    s.set(io::PyValue::of("step"), io::PyValue::of(io::TensorData::from_tensor("", Tensor::scalar(static_cast<float>(optimizer.step)))));
    s.set(io::PyValue::of("exp_avg"), io::PyValue::of(io::TensorData::from_tensor("", optimizer.exp_avg.at(name))));
    s.set(io::PyValue::of("exp_avg_sq"), io::PyValue::of(io::TensorData::from_tensor("", optimizer.exp_avg_sq.at(name))));
  }
  io::PyValue group = io::PyValue::dict();
  group.set(io::PyValue::of("lr"), io::PyValue::of(optimizer.options.lr));
  group.set(io::PyValue::of("betas"), io::PyValue::tuple({io::PyValue::of(optimizer.options.beta1), io::PyValue::of(optimizer.options.beta2)}));
  group.set(io::PyValue::of("eps"), io::PyValue::of(optimizer.options.eps));
  group.set(io::PyValue::of("weight_decay"), io::PyValue::of(optimizer.options.weight_decay));
  group.set(io::PyValue::of("amsgrad"), io::PyValue::of(false));
  group.set(io::PyValue::of("foreach"), io::PyValue::none());
  group.set(io::PyValue::of("maximize"), io::PyValue::of(false));
  group.set(io::PyValue::of("capturable"), io::PyValue::of(false));
  group.set(io::PyValue::of("params"), io::PyValue::list(std::move(indices)));
  opt.set(io::PyValue::of("param_groups"), io::PyValue::list({std::move(group)}));
  root.set(io::PyValue::of("optimizer_state_dict"), std::move(opt));
  io::PyValue config = io::PyValue::dict();
  const nn::GPTConfig c = nn::GPTConfig::of(model.config);
  for (const auto& [key, value] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"vocab_size", c.vocab_size}, {"context_length", c.context_length}, {"emb_dim", c.emb_dim},
           {"n_heads", c.n_heads}, {"n_layers", c.n_layers}}) {
    config.set(io::PyValue::of(key), io::PyValue::of(value));
  }
  config.set(io::PyValue::of("drop_rate"), io::PyValue::of(c.drop_rate));
  config.set(io::PyValue::of("qkv_bias"), io::PyValue::of(c.qkv_bias));
  root.set(io::PyValue::of("config"), std::move(config));
  io::PyValue strings = io::PyValue::dict();
  for (const auto& [k, v] : settings.to_strings()) strings.set(io::PyValue::of(k), io::PyValue::of(v));
  root.set(io::PyValue::of("qkv_settings"), std::move(strings));
  if (!rng_state.empty()) {
    const std::vector<int64_t> words(rng_state.begin(), rng_state.end());
    root.set(io::PyValue::of("qkv_rng_state"), io::PyValue::of(io::TensorData::from_int64s("", words)));
  }
  io::save_pth(path, root);
}

void save_book_safetensors(const std::string& path, nn::Decoder& model) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  const nn::StateDict state = model.state_dict(/*with_derived=*/true);
  for (const auto& [name, t] : state.entries()) tensors.emplace_back(name, t);
  if (!state.find("out_head.weight")) tensors.emplace_back("out_head.weight", model.tok_emb);
  io::save_safetensors(path, tensors, {{"format", "pt"}});
}

TorchAdamW read_checkpoint_optimizer(const std::string& path, nn::Decoder& model, const TrainSettings& settings,
                                     std::vector<uint64_t>* rng_state) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  check_checkpoint(path, settings);
  TorchAdamW out;
  out.step = parse_int(file.metadata().count("step") ? file.metadata().at("step") : "", path + ": step");
  out.options.lr = learning_rate_at(settings, out.step);
  out.options.weight_decay = settings.weight_decay;
  out.options.beta1 = settings.adam_beta1;
  out.options.beta2 = settings.adam_beta2;
  out.options.eps = settings.adam_eps;
  for (const auto& [name, p] : model.named_parameters()) {
    out.exp_avg[name] = file.weights("optimizer.exp_avg." + name);
    out.exp_avg_sq[name] = file.weights("optimizer.exp_avg_sq." + name);
  }
  if (rng_state) {
    const std::vector<int64_t> words = file.int64s("rng.state");
    rng_state->assign(words.begin(), words.end());
  }
  return out;
}

TrainSettings settings_for(const ModelFile& file, TrainSettings base) {
  if (file.settings) return *file.settings;
  base.model = nn::GPTConfig::of(file.model->config);
  base.tokenizer = file.tokenizer;
  if (file.optimizer) {
    const optim::AdamWOptions& o = file.optimizer->options;
    base.learning_rate = base.min_learning_rate = o.lr;
    base.warmup_steps = 0;
    base.grad_clip = 0;
    base.weight_decay = o.weight_decay;
    base.adam_beta1 = o.beta1;
    base.adam_beta2 = o.beta2;
    base.adam_eps = o.eps;
    base.max_steps += file.optimizer->step;
  }
  return base;
}

ModelFormat output_format(const std::string& to, const std::string& output) {
  if (to == "pth") return ModelFormat::Pth;
  if (to == "safetensors") return ModelFormat::BookSafetensors;
  if (to == "checkpoint") return ModelFormat::QkvCheckpoint;
  if (to == "gpt2") return ModelFormat::HuggingFaceGPT2;
  if (!to.empty()) throw ValueError("--to " + printable(to) + ": choose pth, safetensors, checkpoint or gpt2");
  auto ends = [&](const char* ext) {
    const size_t n = std::strlen(ext);
    return output.size() >= n && output.compare(output.size() - n, n, ext) == 0;
  };
  return ends(".pth") || ends(".pt") ? ModelFormat::Pth : ModelFormat::BookSafetensors;
}

Conversion convert_model_file(const std::string& input, const std::string& output, ModelFormat to, const ConfigHint& hint,
                              bool weights_only) {
  ModelFile source = load_model_file(input, hint);
  if (source.classifier_weight.defined()) {
    throw ValueError(input + " is a fine-tuned classifier (its out_head has " + std::to_string(source.classifier_weight.size(0)) +
                     " classes); the formats qkv converts to hold a language model's head, so it would be lost. Its "
                     "model.pth already is the book's format");
  }
  if (source.format == ModelFormat::QkvCheckpoint) {  // its optimizer and generator travel too
    source.optimizer = read_checkpoint_optimizer(input, *source.model, *source.settings, &source.rng_state);
  }
  Conversion c;
  c.from = source.format;
  c.to = to;
  const bool optimizer = source.optimizer.has_value() && !weights_only;
  if (optimizer && (to == ModelFormat::BookSafetensors || to == ModelFormat::HuggingFaceGPT2)) {
    throw ValueError(std::string(model_format_name(to)) + " holds weights only, and " + input + " also has AdamW's state at step " +
                     std::to_string(source.optimizer->step) + ", which would be lost; write a .pth (--to pth) or a qkv "
                     "checkpoint to keep it, or add --weights-only to drop it");
  }
  nn::Decoder& model = *source.model;
  const nn::GPTConfig config = nn::GPTConfig::of(model.config);
  switch (to) {
    case ModelFormat::Pth:
      if (optimizer) {
        save_book_pth_with_optimizer(output, model, *source.optimizer, settings_for(source), source.rng_state);
        c.with_optimizer = true;
      } else {
        save_book_pth(output, model);
      }
      break;
    case ModelFormat::BookSafetensors: save_book_safetensors(output, model); break;
    case ModelFormat::HuggingFaceGPT2:
      nn::save_gpt2(output, model);
      if (!config.qkv_bias) c.note = "the model has no Q/K/V biases; GPT-2's layout gets zero biases (the same function)";
      break;
    case ModelFormat::QkvCheckpoint: {
      const TrainSettings settings = settings_for(source);
      std::vector<uint64_t> rng = source.rng_state.empty() ? Generator(settings.seed).state() : source.rng_state;
      const bool moments = optimizer;
      write_checkpoint(output, model,
                       [&](const auto& fn) {
                         for (auto& [name, p] : model.named_parameters()) {
                           for (const char* kind : {"exp_avg.", "exp_avg_sq."}) {
                             // An optimizer that never stepped has no moments: zeros, as AdamW starts.
                             const Tensor* moment = moments ? source.optimizer->state(kind + name) : nullptr;
                             Tensor t = moment ? *moment : Tensor::zeros(p.shape());
                             fn(kind + name, t);
                           }
                         }
                       },
                       settings, moments ? source.optimizer->step : 0, rng);
      c.with_optimizer = moments;
      if (!moments) c.note = "no optimizer state in the input: the checkpoint starts AdamW afresh at step 0";
      break;
    }
  }
  // Read it back: every parameter must come out bit for bit (a tied head comes back as its own copy of tok_emb).
  ModelFile back = load_model_file(output, {"", config.n_heads, source.tokenizer});
  std::map<std::string, Tensor> original;
  for (auto& [name, p] : model.named_parameters()) original[name] = p;
  if (!original.count("out_head.weight")) original["out_head.weight"] = model.tok_emb;
  for (auto& [name, p] : back.model->named_parameters()) {
    const auto it = original.find(name);
    QKV_CHECK(it != original.end(), "convert: the written model has a parameter " + name + " the input lacks");
    const bool same = it->second.shape() == p.shape() &&
                      std::memcmp(it->second.data(), p.data(), static_cast<size_t>(p.numel()) * sizeof(float)) == 0;
    QKV_CHECK(same, "convert: " + name + " did not survive the round trip");
  }
  if (config.tie_weights && to != ModelFormat::HuggingFaceGPT2 && to != ModelFormat::QkvCheckpoint) {
    c.note = "the input ties its output head to tok_emb.weight; the book's GPTModel has its own out_head.weight, so it "
             "gets a copy";
  }
  return c;
}

}  // namespace qkv::train
