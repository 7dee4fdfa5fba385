// `qkv train --resume DIR` with a Hugging Face model folder: continued pretraining of a decoder (Llama 3, Qwen2/3,
// Gemma 3) on a text tokenised by the folder's own tokenizer — AdamW with warmup and cosine decay, gradient clipping,
// a progress line, losses.csv, and the trained folder written to OUT/model (config.json, model.safetensors, the
// tokenizer files) every --checkpoint-every steps and at the end, each file replaced atomically.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "commands.hpp"
#include "progress.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/text/dataset.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::cli {

int run_train_folder(const TrainCommand& options) {
  namespace fs = std::filesystem;
  // The command line's settings over the defaults, parsed and checked once (the model's own sizes come from the folder).
  std::map<std::string, std::string> strings = options.settings.to_strings();
  for (const auto& [key, value] : options.overrides) strings[key] = value;
  train::TrainSettings s;
  try {
    s = train::TrainSettings::from_strings(strings);
  } catch (const ValueError& e) {
    throw UsageError(e.what());
  }
  ModelOptions source;
  source.checkpoint = options.resume;
  LoadedModel loaded = load_model(source);
  auto* decoder = dynamic_cast<nn::Decoder*>(loaded.model.get());
  if (!decoder) throw UsageError(options.resume + " is a GPT-2 folder: train from its model.safetensors (--resume FILE)");
  const int64_t context = options.overrides.count("context_length")
                              ? std::min(s.model.context_length, decoder->context_length())
                              : std::min<int64_t>(256, decoder->context_length());
  std::string corpus = read_corpus(options.text_path);
  if (options.replace_invalid) corpus = text::replace_invalid_utf8(corpus);
  std::vector<int64_t> ids;
  try {
    ids = loaded.tokenizer->encode(corpus);
  } catch (const ValueError& e) {
    throw ValueError((options.text_path.empty() ? std::string("the corpus") : options.text_path) + ": " + e.what());
  }
  for (int64_t id : ids)
    if (id >= decoder->vocab_size()) throw ValueError("token id " + std::to_string(id) + " is outside the model's vocabulary");
  const text::SlidingWindowDataset data(std::move(ids), context, context);
  const text::DataLoader loader(data, s.batch_size, true, s.seed);
  const fs::path out_dir(options.out_dir), model_dir = out_dir / "model";
  std::error_code ec;
  if (fs::exists(model_dir / "config.json", ec) && !options.overwrite)
    throw UsageError(model_dir.string() + " already holds a model; give --overwrite to replace it, or another --out");
  fs::create_directories(out_dir, ec);
  decoder->train();
  auto parameters = decoder->named_trainable_parameters();
  optim::AdamWOptions adam;
  adam.lr = s.learning_rate;
  adam.beta1 = s.adam_beta1, adam.beta2 = s.adam_beta2, adam.eps = s.adam_eps, adam.weight_decay = s.weight_decay;
  optim::AdamW optimizer(parameters, adam);
  std::fprintf(stderr, "qkv train: continuing %s (%lld parameters) on %lld windows of %lld tokens, batch %lld, %lld steps\n",
               loaded.description.c_str(), static_cast<long long>(decoder->parameter_count()),
               static_cast<long long>(data.size()), static_cast<long long>(context), static_cast<long long>(s.batch_size),
               static_cast<long long>(s.max_steps));
  auto save = [&] {
    nn::save_hf_folder(model_dir.string(), *decoder);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"})
      if (fs::exists(fs::path(options.resume) / f, ec)) fs::copy_file(fs::path(options.resume) / f, model_dir / f, fs::copy_options::overwrite_existing, ec);
  };
  std::string csv = "step,loss,learning_rate,grad_norm\n";
  ProgressLine line(true);
  const auto began = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < s.max_steps; ++step) {
    const text::Batch batch = loader.batch(step);
    const double lr = train::learning_rate_at(s, step);
    optimizer.set_lr(lr);
    optimizer.zero_grad(true);
    Tensor loss = decoder->loss(batch.inputs, batch.batch, batch.tokens, batch.targets);
    const double value = loss.item();
    if (!std::isfinite(value)) throw train::TrainingDiverged("the loss became " + std::to_string(value) + " at step " + std::to_string(step));
    loss.backward();
    const double norm = s.grad_clip > 0 ? train::clip_grad_norm(parameters, s.grad_clip) : train::gradient_norm(parameters);
    if (!std::isfinite(norm)) throw train::TrainingDiverged("the gradient became non-finite at step " + std::to_string(step));
    optimizer.step();
    char row[128];
    std::snprintf(row, sizeof row, "%lld,%.6f,%.6g,%.4f\n", static_cast<long long>(step + 1), value, lr, norm);
    csv += row;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    char text[160];
    std::snprintf(text, sizeof text, " step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s", static_cast<long long>(step + 1),
                  static_cast<long long>(s.max_steps), value, lr,
                  static_cast<double>((step + 1) * batch.batch * batch.tokens) / std::max(seconds, 1e-9));
    line.draw(step + 1, s.max_steps, text);
    if (s.checkpoint_every > 0 && (step + 1) % s.checkpoint_every == 0 && step + 1 < s.max_steps) save();
  }
  save();
  io::write_file_atomically((out_dir / "losses.csv").string(),
                            std::span(reinterpret_cast<const std::byte*>(csv.data()), csv.size()));
  std::fprintf(stderr, "qkv train: wrote %s (load it with --checkpoint %s) and %s\n", model_dir.c_str(), model_dir.c_str(),
               (out_dir / "losses.csv").c_str());
  return 0;
}

}  // namespace qkv::cli
