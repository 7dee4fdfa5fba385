// `qkv generate`: continue a prompt with any checkpoint qkv reads, streaming whole characters as they come, or a file
// of prompts (--prompts) generated as one batch, one JSON result per line. A thin user of nn::Session.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt2.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/session.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/text/stream.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::cli {

LoadedModel load_model(const ModelOptions& options) {
  if (options.checkpoint.empty() && options.gpt2_path.empty())
    throw UsageError("give the model: --checkpoint FILE (or the file first, without --checkpoint), or --gpt2 FILE");
  nn::PretrainedOptions o;
  o.hint = options.hint;
  o.vocab_dir = options.vocab_dir;
  o.adapter = options.adapter;
  o.matrices = options.bf16_weights ? DType::BF16 : DType::F32;
  if (options.weights == "stored") o.keep_stored = true;
  else if (auto type = kernels::weight_type_from_name(options.weights)) o.weights = type;
  else throw UsageError("--weights " + options.weights + " is not stored, f32, bf16, f16, q8_0, q4_0, q4_k, q5_k or q6_k");
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

nn::SessionOptions session_options(const GenerateCommand& g, int64_t max_tokens) {
  nn::SessionOptions o;
  o.max_tokens = max_tokens;
  o.kv_type = *kernels::weight_type_from_name(g.kv_cache);  // checked by the option
  return o;
}

std::string kv_cache_summary(const nn::Session& session) {
  const nn::KVBlockCache& cache = session.cache();
  return "KV cache " + mib(cache.bytes_allocated()) + " of " + kernels::weight_type_name(cache.type()) + " (" +
         count_of(cache.blocks_allocated() * cache.block_size(), "position") + " in blocks of " +
         std::to_string(cache.block_size()) + ")";
}

nn::SamplerOptions sampler_options(const GenerateCommand& g, const LoadedModel& loaded) {
  nn::SamplerOptions o;
  o.greedy = g.greedy;
  o.temperature = g.greedy ? 0.0 : g.temperature;
  o.top_k = g.top_k;
  o.top_p = g.top_p;
  o.min_p = g.min_p;
  o.repetition_penalty = g.repetition_penalty;
  o.presence_penalty = g.presence_penalty;
  o.frequency_penalty = g.frequency_penalty;
  o.seed = g.seed;
  o.vocab_limit = loaded.tokenizer ? loaded.tokenizer->vocab_size() : 0;
  return o;
}

namespace {

// The prompt's token ids: as text, or as one user message in the model's chat template.
std::vector<int64_t> encode_prompt(const LoadedModel& loaded, const std::string& text, bool chat) {
  if (!chat) return loaded.tokenizer->encode(text);
  const auto* hf = dynamic_cast<const text::HfTokenizer*>(loaded.tokenizer.get());
  if (!hf || hf->chat_template().empty())
    throw ValueError("--chat needs a model folder whose tokenizer_config.json has a chat template; " + loaded.description + " has none");
  return loaded.encode_chat({{"user", text}});
}

void check_language_model(const LoadedModel& loaded) {
  if (loaded.model->is_classifier())
    throw UsageError(loaded.description + " is a classifier (" + std::to_string(loaded.classifier.classes()) +
                     " classes), not a language model: it has no head to generate with; use qkv classify");
  if (loaded.is_classifier())
    std::fprintf(stderr, "qkv generate: note: %s is a fine-tuned classifier (%lld classes); as a language model its "
                         "output head is tok_emb.weight (qkv classify uses its own head)\n",
                 loaded.description.c_str(), static_cast<long long>(loaded.classifier.classes()));
}

void check_ids(const std::vector<int64_t>& prompt, const nn::LanguageModel& model) {
  for (int64_t id : prompt)
    if (id >= model.vocab_size())
      throw ValueError("the prompt's token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(model.vocab_size()) + ") of the model; is the tokenizer the model's own?");
}

// --prompts FILE: every line a JSON string (blank lines skipped), all checked before the model is loaded.
std::vector<std::string> read_prompts(const std::string& path) {
  const std::vector<std::byte> bytes = io::read_file(path, kMaxTextBytes);
  const std::string all(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::vector<std::string> prompts;
  size_t line_no = 0;
  for (size_t at = 0; at < all.size();) {
    size_t end = all.find('\n', at);
    if (end == std::string::npos) end = all.size();
    std::string line = all.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      throw IoError(path + ":" + std::to_string(line_no) + ": not JSON; each line must be one JSON string, e.g. "
                    "\"Once upon a time\"");
    }
    if (!j.is_string())
      throw IoError(path + ":" + std::to_string(line_no) + ": a JSON " + std::string(j.type_name()) +
                    ", not a string; each line must be one JSON string, e.g. \"Once upon a time\"");
    prompts.push_back(j.get<std::string>());
  }
  if (prompts.empty()) throw IoError(path + ": no prompts; write one JSON string per line");
  return prompts;
}

// A file of prompts as one batch: one JSON object per line, in the file's order, printed once all have finished.
int generate_batch(const GenerateCommand& options) {
  const std::vector<std::string> texts = read_prompts(options.prompts_path);
  LoadedModel loaded = load_model(options.model);
  check_language_model(loaded);
  const nn::Decoder& model = *loaded.model;
  const int64_t context = model.context_length();
  std::vector<nn::GenerationRequest> requests;
  int64_t positions = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = options.replace_invalid ? text::replace_invalid_utf8(texts[i]) : texts[i];
    nn::GenerationRequest r;
    try {
      r.prompt = encode_prompt(loaded, text, options.chat);
    } catch (const ValueError& e) {
      throw IoError(options.prompts_path + ": prompt " + std::to_string(i + 1) + ": " + e.what());
    }
    if (r.prompt.empty() && loaded.tokenizer->end_of_text() >= 0) r.prompt.push_back(loaded.tokenizer->end_of_text());
    if (r.prompt.empty())
      throw IoError(options.prompts_path + ": prompt " + std::to_string(i + 1) + " gives no tokens");
    if (static_cast<int64_t>(r.prompt.size()) > context) {
      std::fprintf(stderr, "qkv generate: prompt %zu has %zu tokens; only its last %lld (context_length) are used\n",
                   i + 1, r.prompt.size(), static_cast<long long>(context));
      r.prompt.erase(r.prompt.begin(), r.prompt.end() - context);
    }
    check_ids(r.prompt, model);
    r.max_new_tokens = options.max_new_tokens;
    r.sampling = sampler_options(options, loaded);
    r.sampling.seed = options.seed + i;  // each prompt its own stream, the same in any batch
    r.stop_ids = loaded.stop_ids;
    positions += std::min<int64_t>(context, static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
    requests.push_back(std::move(r));
  }
  nn::Session session(model, session_options(options, positions + static_cast<int64_t>(requests.size()) *
                                                                    nn::SessionOptions{}.block_size));
  const auto began = std::chrono::steady_clock::now();
  const std::vector<nn::GenerationResult> results = nn::generate(session, requests);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::string out;
  int64_t produced = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto* hf = dynamic_cast<const text::HfTokenizer*>(loaded.tokenizer.get());
    const std::string reply = hf ? hf->decode_text(results[i].tokens) : loaded.tokenizer->decode(results[i].tokens);
    nlohmann::json j = {{"index", i},
                        {"prompt", texts[i]},
                        {"text", reply},
                        {"tokens", results[i].tokens.size()},
                        {"prompt_tokens", results[i].prompt_tokens},
                        {"finish_reason", nn::finish_reason_name(results[i].finish)}};
    out += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    produced += static_cast<int64_t>(results[i].tokens.size());
  }
  std::cout << out << std::flush;
  std::fprintf(stderr, "qkv generate: %zu prompts as one batch, %lld new tokens in %.2f s (%.1f tok/s, prompts "
                       "included); %s\n",
               results.size(), static_cast<long long>(produced), seconds,
               static_cast<double>(produced) / std::max(seconds, 1e-9), kv_cache_summary(session).c_str());
  return 0;
}

}  // namespace

int run_generate(const GenerateCommand& options) {
  if (!options.prompts_path.empty()) return generate_batch(options);
  LoadedModel loaded = load_model(options.model);
  check_language_model(loaded);
  const nn::Decoder& model = *loaded.model;
  const text::Tokenizer* tokenizer = loaded.tokenizer.get();
  const std::string prompt_text = options.replace_invalid ? text::replace_invalid_utf8(options.prompt) : options.prompt;
  std::vector<int64_t> prompt = encode_prompt(loaded, prompt_text, options.chat);
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
  const int64_t context = model.context_length();
  if (static_cast<int64_t>(prompt.size()) > context) {
    std::fprintf(stderr, "qkv generate: the prompt has %zu tokens; only its last %lld (context_length) are used\n",
                 prompt.size(), static_cast<long long>(context));
    prompt.erase(prompt.begin(), prompt.end() - context);
  }
  check_ids(prompt, model);
  const nn::SamplerOptions sampling = sampler_options(options, loaded);
  const auto began = std::chrono::steady_clock::now();
  if (!options.chat) std::cout << options.prompt << std::flush;
  text::StreamDecoder stream(*tokenizer);
  int64_t produced = 0;
  std::string cache_summary = "no KV cache (--no-cache)";
  if (options.no_cache) {  // the book's loop: the whole context again for every token, for comparison
    nn::SamplingOptions legacy;
    legacy.max_new_tokens = options.max_new_tokens;
    legacy.temperature = sampling.is_greedy() ? 0.0 : sampling.temperature;
    legacy.top_k = sampling.top_k;
    legacy.top_p = sampling.top_p;
    legacy.seed = sampling.seed;
    legacy.use_cache = false;
    legacy.stop_tokens = loaded.stop_ids;
    legacy.vocab_limit = sampling.vocab_limit;
    nn::generate(model, prompt, legacy, [&](int64_t token) {
      if (std::find(loaded.stop_ids.begin(), loaded.stop_ids.end(), token) != loaded.stop_ids.end()) return;
      ++produced;
      std::cout << stream.push(token) << std::flush;
    });
  } else {
    // One sequence in a session; at the model's context the last half of it starts a new sequence (as the book's
    // loop crops), so a reply may run past context_length.
    nn::Session session(model, session_options(options));
    std::vector<int64_t> sequence = prompt;
    for (int64_t left = options.max_new_tokens, round = 0; left > 0; ++round) {
      nn::GenerationRequest r;
      r.prompt = sequence;
      r.max_new_tokens = left;
      r.sampling = sampling;
      r.sampling.seed = sampling.seed + static_cast<uint64_t>(round);
      r.stop_ids = loaded.stop_ids;
      const nn::GenerationResult result = nn::generate(session, {r}, [&](size_t, int64_t token) {
        std::cout << stream.push(token) << std::flush;
        return true;
      })[0];
      produced += static_cast<int64_t>(result.tokens.size());
      left -= static_cast<int64_t>(result.tokens.size());
      if (result.finish != nn::FinishReason::Length || left <= 0 || result.tokens.empty()) break;
      sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
      sequence.erase(sequence.begin(), sequence.end() - std::max<int64_t>(1, context / 2));
    }
    const bool latent = session.cache().keys_only();  // latent attention: one row of latent and rotated key a token
    cache_summary = kv_cache_summary(session) + ", " + count_of(model.block_cache_layers(), "layer") + " × " +
                    (latent ? "a latent of " + std::to_string(session.cache().width()) + " values"
                            : count_of(model.num_kv_heads(), "K/V head"));
    if (const int64_t linear = model.num_layers() - model.block_cache_layers(); linear > 0)  // Gated DeltaNet
      cache_summary += "; " + count_of(linear, "Gated DeltaNet layer") + " keeping a state of " +
                       mib(model.block_cache_state_floats() / linear * 4) + " a sequence";
  }
  std::cout << stream.finish() << "\n" << std::flush;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::fprintf(stderr, "qkv generate: %lld new tokens in %.2f s (%.1f tok/s, prompt included); ",
               static_cast<long long>(produced), seconds, static_cast<double>(produced) / std::max(seconds, 1e-9));
  std::fprintf(stderr, "%s\n", cache_summary.c_str());
  return 0;
}

Runner setup_generate(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<GenerateCommand>();
  add_model_options(cmd, o->model);
  auto* prompt = cmd.add_option("--prompt", o->prompt, "Text to continue (- or none: standard input, when it is not a "
                                                       "terminal; its last line break is dropped)");
  auto* prompts = cmd.add_option("--prompts", o->prompts_path, "A file of prompts, one JSON string per line, generated "
                                                              "as one batch; prints one JSON object per line");
  prompts->excludes(prompt);
  add_weights_option(cmd, o->model);
  add_sampling_options(cmd, *o);
  cmd.add_flag("--chat", o->chat, "Format the prompt as one user message with the model's chat template");
  add_precision_option(cmd, context);
  return [o, prompt, prompts, &context] {
    o->model.bf16_weights = context.precision == Precision::BF16;
    if (o->prompt == "-" || (!prompt->count() && !prompts->count() && !isatty(STDIN_FILENO))) {  // echo "text" | qkv generate …
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
