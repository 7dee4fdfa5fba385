// `qkv attention`: what a trained GPT attends to for a prompt — a layers × heads grid, a heatmap per head, the
// weights as safetensors and an interactive HTML page, all from the fused path (weights recomputed per head).
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/viz/report.hpp"

namespace qkv::cli {

namespace {
// 1-based numbers from the command line → 0-based indices, each checked against the model.
std::vector<int64_t> indices(const std::vector<int64_t>& numbers, int64_t count, const char* what) {
  std::vector<int64_t> out;
  for (int64_t n : numbers) {
    if (n < 1 || n > count) {
      throw UsageError(std::string("--") + what + "s " + std::to_string(n) + ": the model has " + what + "s 1…" +
                       std::to_string(count));
    }
    out.push_back(n - 1);
  }
  return out;
}
}  // namespace

int run_attention(const AttentionCommand& options) {
  const auto start = std::chrono::steady_clock::now();
  LoadedModel loaded = load_model(options.model);
  const nn::LanguageModel& model = *loaded.model;
  const text::Tokenizer* tokenizer = loaded.tokenizer.get();
  const std::vector<int64_t> ids = tokenizer->encode(options.prompt);
  if (ids.empty()) throw UsageError("the prompt is empty; give --prompt TEXT");
  if (static_cast<int64_t>(ids.size()) > model.context_length()) {
    throw UsageError("the prompt has " + std::to_string(ids.size()) + " tokens but the model reads at most " +
                     std::to_string(model.context_length()) + " (context_length); shorten it");
  }
  for (int64_t id : ids) {
    if (id >= model.vocab_size()) {
      throw ValueError("the prompt's token id " + std::to_string(id) + " is outside the model's vocabulary of " +
                       std::to_string(model.vocab_size()) + "; was it trained with another tokenizer?");
    }
  }
  viz::AttentionReport report;
  report.title = loaded.description + ", prompt \"" + options.prompt + "\"";
  report.token_ids = ids;
  for (int64_t id : ids) report.tokens.push_back(tokenizer->token_bytes(id));  // split characters keep their bytes
  std::vector<int64_t> layers = indices(options.layers, model.num_layers(), "layer");
  if (layers.empty() && loaded.model->config.has_linear_layers()) {  // Qwen3-Next: its attention layers only
    for (int64_t l = 0; l < model.num_layers(); ++l)
      if (!loaded.model->config.layers[static_cast<size_t>(l)].linear) layers.push_back(l);
    std::fprintf(stderr, "qkv attention: %lld of the %lld layers are Gated DeltaNet, which weigh no positions; showing "
                         "the attention layers\n",
                 static_cast<long long>(model.num_layers() - static_cast<int64_t>(layers.size())),
                 static_cast<long long>(model.num_layers()));
  }
  const std::vector<int64_t> heads = indices(options.heads, model.num_heads(), "head");
  report.maps = model.attention_maps(ids, layers, heads);
  for (int64_t l = 0; l < report.maps.size(0); ++l) report.layers.push_back(layers.empty() ? l + 1 : layers[static_cast<size_t>(l)] + 1);
  for (int64_t l : report.layers) report.windows.push_back(model.layer_window(l - 1));
  report.kv_group = model.num_heads() / std::max<int64_t>(model.num_kv_heads(), 1);
  for (int64_t h = 0; h < report.maps.size(1); ++h) report.heads.push_back(heads.empty() ? h + 1 : heads[static_cast<size_t>(h)] + 1);
  if (const auto* decoder = dynamic_cast<const nn::Decoder*>(&model)) {
    if (decoder->config.family->sinks) {  // what each row gave its head's sink: 1 − the row's weights
      const int64_t L = report.maps.size(0), H = report.maps.size(1), T = report.maps.size(2);
      report.sink_share = Tensor::empty({L, H, T});
      for (int64_t row = 0; row < L * H * T; ++row) {
        double total = 0.0;
        for (int64_t j = 0; j < T; ++j) total += report.maps.data()[row * T + j];
        report.sink_share.data()[row] = static_cast<float>(std::max(0.0, 1.0 - total));
      }
    }
    const nn::Decoder::Routing routing = decoder->expert_routing(ids);
    if (routing.weights.defined()) {
      for (int64_t l : routing.layers) report.expert_layers.push_back(l + 1);
      report.routing = routing.weights;
    }
  }
  const auto written = viz::write_attention_report(options.out_dir, report, options.per_head, options.pictures);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "qkv attention: %s, %s × %s → %s in %s (%.2f s)\n",
               count_of(static_cast<int64_t>(ids.size()), "token").c_str(),
               count_of(static_cast<int64_t>(report.layers.size()), "layer").c_str(),
               count_of(static_cast<int64_t>(report.heads.size()), "head").c_str(),
               count_of(static_cast<int64_t>(written.size()), "file").c_str(), options.out_dir.c_str(), seconds);
  std::fprintf(stderr, "  open %s/attention.html in a browser; %s/attention-grid%s shows every head\n",
               options.out_dir.c_str(), options.out_dir.c_str(), viz::picture_extension(options.pictures.format));
  return 0;
}

Runner setup_attention(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<AttentionCommand>();
  add_model_options(cmd, o->model);
  add_weights_option(cmd, o->model);
  cmd.add_option("--prompt", o->prompt, "The text whose attention to show")->required();
  cmd.add_option("--layers", o->layers, "Layers to show, 1-based (default: all)")->expected(1, -1);
  cmd.add_option("--heads", o->heads, "Heads to show, 1-based (default: all)")->expected(1, -1);
  cmd.add_option("--out", o->out_dir, "Output directory")->capture_default_str()->transform(folder_path());
  auto no_head = std::make_shared<bool>(false);
  auto* no_head_pictures = cmd.add_flag("--no-head-pictures", *no_head, "Skip the per-head pictures (grid, data and "
                                                                        "HTML only)");
  cmd.add_flag("--no-head-png", *no_head, "The same as --no-head-pictures")->excludes(no_head_pictures);
  add_picture_options(cmd, o->pictures);
  add_precision_option(cmd, context);
  return [o, no_head, &context] {
    o->per_head = !*no_head;
    o->model.bf16_weights = context.precision == Precision::BF16;
    return run_attention(*o);
  };
}

}  // namespace qkv::cli
