// Pictures: PNG heatmaps decode to the size they say, are not blank, and colour the largest weight brighter than
// the smallest (viridis runs from dark purple to yellow); grids and GIFs are written; the demo draws its matrices.
#include <png.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "helpers.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/viz/heatmap.hpp"
#include "qkv/viz/report.hpp"

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

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("qkv_viz_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(Heatmap, DecodesWithLabelsColourBarAndTheRightColourDirection) {
  const fs::path dir = scratch("heatmap");
  // Row 1 holds the largest weight (0.9 at column 2), row 0 the smallest (0.01 at column 0).
  const Tensor w = Tensor::from_rows({{0.01f, 0.49f, 0.5f}, {0.05f, 0.05f, 0.9f}, {0.3f, 0.3f, 0.4f}});
  viz::HeatmapStyle style;
  style.title = "A";
  style.row_labels = style.col_labels = {"the", "fat", "cat"};
  const viz::HeatmapGeometry g = viz::heatmap_png((dir / "a.png").string(), w, style);
  const Image image = read_png((dir / "a.png").string());
  ASSERT_EQ(image.width, g.width);
  ASSERT_EQ(image.height, g.height);
  EXPECT_GT(distinct_colours(image), 20u) << "blank picture";
  // Sample each cell near its corner (the value is printed in the middle).
  auto cell = [&](int r, int c) { return image.luminance(g.left + c * g.cell + 3, g.top + r * g.cell + 3); };
  EXPECT_GT(cell(1, 2), cell(0, 0) + 100) << "the largest weight must be drawn brighter (yellow) than the smallest";
  EXPECT_GT(cell(0, 2), cell(0, 1)) << "0.50 brighter than 0.49";
  EXPECT_GE(g.cell, 48) << "values are printed in cells that fit them";
  // Width > 100 px to the right of the grid holds the colour bar: its top is yellow, its bottom dark.
  const int bar_x = g.left + 3 * g.cell + 20 + 9;
  EXPECT_GT(image.luminance(bar_x, g.top + 2), image.luminance(bar_x, g.top + 3 * g.cell - 3) + 100);
}

TEST(Heatmap, RefusesWhatIsNotAMatrixAndWritesGridsAndGifs) {
  const fs::path dir = scratch("grid");
  EXPECT_THROW(viz::heatmap_png((dir / "bad.png").string(), Tensor::zeros({2, 3, 4}), {}), ValueError);
  EXPECT_FALSE(fs::exists(dir / "bad.png"));
  const Tensor w = random_tensor({5, 5}, 1);
  viz::heatmap_grid_png((dir / "grid.png").string(), "grid", {{"L1 H1", w}, {"L1 H2", w}, {"L2 H1", w}}, 2,
                        {"a", "b", "c", "d", "e"});
  const Image grid = read_png((dir / "grid.png").string());
  EXPECT_GT(grid.width, 300);
  EXPECT_GT(distinct_colours(grid), 20u);
  viz::HeatmapAnimation animation({});
  for (int i = 0; i < 3; ++i) animation.add_frame(random_tensor({4, 4}, static_cast<uint64_t>(i)), "step " + std::to_string(i));
  animation.save_gif((dir / "a.gif").string());
  std::ifstream gif(dir / "a.gif", std::ios::binary);
  std::string magic(6, '\0');
  gif.read(magic.data(), 6);
  EXPECT_EQ(magic, "GIF89a");
  EXPECT_GT(fs::file_size(dir / "a.gif"), 1000u);
}

TEST(Heatmap, AsciiLabelsKeepTokensReadable) {
  EXPECT_EQ(viz::ascii_label(" the"), "_the");
  EXPECT_EQ(viz::ascii_label("caf\xc3\xa9"), "caf?");
  EXPECT_EQ(viz::ascii_label(""), "?");
}

TEST(Demo, PngDirHoldsAHeatmapPerMatrixAndTheTrainingGif) {
  const fs::path dir = scratch("demo");
  const CliResult r = run_cli("demo --no-color --png " + dir.string());
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
           {"--d-out 4", "go with --sentence"}}) {
    const CliResult r = run_cli("demo " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

TEST(Demo, NoColorIsHonoured) {
  const CliResult r = run_cli("demo --section v1 --color", "NO_COLOR=1 ");
  EXPECT_NE(r.out.find("\x1b["), std::string::npos) << "--color wins over NO_COLOR";
  const CliResult plain = run_cli("demo --section v1", "NO_COLOR=1 ");
  EXPECT_EQ(plain.out.find("\x1b["), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
