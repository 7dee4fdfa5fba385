// Chat templates: the Jinja a model's tokenizer_config.json carries to format a conversation (Llama 3's, Qwen3's,
// Gemma 3's), rendered as Hugging Face's transformers renders them (Jinja with trim_blocks and lstrip_blocks, the
// bos_token/eos_token variables, raise_exception). Enough of Jinja for those templates and their kin: text, {{ }},
// {% if/elif/else %}, {% for %} with loop.*, {% set %} (also namespace attributes), filters (trim, length, tojson,
// upper, lower, join, first, last, default, string, items), tests (defined, none, string, iterable, mapping, number,
// true, false), string methods (startswith, endswith, split, strip, lstrip, rstrip, replace, upper, lower), slices.
// Rendering is bounded (steps and output size), so a template cannot hang or exhaust memory.
// Not here: tokenising the result (hf_tokenizer.hpp).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::text {

// One message of a conversation
struct ChatMessage {
  std::string role, content;  // "system", "user", "assistant" or "tool", and its text
  // The message's other fields as the text of a JSON object, in the file's order: what tool calls and their results
  // carry (tool_calls, tool_call_id, name, reasoning_content). The template sees them as message.<field>; a
  // "content": null here gives message.content = none. Empty: no other fields.
  std::string fields = {};
};

// What a template reads besides the messages
struct ChatOptions {
  bool add_generation_prompt = true;  // end with the assistant's turn opened, for the model to write
  std::string bos_token, eos_token;  // the tokenizer's special tokens, as bos_token and eos_token
  bool enable_thinking = true;  // Qwen3's switch: false renders an empty <think></think>
};

// A chat template (tokenizer_config.json's Jinja), parsed once and rendered as Hugging Face's apply_chat_template renders it
class ChatTemplate {
 public:
  // ValueError naming the line and what is wrong for a syntax error or a construct qkv does not render.
  static ChatTemplate parse(std::string_view source);
  // ValueError for a template's raise_exception (its message), a runtime type error, or a render past the limits.
  std::string render(const std::vector<ChatMessage>& messages, const ChatOptions& options) const;

  struct Node;
  ChatTemplate();
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;  // Movable, not copyable
  ChatTemplate& operator=(ChatTemplate&&) noexcept;  // Movable, not copyable

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace qkv::text
