// Attention heatmaps, grids of them and their animations (see qkv/viz/heatmap.hpp), drawn on a Canvas.
#include "qkv/viz/heatmap.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "canvas.hpp"
#include "qkv/core/error.hpp"

namespace qkv::viz {

namespace {

constexpr int kScale = 2;  // text: 12 px per character, 14 px tall — readable at 100 %
constexpr size_t kMaxLabel = 14;

// The matrix as (rows, cols), or ValueError.
Tensor as_matrix(const Tensor& t, const char* what) {
  Shape s = t.shape();
  while (s.rank() > 2 && s[0] == 1) s = Shape(s.dims().subspan(1));
  if (s.rank() == 1) s = Shape{1, s[0]};
  if (s.rank() != 2) throw ValueError(std::string(what) + ": needs a 2-D matrix of weights, got shape " + t.shape().str());
  return t.view_as_shape(s);
}

std::string clip(std::string s) {
  if (s.size() > kMaxLabel) s = s.substr(0, kMaxLabel - 1) + "~";
  return s;
}

std::vector<std::string> labels_or_numbers(const std::vector<std::string>& labels, int64_t n) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back(clip(static_cast<int64_t>(labels.size()) == n ? labels[static_cast<size_t>(i)] : std::to_string(i + 1)));
  return out;
}

double largest_finite(const Tensor& m) {
  double v = 0.0;
  for (float x : m.values())
    if (std::isfinite(x)) v = std::max(v, static_cast<double>(x));
  return v > 0.0 ? v : 1.0;
}

std::string number(double v, int decimals) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  std::string s = buf;
  if (s.rfind("0.", 0) == 0 && decimals > 0) s = s.substr(1);  // ".52": fits a cell
  return s;
}

size_t longest(const std::vector<std::string>& labels) {
  size_t n = 1;
  for (const auto& l : labels) n = std::max(n, l.size());
  return n;
}

// A vertical colour bar at (x, y) of height h, with ticks 0, vmax/2, vmax.
void colour_bar(Canvas& c, int x, int y, int h, double vmax) {
  const int w = 18;
  for (int i = 0; i < h; ++i) c.rect(x, y + i, x + w, y + i, viridis(1.0 - static_cast<double>(i) / std::max(h - 1, 1)));
  c.frame(x, y, x + w, y + h - 1, kAxis);
  const int decimals = vmax >= 10 ? 0 : vmax >= 1 ? 2 : 3;
  for (double f : {0.0, 0.5, 1.0}) {
    const int ty = y + static_cast<int>(std::lround((1.0 - f) * (h - 1)));
    c.rect(x + w, ty, x + w + 4, ty, kAxis);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, f * vmax);
    c.text(x + w + 8, ty - Canvas::text_height(kScale) / 2, buf, kInk, kScale);
  }
}

// The cells of m at (x, y), `cell` pixels square, coloured on 0 … vmax; values printed when asked.
void cells(Canvas& c, const Tensor& m, int x, int y, int cell, double vmax, bool values) {
  const int64_t rows = m.size(0), cols = m.size(1);
  const int decimals = cell >= 60 ? 2 : 1;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) {
      const float v = m.data()[r * cols + k];
      const double t = std::isfinite(v) ? v / vmax : 0.0;
      const int x0 = x + static_cast<int>(k) * cell, y0 = y + static_cast<int>(r) * cell;
      c.rect(x0, y0, x0 + cell - 1, y0 + cell - 1, std::isnan(v) ? Rgb{200, 200, 200} : viridis(t));
      if (values) {
        const std::string s = std::isnan(v) ? "nan" : number(v, decimals);
        const int scale = Canvas::text_width(s, kScale) + 4 <= cell ? kScale : 1;
        c.text(x0 + (cell - Canvas::text_width(s, scale)) / 2, y0 + (cell - Canvas::text_height(scale)) / 2, s,
               t > 0.6 ? kInk : kWhite, scale);
      }
    }
  c.frame(x - 1, y - 1, x + static_cast<int>(cols) * cell, y + static_cast<int>(rows) * cell, kAxis);
}

int cell_size(int64_t n, bool values) {
  if (values) return 64;
  return static_cast<int>(std::clamp<int64_t>(768 / std::max<int64_t>(n, 1), 2, 48));
}

Canvas draw_heatmap(const Tensor& input, const HeatmapStyle& style, HeatmapGeometry* geometry = nullptr) {
  const Tensor m = as_matrix(input, "heatmap");
  const int64_t rows = m.size(0), cols = m.size(1);
  const bool values = style.show_values == 1 || (style.show_values == -1 && rows <= 16 && cols <= 16);
  const int cell = cell_size(std::max(rows, cols), values);
  const double vmax = style.vmax > 0 ? style.vmax : largest_finite(m);
  const auto rl = labels_or_numbers(style.row_labels, rows), cl = labels_or_numbers(style.col_labels, cols);
  const bool row_text = cell >= Canvas::text_height(kScale), col_text = row_text;
  const int char_w = 6 * kScale;
  const int left = 40 + (row_text ? static_cast<int>(longest(rl)) * char_w + 10 : 0);
  const int top = 16 + Canvas::text_height(kScale) + 20 + (style.caption.empty() ? 0 : Canvas::text_height(kScale) + 8);
  const int grid_w = static_cast<int>(cols) * cell, grid_h = static_cast<int>(rows) * cell;
  const int bottom_labels = (col_text ? static_cast<int>(longest(cl)) * char_w + 10 : 0) + 40;
  const std::string title = style.title + "  (" + std::to_string(rows) + "x" + std::to_string(cols) + ")";
  const int width = std::max(left + grid_w + 110, Canvas::text_width(title, kScale) + 40);
  Canvas c(width, top + grid_h + bottom_labels);
  c.text(20, 16, title, kInk, kScale);
  int line_y = 16 + Canvas::text_height(kScale) + 10;
  if (!style.caption.empty()) {
    c.text(20, line_y, style.caption, kMuted, kScale);
    line_y += Canvas::text_height(kScale) + 8;
  }
  cells(c, m, left, top, cell, vmax, values);
  if (row_text)
    for (int64_t r = 0; r < rows; ++r)
      c.text(left - 10 - Canvas::text_width(rl[static_cast<size_t>(r)], kScale),
             top + static_cast<int>(r) * cell + (cell - Canvas::text_height(kScale)) / 2, rl[static_cast<size_t>(r)], kInk, kScale);
  if (col_text)
    for (int64_t k = 0; k < cols; ++k)
      c.text_up(left + static_cast<int>(k) * cell + (cell - Canvas::text_height(kScale)) / 2, top + grid_h + 10 +
                    static_cast<int>(cl[static_cast<size_t>(k)].size()) * char_w - 1, cl[static_cast<size_t>(k)], kInk, kScale);
  c.text_up(8, top + grid_h / 2 + Canvas::text_width(style.row_axis, kScale) / 2, style.row_axis, kMuted, kScale);
  c.text(left + grid_w / 2 - Canvas::text_width(style.col_axis, kScale) / 2, c.height() - 28, style.col_axis, kMuted, kScale);
  colour_bar(c, left + grid_w + 20, top, std::max(grid_h, 60), vmax);
  if (geometry) *geometry = {c.width(), c.height(), left, top, cell};
  return c;
}

}  // namespace

HeatmapGeometry heatmap_png(const std::string& path, const Tensor& weights, const HeatmapStyle& style) {
  HeatmapGeometry geometry;
  draw_heatmap(weights, style, &geometry).save_png(path);
  return geometry;
}

namespace {
Canvas draw_grid(const std::string& title, const std::string& caption, const std::vector<HeatmapPanel>& panels,
                 int columns, const std::vector<std::string>& labels, double vmax) {
  if (panels.empty()) throw ValueError("a grid of heatmaps needs at least one panel");
  columns = std::max(1, std::min<int>(columns, static_cast<int>(panels.size())));
  std::vector<Tensor> mats;
  double largest = 0.0;
  for (const auto& p : panels) {
    mats.push_back(as_matrix(p.weights, "heatmap grid"));
    largest = std::max(largest, largest_finite(mats.back()));
  }
  if (vmax <= 0) vmax = largest;
  const int64_t n = std::max(mats[0].size(0), mats[0].size(1));
  const int cell = static_cast<int>(std::clamp<int64_t>(200 / std::max<int64_t>(n, 1), 1, 24));
  const int panel = static_cast<int>(n) * cell;
  const int rows = (static_cast<int>(panels.size()) + columns - 1) / columns;
  const int label_h = Canvas::text_height(kScale) + 8, gap = 24;
  const bool token_text = cell >= 7 && !labels.empty();
  const int axis = token_text ? static_cast<int>(longest(labels)) * 6 + 8 : 0;  // scale-1 token labels
  const int caption_h = caption.empty() ? 0 : Canvas::text_height(kScale) + 8;
  const int left = 20 + axis, top = 16 + Canvas::text_height(kScale) + 16 + caption_h;
  const int width = left + columns * (panel + gap) + 100;
  const int height = top + rows * (panel + label_h + gap) + 10;
  Canvas c(std::max(width, Canvas::text_width(title, kScale) + 40), height);
  c.text(20, 16, title, kInk, kScale);
  if (!caption.empty()) c.text(20, 16 + Canvas::text_height(kScale) + 8, caption, kMuted, kScale);
  for (size_t i = 0; i < mats.size(); ++i) {
    const int gx = static_cast<int>(i) % columns, gy = static_cast<int>(i) / columns;
    const int x = left + gx * (panel + gap), y = top + gy * (panel + label_h + gap);
    const int scale = Canvas::text_width(panels[i].label, kScale) <= panel + gap - 4 ? kScale : 1;
    c.text(x, y + (scale == 1 ? 6 : 0), panels[i].label, kInk, scale);
    cells(c, mats[i], x, y + label_h, cell, vmax, false);
    if (token_text && gx == 0) {  // the tokens along the first column's rows
      for (int64_t r = 0; r < mats[i].size(0) && r < static_cast<int64_t>(labels.size()); ++r)
        c.text(x - 6 - Canvas::text_width(clip(labels[static_cast<size_t>(r)]), 1), y + label_h + static_cast<int>(r) * cell + (cell - 7) / 2,
               clip(labels[static_cast<size_t>(r)]), kMuted, 1);
    }
  }
  colour_bar(c, left + columns * (panel + gap), top + label_h, std::max(panel, 60), vmax);
  return c;
}
}  // namespace

void heatmap_grid_png(const std::string& path, const std::string& title, const std::vector<HeatmapPanel>& panels,
                      int columns, const std::vector<std::string>& labels, double vmax) {
  draw_grid(title, "", panels, columns, labels, vmax).save_png(path);
}

void heatmap_grid_gif(const std::string& path, const std::string& title,
                      const std::vector<std::pair<std::vector<HeatmapPanel>, std::string>>& frames, int columns,
                      const std::vector<std::string>& labels, double vmax, int delay_cs) {
  std::vector<Canvas> canvases;
  for (const auto& [panels, caption] : frames) canvases.push_back(draw_grid(title, caption.empty() ? " " : caption, panels, columns, labels, vmax));
  save_gif_frames(path, canvases, delay_cs, 200);
}

HeatmapAnimation::HeatmapAnimation(HeatmapStyle style) : style_(std::move(style)) {
  if (style_.vmax <= 0) style_.vmax = 1.0;
}

void HeatmapAnimation::add_frame(const Tensor& weights, const std::string& caption) {
  frames_.emplace_back(as_matrix(weights, "animation").clone(), caption);
}

void HeatmapAnimation::save_gif(const std::string& path, int delay_cs) const {
  std::vector<Canvas> canvases;
  for (const auto& [weights, caption] : frames_) {
    HeatmapStyle style = style_;
    style.caption = caption.empty() ? " " : caption;  // every frame the same size
    canvases.push_back(draw_heatmap(weights, style));
  }
  save_gif_frames(path, canvases, delay_cs, 200);
}

}  // namespace qkv::viz
