// Line charts for loss, accuracy and learning-rate curves: numbered ticks on both axes, one coloured line per
// series (solid or dashed, with dots on its points if asked), an optional second axis on the right (the learning
// rate beside the loss), a linear or logarithmic y axis, and a legend in the corner the curves leave freest.
// Written as PNG, SVG or PDF, the format the file name ends in.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "qkv/viz/picture.hpp"

namespace qkv::viz {

// One curve.
struct Series {
  std::string name;                               // its legend entry (any text)
  std::array<unsigned char, 3> color{31, 119, 180};  // RGB
  std::vector<std::pair<double, double>> points;  // (x, y), x increasing; NaN or infinite points are left out
  bool dashed = false;  // a dashed line (a rate, a mean) instead of a solid one
  bool right_axis = false;  // drawn against the right-hand axis (PlotStyle::y2_label), e.g. the learning rate
  bool markers = false;  // a dot on every point (evaluations: where the line was measured, not drawn between)
};

// What surrounds the curves.
struct PlotStyle {
  std::string title = "", x_label = "", y_label = "";  // the title on top, and the axes' names
  std::string y2_label = "";  // the right-hand axis's name, used when a series has right_axis
  bool log_y = false;    // logarithmic left axis (points with y ≤ 0 are left out)
  bool whole_x = false;  // x ticks on whole numbers only (epochs, steps): never 1.2, 1.4
  int width = 800, height = 480;  // logical pixels
};

// Where the data landed, to find it again in the picture: x_pixel/y_pixel map data to logical pixels.
struct PlotGeometry {
  int width = 0, height = 0;  // the picture's size in logical pixels
  double left = 0, right = 0, top = 0, bottom = 0;  // the plotting area
  // the axes' ranges (whole ticks), left and right
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1, y2_min = 0, y2_max = 1;
  bool log_y = false;  // whether the left axis is logarithmic
  double x_step = 1;   // the distance between two ticks of the x axis
  double legend_x = 0, legend_y = 0, legend_w = 0, legend_h = 0;  // the legend's box, in logical pixels
  double x_pixel(double x) const;  // The x of a data point, in logical pixels
  double y_pixel(double y) const;   // on the left axis
  double y2_pixel(double y) const;  // on the right axis
};

// Writes the chart atomically in the format `path` ends in. ValueError when no series has a finite point (a run
// that diverged) or for a bad extension; IoError if the file cannot be written.
PlotGeometry save_plot(const std::string& path, const std::vector<Series>& series, const PlotStyle& style,
                       const PictureOptions& options = {});

}  // namespace qkv::viz
