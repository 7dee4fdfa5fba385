// qkv: the command-line tool. Thin: parse the command line, call the library, print, map errors to exit
// codes (0 success, 1 a problem with the input or files, 2 a usage error).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "commands.hpp"
#include "qkv/error.hpp"
#include "qkv/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"qkv — trainable self-attention, from the seed's Q = XWq, K = XWk, V = XWv to a small GPT.\n"
               "Run `qkv demo` for the worked example, `qkv <command> --help` for any command."};
  app.set_version_flag("--version", std::string("qkv ") + qkv::kVersion);
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Print help for every command");

  qkv::cli::DemoOptions demo;
  auto* demo_cmd = app.add_subcommand("demo", "Walk through the seed's example (the book's numbers), then train");
  demo_cmd->add_option("--section", demo.sections, "Show only these sections (repeatable)")
      ->check(CLI::IsMember(qkv::cli::demo_sections()));
  bool force_color = false, no_color = false;
  demo_cmd->add_flag("--color", force_color, "Colour the attention heat maps");
  demo_cmd->add_flag("--no-color", no_color, "Never use colour");

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
    cmd->add_option("--tokenizer", tokenize.tokenizer, "gpt2 (byte-level BPE) or bytes")
        ->check(CLI::IsMember({"gpt2", "bytes"}));
    cmd->add_option("--vocab", tokenize.vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe");
  }
  tokenize_cmd->add_flag("--no-special", tokenize.no_special, "Treat <|endoftext|> as plain text");
  tokenize_cmd->add_flag("--replace-invalid", tokenize.replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help/version to stdout, errors to stderr
    return code == 0 ? 0 : 2;
  }

  try {
    if (*demo_cmd) {
      demo.color = !no_color && (force_color || isatty(STDOUT_FILENO));
      return qkv::cli::run_demo(demo, std::cout);
    }
    if (*apply_cmd) return qkv::cli::run_apply(apply);
    if (*tokenize_cmd) return qkv::cli::run_tokenize(tokenize);
    if (*detokenize_cmd) return qkv::cli::run_detokenize(tokenize);
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "qkv: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
