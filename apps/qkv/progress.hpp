// A progress line on stderr for long work (qkv train, qkv eval): a bar sized to the terminal and a text, redrawn in
// place on a terminal, printed every few percent otherwise (logs, pipes).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "qkv/train/trainer.hpp"

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

// A training run's progress line: step, loss, learning rate, smoothed tokens/s and the time left.
class Progress {
 public:
  Progress(int64_t total, int64_t start, bool shown = true) : total_(total), start_(start), line_(shown) {}
  void step(const train::StepReport& r) {
    smoothed_ = smoothed_ == 0 ? r.tokens_per_second : 0.9 * smoothed_ + 0.1 * r.tokens_per_second;
    elapsed_ += r.seconds;
    const double eta = elapsed_ / static_cast<double>(r.step - start_) * static_cast<double>(total_ - r.step);
    char text[200];
    std::snprintf(text, sizeof text, " step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %s",
                  static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, r.learning_rate, smoothed_,
                  format_duration(eta).c_str());
    line_.draw(r.step, total_, text);
  }
  void message(const std::string& text) { line_.message(text); }

 private:
  int64_t total_, start_;
  ProgressLine line_;
  double smoothed_ = 0, elapsed_ = 0;
};

}  // namespace qkv::cli
