// Shared by the libFuzzer harnesses (built with clang, ASan and UBSan by `scripts/run fuzz`): a scratch file
// for loaders that take a path, and the rule every harness checks — user input may raise a qkv::Error, never
// anything else (no other exception, no crash, no abort, no allocation past libFuzzer's -rss_limit_mb).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "qkv/core/error.hpp"

namespace qkv::fuzz {

// A file holding the input, one per process (libFuzzer runs inputs one after another).
inline std::string scratch_file(const uint8_t* data, size_t size, const char* suffix = "") {
  const std::string path = "/tmp/qkv_fuzz_" + std::to_string(getpid()) + suffix;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
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
