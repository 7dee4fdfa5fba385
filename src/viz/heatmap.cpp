// Attention heatmaps, grids of them and their animations (see qkv/viz/heatmap.hpp), drawn on a Canvas.
#include "qkv/viz/heatmap.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "canvas.hpp"
#include "qkv/core/error.hpp"

namespace qkv::viz {

namespace {

constexpr double kMaxLabelWidth = 150;  // logical pixels; longer labels end in "…"

// The matrix as (rows, cols), or ValueError.
Tensor as_matrix(const Tensor& t, const char* what) {
  Shape s = t.shape();
  while (s.rank() > 2 && s[0] == 1) s = Shape(s.dims().subspan(1));
  if (s.rank() == 1) s = Shape{1, s[0]};
  if (s.rank() != 2) throw ValueError(std::string(what) + ": needs a 2-D matrix of weights, got shape " + t.shape().str());
  return t.view_as_shape(s);
}

// A label cut to fit `max_width` at `px`, whole UTF-8 characters at a time, ending in "…" when cut.
std::string fit(const std::string& label, double px, double max_width = kMaxLabelWidth) {
  if (measure_text(label, px).width <= max_width) return label;
  std::string s = label;
  while (!s.empty()) {
    do s.pop_back();
    while (!s.empty() && (static_cast<unsigned char>(s.back()) & 0xC0) == 0x80);  // drop a whole character
    if (!s.empty() && (static_cast<unsigned char>(s.back()) & 0xC0) == 0xC0) s.pop_back();  // a dangling lead byte
    if (measure_text(s + "\u2026", px).width <= max_width) break;
  }
  return s + "\u2026";
}

std::vector<std::string> labels_or_numbers(const std::vector<std::string>& labels, int64_t n, double px) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back(static_cast<int64_t>(labels.size()) == n ? fit(labels[static_cast<size_t>(i)], px) : std::to_string(i + 1));
  return out;
}

double widest(const std::vector<std::string>& labels, double px) {
  double w = 0;
  for (const auto& l : labels) w = std::max(w, measure_text(l, px).width);
  return w;
}

double largest_finite(const Tensor& m) {
  double v = 0.0;
  for (float x : m.values())
    if (std::isfinite(x)) v = std::max(v, static_cast<double>(x));
  return v > 0.0 ? v : 1.0;
}

bool all_whole(const Tensor& m) {
  for (float x : m.values())
    if (std::isfinite(x) && x != std::round(x)) return false;
  return true;
}

std::string number(double v, int decimals) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  std::string s = buf;
  if (s.rfind("0.", 0) == 0 && decimals > 0) s = s.substr(1);  // ".52": fits a cell
  return s;
}

constexpr Rgb kMasked{228, 228, 228}, kHatch{200, 200, 200};

// What the note under a colour bar says of its scale.
const char* scale_note(bool fixed) { return fixed ? "fixed scale" : "scaled to its largest"; }

// A vertical colour bar at (x, y) of height h, with ticks 0, vmax/2, vmax, and under it what the scale is (fixed,
// or stretched to the largest value) and, when cells are masked, their swatch.
void colour_bar(Canvas& c, double x, double y, double h, double vmax, bool whole, bool fixed, bool any_masked) {
  const double w = 18;
  std::vector<Rgb> colours;
  const int levels = std::max(2, static_cast<int>(h));
  for (int i = 0; i < levels; ++i) colours.push_back(viridis(1.0 - static_cast<double>(i) / (levels - 1)));
  c.cells(x, y, w, h / levels, levels, 1, colours);
  c.frame(x, y, w, h, kAxis);
  const int decimals = whole && vmax >= 2 ? 0 : vmax >= 10 ? 0 : vmax >= 1 ? 2 : 3;
  const double line_h = measure_text("0", kLabelPx).height;
  for (double f : {0.0, 0.5, 1.0}) {
    const double ty = y + (1.0 - f) * h;
    c.line(x + w, ty, x + w + 4, ty, kAxis);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, f * vmax);
    c.text(x + w + 8, ty - line_h / 2, buf, kLabelPx, kInk);
  }
  const double small_h = measure_text("Ag", kSmallPx).height;
  double note_y = y + h + 10;
  c.text(x, note_y, scale_note(fixed), kSmallPx, kMuted);
  if (any_masked) {
    note_y += small_h + 6;
    c.rect(x, note_y, 10, 10, kMasked);
    c.line(x, note_y + 10, x + 10, note_y, kHatch);
    c.text(x + 14, note_y + 5 - small_h / 2, "masked", kSmallPx, kMuted);
  }
}

// The height colour_bar's notes take under the bar.
double colour_bar_notes(bool any_masked) { return (measure_text("Ag", kSmallPx).height + 6) * (any_masked ? 2 : 1) + 10; }

bool any_masked(const std::function<bool(int64_t, int64_t)>& masked, int64_t rows, int64_t cols) {
  if (!masked) return false;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k)
      if (masked(r, k)) return true;
  return false;
}

// The cells of m at (x, y), `cell` pixels square, coloured on 0 … vmax (NaN grey); masked cells light grey and, when
// large enough, hatched; values printed when asked (none in masked cells).
void cells(Canvas& c, const Tensor& m, double x, double y, double cell, double vmax, bool values, int decimals,
           const std::function<bool(int64_t, int64_t)>& masked) {
  const int64_t rows = m.size(0), cols = m.size(1);
  std::vector<Rgb> colours(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = m.data()[i];
    colours[static_cast<size_t>(i)] = masked && masked(i / cols, i % cols) ? kMasked
                                      : std::isnan(v) ? Rgb{200, 200, 200}
                                                      : viridis(std::isfinite(v) ? v / vmax : v > 0 ? 1.0 : 0.0);
  }
  c.cells(x, y, cell, cell, static_cast<int>(rows), static_cast<int>(cols), colours);
  if (masked && cell >= 6) {  // one diagonal stroke per masked cell: a pattern no weight has
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k)
        if (masked(r, k)) {
          const double cx = x + static_cast<double>(k) * cell, cy = y + static_cast<double>(r) * cell;
          c.line(cx + 1, cy + cell - 1, cx + cell - 1, cy + 1, kHatch);
        }
  }
  if (values) {
    const bool whole = decimals < 0 && all_whole(m);
    const int digits = decimals >= 0 ? decimals : whole ? 0 : cell >= 60 ? 2 : 1;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) {
        if (masked && masked(r, k)) continue;
        const float v = m.data()[r * cols + k];
        const double t = std::isfinite(v) ? v / vmax : 0.0;
        const std::string s = std::isnan(v) ? "nan" : number(v, digits);
        double px = kLabelPx;
        while (px > 7 && measure_text(s, px).width + 4 > cell) px -= 1;
        const double h = measure_text(s, px).height;
        c.text(x + (static_cast<double>(k) + 0.5) * cell, y + (static_cast<double>(r) + 0.5) * cell - h / 2, s, px,
               t > 0.6 ? kInk : kWhite, Align::center);
      }
  }
  c.frame(x - 1, y - 1, static_cast<double>(cols) * cell + 2, static_cast<double>(rows) * cell + 2, kAxis);
}

int cell_size(int64_t n, bool values) {
  // Cells that hold their value: 64 px, larger for a few classes (a 2 × 2 confusion matrix drew 370 × 240 px)
  if (values) return static_cast<int>(std::clamp<int64_t>(420 / std::max<int64_t>(n, 1), 64, 140));
  return static_cast<int>(std::clamp<int64_t>(768 / std::max<int64_t>(n, 1), 2, 48));
}

Canvas draw_heatmap(const Tensor& input, const HeatmapStyle& style, HeatmapGeometry* geometry = nullptr) {
  const Tensor m = as_matrix(input, "heatmap");
  const int64_t rows = m.size(0), cols = m.size(1);
  const bool values = style.show_values == 1 || (style.show_values == -1 && rows <= 16 && cols <= 16);
  const int cell = cell_size(std::max(rows, cols), values);
  const double vmax = style.vmax > 0 ? style.vmax : largest_finite(m);
  // Labels as large as the cells allow, up to the label size; none below 7 px.
  const double label_px = std::min(kLabelPx, std::floor(cell * 0.8));
  const bool label_text = label_px >= 7;
  // Fitted only when drawn: a 1024-token head has 2048 labels, each a Pango layout to measure.
  const auto rl = label_text ? labels_or_numbers(style.row_labels, rows, label_px) : std::vector<std::string>{};
  const auto cl = label_text ? labels_or_numbers(style.col_labels, cols, label_px) : std::vector<std::string>{};
  const double title_h = measure_text("Ag", kTitlePx, true).height, line_h = measure_text("Ag", kLabelPx).height;
  const int left = 40 + (label_text ? static_cast<int>(std::ceil(widest(rl, label_px))) + 10 : 0);
  const int top = static_cast<int>(std::ceil(16 + title_h + 12 + (style.caption.empty() ? 0 : line_h + 6)));
  const int grid_w = static_cast<int>(cols) * cell, grid_h = static_cast<int>(rows) * cell;
  const int bottom_labels = (label_text ? static_cast<int>(std::ceil(widest(cl, label_px))) + 10 : 0) + 40;
  const std::string title = style.title + "  (" + std::to_string(rows) + "\u00d7" + std::to_string(cols) + ")";
  const double width = std::max({left + grid_w + 110.0, measure_text(title, kTitlePx, true).width + 40,
                                  left + grid_w + 20.0 + measure_text(scale_note(style.vmax > 0), kSmallPx).width + 12});
  const bool masked_cells = any_masked(style.masked, rows, cols);
  Canvas c(width, std::max<double>(top + grid_h + bottom_labels,
                                   top + std::max(grid_h, 60) + colour_bar_notes(masked_cells) + 8));
  c.text(20, 16, title, kTitlePx, kInk, Align::left, true);
  if (!style.caption.empty()) c.text(20, 16 + title_h + 6, style.caption, kLabelPx, kMuted);
  cells(c, m, left, top, cell, vmax, values, style.decimals, style.masked);
  if (label_text) {
    const double h = measure_text("Ag", label_px).height;
    for (int64_t r = 0; r < rows; ++r)
      c.text(left - 10, top + (static_cast<double>(r) + 0.5) * cell - h / 2, rl[static_cast<size_t>(r)], label_px, kInk,
             Align::right);
    for (int64_t k = 0; k < cols; ++k)
      c.text(left + (static_cast<double>(k) + 0.5) * cell - h / 2, top + grid_h + 10, cl[static_cast<size_t>(k)], label_px,
             kInk, Align::right, false, true);
  }
  c.text(8, top + grid_h / 2.0, style.row_axis, kLabelPx, kMuted, Align::center, false, true);
  c.text(left + grid_w / 2.0, c.height() - 28, style.col_axis, kLabelPx, kMuted, Align::center);
  colour_bar(c, left + grid_w + 20, top, std::max(grid_h, 60), vmax, all_whole(m), style.vmax > 0, masked_cells);
  if (geometry) *geometry = {c.width(), c.height(), left, top, cell, left - 10, label_text ? label_px : 0.0};
  return c;
}

}  // namespace

std::function<bool(int64_t, int64_t)> causal_cells(int64_t window) {
  return [window](int64_t row, int64_t col) { return col > row || (window > 0 && col <= row - window); };
}

HeatmapGeometry save_heatmap(const std::string& path, const Tensor& weights, const HeatmapStyle& style,
                             const PictureOptions& options) {
  picture_format_of(path);  // the extension is checked before any drawing
  HeatmapGeometry geometry;
  draw_heatmap(weights, style, &geometry).save(path, options);
  return geometry;
}

namespace {
Canvas draw_grid(const std::string& title, const std::string& caption, const std::vector<HeatmapPanel>& panels,
                 int columns, const std::vector<std::string>& labels, double vmax) {
  if (panels.empty()) throw ValueError("a grid of heatmaps needs at least one panel");
  columns = std::max(1, std::min<int>(columns, static_cast<int>(panels.size())));
  std::vector<Tensor> mats;
  double largest = 0.0;
  bool masked = false;
  for (const auto& p : panels) {
    mats.push_back(as_matrix(p.weights, "heatmap grid"));
    largest = std::max(largest, largest_finite(mats.back()));
    masked = masked || any_masked(p.masked, mats.back().size(0), mats.back().size(1));
  }
  const bool fixed = vmax > 0;
  if (vmax <= 0) vmax = largest;
  const int64_t n = std::max(mats[0].size(0), mats[0].size(1));
  const int cell = static_cast<int>(std::clamp<int64_t>(240 / std::max<int64_t>(n, 1), 1, 28));
  const int panel = static_cast<int>(n) * cell;
  const int rows = (static_cast<int>(panels.size()) + columns - 1) / columns;
  const double title_h = measure_text("Ag", kTitlePx, true).height, line_h = measure_text("Ag", kLabelPx).height;
  const int label_h = static_cast<int>(std::ceil(line_h)) + 6, gap = 24;
  // The tokens along the first column's rows (queries) and under the last row's columns (keys), as large as the cells
  // allow (at most the label size, none below 7 px).
  const double token_px = std::min(kLabelPx - 1, std::floor(cell * 0.8));
  const bool token_text = token_px >= 7 && !labels.empty();
  std::vector<std::string> fitted;
  if (token_text)
    for (const auto& l : labels) fitted.push_back(fit(l, token_px, 100));
  const int axis = token_text ? static_cast<int>(std::ceil(widest(fitted, token_px))) + 8 : 0;
  const double caption_h = caption.empty() ? 0 : line_h + 6;
  const int left = 20 + axis, top = static_cast<int>(std::ceil(16 + title_h + 14 + caption_h));
  const int width = left + columns * (panel + gap) +
                    std::max(100, static_cast<int>(std::ceil(measure_text(scale_note(fixed), kSmallPx).width)) + 12);
  const int bar_h = std::max(panel, 60);
  const int keys_h = axis;  // the key labels under the last row, rotated: as tall as the widest token
  const double height = std::max<double>(top + rows * (panel + label_h + gap) + keys_h + 10,
                                         top + label_h + bar_h + colour_bar_notes(masked) + 10);
  Canvas c(std::max<double>(width, measure_text(title, kTitlePx, true).width + 40), height);
  c.text(20, 16, title, kTitlePx, kInk, Align::left, true);
  if (!caption.empty()) c.text(20, 16 + title_h + 6, caption, kLabelPx, kMuted);
  const double token_h = token_text ? measure_text("Ag", token_px).height : 0;
  for (size_t i = 0; i < mats.size(); ++i) {
    const int gx = static_cast<int>(i) % columns, gy = static_cast<int>(i) / columns;
    const int x = left + gx * (panel + gap), y = top + gy * (panel + label_h + gap);
    const double px = measure_text(panels[i].label, kLabelPx).width <= panel + gap - 4 ? kLabelPx : kSmallPx;
    c.text(x, y + (kLabelPx - px), panels[i].label, px, kInk);
    cells(c, mats[i], x, y + label_h, cell, vmax, false, -1, panels[i].masked);
    if (token_text && gx == 0) {
      for (int64_t r = 0; r < mats[i].size(0) && r < static_cast<int64_t>(fitted.size()); ++r)
        c.text(x - 6, y + label_h + (static_cast<double>(r) + 0.5) * cell - token_h / 2, fitted[static_cast<size_t>(r)],
               token_px, kInk, Align::right);
    }
    // keys under each panel of the last row (and under a column the last row leaves empty)
    const bool lowest = gy == rows - 1 || static_cast<int>(i) + columns >= static_cast<int>(mats.size());
    if (token_text && lowest) {
      const double below = y + label_h + static_cast<double>(mats[i].size(0)) * cell + 6;
      for (int64_t k = 0; k < mats[i].size(1) && k < static_cast<int64_t>(fitted.size()); ++k)
        c.text(x + (static_cast<double>(k) + 0.5) * cell - token_h / 2, below, fitted[static_cast<size_t>(k)], token_px,
               kInk, Align::right, false, true);
    }
  }
  colour_bar(c, left + columns * (panel + gap), top + label_h, bar_h, vmax, false, fixed, masked);
  return c;
}
}  // namespace

void save_heatmap_grid(const std::string& path, const std::string& title, const std::vector<HeatmapPanel>& panels,
                       int columns, const std::vector<std::string>& labels, double vmax, const PictureOptions& options) {
  picture_format_of(path);
  draw_grid(title, "", panels, columns, labels, vmax).save(path, options);
}

void save_heatmap_grid_gif(const std::string& path, const std::string& title,
                           const std::vector<std::pair<std::vector<HeatmapPanel>, std::string>>& frames, int columns,
                           const std::vector<std::string>& labels, double vmax, int delay_cs) {
  save_gif_frames(path, frames.size(), [&](size_t f) {
    return draw_grid(title, frames[f].second.empty() ? " " : frames[f].second, frames[f].first, columns, labels, vmax).render();
  }, delay_cs, 200);
}

HeatmapAnimation::HeatmapAnimation(HeatmapStyle style) : style_(std::move(style)) {
  if (style_.vmax <= 0) style_.vmax = 1.0;
}

void HeatmapAnimation::add_frame(const Tensor& weights, const std::string& caption) {
  frames_.emplace_back(as_matrix(weights, "animation").clone(), caption);
}

void HeatmapAnimation::save_gif(const std::string& path, int delay_cs) const {
  save_gif_frames(path, frames_.size(), [&](size_t f) {
    HeatmapStyle style = style_;
    style.caption = frames_[f].second.empty() ? " " : frames_[f].second;  // every frame the same size
    return draw_heatmap(frames_[f].first, style).render();
  }, delay_cs, 200);
}

}  // namespace qkv::viz
