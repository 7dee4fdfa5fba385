// qkv finetune classify | instruct, and qkv classify: the book's chapters 6 and 7 (and appendix E's LoRA) on any model
// qkv loads, with progress, the book's printouts, metrics, plots and files PyTorch and PEFT read.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "options.hpp"
#include "progress.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/viz/heatmap.hpp"
#include "qkv/viz/plot.hpp"

namespace qkv::cli {

namespace {

namespace fs = std::filesystem;

void write_text(const std::string& path, const std::string& text) {
  io::write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size())));
}

// An output folder that does not clobber a finished run unless told to.
void prepare_out_dir(const std::string& dir, bool overwrite) {
  if (dir.empty()) throw UsageError("give --out DIR for the fine-tuned model");
  for (const char* file : {"model.pth", "model.safetensors"})
    if (!overwrite && fs::exists(fs::path(dir) / file))
      throw UsageError(dir + " already holds a fine-tuned model (" + file + "); choose another --out or pass --overwrite");
  fs::create_directories(dir);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The counts the book prints before and after freezing.
void print_trainable(int64_t before, int64_t after) {
  std::printf("Total trainable parameters before: %s\nTotal trainable parameters after: %s\n",
              train::with_commas(before).c_str(), train::with_commas(after).c_str());
}

// The format a model's matrices are stored in when it is not float (a GGUF file's q8_0 or q4_K, --weights …): such a
// base trains through LoRA adapters only (QLoRA: the base stays as stored, the adapters in float32). Empty for float.
std::string quantized_base(nn::LanguageModel& model) {
  std::string type;
  model.for_each_parameter([&](const std::string&, Tensor& t) {
    const kernels::WeightType w = t.weight_type();
    if (type.empty() && w != kernels::WeightType::F32 && w != kernels::WeightType::BF16) type = kernels::weight_type_name(w);
  });
  return type;
}

// Refuses to fine-tune a stored base's weights themselves, before anything runs
void check_trainable_base(nn::LanguageModel& model, const nn::LoraOptions& lora) {
  const std::string type = quantized_base(model);
  if (!type.empty() && lora.rank <= 0)
    throw UsageError("the base model's matrices are stored as " + type + " (a GGUF file, or --weights): they are "
                     "fine-tuned through LoRA adapters only; give --lora-rank 8 (QLoRA), or a float32 checkpoint to train "
                     "the weights themselves");
}

// LoRA on the base model (the vocabulary head excluded), the base frozen; returns the adapted modules.
std::vector<std::string> apply_lora(nn::LanguageModel& model, const nn::LoraOptions& lora, const std::string& targets,
                                    Generator& gen) {
  if (lora.rank <= 0) return {};
  nn::LoraOptions o = lora;
  o.targets = split_list(targets);
  if (o.targets.empty()) throw UsageError("--lora-targets is empty; give all, attention, qkv, mlp or module names");
  nn::set_trainable(model, {});
  std::string head = model.head_prefix();
  head.pop_back();
  try {
    return nn::add_lora(model, o, gen, {head});
  } catch (const ValueError& e) {
    throw UsageError(e.what());
  }
}

nn::PeftAdapter adapter_description(const ModelOptions& m, const nn::LoraOptions& lora, std::vector<std::string> names,
                                    std::vector<std::string> saved, const char* task) {
  return {.rank = lora.rank, .alpha = lora.alpha > 0 ? lora.alpha : static_cast<double>(lora.rank),
          .target_modules = std::move(names), .modules_to_save = std::move(saved), .base_model = m.path(),
          .task_type = task};
}

// The book's configuration dict (GPT_CONFIG_124M's keys) beside model.pth, which carries none: what the book's
// GPTModel(cfg) needs, and what qkv classify reads back.
void write_book_config(const std::string& dir, nn::LanguageModel& model) {
  const auto* decoder = dynamic_cast<const nn::Decoder*>(&model);
  if (!decoder || decoder->config.family->naming != nn::Naming::Book) return;
  const nn::GPTConfig c = nn::GPTConfig::of(decoder->config);
  const nlohmann::ordered_json config = {{"vocab_size", c.vocab_size}, {"context_length", c.context_length},
                                         {"emb_dim", c.emb_dim}, {"n_heads", c.n_heads}, {"n_layers", c.n_layers},
                                         {"drop_rate", c.drop_rate}, {"qkv_bias", c.qkv_bias}};
  write_text(dir + "/config.json", config.dump(2) + "\n");
}

std::string json_number(double v) { return std::isfinite(v) ? nlohmann::json(v).dump() : ""; }
nlohmann::ordered_json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); }

// The progress bar, the book's evaluation lines, losses.csv and the loss curves, shared by both fine-tuning loops.
class TrainingReport {
 public:
  explicit TrainingReport(const char* seen) : start_(std::chrono::steady_clock::now()) {
    csv_ << "step," << seen << ",train_loss,val_loss\n";
  }
  void step(int64_t epoch, int64_t step, int64_t total, double loss) {
    epoch_ = epoch;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    char text[160];
    std::snprintf(text, sizeof text, " epoch %lld  step %lld/%lld  loss %.3f  %s", static_cast<long long>(epoch),
                  static_cast<long long>(step), static_cast<long long>(total), loss, format_duration(s).c_str());
    progress_.draw(step, total, text);
  }
  void eval(int64_t step, int64_t seen, double train, double val) {
    char line[160];
    std::snprintf(line, sizeof line, "Ep %lld (Step %06lld): Train loss %.3f, Val loss %.3f", static_cast<long long>(epoch_),
                  static_cast<long long>(step - 1), train, val);
    progress_.message(line);
    csv_ << step << ',' << seen << ',' << json_number(train) << ',' << json_number(val) << '\n';
    train_loss.points.emplace_back(static_cast<double>(seen), train);
    val_loss.points.emplace_back(static_cast<double>(seen), val);
  }
  void message(const std::string& line) { progress_.message(line); }
  void draw(int64_t done, int64_t total, const std::string& text) { progress_.draw(done, total, text); }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  // losses.csv, and the loss plot (loss.png, .svg or .pdf) when there was an evaluation.
  void write(const std::string& dir, const char* title, const char* seen_axis, const viz::PictureOptions& pictures) const {
    write_text(dir + "/losses.csv", csv_.str());
    if (!train_loss.points.empty())
      viz::save_plot(viz::picture_path(dir + "/loss", pictures), {train_loss, val_loss},
                     {.title = title, .x_label = seen_axis, .y_label = "loss (nats)"}, pictures);
  }
  // Evaluations: a dot where each was measured
  viz::Series train_loss{"training loss", {31, 119, 180}, {}, false, false, true},
      val_loss{"validation loss", {255, 127, 14}, {}, false, false, true};

 private:
  std::chrono::steady_clock::time_point start_;
  ProgressLine progress_;
  std::ostringstream csv_;
  int64_t epoch_ = 0;
};

// Greedy pooled classification of one text as the book's classify_review: cut to the trained length, padded to it.
struct Prediction {
  int64_t label = 0;
  std::vector<double> probabilities;
};
Prediction classify_one(const train::SequenceClassifier& c, const text::Tokenizer& tokenizer, const std::string& text,
                        int64_t length, int64_t pad_id, train::Pooling pooling) {
  NoGradGuard no_grad;
  std::vector<int64_t> ids = tokenizer.encode(text);
  if (ids.empty()) throw UsageError("the text is empty; give a text with at least one token");
  if (static_cast<int64_t>(ids.size()) > length) ids.resize(static_cast<size_t>(length));
  const int64_t last = static_cast<int64_t>(ids.size()) - 1;
  ids.resize(static_cast<size_t>(length), pad_id);
  const std::vector<int64_t> at = {pooling == train::Pooling::Last ? length - 1 : last};
  const Tensor p = softmax(c.logits(ids, 1, length, at));
  Prediction out;
  out.probabilities.assign(p.data(), p.data() + p.numel());
  out.label = std::max_element(out.probabilities.begin(), out.probabilities.end()) - out.probabilities.begin();
  return out;
}

}  // namespace

int run_finetune_classify(const FinetuneClassifyCommand& cmd) {
  prepare_out_dir(cmd.out_dir, cmd.overwrite);
  LoadedModel loaded = load_model(cmd.model);
  nn::LanguageModel& model = *loaded.model;
  const text::Tokenizer& tokenizer = *loaded.tokenizer;
  train::ClassifierOptions o = cmd.options;
  // A Hugging Face folder's classifier is written as transformers' *ForSequenceClassification, which reads the last
  // token that is not padding; the book's reads the last position (padding included) unless told otherwise.
  const bool hf_folder = loaded.format == nn::CheckpointFormat::HuggingFaceFolder &&
                         loaded.model->config.family->naming == nn::Naming::HuggingFace;
  const std::string pooling = cmd.pooling.empty() ? (hf_folder ? "last-real" : "last") : cmd.pooling;
  o.pooling = pooling == "last-real" ? train::Pooling::LastReal : train::Pooling::Last;
  o.prefix_cache_bytes = cmd.prefix_cache_mib << 20;
  if (o.pad_id < 0) o.pad_id = tokenizer.end_of_text() >= 0 ? tokenizer.end_of_text() : 0;  // GPT-2's is 50256
  if (o.pad_id < 0 || o.pad_id >= model.vocab_size()) throw UsageError("--pad-id " + std::to_string(o.pad_id) + " is outside the vocabulary");

  std::vector<text::LabelledText> train_texts, val_texts, test_texts;
  std::vector<std::string> labels;
  train::ClassificationSplit train_split, val_split, test_split;
  // A problem here is the data files' (a missing column, an unknown label, an empty split): exit 1.
  train_texts = text::read_labelled_texts(cmd.train_path, cmd.columns);
  val_texts = text::read_labelled_texts(cmd.val_path, cmd.columns);
  if (!cmd.test_path.empty()) test_texts = text::read_labelled_texts(cmd.test_path, cmd.columns);
  labels = train::label_names(train_texts);
  if (labels.size() < 2) throw ValueError(cmd.train_path + ": a classifier needs at least two labels; the training texts have " + std::to_string(labels.size()));
  const int64_t length = o.max_length > 0 ? std::min(o.max_length, model.context_length())
                                          : train::longest_text(train_texts, tokenizer, model.context_length());
  train_split = train::make_split(train_texts, labels, tokenizer, length, o.pad_id, cmd.train_path);
  val_split = train::make_split(val_texts, labels, tokenizer, length, o.pad_id, cmd.val_path);
  if (!cmd.test_path.empty()) test_split = train::make_split(test_texts, labels, tokenizer, length, o.pad_id, cmd.test_path);
  const int64_t classes = static_cast<int64_t>(labels.size());
  std::printf("%s: %zu training, %zu validation, %zu test texts, %lld classes, %lld tokens each\n", loaded.description.c_str(),
              train_texts.size(), val_texts.size(), test_texts.size(), static_cast<long long>(classes),
              static_cast<long long>(train_split.length));

  // The book: torch.manual_seed(123); model.out_head = torch.nn.Linear(emb_dim, num_classes); then freeze.
  const int64_t before = model.trainable_parameter_count();
  Generator gen(o.seed);
  train::SequenceClassifier classifier(model, classes, gen, /*bias=*/!hf_folder);  // score has no bias
  std::vector<std::string> adapted;
  check_trainable_base(model, o.lora);
  const std::string stored_as = quantized_base(model);
  if (o.lora.rank > 0) {
    adapted = apply_lora(model, o.lora, cmd.lora_targets, gen);
  } else {
    std::vector<std::string> patterns;
    if (cmd.trainable == "last-block") patterns = {model.block_prefix(model.num_layers() - 1), model.final_norm_prefix()};
    else if (cmd.trainable == "all") model.for_each_parameter([&](const std::string& name, Tensor&) { patterns.push_back(name); });
    else if (cmd.trainable != "head") patterns = split_list(cmd.trainable);
    try {
      nn::set_trainable(model, patterns);
    } catch (const ValueError& e) {
      throw UsageError(std::string("--trainable: ") + e.what());
    }
  }
  print_trainable(before, model.trainable_parameter_count() + classifier.head.parameter_count());

  TrainingReport report("examples_seen");
  viz::Series train_acc{"training accuracy", {31, 119, 180}, {}, false, false, true},
      val_acc{"validation accuracy", {255, 127, 14}, {}, false, false, true};
  train::ClassifierCallbacks callbacks;
  callbacks.on_step = [&](const train::ClassifierProgress& p) { report.step(p.epoch, p.step, p.steps_total, p.loss); };
  callbacks.on_eval = [&](const train::ClassifierEvaluation& e) { report.eval(e.step, e.examples_seen, e.train_loss, e.val_loss); };
  nlohmann::ordered_json epochs = nlohmann::ordered_json::array();
  callbacks.on_epoch = [&](const train::ClassifierEpoch& e) {
    char line[160];
    std::snprintf(line, sizeof line, "Training accuracy: %.2f%% | Validation accuracy: %.2f%%", 100 * e.train_accuracy,
                  100 * e.val_accuracy);
    report.message(line);
    train_acc.points.emplace_back(static_cast<double>(e.epoch), e.train_accuracy);
    val_acc.points.emplace_back(static_cast<double>(e.epoch), e.val_accuracy);
    epochs.push_back({{"epoch", e.epoch}, {"train_accuracy", e.train_accuracy}, {"val_accuracy", e.val_accuracy}});
  };
  int64_t steps = 0;
  try {
    steps = train::train_classifier(classifier, train_split, val_split, o, callbacks);
  } catch (const ValueError& e) {
    throw UsageError(e.what());
  }
  const double seconds = report.seconds();
  std::printf("Training completed in %.2f minutes (%lld steps).\n", seconds / 60, static_cast<long long>(steps));

  // The book's final report: accuracy over the whole of each split.
  const auto tr = train::evaluate_classifier(classifier, train_split, o.batch_size, 0, o.pooling);
  const auto va = train::evaluate_classifier(classifier, val_split, o.batch_size, 0, o.pooling);
  train::ClassifierMetrics te{NAN, NAN};
  if (!cmd.test_path.empty()) te = train::evaluate_classifier(classifier, test_split, o.batch_size, 0, o.pooling);
  std::printf("Training accuracy: %.2f%%\nValidation accuracy: %.2f%%\n", 100 * tr.accuracy, 100 * va.accuracy);
  if (!cmd.test_path.empty()) std::printf("Test accuracy: %.2f%%\n", 100 * te.accuracy);

  const std::string dir = cmd.out_dir;
  if (o.lora.rank > 0) {
    std::vector<std::pair<std::string, Tensor>> head;
    for (auto& [name, p] : classifier.head.named_parameters()) head.emplace_back(classifier.head_name() + "." + name, p);
    nn::save_peft_adapter(dir, model, adapter_description(cmd.model, o.lora, adapted, {classifier.head_name()}, "SEQ_CLS"), head);
    if (stored_as.empty()) nn::merge_lora(model);
  }
  if (!stored_as.empty()) {
    // QLoRA: the base stays as stored; the adapter (with the new head) is the result
  } else if (hf_folder) {  // a folder transformers' <Family>ForSequenceClassification and qkv classify load as it is
    nn::save_hf_classifier(dir, *loaded.model, classifier.head.weight, labels, o.pad_id, cmd.model.path());
  } else {
    train::save_state_dict_pth(dir + "/model.pth", classifier.state_dict());
    write_book_config(dir, model);
  }
  const train::ClassificationSplit& shown = cmd.test_path.empty() ? val_split : test_split;
  const auto confusion = train::confusion_matrix(classifier, shown, o.batch_size, o.pooling, classes);
  nlohmann::ordered_json metrics = {
      {"labels", labels}, {"pooling", pooling}, {"max_length", train_split.length}, {"pad_id", o.pad_id},
      {"train", {{"accuracy", finite_or_null(tr.accuracy)}, {"loss", finite_or_null(tr.loss)}}},
      {"val", {{"accuracy", finite_or_null(va.accuracy)}, {"loss", finite_or_null(va.loss)}}},
      {"test", cmd.test_path.empty() ? nlohmann::ordered_json(nullptr)
                                     : nlohmann::ordered_json{{"accuracy", finite_or_null(te.accuracy)}, {"loss", finite_or_null(te.loss)}}},
      {"epochs", epochs}, {"steps", steps}, {"seconds", seconds},
      {"confusion_matrix", {{"split", cmd.test_path.empty() ? "val" : "test"}, {"rows_true_columns_predicted", confusion}}},
      {"base_model", cmd.model.path()}, {"lora_rank", o.lora.rank}};
  write_text(dir + "/metrics.json", metrics.dump(2) + "\n");
  report.write(dir, "qkv finetune classify: loss", "examples seen", cmd.pictures);
  if (!train_acc.points.empty())
    viz::save_plot(viz::picture_path(dir + "/accuracy", cmd.pictures), {train_acc, val_acc},
                   {.title = "qkv finetune classify: accuracy per epoch", .x_label = "epoch", .y_label = "accuracy",
                    .whole_x = true},
                   cmd.pictures);
  Tensor counts = Tensor::zeros({classes, classes});
  for (int64_t r = 0; r < classes; ++r)
    for (int64_t c = 0; c < classes; ++c) counts.data()[r * classes + c] = static_cast<float>(confusion[static_cast<size_t>(r)][static_cast<size_t>(c)]);
  viz::HeatmapStyle style;
  style.title = std::string("confusion matrix, ") + (cmd.test_path.empty() ? "validation" : "test") + " split";
  style.row_labels = style.col_labels = labels;
  style.row_axis = "true label";
  style.col_axis = "predicted";
  style.show_values = 1;
  viz::save_heatmap(viz::picture_path(dir + "/confusion", cmd.pictures), counts, style, cmd.pictures);
  const char* ext = viz::picture_extension(cmd.pictures.format);
  if (!stored_as.empty())
    std::printf("Wrote %s/adapter_model.safetensors, adapter_config.json (the base stays %s: give it with --adapter %s), "
                "metrics.json, losses.csv, loss%s, accuracy%s, confusion%s\n", dir.c_str(), stored_as.c_str(), dir.c_str(),
                ext, ext, ext);
  else
    std::printf("Wrote %s/%s%s, metrics.json, losses.csv, loss%s, accuracy%s, confusion%s\n", dir.c_str(),
                hf_folder ? "config.json, model.safetensors, tokenizer files" : "model.pth",
                o.lora.rank > 0 ? " (merged), adapter_model.safetensors, adapter_config.json" : "", ext, ext, ext);
  return 0;
}

int run_classify(const ClassifyCommand& cmd) {
  if (cmd.texts.empty()) throw UsageError("give --text TEXT (repeatable)");
  ModelOptions m = cmd.model;
  const fs::path beside = fs::path(m.path()).parent_path() / "config.json";
  if (m.hint.config.empty() && m.hint.n_heads == 0 && m.adapter.empty() && !fs::is_directory(m.path()) && fs::exists(beside))
    m.hint.config = beside.string();  // qkv finetune writes the book's configuration dict beside model.pth
  LoadedModel loaded = load_model(m);
  if (!loaded.is_classifier()) {  // the model lacks what the command needs: an input problem, exit 1
    throw ValueError(loaded.description + " has no classifier head; give the folder, model.pth or --adapter that qkv "
                     "finetune classify wrote");
  }
  // The labels and how the classifier reads a text: from the model's files (nn::ClassifierHead).
  const nn::ClassifierHead& head = loaded.classifier;
  const std::vector<std::string>& labels = head.labels;
  const int64_t classes = head.classes(), length = head.max_length, pad_id = head.pad_id;
  const train::Pooling pooling = head.last_real ? train::Pooling::LastReal : train::Pooling::Last;
  Generator unused = Generator::drawing_nothing();
  train::SequenceClassifier classifier(*loaded.model, classes, unused, head.bias.defined());
  classifier.head.weight.copy_(head.weight);
  if (head.bias.defined()) classifier.head.bias.copy_(head.bias);
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const std::string& text : cmd.texts) {
    const Prediction p = classify_one(classifier, *loaded.tokenizer, text, length, pad_id, pooling);
    const std::string& label = labels[static_cast<size_t>(p.label)];
    if (cmd.json) {
      nlohmann::ordered_json probabilities;
      for (int64_t c = 0; c < classes; ++c) probabilities[labels[static_cast<size_t>(c)]] = p.probabilities[static_cast<size_t>(c)];
      all.push_back({{"text", text}, {"label", label}, {"probability", p.probabilities[static_cast<size_t>(p.label)]},
                     {"probabilities", probabilities}});
    } else {
      std::printf("%s\t%.4f\t%s\n", label.c_str(), p.probabilities[static_cast<size_t>(p.label)], text.c_str());
    }
  }
  if (cmd.json) std::printf("%s\n", (cmd.texts.size() == 1 ? all[0] : all).dump(2).c_str());
  return 0;
}

int run_finetune_instruct(const FinetuneInstructCommand& cmd) {
  prepare_out_dir(cmd.out_dir, cmd.overwrite);
  LoadedModel loaded = load_model(cmd.model);
  nn::LanguageModel& model = *loaded.model;
  const text::Tokenizer& tokenizer = *loaded.tokenizer;
  train::InstructOptions o = cmd.options;
  if (o.pad_id < 0) o.pad_id = tokenizer.end_of_text() >= 0 ? tokenizer.end_of_text() : 0;
  if (o.pad_id >= model.vocab_size()) throw UsageError("--pad-id " + std::to_string(o.pad_id) + " is outside the vocabulary");
  if (o.allowed_max_length > model.context_length()) {
    std::fprintf(stderr, "qkv finetune instruct: examples are cut to the model's %lld positions (--allowed-max-length %lld)\n",
                 static_cast<long long>(model.context_length()), static_cast<long long>(o.allowed_max_length));
    o.allowed_max_length = model.context_length();
  }
  // The data file's problems exit 1 (docs/robustness.md).
  const std::vector<text::Instruction> entries = text::read_instructions(cmd.data_path);
  if (entries.size() < 3) throw ValueError(cmd.data_path + ": " + std::to_string(entries.size()) + " entries; the 85/10/5 split needs more");
  const train::InstructionSplits splits = train::split_instructions(entries, cmd.split_seed);
  if (splits.train.empty() || splits.validation.empty() || splits.test.empty()) {
    throw ValueError(cmd.data_path + ": " + std::to_string(entries.size()) + " entries leave an empty split (" +
                     std::to_string(splits.train.size()) + " train, " + std::to_string(splits.test.size()) + " test, " +
                     std::to_string(splits.validation.size()) + " validation); give at least 20");
  }
  // The prompt: the book's Alpaca format, or the model's own chat template.
  std::function<std::string(const text::Instruction&)> prompt;
  if (cmd.format == "chat") {
    const auto* hf = dynamic_cast<const text::HfTokenizer*>(&tokenizer);
    if (!hf || hf->chat_template().empty())
      throw ValueError("--format chat needs a model folder with a chat template; " + loaded.description + " has none");
    auto tmpl = std::make_shared<text::ChatTemplate>(text::ChatTemplate::parse(hf->chat_template()));
    text::ChatOptions chat;
    if (hf->bos_id() >= 0) chat.bos_token = hf->token_content(hf->bos_id());
    if (hf->end_of_text() >= 0) chat.eos_token = hf->token_content(hf->end_of_text());
    prompt = [tmpl, chat](const text::Instruction& e) {
      return tmpl->render({{"user", e.input.empty() ? e.instruction : e.instruction + "\n\n" + e.input}}, chat);
    };
  }
  auto encode_all = [&](const std::vector<text::Instruction>& list) {
    std::vector<train::EncodedInstruction> out;
    for (const auto& e : list) out.push_back(train::encode_instruction(e, tokenizer, prompt));
    return out;
  };
  const auto train_set = encode_all(splits.train), val_set = encode_all(splits.validation);
  std::printf("%s: %zu training, %zu validation, %zu test entries\n", loaded.description.c_str(), splits.train.size(),
              splits.validation.size(), splits.test.size());
  const int64_t before = model.trainable_parameter_count();
  Generator gen(o.seed);
  std::vector<std::string> adapted;
  check_trainable_base(model, o.lora);
  const std::string stored_as = quantized_base(model);
  if (o.lora.rank > 0) adapted = apply_lora(model, o.lora, cmd.lora_targets, gen);
  print_trainable(before, model.trainable_parameter_count());
  std::printf("Initial losses: training %.3f, validation %.3f\n", train::instruction_loss(model, train_set, o, o.eval_iter),
              train::instruction_loss(model, val_set, o, o.eval_iter));

  TrainingReport report("tokens_seen");
  train::InstructCallbacks callbacks;
  callbacks.on_step = [&](const train::InstructProgress& p) { report.step(p.epoch, p.step, p.steps_total, p.loss); };
  callbacks.on_eval = [&](const train::InstructEvaluation& e) { report.eval(e.step, e.tokens_seen, e.train_loss, e.val_loss); };
  int64_t steps = 0;
  try {
    steps = train::train_instructions(model, train_set, val_set, o, callbacks);
  } catch (const ValueError& e) {
    throw UsageError(e.what());
  }
  const double seconds = report.seconds();
  std::printf("Training completed in %.2f minutes (%lld steps).\n", seconds / 60, static_cast<long long>(steps));

  // The book: a greedy response to every test entry, stopping at the end of text.
  nlohmann::ordered_json with_responses = nlohmann::ordered_json::array();
  nn::SamplingOptions sampling;
  sampling.max_new_tokens = cmd.max_new_tokens;
  sampling.temperature = 0.0;
  sampling.stop_tokens = loaded.stop_ids;
  int64_t done = 0;
  for (const auto& e : splits.test) {
    std::vector<int64_t> ids = tokenizer.encode(prompt ? prompt(e) : text::alpaca_prompt(e));
    std::string response = tokenizer.decode(nn::generate(model, ids, sampling));
    if (!prompt) {
      if (const size_t at = response.find("### Response:"); at != std::string::npos) response.erase(at, 13);
    }
    const size_t a = response.find_first_not_of(" \t\r\n"), b = response.find_last_not_of(" \t\r\n");
    response = a == std::string::npos ? "" : response.substr(a, b - a + 1);
    with_responses.push_back({{"instruction", e.instruction}, {"input", e.input}, {"output", e.output}, {"model_response", response}});
    report.draw(++done, static_cast<int64_t>(splits.test.size()), " responses to the test entries");
  }
  const std::string dir = cmd.out_dir;
  write_text(dir + "/instruction-data-with-response.json", with_responses.dump(4) + "\n");
  if (o.lora.rank > 0) {
    nn::save_peft_adapter(dir, model, adapter_description(cmd.model, o.lora, adapted, {}, "CAUSAL_LM"), {});
    if (stored_as.empty()) nn::merge_lora(model);
  }
  if (stored_as.empty()) {  // QLoRA keeps the base as stored: the adapter is the result
    std::vector<std::pair<std::string, Tensor>> state;
    const nn::StateDict sd = model.state_dict();
    for (const auto& [name, t] : sd.entries()) state.emplace_back(name, t);
    train::save_state_dict_pth(dir + "/model.pth", state);
    write_book_config(dir, model);
  }
  nlohmann::ordered_json metrics = {{"train_loss", finite_or_null(train::instruction_loss(model, train_set, o, 0))},
                                    {"val_loss", finite_or_null(train::instruction_loss(model, val_set, o, 0))},
                                    {"steps", steps}, {"seconds", seconds}, {"train_entries", splits.train.size()},
                                    {"test_entries", splits.test.size()}, {"validation_entries", splits.validation.size()},
                                    {"mask_prompt", o.mask_prompt}, {"format", cmd.format}, {"base_model", cmd.model.path()},
                                    {"lora_rank", o.lora.rank}};
  write_text(dir + "/metrics.json", metrics.dump(2) + "\n");
  report.write(dir, "qkv finetune instruct: loss", "tokens seen", cmd.pictures);
  if (!stored_as.empty())
    std::printf("Wrote %s/adapter_model.safetensors, adapter_config.json (the base stays %s: give it with --adapter %s), "
                "instruction-data-with-response.json, metrics.json, losses.csv, loss%s\n", dir.c_str(), stored_as.c_str(),
                dir.c_str(), viz::picture_extension(cmd.pictures.format));
  else
    std::printf("Wrote %s/model.pth%s, instruction-data-with-response.json, metrics.json, losses.csv, loss%s\n", dir.c_str(),
                o.lora.rank > 0 ? " (merged), adapter_model.safetensors, adapter_config.json" : "",
                viz::picture_extension(cmd.pictures.format));
  return 0;
}

Runner setup_finetune(CLI::App& cmd, CommandContext& context) {
  cmd.require_subcommand(1);
  auto classify = std::make_shared<FinetuneClassifyCommand>();
  auto* c = cmd.add_subcommand("classify", "A new classification head on the last position (the book's spam "
                                           "classifier): CSV/TSV/JSONL in, model.pth, metrics.json, losses.csv and "
                                           "plots out");
  add_model_options(*c, classify->model);
  add_weights_option(*c, classify->model);  // q8_0, q4_k…: the base as stored, trained through LoRA (QLoRA)
  c->add_option("--train", classify->train_path, "Training texts: .csv (header with Label,Text), .tsv or .jsonl")->required();
  c->add_option("--val", classify->val_path, "Validation texts, same layout")->required();
  c->add_option("--test", classify->test_path, "Test texts, same layout (reported at the end)");
  c->add_option("--out", classify->out_dir, "Folder for the fine-tuned model and its reports")->required()
      ->transform(folder_path());
  c->add_option("--text-column", classify->columns.text, "Column (or JSON key) of the texts")->capture_default_str();
  c->add_option("--label-column", classify->columns.label, "Column (or JSON key) of the labels")->capture_default_str();
  c->add_option("--trainable", classify->trainable, "What trains besides the head: last-block (the last block and the "
                                                    "final norm), all, head, or parameter-name patterns")
      ->capture_default_str();
  c->add_option("--pooling", classify->pooling, "The position the head reads: last (the book's, padding included) or "
                                                "last-real (each text's last token)")
      ->capture_default_str()->check(one_of({"last", "last-real"}));
  c->add_option("--max-length", classify->options.max_length, "Tokens per text (default: the longest training text)")
      ->check(int_at_least(1));
  add_finetune_options(*c, classify->options, classify->lora_targets, classify->overwrite);
  c->add_option("--prefix-cache-mib", classify->prefix_cache_mib,
                "Keep the frozen blocks' output per text for later epochs, up to this many MiB (0: recompute)")
      ->capture_default_str()->check(int_at_least(0));
  add_picture_options(*c, classify->pictures);
  add_precision_option(*c, context);

  auto instruct = std::make_shared<FinetuneInstructCommand>();
  auto* i = cmd.add_subcommand("instruct", "Instruction fine-tuning on Alpaca entries (the book's chapter 7): responses "
                                           "to the test entries, model.pth, metrics and a loss plot");
  add_model_options(*i, instruct->model);
  add_weights_option(*i, instruct->model);
  i->add_option("--data", instruct->data_path, "A JSON list of {instruction, input, output}")->required();
  i->add_option("--out", instruct->out_dir, "Folder for the fine-tuned model and its responses")->required()
      ->transform(folder_path());
  i->add_option("--format", instruct->format, "alpaca (the book's prompt) or chat (the model's chat template)")
      ->capture_default_str()->check(one_of({"alpaca", "chat"}));
  i->add_flag("--mask-prompt", instruct->options.mask_prompt, "Put the loss on the response only");
  i->add_option("--allowed-max-length", instruct->options.allowed_max_length, "Tokens per example at most")
      ->capture_default_str()->check(int_at_least(2));
  i->add_option("--split-seed", instruct->split_seed, "Shuffle before the 85/10/5 split (0: the file's order, as the "
                                                      "book)")->capture_default_str();
  i->add_option("--max-new-tokens", instruct->max_new_tokens, "Tokens per test response")
      ->capture_default_str()->check(int_at_least(0));
  add_finetune_options(*i, instruct->options, instruct->lora_targets, instruct->overwrite);
  add_picture_options(*i, instruct->pictures, "--picture-format");
  add_precision_option(*i, context);
  return [classify, instruct, c] {
    // Fine-tuning keeps float32 master weights whatever --precision says (as train does).
    return c->parsed() ? run_finetune_classify(*classify) : run_finetune_instruct(*instruct);
  };
}

Runner setup_classify(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<ClassifyCommand>();
  add_model_options(cmd, o->model);
  add_weights_option(cmd, o->model);
  cmd.add_option("--text", o->texts, "A text to classify (repeatable)")->required();
  cmd.add_flag("--json", o->json, "Print the label, its probability and every class's as JSON");
  add_precision_option(cmd, context);
  return [o, &context] {
    o->model.bf16_weights = context.precision == Precision::BF16;
    return run_classify(*o);
  };
}

}  // namespace qkv::cli
