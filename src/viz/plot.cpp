// plot_lines: a line chart drawn on a Canvas (canvas.hpp) and saved as PNG.
#include "qkv/viz/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "qkv/core/error.hpp"
#include "canvas.hpp"

namespace qkv::viz {

namespace {

std::string tick_label(double v, double step) {
  char buf[32];
  const int decimals = step >= 1 ? 0 : std::min(4, static_cast<int>(std::ceil(-std::log10(step))));
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over the range.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) return m * magnitude;
  return 10 * magnitude;
}

}  // namespace

void plot_lines(const std::string& path, const std::string& title, const std::string& x_label,
                const std::string& y_label, const std::vector<Series>& series, int width, int height) {
  double x_min = INFINITY, x_max = -INFINITY, y_min = INFINITY, y_max = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x_min = std::min(x_min, x), x_max = std::max(x_max, x), y_min = std::min(y_min, y), y_max = std::max(y_max, y);
    }
  if (!std::isfinite(x_min)) {
    throw ValueError(path + ": there is no finite value to plot (every point is NaN or infinite; did the run diverge?)");
  }
  if (x_max == x_min) x_max = x_min + 1;
  if (y_max == y_min) y_max = y_min + 1;
  const double y_step = nice_step(y_max - y_min, 6), x_step = nice_step(x_max - x_min, 8);
  y_min = std::floor(y_min / y_step) * y_step, y_max = std::ceil(y_max / y_step) * y_step;
  const int left = 90, right = width - 30, top = 50, bottom = height - 60;
  auto px = [&](double x) { return left + (x - x_min) / (x_max - x_min) * (right - left); };
  auto py = [&](double y) { return bottom - (y - y_min) / (y_max - y_min) * (bottom - top); };
  Canvas c(width, height);
  c.text((width - Canvas::text_width(title)) / 2, 14, title);
  for (double y = y_min; y <= y_max + y_step / 2; y += y_step) {
    const int yy = static_cast<int>(std::lround(py(y)));
    c.line(left, yy, right, yy, {225, 225, 225}, 1);
    const std::string label = tick_label(y, y_step);
    c.text(left - 10 - Canvas::text_width(label), yy - 7, label);
  }
  for (double x = std::ceil(x_min / x_step) * x_step; x <= x_max + x_step / 2; x += x_step) {
    const int xx = static_cast<int>(std::lround(px(x)));
    c.line(xx, top, xx, bottom, {235, 235, 235}, 1);
    const std::string label = tick_label(x, x_step);
    c.text(xx - Canvas::text_width(label) / 2, bottom + 10, label);
  }
  c.line(left, bottom, right, bottom, {60, 60, 60}, 2);
  c.line(left, top, left, bottom, {60, 60, 60}, 2);
  c.text((left + right - Canvas::text_width(x_label)) / 2, height - 28, x_label);
  c.text(8, top - 30, y_label);
  int legend_y = top + 8;
  for (const auto& s : series) {
    for (size_t i = 1; i < s.points.size(); ++i)
      c.line(px(s.points[i - 1].first), py(s.points[i - 1].second), px(s.points[i].first), py(s.points[i].second), s.color, 2);
    if (s.points.size() == 1) c.rect(static_cast<int>(px(s.points[0].first)) - 2, static_cast<int>(py(s.points[0].second)) - 2,
                                     static_cast<int>(px(s.points[0].first)) + 2, static_cast<int>(py(s.points[0].second)) + 2, s.color);
    const int lx = right - 20 - Canvas::text_width(s.name) - 30;
    c.rect(lx, legend_y + 3, lx + 20, legend_y + 9, s.color);
    c.text(lx + 28, legend_y, s.name);
    legend_y += 22;
  }
  c.save_png(path);
}

}  // namespace qkv::viz
