// End-to-end runs of the qkv tool: the demo prints the book's numbers, apply matches PyTorch, and
// mistakes give a message and the documented exit code.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cctype>
#include <algorithm>
#include <sstream>
#include <set>
#include <regex>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::test {
namespace {

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

TEST(Cli, DemoPrintsTheBooksNumbers) {
  const CliResult r = run_cli("demo --no-color");
  ASSERT_EQ(r.code, 0) << r.out;
  // SelfAttention_v1, seed 123: W_query, query_2, ω22, the weights of x², and the context vectors.
  for (const char* expected : {"x1  0.2961  0.5166", "query_2 = [0.4306, 1.4551]", "ω₂₂ = 1.8524",
                               "journey   0.1500   0.2264   0.2199   0.1311   0.0906   0.1820       1.0000",
                               "Your     0.2996  0.8053", "step     0.2990  0.8040",
                               // SelfAttention_v2, seed 789
                               "x1   0.3161  -0.1683", "Your     -0.0739   0.0713", "step     -0.0754   0.0693"})
    EXPECT_TRUE(contains(r.out, expected)) << "missing: " << expected;
  EXPECT_TRUE(contains(r.out, "← cat now attends most to fat"));
  // Causal weights (seed 789), dropout (seed 123), CausalAttention, the wrapper and MultiHeadAttention (seed 123).
  for (const char* expected : {"journey   0.5517   0.4483   0.0000", "step      0.1935   0.1663   0.1666   0.1542   0.1666   0.1529",
                               "0  2.0000  2.0000  0.0000  2.0000  2.0000  0.0000",
                               "starts    0.7599   0.6194   0.6206   0.0000   0.0000   0.0000",
                               "Your     -0.4519   0.2216", "step     -0.5299  -0.1081",
                               "Your     -0.4519   0.2216   0.4772   0.1063", "step     -0.5299  -0.1081   0.5077   0.3493",
                               "Your     0.3190  0.4858", "step     0.2575  0.4028"})
    EXPECT_TRUE(contains(r.out, expected)) << "missing: " << expected;
}

TEST(Cli, DemoTrainingLossFalls) {
  const CliResult r = run_cli("demo --no-color --section train");
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<double> losses;
  const std::string marker = "   loss ";  // as in "step  10   loss 1.3716"
  for (size_t at = r.out.find(marker); at != std::string::npos; at = r.out.find(marker, at + 1))
    losses.push_back(std::stod(r.out.substr(at + marker.size())));
  ASSERT_GE(losses.size(), 5u);
  EXPECT_LT(losses.back(), losses.front() * 0.5);
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]);
}

TEST(Cli, HelpVersionAndUsageErrors) {
  EXPECT_EQ(run_cli("--help").code, 0);
  EXPECT_EQ(run_cli("demo --help").code, 0);
  const CliResult version = run_cli("--version");
  EXPECT_EQ(version.code, 0);
  EXPECT_TRUE(contains(version.out, kVersion));
  const CliResult unknown = run_cli("demo --frobnicate");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_TRUE(contains(unknown.out, "frobnicate")) << unknown.out;
  EXPECT_EQ(run_cli("").code, 2);
  EXPECT_EQ(run_cli("no-such-command").code, 2);
  EXPECT_EQ(run_cli("demo --section nope").code, 2);
}

// The option parser's internals never show: help names value types (INT, NUMBER, FORMAT) and bad values are refused
// in qkv's words, under the option's own name.
TEST(Cli, OptionHelpAndErrorsShowNoParserInternals) {
  const CliResult help = run_cli("--help-all");
  ASSERT_EQ(help.code, 0);
  for (const char* internal : {"TEXT:VALUE", "{false}", "->", "ENUM", "OR {", ":COUNT", ":NUMBER"})
    EXPECT_FALSE(contains(help.out, internal)) << internal;
  for (const char* shown : {"--steps INT=500", "--lr NUMBER=0.001", "--format,--picture-format FORMAT=png",
                            "--context INT               Window length (default: the model's context_length; for a "
                            "Hugging Face folder at most 2048)", "--overwrite                 Replace the output if it exists",
                            "--no-head-pictures Excludes"})
    EXPECT_TRUE(contains(help.out, shown)) << shown;
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"demo --format jpg", "--format: must be png, svg or pdf, not \"jpg\""},
           {"train --steps abc", "--steps: \"abc\" is not an integer"},
           {"train --lr 1e-3x", "--lr: \"1e-3x\" is not a number"},
           {"generate --top-p 2", "--top-p: must lie in (0, 1], not 2"},
           {"tokenize --vocab", "--vocab"}}) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_TRUE(contains(r.out, message)) << args << "\n" << r.out;
    EXPECT_FALSE(contains(r.out, "max_steps")) << r.out;
  }
}

// A file that is not a model is named for what it is: text, GGUF, a folder without config.json (named as missing).
TEST(Cli, AFileThatIsNotAModelIsNamedForWhatItIs) {
  const auto dir = std::filesystem::temp_directory_path() / "qkv_cli_not_a_model";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "folder");
  std::ofstream(dir / "story.txt") << "In the beginning God created the heaven and the earth.\n";
  std::ofstream(dir / "model.gguf") << std::string("GGUF\x03\0\0\0", 8) << std::string(64, '\0');
  std::ofstream(dir / "folder" / "model.safetensors") << "";
  for (const auto& [path, message] : std::vector<std::pair<std::string, std::string>>{
           {(dir / "story.txt").string(), "story.txt: a text file, not a model"},
           {(dir / "model.gguf").string(), "model.gguf: a GGUF file (llama.cpp's format)"},
           {(dir / "folder").string() + "/", "folder: a folder without config.json"}}) {
    const std::vector<std::string> commands = {"generate --prompt hi --checkpoint ", "train --steps 1 --out " +
                                                                       (dir / "out").string() + " --resume "};
    for (const std::string& command : commands) {
      const CliResult r = run_cli(command + path);
      EXPECT_EQ(r.code, 1) << command << path << "\n" << r.out;
      EXPECT_TRUE(contains(r.out, message)) << r.out;
      EXPECT_FALSE(contains(r.out, "header length")) << r.out;
      EXPECT_FALSE(contains(r.out, "not a regular file")) << r.out;
    }
  }
  const CliResult apply = run_cli("apply --module " + (dir / "story.txt").string() + " --input x.npy --output " +
                                  (dir / "o.safetensors").string());
  EXPECT_EQ(apply.code, 1);
  EXPECT_TRUE(contains(apply.out, "the file is UTF-8 text (\"In the beginning")) << apply.out;
  std::filesystem::remove_all(dir);
}

TEST(Cli, ApplyReproducesPyTorchOutputAndGradients) {
  const std::string base = fixture("modules/mha_dropout");
  const auto out_path = std::filesystem::temp_directory_path() / "qkv_cli_apply.safetensors";
  const auto expected = io::SafetensorsFile::open(base + ".expected.safetensors");
  const CliResult r = run_cli("apply --module " + base + ".module.safetensors --input " + base + ".input.safetensors" +
                    " --grad-output " + base + ".input.safetensors --output " + out_path.string() + " --train --seed " +
                    expected.metadata().at("seed"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto got = io::SafetensorsFile::open(out_path.string());
  ASSERT_EQ(got.tensors().size(), expected.tensors().size());
  for (const auto& info : expected.tensors())
    EXPECT_TRUE(all_close(got.tensor(info.name), expected.tensor(info.name))) << info.name;
  std::filesystem::remove(out_path);
}

TEST(Cli, ApplyErrorsNameTheFileAndExitOne) {
  const std::string base = fixture("modules/v1_book");
  const std::string out = (std::filesystem::temp_directory_path() / "qkv_cli_never.safetensors").string();
  CliResult r = run_cli("apply --module " + base + ".module.safetensors --input " + fixture("modules/mha_t37.input.safetensors") +
              " --output " + out);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(r.out, "mha_t37.input.safetensors")) << r.out;
  EXPECT_TRUE(contains(r.out, "d_in = 3")) << r.out;
  r = run_cli("apply --module " + base + ".input.safetensors --input x.npy --output " + out);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(r.out, "no \"module\" entry")) << r.out;
  r = run_cli("apply --module /nonexistent.safetensors --input x.npy --output " + out);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(r.out, "/nonexistent.safetensors: cannot open")) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;  // one line
  EXPECT_FALSE(std::filesystem::exists(out));
  r = run_cli("apply --module " + base + ".module.safetensors --input x.npy --output o.safetensors --seed 3");
  EXPECT_EQ(r.code, 2) << r.out;  // --seed needs --train
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Readme, ShowsTheCompiledExampleVerbatimAndTheTwoCommands) {
  const std::string root = std::string(QKV_FIXTURES) + "/../..";
  const std::string readme = read_text(root + "/README.md");
  const std::string example = read_text(root + "/tests/readme_example.cpp");
  ASSERT_FALSE(example.empty());
  EXPECT_NE(readme.find("```cpp\n" + example + "```"), std::string::npos)
      << "README.md's C++ example differs from tests/readme_example.cpp";
  EXPECT_NE(readme.find("scripts/run demo"), std::string::npos);
  EXPECT_NE(readme.find("scripts/run test"), std::string::npos);
  EXPECT_NE(read_text(root + "/.ci/run").find("scripts/run test"), std::string::npos);
  const auto lines = std::count(readme.begin(), readme.end(), '\n');
  EXPECT_LE(lines, 300) << "the README is for a newcomer's five minutes: details belong in docs/";
}

// The README's first command leaves what its tour needs: fonts for CJK and emoji (Debian's packages, installed before
// any job) and the GPT-2 vocabulary `qkv train` reads, fetched by the demo job itself into data/gpt2 (where qkv looks
// from the checkout).
TEST(Readme, ScriptsRunDemoInstallsWhatTheTourNeeds) {
  const std::string root = std::string(QKV_FIXTURES) + "/../..";
  const std::string run = read_text(root + "/scripts/run");
  const size_t packages = run.find("packages=("), demo = run.find("\n  demo)");
  ASSERT_NE(packages, std::string::npos);
  ASSERT_NE(demo, std::string::npos);
  const std::string list = run.substr(packages, run.find(')', packages) - packages);
  for (const char* p : {"fonts-noto-cjk", "fonts-noto-color-emoji", "bible-kjv"})
    EXPECT_NE(list.find(p), std::string::npos) << "scripts/run installs no " << p;
  const std::string job = run.substr(demo, run.find(";;", demo) - demo);
  EXPECT_NE(job.find("scripts/fetch-gpt2-vocab data/gpt2"), std::string::npos) << job;
  EXPECT_LT(job.find("fetch-gpt2-vocab"), job.find("./build/qkv demo")) << job;
}

// The README's excerpt of `qkv demo --section v1` is the real output: each run of lines between its "…" appears, line
// for line, in what the command prints (it once showed Wq beside A; the output stacks them).
TEST(Readme, TheDemoExcerptIsRealOutput) {
  const std::string root = std::string(QKV_FIXTURES) + "/../..";
  const std::string readme = read_text(root + "/README.md");
  const std::string command = "$ build/qkv demo --section v1\n";
  const size_t begin = readme.find(command);
  ASSERT_NE(begin, std::string::npos);
  const std::string excerpt = readme.substr(begin + command.size(), readme.find("```", begin) - begin - command.size());
  const CliResult r = run_cli("demo --section v1 --no-color");
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(excerpt);
  std::string line, run;
  int runs = 0;
  auto check = [&] {
    if (run.empty()) return;
    ++runs;
    EXPECT_NE(r.out.find(run), std::string::npos) << "README.md shows lines qkv demo does not print:\n" << run;
    run.clear();
  };
  while (std::getline(lines, line)) {
    if (line == "\u2026") check();
    else run += line + "\n";
  }
  check();
  EXPECT_GE(runs, 2);
}

// GitHub's anchor for a heading: lower case, spaces to '-', ASCII punctuation dropped (letters of other scripts kept).
std::string anchor_of(const std::string& heading) {
  std::string out;
  for (unsigned char c : heading) {
    if (c == ' ') out += '-';
    else if (c >= 0x80 || std::isalnum(c) || c == '-' || c == '_') out += static_cast<char>(std::tolower(c));
  }
  return out;
}

struct Markdown {
  std::vector<std::string> anchors, links, cpp_blocks;
};
Markdown parse_markdown(const std::string& text) {
  Markdown md;
  std::istringstream in(text);
  std::string line, block;
  bool fenced = false, cpp = false;
  const std::regex link(R"(\[[^\]]*\]\(([^)\s]+)\))");
  while (std::getline(in, line)) {
    if (line.rfind("```", 0) == 0) {
      if (fenced && cpp) md.cpp_blocks.push_back(block);
      cpp = !fenced && line == "```cpp";
      fenced = !fenced;
      block.clear();
      continue;
    }
    if (fenced) {
      block += line + "\n";
      continue;
    }
    if (line.rfind("#", 0) == 0) md.anchors.push_back(anchor_of(line.substr(line.find_first_not_of('#') + 1)));
    for (std::sregex_iterator m(line.begin(), line.end(), link), end; m != end; ++m) md.links.push_back((*m)[1]);
  }
  return md;
}

// Every relative link in the README and docs/ names a file that exists, and every #anchor a heading of its page;
// every C++ block is one of the examples the suite compiles and runs.
TEST(Readme, EveryLinkResolvesAndEveryCppExampleIsCompiled) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(QKV_FIXTURES) / ".." / "..";
  std::vector<fs::path> pages = {root / "README.md"};
  for (const auto& entry : fs::directory_iterator(root / "docs"))
    if (entry.path().extension() == ".md") pages.push_back(entry.path());
  ASSERT_GE(pages.size(), 8u) << "docs/ holds the details the README links to";
  std::set<std::string> examples;
  for (const char* f : {"readme_example.cpp", "pictures_example.cpp", "chat_example.cpp", "batch_example.cpp"}) examples.insert(read_text((root / "tests" / f).string()));
  int links = 0;
  for (const fs::path& page : pages) {
    const Markdown md = parse_markdown(read_text(page.string()));
    for (const std::string& target : md.links) {
      if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0 || target.rfind("mailto:", 0) == 0) continue;
      ++links;
      const size_t hash = target.find('#');
      const std::string file = target.substr(0, hash), anchor = hash == std::string::npos ? "" : target.substr(hash + 1);
      const fs::path resolved = file.empty() ? page : page.parent_path() / file;
      ASSERT_TRUE(fs::exists(resolved)) << page.filename() << " links to " << target << ", which does not exist";
      if (!anchor.empty()) {
        const Markdown linked = parse_markdown(read_text(resolved.string()));
        EXPECT_NE(std::find(linked.anchors.begin(), linked.anchors.end(), anchor), linked.anchors.end())
            << page.filename() << " links to " << target << ": no heading of " << resolved.filename() << " has that anchor";
      }
    }
    for (const std::string& block : md.cpp_blocks)
      EXPECT_TRUE(examples.count(block)) << page.filename() << " shows C++ that no compiled example holds:\n" << block;
  }
  EXPECT_GE(links, 10);
}

}  // namespace
}  // namespace qkv::test
