// Pictures of tensors for people learning how attention works: matrices labelled with their tokens
// and shape, and a shaded grid of who attends to whom. Plain text; ANSI colour only when asked.
// Not here: plots of training curves (viz/plot.hpp).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv::viz {

// How the terminal pictures print numbers
struct Style {
  int decimals = 4;  // digits after the point
  bool color = false;  // ANSI colours for the heat map
};

// A 2-D tensor as a table:
//   title  (6×2)
//              d0       d1
//   Your     0.2309   1.0966
// Empty label lists number the rows/columns. A row-sum column is added when `row_sums` is set.
std::string matrix(const std::string& title, const Tensor& m, const std::vector<std::string>& row_labels,
                   const std::vector<std::string>& col_labels, const Style& style = {}, bool row_sums = false);

// Attention weights (T,T) as a grid, rows = queries, columns = keys: each cell shows its weight (".43") beside
// a shade from ' ' (0) to '█' (the largest weight), or, with style.color, on a viridis background (ANSI).
std::string heatmap(const std::string& title, const Tensor& weights, const std::vector<std::string>& labels,
                    const Style& style = {});

// The columns a terminal gives `text` (UTF-8): 2 for each CJK character or emoji, 0 for combining marks, 1 for the
// rest; what the tables above pad by, so 東京 and 🙂 line up with ASCII.
size_t display_width(std::string_view text);

// One row of weights as horizontal bars, one line per key.
std::string bars(const std::vector<float>& values, const std::vector<std::string>& labels, int width = 40);

}  // namespace qkv::viz
