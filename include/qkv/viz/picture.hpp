// Picture files: the formats every drawing in qkv::viz is written as (PNG, SVG, PDF through Cairo), the
// options the commands take (--format, --scale), and the labels tokens get. What a picture shows lives in
// heatmap.hpp, plot.hpp and report.hpp.
#pragma once

#include <string>

namespace qkv::viz {

// A picture's file format: raster (PNG) or vector (SVG, PDF; text stays text-sized glyph outlines).
enum class PictureFormat { png, svg, pdf };

// How pictures are written.
struct PictureOptions {
  PictureFormat format = PictureFormat::png;  // the format picture_path() names; saving goes by the extension
  double scale = 1.0;  // PNG device pixels per logical pixel (2 for HiDPI screens), 0.25 … 8; vectors ignore it
};

// "png", "svg" or "pdf" as a format; ValueError naming the three otherwise.
PictureFormat parse_picture_format(const std::string& name);

// ".png", ".svg" or ".pdf".
const char* picture_extension(PictureFormat format);

// The format a file name's extension names; ValueError for another extension (the message lists the three).
PictureFormat picture_format_of(const std::string& path);

// `stem` with the options' extension: picture_path("out/loss", {svg}) is "out/loss.svg".
std::string picture_path(const std::string& stem, const PictureOptions& options);

// Checks the options (a scale outside 0.25 … 8 is a ValueError that says so).
void check_picture_options(const PictureOptions& options);

// A token as the pictures and attention.html label it: valid UTF-8 drawn with its real glyphs, a leading space shown
// as '␣', a newline as "\n", tabs and other control bytes as "\xNN", and so are bytes that are not UTF-8 (the pieces
// of a character split across byte-level tokens: "\xe6\x9d"); an empty token as "∅".
std::string token_label(const std::string& token);

// One line of text alone on a white picture, drawn as every picture draws its labels (same font, size,
// fallback and snapping), with `margin` logical pixels around it: what a label's pixels are compared with.
void save_text_picture(const std::string& path, const std::string& text, double px, double margin = 8,
                       const PictureOptions& options = {});

}  // namespace qkv::viz
