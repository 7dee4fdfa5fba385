// A reply's text as its tokens arrive: whole UTF-8 characters only (a byte-level token that ends inside a character
// is held back), and OpenAI's `stop` strings — the reply ends before the first one, and text that could be the start
// of one is held back until it is clear. The server streams every reply through one. Tokens become text through
// text::StreamDecoder (a window of the last few tokens per token, not the whole reply again; special tokens give no
// text, as `qkv generate` prints).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/text/stream.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::serve {

// One reply's tokens in, its text out (not thread-safe: the scheduler's thread alone pushes)
class ReplyText {
 public:
  // `tokenizer` must outlive this; `stops`: strings that end the reply (empty ones are ignored)
  ReplyText(const text::Tokenizer& tokenizer, std::vector<std::string> stops);
  // The new text `token` makes safe to hand out (possibly empty)
  std::string push(int64_t token);
  // Whatever is still held back, when the reply ends without a stop string (an unfinished character as U+FFFD)
  std::string finish();
  bool stopped() const { return stopped_; }         // a stop string was seen: the reply is complete
  const std::string& text() const { return sent_; }  // everything handed out

 private:
  std::string release(bool final);
  text::StreamDecoder decoder_;
  std::vector<std::string> stops_;
  std::string decoded_;  // the reply's text so far, whole characters (what decoder_ handed out)
  std::string sent_;
  bool stopped_ = false;
};

// How many bytes at the end of `text` are an unfinished UTF-8 character (0: it ends on a whole one)
size_t unfinished_utf8_tail(const std::string& text);

}  // namespace qkv::serve
