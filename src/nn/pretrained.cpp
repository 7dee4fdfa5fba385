// load_pretrained (see qkv/nn/pretrained.hpp): a checkpoint's model, tokenizer, template, stop ids, generation defaults,
// adapter and classifier head in one call.
#include "qkv/nn/pretrained.hpp"

#include <algorithm>
#include <filesystem>
#include <future>
#include <optional>
#include <nlohmann/json.hpp>

#include "qkv/core/settings.hpp"
#include "qkv/nn/gguf_model.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/text/records.hpp"

namespace qkv::nn {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json(const fs::path& p) {
  try {
    return json::parse(text::read_text_file(p.string(), 1 << 24));
  } catch (const json::exception& e) {
    throw IoError(p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// Whether `path` is a Hugging Face folder whose config.json says its weights are bfloat16 (torch_dtype, or dtype in
// newer transformers).
bool stored_as_bf16(const std::string& path) {
  std::error_code ec;
  const fs::path config = fs::path(path) / "config.json";
  if (!fs::is_directory(path, ec) || !fs::is_regular_file(config, ec)) return false;
  const json j = read_json(config);
  for (const char* key : {"torch_dtype", "dtype"})
    if (j.is_object() && j.contains(key) && j[key].is_string() && j[key].get<std::string>() == "bfloat16") return true;
  return false;
}

// generation_config.json's sampling defaults and extra stop ids.
void read_generation_config(const fs::path& dir, Pretrained& m) {
  const fs::path p = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return;
  const json j = read_json(p);
  if (!j.is_object()) throw IoError(p.string() + ": not a JSON object");
  auto number = [&](const char* key, double fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) throw IoError(p.string() + ": '" + key + "' must be a number");
    return j[key].get<double>();
  };
  GenerationDefaults& g = m.generation;
  g.do_sample = j.contains("do_sample") && j["do_sample"].is_boolean() && j["do_sample"].get<bool>();
  g.temperature = number("temperature", 1.0);
  g.top_p = number("top_p", 1.0);
  g.min_p = number("min_p", 0.0);
  g.top_k = static_cast<int64_t>(number("top_k", 0.0));
  g.repetition_penalty = number("repetition_penalty", 1.0);
  g.max_new_tokens = static_cast<int64_t>(number("max_new_tokens", 0.0));
  if (!(g.temperature >= 0.0) || !(g.top_p > 0.0 && g.top_p <= 1.0) || g.top_k < 0 || !(g.repetition_penalty > 0.0))
    throw IoError(p.string() + ": temperature, top_p (0, 1], top_k and repetition_penalty must be in range");
  if (j.contains("eos_token_id")) {  // generation ends at these too (Llama 3.1 lists <|eot_id|> here)
    const json& e = j["eos_token_id"];
    for (const json& id : e.is_array() ? e : json::array({e}))
      if (id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < m.model->vocab_size())
        m.stop_ids.push_back(id.get<int64_t>());
  }
}

// What qkv finetune classify wrote beside a model.pth or an adapter: the labels and how texts are read.
void read_classifier_metrics(const fs::path& dir, ClassifierHead& head) {
  const fs::path p = dir / "metrics.json";
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return;
  const json m = read_json(p);
  try {
    if (m.contains("labels")) head.labels = m.at("labels").get<std::vector<std::string>>();
    if (m.contains("max_length")) head.max_length = m.at("max_length").get<int64_t>();
    if (m.contains("pad_id")) head.pad_id = m.at("pad_id").get<int64_t>();
    if (m.contains("pooling")) head.last_real = m.at("pooling").get<std::string>() == "last-real";
  } catch (const json::exception& e) {
    throw IoError(p.string() + ": " + e.what());
  }
}

// A PEFT adapter: its LoRA pairs added, and its fully trained modules (modules_to_save) copied into the parameters of
// those names — or, for a head with fewer rows than the vocabulary, kept as a classifier's head.
void apply_adapter(const std::string& dir, Pretrained& m) {
  const PeftAdapter adapter = read_peft_adapter(dir);
  const std::string head = m.model->classifier_head_name();
  try {
    for (const auto& [name, t] : apply_peft_adapter(*m.model, adapter)) {
      if (name == head + ".weight" && t.rank() == 2 && t.size(1) == m.model->hidden_size()) {
        m.classifier.weight = t;
      } else if (name == head + ".bias" && t.rank() == 1) {
        m.classifier.bias = t;
      } else {
        throw ValueError("the adapter is for another model: its " + name + " " + t.shape().str() + " has no place in " +
                         m.description);
      }
    }
  } catch (const ValueError& e) {  // an adapter for another model: the caller's choice to fix, not a broken file
    throw ValueError("adapter " + dir + ": " + e.what());
  }
  m.description += " + adapter " + dir;
}

}  // namespace

std::unique_ptr<Pretrained> load_pretrained(const std::string& path, const PretrainedOptions& options) {
  auto m = std::make_unique<Pretrained>();
  m->path = path;
  // With an adapter, its update is added in float32 and the matrices are rounded after (below).
  DType matrices = options.adapter.empty() ? options.matrices : DType::F32;
  // As stored: a bfloat16 folder is read into bfloat16 matrices (no float32 copy is ever made); so is one that is
  // quantized after reading (half the peak).
  if (options.adapter.empty() && (options.keep_stored || options.weights) && stored_as_bf16(path)) matrices = DType::BF16;
  if (options.adapter.empty() && options.weights == kernels::WeightType::BF16) matrices = DType::BF16;
  // A folder's tokenizer is read on a thread of its own while the weights load: the two are independent, and the
  // tokenizer's tables (tens of ms for a 150k vocabulary) would otherwise add to the weights' time.
  std::future<std::unique_ptr<text::HfTokenizer>> folder_tokenizer;
  {
    std::error_code ec;
    if (options.tokenizer && std::filesystem::is_directory(path, ec) && std::filesystem::exists(std::filesystem::path(path) / "tokenizer.json", ec))
      folder_tokenizer = std::async(std::launch::async, [path] { return text::HfTokenizer::from_folder(path); });
  }
  // A GGUF file is parsed once, for the model, its metadata and its tokenizer; the tokenizer's tables are built on a
  // thread of their own while the model's tensors are laid out, as a folder's are.
  std::shared_ptr<const io::GgufFile> gguf;
  std::future<std::unique_ptr<text::HfTokenizer>> gguf_tokenizer;
  if (!folder_tokenizer.valid() && detect_checkpoint_format(path) == CheckpointFormat::Gguf) {
    gguf = std::make_shared<const io::GgufFile>(io::GgufFile::open(path, io::MapAccess::Random));
    if (options.tokenizer) gguf_tokenizer = std::async(std::launch::async, [gguf] { return text::HfTokenizer::from_gguf(*gguf); });
  }
  CheckpointModel opened = open_checkpoint(path, options.hint, matrices, gguf);
  m->format = opened.format;
  m->description = opened.description;
  m->model = std::move(opened.model);
  m->classifier.weight = opened.classifier_weight;
  m->classifier.bias = opened.classifier_bias;
  m->classifier.labels = opened.labels;
  const bool folder = m->format == CheckpointFormat::HuggingFaceFolder;
  if (m->format == CheckpointFormat::Gguf) {  // the chat template and special ids are metadata, tokenizer or not
    const GgufExtras extras = gguf_extras(*gguf);
    m->chat_template = extras.chat_template;
    m->bos_id = extras.bos_id;
  }
  // The tokenizer: a folder's own files, else what the book's file says (GPT-2's BPE or bytes).
  if (!options.tokenizer) {
  } else if (folder) {
    if (auto hf = folder_tokenizer.valid() ? folder_tokenizer.get() : text::HfTokenizer::from_folder(path)) {
      m->chat_template = hf->chat_template();
      if (hf->bos_id() >= 0) m->chat.bos_token = hf->token_content(hf->bos_id());
      if (hf->end_of_text() >= 0) m->chat.eos_token = hf->token_content(hf->end_of_text());
      m->bos_id = hf->bos_id();
      m->tokenizer = std::move(hf);
    } else if (m->model->config.family->naming == Naming::Book) {
      m->tokenizer = text::make_tokenizer("gpt2", options.vocab_dir);
    } else {
      throw IoError(path + ": has no tokenizer.json; a Hugging Face model folder carries its tokenizer (download it "
                    "with the weights)");
    }
  } else if (m->format == CheckpointFormat::Gguf) {  // tokenizer.ggml.*, run as the tokenizer.json it came from
    auto hf = gguf_tokenizer.get();
    if (hf->bos_id() >= 0) m->chat.bos_token = hf->token_content(hf->bos_id());
    if (hf->end_of_text() >= 0) m->chat.eos_token = hf->token_content(hf->end_of_text());
    if (m->chat_template.empty()) m->chat_template = hf->chat_template();
    m->tokenizer = std::move(hf);
  } else {
    m->tokenizer = text::make_tokenizer(opened.tokenizer, options.vocab_dir);
  }
  m->stop_ids = m->model->config.eos_token_ids;
  const int64_t end_of_text = m->tokenizer ? m->tokenizer->end_of_text() : -1;
  if (end_of_text >= 0) m->stop_ids.push_back(end_of_text);
  if (folder) read_generation_config(path, *m);
  std::sort(m->stop_ids.begin(), m->stop_ids.end());
  m->stop_ids.erase(std::unique(m->stop_ids.begin(), m->stop_ids.end()), m->stop_ids.end());
  m->default_context = folder ? std::min<int64_t>(m->model->context_length(), 2048) : m->model->context_length();
  if (!options.adapter.empty()) apply_adapter(options.adapter, *m);
  // A classifier: how it reads a text — what fine-tuning wrote beside the model or the adapter, else a folder's
  // (transformers pools the last token that is not padding).
  ClassifierHead& head = m->classifier;
  if (head.weight.defined()) {
    head.pad_id = m->model->config.pad_token_id >= 0 ? m->model->config.pad_token_id : end_of_text >= 0 ? end_of_text : 0;
    head.last_real = folder;
    const fs::path beside = !options.adapter.empty() ? fs::path(options.adapter)
                            : folder                  ? fs::path(path)
                                                      : fs::path(path).parent_path();
    read_classifier_metrics(beside, head);
    if (head.labels.size() != static_cast<size_t>(head.classes())) {
      head.labels.clear();
      for (int64_t c = 0; c < head.classes(); ++c) head.labels.push_back(std::to_string(c));
    }
    // metrics.json is user input too: a length beyond the model's context is cut to it.
    if (head.max_length <= 0 || head.max_length > m->model->context_length())
      head.max_length = std::min<int64_t>(m->model->context_length(), 1024);
    if (head.pad_id < 0 || head.pad_id >= m->model->vocab_size()) head.pad_id = 0;
  }
  m->model->eval();
  if (options.matrices == DType::BF16) m->model->weights_to_bf16();  // a no-op for matrices already read as bf16
  if (options.weights) m->model->store_matrices(*options.weights);
  return m;
}

std::vector<int64_t> Pretrained::encode_chat(const std::vector<text::ChatMessage>& messages, bool add_generation_prompt,
                                             bool enable_thinking) const {
  const auto* hf = dynamic_cast<const text::HfTokenizer*>(tokenizer.get());
  if (!hf || chat_template.empty())
    throw ValueError(description + " has no chat template (a Hugging Face folder's tokenizer_config.json carries one)");
  text::ChatOptions o = chat;
  o.add_generation_prompt = add_generation_prompt;
  o.enable_thinking = enable_thinking;
  return hf->encode_rendered(text::ChatTemplate::parse(chat_template).render(messages, o));
}

}  // namespace qkv::nn
