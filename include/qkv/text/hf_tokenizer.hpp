// Hugging Face's tokenizer.json: the BPE model with its normalizer, pre-tokenizer (the file's own Split regex through
// PCRE2, ByteLevel, Metaspace), added and special tokens matched before BPE, the post_processor (TemplateProcessing's
// BOS/EOS where the file has one) and the decoder (ByteLevel, or SentencePiece-style Replace/ByteFallback/Fuse) — so
// Llama 3's, Qwen's, Gemma's, Mistral's, DeepSeek-V3's and gpt-oss's files give the ids Hugging Face's tokenizers give.
// tokenizer_config.json, when given, names the BOS and EOS tokens, holds the chat template, and for the classes whose
// transformers tokenizer rebuilds the post-processor (LlamaTokenizerFast, Gemma's, CodeLlama's, Cohere's) its
// add_bos_token / add_eos_token decide what encode adds, as in transformers.
// Not here: GPT-2's own files (tokenizer.hpp), chat templates (chat_template.hpp).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/text/tokenizer.hpp"

namespace qkv::io {
class GgufFile;
}

namespace qkv::text {

// A Hugging Face tokenizer.json (BPE: Llama 3, Qwen, Gemma 3, GPT-2) with its tokenizer_config.json: ids as Hugging Face's
class HfTokenizer : public Tokenizer {
 public:
  // Reads tokenizer.json (and tokenizer_config.json if `config_path` is not empty and exists). IoError naming the
  // file and the key for anything malformed or unsupported (a model other than BPE, a merges entry naming an
  // unknown token, a pre-tokenizer qkv lacks).
  static std::unique_ptr<HfTokenizer> load(const std::string& tokenizer_path, const std::string& config_path = "");
  // The same from the files' text; `label` names them in messages.
  static std::unique_ptr<HfTokenizer> parse(std::string_view tokenizer_json, std::string_view config_json = "",
                                            const std::string& label = "tokenizer.json");
  // Both files of a Hugging Face model folder, and its chat template as transformers finds it (folder_chat_template);
  // nullptr when it has no tokenizer.json.
  static std::unique_ptr<HfTokenizer> from_folder(const std::string& dir);
  // The tokenizer of a GGUF file's tokenizer.ggml.* metadata (llama.cpp's vocabulary), run as the tokenizer.json it
  // was converted from: model "gpt2" (byte-level BPE: tokens, merges, the pre-tokenizer regexes named by
  // tokenizer.ggml.pre — llama-bpe, qwen2, deepseek-v3, gpt-4o …) or "llama" (SentencePiece: tokens, scores, <0xNN>
  // byte tokens); token types (control and user-defined tokens are matched in text, control ones as special);
  // bos/eos/unk/padding ids, add_bos_token/add_eos_token, add_space_prefix and tokenizer.chat_template, with llama.cpp's
  // defaults where a key is absent. IoError naming the file and the key for anything missing, malformed or unknown.
  static std::unique_ptr<HfTokenizer> from_gguf(const io::GgufFile& file);
  ~HfTokenizer() override;

  // tokenizer(text): added tokens matched first (special ones only with allow_special), the rest normalised,
  // pre-tokenised and merged; then, with allow_special, the post_processor's special tokens (e.g. BOS).
  std::vector<int64_t> encode(std::string_view text, bool allow_special = true) const override;
  // Special tokens in the text matched, but nothing added by the post_processor: what apply_chat_template(tokenize=True)
  // gives for a rendered chat, whose text already holds the BOS the template put there.
  std::vector<int64_t> encode_rendered(std::string_view text) const;
  std::string decode(std::span<const int64_t> ids) const override;
  std::string token_bytes(int64_t id) const override;  // byte-fallback and byte-level pieces as their bytes
  // Like decode, without the special tokens (what a person reads of a generation).
  std::string decode_text(std::span<const int64_t> ids) const;
  int64_t vocab_size() const override;
  int64_t end_of_text() const override;  // tokenizer_config.json's eos_token (or its class's default), else −1
  std::string name() const override;  // "tokenizer.json" or "gguf"

  int64_t token_id(std::string_view token) const;  // −1 when the vocabulary has no such token
  int64_t bos_id() const;                          // tokenizer_config.json's bos_token (or its class's), else −1
  int64_t pad_id() const;  // tokenizer_config.json's pad_token (a GGUF's padding_token_id), else −1
  bool is_special(int64_t id) const;  // Whether `id` is a special (added, special) token
  // tokenizer_config.json's, or the folder's own file (from_folder); empty when none
  const std::string& chat_template() const;
  std::string token_content(int64_t id) const;     // the token's text as the vocabulary spells it

  struct State;

 private:
  explicit HfTokenizer(std::unique_ptr<State> state);
  std::vector<int64_t> encode_impl(std::string_view text, bool allow_special, bool post_process) const;
  std::unique_ptr<State> state_;
};

// A model folder's chat template as transformers (4.43 and later) finds it: its chat_template.jinja when there is one
// (it wins over tokenizer_config.json's: how save_pretrained writes templates now, gpt-oss's and Qwen3-Next's among
// them), else `config_template` (tokenizer_config.json's chat_template), else chat_template.json's "chat_template".
// IoError naming a chat_template.json that is not a JSON object with a string there.
std::string folder_chat_template(const std::string& dir, const std::string& config_template);

}  // namespace qkv::text
