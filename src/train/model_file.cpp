// Model files by content: qkv checkpoints, .pth, book-named safetensors, Hugging Face GPT-2 (see
// qkv/train/model_file.hpp).
#include "qkv/train/model_file.hpp"

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/core/random.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::train {

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& problem) { throw IoError(label + ": " + problem); }

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

ModelFile load_model_file(const std::string& path, const ConfigHint& hint, DType matrices) {
  nn::CheckpointModel opened = nn::open_checkpoint(path, hint, matrices);
  if (opened.format == ModelFormat::HuggingFaceFolder)
    fail(path, "a Hugging Face folder; training and conversion take the book's files and qkv checkpoints here (a "
               "folder trains with qkv train --resume FOLDER)");
  ModelFile out;
  out.model = std::move(opened.model);
  out.format = opened.format;
  out.tokenizer = opened.tokenizer;
  out.description = opened.description;
  out.classifier_weight = opened.classifier_weight;
  out.classifier_bias = opened.classifier_bias;
  if (!opened.settings.empty()) {  // a qkv checkpoint, or a .pth written by qkv: its training settings whole
    try {
      out.settings = TrainSettings::from_strings(opened.settings);
    } catch (const ValueError& e) {
      fail(path, e.what());
    }
  }
  if (out.format == ModelFormat::Pth) {  // AdamW's state and qkv's generator, when the .pth has them
    const io::PthFile file = io::PthFile::open(path);
    const io::PyRef root = file.root();
    if (auto opt = root.get("optimizer_state_dict")) out.optimizer = read_torch_adamw(file, *opt, *out.model);
    if (auto rng = root.get("qkv_rng_state")) {
      const std::vector<int64_t> words = file.int64s(*rng);
      out.rng_state.assign(words.begin(), words.end());
    }
  }
  return out;
}

const Tensor* TorchAdamW::state(const std::string& name) const {
  for (const auto& [prefix, moments] : {std::pair{std::string("exp_avg."), &exp_avg}, std::pair{std::string("exp_avg_sq."), &exp_avg_sq}}) {
    if (name.rfind(prefix, 0) == 0) {
      auto it = moments->find(name.substr(prefix.size()));
      return it == moments->end() ? nullptr : &it->second;
    }
  }
  return nullptr;
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

TrainSettings settings_for(const ModelFile& file) {
  static const TrainSettings defaults;  // (named: GCC 12 took a temporary's std::string for uninitialized)
  return settings_for(file, defaults);
}

TrainSettings settings_for(const ModelFile& file, const TrainSettings& defaults) {
  if (file.settings) return *file.settings;
  TrainSettings base = defaults;
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
        const TrainSettings settings = settings_for(source);
        save_book_pth_with_optimizer(output, model, *source.optimizer, settings, source.rng_state);
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
    case ModelFormat::HuggingFaceFolder:
    case ModelFormat::Gguf:
      QKV_CHECK(false, std::string("convert: ") + model_format_name(to) + " is written by its own path, not this one");
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
