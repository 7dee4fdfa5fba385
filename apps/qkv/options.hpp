// The option groups the qkv commands share (model, sampling, pictures, fine-tuning, precision) and the checks that
// turn a bad value into a usage error in qkv's words, never CLI11's internals ("Check jpg value in {…} FAILED").
// Not here: any one command's own options (each command's setup_* function, beside its run_*).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "commands.hpp"

namespace qkv::cli {

// A check that runs one of qkv's parsers: `check` returns "" when the text is good, else what is wrong with it
// ("must be at least 1, not 0"); CLI11 puts the option's name in front. The check has no name of its own, so help
// shows `--steps INT=500`, not `TEXT:VALUE=500`.
CLI::Validator checked(std::function<std::string(const std::string&)> check);
// What a qkv parser's error says without its leading `what = ` (CLI11 names the option already).
std::string parse_problem(const Error& error, const std::string& what);

// A path whose trailing slashes go ("pictures/" → "pictures"), so the files named in it read pictures/01-v1-A.png,
// not pictures//01-v1-A.png; "/" stays.
CLI::Validator folder_path();
CLI::Validator int_at_least(int64_t least);
CLI::Validator int_in_range(int64_t least, int64_t most);
CLI::Validator positive_real();
CLI::Validator non_negative_real();
// One of `names`; the error lists them: "must be one of gpt2, bytes; not \"gpt3\"".
CLI::Validator one_of(std::vector<std::string> names);

// How to read a book state dict: --config, --n-heads, --tokenizer (generate, attention, eval and convert).
void add_config_options(CLI::App& command, nn::ConfigHint& hint);
// --checkpoint FILE | --gpt2 FILE, the configuration of a book state dict, --vocab DIR and --adapter DIR.
void add_model_options(CLI::App& command, ModelOptions& model);
// --weights of the inference commands: how the model's matrices are kept in memory (stored, or a type to convert to).
void add_weights_option(CLI::App& command, ModelOptions& model);
// --kv-cache f32|f16|bf16|q8_0 into `type` (checked; kernels::weight_type_from_name reads it)
CLI::Option* add_kv_cache_option(CLI::App& command, std::string& type);
// --format png|svg|pdf and --scale of every command that draws (`names`: the format option's names; instruct's
// --format is its prompt format, so it takes --picture-format alone).
void add_picture_options(CLI::App& command, viz::PictureOptions& pictures,
                         const std::string& names = "--format,--picture-format");
// Sampling options of generate and chat: counts checked whole and in range (a NaN or a negative count is a usage
// error, never a silent default). generate.sampling_given lists the sampling options given, for the note below.
void add_sampling_options(CLI::App& command, GenerateCommand& generate);
// With --greedy, a note on stderr naming the sampling options given that it makes unused (--temperature 1.5).
void note_unused_sampling(const GenerateCommand& generate, const char* command);
// --precision of a command that multiplies matrices, into context.precision_text (main.cpp resolves it).
void add_precision_option(CLI::App& command, CommandContext& context);

// Both fine-tuning commands' training and LoRA options (the book's defaults shown).
template <typename Options>
void add_finetune_options(CLI::App& cmd, Options& o, std::string& lora_targets, bool& overwrite) {
  cmd.add_option("--lr", o.lr, "AdamW learning rate")->capture_default_str()->check(positive_real());
  cmd.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str()->check(non_negative_real());
  cmd.add_option("--epochs", o.epochs, "Passes over the training split")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--batch-size", o.batch_size, "Examples per step")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--eval-freq", o.eval_freq, "Evaluate every N steps")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--eval-iter", o.eval_iter, "Batches per evaluation")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--seed", o.seed, "Seed of the new weights (head, LoRA's A) and of the shuffling")->capture_default_str();
  cmd.add_option("--lora-rank", o.lora.rank, "Train LoRA adapters of this rank instead of the weights (0: none)")
      ->capture_default_str()->check(int_at_least(0));
  cmd.add_option("--lora-alpha", o.lora.alpha, "LoRA's alpha: the update is scaled by alpha / rank (default: the rank)")
      ->check(positive_real());
  cmd.add_option("--lora-targets", lora_targets, "Layers LoRA adapts: all, attention, qkv, mlp, or module-name patterns, "
                                                 "comma-separated")->capture_default_str();
  cmd.add_flag("--overwrite", overwrite, "Replace a fine-tuned model already in --out");
  o.pad_id = -1;  // the tokenizer's end of text unless given
  cmd.add_option("--pad-id", o.pad_id, "Padding (and appended end-of-text) token (default: the tokenizer's end of text, "
                                       "GPT-2's 50256)")
      ->check(int_at_least(0));
}

}  // namespace qkv::cli
