// Labelled matrices and shaded attention grids (see qkv/viz/show.hpp).
#include "qkv/viz/show.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <utf8proc.h>

#include "canvas.hpp"

namespace qkv::viz {

namespace {
std::string fmt(float v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, static_cast<double>(v));
  return buf;
}

std::string pad_left(const std::string& s, size_t width) {
  const size_t w = display_width(s);
  return w >= width ? s : std::string(width - w, ' ') + s;
}

std::string pad_right(const std::string& s, size_t width) {
  const size_t w = display_width(s);
  return w >= width ? s : s + std::string(width - w, ' ');
}

std::vector<std::string> labels_or_numbers(const std::vector<std::string>& labels, int64_t n, const char* prefix) {
  if (static_cast<int64_t>(labels.size()) == n) return labels;
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

Tensor as_matrix(const Tensor& m) {
  if (m.rank() == 2) return m;
  if (m.rank() == 1) return m.view_as_shape({1, m.size(0)});
  throw ShapeError("show::matrix: needs a 1-D or 2-D tensor, got shape " + m.shape().str());
}
}  // namespace

size_t display_width(std::string_view text) {
  size_t width = 0;
  utf8proc_int32_t previous = 0;
  int previous_width = 0;
  for (size_t at = 0; at < text.size();) {
    utf8proc_int32_t c = 0;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + at),
                                    static_cast<utf8proc_ssize_t>(text.size() - at), &c);
    if (n <= 0) {  // a byte that starts no character: terminals show one replacement character
      ++width, ++at, previous = 0, previous_width = 1;
      continue;
    }
    at += static_cast<size_t>(n);
    int w = utf8proc_charwidth(c);
    if (previous == 0x200D) w = 0;  // joined to the emoji before it (👩‍💻 is one picture, two columns)
    if (c == 0xFE0F && previous_width == 1) w = 1;  // emoji presentation widens a narrow symbol (❤️)
    width += static_cast<size_t>(std::max(w, 0));
    previous = c, previous_width = w;
  }
  return width;
}

std::string matrix(const std::string& title, const Tensor& input, const std::vector<std::string>& row_labels,
                   const std::vector<std::string>& col_labels, const Style& style, bool row_sums) {
  const Tensor m = as_matrix(input);
  const int64_t rows = m.size(0), cols = m.size(1);
  const auto rl = labels_or_numbers(row_labels, rows, "");
  const auto cl = labels_or_numbers(col_labels, cols, "d");
  size_t label_width = 0;
  for (const auto& l : rl) label_width = std::max(label_width, display_width(l));
  size_t cell = 0;
  for (int64_t i = 0; i < m.numel(); ++i) cell = std::max(cell, fmt(m.data()[i], style.decimals).size());
  for (const auto& l : cl) cell = std::max(cell, display_width(l));
  cell += 2;
  std::ostringstream os;
  os << title << "  (" << rows << "×" << cols << ")\n";
  os << std::string(label_width, ' ');
  for (const auto& l : cl) os << pad_left(l, cell);
  if (row_sums) os << pad_left("row sum", cell + 4);
  os << '\n';
  for (int64_t r = 0; r < rows; ++r) {
    os << pad_right(rl[static_cast<size_t>(r)], label_width);
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = m.data()[r * cols + c];
      sum += v;
      os << pad_left(fmt(v, style.decimals), cell);
    }
    if (row_sums) os << pad_left(fmt(static_cast<float>(sum), style.decimals), cell + 4);
    os << '\n';
  }
  return os.str();
}

namespace {
// The xterm-256 colour nearest to an RGB colour, from the 6×6×6 cube (levels 0, 95, 135, 175, 215, 255).
int xterm_colour(Rgb c) {
  auto level = [](int v) {
    static const int kLevels[] = {0, 95, 135, 175, 215, 255};
    int best = 0;
    for (int i = 1; i < 6; ++i)
      if (std::abs(kLevels[i] - v) < std::abs(kLevels[best] - v)) best = i;
    return best;
  };
  return 16 + 36 * level(c[0]) + 6 * level(c[1]) + level(c[2]);
}
}  // namespace

std::string heatmap(const std::string& title, const Tensor& weights, const std::vector<std::string>& labels,
                    const Style& style) {
  const Tensor m = as_matrix(weights);
  const int64_t rows = m.size(0), cols = m.size(1);
  const auto rl = labels_or_numbers(labels, rows, "");
  const auto cl = labels_or_numbers(labels, cols, "");
  // Eight shades, from nothing to a full block: more ink = more attention. With colour, the background is the
  // viridis map of the PNG pictures (dark purple = 0, yellow = the largest weight).
  static const char* kShades[] = {" ", "·", "░", "░", "▒", "▒", "▓", "█"};
  size_t label_width = 0;
  for (const auto& l : rl) label_width = std::max(label_width, display_width(l));
  // Shades are relative to the largest weight in the grid, so nearly uniform rows still show structure.
  float largest = 0.0f;
  for (int64_t i = 0; i < m.numel(); ++i)
    if (!std::isnan(m.data()[i])) largest = std::max(largest, m.data()[i]);
  const float unit = largest > 0.0f ? largest : 1.0f;
  std::ostringstream os;
  os << title << "  (rows: queries, columns: keys; each cell shows its weight; "
     << (style.color ? "brighter (yellow) = more attention" : "denser shade = more attention") << "; max = "
     << fmt(largest, style.decimals) << ")\n";
  // Column headers: numbers, listed below with their tokens (stacked words would be hard to read).
  os << std::string(label_width, ' ') << " ";
  for (int64_t c = 0; c < cols; ++c) os << pad_left(std::to_string(c + 1), 5);
  os << '\n';
  for (int64_t r = 0; r < rows; ++r) {
    os << pad_right(rl[static_cast<size_t>(r)], label_width) << " ";
    for (int64_t c = 0; c < cols; ++c) {
      const float v = m.data()[r * cols + c];
      const float t = std::isnan(v) ? 0.0f : std::clamp(v / unit, 0.0f, 1.0f);
      // ".43" or "1.0": the weight itself, so cells and heads with close shades still read differently
      std::string value = std::isnan(v) ? "nan" : v >= 0.995f ? "1.0" : fmt(v, 2).substr(v < 0 ? 0 : 1);
      if (value.size() > 3) value = value.substr(0, 3);
      if (style.color) {
        const Rgb bg = viridis(t);
        os << " \x1b[48;5;" << xterm_colour(bg) << ";38;5;" << (t > 0.6f ? 16 : 231) << "m" << pad_left(value, 4)
           << "\x1b[0m";
      } else {
        os << ' ' << kShades[std::clamp(static_cast<int>(std::lround(t * 7.0f)), 0, 7)] << pad_left(value, 3);
      }
    }
    os << '\n';
  }
  os << std::string(label_width, ' ') << "  keys: ";
  for (int64_t c = 0; c < cols; ++c) os << (c ? ", " : "") << c + 1 << "=" << cl[static_cast<size_t>(c)];
  os << '\n';
  return os.str();
}

std::string bars(const std::vector<float>& values, const std::vector<std::string>& labels, int width) {
  size_t label_width = 0;
  for (const auto& l : labels) label_width = std::max(label_width, display_width(l));
  std::ostringstream os;
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = std::isnan(values[i]) ? 0.0f : std::clamp(values[i], 0.0f, 1.0f);
    const int n = static_cast<int>(std::lround(v * static_cast<float>(width)));
    std::string bar;
    for (int k = 0; k < n; ++k) bar += "█";
    os << "  " << pad_right(i < labels.size() ? labels[i] : std::to_string(i), label_width) << "  "
       << fmt(values[i], 4) << "  " << bar << '\n';
  }
  return os.str();
}

}  // namespace qkv::viz
