// `qkv train --resume DIR` with a Hugging Face model folder: continued pretraining of a decoder (Llama 3, Qwen2/3,
// Gemma 3, GPT-2) on a text tokenised by the folder's own tokenizer, through qkv train's Trainer — AdamW with warmup
// and cosine decay, gradient clipping, a validation split evaluated every --eval-every steps, several processes under
// mpirun — with a progress line, losses.csv, and the trained folder written to OUT/model (config.json,
// model.safetensors, the tokenizer files) every --checkpoint-every steps and at the end, each file replaced atomically.
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

int run_train_folder(const TrainCommand& options, train::Communicator& comm) {
  namespace fs = std::filesystem;
  const bool lead = comm.rank() == 0;  // under mpirun, process 0 alone writes and talks
  // Every process reads the folder and the text; a problem on any stops all (set_up_everywhere).
  std::unique_ptr<train::Trainer> trainer_owner;
  train::TrainSettings s;
  std::string description;
  int64_t context = 0, parameters = 0;
  const std::filesystem::path out_dir(options.out_dir), model_dir = out_dir / "model";
  std::error_code ec;
  set_up_everywhere(comm, [&] {
    // The command line's settings over the defaults, checked before the folder loads (that can take seconds) and
    // again with the folder's sizes.
    std::map<std::string, std::string> strings = options.settings.to_strings();
    for (const auto& [key, value] : options.overrides) strings[key] = value;
    parse_train_settings(strings, options, "default");
    ModelOptions source;
    source.checkpoint = options.resume;
    LoadedModel loaded = load_model(source);
    auto* raw = dynamic_cast<nn::Decoder*>(loaded.model.get());
    if (!raw) throw UsageError(options.resume + " holds no decoder qkv can train");
    std::unique_ptr<nn::Decoder> decoder(raw);
    loaded.model.release();  // owned by `decoder` now
    // Windows of 256 tokens unless --context-length says otherwise, never more than the model has.
    context = options.overrides.count("context_length")
                                ? std::min(parse_int(options.overrides.at("context_length"), "--context-length"), decoder->context_length())
                                : std::min<int64_t>(256, decoder->context_length());
    strings["context_length"] = std::to_string(context);
    strings["vocab_size"] = std::to_string(decoder->vocab_size());
    s = parse_train_settings(strings, options, "default");
    std::string corpus = read_corpus(options.text_path);
    if (options.replace_invalid) corpus = text::replace_invalid_utf8(corpus);
    std::vector<int64_t> ids;
    try {
      ids = loaded.tokenizer->encode(corpus);
    } catch (const ValueError& e) {
      throw ValueError((options.text_path.empty() ? std::string("the corpus") : options.text_path) + ": " + e.what());
    }
    if (fs::exists(model_dir / "config.json", ec) && !options.overwrite)
      throw UsageError(model_dir.string() + " already holds a model; give --overwrite to replace it, or another --out");
    if (lead) fs::create_directories(out_dir, ec);
    parameters = decoder->parameter_count();
    description = loaded.description;
    // The trainer of `qkv train`: AdamW with warmup and cosine decay, clipping, a validation split and its evaluations,
    // and across processes under mpirun.
    trainer_owner = std::make_unique<train::Trainer>(s, ids, &comm, std::move(decoder));
  });
  train::Trainer& trainer = *trainer_owner;
  nn::Decoder& model = trainer.model();
  if (lead) {
    std::fprintf(stderr,
                 "qkv train: continuing %s (%lld parameters) on %lld training and %lld validation windows of %lld tokens, "
                 "global batch %lld, %lld steps\n",
                 description.c_str(), static_cast<long long>(parameters), static_cast<long long>(trainer.train_windows()),
                 static_cast<long long>(trainer.validation_windows()), static_cast<long long>(context),
                 static_cast<long long>(trainer.global_batch()), static_cast<long long>(s.max_steps));
    std::fprintf(stderr, "precision: %s\n", describe_precision(trainer.precision(), s.precision).c_str());
    note_schedule(s, 0);
  }
  auto save = [&](int64_t) {
    if (!lead) return;
    nn::save_hf_folder(model_dir.string(), model);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                          "chat_template.jinja", "chat_template.json"})
      if (fs::exists(fs::path(options.resume) / f, ec)) fs::copy_file(fs::path(options.resume) / f, model_dir / f, fs::copy_options::overwrite_existing, ec);
  };
  std::string csv = "step,loss,learning_rate,grad_norm,eval_train_loss,eval_validation_loss\n";
  std::vector<std::string> rows;
  Progress progress(s.max_steps, 0, lead);
  try {
    trainer.run(
        [&](const train::StepReport& r) {
          char row[160];
          std::snprintf(row, sizeof row, "%lld,%.6f,%.6g,%.4f", static_cast<long long>(r.step), r.loss, r.learning_rate, r.grad_norm);
          rows.push_back(std::string(row) + ",,");
          progress.step(r);
        },
        [&](const train::EvalReport& e) {
          char text[160];
          std::snprintf(text, sizeof text, "step %lld: train loss %.4f, validation loss %.4f", static_cast<long long>(e.step),
                        e.train_loss, e.validation_loss);
          progress.message(text);
          std::snprintf(text, sizeof text, ",%.6f,%.6f", e.train_loss, e.validation_loss);
          if (!rows.empty()) rows.back() = rows.back().substr(0, rows.back().size() - 2) + text;
        },
        [&](int64_t step) {
          if (step < s.max_steps) save(step);
        },
        nullptr);
  } catch (const train::TrainingDiverged& e) {
    throw ValueError(std::string(e.what()) + ". Lower --lr (or raise --warmup) and train again");
  }
  save(trainer.step());
  if (!lead) return 0;
  for (const std::string& r : rows) csv += r + "\n";
  io::write_file_atomically((out_dir / "losses.csv").string(),
                            std::span(reinterpret_cast<const std::byte*>(csv.data()), csv.size()));
  std::fprintf(stderr, "qkv train: wrote %s (load it with --checkpoint %s) and %s\n", model_dir.c_str(), model_dir.c_str(),
               (out_dir / "losses.csv").c_str());
  return 0;
}

}  // namespace qkv::cli
