// qkv: the command-line tool. Thin: parse the command line, call the library, print, map errors to exit
// codes (0 success, 1 a problem with the input or files, 2 a usage error).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>

#include "commands.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/version.hpp"

namespace {
// A CLI11 check that runs one of qkv's parsers (and an extra condition), so a bad number is a usage error that
// says what is wrong.
template <typename Parse>
CLI::Validator checked(const char* name, Parse parse) {
  return CLI::Validator(
      [parse](std::string& text) -> std::string {
        try {
          return parse(text);
        } catch (const qkv::Error& e) {
          return e.what();
        }
      },
      name);
}

CLI::Validator int_at_least(const char* what, int64_t least);

// How to read a book state dict: --config, --n-heads, --tokenizer (generate, attention, eval and convert).
void add_config_options(CLI::App* command, qkv::nn::ConfigHint& hint) {
  command->add_option("--config", hint.config,
                      "For a book state dict: the book's configuration dict as a JSON file (GPT_CONFIG_124M; Python's "
                      "True/False accepted) or a preset: gpt2-small, gpt2-medium, gpt2-large, gpt2-xl");
  command->add_option("--n-heads", hint.n_heads, "For a book state dict: its attention heads (the one setting its "
                                                 "tensors do not show)")
      ->check(int_at_least("--n-heads", 1));
  command->add_option("--tokenizer", hint.tokenizer, "gpt2 or bytes (default: the checkpoint's; for a .pth, bytes "
                                                     "when the vocabulary is 256, else gpt2)")
      ->check(CLI::IsMember({"gpt2", "bytes"}));
}

// The model options of generate, attention and eval: --checkpoint FILE | --gpt2 FILE, the configuration of a book
// state dict and --vocab DIR.
void add_model_options(CLI::App* command, qkv::cli::ModelOptions& m) {
  auto* ckpt = command->add_option("--checkpoint", m.checkpoint,
                                   "The model: a qkv checkpoint, a PyTorch .pth (the book's model.pth or "
                                   "model_and_optimizer.pth), or a safetensors state dict (book or Hugging Face names)");
  auto* gpt2 = command->add_option("--gpt2", m.gpt2_path, "GPT-2 weights: Hugging Face model.safetensors");
  ckpt->excludes(gpt2);
  add_config_options(command, m.hint);
  command->add_option("--vocab", m.vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe");
  command->add_option("--adapter", m.adapter, "A LoRA adapter folder (PEFT's adapter_config.json and "
                                              "adapter_model.safetensors, as qkv finetune --lora-rank writes) to apply");
}

// --weights of the inference commands: how the model's matrices are kept in memory.
void add_weights_option(CLI::App* command, qkv::cli::ModelOptions& m) {
  command->add_option("--weights", m.weights,
                      "How matrices are kept in memory: stored (as the file stores them: a bf16 folder stays bf16), or "
                      "converted while loading to f32, bf16, f16, q8_0, q4_0, q4_k, q5_k or q6_k (ggml's block formats)")
      ->capture_default_str()
      ->check(checked("TYPE", [](const std::string& text) {
        return text == "stored" || qkv::kernels::weight_type_from_name(text) ? std::string()
                                                                              : "--weights " + text + " is not stored, f32, bf16, f16, q8_0, q4_0, q4_k, q5_k or q6_k";
      }));
}

// An integer option's check: a whole number of at least `least`, or a usage error saying so.
CLI::Validator int_at_least(const char* what, int64_t least) {
  return checked("INT", [what, least](const std::string& text) {
    return qkv::parse_int(text, what) >= least ? std::string()
                                               : std::string(what) + " must be at least " + std::to_string(least);
  });
}
CLI::Validator positive_real(const char* what) {
  return checked("NUMBER", [what](const std::string& text) {
    return qkv::parse_real(text, what) > 0 ? std::string() : std::string(what) + " must be a positive number";
  });
}

// An integer option's check: a whole number in [least, most], or a usage error naming the range in integers.
CLI::Validator int_in_range(const char* what, int64_t least, int64_t most) {
  return checked("INT", [what, least, most](const std::string& text) {
    const int64_t v = qkv::parse_int(text, what);
    return v >= least && v <= most ? std::string()
                                   : std::string(what) + " must be a whole number from " + std::to_string(least) +
                                         " to " + std::to_string(most) + ", not " + text;
  });
}

// --format png|svg|pdf and --scale of every command that draws (`names`: the format option's names; instruct's
// --format is its prompt format, so it takes --picture-format alone).
void add_picture_options(CLI::App* cmd, qkv::viz::PictureOptions& p,
                         const std::string& names = "--format,--picture-format") {
  const std::map<std::string, qkv::viz::PictureFormat> formats{
      {"png", qkv::viz::PictureFormat::png}, {"svg", qkv::viz::PictureFormat::svg}, {"pdf", qkv::viz::PictureFormat::pdf}};
  cmd->add_option(names, p.format, "Pictures as png, svg or pdf (vectors, for papers and slides)")
      ->transform(CLI::CheckedTransformer(formats, CLI::ignore_case))
      ->default_str("png");
  cmd->add_option("--scale", p.scale, "PNG pixels per point: 2 for HiDPI screens (0.25 to 8)")->capture_default_str()
      ->check(checked("SCALE", [](const std::string& text) {
        const double v = qkv::parse_real(text, "--scale");
        return v >= 0.25 && v <= 8.0 ? std::string() : "--scale must lie in 0.25 … 8, not " + text;
      }));
}

// Both fine-tuning commands' training and LoRA options (the book's defaults shown).
template <typename Options>
void add_finetune_options(CLI::App* cmd, Options& o, std::string& lora_targets, bool& overwrite) {
  cmd->add_option("--lr", o.lr, "AdamW learning rate")->capture_default_str()->check(positive_real("--lr"));
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str()
      ->check(checked("NUMBER", [](const std::string& t) {
        return qkv::parse_real(t, "--weight-decay") >= 0 ? std::string() : "--weight-decay must not be negative";
      }));
  cmd->add_option("--epochs", o.epochs, "Passes over the training split")->capture_default_str()->check(int_at_least("--epochs", 1));
  cmd->add_option("--batch-size", o.batch_size, "Examples per step")->capture_default_str()->check(int_at_least("--batch-size", 1));
  cmd->add_option("--eval-freq", o.eval_freq, "Evaluate every N steps")->capture_default_str()->check(int_at_least("--eval-freq", 1));
  cmd->add_option("--eval-iter", o.eval_iter, "Batches per evaluation")->capture_default_str()->check(int_at_least("--eval-iter", 1));
  cmd->add_option("--seed", o.seed, "Seed of the new weights (head, LoRA's A) and of the shuffling")->capture_default_str();
  cmd->add_option("--lora-rank", o.lora.rank, "Train LoRA adapters of this rank instead of the weights (0: none)")
      ->capture_default_str()->check(int_at_least("--lora-rank", 0));
  cmd->add_option("--lora-alpha", o.lora.alpha, "LoRA's alpha: the update is scaled by alpha / rank (default: the rank)")
      ->check(positive_real("--lora-alpha"));
  cmd->add_option("--lora-targets", lora_targets, "Layers LoRA adapts: all, attention, qkv, mlp, or module-name patterns, "
                                                  "comma-separated")->capture_default_str();
  cmd->add_flag("--overwrite", overwrite, "Replace a fine-tuned model already in --out");
  o.pad_id = -1;  // the tokenizer's end of text unless given
  cmd->add_option("--pad-id", o.pad_id, "Padding (and appended end-of-text) token (default: the tokenizer's end of text, "
                                        "GPT-2's 50256)")
      ->check(int_at_least("--pad-id", 0));
}

// Sampling options of generate and chat: counts checked whole and in range (a NaN or a negative count is a usage
// error, never a silent default).
void add_sampling_options(CLI::App* cmd, qkv::cli::GenerateCommand& g) {
  const auto count = [](const char* what) {
    return checked("COUNT", [what](const std::string& text) {
      return qkv::parse_int(text, what) >= 0 ? std::string() : std::string(what) + " must not be negative";
    });
  };
  cmd->add_option("--max-new-tokens", g.max_new_tokens, "Tokens to generate")->capture_default_str()
      ->check(count("--max-new-tokens"));
  cmd->add_option("--temperature", g.temperature, "Sampling temperature (0: greedy)")->capture_default_str()
      ->check(checked("NUMBER", [](const std::string& text) {
        return qkv::parse_real(text, "--temperature") >= 0 ? std::string() : "--temperature must be at least 0";
      }));
  cmd->add_option("--top-k", g.top_k, "Sample from the k likeliest tokens (0: all)")->capture_default_str()
      ->check(count("--top-k"));
  cmd->add_option("--top-p", g.top_p, "Nucleus sampling threshold, in (0, 1]")->capture_default_str()
      ->check(checked("P", [](const std::string& text) {
        const double v = qkv::parse_real(text, "--top-p");
        return v > 0.0 && v <= 1.0 ? std::string() : "--top-p must lie in (0, 1]";
      }));
  cmd->add_option("--seed", g.seed, "Sampling seed")->capture_default_str()
      ->check(checked("SEED", [](const std::string& text) {
        qkv::parse_uint(text, "--seed");
        return std::string();
      }));
  const auto real_in = [](const char* what, double low, double high) {
    return checked("NUMBER", [=](const std::string& text) {
      const double v = qkv::parse_real(text, what);
      if (v >= low && v <= high) return std::string();
      char range[64];
      std::snprintf(range, sizeof range, "[%g, %g]", low, high);
      return std::string(what) + " must lie in " + range;
    });
  };
  cmd->add_option("--min-p", g.min_p, "Keep tokens at least this fraction of the likeliest one's probability (0: off)")
      ->capture_default_str()->check(real_in("--min-p", 0.0, 1.0));
  cmd->add_option("--repetition-penalty", g.repetition_penalty,
                  "Divide the positive logits (multiply the negative) of tokens already seen (1: off)")
      ->capture_default_str()->check(real_in("--repetition-penalty", 1e-3, 1e3));
  cmd->add_option("--presence-penalty", g.presence_penalty, "Subtract from the logit of every token seen (0: off)")
      ->capture_default_str()->check(real_in("--presence-penalty", -100.0, 100.0));
  cmd->add_option("--frequency-penalty", g.frequency_penalty, "Subtract per time a token was seen (0: off)")
      ->capture_default_str()->check(real_in("--frequency-penalty", -100.0, 100.0));
  cmd->add_flag("--replace-invalid", g.replace_invalid, "Replace invalid UTF-8 in the prompt with U+FFFD");
  cmd->add_flag("--greedy", g.greedy, "Always take the likeliest token");
  cmd->add_flag("--no-cache", g.no_cache, "Recompute the whole context for every token (slow; for comparison)");
}

// 0 if everything written to standard output reached it; otherwise a message and 1 (a full disk, a closed pipe:
// `qkv tokenize > /dev/full` must not report success).
int check_stdout(int code) {
  std::cout.flush();
  if (std::cout.fail() || std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "qkv: error: cannot write to standard output (%s)\n", std::strerror(errno ? errno : EIO));
    return code == 0 ? 1 : code;
  }
  return code;
}
}  // namespace

int run(int argc, char** argv);

int main(int argc, char** argv) { return check_stdout(run(argc, argv)); }

int run(int argc, char** argv) {
  CLI::App app{"qkv — trainable self-attention, from the article's Q = XWq, K = XWk, V = XWv to a small GPT.\n"
               "Run `qkv demo` for the worked example, `qkv <command> --help` for any command."};
  app.set_version_flag("--version", std::string("qkv ") + qkv::kVersion);
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print help for every command");
  // --threads N anywhere on the line (qkv train --threads 2): the subcommands pass it up to here.
  int threads = 0;
  app.add_option("--threads", threads, "Threads for qkv's kernels (default: OMP_NUM_THREADS, else all cores)")
      ->check(int_in_range("--threads", 1, 1024));
  app.fallthrough();

  qkv::cli::DemoOptions demo;
  auto* demo_cmd = app.add_subcommand(
      "demo", "Walk through the article's example (the book's numbers), or your own sentence, then train");
  demo_cmd->add_option("--section", demo.sections, "Show only these sections (repeatable)")
      ->check(CLI::IsMember(qkv::cli::demo_sections()));
  bool force_color = false, no_color = false;
  auto* color_flag = demo_cmd->add_flag("--color", force_color, "Colour the attention grids (default: on a terminal, "
                                                                 "unless NO_COLOR is set)");
  demo_cmd->add_flag("--no-color", no_color, "Never use colour")->excludes(color_flag);
  demo_cmd->add_option("--pictures,--png", demo.pictures_dir,
                       "Also draw every weight matrix as a heatmap in DIR (--format), and the training as a GIF");
  add_picture_options(demo_cmd, demo.pictures);
  auto* sentence_opt = demo_cmd->add_option("--sentence", demo.sentence,
                                            "Your own sentence: one random embedding per distinct word (like the book)");
  auto* embeddings_opt = demo_cmd->add_option("--embeddings", demo.embeddings,
                                              "Your own embeddings: a .npy array of (tokens × d_in), with --tokens");
  auto* tokens_opt = demo_cmd->add_option("--tokens", demo.tokens, "The tokens of --embeddings' rows, space-separated");
  embeddings_opt->needs(tokens_opt)->excludes(sentence_opt);
  tokens_opt->needs(embeddings_opt);
  demo_cmd->add_option("--d-in", demo.d_in, "Embedding width for --sentence (default 3)");
  demo_cmd->add_option("--d-out", demo.d_out, "Query/key/value width c (default 2; even: two heads share it)");
  demo_cmd->add_option("--seed", demo.seed, "Seed for your input's embeddings and weights (default 123)");

  qkv::cli::ApplyCommand apply;
  auto* apply_cmd = app.add_subcommand(
      "apply", "Run a module stored in safetensors (PyTorch state-dict names, __metadata__ \"module\" and its "
               "constructor arguments) on an input; write the output and, with --grad-output, every gradient");
  apply_cmd->add_option("--module", apply.module_path, "Module file (.safetensors)")->required();
  apply_cmd->add_option("--input", apply.input_path, "Input: .npy, or .safetensors with a tensor \"input\"")->required();
  apply_cmd->add_option("--output", apply.output_path,
                        "Result (.safetensors): \"output\", and with --grad-output \"grad.input\" and "
                        "\"grad.<parameter>\"")
      ->required();
  apply_cmd->add_option("--grad-output", apply.grad_output_path,
                        "dL/d(output): .npy, or .safetensors with a tensor \"grad_output\"");
  auto* train_flag = apply_cmd->add_flag("--train", apply.train, "Training mode: dropout on");
  apply_cmd->add_option("--seed", apply.seed, "Seed drawn from just before forward (dropout masks)")->needs(train_flag);

  qkv::cli::TokenizeCommand tokenize;
  auto* tokenize_cmd = app.add_subcommand("tokenize", "Text on stdin → JSON token ids on stdout");
  auto* detokenize_cmd = app.add_subcommand("detokenize", "JSON token ids on stdin → text on stdout");
  for (auto* cmd : {tokenize_cmd, detokenize_cmd}) {
    cmd->add_option("--tokenizer", tokenize.tokenizer, "gpt2 (byte-level BPE), bytes, or a Hugging Face tokenizer.json "
                                                       "(or a model folder holding one)");
    cmd->add_option("--vocab", tokenize.vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe");
  }
  tokenize_cmd->add_flag("--no-special", tokenize.no_special, "Treat <|endoftext|> as plain text");
  tokenize_cmd->add_flag("--replace-invalid", tokenize.replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");

  qkv::cli::TrainCommand train;
  auto* train_cmd = app.add_subcommand(
      "train", "Train a small GPT on a text (default: the King James Bible) with AdamW, warmup + cosine LR, "
               "clipping, evaluation, checkpoints, a CSV and a PNG of the losses");
  auto& ts = train.settings;
  ts.model.vocab_size = 50257;
  ts.model.context_length = 128;
  ts.model.emb_dim = 192;
  ts.model.n_heads = 6;
  ts.model.n_layers = 4;
  ts.model.drop_rate = 0.1;
  train_cmd->add_option("--text", train.text_path, "UTF-8 text file to train on (default: bible -l80 gen1:1-rev22:21)");
  train_cmd->add_option("--out", train.out_dir, "Output directory: checkpoint.safetensors, losses.csv, loss.png, sample.txt")
      ->capture_default_str();
  train_cmd->add_option("--resume", train.resume,
                        "Continue from a checkpoint: qkv's (exactly, with its settings unless overridden), or the "
                        "book's model_and_optimizer.pth (its weights, AdamW state and learning rate), or a state dict "
                        "(.pth or safetensors: fine-tune from its weights)");
  train_cmd->add_option("--config", train.resume_config,
                        "With --resume of a book state dict: the book's configuration (JSON file or gpt2-small|medium|"
                        "large|xl)");
  train_cmd->add_option("--vocab", train.vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe");
  train_cmd->add_flag("--replace-invalid", train.replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");
  // Every model and training setting comes from one table (train_settings_schema): its flag, help, default
  // and parser. What the command line gives is kept as text and applied to the defaults or, with --resume, to
  // the checkpoint's settings; then everything is parsed and validated once.
  std::map<std::string, std::string> given_values;
  std::vector<std::pair<CLI::Option*, std::string>> settings_options;
  for (const auto& setting : qkv::train::train_settings_schema()) {
    if (!setting.flag) continue;
    std::string& target = given_values[setting.key];
    CLI::Option* option;
    if (setting.is_flag) {
      option = train_cmd->add_flag(setting.flag, setting.help);
    } else {
      option = train_cmd->add_option(setting.flag, target, setting.help)->default_str(setting.get(ts));
      option->check(checked("VALUE", [&setting](const std::string& text) {
        qkv::train::TrainSettings scratch;
        setting.set(scratch, text);
        return std::string();
      }));
    }
    settings_options.emplace_back(option, setting.key);
  }
  train_cmd->add_option("--stop-at", train.stop_at,
                        "Checkpoint and stop after this step, to continue later with --resume (a run in chunks)");
  train_cmd->add_option("--attention-every", train.attention_every,
                        "Every N steps, save the attention maps of a probe prompt (OUT/attention/step-N.png, and an "
                        "animation over the run, OUT/attention/attention.gif)")
      ->check(int_at_least("--attention-every", 0));
  train_cmd->add_option("--attention-prompt", train.attention_prompt,
                        "The probe for --attention-every (default: the first 24 tokens of the text)");
  train_cmd->add_option("--sample-prompt", train.sample_prompt,
                        "Prompt for the sample printed at the end (default: the first words of the text)");
  train_cmd->add_flag("--overwrite", train.overwrite, "Start over in an --out that already holds a run");
  add_picture_options(train_cmd, train.pictures);
  train_cmd->add_flag("--plot-log", train.plot_log, "Draw the loss plot's y axis on a log scale");
  train_cmd->add_option("--sample-tokens", train.sample_tokens, "Length of that sample")->capture_default_str();

  qkv::cli::GenerateCommand generate;
  auto* generate_cmd = app.add_subcommand("generate", "Continue a prompt with a checkpoint or GPT-2 weights");
  add_model_options(generate_cmd, generate.model);
  add_weights_option(generate_cmd, generate.model);
  auto* prompt_opt = generate_cmd->add_option("--prompt", generate.prompt, "Text to continue (default: standard input, "
                                                                         "when it is not a terminal)");
  auto* prompts_opt = generate_cmd->add_option("--prompts", generate.prompts_path,
                                               "A file of prompts, one JSON string per line, generated as one batch; "
                                               "prints one JSON object per line");
  prompts_opt->excludes(prompt_opt);
  add_sampling_options(generate_cmd, generate);
  generate_cmd->add_flag("--chat", generate.chat, "Format the prompt as one user message with the model's chat template");

  qkv::cli::ChatCommand chat;
  auto* chat_cmd = app.add_subcommand("chat", "Talk to a Hugging Face model folder in its own chat format: streamed, "
                                              "with the KV cache kept between turns");
  add_model_options(chat_cmd, chat.generation.model);
  add_weights_option(chat_cmd, chat.generation.model);
  add_sampling_options(chat_cmd, chat.generation);
  chat_cmd->add_option("--system", chat.system, "A system message before the conversation");
  chat_cmd->add_option("--messages", chat.messages_path, "Start from these messages (JSON list of {role, content})");
  chat_cmd->add_flag("--print-prompt", chat.print_prompt, "Print what the chat template makes of the messages, and stop");
  chat_cmd->add_option("--template", chat.template_path, "With --print-prompt: a tokenizer_config.json (no model needed)");
  chat_cmd->add_flag("--no-thinking", chat.no_thinking, "Qwen3: render enable_thinking = false (an empty think block)");
  chat_cmd->add_option("--max-context", chat.max_context, "Tokens the KV cache holds")->capture_default_str()
      ->check(int_at_least("--max-context", 1));

  qkv::cli::AttentionCommand attention;
  auto* attention_cmd = app.add_subcommand(
      "attention", "What a GPT attends to for a prompt: a layers × heads grid, a heatmap per head, the weights "
                   "(attention.safetensors) and an interactive attention.html");
  add_model_options(attention_cmd, attention.model);
  add_weights_option(attention_cmd, attention.model);
  attention_cmd->add_option("--prompt", attention.prompt, "The text whose attention to show")->required();
  attention_cmd->add_option("--layers", attention.layers, "Layers to show, 1-based (default: all)")->expected(1, -1);
  attention_cmd->add_option("--heads", attention.heads, "Heads to show, 1-based (default: all)")->expected(1, -1);
  attention_cmd->add_option("--out", attention.out_dir, "Output directory")->capture_default_str();
  auto* no_head = attention_cmd->add_flag("--no-head-pictures{false}", attention.per_head,
                                          "Skip the per-head pictures (grid, data and HTML only)");
  attention_cmd->add_flag("--no-head-png{false}", attention.per_head, "The same as --no-head-pictures")->excludes(no_head);
  add_picture_options(attention_cmd, attention.pictures);

  qkv::cli::MemoryCommand memory;
  auto* memory_cmd = app.add_subcommand(
      "memory", "KV-cache bytes (MHA, GQA, MLA, sliding windows) and mixture-of-experts parameters from settings — "
                "with none, the book's chapter-4 bonus figures — or a Hugging Face folder's parameters and KV cache");
  memory_cmd->add_option("folder", memory.folder, "A Hugging Face model folder (its config.json)");
  qkv::nn::MemorySettings& ms = memory.settings;
  std::vector<CLI::Option*> memory_settings = {
      memory_cmd->add_option("--emb", ms.emb_dim, "Residual width (emb_dim)")->check(int_at_least("--emb", 1)),
      memory_cmd->add_option("--heads", ms.heads, "Query heads")->check(int_at_least("--heads", 1)),
      memory_cmd->add_option("--layers", ms.layers, "Layers")->check(int_at_least("--layers", 1)),
      memory_cmd->add_option("--kv-groups", ms.kv_groups, "GQA: query heads per K/V head")->check(int_at_least("--kv-groups", 1)),
      memory_cmd->add_option("--latent", ms.latent_dim, "MLA: the latent cached per token and layer")->check(int_at_least("--latent", 1)),
      memory_cmd->add_option("--window", ms.window, "SWA: the sliding layers' window")->check(int_at_least("--window", 1)),
      memory_cmd->add_option("--swa-ratio", memory.swa_ratio, "SWA: a:b sliding to full layers (default 1:0, all sliding)"),
      memory_cmd->add_option("--hidden", ms.hidden_dim, "MoE: the dense FFN's hidden width")->check(int_at_least("--hidden", 1)),
      memory_cmd->add_option("--experts", ms.experts, "MoE: experts")->check(int_at_least("--experts", 1)),
      memory_cmd->add_option("--experts-per-token", ms.top_k, "MoE: experts per token (top-k)")->check(int_at_least("--experts-per-token", 1)),
      memory_cmd->add_option("--ffn", memory.ffn, "MoE: swiglu (3 matrices) or gelu (2)")->check(CLI::IsMember({"swiglu", "gelu"})),
  };
  memory_cmd->add_option("--context", ms.context, "Tokens cached per sequence")->capture_default_str()
      ->check(int_at_least("--context", 1));
  memory_cmd->add_option("--batch", ms.batch, "Sequences")->capture_default_str()->check(int_at_least("--batch", 1));
  memory_cmd->add_option("--dtype", memory.dtype, "Bytes a value: fp32, bf16, fp16, fp8, int8")->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "fp8", "int8"}));

  qkv::cli::EvalCommand eval;
  auto* eval_cmd = app.add_subcommand(
      "eval", "Loss and perplexity of a model on a text, in sliding windows (each token predicted once, with as "
              "much context as --stride leaves)");
  add_model_options(eval_cmd, eval.model);
  add_weights_option(eval_cmd, eval.model);
  eval_cmd->add_option("--text", eval.text_path, "UTF-8 text to score (- for standard input)")->required();
  eval_cmd->add_option("--context", eval.context, "Window length (default: the model's context_length)")
      ->check(int_at_least("--context", 1));
  eval_cmd->add_option("--stride", eval.stride, "Tokens between window starts (default: the window length; smaller "
                                                "gives each token more context and costs more)")
      ->check(int_at_least("--stride", 1));
  eval_cmd->add_option("--batch-size", eval.batch_size, "Windows per forward pass (default: what keeps the logits "
                                                        "under 256 MiB)")
      ->check(int_at_least("--batch-size", 1));
  eval_cmd->add_option("--plot", eval.plot_path, "Also draw the loss of each window along the text (FILE.png, .svg or "
                                                 ".pdf; a name without one gets --format's)");
  add_picture_options(eval_cmd, eval.pictures);
  eval_cmd->add_flag("--json", eval.json, "Print one JSON object (loss, perplexity, tokens, tokens/s …) on stdout");
  eval_cmd->add_flag("--replace-invalid", eval.replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");

  qkv::cli::ConvertCommand convert;
  auto* finetune_cmd = app.add_subcommand("finetune", "Fine-tune a model as the book's chapters 6 and 7 do (classify, "
                                                      "instruct), optionally with LoRA (appendix E)");
  finetune_cmd->require_subcommand(1);
  qkv::cli::FinetuneClassifyCommand ft_classify;
  auto* ft_classify_cmd = finetune_cmd->add_subcommand(
      "classify", "A new classification head on the last position (the book's spam classifier): CSV/TSV/JSONL in, "
                  "model.pth, metrics.json, losses.csv and plots out");
  add_model_options(ft_classify_cmd, ft_classify.model);
  ft_classify_cmd->add_option("--train", ft_classify.train_path, "Training texts: .csv (header with Label,Text), .tsv or .jsonl")->required();
  ft_classify_cmd->add_option("--val", ft_classify.val_path, "Validation texts, same layout")->required();
  ft_classify_cmd->add_option("--test", ft_classify.test_path, "Test texts, same layout (reported at the end)");
  ft_classify_cmd->add_option("--out", ft_classify.out_dir, "Folder for the fine-tuned model and its reports")->required();
  ft_classify_cmd->add_option("--text-column", ft_classify.columns.text, "Column (or JSON key) of the texts")->capture_default_str();
  ft_classify_cmd->add_option("--label-column", ft_classify.columns.label, "Column (or JSON key) of the labels")->capture_default_str();
  ft_classify_cmd->add_option("--trainable", ft_classify.trainable, "What trains besides the head: last-block (the last "
                                                                    "block and the final norm), all, head, or parameter-name patterns")
      ->capture_default_str();
  ft_classify_cmd->add_option("--pooling", ft_classify.pooling, "The position the head reads: last (the book's, padding "
                                                                "included) or last-real (each text's last token)")
      ->capture_default_str()->check(CLI::IsMember({"last", "last-real"}));
  ft_classify_cmd->add_option("--max-length", ft_classify.options.max_length, "Tokens per text (default: the longest "
                                                                              "training text)")->check(int_at_least("--max-length", 1));
  add_finetune_options(ft_classify_cmd, ft_classify.options, ft_classify.lora_targets, ft_classify.overwrite);
  ft_classify_cmd->add_option("--prefix-cache-mib", ft_classify.prefix_cache_mib,
                              "Keep the frozen blocks' output per text for later epochs, up to this many MiB (0: recompute)")
      ->capture_default_str()->check(int_at_least("--prefix-cache-mib", 0));
  add_picture_options(ft_classify_cmd, ft_classify.pictures);

  qkv::cli::FinetuneInstructCommand ft_instruct;
  auto* ft_instruct_cmd = finetune_cmd->add_subcommand(
      "instruct", "Instruction fine-tuning on Alpaca entries (the book's chapter 7): responses to the test entries, "
                  "model.pth, metrics and a loss plot");
  add_model_options(ft_instruct_cmd, ft_instruct.model);
  ft_instruct_cmd->add_option("--data", ft_instruct.data_path, "A JSON list of {instruction, input, output}")->required();
  ft_instruct_cmd->add_option("--out", ft_instruct.out_dir, "Folder for the fine-tuned model and its responses")->required();
  ft_instruct_cmd->add_option("--format", ft_instruct.format, "alpaca (the book's prompt) or chat (the model's chat template)")
      ->capture_default_str()->check(CLI::IsMember({"alpaca", "chat"}));
  ft_instruct_cmd->add_flag("--mask-prompt", ft_instruct.options.mask_prompt, "Put the loss on the response only");
  ft_instruct_cmd->add_option("--allowed-max-length", ft_instruct.options.allowed_max_length, "Tokens per example at most")
      ->capture_default_str()->check(int_at_least("--allowed-max-length", 2));
  ft_instruct_cmd->add_option("--split-seed", ft_instruct.split_seed, "Shuffle before the 85/10/5 split (0: the file's "
                                                                      "order, as the book)")->capture_default_str();
  ft_instruct_cmd->add_option("--max-new-tokens", ft_instruct.max_new_tokens, "Tokens per test response")
      ->capture_default_str()->check(int_at_least("--max-new-tokens", 0));
  add_finetune_options(ft_instruct_cmd, ft_instruct.options, ft_instruct.lora_targets, ft_instruct.overwrite);
  add_picture_options(ft_instruct_cmd, ft_instruct.pictures, "--picture-format");

  qkv::cli::ClassifyCommand classify;
  auto* classify_cmd = app.add_subcommand("classify", "Label texts with a fine-tuned classifier (qkv finetune classify's "
                                                      "model.pth, or a base model with its --adapter)");
  add_model_options(classify_cmd, classify.model);
  add_weights_option(classify_cmd, classify.model);
  classify_cmd->add_option("--text", classify.texts, "A text to classify (repeatable)")->required();
  classify_cmd->add_flag("--json", classify.json, "Print the label, its probability and every class's as JSON");

  auto* convert_cmd = app.add_subcommand(
      "convert", "Convert a model between PyTorch .pth, book-named safetensors, qkv checkpoints and Hugging Face "
                 "GPT-2 safetensors, where nothing is lost (it refuses, saying what would be, otherwise)");
  convert_cmd->add_option("input", convert.input, "The model file (any format qkv reads)")->required();
  convert_cmd->add_option("output", convert.output, "The file to write")->required();
  convert_cmd->add_option("--to", convert.to, "pth, safetensors (book names), checkpoint (qkv), gpt2 (Hugging "
                                              "Face) or hf (a Hugging Face folder from another); default: .pth/.pt → "
                                              "pth, otherwise safetensors")
      ->check(CLI::IsMember({"pth", "safetensors", "checkpoint", "gpt2", "hf"}));
  convert_cmd->add_option("--dtype", convert.dtype, "With --to hf: f32 or bf16 (half the bytes)")->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  add_config_options(convert_cmd, convert.hint);
  convert_cmd->add_flag("--weights-only", convert.weights_only, "Keep only the weights (drop optimizer state)");
  convert_cmd->add_option("--merge", convert.merge, "A LoRA adapter folder (PEFT's layout, as qkv finetune writes) to "
                                                    "merge into the weights: W + (alpha / r)·B·A");

  auto* serve_cmd = qkv::cli::add_serve_command(app);
  // An unknown word where a command belongs: say so and list the commands (CLI11 would say "A subcommand is
  // required").
  // --precision of every command that multiplies matrices (train's is one of its settings, stored in checkpoints).
  std::string precision_text = "fp32";
  for (CLI::App* cmd : {apply_cmd, generate_cmd, chat_cmd, attention_cmd, eval_cmd, ft_classify_cmd, ft_instruct_cmd,
                        classify_cmd}) {
    cmd->add_option("--precision", precision_text,
                    "Matrix products in fp32, bf16 (bf16 operands, float32 sums; CPUs with AVX512_BF16 or AMX) or auto")
        ->capture_default_str()
        ->check(checked("PRECISION", [](const std::string& text) {
          try {
            qkv::resolve_precision(text, "--precision");
            return std::string();
          } catch (const qkv::ValueError& e) {
            return std::string(e.what());
          }
        }));
  }
  if (argc >= 2 && argv[1][0] != '-') {
    bool known = false;
    std::string names;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known = known || sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "qkv: unknown command '%s'; the commands are: %s (qkv --help)\n",
                   qkv::printable(argv[1]).c_str(), names.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help/version to stdout, errors to stderr
    return code == 0 ? 0 : 2;
  }

  if (threads > 0) qkv::set_num_threads(threads);
  const qkv::Precision precision = qkv::resolve_precision(precision_text, "--precision");  // checked while parsing
  const qkv::PrecisionGuard precision_guard(precision);
  // Inference in bf16 keeps the weights in bf16 alone (fine-tuning keeps float32 master weights, as train does).
  for (qkv::cli::ModelOptions* m : {&generate.model, &chat.generation.model, &attention.model, &eval.model, &classify.model})
    m->bf16_weights = precision == qkv::Precision::BF16;
  if (precision_text != "fp32") std::fprintf(stderr, "precision: %s\n", qkv::describe_precision(precision, precision_text).c_str());
  try {
    if (*demo_cmd) {
      // NO_COLOR (no-color.org): any non-empty value turns colour off unless --color asks for it.
      const char* no_color_env = std::getenv("NO_COLOR");
      const bool env_off = no_color_env && *no_color_env;
      demo.color = !no_color && (force_color || (!env_off && isatty(STDOUT_FILENO)));
      demo.sentence_given = sentence_opt->count() > 0;
      return qkv::cli::run_demo(demo, std::cout);
    }
    if (*apply_cmd) return qkv::cli::run_apply(apply);
    if (*tokenize_cmd) return qkv::cli::run_tokenize(tokenize);
    if (*train_cmd) {
      for (const auto& [option, key] : settings_options)
        if (option->count()) train.overrides[key] = option->get_expected_min() == 0 ? "true" : given_values[key];
      // Under mpirun (more than one process) the processes train one model together; MPI starts here.
      if (qkv::train::launched_world_size() > 1) {
        if (!qkv::train::built_with_mpi()) {
          std::fprintf(stderr, "qkv train: started by mpirun with %d processes, but this qkv was built without MPI; "
                               "install Open MPI (apt-get install libopenmpi-dev openmpi-bin), rebuild, or run "
                               "without mpirun\n", qkv::train::launched_world_size());
          return 2;
        }
        auto comm = qkv::train::make_mpi_communicator(&argc, &argv);
        try {
          return qkv::cli::run_train(train, *comm);
        } catch (const qkv::train::CollectiveError& e) {  // every process knows: one message, no abort
          if (comm->rank() == 0) std::fprintf(stderr, "qkv train: error: %s\n", e.what());
          return 1;
        } catch (const qkv::cli::UsageError& e) {
          std::fprintf(stderr, "qkv (process %d of %d): usage error: %s\n", comm->rank(), comm->size(), e.what());
          if (comm->size() > 1) comm->abort_all(2);
          return 2;
        } catch (const std::exception& e) {
          // One process failed on its own (a write, a read): stop every process, naming this one.
          std::fprintf(stderr, "qkv (process %d of %d): error: %s\n", comm->rank(), comm->size(), e.what());
          if (comm->size() > 1) comm->abort_all(1);
          return 1;
        }
      }
      qkv::train::SingleProcess single;
      return qkv::cli::run_train(train, single);
    }
    if (*generate_cmd) {
      if (!prompt_opt->count() && !prompts_opt->count() && !isatty(STDIN_FILENO)) {  // echo "text" | qkv generate …
        generate.prompt.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
      }
      return qkv::cli::run_generate(generate);
    }
    if (*chat_cmd) return qkv::cli::run_chat(chat);
    if (*serve_cmd) return qkv::cli::run_serve();
    if (*detokenize_cmd) return qkv::cli::run_detokenize(tokenize);
    if (*eval_cmd) return qkv::cli::run_eval(eval);
    if (*convert_cmd) return qkv::cli::run_convert(convert);
    if (*ft_classify_cmd) return qkv::cli::run_finetune_classify(ft_classify);
    if (*ft_instruct_cmd) return qkv::cli::run_finetune_instruct(ft_instruct);
    if (*classify_cmd) return qkv::cli::run_classify(classify);
    if (*attention_cmd) {
      return qkv::cli::run_attention(attention);
    }
    if (*memory_cmd) {
      for (const CLI::Option* o : memory_settings) memory.custom = memory.custom || o->count() > 0;
      if (memory.custom && !memory.folder.empty())
        throw qkv::cli::UsageError("give a folder or settings (--emb, --heads, …), not both");
      return qkv::cli::run_memory(memory, std::cout);
    }
  } catch (const qkv::cli::UsageError& e) {
    std::fprintf(stderr, "qkv: usage error: %s\n", e.what());
    return 2;
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "qkv: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
