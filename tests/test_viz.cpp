// Pictures: heatmaps and plots decode to the size they say, are not blank, and put the data where it belongs
// (viridis runs from dark purple to yellow; a curve's pixels lie where its points are); labels are drawn with
// the real glyphs of any script, exactly as the same text drawn alone; SVG and PDF are well-formed files that
// xmllint and pdfinfo (libxml2-utils, poppler-utils: scripts/run test installs them) accept.
#include <png.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <system_error>
#include <vector>

#include "helpers.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/viz/heatmap.hpp"
#include "qkv/viz/plot.hpp"
#include "qkv/viz/report.hpp"
#include "qkv/viz/show.hpp"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

struct Image {
  int width = 0, height = 0;
  std::vector<unsigned char> rgb;
  std::array<int, 3> at(int x, int y) const {
    const size_t i = (static_cast<size_t>(y) * width + x) * 3;
    return {rgb[i], rgb[i + 1], rgb[i + 2]};
  }
  double luminance(int x, int y) const {
    const auto c = at(x, y);
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
  }
};

Image read_png(const std::string& path) {
  Image image;
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&png, path.c_str())) return image;
  png.format = PNG_FORMAT_RGB;
  image.rgb.resize(PNG_IMAGE_SIZE(png));
  if (!png_image_finish_read(&png, nullptr, image.rgb.data(), 0, nullptr)) return {};
  image.width = static_cast<int>(png.width);
  image.height = static_cast<int>(png.height);
  return image;
}

size_t distinct_colours(const Image& image) {
  std::set<std::array<int, 3>> colours;
  for (int y = 0; y < image.height; y += 2)
    for (int x = 0; x < image.width; x += 2) colours.insert(image.at(x, y));
  return colours.size();
}

// The ink (pixels darker than the white background) inside [x0, x1) × [y0, y1), cropped to its bounding box.
struct Ink {
  int width = 0, height = 0;
  std::vector<double> luminance;  // row-major
};
Ink ink(const Image& image, int x0, int y0, int x1, int y1) {
  int left = x1, right = x0 - 1, top = y1, bottom = y0 - 1;
  for (int y = std::max(y0, 0); y < std::min(y1, image.height); ++y)
    for (int x = std::max(x0, 0); x < std::min(x1, image.width); ++x)
      if (image.luminance(x, y) < 200) left = std::min(left, x), right = std::max(right, x), top = std::min(top, y), bottom = std::max(bottom, y);
  Ink out;
  if (right < left) return out;
  out.width = right - left + 1, out.height = bottom - top + 1;
  for (int y = top; y <= bottom; ++y)
    for (int x = left; x <= right; ++x) out.luminance.push_back(image.luminance(x, y));
  return out;
}
// Mean absolute difference of two crops of equal size; infinity when their sizes differ.
double difference(const Ink& a, const Ink& b) {
  if (a.width != b.width || a.height != b.height || a.luminance.empty()) return INFINITY;
  double total = 0;
  for (size_t i = 0; i < a.luminance.size(); ++i) total += std::fabs(a.luminance[i] - b.luminance[i]);
  return total / static_cast<double>(a.luminance.size());
}

// The scratch directories of the test under way, removed when it ends unless it failed (then kept, to look at). Each
// ctest process runs one test under its own pid, so without this every run left its pictures in /tmp (74 MB so far).
std::vector<fs::path>& scratch_dirs() {
  static std::vector<fs::path> dirs;
  return dirs;
}

class RemoveScratchDirs : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& test) override {
    if (test.result() != nullptr && !test.result()->Failed())
      for (const fs::path& dir : scratch_dirs()) {
        std::error_code ignored;
        fs::remove_all(dir, ignored);
      }
    scratch_dirs().clear();
  }
};

fs::path scratch(const std::string& name) {
  static const bool listening = [] {
    ::testing::UnitTest::GetInstance()->listeners().Append(new RemoveScratchDirs);  // gtest owns it
    return true;
  }();
  (void)listening;
  const fs::path dir = fs::temp_directory_path() / ("qkv_viz_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  scratch_dirs().push_back(dir);
  return dir;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Heatmap, DecodesWithLabelsColourBarAndTheRightColourDirection) {
  const fs::path dir = scratch("heatmap");
  // Row 1 holds the largest weight (0.9 at column 2), row 0 the smallest (0.01 at column 0).
  const Tensor w = Tensor::from_rows({{0.01f, 0.49f, 0.5f}, {0.05f, 0.05f, 0.9f}, {0.3f, 0.3f, 0.4f}});
  viz::HeatmapStyle style;
  style.title = "A";
  style.row_labels = style.col_labels = {"the", "fat", "cat"};
  const viz::HeatmapGeometry g = viz::save_heatmap((dir / "a.png").string(), w, style);
  const Image image = read_png((dir / "a.png").string());
  ASSERT_EQ(image.width, g.width);
  ASSERT_EQ(image.height, g.height);
  EXPECT_GT(distinct_colours(image), 20u) << "blank picture";
  // Sample each cell near its corner (the value is printed in the middle).
  auto cell = [&](int r, int c) { return image.luminance(g.left + c * g.cell + 3, g.top + r * g.cell + 3); };
  EXPECT_GT(cell(1, 2), cell(0, 0) + 100) << "the largest weight must be drawn brighter (yellow) than the smallest";
  EXPECT_GT(cell(0, 2), cell(0, 1)) << "0.50 brighter than 0.49";
  EXPECT_GE(g.cell, 48) << "values are printed in cells that fit them";
  // Right of the grid, the colour bar: its top is yellow, its bottom dark.
  const int bar_x = g.left + 3 * g.cell + 20 + 9;
  EXPECT_GT(image.luminance(bar_x, g.top + 2), image.luminance(bar_x, g.top + 3 * g.cell - 3) + 100);
  // At scale 2 the same picture has twice the pixels each way, the same colours in the same places.
  viz::save_heatmap((dir / "a2.png").string(), w, style, {.scale = 2.0});
  const Image big = read_png((dir / "a2.png").string());
  EXPECT_EQ(big.width, 2 * g.width);
  EXPECT_EQ(big.height, 2 * g.height);
  EXPECT_NEAR(big.luminance(2 * (g.left + 2 * g.cell + 3), 2 * (g.top + g.cell + 3)), cell(1, 2), 2.0);
}

TEST(Heatmap, RefusesWhatIsNotAMatrixOrAFormatAndWritesGridsAndGifs) {
  const fs::path dir = scratch("grid");
  EXPECT_THROW(viz::save_heatmap((dir / "bad.png").string(), Tensor::zeros({2, 3, 4}), {}), ValueError);
  EXPECT_FALSE(fs::exists(dir / "bad.png"));
  try {
    viz::save_heatmap((dir / "a.bmp").string(), Tensor::zeros({2, 2}), {});
    ADD_FAILURE() << "a .bmp name must be refused";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(".png, .svg or .pdf"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "a.bmp"));
  EXPECT_THROW(viz::save_heatmap((dir / "a.png").string(), Tensor::zeros({2, 2}), {}, {.scale = 0.0}), ValueError);
  EXPECT_THROW(viz::parse_picture_format("jpg"), ValueError);
  const Tensor w = random_tensor({5, 5}, 1);
  viz::save_heatmap_grid((dir / "grid.png").string(), "grid", {{"L1 H1", w}, {"L1 H2", w}, {"L2 H1", w}}, 2,
                         {"a", "b", "c", "d", "e"});
  const Image grid = read_png((dir / "grid.png").string());
  EXPECT_GT(grid.width, 300);
  EXPECT_GT(distinct_colours(grid), 20u);
  viz::HeatmapAnimation animation({});
  for (int i = 0; i < 3; ++i) animation.add_frame(random_tensor({4, 4}, static_cast<uint64_t>(i)), "step " + std::to_string(i));
  animation.save_gif((dir / "a.gif").string());
  EXPECT_EQ(slurp(dir / "a.gif").substr(0, 6), "GIF89a");
  EXPECT_GT(fs::file_size(dir / "a.gif"), 1000u);
}

TEST(Heatmap, CountsPrintAsWholeNumbers) {
  // A confusion matrix: whole counts print as "143", not "143.00" — the cell holds less ink than "143.00" would.
  const fs::path dir = scratch("counts");
  viz::HeatmapStyle style;
  style.show_values = 1;
  const viz::HeatmapGeometry g = viz::save_heatmap((dir / "c.png").string(), Tensor::from_rows({{143.f, 7.f}, {2.f, 98.f}}), style);
  const Image image = read_png((dir / "c.png").string());
  viz::save_text_picture((dir / "whole.png").string(), "143", 13);
  viz::save_text_picture((dir / "decimals.png").string(), "143.00", 13);
  const Ink in_cell = ink(image, g.left + 2, g.top + 2, g.left + g.cell - 2, g.top + g.cell - 2);
  // In the bright cell the digits are dark ink on yellow; compare widths with the text drawn alone.
  const Ink whole = ink(read_png((dir / "whole.png").string()), 0, 0, 1000, 1000);
  const Ink decimals = ink(read_png((dir / "decimals.png").string()), 0, 0, 1000, 1000);
  EXPECT_LT(std::abs(in_cell.width - whole.width), 3) << in_cell.width << " vs " << whole.width;
  EXPECT_LT(whole.width + 10, decimals.width);
  EXPECT_GE(g.cell, 120) << "a 2 × 2 confusion matrix is drawn large enough to read (it was 370 × 240 px in all)";
}

// Cells a causal mask hides are light grey and hatched, without a value: not the dark purple of a real weight of 0. Under
// the colour bar, a note says which scale the colours are on (a fixed 0 … 1, or stretched to the largest value).
TEST(Heatmap, MaskedCellsDifferFromZeroWeightsAndTheBarNamesItsScale) {
  const fs::path dir = scratch("masked");
  const Tensor w = Tensor::from_rows({{1.0f, 0.0f, 0.0f}, {0.0f, 1.0f, 0.0f}, {0.2f, 0.3f, 0.5f}});  // (1, 0) is a real 0
  viz::HeatmapStyle style;
  style.row_labels = style.col_labels = {"a", "b", "c"};
  style.masked = viz::causal_cells();
  style.vmax = 1.0;
  const viz::HeatmapGeometry g = viz::save_heatmap((dir / "m.png").string(), w, style);
  const Image image = read_png((dir / "m.png").string());
  ASSERT_EQ(image.width, g.width);
  auto corner = [&](int r, int c) { return image.at(g.left + c * g.cell + 3, g.top + r * g.cell + 3); };
  const auto masked = corner(0, 1), zero = corner(1, 0);
  EXPECT_EQ(masked[0], masked[1]);
  EXPECT_EQ(masked[1], masked[2]);
  EXPECT_GT(image.luminance(g.left + g.cell + 3, g.top + 3), 200) << "a masked cell is light grey";
  EXPECT_LT(image.luminance(g.left + 3, g.top + g.cell + 3), 80) << "a weight of 0 is viridis' dark purple";
  EXPECT_NE(masked, zero);
  // hatched: the cell's diagonal is darker than its corner; and no value is printed in it
  EXPECT_LT(image.luminance(g.left + 2 * g.cell + g.cell / 2, g.top + g.cell / 2), image.luminance(g.left + 2 * g.cell + 3, g.top + 3) - 5);
  EXPECT_EQ(ink(image, g.left + g.cell + 2, g.top + 2, g.left + 2 * g.cell - 2, g.top + g.cell - 2).width, 0);
  // The note under the bar: "fixed scale" here, "scaled to its largest" with vmax = 0 (the same matrix, unmasked).
  auto note = [&](const Image& im, const viz::HeatmapGeometry& h) {
    const int x = h.left + 3 * h.cell + 20, y = h.top + std::max(3 * h.cell, 60) + 10;
    return ink(im, x - 2, y - 2, im.width, y + 15);
  };
  auto alone = [&](const std::string& text) {
    viz::save_text_picture((dir / "note.png").string(), text, 10);
    return ink(read_png((dir / "note.png").string()), 0, 0, 10000, 10000);
  };
  const Ink fixed = note(image, g), fixed_alone = alone("fixed scale");
  EXPECT_NEAR(fixed.width, fixed_alone.width, 2) << "the note under a fixed scale's bar";
  style.vmax = 0.0;
  style.masked = {};
  const viz::HeatmapGeometry a = viz::save_heatmap((dir / "auto.png").string(), w, style);
  const Ink stretched = note(read_png((dir / "auto.png").string()), a), stretched_alone = alone("scaled to its largest");
  EXPECT_NEAR(stretched.width, stretched_alone.width, 2) << "the note under a stretched scale's bar";
  EXPECT_GT(stretched.width, fixed.width + 20);
}

// Small multiples label the keys under the last row of panels as well as the queries beside the first column.
TEST(Heatmap, GridsLabelTheirKeysToo) {
  const fs::path dir = scratch("grid_keys");
  const Tensor w = random_tensor({6, 6}, 4);
  const std::vector<viz::HeatmapPanel> panels = {{"H1", w, viz::causal_cells()}, {"H2", w, viz::causal_cells()}};
  const std::vector<std::string> words = {"The", "keeper", "of", "the", "light", "house"};
  viz::save_heatmap_grid((dir / "labelled.png").string(), "heads", panels, 2, words);
  viz::save_heatmap_grid((dir / "bare.png").string(), "heads", panels, 2, {});
  const Image labelled = read_png((dir / "labelled.png").string()), bare = read_png((dir / "bare.png").string());
  ASSERT_GT(bare.height, 0);
  EXPECT_GT(labelled.height, bare.height + 20) << "room for the key labels under the panels";
  // Under the second panel (the lower half, left of the colour bar), dark text: its keys, which the bare grid lacks
  // (the cells are viridis, the bar's notes grey).
  auto text_pixels = [](const Image& image) {
    int n = 0;
    for (int y = image.height / 2; y < image.height; ++y)
      for (int x = image.width / 2 - 20; x < image.width - 150; ++x) {
        const auto p = image.at(x, y);
        n += std::abs(p[0] - 40) < 30 && std::abs(p[1] - 40) < 30 && std::abs(p[2] - 40) < 30;
      }
    return n;
  };
  EXPECT_GT(text_pixels(labelled), text_pixels(bare) + 150) << "keys under the last row's panels: " << text_pixels(labelled)
                                                             << " dark pixels, " << text_pixels(bare) << " without labels";
}

TEST(Labels, TokensKeepTheirCharactersAndShowWhatIsInvisible) {
  EXPECT_EQ(viz::token_label(" the"), "\u2423the");
  EXPECT_EQ(viz::token_label("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(viz::token_label("\xe6\x9d\xb1\xe4\xba\xac"), "\xe6\x9d\xb1\xe4\xba\xac");  // 東京
  EXPECT_EQ(viz::token_label("a\nb\tc"), "a\\nb\\x09c");
  EXPECT_EQ(viz::token_label(""), "\u2205");
  EXPECT_EQ(viz::token_label("\xe6\x9d"), "\\xe6\\x9d") << "half a character (a byte-level token): its bytes in hex";
  EXPECT_EQ(viz::token_label("\xac caf\xc3\xa9 \xf0\x9f\x99\x82"), "\\xac caf\xc3\xa9 \xf0\x9f\x99\x82");
  EXPECT_EQ(viz::token_label("\xed\xa0\x80"), "\\xed\\xa0\\x80") << "a surrogate is no character";
}

// GPT-2 splits an emoji into byte pieces: each keeps its bytes (token_bytes), labelled in hex, never U+FFFD.
TEST(Labels, SplitCharactersShowTheirBytes) {
  const auto dir = text::find_gpt2_vocabulary();
  ASSERT_TRUE(dir) << "GPT-2 vocabulary missing: run scripts/fetch-gpt2-vocab (scripts/run test does)";
  const auto gpt2 = text::make_tokenizer("gpt2", *dir);
  const std::string text = " \xf0\x9f\xa4\x96 \xe6\x9d\xb1\xe4\xba\xac";  // " 🤖 東京"
  const std::vector<int64_t> ids = gpt2->encode(text);
  std::string joined, labels;
  for (int64_t id : ids) {
    joined += gpt2->token_bytes(id);
    labels += viz::token_label(gpt2->token_bytes(id)) + "|";
  }
  EXPECT_EQ(joined, text) << "the pieces' bytes are the text's";
  EXPECT_NE(labels.find("\\xf0"), std::string::npos) << labels;
  EXPECT_NE(labels.find("\\x96"), std::string::npos) << labels;
  EXPECT_EQ(labels.find("\ufffd"), std::string::npos) << labels;
  EXPECT_EQ(text::ByteTokenizer().token_bytes(0xe6), "\xe6");
  EXPECT_THROW(gpt2->token_bytes(50257), ValueError);
}

// Every label of a heatmap, in four scripts, has the pixels of the same text drawn alone: real glyphs, not '?'.
void expect_labels_drawn_as_alone(const Image& image, const viz::HeatmapGeometry& g, const std::vector<std::string>& labels,
                                  const fs::path& dir) {
  ASSERT_GT(g.label_px, 0);
  for (size_t r = 0; r < labels.size(); ++r) {
    // Labels start 30 px from the left edge at the earliest (the rotated axis name "query" lies left of that).
    const Ink label = ink(image, 28, g.top + static_cast<int>(r) * g.cell, g.label_right + 2, g.top + (static_cast<int>(r) + 1) * g.cell);
    const std::string alone_path = (dir / ("alone" + std::to_string(r) + ".png")).string();
    viz::save_text_picture(alone_path, labels[r], g.label_px);
    const Ink alone = ink(read_png(alone_path), 0, 0, 10000, 10000);
    ASSERT_GT(alone.width, 0) << labels[r] << " drew no ink";
    EXPECT_LT(difference(label, alone), 4.0) << "label " << r << " (" << labels[r] << "): " << label.width << "×" << label.height
                                             << " vs alone " << alone.width << "×" << alone.height;
    const std::string question = (dir / "question.png").string();
    viz::save_text_picture(question, std::string(labels[r].size(), '?'), g.label_px);
    EXPECT_GT(difference(label, ink(read_png(question), 0, 0, 10000, 10000)), 4.0) << labels[r] << " looks like '?'";
  }
}

TEST(Heatmap, LabelsInAnyScriptAreDrawnWithTheirGlyphs) {
  const fs::path dir = scratch("unicode");
  const std::vector<std::string> labels = {"na\xc3\xafve", "caf\xc3\xa9", "\xc3\xbc" "ber", "\xe6\x9d\xb1\xe4\xba\xac",
                                           "\xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d"};  // naïve café über 東京 שלום
  viz::HeatmapStyle style;
  style.row_labels = style.col_labels = labels;
  const viz::HeatmapGeometry g = viz::save_heatmap((dir / "u.png").string(), random_tensor({5, 5}, 3), style);
  expect_labels_drawn_as_alone(read_png((dir / "u.png").string()), g, labels, dir);
}

TEST(Demo, YourSentenceInAnyScriptIsLabelledWithItsGlyphs) {
  const fs::path dir = scratch("demo_unicode");
  const std::vector<std::string> words = {"na\xc3\xafve", "caf\xc3\xa9", "\xc3\xbc" "ber", "\xe6\x9d\xb1\xe4\xba\xac"};
  const CliResult r = run_cli("demo --no-color --section v1 --pictures " + dir.string() + " --sentence '" + words[0] + " " +
                              words[1] + " " + words[2] + " " + words[3] + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  // The demo's layout is the library's: the same labels on a 4 × 4 matrix give the geometry to look in.
  viz::HeatmapStyle style;
  style.row_labels = style.col_labels = words;
  const viz::HeatmapGeometry g = viz::save_heatmap((dir / "layout.png").string(), Tensor::zeros({4, 4}), style);
  const Image image = read_png((dir / "01-v1-A.png").string());
  ASSERT_GT(image.width, 0);
  expect_labels_drawn_as_alone(image, g, words, dir);
}

TEST(Formats, SvgAndPdfAreWellFormedVectorsThatToolsOpen) {
  const fs::path dir = scratch("formats");
  viz::HeatmapStyle style;
  style.title = "A \xe2\x80\x94 caf\xc3\xa9";
  style.row_labels = style.col_labels = {"a", "b", "c"};
  viz::save_heatmap((dir / "a.svg").string(), random_tensor({3, 3}, 1), style);
  viz::save_heatmap((dir / "a.pdf").string(), random_tensor({3, 3}, 1), style);
  viz::save_plot((dir / "p.svg").string(), {{"loss", {31, 119, 180}, {{0, 3}, {1, 2}, {2, 1.5}}}}, {.title = "t"});
  EXPECT_NE(slurp(dir / "a.svg").find("<svg style=\"image-rendering:pixelated\""), std::string::npos)
      << "without it, browsers smooth the cells' image into a blur";
  EXPECT_EQ(slurp(dir / "a.pdf").substr(0, 5), "%PDF-");
  const CliResult xml = run_cli("", "xmllint --noout " + (dir / "a.svg").string() + " " + (dir / "p.svg").string() + " && echo ok; true #");
  EXPECT_NE(xml.out.find("ok"), std::string::npos) << "xmllint (libxml2-utils) refused the SVG or is missing:\n" << xml.out;
  const CliResult pdf = run_cli("", "pdfinfo " + (dir / "a.pdf").string() + "; true #");
  EXPECT_NE(pdf.out.find("Pages:           1"), std::string::npos) << "pdfinfo (poppler-utils) refused the PDF:\n" << pdf.out;
  EXPECT_NE(pdf.out.find("Creator:         qkv"), std::string::npos) << pdf.out;
}

TEST(Plot, CurvesLieWhereTheirPointsAreOnEitherAxisAndOnALogScale) {
  const fs::path dir = scratch("plot");
  const std::array<unsigned char, 3> blue{31, 119, 180}, red{214, 39, 40}, grey{120, 120, 120};
  viz::Series train{"train", blue, {}}, val{"validation", red, {}}, lr{"learning rate", grey, {}, false, true};
  for (int i = 0; i <= 100; ++i) {
    train.points.emplace_back(i, 5.0 * std::exp(-i / 30.0) + 0.5);
    lr.points.emplace_back(i, 1e-3 * std::min(1.0, i / 10.0));
  }
  for (int i = 0; i <= 100; i += 25) val.points.emplace_back(i, 5.0 * std::exp(-i / 30.0) + 0.8);
  train.points.emplace_back(101, NAN);  // left out, not drawn to the corner
  for (bool log_y : {false, true}) {
    const std::string path = (dir / (log_y ? "log.png" : "linear.png")).string();
    const viz::PlotGeometry g = viz::save_plot(path, {train, val, lr},
                                               {.title = "loss", .x_label = "step", .y_label = "loss", .y2_label = "lr", .log_y = log_y});
    const Image image = read_png(path);
    ASSERT_EQ(image.width, 800);
    ASSERT_EQ(image.height, 480);
    // Near each point's pixel, a pixel of its series' colour.
    auto near_colour = [&](double px, double py, std::array<unsigned char, 3> c) {
      for (int dy = -2; dy <= 2; ++dy)
        for (int dx = -2; dx <= 2; ++dx) {
          const int x = static_cast<int>(std::lround(px)) + dx, y = static_cast<int>(std::lround(py)) + dy;
          if (x < 0 || y < 0 || x >= image.width || y >= image.height) continue;
          const auto p = image.at(x, y);
          if (std::abs(p[0] - c[0]) + std::abs(p[1] - c[1]) + std::abs(p[2] - c[2]) < 30) return true;
        }
      return false;
    };
    for (int i : {0, 20, 50, 90}) {
      const auto [x, y] = train.points[static_cast<size_t>(i)];
      EXPECT_TRUE(near_colour(g.x_pixel(x), g.y_pixel(y), blue)) << "train at step " << i << (log_y ? " (log)" : "");
    }
    for (int i : {3, 60}) {  // the learning rate against the right-hand axis, dashed: look at two gaps' worth
      const auto [x, y] = lr.points[static_cast<size_t>(i)];
      EXPECT_TRUE(near_colour(g.x_pixel(x), g.y2_pixel(y), grey) || near_colour(g.x_pixel(x + 1), g.y2_pixel(lr.points[i + 1].second), grey))
          << "learning rate at step " << i;
    }
    EXPECT_TRUE(near_colour(g.x_pixel(50), g.y_pixel(val.points[2].second), red));
    EXPECT_GT(g.right, g.left + 500);
    if (log_y) {
      EXPECT_LE(g.y_min, 0.5);  // whole decades
      EXPECT_GE(g.y_max, 5.8);
      // On a log axis, equal ratios are equal distances.
      EXPECT_NEAR(g.y_pixel(1) - g.y_pixel(2), g.y_pixel(2) - g.y_pixel(4), 0.01);
    }
  }
  EXPECT_THROW(viz::save_plot((dir / "nan.png").string(), {{"x", blue, {{0, NAN}, {1, INFINITY}}}}, {}), ValueError);
  EXPECT_THROW(viz::save_plot((dir / "neg.png").string(), {{"x", blue, {{0, -1}, {1, 0}}}}, {.log_y = true}), ValueError);
}

// Accuracy per epoch: ticks at whole epochs only, a dot on every evaluation, and the legend where the curves are not
// (they rise into the top right corner, its usual place).
TEST(Plot, WholeEpochTicksMarkersAndALegendOffTheData) {
  const fs::path dir = scratch("plot_epochs");
  const std::array<unsigned char, 3> blue{31, 119, 180}, orange{255, 127, 14};
  viz::Series train{"training accuracy", blue, {{1, 0.5}, {2, 0.8}, {3, 0.95}}, false, false, true},
      val{"validation accuracy", orange, {{1, 0.45}, {2, 0.75}, {3, 0.92}}, false, false, true};
  const viz::PlotStyle style{.title = "accuracy", .x_label = "epoch", .y_label = "accuracy", .whole_x = true};
  const viz::PlotGeometry g = viz::save_plot((dir / "a.png").string(), {train, val}, style);
  EXPECT_EQ(g.x_step, 1.0) << "no tick at epoch 1.2";
  EXPECT_LT(viz::save_plot((dir / "b.png").string(), {train, val}, {.title = "t"}).x_step, 1.0);
  for (int64_t epochs : {12, 21, 40}) {  // a step of 2.5 would put ticks at 2.5, 7.5
    viz::Series many{"a", blue, {}};
    for (int64_t e = 1; e <= epochs; ++e) many.points.emplace_back(static_cast<double>(e), 1.0 / static_cast<double>(e));
    const double step = viz::save_plot((dir / "c.png").string(), {many}, style).x_step;
    EXPECT_EQ(step, std::round(step)) << epochs << " epochs";
  }
  ASSERT_GT(g.legend_w, 50);
  for (const viz::Series& s : {train, val})
    for (const auto& [x, y] : s.points) {
      const double px = g.x_pixel(x), py = g.y_pixel(y);
      EXPECT_FALSE(px >= g.legend_x && px <= g.legend_x + g.legend_w && py >= g.legend_y && py <= g.legend_y + g.legend_h)
          << s.name << " at epoch " << x << " lies under the legend";
    }
  EXPECT_LT(g.legend_x, g.left + (g.right - g.left) / 2) << "the top right is taken by the data";
  // The dot at epoch 2 on the training curve: more of its colour around the point than the line alone leaves.
  const Image marked = read_png((dir / "a.png").string());
  train.markers = val.markers = false;
  viz::save_plot((dir / "plain.png").string(), {train, val}, style);
  const Image plain = read_png((dir / "plain.png").string());
  auto coloured = [&](const Image& image) {
    int n = 0;
    for (int dy = -3; dy <= 3; ++dy)
      for (int dx = -3; dx <= 3; ++dx) {
        const auto p = image.at(static_cast<int>(g.x_pixel(2)) + dx, static_cast<int>(g.y_pixel(0.8)) + dy);
        n += std::abs(p[0] - blue[0]) + std::abs(p[1] - blue[1]) + std::abs(p[2] - blue[2]) < 60;
      }
    return n;
  };
  EXPECT_GT(coloured(marked), coloured(plain) + 8) << coloured(marked) << " vs " << coloured(plain);
}

// --color-scale: auto stretches each picture's colours to its largest weight (the book's A, at most 0.23, reaches
// yellow), fixed keeps 0 … 1 (no cell of it does). Causal pictures show their masked cells as such.
TEST(Demo, ColorScaleAndMaskedCells) {
  auto yellow = [](const Image& image) {
    int n = 0;
    for (int y = 0; y < image.height; ++y)
      for (int x = 0; x < image.width; ++x) {
        const auto p = image.at(x, y);
        n += p[0] > 200 && p[1] > 190 && p[2] < 90;
      }
    return n;
  };
  int counts[2] = {0, 0};
  for (int fixed : {0, 1}) {
    const fs::path dir = scratch(std::string("demo_scale_") + (fixed ? "fixed" : "auto"));
    const CliResult r = run_cli("demo --no-color --section v1 --section causal --pictures " + dir.string() +
                                " --color-scale " + (fixed ? "fixed" : "auto"));
    ASSERT_EQ(r.code, 0) << r.out;
    counts[fixed] = yellow(read_png((dir / "01-v1-A.png").string()));
    const Image causal = read_png((dir / "04-causal-A.png").string());
    int grey = 0;
    for (int y = 0; y < causal.height; ++y)
      for (int x = 0; x < causal.width; ++x) grey += causal.at(x, y) == std::array<int, 3>{228, 228, 228};
    EXPECT_GT(grey, 15 * 40 * 40) << "the 15 masked cells of a 6 × 6 causal A";
  }
  EXPECT_GT(counts[0], counts[1] + 2000) << "auto: " << counts[0] << " yellow pixels, fixed: " << counts[1];
  const CliResult bad = run_cli("demo --section v1 --color-scale bright");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("fixed"), std::string::npos) << bad.out;
}

TEST(Demo, PicturesDirHoldsAHeatmapPerMatrixAndTheTrainingGif) {
  const fs::path dir = scratch("demo");
  const CliResult r = run_cli("demo --no-color --png " + dir.string());  // --png: the older name of --pictures
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"01-v1-A.png", "02-v2-A.png", "03-train-A-before.png", "03-train-A-after.png", "04-causal-A.png",
                        "05-dropout-A.png", "06-wrapper-head1.png", "06-wrapper-head2.png", "06-mha-head1.png",
                        "06-mha-head2.png", "06-mha-heads.png"}) {
    const Image image = read_png((dir / f).string());
    EXPECT_GT(image.width, 200) << f;
    EXPECT_GT(distinct_colours(image), 10u) << f;
  }
  EXPECT_GT(fs::file_size(dir / "03-train-A-steps.gif"), 10000u);
  EXPECT_NE(r.out.find("[picture: " + (dir / "03-train-A-after.png").string() + "]"), std::string::npos);
  // --format: the same pictures as vectors; the animation stays a GIF.
  for (const char* format : {"svg", "pdf"}) {
    const fs::path vectors = scratch(std::string("demo_") + format);
    const CliResult v = run_cli("demo --no-color --section v1 --section train --pictures " + vectors.string() + " --format " + format);
    ASSERT_EQ(v.code, 0) << v.out;
    EXPECT_TRUE(fs::exists(vectors / (std::string("01-v1-A.") + format))) << v.out;
    EXPECT_TRUE(fs::exists(vectors / "03-train-A-steps.gif"));
    EXPECT_FALSE(fs::exists(vectors / "01-v1-A.png"));
  }
  const CliResult bad = run_cli("demo --section v1 --pictures " + dir.string() + " --format bmp");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("png"), std::string::npos) << bad.out;
}

TEST(Demo, YourOwnSentenceAndEmbeddingsAndTheirMistakes) {
  const CliResult own = run_cli("demo --no-color --sentence 'the fat cat sat on the mat' --d-in 4 --d-out 4 --seed 5");
  ASSERT_EQ(own.code, 0) << own.out;
  EXPECT_NE(own.out.find("n = 7 tokens, d = 4"), std::string::npos);
  EXPECT_NE(own.out.find("← cat now attends most to fat"), std::string::npos);
  EXPECT_EQ(own.out.find("query_2 ="), std::string::npos) << "the book's numbers belong to the book's sentence";
  const fs::path dir = scratch("demo_npy");
  io::save_npy((dir / "x.npy").string(), random_tensor({3, 5}, 2));
  const CliResult npy = run_cli("demo --no-color --section v1 --embeddings " + (dir / "x.npy").string() + " --tokens 'a b c'");
  ASSERT_EQ(npy.code, 0) << npy.out;
  EXPECT_NE(npy.out.find("d = 5: embeddings from"), std::string::npos) << npy.out;
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"--sentence ''", "--sentence is empty"},
           {"--sentence '" + [] { std::string s; for (int i = 0; i < 40; ++i) s += "w "; return s; }() + "'",
            "at most 32 tokens"},
           {"--sentence 'a b' --d-out 3", "not divisible by num_heads = 2"},
           {"--embeddings " + (dir / "x.npy").string() + " --tokens 'a b'", "has 3 rows but --tokens names 2"},
           {"--color --no-color", "excludes"},
           {"--tokens 'a b'", "requires"},
           {"--d-out 4", "go with --sentence"},
           // 0 is refused like -3 and 65, not read as "the default"
           {"--sentence 'a b' --d-in 0", "--d-in: must be a whole number from 1 to 64, not 0"},
           {"--sentence 'a b' --d-out 0", "--d-out: must be a whole number from 1 to 64, not 0"},
           {"--sentence 'a b' --d-in -3", "from 1 to 64, not -3"},
           {"--sentence 'a b' --d-out 65", "from 1 to 64, not 65"}}) {
    const CliResult r = run_cli("demo " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

// Terminal tables pad by display width: wide CJK and emoji take two columns, combining marks none, so every row's
// numbers start in the same column whatever script its label is in.
TEST(Terminal, TablesAlignByDisplayWidthInAnyScript) {
  EXPECT_EQ(viz::display_width("naïve"), 5u);
  EXPECT_EQ(viz::display_width("e\u0301"), 1u);  // e + combining acute
  EXPECT_EQ(viz::display_width("東京"), 4u);
  EXPECT_EQ(viz::display_width("🙂"), 2u);
  EXPECT_EQ(viz::display_width("👩\u200d💻"), 2u);  // one ZWJ picture
  EXPECT_EQ(viz::display_width("\u2764\ufe0f"), 2u);  // ❤️: a narrow symbol in emoji presentation
  const std::vector<std::string> labels = {"naïve", "東京", "🙂", "a", "über"};
  const Tensor m = Tensor::from_rows({{-0.1085f, 1.0f}, {-0.1085f, 1.0f}, {0.5f, 1.0f}, {0.25f, 1.0f}, {0.125f, 1.0f}});
  for (const std::string& table : {viz::matrix("m", m, labels, {"c1", "c2"}),
                                   viz::heatmap("w", m, labels), viz::bars({0.5f, 0.25f, 0.1f, 0.0f, 1.0f}, labels)}) {
    std::istringstream lines(table);
    std::set<size_t> number_columns;
    for (std::string line; std::getline(lines, line);) {
      for (const std::string& label : labels) {
        const size_t at = line.find(label);
        if (at > 2) continue;  // a row starts with its label (bars indent it by two spaces)
        // where the first number ends: numbers are right-aligned in their cells
        const size_t digit = line.find_first_of("0123456789.-", at + label.size());
        number_columns.insert(viz::display_width(line.substr(0, line.find_first_not_of("0123456789.-", digit))));
        break;
      }
    }
    EXPECT_EQ(number_columns.size(), 1u) << table;
  }
  const CliResult demo = run_cli("demo --no-color --section v1 --sentence 'naïve café über 東京 🙂'");
  ASSERT_EQ(demo.code, 0) << demo.out;
  std::set<size_t> starts;  // where each row's first number ends in the first table (X)
  int rows = 0;
  std::istringstream lines(demo.out);
  for (std::string line; std::getline(lines, line);)
    for (const char* label : {"naïve ", "café ", "über ", "東京 ", "🙂 "})
      if (line.rfind(label, 0) == 0 && line.find("0.") != std::string::npos && ++rows <= 5) {  // X's five rows
        const size_t digit = line.find_first_of("0123456789.-", std::string(label).size());
        starts.insert(viz::display_width(line.substr(0, line.find_first_not_of("0123456789.-", digit))));
      }
  EXPECT_EQ(starts.size(), 1u) << demo.out.substr(0, 1200);
}

// A sentence where the goal cannot be met: the run stops at 500 steps and says so (and why), counts its steps right,
// and its animation keeps ~60 frames (it kept 501: 1.4 GB while drawing, a 30 MB GIF). --attend picks the pair.
TEST(Demo, TrainingThatMissesItsGoalSaysSoAndKeepsItsAnimationSmall) {
  std::string sentence;
  for (int i = 1; i <= 32; ++i) sentence += "w" + std::to_string(i) + " ";
  const fs::path dir = scratch("demo_miss");
  fs::remove_all(dir);
  const CliResult r = run_cli("demo --no-color --section train --sentence '" + sentence + "' --pictures " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("make \"w32\" attend to \"w1\""), std::string::npos) << "last word to first by default";
  EXPECT_NE(r.out.find("step 500   loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("After 500 steps"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("After 501"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("The goal (\"w32\" attending most to \"w1\", with a weight of at least 0.5) was not reached in "
                       "500 steps"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("with 32 words in d = 3 dimensions"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("03-train-A-steps.gif, 60 frames: the first ten steps, then every tenth"), std::string::npos) << r.out;
  EXPECT_LT(fs::file_size(dir / "03-train-A-steps.gif"), 8u << 20);
  fs::remove_all(dir);
  // --attend QUERY,KEY by word or position; a repeated key is named as the reason the goal is out of reach.
  const CliResult pair = run_cli("demo --no-color --section train --sentence 'the fat cat sat on the mat' --attend 3,the");
  ASSERT_EQ(pair.code, 0) << pair.out;
  EXPECT_NE(pair.out.find("make \"cat\" attend to \"the\""), std::string::npos) << pair.out;
  EXPECT_NE(pair.out.find("\"the\" appears 2 times with one embedding"), std::string::npos) << pair.out;
  const CliResult cat_fat = run_cli("demo --no-color --section train --sentence 'a fat cat'");
  EXPECT_NE(cat_fat.out.find("← cat now attends most to fat"), std::string::npos) << cat_fat.out;
  const CliResult bad = run_cli("demo --section train --sentence 'a b' --attend a,zz");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("--attend: the key \"zz\" is neither a word of the input (a b) nor a position 1…2"),
            std::string::npos) << bad.out;
}

TEST(Demo, NoColorIsHonoured) {
  const CliResult r = run_cli("demo --section v1 --color", "NO_COLOR=1 ");
  EXPECT_NE(r.out.find("\x1b["), std::string::npos) << "--color wins over NO_COLOR";
  const CliResult plain = run_cli("demo --section v1", "NO_COLOR=1 ");
  EXPECT_EQ(plain.out.find("\x1b["), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
