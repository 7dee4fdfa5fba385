// qkv: the command-line tool. Thin: a table of commands, each registering its own options and run function
// (setup_* in the command's file); here the line is parsed, the chosen command run, and errors mapped to exit codes
// (0 success, 1 a problem with the input or files, 2 a usage error; docs/robustness.md).
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/core/error.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/version.hpp"

namespace {

struct Command {
  const char* name;
  const char* summary;  // the line `qkv --help` shows
  qkv::cli::Setup setup;
};

// Every command, in the order `qkv --help` lists them.
const Command kCommands[] = {
    {"demo", "Walk through the article's example (the book's numbers), or your own sentence, then train",
     qkv::cli::setup_demo},
    {"apply", "Run a module stored in safetensors (PyTorch state-dict names, __metadata__ \"module\" and its "
              "constructor arguments) on an input; write the output and, with --grad-output, every gradient",
     qkv::cli::setup_apply},
    {"tokenize", "Text on stdin → JSON token ids on stdout", qkv::cli::setup_tokenize},
    {"detokenize", "JSON token ids on stdin → text on stdout", qkv::cli::setup_detokenize},
    {"train", "Train a small GPT on a text (default: the King James Bible) with AdamW, warmup + cosine LR, clipping, "
              "evaluation, checkpoints, a CSV and a PNG of the losses",
     qkv::cli::setup_train},
    {"generate", "Continue a prompt with a checkpoint or GPT-2 weights", qkv::cli::setup_generate},
    {"chat", "Talk to a Hugging Face model folder in its own chat format: streamed, with the KV cache kept between turns",
     qkv::cli::setup_chat},
    {"attention", "What a GPT attends to for a prompt: a layers × heads grid, a heatmap per head, the weights "
                  "(attention.safetensors) and an interactive attention.html",
     qkv::cli::setup_attention},
    {"memory", "KV-cache bytes (MHA, GQA, MLA, sliding windows) and mixture-of-experts parameters from settings — with "
               "none, the book's chapter-4 bonus figures — or a Hugging Face folder's parameters and KV cache",
     qkv::cli::setup_memory},
    {"eval", "Loss and perplexity of a model on a text, in sliding windows (each token predicted once, with as much "
             "context as --stride leaves)",
     qkv::cli::setup_eval},
    {"finetune", "Fine-tune a model as the book's chapters 6 and 7 do (classify, instruct), optionally with LoRA "
                 "(appendix E)",
     qkv::cli::setup_finetune},
    {"classify", "Label texts with a fine-tuned classifier (qkv finetune classify's model.pth, or a base model with "
                 "its --adapter)",
     qkv::cli::setup_classify},
    {"convert", "Convert a model between PyTorch .pth, book-named safetensors, qkv checkpoints and Hugging Face "
                "GPT-2 safetensors, where nothing is lost (it refuses, saying what would be, otherwise)",
     qkv::cli::setup_convert},
    {"quantize", "Write a model (a Hugging Face folder or a GGUF file) as a GGUF file llama.cpp loads: f32, f16, bf16, "
                 "q8_0, q4_0, q4_k, q5_k, q6_k, or llama.cpp's q4_k_m / q5_k_m mixes",
     qkv::cli::setup_quantize},
    {"serve", "An OpenAI-compatible HTTP server for a model: /v1/chat/completions, /v1/completions (streamed or whole), "
              "/v1/models, /health, /metrics",
     qkv::cli::setup_serve},
};

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

// An unknown word where a command belongs: say so and list the commands (CLI11 would say "A subcommand is
// required"). True when argv[1] is a command or an option.
bool known_command(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return true;
  std::string names;
  for (const Command& c : kCommands) {
    if (std::strcmp(c.name, argv[1]) == 0) return true;
    names += (names.empty() ? "" : ", ") + std::string(c.name);
  }
  std::fprintf(stderr, "qkv: unknown command '%s'; the commands are: %s (qkv --help)\n", qkv::printable(argv[1]).c_str(),
               names.c_str());
  return false;
}

int run(int argc, char** argv) {
  CLI::App app{"qkv — trainable self-attention, from the article's Q = XWq, K = XWk, V = XWv to a small GPT.\n"
               "Run `qkv demo` for the worked example, `qkv <command> --help` for any command."};
  app.set_version_flag("--version", std::string("qkv ") + qkv::kVersion);
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print help for every command");
  // --threads N anywhere on the line (qkv train --threads 2): the subcommands pass it up to here.
  int threads = 0;
  app.add_option("--threads", threads, "Threads for qkv's kernels (default: OMP_NUM_THREADS, else all cores)")
      ->check(qkv::cli::int_in_range(1, 1024));
  app.fallthrough();

  qkv::cli::CommandContext context;
  context.argc = &argc;
  context.argv = &argv;
  std::vector<std::pair<CLI::App*, qkv::cli::Runner>> commands;
  for (const Command& c : kCommands) {
    CLI::App* command = app.add_subcommand(c.name, c.summary);
    commands.emplace_back(command, c.setup(*command, context));
  }
  if (!known_command(argc, argv)) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // The model (and quantize's output) may also come without its name, before the options. A bare word before
    // `--checkpoint FILE` is then taken for a second model, which CLI11 reports as "At Most 1 required": most often a
    // text that lost its option's name.
    const std::string what = e.what();
    if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) &&
        (what.rfind("--checkpoint:", 0) == 0 || what.rfind("--out:", 0) == 0)) {
      const std::string name = what.substr(0, what.find(':'));
      std::fprintf(stderr,
                   "qkv: usage error: %s was given twice: by its name and as an argument without one (the model may "
                   "come first without --checkpoint, and quantize's output second without --out); a text meant for "
                   "an option needs its name, e.g. --prompt \"...\"\n",
                   name.c_str());
      return 2;
    }
    const int code = app.exit(e);  // prints help/version to stdout, errors to stderr
    return code == 0 ? 0 : 2;
  }

  if (threads > 0) qkv::set_num_threads(threads);
  // Checked while parsing; train's --precision is one of its settings (stored in checkpoints) and applied there.
  context.precision = qkv::resolve_precision(context.precision_text, "--precision");
  const qkv::PrecisionGuard precision_guard(context.precision);
  if (context.precision_text != "fp32")
    std::fprintf(stderr, "precision: %s\n", qkv::describe_precision(context.precision, context.precision_text).c_str());
  try {
    for (auto& [command, runner] : commands)
      if (command->parsed()) return runner();
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

}  // namespace

int main(int argc, char** argv) { return check_stdout(run(argc, argv)); }
