// The Cairo canvas, Pango text, viridis, the picture formats and the GIF encoder (see canvas.hpp, picture.hpp).
#include "canvas.hpp"

#include <cairo-pdf.h>
#include <cairo-svg.h>
#include <cairo.h>
#include <gif_lib.h>
#include <glib.h>
#include <pango/pangocairo.h>
#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "qkv/core/error.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/io/file.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(QKV_ASAN)  // GCC, or any compiler under scripts/run test
// Sanitizer builds: fontconfig keeps its font caches until exit without a root LeakSanitizer can see (Pango's font
// maps hold them), so every process that draws text "leaks" them — Chromium's LeakSanitizer runs suppress
// libfontconfig for the same reason — and LeakSanitizer reports the Cairo fonts and glyph surfaces hung off them
// (allocated in libcairo and libpixman) as indirect leaks of their own. qkv's own Cairo objects are all owned by
// Canvas::State and destroyed with it. Compiled into every binary that draws, so a plain ctest of a sanitizer
// build needs no LSAN_OPTIONS.
extern "C" __attribute__((visibility("default"))) const char* __lsan_default_suppressions() {
  return "leak:libfontconfig.so\nleak:libcairo.so\nleak:libpixman-1.so\n";
}
extern "C" __attribute__((visibility("default"))) const char* __lsan_default_options() {
  return "print_suppressions=0";  // a command's output stays its own
}
#endif

namespace qkv::viz {

namespace {

// Matplotlib's viridis sampled at t = 0, 1/9, …, 1; between samples the colour is interpolated linearly.
constexpr Rgb kViridisAnchors[10] = {{68, 1, 84},    {72, 40, 120},  {62, 74, 137},  {49, 104, 142}, {38, 130, 142},
                                     {31, 158, 137}, {53, 183, 121}, {109, 205, 89}, {180, 222, 44}, {253, 231, 37}};

// DejaVu Sans covers Latin, Greek, Cyrillic, Arabic and Hebrew; Noto Sans CJK (where installed) Chinese, Japanese
// and Korean; fontconfig falls back to any installed font for the rest, and Pango draws a box with the code point
// where none has the character.
constexpr const char* kFamilies = "DejaVu Sans, Noto Sans CJK SC, Noto Sans CJK JP, Noto Sans, sans-serif";

// One Pango context per thread (Pango's default font map is per thread): layouts measured and drawn with
// unhinted metrics, so a label's width is the same in PNG, SVG and PDF and at every scale.
struct TextContext {
  PangoContext* context = nullptr;
  PangoFontDescription* regular = nullptr;
  PangoFontDescription* bold = nullptr;
  TextContext() {
    context = pango_font_map_create_context(pango_cairo_font_map_get_default());
    cairo_font_options_t* options = cairo_font_options_create();
    cairo_font_options_set_hint_metrics(options, CAIRO_HINT_METRICS_OFF);
    cairo_font_options_set_hint_style(options, CAIRO_HINT_STYLE_NONE);
    cairo_font_options_set_antialias(options, CAIRO_ANTIALIAS_GRAY);
    pango_cairo_context_set_font_options(context, options);
    cairo_font_options_destroy(options);
    pango_cairo_context_set_resolution(context, 96.0);
    regular = pango_font_description_from_string(kFamilies);
    bold = pango_font_description_copy(regular);
    pango_font_description_set_weight(bold, PANGO_WEIGHT_BOLD);
  }
  ~TextContext() {
    pango_font_description_free(regular);
    pango_font_description_free(bold);
    g_object_unref(context);
  }
  TextContext(const TextContext&) = delete;
  TextContext& operator=(const TextContext&) = delete;
};

TextContext& text_context() {
  thread_local TextContext context;
  return context;
}

// Pango needs valid UTF-8: bytes that are not become U+FFFD.
std::string valid_utf8(const std::string& text) {
  if (g_utf8_validate(text.data(), static_cast<gssize>(text.size()), nullptr)) return text;
  gchar* fixed = g_utf8_make_valid(text.data(), static_cast<gssize>(text.size()));
  std::string out = fixed;
  g_free(fixed);
  return out;
}

struct Layout {
  PangoLayout* layout = nullptr;
  TextSize size;
  Layout(const std::string& text, double px, bool bold) {
    TextContext& tc = text_context();
    layout = pango_layout_new(tc.context);
    PangoFontDescription* font = pango_font_description_copy(bold ? tc.bold : tc.regular);
    pango_font_description_set_absolute_size(font, px * PANGO_SCALE);
    pango_layout_set_font_description(layout, font);
    pango_font_description_free(font);
    const std::string valid = valid_utf8(text);
    pango_layout_set_text(layout, valid.data(), static_cast<int>(valid.size()));
    PangoRectangle logical;
    pango_layout_get_extents(layout, nullptr, &logical);
    size = {static_cast<double>(logical.width) / PANGO_SCALE, static_cast<double>(logical.height) / PANGO_SCALE};
  }
  ~Layout() { g_object_unref(layout); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

void set_colour(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c[0] / 255.0, c[1] / 255.0, c[2] / 255.0); }

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  auto* out = static_cast<std::vector<std::byte>*>(closure);
  out->insert(out->end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + length);
  return CAIRO_STATUS_SUCCESS;
}

std::string lower_extension(const std::string& path) {
  const size_t slash = path.find_last_of('/'), dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot + 1);
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext;
}

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

TextSize measure_text(const std::string& text, double px, bool bold) { return Layout(text, px, bold).size; }

// ---- picture.hpp ----

PictureFormat parse_picture_format(const std::string& name) {
  if (name == "png") return PictureFormat::png;
  if (name == "svg") return PictureFormat::svg;
  if (name == "pdf") return PictureFormat::pdf;
  throw ValueError("picture format '" + name + "' is not one qkv writes; use png, svg or pdf");
}

const char* picture_extension(PictureFormat format) {
  switch (format) {
    case PictureFormat::svg: return ".svg";
    case PictureFormat::pdf: return ".pdf";
    case PictureFormat::png: break;
  }
  return ".png";
}

PictureFormat picture_format_of(const std::string& path) {
  const std::string ext = lower_extension(path);
  if (ext == "png" || ext == "svg" || ext == "pdf") return parse_picture_format(ext);
  throw ValueError(path + ": a picture's name ends in .png, .svg or .pdf, the format it is written in");
}

std::string picture_path(const std::string& stem, const PictureOptions& options) {
  return stem + picture_extension(options.format);
}

void check_picture_options(const PictureOptions& options) {
  if (!(options.scale >= 0.25 && options.scale <= 8.0)) {
    throw ValueError("picture scale " + format_real(options.scale) +
                     " is outside 0.25 … 8 (device pixels per pixel; 2 for a HiDPI screen)");
  }
}

std::string token_label(const std::string& token) {
  if (token.empty()) return "\u2205";
  std::string out;
  auto hex = [&](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  };
  for (size_t i = 0; i < token.size();) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x80) {
      if (c == ' ' && i == 0) out += "\u2423";
      else if (c == '\n') out += "\\n";
      else if (c < 0x20 || c == 0x7f) hex(c);
      else out += static_cast<char>(c);
      ++i;
      continue;
    }
    // A whole UTF-8 character keeps its glyph; a byte that starts none (a piece of a character split across
    // byte-level tokens) shows its value, as the control bytes do, not a row of U+FFFD that all look alike.
    const char* end = nullptr;
    const size_t n = std::min<size_t>(4, token.size() - i);
    g_utf8_validate(token.data() + i, static_cast<gssize>(n), &end);
    const size_t valid = static_cast<size_t>(end - (token.data() + i));  // glib refuses overlongs and surrogates
    const size_t length = static_cast<size_t>(g_utf8_skip[c]);
    if (valid >= length) {
      out.append(token, i, length);
      i += length;
    } else {
      hex(c);
      ++i;
    }
  }
  return out;
}

void save_text_picture(const std::string& path, const std::string& text, double px, double margin,
                       const PictureOptions& options) {
  const TextSize size = measure_text(text, px);
  Canvas canvas(size.width + 2 * margin, size.height + 2 * margin);
  canvas.text(margin, margin, text, px, kInk);
  canvas.save(path, options);
}

// ---- Canvas ----

struct Canvas::State {
  cairo_surface_t* surface = nullptr;  // a recording surface: the drawing as vectors, replayed at save time
  cairo_t* cr = nullptr;
  ~State() {
    if (cr) cairo_destroy(cr);
    if (surface) cairo_surface_destroy(surface);
  }
};

Canvas::Canvas(double width, double height, Rgb background)
    : state_(std::make_unique<State>()),
      w_(std::max(1, static_cast<int>(std::ceil(width)))),
      h_(std::max(1, static_cast<int>(std::ceil(height)))) {
  const cairo_rectangle_t extents{0, 0, static_cast<double>(w_), static_cast<double>(h_)};
  state_->surface = cairo_recording_surface_create(CAIRO_CONTENT_COLOR, &extents);
  state_->cr = cairo_create(state_->surface);
  set_colour(state_->cr, background);
  cairo_paint(state_->cr);
}

Canvas::~Canvas() = default;
Canvas::Canvas(Canvas&&) noexcept = default;
Canvas& Canvas::operator=(Canvas&&) noexcept = default;

void Canvas::rect(double x, double y, double w, double h, Rgb c) {
  cairo_t* cr = state_->cr;
  set_colour(cr, c);
  cairo_rectangle(cr, x, y, w, h);
  cairo_fill(cr);
}

void Canvas::frame(double x, double y, double w, double h, Rgb c, double line_width) {
  cairo_t* cr = state_->cr;
  set_colour(cr, c);
  cairo_set_line_width(cr, line_width);
  cairo_rectangle(cr, x + line_width / 2, y + line_width / 2, w - line_width, h - line_width);
  cairo_stroke(cr);
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, double line_width, bool dashed) {
  polyline({{x0, y0}, {x1, y1}}, c, line_width, dashed);
}

void Canvas::polyline(const std::vector<std::pair<double, double>>& points, Rgb c, double line_width, bool dashed) {
  cairo_t* cr = state_->cr;
  set_colour(cr, c);
  cairo_set_line_width(cr, line_width);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
  const double dash[] = {6.0, 4.0};
  cairo_set_dash(cr, dash, dashed ? 2 : 0, 0);
  bool open = false;
  for (const auto& [x, y] : points) {
    if (!std::isfinite(x) || !std::isfinite(y)) {
      open = false;
      continue;
    }
    if (open) cairo_line_to(cr, x, y);
    else cairo_move_to(cr, x, y), open = true;
  }
  cairo_stroke(cr);
  cairo_set_dash(cr, nullptr, 0, 0);
}

void Canvas::dot(double x, double y, double radius, Rgb c) {
  cairo_t* cr = state_->cr;
  set_colour(cr, c);
  cairo_arc(cr, x, y, radius, 0, 2 * M_PI);
  cairo_fill(cr);
}

void Canvas::cells(double x, double y, double cell_w, double cell_h, int rows, int cols, const std::vector<Rgb>& colours) {
  QKV_CHECK(colours.size() == static_cast<size_t>(rows) * static_cast<size_t>(cols), "one colour per cell");
  if (rows <= 0 || cols <= 0) return;
  cairo_surface_t* image = cairo_image_surface_create(CAIRO_FORMAT_RGB24, cols, rows);
  if (cairo_surface_status(image) != CAIRO_STATUS_SUCCESS) {
    cairo_surface_destroy(image);
    throw ValueError("a heatmap of " + std::to_string(rows) + " × " + std::to_string(cols) +
                     " cells is larger than a picture can hold (32767 per side)");
  }
  cairo_surface_flush(image);
  unsigned char* data = cairo_image_surface_get_data(image);
  const int stride = cairo_image_surface_get_stride(image);
  for (int r = 0; r < rows; ++r) {
    auto* row = reinterpret_cast<uint32_t*>(data + static_cast<size_t>(r) * stride);
    for (int c = 0; c < cols; ++c) {
      const Rgb& rgb = colours[static_cast<size_t>(r) * cols + c];
      row[c] = 0xFF000000u | static_cast<uint32_t>(rgb[0]) << 16 | static_cast<uint32_t>(rgb[1]) << 8 | rgb[2];
    }
  }
  cairo_surface_mark_dirty(image);
  cairo_t* cr = state_->cr;
  cairo_save(cr);
  cairo_translate(cr, x, y);
  cairo_scale(cr, cell_w, cell_h);
  cairo_set_source_surface(cr, image, 0, 0);
  cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
  cairo_rectangle(cr, 0, 0, cols, rows);
  cairo_fill(cr);
  cairo_restore(cr);
  cairo_surface_destroy(image);
}

TextSize Canvas::text(double x, double y, const std::string& text, double px, Rgb c, Align align, bool bold, bool up) {
  if (text.empty()) return {};
  Layout layout(text, px, bold);
  const double along = align == Align::left ? 0.0 : align == Align::center ? -layout.size.width / 2 : -layout.size.width;
  cairo_t* cr = state_->cr;
  cairo_save(cr);
  set_colour(cr, c);
  if (up) {
    cairo_translate(cr, std::round(x), std::round(y - along));
    cairo_rotate(cr, -M_PI / 2);
  } else {
    cairo_translate(cr, std::round(x + along), std::round(y));
  }
  cairo_move_to(cr, 0, 0);
  pango_cairo_show_layout(cr, layout.layout);
  cairo_restore(cr);
  return layout.size;
}

namespace {
cairo_surface_t* raster(cairo_surface_t* recording, int w, int h, double scale) {
  const int sw = std::max(1, static_cast<int>(std::ceil(w * scale))), sh = std::max(1, static_cast<int>(std::ceil(h * scale)));
  cairo_surface_t* image = cairo_image_surface_create(CAIRO_FORMAT_RGB24, sw, sh);
  cairo_t* cr = cairo_create(image);
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_scale(cr, scale, scale);
  cairo_set_source_surface(cr, recording, 0, 0);
  cairo_paint(cr);
  cairo_destroy(cr);
  cairo_surface_flush(image);
  return image;
}
}  // namespace

namespace {
// PNG through libpng at zlib level 1 and the Sub filter, not cairo_surface_write_to_png_stream: Cairo's writer
// always uses zlib's default level with adaptive filtering, which took 43% of `qkv attention` at GPT-2 124M and
// 254 tokens (145 pictures, 110 M pixels). Flat colour cells compress well at any level: on one 912 × 850 head
// picture, 6–7 ms against Cairo's 24–25 ms, for a file 1.24× larger (measured).
std::vector<std::byte> encode_png(const Pixels& pixels, const std::string& path) {
  std::vector<std::byte> bytes;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw IoError(path + ": could not encode the PNG");
  }
  png_set_write_fn(
      png, &bytes,
      [](png_structp p, png_bytep data, png_size_t length) {
        auto* out = static_cast<std::vector<std::byte>*>(png_get_io_ptr(p));
        out->insert(out->end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + length);
      },
      nullptr);
  png_set_compression_level(png, 1);
  png_set_filter(png, PNG_FILTER_TYPE_BASE, PNG_FILTER_SUB);
  png_set_IHDR(png, info, static_cast<png_uint_32>(pixels.width), static_cast<png_uint_32>(pixels.height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < pixels.height; ++y)
    png_write_row(png, const_cast<png_bytep>(&pixels.rgb[static_cast<size_t>(y) * pixels.width * 3]));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return bytes;
}

// Cairo 1.16 writes an SVG's images without a rendering hint, so browsers smooth a heatmap's cells (one small
// image scaled up) into a blur (seen in Chromium). The only images in qkv's pictures are such cells: the root gets
// image-rendering: pixelated, which every image inherits. PDF images already say /Interpolate false.
void keep_cells_sharp(std::vector<std::byte>& svg) {
  const std::string_view text(reinterpret_cast<const char*>(svg.data()), svg.size());
  const size_t root = text.find("<svg ");
  if (root == std::string_view::npos) return;
  static constexpr std::string_view kStyle = "<svg style=\"image-rendering:pixelated\" ";
  std::vector<std::byte> out;
  out.reserve(svg.size() + kStyle.size());
  out.insert(out.end(), svg.begin(), svg.begin() + static_cast<std::ptrdiff_t>(root));
  for (char c : kStyle) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), svg.begin() + static_cast<std::ptrdiff_t>(root + 5), svg.end());
  svg = std::move(out);
}

}  // namespace

Pixels Canvas::render(double scale) const {
  cairo_surface_t* image = raster(state_->surface, w_, h_, scale);
  Pixels out;
  out.width = cairo_image_surface_get_width(image);
  out.height = cairo_image_surface_get_height(image);
  const unsigned char* data = cairo_image_surface_get_data(image);
  const int stride = cairo_image_surface_get_stride(image);
  if (cairo_surface_status(image) != CAIRO_STATUS_SUCCESS || !data) {
    cairo_surface_destroy(image);
    throw IoError("could not render a picture of " + std::to_string(w_) + " × " + std::to_string(h_) + " at scale " +
                  format_real(scale) + " (out of memory?)");
  }
  out.rgb.resize(static_cast<size_t>(out.width) * out.height * 3);
  for (int y = 0; y < out.height; ++y) {
    const auto* row = reinterpret_cast<const uint32_t*>(data + static_cast<size_t>(y) * stride);
    unsigned char* dst = &out.rgb[static_cast<size_t>(y) * out.width * 3];
    for (int x = 0; x < out.width; ++x) {
      dst[3 * x] = static_cast<unsigned char>(row[x] >> 16), dst[3 * x + 1] = static_cast<unsigned char>(row[x] >> 8),
              dst[3 * x + 2] = static_cast<unsigned char>(row[x]);
    }
  }
  cairo_surface_destroy(image);
  return out;
}

void Canvas::save(const std::string& path, const PictureOptions& options) const {
  check_picture_options(options);
  const PictureFormat format = picture_format_of(path);
  std::vector<std::byte> bytes;
  cairo_status_t status = CAIRO_STATUS_SUCCESS;
  if (format == PictureFormat::png) {
    bytes = encode_png(render(options.scale), path);
  } else {
    // Vectors: one logical pixel is one point; the recording is replayed as paths, glyphs and images.
    cairo_surface_t* target = format == PictureFormat::svg
                                  ? cairo_svg_surface_create_for_stream(append_bytes, &bytes, w_, h_)
                                  : cairo_pdf_surface_create_for_stream(append_bytes, &bytes, w_, h_);
    if (format == PictureFormat::pdf) cairo_pdf_surface_set_metadata(target, CAIRO_PDF_METADATA_CREATOR, "qkv");
    cairo_t* cr = cairo_create(target);
    cairo_set_source_surface(cr, state_->surface, 0, 0);
    cairo_paint(cr);
    cairo_show_page(cr);
    cairo_destroy(cr);
    cairo_surface_finish(target);
    status = cairo_surface_status(target);
    cairo_surface_destroy(target);
    if (format == PictureFormat::svg) keep_cells_sharp(bytes);
  }
  if (status != CAIRO_STATUS_SUCCESS) {
    throw IoError(path + ": could not draw the picture (" + cairo_status_to_string(status) + ")");
  }
  io::write_file_atomically(path, bytes);
}

// ---- GIF ----

namespace {

int gif_write(GifFileType* gif, const GifByteType* data, int length) {
  auto* out = static_cast<std::vector<std::byte>*>(gif->UserData);
  out->insert(out->end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + length);
  return length;
}

// The palette: the viridis levels, then the interface colours, then greys for anti-aliased text.
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

void save_gif_frames(const std::string& path, size_t count, const std::function<Pixels(size_t)>& frame, int delay_cs,
                     int last_delay_cs) {
  if (count == 0) throw ValueError(path + ": an animation needs at least one frame");
  // Frames are drawn one at a time as they are encoded (one palette for all), so memory holds one frame, not all:
  // 500 frames of a 32-token heatmap took 1.4 GB before.
  Pixels current = frame(0);
  const int w = current.width, h = current.height;
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
  for (size_t f = 0; ok && f < count; ++f) {
    if (f > 0) current = frame(f);
    if (current.width != w || current.height != h) {
      ok = false;
      break;
    }
    GraphicsControlBlock gcb{};
    gcb.DisposalMode = DISPOSE_DO_NOT;
    gcb.DelayTime = f + 1 == count ? last_delay_cs : delay_cs;
    gcb.TransparentColor = NO_TRANSPARENT_COLOR;
    GifByteType extension[4];
    EGifGCBToExtension(&gcb, extension);
    ok = EGifPutExtension(gif, GRAPHICS_EXT_FUNC_CODE, 4, extension) == GIF_OK &&
         EGifPutImageDesc(gif, 0, 0, w, h, false, nullptr) == GIF_OK;
    const unsigned char* px = current.rgb.data();
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
