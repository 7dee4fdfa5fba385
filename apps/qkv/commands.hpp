// The subcommands of the qkv tool. Each parses nothing itself: main.cpp fills the options with CLI11.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace qkv::cli {

struct DemoOptions {
  std::vector<std::string> sections;  // empty: all
  bool color = false;
};
const std::vector<std::string>& demo_sections();
int run_demo(const DemoOptions& options, std::ostream& out);

struct ApplyCommand {
  std::string module_path, input_path, output_path, grad_output_path;
  bool train = false;
  uint64_t seed = 0;
};
int run_apply(const ApplyCommand& options);

struct TokenizeCommand {
  std::string tokenizer = "gpt2", vocab_dir;
  bool no_special = false, replace_invalid = false;
};
int run_tokenize(const TokenizeCommand& options);
int run_detokenize(const TokenizeCommand& options);

}  // namespace qkv::cli
