// A line chart as a PNG (libpng), for loss curves: axes with numbered ticks, one coloured line per series,
// a legend. Text uses a built-in 5×7 pixel font, so no font files are needed.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace qkv::viz {

struct Series {
  std::string name;                               // lower-case letters, digits, spaces, ".-()="
  std::array<unsigned char, 3> color{31, 119, 180};
  std::vector<std::pair<double, double>> points;  // (x, y), x increasing
};

// Writes the chart atomically; throws IoError if the file cannot be written, ValueError with no points.
void plot_lines(const std::string& path, const std::string& title, const std::string& x_label,
                const std::string& y_label, const std::vector<Series>& series, int width = 800, int height = 480);

}  // namespace qkv::viz
