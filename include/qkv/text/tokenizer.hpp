// Tokenizers: GPT-2's byte-level BPE, exact to OpenAI's encoder (and tiktoken's "gpt2"), and a plain
// byte tokenizer (256 ids) for fast tiny experiments.
// Not here: windows and batches over token ids (text/dataset.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::text {

// Text ↔ token ids: GPT-2's BPE, bytes, or a Hugging Face tokenizer.json
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Text must be valid UTF-8 (ValueError naming the byte offset otherwise; see replace_invalid_utf8).
  // With allow_special, "<|endoftext|>" in the text becomes the end-of-text id.
  virtual std::vector<int64_t> encode(std::string_view text, bool allow_special = true) const = 0;
  // Bytes that do not form valid UTF-8 come out as U+FFFD.
  virtual std::string decode(std::span<const int64_t> ids) const = 0;
  // One token's bytes as they are: a piece of a character split across byte-level tokens stays its bytes (decode
  // would make it U+FFFD), for labels that show them (viz::token_label).
  virtual std::string token_bytes(int64_t id) const { return decode(std::span<const int64_t>(&id, 1)); }
  virtual int64_t vocab_size() const = 0;
  virtual int64_t end_of_text() const = 0;  // the id of <|endoftext|>, or −1 if there is none
  virtual std::string name() const = 0;     // "gpt2" or "bytes"
};

// One id per byte; no special tokens.
class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> encode(std::string_view text, bool allow_special = true) const override;
  std::string decode(std::span<const int64_t> ids) const override;
  std::string token_bytes(int64_t id) const override;
  int64_t vocab_size() const override { return 256; }
  int64_t end_of_text() const override { return -1; }
  std::string name() const override { return "bytes"; }
};

// GPT-2's byte-level BPE (encoder.json + vocab.bpe): ids identical to tiktoken's
class GPT2Tokenizer : public Tokenizer {
 public:
  // Reads encoder.json and vocab.bpe from `directory`. A missing file is an IoError that says how to get
  // them (scripts/fetch-gpt2-vocab); a malformed one names the file and the line.
  static std::unique_ptr<GPT2Tokenizer> load(const std::string& directory);
  ~GPT2Tokenizer() override;

  std::vector<int64_t> encode(std::string_view text, bool allow_special = true) const override;
  std::string decode(std::span<const int64_t> ids) const override;
  std::string token_bytes(int64_t id) const override;
  int64_t vocab_size() const override;
  int64_t end_of_text() const override { return 50256; }
  std::string name() const override { return "gpt2"; }

  struct State;

 private:
  explicit GPT2Tokenizer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Where GPT-2's files are looked for when no directory is given, in order: $QKV_VOCAB_DIR, ./data/gpt2,
// $XDG_CACHE_HOME/qkv/gpt2 (or ~/.cache/qkv/gpt2). Returns the first that has both files, or nullopt.
std::optional<std::string> find_gpt2_vocabulary();
std::vector<std::string> gpt2_vocabulary_search_path();

// "gpt2" (vocabulary from `directory`, or found as above), "bytes", or the path of a Hugging Face tokenizer.json (or of
// a model folder holding one; text/hf_tokenizer.hpp).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& directory = "");

// UTF-8 checks: the byte offset of the first invalid sequence, or nullopt; and a copy with each invalid
// sequence replaced by U+FFFD (one per maximal subpart, as Python's errors="replace").
std::optional<size_t> first_invalid_utf8(std::string_view text);
std::string replace_invalid_utf8(std::string_view text);

}  // namespace qkv::text
