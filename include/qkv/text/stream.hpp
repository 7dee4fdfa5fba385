// A streaming detokenizer: tokens in one at a time, text out in whole UTF-8 characters only. A byte-level token that
// ends inside a character (an emoji or a CJK character split between tokens) is held back until the character is
// complete. Each token costs decoding a window of a few tokens (the ones since the last text handed out), not the
// whole reply again, and the window keeps what depends on the token before (SentencePiece's leading space) right.
// Not here: deciding which tokens to stream (the stop token is the generator's to hold back: nn/session.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/text/tokenizer.hpp"

namespace qkv::text {

// One sequence's tokens in, its text out in whole characters (one per stream; not thread-safe)
class StreamDecoder {
 public:
  // Decodes with `tokenizer` (kept by reference: it must outlive this); skip_special: a Hugging Face tokenizer's
  // special tokens give no text (what a person reads), as HfTokenizer::decode_text.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = true);
  // The text `token` completes: whole characters, possibly empty (held back until the next token ends a character).
  std::string push(int64_t token);
  // Whatever is still held back (an unfinished character comes out as U+FFFD); then starts afresh.
  std::string finish();
  // All text handed out so far, by push and finish
  const std::string& text() const { return text_; }

 private:
  std::string decode(size_t begin, size_t end) const;
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int64_t> tokens_;
  size_t prefix_ = 0, read_ = 0;  // tokens_[prefix_, read_) decode to text already handed out; read_… is new
  std::string text_;
};

// Whether `text` ends inside a UTF-8 character, or with the U+FFFD a decoder writes for one: the bytes that
// could still become a character if more came.
bool ends_mid_character(const std::string& text);

}  // namespace qkv::text
