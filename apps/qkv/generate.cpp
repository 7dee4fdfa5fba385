// `qkv generate`: continue a prompt with a trained checkpoint or with GPT-2 weights (Hugging Face's
// model.safetensors), streaming tokens as they come.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <unistd.h>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::cli {

LoadedModel load_model(const ModelOptions& options) {
  if (options.checkpoint.empty() && options.gpt2_path.empty()) throw UsageError("give --checkpoint FILE or --gpt2 FILE");
  nn::PretrainedOptions o;
  o.hint = options.hint;
  o.vocab_dir = options.vocab_dir;
  o.adapter = options.adapter;
  o.matrices = options.bf16_weights ? DType::BF16 : DType::F32;
  std::unique_ptr<nn::Pretrained> loaded;
  try {
    loaded = nn::load_pretrained(options.path(), o);
  } catch (const ValueError& e) {  // a mismatched adapter or hint is the user's to fix
    throw UsageError(e.what());
  }
  if (!options.gpt2_path.empty() && loaded->format != nn::CheckpointFormat::HuggingFaceGPT2) {
    std::fprintf(stderr, "qkv: note: %s is a %s, not Hugging Face GPT-2 weights; read as such (--checkpoint takes any)\n",
                 options.gpt2_path.c_str(), nn::checkpoint_format_name(loaded->format));
  }
  return std::move(*loaded);
}

int run_generate(const GenerateCommand& options) {
  LoadedModel loaded = load_model(options.model);
  if (loaded.model->is_classifier())
    throw UsageError(loaded.description + " is a classifier (" + std::to_string(loaded.classifier.classes()) +
                     " classes), not a language model: it has no head to generate with; use qkv classify");
  if (loaded.is_classifier())
    std::fprintf(stderr, "qkv generate: note: %s is a fine-tuned classifier (%lld classes); as a language model its "
                         "output head is tok_emb.weight (qkv classify uses its own head)\n",
                 loaded.description.c_str(), static_cast<long long>(loaded.classifier.classes()));
  const nn::LanguageModel& model = *loaded.model;
  const text::Tokenizer* tokenizer = loaded.tokenizer.get();
  const std::string prompt_text = options.replace_invalid ? text::replace_invalid_utf8(options.prompt) : options.prompt;
  std::vector<int64_t> prompt;
  if (options.chat) {
    const auto* hf = dynamic_cast<const text::HfTokenizer*>(tokenizer);
    if (!hf || hf->chat_template().empty())
      throw ValueError("--chat needs a model folder whose tokenizer_config.json has a chat template; " +
                       loaded.description + " has none");
    text::ChatOptions chat;
    if (hf->bos_id() >= 0) chat.bos_token = hf->token_content(hf->bos_id());
    if (hf->end_of_text() >= 0) chat.eos_token = hf->token_content(hf->end_of_text());
    prompt = hf->encode_rendered(text::ChatTemplate::parse(hf->chat_template()).render({{"user", prompt_text}}, chat));
  } else {
    prompt = tokenizer->encode(prompt_text);
  }
  if (prompt_text.empty() && !options.chat) {
    // An empty prompt: say which token the sample grows from — the BOS the tokenizer adds, or the end-of-text token
    // (GPT-2 starts unconditional samples from <|endoftext|>) — or refuse where there is neither.
    if (prompt.empty() && tokenizer->end_of_text() >= 0) prompt.push_back(tokenizer->end_of_text());
    if (prompt.empty()) {
      throw UsageError("the prompt is empty and this model's tokenizer has no beginning- or end-of-text token to start "
                       "from; give --prompt TEXT");
    }
    const auto* hf = dynamic_cast<const text::HfTokenizer*>(tokenizer);
    const std::string name = hf ? hf->token_content(prompt.front()) : tokenizer->decode(std::vector<int64_t>{prompt.front()});
    std::fprintf(stderr, "qkv generate: the prompt is empty; generation starts from %s (token %lld)\n",
                 printable(name).c_str(), static_cast<long long>(prompt.front()));
  }
  if (prompt.empty()) throw UsageError("the prompt gives no tokens; give --prompt TEXT");
  if (static_cast<int64_t>(prompt.size()) > model.context_length()) {
    std::fprintf(stderr, "qkv generate: the prompt has %zu tokens; only its last %lld (context_length) are used\n",
                 prompt.size(), static_cast<long long>(model.context_length()));
  }
  for (int64_t id : prompt)
    if (id >= model.vocab_size())
      throw ValueError("the prompt's token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(model.vocab_size()) + ") of the model; is the tokenizer the model's own?");
  nn::SamplingOptions sampling;
  sampling.max_new_tokens = options.max_new_tokens;
  sampling.temperature = options.greedy ? 0.0 : options.temperature;
  sampling.top_k = options.top_k;
  sampling.top_p = options.top_p;
  sampling.seed = options.seed;
  sampling.use_cache = !options.no_cache;
  sampling.stop_tokens = loaded.stop_ids;
  sampling.vocab_limit = loaded.tokenizer->vocab_size();
  // What the KV cache holds: H_kv heads per layer, and a sliding-window layer only its window.
  const int64_t positions = std::min<int64_t>(model.context_length(), static_cast<int64_t>(prompt.size()) + options.max_new_tokens);
  int64_t cache_bytes = 0;
  const char* cache_dtype = "";
  if (!options.no_cache) {  // what generation's cache will hold (made as it will be: bf16 under --precision bf16)
    const nn::KVCache probe = model.make_cache(1, positions);
    cache_bytes = probe.bytes();
    if (!probe.layers.empty()) cache_dtype = dtype_name(probe.layers[0].keys.dtype());
  }
  const auto began = std::chrono::steady_clock::now();
  if (!options.chat) std::cout << options.prompt << std::flush;
  // Decode the whole continuation each time and print what is new, so multi-byte characters split across
  // tokens come out whole.
  std::vector<int64_t> produced;
  std::string shown;
  nn::generate(model, prompt, sampling, [&](int64_t token) {
    if (std::find(loaded.stop_ids.begin(), loaded.stop_ids.end(), token) != loaded.stop_ids.end()) return;
    produced.push_back(token);
    const std::string text = tokenizer->decode(produced);
    if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      std::cout << text.substr(shown.size()) << std::flush;
      shown = text;
    }
  });
  std::cout << "\n" << std::flush;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::fprintf(stderr, "qkv generate: %zu new tokens in %.2f s (%.1f tok/s, prompt included); ", produced.size(), seconds,
               static_cast<double>(produced.size()) / std::max(seconds, 1e-9));
  if (options.no_cache) std::fprintf(stderr, "no KV cache (--no-cache)\n");
  else
    std::fprintf(stderr, "KV cache %.2f MiB of %s for %s (%s × %s)\n", static_cast<double>(cache_bytes) / (1 << 20),
                 cache_dtype, count_of(positions, "position").c_str(), count_of(model.num_layers(), "layer").c_str(),
                 count_of(model.num_kv_heads(), "K/V head").c_str());
  return 0;
}

Runner setup_generate(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<GenerateCommand>();
  add_model_options(cmd, o->model);
  auto* prompt = cmd.add_option("--prompt", o->prompt, "Text to continue (- or none: standard input, when it is not a "
                                                       "terminal; its last line break is dropped)");
  add_sampling_options(cmd, *o);
  cmd.add_flag("--chat", o->chat, "Format the prompt as one user message with the model's chat template");
  add_precision_option(cmd, context);
  return [o, prompt, &context] {
    o->model.bf16_weights = context.precision == Precision::BF16;
    if (o->prompt == "-" || (!prompt->count() && !isatty(STDIN_FILENO))) {  // echo "text" | qkv generate …
      o->prompt.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
      // echo ends its text with a line break that is no part of the prompt (it would become a token)
      if (o->prompt.ends_with('\n')) o->prompt.pop_back();
      if (o->prompt.ends_with('\r')) o->prompt.pop_back();
    }
    note_unused_sampling(*o, "generate");
    return run_generate(*o);
  };
}

}  // namespace qkv::cli
