// save_plot: a line chart drawn on a Canvas (canvas.hpp) — axes with ticks, curves, a legend.
#include "qkv/viz/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "canvas.hpp"
#include "qkv/core/error.hpp"

namespace qkv::viz {

namespace {

// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over the range.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) return m * magnitude;
  return 10 * magnitude;
}

// A tick's text: as many decimals as the step needs; very large or small values in scientific notation.
std::string tick_label(double v, double step) {
  char buf[32];
  if (v != 0 && (std::fabs(v) >= 1e6 || std::fabs(v) < 1e-3 || step < 1e-4)) std::snprintf(buf, sizeof buf, "%.2g", v);
  else std::snprintf(buf, sizeof buf, "%.*f", step >= 1 ? 0 : std::min(4, static_cast<int>(std::ceil(-std::log10(step) - 1e-9))), v);
  return buf;
}

struct Range {
  double lo = INFINITY, hi = -INFINITY;
  void add(double v) { lo = std::min(lo, v), hi = std::max(hi, v); }
  bool empty() const { return !(lo <= hi); }
};

// Linear ticks covering [lo, hi], the range widened to whole steps.
std::vector<double> linear_ticks(Range& r, int target) {
  if (r.hi == r.lo) r.lo -= 0.5, r.hi += 0.5;
  const double step = nice_step(r.hi - r.lo, target);
  r.lo = std::floor(r.lo / step + 1e-9) * step, r.hi = std::ceil(r.hi / step - 1e-9) * step;
  std::vector<double> ticks;
  for (double v = r.lo; v <= r.hi + step / 2; v += step) ticks.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return ticks;
}

// Log ticks: powers of ten over the (positive) range widened to whole decades, with 2 and 5 between them when the
// range spans two decades or fewer.
std::vector<double> log_ticks(Range& r) {
  double lo = std::floor(std::log10(r.lo)), hi = std::ceil(std::log10(r.hi));
  if (hi == lo) hi = lo + 1;
  r.lo = std::pow(10.0, lo), r.hi = std::pow(10.0, hi);
  std::vector<double> ticks;
  for (double e = lo; e <= hi; ++e) {
    const double p = std::pow(10.0, e);
    ticks.push_back(p);
    if (hi - lo <= 2 && e < hi) ticks.push_back(2 * p), ticks.push_back(5 * p);
  }
  return ticks;
}

double step_of(const std::vector<double>& ticks) { return ticks.size() > 1 ? ticks[1] - ticks[0] : 1.0; }

}  // namespace

double PlotGeometry::x_pixel(double x) const { return left + (x - x_min) / (x_max - x_min) * (right - left); }
double PlotGeometry::y_pixel(double y) const {
  const double t = log_y ? (std::log10(y) - std::log10(y_min)) / (std::log10(y_max) - std::log10(y_min))
                         : (y - y_min) / (y_max - y_min);
  return bottom - t * (bottom - top);
}
double PlotGeometry::y2_pixel(double y) const { return bottom - (y - y2_min) / (y2_max - y2_min) * (bottom - top); }

PlotGeometry save_plot(const std::string& path, const std::vector<Series>& series, const PlotStyle& style,
                       const PictureOptions& options) {
  picture_format_of(path);
  auto usable = [&](const Series& s, double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && (s.right_axis || !style.log_y || y > 0);
  };
  Range xs, ys, y2s;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points)
      if (usable(s, x, y)) xs.add(x), (s.right_axis ? y2s : ys).add(y);
  if (xs.empty() || ys.empty()) {
    throw ValueError(path + ": there is no finite value to plot" +
                     (style.log_y ? std::string(" above 0 on a log scale") : std::string()) +
                     " (every point is NaN or infinite; did the run diverge?)");
  }
  if (xs.hi == xs.lo) xs.hi = xs.lo + 1;
  const std::vector<double> y_ticks = style.log_y ? log_ticks(ys) : linear_ticks(ys, 6);
  const bool second = !y2s.empty();
  const std::vector<double> y2_ticks = second ? linear_ticks(y2s, 6) : std::vector<double>{};
  // Whole-number axes (epochs) never get a tick between two whole numbers, nor at 2.5, 7.5 (a step of 2.5 becomes 3).
  const double x_step = style.whole_x ? std::max(1.0, std::ceil(nice_step(xs.hi - xs.lo, 8) - 1e-9))
                                      : nice_step(xs.hi - xs.lo, 8);

  PlotGeometry g;
  g.width = style.width, g.height = style.height, g.log_y = style.log_y;
  g.x_min = xs.lo, g.x_max = xs.hi, g.y_min = ys.lo, g.y_max = ys.hi, g.x_step = x_step;
  if (second) g.y2_min = y2s.lo, g.y2_max = y2s.hi;
  double y_label_w = 0, y2_label_w = 0;
  for (double v : y_ticks) y_label_w = std::max(y_label_w, measure_text(tick_label(v, step_of(y_ticks)), kLabelPx).width);
  for (double v : y2_ticks) y2_label_w = std::max(y2_label_w, measure_text(tick_label(v, step_of(y2_ticks)), kLabelPx).width);
  const double line_h = measure_text("Ag", kLabelPx).height, title_h = measure_text("Ag", kTitlePx, true).height;
  g.left = std::ceil(30 + line_h + y_label_w), g.right = style.width - (second ? std::ceil(30 + line_h + y2_label_w) : 24.0);
  g.top = std::ceil(20 + title_h + 16), g.bottom = style.height - std::ceil(24 + 2 * line_h);

  Canvas c(style.width, style.height);
  c.text(style.width / 2.0, 14, style.title, kTitlePx, kInk, Align::center, true);
  for (double y : y_ticks) {  // horizontal grid lines and the left axis's numbers
    const double yy = g.y_pixel(y);
    c.line(g.left, yy, g.right, yy, kGrid, 1);
    c.line(g.left - 5, yy, g.left, yy, kAxis, 1);
    c.text(g.left - 8, yy - line_h / 2, tick_label(y, step_of(y_ticks)), kLabelPx, kInk, Align::right);
  }
  for (double x = std::ceil(xs.lo / x_step - 1e-9) * x_step; x <= xs.hi + x_step * 1e-9; x += x_step) {
    const double xx = g.x_pixel(x);
    c.line(xx, g.top, xx, g.bottom, {238, 238, 238}, 1);
    c.line(xx, g.bottom, xx, g.bottom + 5, kAxis, 1);
    c.text(xx, g.bottom + 8, tick_label(std::fabs(x) < x_step * 1e-9 ? 0.0 : x, x_step), kLabelPx, kInk, Align::center);
  }
  for (double y : y2_ticks) {
    const double yy = g.y2_pixel(y);
    c.line(g.right, yy, g.right + 5, yy, kAxis, 1);
    c.text(g.right + 8, yy - line_h / 2, tick_label(y, step_of(y2_ticks)), kLabelPx, kInk);
  }
  c.line(g.left, g.bottom, g.right, g.bottom, kAxis, 1.5);
  c.line(g.left, g.top, g.left, g.bottom, kAxis, 1.5);
  if (second) c.line(g.right, g.top, g.right, g.bottom, kAxis, 1.5);
  c.text((g.left + g.right) / 2, style.height - 12 - line_h, style.x_label, kLabelPx, kMuted, Align::center);
  c.text(10, (g.top + g.bottom) / 2, style.y_label + (style.log_y ? " (log scale)" : ""), kLabelPx, kMuted,
         Align::center, false, true);
  if (second) c.text(style.width - 10 - line_h, (g.top + g.bottom) / 2, style.y2_label, kLabelPx, kMuted, Align::center, false, true);

  for (const auto& s : series) {
    std::vector<std::pair<double, double>> pixels;
    for (const auto& [x, y] : s.points)
      pixels.emplace_back(usable(s, x, y) ? std::pair{g.x_pixel(x), s.right_axis ? g.y2_pixel(y) : g.y_pixel(y)}
                                          : std::pair<double, double>{NAN, NAN});
    c.polyline(pixels, s.color, 2, s.dashed);
    for (size_t i = 0; i < pixels.size(); ++i) {  // marked points, and points with no neighbour to join, as dots
      const bool alone = (i == 0 || std::isnan(pixels[i - 1].first)) && (i + 1 == pixels.size() || std::isnan(pixels[i + 1].first));
      if ((alone || s.markers) && !std::isnan(pixels[i].first)) c.dot(pixels[i].first, pixels[i].second, 3.5, s.color);
    }
  }
  // The legend on white (so curves under it do not hide it), in the corner of the plotting area where it covers the
  // fewest points of the curves, and the segments between them: top right unless the data are there.
  double legend_w = 0;
  for (const auto& s : series) legend_w = std::max(legend_w, measure_text(s.name, kLabelPx).width);
  const double box_w = legend_w + 50, box_h = static_cast<double>(series.size()) * (line_h + 6) + 4;
  struct Corner { double x, y; };
  const Corner corners[] = {{g.right - 12 - box_w, g.top + 4},
                            {g.left + 12, g.top + 4},
                            {g.right - 12 - box_w, g.bottom - 8 - box_h},
                            {g.left + 12, g.bottom - 8 - box_h}};
  auto covered = [&](const Corner& k) {
    int n = 0;
    for (const auto& s : series) {
      std::pair<double, double> previous{NAN, NAN};
      for (const auto& [x, y] : s.points) {
        if (!usable(s, x, y)) {
          previous = {NAN, NAN};
          continue;
        }
        const double px = g.x_pixel(x), py = s.right_axis ? g.y2_pixel(y) : g.y_pixel(y);
        // the point, and with a previous one three more along the segment between them
        const bool joined = !std::isnan(previous.first);
        for (int t = joined ? 1 : 4; t <= 4; ++t) {
          const double f = t / 4.0;
          const double sx = joined ? previous.first + (px - previous.first) * f : px;
          const double sy = joined ? previous.second + (py - previous.second) * f : py;
          n += sx >= k.x - 4 && sx <= k.x + box_w + 4 && sy >= k.y - 4 && sy <= k.y + box_h + 4;
        }
        previous = {px, py};
      }
    }
    return n;
  };
  Corner best = corners[0];
  int fewest = covered(best);
  for (const Corner& k : corners)
    if (const int n = covered(k); n < fewest) best = k, fewest = n;
  const double lx = best.x + 8;
  double legend_y = best.y + 4;
  c.rect(best.x, best.y, box_w, box_h, kWhite);
  for (const auto& s : series) {
    c.line(lx, legend_y + line_h / 2, lx + 24, legend_y + line_h / 2, s.color, 2.5, s.dashed);
    if (s.markers) c.dot(lx + 12, legend_y + line_h / 2, 3.5, s.color);
    c.text(lx + 32, legend_y, s.name, kLabelPx, kInk);
    legend_y += line_h + 6;
  }
  g.legend_x = best.x, g.legend_y = best.y, g.legend_w = box_w, g.legend_h = box_h;
  c.save(path, options);
  return g;
}

}  // namespace qkv::viz
