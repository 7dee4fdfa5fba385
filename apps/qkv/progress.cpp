// The progress line (see progress.hpp).
#include "progress.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace qkv::cli {

namespace {
int terminal_columns() {
  struct winsize size {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  if (const char* env = std::getenv("COLUMNS"); env && std::atoi(env) > 0) return std::atoi(env);
  return 80;
}
}  // namespace

std::string format_duration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, s / 60 % 60);
  else std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

ProgressLine::ProgressLine(bool shown) : tty_(isatty(STDERR_FILENO)), shown_(shown) {}

void ProgressLine::draw(int64_t done, int64_t total, const std::string& text, bool always) {
  if (!shown_) return;
  // The bar takes what the terminal's width leaves, so the line never wraps (80 columns: a 10-wide bar).
  const int columns = terminal_columns();
  const int width = std::clamp(columns - 3 - static_cast<int>(text.size()), 0, 30);
  const int filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(static_cast<size_t>(width), '.');
  std::string line = width > 0 ? "[" + bar + "]" + text : text.substr(text.empty() || text[0] != ' ' ? 0 : 1);
  if (static_cast<int>(line.size()) >= columns) line.resize(static_cast<size_t>(std::max(columns - 1, 10)));
  if (tty_) {
    std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
  } else if (always) {
    std::fprintf(stderr, "%s\n", line.c_str());
  } else if (done == total || done / std::max<int64_t>(1, total / 25) != last_printed_) {
    last_printed_ = done / std::max<int64_t>(1, total / 25);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

void ProgressLine::message(const std::string& text) {
  if (!shown_) return;
  std::fprintf(stderr, tty_ ? "\r\x1b[K%s\n" : "%s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace qkv::cli
