// Fine-tuning: freezing by name, LoRA and PEFT adapters, classification and instruction training loops.
#include "qkv/train/finetune.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/io/file.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::train {

// ---- which parameters train ----

namespace {

bool glob(const char* p, const char* s) {
  for (; *p; ++p, ++s) {
    if (*p == '*') {
      for (const char* t = s;; ++t) {
        if (glob(p + 1, t)) return true;
        if (!*t) return false;
      }
    }
    if (*s != *p) return false;
  }
  return *s == '\0';
}

std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 6; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 6) out += ", … (" + std::to_string(names.size()) + " in all)";
  return out;
}

}  // namespace

bool name_matches(const std::string& pattern, const std::string& name) {
  if (pattern.find('*') != std::string::npos) return glob(pattern.c_str(), name.c_str());
  if (name == pattern) return true;
  const std::string prefix = pattern.empty() || pattern.back() == '.' ? pattern : pattern + ".";
  return !prefix.empty() && name.compare(0, prefix.size(), prefix) == 0;
}

void set_trainable(nn::Module& model, const std::vector<std::string>& patterns) {
  std::vector<std::string> names;
  model.for_each_parameter([&](const std::string& name, Tensor&) { names.push_back(name); });
  for (const std::string& p : patterns) {
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return name_matches(p, n); })) {
      throw ValueError("no parameter matches '" + p + "'; the model's parameters are " + some_names(names));
    }
  }
  model.for_each_parameter([&](const std::string& name, Tensor& t) {
    t.requires_grad_(std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return name_matches(p, name); }));
  });
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// ---- LoRA ----

namespace {

// The roles a preset chooses (module.hpp's LoraRoleBits), or 0 when `target` is a name pattern instead.
constexpr unsigned kLoraQkv = nn::kLoraQuery | nn::kLoraKey | nn::kLoraValue;
unsigned preset_roles(const std::string& target) {
  if (target == "all") return ~0u;
  if (target == "qkv") return kLoraQkv;
  if (target == "attention") return kLoraQkv | nn::kLoraOutput;
  if (target == "mlp") return nn::kLoraGate | nn::kLoraUp | nn::kLoraDown;
  return 0;
}

// Whether `site` is one of `targets`: a preset by the roles the site projects to, anything else a name pattern.
bool targeted(const std::vector<std::string>& targets, const nn::LoraSite& site) {
  for (const std::string& t : targets) {
    const unsigned roles = preset_roles(t);
    if (roles == ~0u || (roles ? (site.roles & roles) != 0 : name_matches(t, site.name))) return true;
  }
  return false;
}

bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return name_matches(p, name); });
}

}  // namespace

std::vector<std::string> add_lora(nn::Module& model, const LoraOptions& options, Generator& gen,
                                  const std::vector<std::string>& exclude) {
  if (options.rank < 1) throw ValueError("LoRA: the rank must be at least 1, got " + std::to_string(options.rank));
  const double alpha = options.alpha > 0 ? options.alpha : static_cast<double>(options.rank);
  std::vector<nn::LoraSite> chosen, all = model.lora_sites();
  for (auto& site : all)
    if (targeted(options.targets, site) && !matches_any(exclude, site.name)) chosen.push_back(site);
  if (chosen.empty()) {
    std::vector<std::string> names;
    for (auto& site : all) names.push_back(site.name);
    std::string given;
    for (const auto& t : options.targets) given += (given.empty() ? "" : ",") + t;
    throw ValueError("LoRA: the targets '" + given + "' match no layer LoRA can adapt; the model's are " +
                     (names.empty() ? std::string("none") : some_names(names)) + " (presets: all, attention, qkv, mlp)");
  }
  for (auto& site : chosen) {  // every size checked before any adapter is added
    const int64_t in = site.weight.size(1), out = site.weight.size(0);
    if (options.rank > std::min(in, out)) {
      throw ValueError("LoRA: rank " + std::to_string(options.rank) + " is larger than " + site.name + " (" +
                       std::to_string(out) + " × " + std::to_string(in) + "); use at most " + std::to_string(std::min(in, out)));
    }
  }
  std::vector<std::string> names;
  for (auto& site : chosen) {
    nn::Module::add_lora(site, options.rank, alpha, gen);
    names.push_back(site.name);
  }
  return names;
}

void merge_lora(nn::Module& model) {
  for (auto& site : model.lora_sites()) nn::Module::merge_lora(site);
}

namespace {
const std::string kPeftPrefix = "base_model.model.";
}

void save_peft_adapter(const std::string& dir, nn::Module& model, const PeftAdapter& d,
                       const std::vector<std::pair<std::string, Tensor>>& saved_modules) {
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& site : model.lora_sites()) {
    if (!site.lora->defined()) continue;
    tensors.emplace_back(kPeftPrefix + site.name + ".lora_A.weight", site.lora->a);
    tensors.emplace_back(kPeftPrefix + site.name + ".lora_B.weight", site.lora->b);
  }
  for (const auto& [name, t] : saved_modules) tensors.emplace_back(kPeftPrefix + name, t);
  io::save_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"}, {"task_type", nullptr}, {"base_model_name_or_path", d.base_model},
      {"r", d.rank}, {"lora_alpha", d.alpha}, {"lora_dropout", 0.0}, {"bias", "none"},
      {"fan_in_fan_out", false}, {"inference_mode", true}, {"init_lora_weights", true},
      {"target_modules", d.target_modules}, {"modules_to_save", d.modules_to_save.empty() ? nlohmann::ordered_json(nullptr)
                                                                                         : nlohmann::ordered_json(d.modules_to_save)}};
  const std::string text = config.dump(2) + "\n";
  io::write_file_atomically(dir + "/adapter_config.json", std::as_bytes(std::span(text.data(), text.size())));
}

PeftAdapter read_peft_adapter(const std::string& dir) {
  const std::string config_path = dir + "/adapter_config.json", weights_path = dir + "/adapter_model.safetensors";
  for (const std::string& p : {config_path, weights_path})
    if (!std::filesystem::is_regular_file(p)) throw IoError(dir + ": not a PEFT adapter folder (no " + p + ")");
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(text::read_text_file(config_path, 1 << 20));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(config_path + ": not valid JSON: " + e.what());
  }
  PeftAdapter a;
  try {
    if (c.value("peft_type", std::string()) != "LORA") throw IoError(config_path + ": peft_type is not LORA; qkv applies LoRA adapters");
    if (c.value("fan_in_fan_out", false)) throw IoError(config_path + ": fan_in_fan_out adapters (Conv1D layers) are not supported");
    a.rank = c.at("r").get<int64_t>();
    a.alpha = c.at("lora_alpha").get<double>();
    if (c.contains("target_modules") && c["target_modules"].is_array()) a.target_modules = c["target_modules"].get<std::vector<std::string>>();
    if (c.contains("modules_to_save") && c["modules_to_save"].is_array()) a.modules_to_save = c["modules_to_save"].get<std::vector<std::string>>();
    a.base_model = c.value("base_model_name_or_path", std::string());
  } catch (const nlohmann::json::exception& e) {
    throw IoError(config_path + ": " + e.what());
  }
  if (a.rank < 1 || !(a.alpha > 0)) throw IoError(config_path + ": r and lora_alpha must be positive");
  const io::SafetensorsFile file = io::SafetensorsFile::open(weights_path);
  for (const auto& info : file.tensors()) {
    std::string name = info.name;
    if (name.compare(0, kPeftPrefix.size(), kPeftPrefix) == 0) name = name.substr(kPeftPrefix.size());
    a.tensors[name] = file.weights(info.name);
  }
  return a;
}

std::map<std::string, Tensor> apply_peft_adapter(nn::Module& model, const PeftAdapter& adapter) {
  std::map<std::string, nn::LoraSite> layers;
  for (auto& site : model.lora_sites()) layers[site.name] = site;
  std::set<std::string> modules;
  const std::string a_suffix = ".lora_A.weight", b_suffix = ".lora_B.weight";
  for (const auto& [name, t] : adapter.tensors) {
    for (const std::string* suffix : {&a_suffix, &b_suffix}) {
      if (name.size() > suffix->size() && name.compare(name.size() - suffix->size(), suffix->size(), *suffix) == 0)
        modules.insert(name.substr(0, name.size() - suffix->size()));
    }
  }
  if (modules.empty()) throw ValueError("the adapter holds no lora_A/lora_B weights");
  std::map<std::string, Tensor> parameters, rest;
  for (auto& [name, p] : model.named_parameters()) parameters[name] = p;
  for (const auto& [name, t] : adapter.tensors) {
    if (name.find(".lora_") != std::string::npos) continue;
    const auto it = parameters.find(name);
    if (it == parameters.end() || !(it->second.shape() == t.shape())) rest[name] = t;
  }
  for (const std::string& m : modules) {  // everything checked before anything changes
    auto it = layers.find(m);
    if (it == layers.end()) throw ValueError("the adapter is for another model: it adapts '" + m + "', a layer this model does not have");
    const auto a = adapter.tensors.find(m + a_suffix), b = adapter.tensors.find(m + b_suffix);
    if (a == adapter.tensors.end() || b == adapter.tensors.end()) throw ValueError("the adapter has only half of " + m + "'s LoRA pair");
    const Tensor& w = it->second.weight;
    if (!(a->second.shape() == Shape{adapter.rank, w.size(1)}) || !(b->second.shape() == Shape{w.size(0), adapter.rank})) {
      throw ValueError("the adapter is for another model: " + m + " is " + w.shape().str() + " here, its LoRA pair is " +
                       a->second.shape().str() + " and " + b->second.shape().str());
    }
    if (it->second.lora->defined()) throw ValueError(m + " already has an adapter");
  }
  Generator unused = Generator::drawing_nothing();
  for (const std::string& m : modules) {
    nn::LoraSite& site = layers[m];
    nn::Module::add_lora(site, adapter.rank, adapter.alpha, unused);
    site.lora->a.copy_(adapter.tensors.at(m + a_suffix));
    site.lora->b.copy_(adapter.tensors.at(m + b_suffix));
  }
  for (const auto& [name, t] : adapter.tensors)
    if (name.find(".lora_") == std::string::npos && !rest.count(name)) parameters.at(name).copy_(t);
  return rest;
}

// ---- classification ----

std::vector<std::string> label_names(const std::vector<text::LabelledText>& train) {
  std::vector<std::string> out;
  for (const auto& t : train)
    if (std::find(out.begin(), out.end(), t.label) == out.end()) out.push_back(t.label);
  const bool integers = std::all_of(out.begin(), out.end(), [](const std::string& s) {
    return !s.empty() && s.size() < 18 && std::all_of(s.begin() + (s[0] == '-' ? 1 : 0), s.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
           s != "-";
  });
  if (integers) std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) { return std::stoll(a) < std::stoll(b); });
  return out;
}

int64_t longest_text(const std::vector<text::LabelledText>& texts, const text::Tokenizer& tokenizer, int64_t limit) {
  int64_t longest = 0;
  for (const auto& t : texts) longest = std::max<int64_t>(longest, static_cast<int64_t>(tokenizer.encode(t.text).size()));
  return std::min(longest, limit);
}

ClassificationSplit make_split(const std::vector<text::LabelledText>& texts, const std::vector<std::string>& labels,
                               const text::Tokenizer& tokenizer, int64_t length, int64_t pad_id, const std::string& label) {
  if (texts.empty()) throw ValueError(label + ": no texts (an empty split)");
  if (length < 1) throw ValueError(label + ": the texts have no tokens");
  ClassificationSplit s;
  s.length = length;
  for (const auto& t : texts) {
    const auto at = std::find(labels.begin(), labels.end(), t.label);
    if (at == labels.end()) {
      std::string known;
      for (const auto& l : labels) known += (known.empty() ? "'" : ", '") + l + "'";
      throw ValueError(label + ":" + std::to_string(t.line) + ": label '" + t.label +
                       "' is not in the training set (which has " + known + ")");
    }
    std::vector<int64_t> ids = tokenizer.encode(t.text);
    if (static_cast<int64_t>(ids.size()) > length) ids.resize(static_cast<size_t>(length));
    s.last_real.push_back(std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - 1));
    ids.resize(static_cast<size_t>(length), pad_id);
    s.ids.insert(s.ids.end(), ids.begin(), ids.end());
    s.labels.push_back(at - labels.begin());
  }
  return s;
}

SequenceClassifier::SequenceClassifier(nn::LanguageModel& base_, int64_t classes, Generator& gen)
    : base(base_), head(base_.hidden_size(), classes, true, gen) {}

Tensor SequenceClassifier::logits(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                                  std::span<const int64_t> positions) const {
  return head(gather_tokens(base.hidden_states(ids, batch, tokens), positions));
}

int64_t SequenceClassifier::enable_prefix_cache(int64_t limit_bytes) {
  cache_.clear();
  cache_bytes_ = 0;
  cache_limit_ = limit_bytes;
  const int64_t L = base.num_layers();
  int64_t first = L;  // the first block with a trainable parameter (L: only the final norm and the head train)
  for (const auto& [name, p] : base.named_trainable_parameters()) {
    if (name.rfind(base.final_norm_prefix(), 0) == 0) continue;
    int64_t layer = -1;
    for (int64_t i = 0; i < L && layer < 0; ++i)
      if (name.rfind(base.block_prefix(i), 0) == 0) layer = i;
    first = std::min(first, layer < 0 ? 0 : layer);  // anything outside the blocks (an embedding) trains: no cache
  }
  cache_layer_ = limit_bytes > 0 && !base.is_training() ? first : 0;
  return cache_layer_;
}

Tensor SequenceClassifier::batch_logits(const ClassificationSplit& data, std::span<const int64_t> rows, Pooling pooling) const {
  const int64_t B = static_cast<int64_t>(rows.size()), T = data.length;
  std::vector<int64_t> ids, positions;
  for (int64_t i : rows) {
    ids.insert(ids.end(), data.ids.begin() + i * T, data.ids.begin() + (i + 1) * T);
    positions.push_back(pooling == Pooling::Last ? T - 1 : data.last_real[static_cast<size_t>(i)]);
  }
  if (cache_layer_ == 0) return logits(ids, B, T, positions);
  std::vector<Tensor>& cached = cache_[&data];
  cached.resize(static_cast<size_t>(data.size()));
  std::vector<int64_t> missing;
  for (int64_t i : rows)
    if (!cached[static_cast<size_t>(i)].defined() && std::find(missing.begin(), missing.end(), i) == missing.end()) missing.push_back(i);
  const int64_t C = base.hidden_size();
  std::map<int64_t, Tensor> fresh;  // rows computed now but not kept (over the limit)
  if (!missing.empty()) {
    NoGradGuard no_grad;
    std::vector<int64_t> missing_ids;
    for (int64_t i : missing) missing_ids.insert(missing_ids.end(), data.ids.begin() + i * T, data.ids.begin() + (i + 1) * T);
    const Tensor r = base.residual_before(missing_ids, static_cast<int64_t>(missing.size()), T, cache_layer_);
    for (size_t k = 0; k < missing.size(); ++k) {
      Tensor row = Tensor::from(std::span<const float>(r.data() + static_cast<int64_t>(k) * T * C, static_cast<size_t>(T * C)), {T, C});
      if (cache_bytes_ + T * C * 4 <= cache_limit_) {
        cached[static_cast<size_t>(missing[k])] = row;
        cache_bytes_ += T * C * 4;
      } else {
        fresh[missing[k]] = row;
      }
    }
  }
  Tensor x = Tensor::empty({B, T, C});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = rows[static_cast<size_t>(b)];
    const Tensor& row = cached[static_cast<size_t>(i)].defined() ? cached[static_cast<size_t>(i)] : fresh.at(i);
    std::copy_n(row.data(), T * C, x.data() + b * T * C);
  }
  return head(gather_tokens(base.hidden_from(x, cache_layer_), positions));
}

std::string SequenceClassifier::head_name() const { return base.classifier_head_name(); }

std::vector<std::pair<std::string, Tensor>> SequenceClassifier::trainable_parameters() {
  auto out = base.named_trainable_parameters();
  for (auto& [name, p] : head.named_trainable_parameters()) out.emplace_back(head_name() + "." + name, p);
  return out;
}

std::vector<std::pair<std::string, Tensor>> SequenceClassifier::state_dict() {
  std::vector<std::pair<std::string, Tensor>> out;
  const std::string vocab_head = base.head_prefix(), mine = head_name() + ".";
  const bool tied = vocab_head != "out_head." && vocab_head != "lm_head.";
  const nn::StateDict state = base.state_dict(), head_state = head.state_dict();
  for (const auto& [name, t] : state.entries()) {
    if (!tied && name.compare(0, vocab_head.size(), vocab_head) == 0) continue;
    if (name.compare(0, mine.size(), mine) == 0) continue;
    out.emplace_back(name, t);
  }
  for (const auto& [name, t] : head_state.entries())
    if (name.find("lora_") == std::string::npos) out.emplace_back(mine + name, t);
  return out;
}

namespace {

std::vector<int64_t> labels_of(const ClassificationSplit& data, std::span<const int64_t> rows) {
  std::vector<int64_t> out;
  for (int64_t i : rows) out.push_back(data.labels[static_cast<size_t>(i)]);
  return out;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

optim::AdamW make_adamw(std::vector<std::pair<std::string, Tensor>> parameters, double lr, double weight_decay) {
  if (parameters.empty()) throw ValueError("fine-tuning: no parameter is trainable");
  return optim::AdamW(std::move(parameters), {.lr = lr, .weight_decay = weight_decay});
}

void check_finite(double loss, int64_t step) {
  if (!std::isfinite(loss)) {
    throw TrainingDiverged("step " + std::to_string(step) + ": the loss became " + std::to_string(loss) +
                           "; the step was not applied (try a lower --lr)");
  }
}

}  // namespace

std::vector<int64_t> randperm(int64_t n, Generator& gen) {
  std::vector<int64_t> r = iota(n);
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t z = static_cast<int64_t>(gen.next_u32() % static_cast<uint64_t>(n - i));
    std::swap(r[static_cast<size_t>(i)], r[static_cast<size_t>(z + i)]);
  }
  return r;
}

ClassifierMetrics evaluate_classifier(const SequenceClassifier& model, const ClassificationSplit& data, int64_t batch_size,
                                      int64_t batches, Pooling pooling) {
  NoGradGuard no_grad;
  const int64_t n = data.size(), available = (n + batch_size - 1) / batch_size;
  const int64_t count = batches > 0 ? std::min(batches, available) : available;
  ClassifierMetrics m;
  if (count == 0) return {NAN, NAN};
  int64_t correct = 0, seen = 0;
  const std::vector<int64_t> order = iota(n);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t begin = k * batch_size, rows = std::min(batch_size, n - begin);
    const auto chosen = std::span(order).subspan(static_cast<size_t>(begin), static_cast<size_t>(rows));
    const std::vector<int64_t> labels = labels_of(data, chosen);
    const Tensor logits = model.batch_logits(data, chosen, pooling);
    m.loss += cross_entropy(logits, labels).item();
    const int64_t classes = logits.size(1);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * classes;
      if (std::max_element(row, row + classes) - row == labels[static_cast<size_t>(r)]) ++correct;
    }
    seen += rows;
  }
  m.loss /= static_cast<double>(count);
  m.accuracy = static_cast<double>(correct) / static_cast<double>(seen);
  return m;
}

std::vector<std::vector<int64_t>> confusion_matrix(const SequenceClassifier& model, const ClassificationSplit& data,
                                                   int64_t batch_size, Pooling pooling, int64_t classes) {
  NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(classes), std::vector<int64_t>(static_cast<size_t>(classes)));
  const std::vector<int64_t> order = iota(data.size());
  for (int64_t begin = 0; begin < data.size(); begin += batch_size) {
    const int64_t rows = std::min(batch_size, data.size() - begin);
    const auto chosen = std::span(order).subspan(static_cast<size_t>(begin), static_cast<size_t>(rows));
    const std::vector<int64_t> labels = labels_of(data, chosen);
    const Tensor logits = model.batch_logits(data, chosen, pooling);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * classes;
      counts[static_cast<size_t>(labels[static_cast<size_t>(r)])][static_cast<size_t>(std::max_element(row, row + classes) - row)]++;
    }
  }
  return counts;
}

int64_t train_classifier(SequenceClassifier& model, const ClassificationSplit& train, const ClassificationSplit& val,
                         const ClassifierOptions& o, const ClassifierCallbacks& callbacks) {
  if (o.batch_size < 1 || o.epochs < 0 || o.eval_freq < 1 || o.eval_iter < 1) throw ValueError("fine-tuning: batch size, eval frequency and eval batches must be positive");
  const int64_t per_epoch = train.size() / o.batch_size;
  if (per_epoch == 0) {
    throw ValueError("the training split has " + std::to_string(train.size()) + " texts, fewer than one batch of " +
                     std::to_string(o.batch_size) + "; use a smaller --batch-size");
  }
  model.base.eval();
  model.enable_prefix_cache(o.prefix_cache_bytes);
  optim::AdamW optimizer = make_adamw(model.trainable_parameters(), o.lr, o.weight_decay);
  int64_t step = 0, examples = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    Generator shuffle(o.seed + static_cast<uint64_t>(epoch));
    const std::vector<int64_t> order = randperm(train.size(), shuffle);
    for (int64_t k = 0; k < per_epoch; ++k) {
      const auto chosen = std::span(order).subspan(static_cast<size_t>(k * o.batch_size), static_cast<size_t>(o.batch_size));
      optimizer.zero_grad(true);
      const Tensor loss = cross_entropy(model.batch_logits(train, chosen, o.pooling), labels_of(train, chosen));
      const double value = loss.item();
      check_finite(value, step + 1);
      loss.backward();
      optimizer.step();
      memory::cache_blocks_for_steps();  // every batch has the same shape: the next step reuses these blocks
      examples += o.batch_size;
      if (callbacks.on_step) callbacks.on_step({step + 1, epoch + 1, examples, per_epoch * o.epochs, value});
      if (step % o.eval_freq == 0 && callbacks.on_eval) {
        const double tl = evaluate_classifier(model, train, o.batch_size, o.eval_iter, o.pooling).loss;
        const double vl = evaluate_classifier(model, val, o.batch_size, o.eval_iter, o.pooling).loss;
        callbacks.on_eval({step + 1, examples, tl, vl});
      }
      ++step;
    }
    if (callbacks.on_epoch) {
      callbacks.on_epoch({epoch + 1, evaluate_classifier(model, train, o.batch_size, o.eval_iter, o.pooling).accuracy,
                          evaluate_classifier(model, val, o.batch_size, o.eval_iter, o.pooling).accuracy});
    }
  }
  return step;
}

// ---- instruction fine-tuning ----

InstructionSplits split_instructions(const std::vector<text::Instruction>& entries, uint64_t seed) {
  std::vector<int64_t> order = iota(static_cast<int64_t>(entries.size()));
  if (seed != 0) {
    Generator gen(seed);
    order = randperm(static_cast<int64_t>(entries.size()), gen);
  }
  const size_t n = entries.size(), train = static_cast<size_t>(static_cast<double>(n) * 0.85),
               test = static_cast<size_t>(static_cast<double>(n) * 0.1);
  InstructionSplits s;
  for (size_t i = 0; i < n; ++i) {
    const text::Instruction& e = entries[static_cast<size_t>(order[i])];
    (i < train ? s.train : i < train + test ? s.test : s.validation).push_back(e);
  }
  return s;
}

EncodedInstruction encode_instruction(const text::Instruction& entry, const text::Tokenizer& tokenizer,
                                      const std::function<std::string(const text::Instruction&)>& prompt) {
  const std::string p = prompt ? prompt(entry) : text::alpaca_prompt(entry);
  EncodedInstruction e;
  // The book encodes prompt + response as one text; the prompt's own encoding gives where the response starts.
  e.ids = tokenizer.encode(p + (prompt ? entry.output : text::alpaca_response(entry)));
  e.prompt_tokens = static_cast<int64_t>(tokenizer.encode(p).size());
  return e;
}

InstructionBatch collate_instructions(const std::vector<const EncodedInstruction*>& entries, int64_t pad_id,
                                      int64_t allowed_max_length, bool mask_prompt) {
  InstructionBatch b;
  b.batch = static_cast<int64_t>(entries.size());
  size_t longest = 0;
  for (const auto* e : entries) longest = std::max(longest, e->ids.size() + 1);
  const int64_t T = static_cast<int64_t>(longest) - 1;
  b.tokens = allowed_max_length > 0 ? std::min(T, allowed_max_length) : T;
  for (const auto* e : entries) {
    std::vector<int64_t> padded = e->ids;
    padded.resize(longest, pad_id);  // the end of text, then padding, all pad_id
    std::vector<int64_t> targets(padded.begin() + 1, padded.end());
    bool first = true;
    for (int64_t& t : targets) {
      if (t != pad_id) continue;
      if (!first) t = -100;
      first = false;
    }
    if (mask_prompt)
      for (int64_t i = 0; i < std::min<int64_t>(e->prompt_tokens - 1, T); ++i) targets[static_cast<size_t>(i)] = -100;
    b.inputs.insert(b.inputs.end(), padded.begin(), padded.begin() + b.tokens);
    b.targets.insert(b.targets.end(), targets.begin(), targets.begin() + b.tokens);
  }
  return b;
}

double instruction_loss(const nn::LanguageModel& model, const std::vector<EncodedInstruction>& data,
                        const InstructOptions& o, int64_t batches) {
  NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(data.size()), available = (n + o.batch_size - 1) / o.batch_size;
  const int64_t count = batches > 0 ? std::min(batches, available) : available;
  if (count == 0) return NAN;
  double total = 0;
  int64_t counted = 0;  // batches with a target (an all-masked batch has no loss, 0/0)
  for (int64_t k = 0; k < count; ++k) {
    std::vector<const EncodedInstruction*> rows;
    for (int64_t i = k * o.batch_size; i < std::min(n, (k + 1) * o.batch_size); ++i) rows.push_back(&data[static_cast<size_t>(i)]);
    const InstructionBatch b = collate_instructions(rows, o.pad_id, o.allowed_max_length, o.mask_prompt);
    if (std::all_of(b.targets.begin(), b.targets.end(), [](int64_t t) { return t == -100; })) continue;
    total += model.loss(b.inputs, b.batch, b.tokens, b.targets).item();
    ++counted;
  }
  return counted ? total / static_cast<double>(counted) : NAN;
}

int64_t train_instructions(nn::LanguageModel& model, const std::vector<EncodedInstruction>& train,
                           const std::vector<EncodedInstruction>& validation, const InstructOptions& o,
                           const InstructCallbacks& callbacks) {
  if (o.batch_size < 1 || o.epochs < 0 || o.eval_freq < 1 || o.eval_iter < 1) throw ValueError("fine-tuning: batch size, eval frequency and eval batches must be positive");
  const int64_t n = static_cast<int64_t>(train.size()), per_epoch = n / o.batch_size;
  if (per_epoch == 0) {
    throw ValueError("the training split has " + std::to_string(n) + " entries, fewer than one batch of " +
                     std::to_string(o.batch_size) + "; use a smaller --batch-size or more data");
  }
  model.eval();
  optim::AdamW optimizer = make_adamw(model.named_trainable_parameters(), o.lr, o.weight_decay);
  int64_t step = 0, tokens = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    Generator shuffle(o.seed + static_cast<uint64_t>(epoch));
    const std::vector<int64_t> order = randperm(n, shuffle);
    for (int64_t k = 0; k < per_epoch; ++k) {
      std::vector<const EncodedInstruction*> rows;
      for (int64_t i = 0; i < o.batch_size; ++i) rows.push_back(&train[static_cast<size_t>(order[static_cast<size_t>(k * o.batch_size + i)])]);
      const InstructionBatch b = collate_instructions(rows, o.pad_id, o.allowed_max_length, o.mask_prompt);
      if (std::all_of(b.targets.begin(), b.targets.end(), [](int64_t t) { return t == -100; })) {
        throw ValueError("training batch " + std::to_string(step + 1) + " has nothing to learn: every target is masked, "
                         "as its prompts fill all " + std::to_string(b.tokens) + " positions (--allowed-max-length, the "
                         "model's context); use a model with a longer context, shorter prompts, or no --mask-prompt");
      }
      optimizer.zero_grad(true);
      const Tensor loss = model.loss(b.inputs, b.batch, b.tokens, b.targets);
      const double value = loss.item();
      check_finite(value, step + 1);
      loss.backward();
      optimizer.step();
      // No block cache here: each batch is padded to its own longest entry, so the sizes differ from step to step and
      // blocks kept by exact size would mostly wait for a size that never comes again.
      tokens += b.batch * b.tokens;
      if (callbacks.on_step) callbacks.on_step({step + 1, epoch + 1, per_epoch * o.epochs, tokens, value});
      if (step % o.eval_freq == 0 && callbacks.on_eval)
        callbacks.on_eval({step + 1, tokens, instruction_loss(model, train, o, o.eval_iter), instruction_loss(model, validation, o, o.eval_iter)});
      ++step;
    }
  }
  return step;
}

}  // namespace qkv::train
