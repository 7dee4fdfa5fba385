// ReplyText (see reply_text.hpp).
#include "qkv/serve/reply_text.hpp"

#include <algorithm>

namespace qkv::serve {

size_t unfinished_utf8_tail(const std::string& text) {
  // Walk back over at most 3 continuation bytes to the lead byte and compare what it announces with what is there.
  const size_t n = text.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return want > back ? back : 0;
  }
  return 0;
}

ReplyText::ReplyText(const text::Tokenizer& tokenizer, std::vector<std::string> stops) : decoder_(tokenizer) {
  for (auto& x : stops)
    if (!x.empty()) stops_.push_back(std::move(x));
}

std::string ReplyText::push(int64_t token) {
  if (stopped_) return {};
  decoded_ += decoder_.push(token);
  return release(false);
}

std::string ReplyText::finish() {
  if (stopped_) return {};
  decoded_ += decoder_.finish();
  return release(true);
}

// Hands out what the reply's text so far adds to what was sent, cut at a stop string and, unless final, short of a
// tail that may still grow into a stop string. (The stream decoder hands out whole characters only.)
std::string ReplyText::release(bool final) {
  const std::string& decoded = decoded_;
  if (decoded.size() <= sent_.size()) return {};
  size_t end = decoded.size();
  // The earliest stop string that begins in the unsent part (it may straddle what was sent, so search from a little
  // before it)
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t from = sent_.size() >= s.size() - 1 ? sent_.size() - (s.size() - 1) : 0;
    const size_t at = decoded.find(s, from);
    if (at != std::string::npos && at + s.size() <= decoded.size()) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    end = std::max(cut, sent_.size());
  } else if (!final) {
    // Hold back a tail that is a proper prefix of some stop string.
    size_t hold = 0;
    for (const std::string& s : stops_)
      for (size_t k = std::min(s.size() - 1, end); k > hold; --k)
        if (decoded.compare(end - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    end -= hold;
  }
  if (end <= sent_.size()) return {};
  std::string piece = decoded.substr(sent_.size(), end - sent_.size());
  sent_.append(piece);
  return piece;
}

}  // namespace qkv::serve
