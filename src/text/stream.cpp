// The streaming detokenizer (see qkv/text/stream.hpp): the incremental decoding of text-generation-inference and
// vLLM — decode the tokens since the last text handed out with the one before them, hand out what is new.
#include "qkv/text/stream.hpp"

#include "qkv/text/hf_tokenizer.hpp"

namespace qkv::text {

namespace {
// The longest a character spans in byte-level tokens (4 bytes); a held window longer than this is not waiting for
// a character any more (the model wrote a real U+FFFD, or bytes that never form one), and is handed out.
constexpr size_t kMaxHeld = 4;
}  // namespace

bool ends_mid_character(const std::string& text) {
  if (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) return true;  // U+FFFD
  // A lead byte (11xxxxxx) among the last 3 bytes with fewer continuation bytes after it than it announces
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    const auto c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return back < need;
  }
  return false;
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::decode(size_t begin, size_t end) const {
  const std::span<const int64_t> ids(tokens_.data() + begin, end - begin);
  if (skip_special_)
    if (const auto* hf = dynamic_cast<const HfTokenizer*>(&tokenizer_)) return hf->decode_text(ids);
  return tokenizer_.decode(ids);
}

std::string StreamDecoder::push(int64_t token) {
  tokens_.push_back(token);
  const std::string before = decode(prefix_, read_);
  const std::string now = decode(prefix_, tokens_.size());
  if (now.size() <= before.size() || now.compare(0, before.size(), before) != 0) return "";
  if (ends_mid_character(now) && tokens_.size() - read_ < kMaxHeld) return "";  // wait for the rest of it
  std::string fresh = now.substr(before.size());
  prefix_ = read_;
  read_ = tokens_.size();
  text_ += fresh;
  return fresh;
}

std::string StreamDecoder::finish() {
  const std::string before = decode(prefix_, read_);
  const std::string now = decode(prefix_, tokens_.size());
  std::string rest = now.size() > before.size() && now.compare(0, before.size(), before) == 0 ? now.substr(before.size()) : "";
  text_ += rest;
  tokens_.clear();
  prefix_ = read_ = 0;
  return rest;
}

}  // namespace qkv::text
