// Canvas drawing, the 5×7 font, viridis and the PNG and GIF encoders (see canvas.hpp).
#include "canvas.hpp"

#include <gif_lib.h>
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

// 5×7 glyphs of printable ASCII (32…126), one byte per row, bit 4 = the leftmost pixel. Drawn for qkv.
constexpr unsigned char kFont[95][7] = {
    {0, 0, 0, 0, 0, 0, 0}, {4, 4, 4, 4, 4, 0, 4}, {10, 10, 0, 0, 0, 0, 0}, {10, 31, 10, 10, 10, 31, 10},
    {4, 15, 20, 14, 5, 30, 4}, {24, 25, 2, 4, 8, 19, 3}, {12, 18, 20, 8, 21, 18, 13}, {4, 4, 0, 0, 0, 0, 0},
    {2, 4, 8, 8, 8, 4, 2}, {8, 4, 2, 2, 2, 4, 8}, {0, 4, 21, 14, 21, 4, 0}, {0, 4, 4, 31, 4, 4, 0},
    {0, 0, 0, 0, 12, 4, 8}, {0, 0, 0, 31, 0, 0, 0}, {0, 0, 0, 0, 0, 12, 12}, {1, 1, 2, 4, 8, 16, 16},
    {14, 17, 19, 21, 25, 17, 14}, {4, 12, 4, 4, 4, 4, 14}, {14, 17, 1, 2, 4, 8, 31}, {30, 1, 1, 14, 1, 1, 30},
    {2, 6, 10, 18, 31, 2, 2}, {31, 16, 30, 1, 1, 17, 14}, {6, 8, 16, 30, 17, 17, 14}, {31, 1, 2, 4, 8, 8, 8},
    {14, 17, 17, 14, 17, 17, 14}, {14, 17, 17, 15, 1, 2, 12}, {0, 12, 12, 0, 12, 12, 0}, {0, 12, 12, 0, 12, 4, 8},
    {2, 4, 8, 16, 8, 4, 2}, {0, 0, 31, 0, 31, 0, 0}, {8, 4, 2, 1, 2, 4, 8}, {14, 17, 1, 2, 4, 0, 4},
    {14, 17, 23, 21, 23, 16, 14}, {14, 17, 17, 31, 17, 17, 17}, {30, 17, 17, 30, 17, 17, 30}, {14, 17, 16, 16, 16, 17, 14},
    {28, 18, 17, 17, 17, 18, 28}, {31, 16, 16, 30, 16, 16, 31}, {31, 16, 16, 30, 16, 16, 16}, {14, 17, 16, 23, 17, 17, 15},
    {17, 17, 17, 31, 17, 17, 17}, {14, 4, 4, 4, 4, 4, 14}, {7, 2, 2, 2, 2, 18, 12}, {17, 18, 20, 24, 20, 18, 17},
    {16, 16, 16, 16, 16, 16, 31}, {17, 27, 21, 21, 17, 17, 17}, {17, 17, 25, 21, 19, 17, 17}, {14, 17, 17, 17, 17, 17, 14},
    {30, 17, 17, 30, 16, 16, 16}, {14, 17, 17, 17, 21, 18, 13}, {30, 17, 17, 30, 20, 18, 17}, {15, 16, 16, 14, 1, 1, 30},
    {31, 4, 4, 4, 4, 4, 4}, {17, 17, 17, 17, 17, 17, 14}, {17, 17, 17, 17, 17, 10, 4}, {17, 17, 17, 21, 21, 21, 10},
    {17, 17, 10, 4, 10, 17, 17}, {17, 17, 10, 4, 4, 4, 4}, {31, 1, 2, 4, 8, 16, 31}, {14, 8, 8, 8, 8, 8, 14},
    {16, 16, 8, 4, 2, 1, 1}, {14, 2, 2, 2, 2, 2, 14}, {4, 10, 17, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 31},
    {8, 4, 0, 0, 0, 0, 0}, {0, 0, 14, 1, 15, 17, 15}, {16, 16, 22, 25, 17, 17, 30}, {0, 0, 14, 16, 16, 17, 14},
    {1, 1, 13, 19, 17, 17, 15}, {0, 0, 14, 17, 31, 16, 14}, {6, 9, 8, 28, 8, 8, 8}, {0, 15, 17, 17, 15, 1, 14},
    {16, 16, 22, 25, 17, 17, 17}, {4, 0, 12, 4, 4, 4, 14}, {2, 0, 6, 2, 2, 18, 12}, {16, 16, 18, 20, 24, 20, 18},
    {12, 4, 4, 4, 4, 4, 14}, {0, 0, 26, 21, 21, 17, 17}, {0, 0, 22, 25, 17, 17, 17}, {0, 0, 14, 17, 17, 17, 14},
    {0, 0, 30, 17, 30, 16, 16}, {0, 0, 13, 19, 15, 1, 1}, {0, 0, 22, 25, 16, 16, 16}, {0, 0, 14, 16, 14, 1, 30},
    {8, 8, 28, 8, 8, 9, 6}, {0, 0, 17, 17, 17, 19, 13}, {0, 0, 17, 17, 17, 10, 4}, {0, 0, 17, 17, 21, 21, 10},
    {0, 0, 17, 10, 4, 10, 17}, {0, 0, 17, 17, 15, 1, 14}, {0, 0, 31, 2, 4, 8, 31}, {2, 4, 4, 8, 4, 4, 2},
    {4, 4, 4, 4, 4, 4, 4}, {8, 4, 4, 2, 4, 4, 8}, {0, 0, 8, 21, 2, 0, 0},
};

// Matplotlib's viridis sampled at t = 0, 1/9, …, 1; between samples the colour is interpolated linearly.
constexpr Rgb kViridisAnchors[10] = {{68, 1, 84},    {72, 40, 120},  {62, 74, 137},  {49, 104, 142}, {38, 130, 142},
                                     {31, 158, 137}, {53, 183, 121}, {109, 205, 89}, {180, 222, 44}, {253, 231, 37}};

}  // namespace

Rgb viridis(double t) {
  // The kViridisLevels colours, computed once.
  static const std::array<Rgb, kViridisLevels> table = [] {
    std::array<Rgb, kViridisLevels> out{};
    for (int level = 0; level < kViridisLevels; ++level) {
      const double x = static_cast<double>(level) / (kViridisLevels - 1) * 9.0;
      const int i = std::min(8, static_cast<int>(x));
      const double f = x - i;
      for (int k = 0; k < 3; ++k)
        out[static_cast<size_t>(level)][static_cast<size_t>(k)] = static_cast<unsigned char>(std::lround(
            kViridisAnchors[i][static_cast<size_t>(k)] * (1 - f) + kViridisAnchors[i + 1][static_cast<size_t>(k)] * f));
    }
    return out;
  }();
  if (!(t >= 0.0)) t = 0.0;  // NaN too
  t = std::min(t, 1.0);
  return table[static_cast<size_t>(std::lround(t * (kViridisLevels - 1)))];
}

Canvas::Canvas(int width, int height, Rgb background)
    : w_(std::max(width, 1)), h_(std::max(height, 1)), pixels_(static_cast<size_t>(w_) * h_ * 3) {
  for (size_t i = 0; i < pixels_.size(); i += 3) std::memcpy(&pixels_[i], background.data(), 3);
}

void Canvas::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
  std::memcpy(&pixels_[(static_cast<size_t>(y) * w_ + x) * 3], c.data(), 3);
}

Rgb Canvas::get(int x, int y) const {
  Rgb c{};
  if (x >= 0 && y >= 0 && x < w_ && y < h_) std::memcpy(c.data(), &pixels_[(static_cast<size_t>(y) * w_ + x) * 3], 3);
  return c;
}

void Canvas::rect(int x0, int y0, int x1, int y1, Rgb c) {
  for (int y = std::max(y0, 0); y <= std::min(y1, h_ - 1); ++y)
    for (int x = std::max(x0, 0); x <= std::min(x1, w_ - 1); ++x) set(x, y, c);
}

void Canvas::frame(int x0, int y0, int x1, int y1, Rgb c) {
  rect(x0, y0, x1, y0, c);
  rect(x0, y1, x1, y1, c);
  rect(x0, y0, x0, y1, c);
  rect(x1, y0, x1, y1, c);
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int thickness) {
  const int steps = static_cast<int>(std::max(std::fabs(x1 - x0), std::fabs(y1 - y0))) + 1;
  for (int i = 0; i <= steps; ++i) {
    const double t = static_cast<double>(i) / steps;
    const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))), y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
    rect(x - thickness / 2, y - thickness / 2, x + (thickness - 1) / 2, y + (thickness - 1) / 2, c);
  }
}

namespace {
// Calls pixel(glyph index in s, col, row) for every lit pixel of every glyph of s.
template <typename Pixel>
void for_each_glyph_pixel(const std::string& s, Pixel&& pixel) {
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char u = static_cast<unsigned char>(s[i]);
    const unsigned char* glyph = kFont[(u >= 32 && u <= 126 ? u : '?') - 32];
    for (int row = 0; row < 7; ++row)
      for (int col = 0; col < 5; ++col)
        if (glyph[row] & (16 >> col)) pixel(static_cast<int>(i), col, row);
  }
}
}  // namespace

void Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for_each_glyph_pixel(s, [&](int i, int col, int row) {
    const int px = x + (i * 6 + col) * scale, py = y + row * scale;
    rect(px, py, px + scale - 1, py + scale - 1, c);
  });
}

void Canvas::text_up(int x, int y, const std::string& s, Rgb c, int scale) {
  // glyph pixel (col, row) goes to (x + row, y − col): a quarter turn counter-clockwise
  for_each_glyph_pixel(s, [&](int i, int col, int row) {
    const int px = x + row * scale, py = y - (i * 6 + col) * scale;
    rect(px, py - scale + 1, px + scale - 1, py, c);
  });
}

void Canvas::save_png(const std::string& path) const {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* memory = open_memstream(&buffer, &size);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!memory || !png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    if (memory) fclose(memory);
    free(buffer);
    throw IoError(path + ": could not encode the PNG");
  }
  png_init_io(png, memory);
  // Flat colour areas compress well at any level; the fastest level keeps 144 heads' pictures quick.
  png_set_compression_level(png, 1);
  png_set_IHDR(png, info, static_cast<png_uint_32>(w_), static_cast<png_uint_32>(h_), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h_; ++y) png_write_row(png, const_cast<png_bytep>(&pixels_[static_cast<size_t>(y) * w_ * 3]));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  fclose(memory);
  std::vector<std::byte> bytes(reinterpret_cast<std::byte*>(buffer), reinterpret_cast<std::byte*>(buffer) + size);
  free(buffer);
  io::write_file_atomically(path, bytes);
}

namespace {

int gif_write(GifFileType* gif, const GifByteType* data, int length) {
  auto* out = static_cast<std::vector<std::byte>*>(gif->UserData);
  out->insert(out->end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + length);
  return length;
}

// The palette: the viridis levels, then the interface colours, then greys for anything else.
std::vector<Rgb> gif_palette() {
  std::vector<Rgb> palette;
  for (int i = 0; i < kViridisLevels; ++i) palette.push_back(viridis(static_cast<double>(i) / (kViridisLevels - 1)));
  for (Rgb c : {kWhite, kInk, kGrid, kAxis, kMuted, Rgb{0, 0, 0}, Rgb{214, 39, 40}, Rgb{31, 119, 180}})
    palette.push_back(c);
  for (int g = 0; palette.size() < 256; ++g) {
    const auto v = static_cast<unsigned char>(g * 255 / 47);
    palette.push_back({v, v, v});
  }
  return palette;
}

}  // namespace

void save_gif_frames(const std::string& path, const std::vector<Canvas>& frames, int delay_cs, int last_delay_cs) {
  if (frames.empty()) throw ValueError(path + ": an animation needs at least one frame");
  const int w = frames[0].width(), h = frames[0].height();
  const std::vector<Rgb> palette = gif_palette();
  std::map<uint32_t, GifByteType> index;
  auto lookup = [&](const unsigned char* p) -> GifByteType {
    const uint32_t key = static_cast<uint32_t>(p[0]) << 16 | static_cast<uint32_t>(p[1]) << 8 | p[2];
    if (auto it = index.find(key); it != index.end()) return it->second;
    size_t best = 0;
    int best_distance = 1 << 30;
    for (size_t i = 0; i < palette.size(); ++i) {
      const int d = (palette[i][0] - p[0]) * (palette[i][0] - p[0]) + (palette[i][1] - p[1]) * (palette[i][1] - p[1]) +
                    (palette[i][2] - p[2]) * (palette[i][2] - p[2]);
      if (d < best_distance) best_distance = d, best = i;
    }
    return index[key] = static_cast<GifByteType>(best);
  };
  std::vector<std::byte> bytes;
  int error = 0;
  GifFileType* gif = EGifOpen(&bytes, gif_write, &error);
  if (!gif) throw IoError(path + ": could not start the GIF encoder (giflib error " + std::to_string(error) + ")");
  std::vector<GifColorType> colors(256);
  for (size_t i = 0; i < 256; ++i) colors[i] = {palette[i][0], palette[i][1], palette[i][2]};
  ColorMapObject* map = GifMakeMapObject(256, colors.data());
  EGifSetGifVersion(gif, true);  // GIF89a: frame delays and looping
  bool ok = map && EGifPutScreenDesc(gif, w, h, 8, 0, map) == GIF_OK;
  // NETSCAPE2.0: loop forever.
  static const GifByteType kNetscape[] = {'N', 'E', 'T', 'S', 'C', 'A', 'P', 'E', '2', '.', '0'};
  static const GifByteType kLoop[] = {1, 0, 0};
  ok = ok && EGifPutExtensionLeader(gif, APPLICATION_EXT_FUNC_CODE) == GIF_OK &&
       EGifPutExtensionBlock(gif, sizeof kNetscape, kNetscape) == GIF_OK &&
       EGifPutExtensionBlock(gif, sizeof kLoop, kLoop) == GIF_OK && EGifPutExtensionTrailer(gif) == GIF_OK;
  std::vector<GifByteType> row(static_cast<size_t>(w));
  for (size_t f = 0; ok && f < frames.size(); ++f) {
    if (frames[f].width() != w || frames[f].height() != h) {
      ok = false;
      break;
    }
    GraphicsControlBlock gcb{};
    gcb.DisposalMode = DISPOSE_DO_NOT;
    gcb.DelayTime = f + 1 == frames.size() ? last_delay_cs : delay_cs;
    gcb.TransparentColor = NO_TRANSPARENT_COLOR;
    GifByteType extension[4];
    EGifGCBToExtension(&gcb, extension);
    ok = EGifPutExtension(gif, GRAPHICS_EXT_FUNC_CODE, 4, extension) == GIF_OK &&
         EGifPutImageDesc(gif, 0, 0, w, h, false, nullptr) == GIF_OK;
    const unsigned char* px = frames[f].pixels().data();
    for (int y = 0; ok && y < h; ++y) {
      for (int x = 0; x < w; ++x) row[static_cast<size_t>(x)] = lookup(px + (static_cast<size_t>(y) * w + x) * 3);
      ok = EGifPutLine(gif, row.data(), w) == GIF_OK;
    }
  }
  GifFreeMapObject(map);
  const bool closed = EGifCloseFile(gif, &error) == GIF_OK;
  if (!ok || !closed) throw IoError(path + ": could not encode the GIF (frames of different sizes, or giflib failed)");
  io::write_file_atomically(path, bytes);
}

}  // namespace qkv::viz
