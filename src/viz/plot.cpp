// plot_lines: rasterise a line chart into RGB pixels and encode it with libpng.
#include "qkv/viz/plot.hpp"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "qkv/core/error.hpp"
#include "qkv/io/file.hpp"

namespace qkv::viz {

namespace {

// 5×7 glyphs, one byte per row, bit 4 = leftmost pixel.
const std::map<char, std::array<unsigned char, 7>>& font() {
  static const std::map<char, std::array<unsigned char, 7>> glyphs = {
      {'0', {14, 17, 19, 21, 25, 17, 14}}, {'1', {4, 12, 4, 4, 4, 4, 14}},   {'2', {14, 17, 1, 2, 4, 8, 31}},
      {'3', {30, 1, 1, 14, 1, 1, 30}},     {'4', {2, 6, 10, 18, 31, 2, 2}},  {'5', {31, 16, 30, 1, 1, 17, 14}},
      {'6', {6, 8, 16, 30, 17, 17, 14}},   {'7', {31, 1, 2, 4, 8, 8, 8}},    {'8', {14, 17, 17, 14, 17, 17, 14}},
      {'9', {14, 17, 17, 15, 1, 2, 12}},   {'.', {0, 0, 0, 0, 0, 12, 12}},   {'-', {0, 0, 0, 31, 0, 0, 0}},
      {'=', {0, 0, 31, 0, 31, 0, 0}},      {'(', {2, 4, 8, 8, 8, 4, 2}},     {')', {8, 4, 2, 2, 2, 4, 8}},
      {' ', {0, 0, 0, 0, 0, 0, 0}},        {'a', {0, 0, 14, 1, 15, 17, 15}}, {'c', {0, 0, 14, 16, 16, 17, 14}},
      {'d', {1, 1, 13, 19, 17, 17, 15}},   {'e', {0, 0, 14, 17, 31, 16, 14}}, {'g', {0, 15, 17, 17, 15, 1, 14}},
      {'i', {4, 0, 12, 4, 4, 4, 14}},      {'k', {16, 16, 18, 20, 24, 20, 18}}, {'l', {12, 4, 4, 4, 4, 4, 14}},
      {'n', {0, 0, 22, 25, 17, 17, 17}},   {'o', {0, 0, 14, 17, 17, 17, 14}}, {'p', {0, 0, 30, 17, 30, 16, 16}},
      {'r', {0, 0, 22, 25, 16, 16, 16}},   {'s', {0, 0, 15, 16, 14, 1, 30}}, {'t', {8, 8, 28, 8, 8, 9, 6}},
      {'u', {0, 0, 17, 17, 17, 19, 13}},   {'v', {0, 0, 17, 17, 17, 10, 4}}, {'x', {0, 0, 17, 10, 4, 10, 17}},
      {'y', {0, 0, 17, 17, 15, 1, 14}},    {'m', {0, 0, 26, 21, 21, 17, 17}}, {'h', {16, 16, 22, 25, 17, 17, 17}},
      {'b', {16, 16, 22, 25, 17, 17, 30}}, {'f', {6, 9, 8, 28, 8, 8, 8}},    {'w', {0, 0, 17, 17, 21, 21, 10}},
      {'/', {1, 1, 2, 4, 8, 16, 16}},      {'q', {0, 0, 15, 17, 15, 1, 1}},  {'z', {0, 0, 31, 2, 4, 8, 31}},
      {'j', {2, 0, 6, 2, 2, 18, 12}},      {',', {0, 0, 0, 0, 12, 4, 8}},    {':', {0, 12, 12, 0, 12, 12, 0}},
  };
  return glyphs;
}

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), pixels_(static_cast<size_t>(w * h * 3), 255) {}
  void set(int x, int y, std::array<unsigned char, 3> c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    std::memcpy(&pixels_[static_cast<size_t>((y * w_ + x) * 3)], c.data(), 3);
  }
  void rect(int x0, int y0, int x1, int y1, std::array<unsigned char, 3> c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  void line(double x0, double y0, double x1, double y1, std::array<unsigned char, 3> c, int thickness) {
    const int steps = static_cast<int>(std::max(std::fabs(x1 - x0), std::fabs(y1 - y0))) + 1;
    for (int i = 0; i <= steps; ++i) {
      const double t = static_cast<double>(i) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))), y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      rect(x - thickness / 2, y - thickness / 2, x + (thickness - 1) / 2, y + (thickness - 1) / 2, c);
    }
  }
  // Text at (x, y) top-left, scale 2: 12 px per character.
  void text(int x, int y, const std::string& s, std::array<unsigned char, 3> c = {40, 40, 40}) {
    for (char ch : s) {
      auto it = font().find(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
      if (it != font().end())
        for (int row = 0; row < 7; ++row)
          for (int col = 0; col < 5; ++col)
            if (it->second[static_cast<size_t>(row)] & (16 >> col)) rect(x + col * 2, y + row * 2, x + col * 2 + 1, y + row * 2 + 1, c);
      x += 12;
    }
  }
  static int text_width(const std::string& s) { return static_cast<int>(s.size()) * 12; }
  const std::vector<unsigned char>& pixels() const { return pixels_; }

 private:
  int w_, h_;
  std::vector<unsigned char> pixels_;
};

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

void write_png(const std::string& path, int w, int h, const std::vector<unsigned char>& rgb) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* memory = open_memstream(&buffer, &size);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (!memory || !png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    if (memory) fclose(memory);
    free(buffer);
    throw IoError(path + ": could not encode the PNG");
  }
  png_init_io(png, memory);
  png_set_IHDR(png, info, static_cast<png_uint_32>(w), static_cast<png_uint_32>(h), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h; ++y) png_write_row(png, const_cast<png_bytep>(&rgb[static_cast<size_t>(y * w * 3)]));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  fclose(memory);
  std::vector<std::byte> bytes(reinterpret_cast<std::byte*>(buffer), reinterpret_cast<std::byte*>(buffer) + size);
  free(buffer);
  io::write_file_atomically(path, bytes);
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
  if (!std::isfinite(x_min)) throw ValueError("plot: no finite points to draw");
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
  write_png(path, width, height, c.pixels());
}

}  // namespace qkv::viz
