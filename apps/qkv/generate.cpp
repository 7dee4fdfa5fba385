// `qkv generate`: continue a prompt with a trained checkpoint or with GPT-2 weights (Hugging Face's
// model.safetensors), streaming tokens as they come.
#include <cstdio>
#include <iostream>

#include "commands.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::cli {

LoadedModel load_model(const ModelOptions& options) {
  if (options.checkpoint.empty() && options.gpt2_path.empty()) throw UsageError("give --checkpoint FILE or --gpt2 FILE");
  train::ModelFile file = train::load_model_file(options.path(), options.hint);
  if (!options.gpt2_path.empty() && file.format != train::ModelFormat::HuggingFaceGPT2) {
    std::fprintf(stderr, "qkv: note: %s is a %s, not Hugging Face GPT-2 weights; read as such (--checkpoint takes any)\n",
                 options.gpt2_path.c_str(), train::model_format_name(file.format));
  }
  return {std::move(file.model), file.tokenizer, file.description};
}

int run_generate(const GenerateCommand& options) {
  LoadedModel loaded = load_model(options.model);
  std::unique_ptr<nn::GPTModel>& model = loaded.model;
  const auto tokenizer = text::make_tokenizer(loaded.tokenizer, options.model.vocab_dir);
  std::vector<int64_t> prompt =
      tokenizer->encode(options.replace_invalid ? text::replace_invalid_utf8(options.prompt) : options.prompt);
  if (prompt.empty()) {
    if (tokenizer->end_of_text() < 0) throw ValueError("the prompt is empty; give --prompt TEXT");
    prompt.push_back(tokenizer->end_of_text());  // GPT-2 starts unconditional samples from <|endoftext|>
  }
  if (static_cast<int64_t>(prompt.size()) > model->config.context_length) {
    std::fprintf(stderr, "qkv generate: the prompt has %zu tokens; only its last %lld (context_length) are used\n",
                 prompt.size(), static_cast<long long>(model->config.context_length));
  }
  nn::SamplingOptions sampling;
  sampling.max_new_tokens = options.max_new_tokens;
  sampling.temperature = options.greedy ? 0.0 : options.temperature;
  sampling.top_k = options.top_k;
  sampling.top_p = options.top_p;
  sampling.seed = options.seed;
  sampling.use_cache = !options.no_cache;
  sampling.stop_token = tokenizer->end_of_text();
  std::cout << options.prompt << std::flush;
  // Decode the whole continuation each time and print what is new, so multi-byte characters split across
  // tokens come out whole.
  std::vector<int64_t> produced;
  std::string shown;
  nn::generate(*model, prompt, sampling, [&](int64_t token) {
    if (token == tokenizer->end_of_text()) return;
    produced.push_back(token);
    const std::string text = tokenizer->decode(produced);
    if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      std::cout << text.substr(shown.size()) << std::flush;
      shown = text;
    }
  });
  std::cout << "\n";
  return 0;
}

}  // namespace qkv::cli
