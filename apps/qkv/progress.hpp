// A progress line on stderr for long work (qkv train, qkv eval): a bar sized to the terminal and a text, redrawn in
// place on a terminal, printed every few percent otherwise (logs, pipes).
#pragma once

#include <cstdint>
#include <string>

namespace qkv::cli {

std::string format_duration(double seconds);  // "3m07s", "1h02m"

class ProgressLine {
 public:
  explicit ProgressLine(bool shown = true);
  // `done` of `total` units; `text` follows the bar (" step 3/10  loss …").
  void draw(int64_t done, int64_t total, const std::string& text);
  // A line of its own, above the bar.
  void message(const std::string& text);

 private:
  bool tty_, shown_;
  int64_t last_printed_ = -1;
};

}  // namespace qkv::cli
