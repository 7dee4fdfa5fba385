// An RGB canvas with a built-in 5×7 pixel font (printable ASCII), the viridis colour map and PNG/GIF encoding:
// the drawing surface every picture in qkv_viz is made on (internal to src/viz/). No font files are needed.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace qkv::viz {

using Rgb = std::array<unsigned char, 3>;

inline constexpr Rgb kWhite{255, 255, 255}, kInk{40, 40, 40}, kGrid{225, 225, 225}, kAxis{60, 60, 60},
    kMuted{120, 120, 120};

// Viridis (matplotlib's perceptually uniform, colour-blind-safe map) at t in [0, 1], from dark purple to
// yellow; quantised to kViridisLevels steps so that a GIF palette holds every colour exactly.
inline constexpr int kViridisLevels = 200;
Rgb viridis(double t);

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = kWhite);
  int width() const { return w_; }
  int height() const { return h_; }
  void set(int x, int y, Rgb c);
  Rgb get(int x, int y) const;
  void rect(int x0, int y0, int x1, int y1, Rgb c);  // filled, inclusive corners
  void frame(int x0, int y0, int x1, int y1, Rgb c);  // outline
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness);
  // Text with its top-left corner at (x, y); each glyph is 6·scale pixels wide (5 + 1 spacing), 7·scale tall.
  // Bytes outside printable ASCII are drawn as '?'.
  void text(int x, int y, const std::string& s, Rgb c = kInk, int scale = 2);
  // The same, rotated 90° counter-clockwise (reads bottom to top), starting at (x, y) bottom-left.
  void text_up(int x, int y, const std::string& s, Rgb c = kInk, int scale = 2);
  static int text_width(const std::string& s, int scale = 2) { return static_cast<int>(s.size()) * 6 * scale; }
  static int text_height(int scale = 2) { return 7 * scale; }
  const std::vector<unsigned char>& pixels() const { return pixels_; }

  // Encodes as PNG (libpng) and writes atomically; IoError naming the path on failure.
  void save_png(const std::string& path) const;

 private:
  int w_, h_;
  std::vector<unsigned char> pixels_;
};

// Frames of equal size written as one looping GIF (giflib), with a 256-colour palette holding the viridis
// levels and the interface colours above. `delay_cs` is each frame's display time in 1/100 s; the last frame
// shows `last_delay_cs`. Written atomically.
void save_gif_frames(const std::string& path, const std::vector<Canvas>& frames, int delay_cs, int last_delay_cs);

}  // namespace qkv::viz
