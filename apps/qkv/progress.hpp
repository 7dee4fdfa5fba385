// A progress line on stderr for long work (qkv train, qkv eval): a bar sized to the terminal and a text, redrawn in
// place on a terminal, printed every few percent otherwise (logs, pipes).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "qkv/train/trainer.hpp"

namespace qkv::cli {

std::string format_duration(double seconds);  // "3m07s", "1h02m"

class ProgressLine {
 public:
  explicit ProgressLine(bool shown = true);
  // `done` of `total` units; `text` follows the bar (" step 3/10  loss …"). Off a terminal a line is printed every
  // 4% of the total; `always` prints this one regardless, without using up its 4% (an estimate before the first step).
  void draw(int64_t done, int64_t total, const std::string& text, bool always = false);
  // A line of its own, above the bar.
  void message(const std::string& text);

 private:
  bool tty_, shown_;
  int64_t last_printed_ = -1;
};

// A training run's progress line: step, loss, learning rate, smoothed tokens/s and the time left. The time left is
// there from the start (begin: an estimate before the first step), then measured on the wall clock, so it counts the
// evaluations and checkpoints between steps too.
class Progress {
 public:
  Progress(int64_t total, int64_t start, bool shown = true)
      : total_(total), start_(start), line_(shown), began_(std::chrono::steady_clock::now()) {}
  // The bar before the first step, its ETA from the seconds a step is expected to take (≤ 0: none drawn).
  void begin(double seconds_per_step) {
    if (seconds_per_step <= 0 || start_ >= total_) return;
    char text[160];
    std::snprintf(text, sizeof text, " step %lld/%lld  ETA ~%s (estimated; measured from the first step on)",
                  static_cast<long long>(start_), static_cast<long long>(total_),
                  format_duration(seconds_per_step * static_cast<double>(total_ - start_)).c_str());
    line_.draw(start_, total_, text, /*always=*/true);
    began_ = std::chrono::steady_clock::now();
  }
  void step(const train::StepReport& r) {
    smoothed_ = smoothed_ == 0 ? r.tokens_per_second : 0.9 * smoothed_ + 0.1 * r.tokens_per_second;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
    const double eta = elapsed / static_cast<double>(std::max<int64_t>(r.step - start_, 1)) * static_cast<double>(total_ - r.step);
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
  double smoothed_ = 0;
  std::chrono::steady_clock::time_point began_;  // when the steps began (begin, or construction)
};

}  // namespace qkv::cli
