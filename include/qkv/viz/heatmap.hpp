// Pictures of attention weights as heatmaps: one matrix with its token labels on both axes, a colour bar,
// the viridis colour map (perceptually uniform, colour-blind safe) and, up to 16×16, each cell's value; a grid
// of small multiples (layers × heads); and animations of a matrix changing (GIF). Each is written as PNG, SVG
// or PDF, the format its file name ends in (picture.hpp). Part of qkv::viz, which links Cairo, Pango and
// giflib; the rest of qkv links none of them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/core/tensor.hpp"
#include "qkv/viz/picture.hpp"

namespace qkv::viz {

// What a heatmap shows besides its cells
struct HeatmapStyle {
  std::string title;                                // the matrix's name; its shape is appended, e.g. "(6×6)"
  std::vector<std::string> row_labels, col_labels;  // queries (rows) and keys (columns); empty: 1, 2, …
  std::string row_axis = "query", col_axis = "key";  // the axes' names
  // The colour scale runs 0 … vmax; 0: the matrix's largest finite value. A note under the colour bar says which
  // ("fixed scale" or "scale: the largest"), so pictures on different scales are not read alike.
  double vmax = 0.0;
  int show_values = -1;  // print each cell's value: -1 when the matrix is at most 16×16, 0 never, 1 always
  std::string caption;   // a line under the title (e.g. "step 12, loss 0.41")
  // Digits after the point in printed values; -1: whole numbers as such (counts), others with 2 (or 1 in small cells).
  int decimals = -1;
  // Cells the model cannot see (a causal mask's future, keys past a sliding window; see causal_cells): drawn light
  // grey and hatched, without a value, so they do not read as a weight of 0. Empty: every cell is a weight.
  std::function<bool(int64_t row, int64_t col)> masked;
};

// The cells a causal mask hides (keys after the query) and, with a window, the keys the window leaves behind.
std::function<bool(int64_t row, int64_t col)> causal_cells(int64_t window = 0);

// Where the cells landed, in logical pixels (PNG pixels at scale 1): cell (r, c) covers x ∈ [left + c·cell,
// left + (c+1)·cell), y likewise from top. Row r's label ends at label_right, centred on the row; its size is
// label_px (0: the rows are too small for labels).
struct HeatmapGeometry {
  // the picture's size; the grid's top-left corner and cell size; where row labels end
  int width = 0, height = 0, left = 0, top = 0, cell = 0, label_right = 0;
  double label_px = 0;  // the labels' font size in pixels
};

// Writes a (rows, cols) matrix (or one with leading dimensions of size 1) as a picture, atomically, in the
// format `path` ends in (.png, .svg, .pdf). ValueError for another shape or extension; IoError if the file
// cannot be written.
HeatmapGeometry save_heatmap(const std::string& path, const Tensor& weights, const HeatmapStyle& style,
                             const PictureOptions& options = {});

// One matrix of a grid, with its label
struct HeatmapPanel {
  std::string label;  // e.g. "layer 2, head 5"
  Tensor weights;     // (T, T)
  std::function<bool(int64_t row, int64_t col)> masked = {};  // as HeatmapStyle::masked
};

// Small multiples: the panels in a grid of `columns` per row (heads across, layers down), each labelled, one
// colour bar for all (0 … vmax, or the largest value of all panels), the tokens along the first column's rows
// (queries) and under the last row's columns (keys).
void save_heatmap_grid(const std::string& path, const std::string& title, const std::vector<HeatmapPanel>& panels,
                       int columns, const std::vector<std::string>& labels, double vmax = 0.0,
                       const PictureOptions& options = {});

// The same grid as it changes (attention snapshots during training), one frame per (panels, caption), as a looping
// GIF; vmax 0 means 1. Every frame must have the same panels' shapes.
void save_heatmap_grid_gif(const std::string& path, const std::string& title,
                           const std::vector<std::pair<std::vector<HeatmapPanel>, std::string>>& frames, int columns,
                           const std::vector<std::string>& labels, double vmax = 1.0, int delay_cs = 50);

// Frames of one heatmap as it changes (every training step, say), saved as a looping GIF. All frames share
// the style's labels and colour scale (vmax 0 means 1: attention weights).
class HeatmapAnimation {
 public:
  explicit HeatmapAnimation(HeatmapStyle style);  // An animation drawn with `style` (vmax 0 becomes 1)
  // Adds a frame: `weights` (rows, cols) with a caption under the title
  void add_frame(const Tensor& weights, const std::string& caption);
  // Frames added so far
  size_t frames() const { return frames_.size(); }
  // delay_cs: each frame's display time in 1/100 s; the last frame stays for 2 s. Atomically.
  void save_gif(const std::string& path, int delay_cs = 10) const;

 private:
  HeatmapStyle style_;
  std::vector<std::pair<Tensor, std::string>> frames_;
};

}  // namespace qkv::viz
