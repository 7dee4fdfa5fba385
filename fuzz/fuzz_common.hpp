// Shared by the libFuzzer harnesses (built with clang, ASan and UBSan by `scripts/run fuzz`): a scratch file
// for loaders that take a path, and the rule every harness checks — user input may raise a qkv::Error, never
// anything else (no other exception, no crash, no abort, no allocation past libFuzzer's -rss_limit_mb).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "qkv/core/error.hpp"

namespace qkv::fuzz {

// A scratch path (file or folder) removed with what it holds when the process exits.
struct RemovedAtExit {
  std::filesystem::path path;
  ~RemovedAtExit() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// A file holding the input, one per process (libFuzzer runs inputs one after another).
// The file is removed when the process exits.
inline std::string scratch_file(const uint8_t* data, size_t size, const char* suffix = "") {
  const std::string path = "/tmp/qkv_fuzz_" + std::to_string(getpid()) + suffix;
  static const RemovedAtExit remover{path};
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

// A scratch folder, one per process, "/tmp/qkv_fuzz_<name>_<pid>", removed with what it holds when the process exits.
inline std::filesystem::path scratch_dir(const char* name) {
  static const RemovedAtExit remover{std::string("/tmp/qkv_fuzz_") + name + "_" + std::to_string(getpid())};
  std::filesystem::create_directories(remover.path);
  return remover.path;
}

// Runs body; a qkv::Error is the expected outcome of bad input, anything else is a finding.
template <typename Body>
void expect_only_qkv_errors(Body&& body) {
  try {
    body();
  } catch (const qkv::Error&) {
  }
}

}  // namespace qkv::fuzz
