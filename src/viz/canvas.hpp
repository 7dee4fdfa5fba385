// The drawing surface every picture in qkv_viz is made on (internal to src/viz/): Cairo records the drawing as
// vectors once, and it is saved as PNG, SVG or PDF at any scale, or rendered to pixels for a GIF frame. Text is
// laid out by Pango (HarfBuzz shaping, bidi, font fallback through fontconfig), so any Unicode label is drawn
// with real glyphs; a character no installed font has becomes the font's box, never '?'.
// Not here: what a picture shows (heatmap.cpp, plot.cpp) or where it is written (picture.hpp).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qkv/viz/picture.hpp"

namespace qkv::viz {

using Rgb = std::array<unsigned char, 3>;

inline constexpr Rgb kWhite{255, 255, 255}, kInk{40, 40, 40}, kGrid{225, 225, 225}, kAxis{60, 60, 60},
    kMuted{110, 110, 110};

// Viridis (matplotlib's perceptually uniform, colour-blind-safe map) at t in [0, 1], from dark purple to
// yellow; quantised to kViridisLevels steps so that a GIF palette holds every colour exactly.
inline constexpr int kViridisLevels = 200;
Rgb viridis(double t);

// Font sizes in logical pixels (1/96 inch at scale 1): labels, titles.
inline constexpr double kLabelPx = 13.0, kTitlePx = 17.0, kSmallPx = 10.0;

enum class Align { left, center, right };

struct TextSize {
  double width = 0, height = 0;
};

// The size one line of UTF-8 text takes at `px` (the same layout drawing uses: fonts, fallback, shaping).
TextSize measure_text(const std::string& text, double px, bool bold = false);

// Pixels of a rendered picture, RGB row-major.
struct Pixels {
  int width = 0, height = 0;
  std::vector<unsigned char> rgb;
};

class Canvas {
 public:
  Canvas(double width, double height, Rgb background = kWhite);  // logical pixels, rounded up
  ~Canvas();
  Canvas(Canvas&&) noexcept;
  Canvas& operator=(Canvas&&) noexcept;
  int width() const { return w_; }
  int height() const { return h_; }

  void rect(double x, double y, double w, double h, Rgb c);                         // filled
  void frame(double x, double y, double w, double h, Rgb c, double line_width = 1);  // outline inside the box
  void line(double x0, double y0, double x1, double y1, Rgb c, double line_width = 1, bool dashed = false);
  // A connected line through the points (NaN points break it into pieces).
  void polyline(const std::vector<std::pair<double, double>>& points, Rgb c, double line_width, bool dashed = false);
  void dot(double x, double y, double radius, Rgb c);
  // A rows × cols matrix of colours (row-major RGB) drawn as cells of cell_w × cell_h pixels at (x, y): one image
  // scaled without smoothing, so cells stay sharp at any scale and an SVG/PDF holds one small image, not
  // rows × cols boxes.
  void cells(double x, double y, double cell_w, double cell_h, int rows, int cols, const std::vector<Rgb>& colours);
  // One line of text. (x, y) is the top of its box at the left edge, centre or right edge (align). With `up` the
  // text reads bottom to top (rotated 90° counter-clockwise): x is its box's left, y the box's bottom, middle or
  // top (where the text starts, its centre, where it ends). Returns the text's size. Text positions snap to whole pixels at scale 1, so a
  // label is drawn exactly as the same text alone.
  TextSize text(double x, double y, const std::string& text, double px, Rgb c = kInk, Align align = Align::left,
                bool bold = false, bool up = false);

  // Writes the picture in the format the path's extension names (.png, .svg, .pdf) at `scale` device pixels
  // per logical pixel (PNG) — SVG and PDF are vectors, their size in points is the logical size. Atomically;
  // IoError naming the path on failure.
  void save(const std::string& path, const PictureOptions& options = {}) const;
  Pixels render(double scale = 1.0) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  int w_ = 0, h_ = 0;
};

// `frames` frames of equal size, frame(i) drawing the i-th when the encoder reaches it, written as one looping GIF
// (giflib), with a 256-colour palette holding the viridis levels, the interface colours and greys (anti-aliased
// text). `delay_cs` is each frame's display time in 1/100 s; the last frame shows `last_delay_cs`. Written atomically.
void save_gif_frames(const std::string& path, size_t frames, const std::function<Pixels(size_t)>& frame, int delay_cs,
                     int last_delay_cs);

}  // namespace qkv::viz
