// `qkv eval`: loss and perplexity of a model on a text, with a progress bar, tokens/s and --json.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "options.hpp"
#include "progress.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/divergence.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/text/records.hpp"
#include "qkv/train/classify.hpp"
#include "qkv/train/evaluate.hpp"
#include "qkv/viz/plot.hpp"

namespace qkv::cli {

namespace fs = std::filesystem;

namespace {
// A fine-tuned classifier: accuracy and mean loss over a labelled file (CSV, TSV or JSON lines, as qkv finetune
// classify reads them), read as the classifier was trained to read texts.
int eval_classifier(const EvalCommand& options, LoadedModel& loaded) {
  const nn::ClassifierHead& head = loaded.classifier;
  std::vector<text::LabelledText> texts;
  train::ClassificationSplit split;
  try {
    texts = text::read_labelled_texts(options.text_path);
    split = train::make_split(texts, head.labels, *loaded.tokenizer, head.max_length, head.pad_id, options.text_path);
  } catch (const ValueError& e) {
    throw UsageError(std::string(e.what()) + " (a classifier is evaluated on labelled texts: a CSV, TSV or JSON lines "
                     "file with text and label columns, as qkv finetune classify reads)");
  }
  Generator unused = Generator::drawing_nothing();
  train::SequenceClassifier classifier(*loaded.model, head.classes(), unused, head.bias.defined());
  classifier.head.weight.copy_(head.weight);
  if (head.bias.defined()) classifier.head.bias.copy_(head.bias);
  const train::Pooling pooling = head.last_real ? train::Pooling::LastReal : train::Pooling::Last;
  const auto m = train::evaluate_classifier(classifier, split, 8, 0, pooling);
  if (options.json) {
    nlohmann::ordered_json j = {{"model", options.model.path()}, {"text", options.text_path}, {"texts", texts.size()},
                                {"classes", head.labels}, {"accuracy", m.accuracy}, {"loss", m.loss}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("accuracy %.2f%%  loss %.6f  (%zu texts, %lld classes: %s)\n", 100 * m.accuracy, m.loss, texts.size(),
                static_cast<long long>(head.classes()), loaded.description.c_str());
  }
  return 0;
}
// --kl-reference: the model's next-token distributions against the reference's on the same tokens (llama-perplexity
// --kl-divergence), in windows that do not overlap: --context, else 512 tokens (two vocabularies of logits per
// window are held).
int eval_divergence(const EvalCommand& options, const LoadedModel& loaded, const std::vector<int64_t>& ids) {
  if (!options.plot_path.empty() || options.stride > 0) throw UsageError("--kl-reference compares whole windows: no --plot or --stride");
  ModelOptions reference_options;
  reference_options.checkpoint = options.kl_reference;
  reference_options.hint = options.model.hint;
  reference_options.vocab_dir = options.model.vocab_dir;
  const LoadedModel reference = load_model(reference_options);  // as its file stores it (an F32 file: float32)
  if (reference.model->vocab_size() != loaded.model->vocab_size())
    throw UsageError("--kl-reference " + options.kl_reference + " has " + std::to_string(reference.model->vocab_size()) +
                     " tokens and the model " + std::to_string(loaded.model->vocab_size()) + ": give the same model");
  const int64_t context = options.context > 0 ? options.context
                                              : std::min({int64_t{512}, loaded.model->context_length(), reference.model->context_length()});
  if (!options.json)
    std::fprintf(stderr, "qkv eval: %s against %s, %zu tokens of %s in windows of %lld\n", loaded.description.c_str(),
                 reference.description.c_str(), ids.size(), options.text_path.c_str(), static_cast<long long>(context));
  ProgressLine line(!options.json);
  const auto began = std::chrono::steady_clock::now();
  nn::Divergence d;
  try {
    d = nn::next_token_divergence(*reference.model, *loaded.model, ids, context, [&](int64_t done, int64_t total) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
      line.draw(done, total, " window " + std::to_string(done) + "/" + std::to_string(total) + "  ETA " +
                                 format_duration(seconds / static_cast<double>(done) * static_cast<double>(total - done)));
    });
  } catch (const ValueError& e) {
    throw UsageError(std::string("--kl-reference: ") + e.what());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  if (options.json) {
    nlohmann::ordered_json j = {{"model", options.model.path()}, {"weights", options.model.weights},
                                {"reference", options.kl_reference}, {"text", options.text_path}, {"context", context},
                                {"positions", d.positions}, {"mean_kl", d.mean_kl}, {"median_kl", d.median_kl},
                                {"p99_kl", d.p99_kl}, {"max_kl", d.max_kl}, {"top1_agreement", d.top1_agreement},
                                {"perplexity", d.perplexity}, {"reference_perplexity", d.reference_perplexity},
                                {"seconds", seconds}};
    std::cout << j.dump(2) << "\n";
  } else {
    line.message("");
    std::printf("KL divergence %.6f mean, %.6f median, %.6f 99%%, %.6f max; top-1 agreement %.2f%%; perplexity %.4f "
                "(reference %.4f); %lld positions, %.1f s\n",
                d.mean_kl, d.median_kl, d.p99_kl, d.max_kl, 100 * d.top1_agreement, d.perplexity, d.reference_perplexity,
                static_cast<long long>(d.positions), seconds);
  }
  return 0;
}

}  // namespace

int run_eval(const EvalCommand& options) {
  // --plot NAME: NAME.png/.svg/.pdf as given, else with --format's extension; checked before the model loads.
  std::string plot_path = options.plot_path;
  if (!plot_path.empty() && fs::path(plot_path).extension().empty()) plot_path = viz::picture_path(plot_path, options.pictures);
  if (!plot_path.empty()) {
    try {
      viz::picture_format_of(plot_path);
    } catch (const ValueError& e) {
      throw UsageError(std::string("--plot: ") + e.what());
    }
  }
  const auto start = std::chrono::steady_clock::now();
  LoadedModel loaded = load_model(options.model);
  if (loaded.is_classifier()) return eval_classifier(options, loaded);
  const nn::LanguageModel& model = *loaded.model;
  const text::Tokenizer* tokenizer = loaded.tokenizer.get();
  const std::string path = options.text_path == "-" ? "/dev/stdin" : options.text_path;
  const std::vector<std::byte> bytes = io::read_file(path, kMaxTextBytes);
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  if (options.replace_invalid) text = text::replace_invalid_utf8(text);
  std::vector<int64_t> ids;
  try {
    ids = tokenizer->encode(text);
  } catch (const ValueError& e) {
    throw ValueError(options.text_path + ": " + e.what());
  }
  const int64_t context = options.context > 0 ? options.context : loaded.default_context;
  if (context > model.context_length()) {
    throw UsageError("--context " + std::to_string(context) + " is longer than the model's context_length " +
                     std::to_string(model.context_length()));
  }
  const int64_t stride = options.stride > 0 ? options.stride : context;
  if (stride > context) throw UsageError("--stride " + std::to_string(stride) + " exceeds the window of " + std::to_string(context) + " tokens");
  if (ids.size() < 2)  // the text's problem (exit 1), not the command line's
    throw ValueError(options.text_path + " has " + count_of(static_cast<int64_t>(ids.size()), "token") +
                     "; scoring needs at least 2");
  // Logits are batch × context × vocabulary floats: keep them under 256 MiB unless told otherwise.
  const int64_t batch = options.batch_size > 0 ? options.batch_size
                                                : std::max<int64_t>(1, (int64_t{256} << 20) / (4 * context * model.vocab_size()));
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!options.kl_reference.empty()) return eval_divergence(options, loaded, ids);
  if (!options.json) {
    std::fprintf(stderr, "qkv eval: %s, %zu %s tokens of %s, windows of %lld every %lld tokens\n", loaded.description.c_str(),
                 ids.size(), tokenizer->name().c_str(), options.text_path.c_str(), static_cast<long long>(context),
                 static_cast<long long>(stride));
  }
  ProgressLine line(!options.json);
  const auto began = std::chrono::steady_clock::now();
  int64_t scored_so_far = 0, counted = 0;  // tokens scored by the first `counted` windows
  const auto windows = train::eval_windows(static_cast<int64_t>(ids.size()), context, stride);
  const train::TextEvaluation result = train::evaluate_text(model, ids, context, stride, batch, [&](int64_t done, int64_t total) {
    for (; counted < done; ++counted) scored_so_far += windows[static_cast<size_t>(counted)].fresh;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    char text_line[160];
    std::snprintf(text_line, sizeof text_line, " window %lld/%lld  %.0f tok/s  ETA %s", static_cast<long long>(done),
                  static_cast<long long>(total), static_cast<double>(scored_so_far) / std::max(seconds, 1e-9),
                  format_duration(seconds / static_cast<double>(done) * static_cast<double>(total - done)).c_str());
    line.draw(done, total, text_line);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  const double tokens_per_second = static_cast<double>(result.scored) / std::max(seconds, 1e-9);
  if (options.json) {
    nlohmann::ordered_json j;
    j["model"] = options.model.path();
    j["text"] = options.text_path;
    j["tokenizer"] = tokenizer->name();
    j["tokens"] = ids.size();
    j["scored_tokens"] = result.scored;
    j["windows"] = result.windows;
    j["context"] = context;
    j["stride"] = stride;
    j["loss"] = result.loss;
    j["perplexity"] = result.perplexity;
    j["seconds"] = seconds;
    j["load_seconds"] = load_seconds;
    j["tokens_per_second"] = tokens_per_second;
    std::cout << j.dump(2) << "\n";
  } else {
    line.message("");
    std::printf("loss %.6f  perplexity %.4f  (%lld tokens scored in %lld windows, %.1f s, %.0f tokens/s)\n", result.loss,
                result.perplexity, static_cast<long long>(result.scored), static_cast<long long>(result.windows), seconds,
                tokens_per_second);
  }
  if (!plot_path.empty()) {
    viz::Series per_window{"loss of the window's scored tokens", {31, 119, 180}, {}};
    for (size_t i = 0; i < windows.size() && i < result.window_losses.size(); ++i)
      per_window.points.emplace_back(static_cast<double>(windows[i].end), result.window_losses[i]);
    const double last = static_cast<double>(windows.back().end);
    char mean_label[64];
    std::snprintf(mean_label, sizeof mean_label, "mean %.4f", result.loss);
    viz::Series mean{mean_label, {214, 39, 40}, {{0.0, result.loss}, {last, result.loss}}, true};
    char title[200];
    std::snprintf(title, sizeof title, "qkv eval: loss along the text (windows of %lld, stride %lld)",
                  static_cast<long long>(context), static_cast<long long>(stride));
    viz::save_plot(plot_path, {per_window, mean},
                   {.title = title, .x_label = "token position (window end)", .y_label = "loss (nats)"}, options.pictures);
    if (!options.json) std::fprintf(stderr, "  [plot: %s]\n", plot_path.c_str());
  }
  return 0;
}

Runner setup_eval(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<EvalCommand>();
  add_model_options(cmd, o->model);
  add_weights_option(cmd, o->model);
  cmd.add_option("--text", o->text_path, "UTF-8 text to score (- for standard input)")->required();
  cmd.add_option("--context", o->context, "Window length (default: the model's context_length; for a Hugging Face "
                                          "folder at most 2048)")
      ->check(int_at_least(1));
  cmd.add_option("--stride", o->stride, "Tokens between window starts (default: the window length; smaller gives each "
                                        "token more context and costs more)")
      ->check(int_at_least(1));
  cmd.add_option("--batch-size", o->batch_size, "Windows per forward pass (default: what keeps the logits under 256 MiB)")
      ->check(int_at_least(1));
  cmd.add_option("--plot", o->plot_path, "Also draw the loss of each window along the text (FILE.png, .svg or .pdf; a "
                                         "name without one gets --format's)");
  add_picture_options(cmd, o->pictures);
  cmd.add_option("--kl-reference", o->kl_reference, "Compare the model's next-token distributions with this model's "
                                                    "(the same model in full precision: a folder or an F32 GGUF): KL "
                                                    "divergence and top-1 agreement, as llama-perplexity --kl-divergence")
      ->transform(folder_path());
  cmd.add_flag("--json", o->json, "Print one JSON object (loss, perplexity, tokens, tokens/s …) on stdout");
  cmd.add_flag("--replace-invalid", o->replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");
  add_precision_option(cmd, context);
  return [o, &context] {
    o->model.bf16_weights = context.precision == Precision::BF16;
    return run_eval(*o);
  };
}

}  // namespace qkv::cli
