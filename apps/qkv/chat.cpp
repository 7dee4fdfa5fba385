// `qkv chat`: a conversation with a Hugging Face model folder, formatted by the model's own chat template
// (tokenizer_config.json), streamed in whole characters, one sequence of an nn::Session kept between turns (only the
// tokens a turn adds are fed).
// `--messages FILE --print-prompt` prints what the template makes of a conversation, and with `--template` needs no
// model at all.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/session.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/text/stream.hpp"

namespace qkv::cli {

namespace {

std::string read_text(const std::string& path) {
  const std::vector<std::byte> bytes = io::read_file(path, kMaxTextBytes);
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::string token_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

// A tokenizer_config.json's template and its bos/eos token texts.
struct TemplateFile {
  text::ChatTemplate chat;
  std::string bos, eos;
};

TemplateFile read_template_file(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("chat_template"))
    throw IoError(path + ": has no chat_template; the model has no chat format (use qkv generate)");
  std::string source;
  if (j["chat_template"].is_string()) source = j["chat_template"].get<std::string>();
  else if (j["chat_template"].is_array())
    for (const auto& t : j["chat_template"])
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
        source = t["template"].get<std::string>();
  if (source.empty()) throw IoError(path + ": chat_template is neither a string nor a list with a 'default'");
  TemplateFile f;
  try {
    f.chat = text::ChatTemplate::parse(source);
  } catch (const ValueError& e) {
    throw IoError(path + ": " + e.what());
  }
  if (j.contains("bos_token")) f.bos = token_text(j["bos_token"]);
  if (j.contains("eos_token")) f.eos = token_text(j["eos_token"]);
  return f;
}

// A JSON list of messages, OpenAI's and Hugging Face's shape: a role, a content (a string; null or absent beside
// tool_calls) and any other fields (tool_calls, tool_call_id, name …), kept for the template in the file's order.
std::vector<text::ChatMessage> read_messages(const std::string& path) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_array()) throw IoError(path + ": must be a JSON list of {\"role\": …, \"content\": …} messages");
  std::vector<text::ChatMessage> messages;
  for (const auto& m : j) {
    const std::string where = path + ": message " + std::to_string(messages.size() + 1);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw IoError(where + " needs a string role (system, user, assistant or tool)");
    const bool calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (m.contains("tool_calls") && !m["tool_calls"].is_array() && !m["tool_calls"].is_null())
      throw IoError(where + ": tool_calls must be a list of {\"function\": {\"name\": …, \"arguments\": …}}");
    const bool text = m.contains("content") && m["content"].is_string();
    if (!text && !(calls && (!m.contains("content") || m["content"].is_null())))
      throw IoError(where + " needs a string content (null or none only beside tool_calls)");
    text::ChatMessage message{m["role"].get<std::string>(), text ? m["content"].get<std::string>() : ""};
    nlohmann::ordered_json fields = nlohmann::ordered_json::object();
    for (const auto& [key, value] : m.items())
      if (key != "role" && !(key == "content" && text)) fields[key] = value;
    if (!fields.empty()) message.fields = fields.dump();
    messages.push_back(std::move(message));
  }
  return messages;
}

}  // namespace

int run_chat(const ChatCommand& options) {
  text::ChatOptions chat;
  chat.enable_thinking = !options.no_thinking;
  std::vector<text::ChatMessage> messages;
  if (!options.messages_path.empty()) messages = read_messages(options.messages_path);
  if (!options.system.empty()) messages.insert(messages.begin(), {"system", options.system});
  if (options.print_prompt && !options.template_path.empty()) {  // the template alone
    const TemplateFile t = read_template_file(options.template_path);
    chat.bos_token = t.bos, chat.eos_token = t.eos;
    std::cout << t.chat.render(messages, chat);
    return 0;
  }
  if (options.generation.model.checkpoint.empty()) throw UsageError("give --checkpoint DIR (a Hugging Face model folder)");
  LoadedModel loaded = load_model(options.generation.model);
  const auto* tokenizer = dynamic_cast<const text::HfTokenizer*>(loaded.tokenizer.get());
  // What the model lacks is a problem of the input (exit 1), not of the command line.
  if (!tokenizer)
    throw ValueError(loaded.description + " is no Hugging Face model folder (with tokenizer.json and a chat template); "
                     "qkv chat talks to one; use qkv generate");
  if (tokenizer->chat_template().empty())
    throw ValueError(options.generation.model.checkpoint + " has no chat template in tokenizer_config.json; use qkv generate");
  text::ChatTemplate templ;
  try {
    templ = text::ChatTemplate::parse(tokenizer->chat_template());
  } catch (const ValueError& e) {
    throw IoError(options.generation.model.checkpoint + "/tokenizer_config.json: " + e.what());
  }
  if (tokenizer->bos_id() >= 0) chat.bos_token = tokenizer->token_content(tokenizer->bos_id());
  if (tokenizer->end_of_text() >= 0) chat.eos_token = tokenizer->token_content(tokenizer->end_of_text());
  if (options.print_prompt) {
    std::cout << templ.render(messages, chat);
    return 0;
  }
  const nn::Decoder& model = *loaded.model;
  const GenerateCommand& g = options.generation;
  const nn::SamplerOptions sampling = sampler_options(g, loaded);
  const int64_t capacity = std::min<int64_t>(model.context_length(), options.max_context);
  nn::Session session(model, session_options(g, capacity));  // blocks are taken as the conversation grows
  const int64_t conversation = session.open();
  const bool interactive = isatty(STDIN_FILENO);
  std::fprintf(stderr, "qkv chat: %s; KV cache of %s for up to %lld tokens (%s at most), taken as the conversation "
                       "grows. %s\n",
               loaded.description.c_str(), g.kv_cache.c_str(), static_cast<long long>(capacity),
               mib(session.cache().max_blocks() * session.cache().bytes_per_block()).c_str(),
               interactive ? "Type a message; an empty line or Ctrl-D ends the chat." : "Reading messages from stdin, one per line.");
  int64_t turns = 0;
  // One turn: render the conversation, keep the cached tokens it begins with, feed the rest, stream the reply.
  auto turn = [&]() {
    std::vector<int64_t> ids = tokenizer->encode_rendered(templ.render(messages, chat));
    // A conversation that no longer fits the cache with room for a reply loses its oldest turns (a leading system
    // message stays): whole turns, so what remains still starts with a user's message.
    size_t dropped = 0;
    const size_t first = !messages.empty() && messages.front().role == "system" ? 1 : 0;
    while (static_cast<int64_t>(ids.size()) + g.max_new_tokens > capacity && messages.size() > first + 1) {
      do {
        messages.erase(messages.begin() + static_cast<std::ptrdiff_t>(first));
        ++dropped;
      } while (messages.size() > first + 1 && messages[first].role != "user");
      ids = tokenizer->encode_rendered(templ.render(messages, chat));
    }
    if (dropped > 0)
      std::fprintf(stderr, "qkv chat: the conversation filled the %lld-token cache (--max-context); dropped its oldest "
                           "%s to make room\n", static_cast<long long>(capacity),
                   count_of(static_cast<int64_t>(dropped), "message").c_str());
    if (static_cast<int64_t>(ids.size()) + g.max_new_tokens > capacity)
      throw UsageError("the message alone has " + std::to_string(ids.size()) + " tokens; with --max-new-tokens " +
                       std::to_string(g.max_new_tokens) + " it would pass the " + std::to_string(capacity) +
                       "-token cache; give a larger --max-context (at most the model's " +
                       std::to_string(model.context_length()) + "), a smaller --max-new-tokens or a shorter message");
    // The template may rewrite the history (Qwen3 drops old <think> blocks): the cache is cut where it differs, and
    // at least the last token is fed again for its logits.
    // A model with Gated DeltaNet layers keeps a state of the whole conversation: kept whole, or fed again from 0.
    int64_t keep = std::min<int64_t>(session.common_prefix(conversation, ids), static_cast<int64_t>(ids.size()) - 1);
    if (session.cache().state_floats() > 0 && keep != session.length(conversation)) keep = 0;
    session.truncate(conversation, keep);
    nn::GenerationRequest r;
    r.prompt.assign(ids.begin() + keep, ids.end());
    r.max_new_tokens = g.max_new_tokens;
    r.sampling = sampling;
    r.sampling.seed = sampling.seed + static_cast<uint64_t>(turns++);
    r.stop_ids = loaded.stop_ids;
    r.sequence = conversation;
    text::StreamDecoder stream(*tokenizer);
    nn::generate(session, {r}, [&](size_t, int64_t token) {
      std::cout << stream.push(token) << std::flush;
      return true;
    });
    std::cout << stream.finish() << "\n" << std::flush;
    messages.push_back({"assistant", stream.text()});
  };
  if (!messages.empty() && messages.back().role == "user") turn();
  for (std::string line;;) {
    if (interactive) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line) || (interactive && line.empty())) break;
    // Piped text: a blank line separates, it is no message (it would make the model answer nothing).
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    messages.push_back({"user", line});
    turn();
  }
  return 0;
}

Runner setup_chat(CLI::App& cmd, CommandContext& context) {
  auto o = std::make_shared<ChatCommand>();
  add_model_options(cmd, o->generation.model);
  add_weights_option(cmd, o->generation.model);
  add_sampling_options(cmd, o->generation);
  cmd.add_option("--system", o->system, "A system message before the conversation");
  cmd.add_option("--messages", o->messages_path, "Start from these messages (JSON list of {role, content})");
  cmd.add_flag("--print-prompt", o->print_prompt, "Print what the chat template makes of the messages, and stop");
  cmd.add_option("--template", o->template_path, "With --print-prompt: a tokenizer_config.json (no model needed)");
  cmd.add_flag("--no-thinking", o->no_thinking, "Qwen3: render enable_thinking = false (an empty think block)");
  cmd.add_option("--max-context", o->max_context, "Tokens the KV cache holds")->capture_default_str()
      ->check(int_at_least(1));
  add_precision_option(cmd, context);
  return [o, &context] {
    o->generation.model.bf16_weights = context.precision == Precision::BF16;
    note_unused_sampling(o->generation, "chat");
    return run_chat(*o);
  };
}

}  // namespace qkv::cli
