// `qkv tokenize` (text on stdin → JSON ids on stdout) and `qkv detokenize` (JSON ids → text).
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/core/error.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::cli {

int run_tokenize(const TokenizeCommand& options) {
  const auto tokenizer = text::make_tokenizer(options.tokenizer, options.vocab_dir);
  std::string input{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  if (options.replace_invalid) input = text::replace_invalid_utf8(input);
  const std::vector<int64_t> ids = tokenizer->encode(input, !options.no_special);
  std::cout << nlohmann::json(ids).dump() << "\n";
  return 0;
}

int run_detokenize(const TokenizeCommand& options) {
  const auto tokenizer = text::make_tokenizer(options.tokenizer, options.vocab_dir);
  const std::string input{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(input);  // the whole input: text after the array is an error too
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(std::string("detokenize: stdin is not one JSON array of token ids: ") + printable(e.what()));
  }
  if (!json.is_array()) throw ValueError("detokenize: stdin must hold a JSON array of token ids, e.g. [15496, 995]");
  std::vector<int64_t> ids;
  for (const auto& v : json) {
    if (!v.is_number_integer()) throw ValueError("detokenize: every element must be an integer token id");
    ids.push_back(v.get<int64_t>());
  }
  std::cout << tokenizer->decode(ids);
  return 0;
}

namespace {
std::shared_ptr<TokenizeCommand> add_tokenizer_options(CLI::App& cmd) {
  auto o = std::make_shared<TokenizeCommand>();
  cmd.add_option("--tokenizer", o->tokenizer, "gpt2 (byte-level BPE), bytes, or a Hugging Face tokenizer.json (or a "
                                              "model folder holding one)")
      ->capture_default_str();
  cmd.add_option("--vocab", o->vocab_dir, "Directory with GPT-2's encoder.json and vocab.bpe");
  return o;
}
}  // namespace

Runner setup_tokenize(CLI::App& cmd, CommandContext&) {
  auto o = add_tokenizer_options(cmd);
  cmd.add_flag("--no-special", o->no_special, "Treat <|endoftext|> as plain text");
  cmd.add_flag("--replace-invalid", o->replace_invalid, "Replace invalid UTF-8 with U+FFFD instead of failing");
  return [o] { return run_tokenize(*o); };
}

Runner setup_detokenize(CLI::App& cmd, CommandContext&) {
  auto o = add_tokenizer_options(cmd);
  return [o] { return run_detokenize(*o); };
}

}  // namespace qkv::cli
