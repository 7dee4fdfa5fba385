// `qkv memory`: what attention variants cost in memory, printed from their settings (nn/footprint.hpp) — with no
// settings the book's chapter-4 bonus figures — or from a Hugging Face folder's config.json.
#include <fstream>
#include <ostream>
#include <sstream>

#include "commands.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::cli {

namespace {
int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "fp32") return 4;
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp8" || dtype == "int8") return 1;
  throw UsageError("--dtype " + printable(dtype) + ": use fp32, bf16, fp16, fp8 or int8");
}
}  // namespace

int run_memory(const MemoryCommand& options, std::ostream& out) {
  const int64_t bytes = dtype_bytes(options.dtype);
  if (!options.folder.empty()) {
    const std::string path = options.folder + "/config.json";
    std::ifstream in(path, std::ios::binary);
    if (!in) throw IoError("cannot read " + printable(path) + "; give a Hugging Face model folder");
    std::ostringstream text;
    text << in.rdbuf();
    const nn::DecoderConfig config = nn::decoder_config_from_hf(text.str(), path);
    out << nn::memory_report(config, options.settings.batch, options.settings.context, bytes);
    return 0;
  }
  if (!options.custom) {
    bool first = true;
    for (const nn::MemorySettings& s : nn::book_memory_settings()) {
      out << (first ? "" : "\n") << nn::memory_report(s);
      first = false;
    }
    return 0;
  }
  nn::MemorySettings s = options.settings;
  s.bytes_per_value = bytes;
  const size_t colon = options.swa_ratio.find(':');
  if (colon == std::string::npos) throw UsageError("--swa-ratio " + printable(options.swa_ratio) + ": write it a:b, e.g. 5:1");
  s.swa_layers = parse_int(options.swa_ratio.substr(0, colon), "--swa-ratio");
  s.full_layers = parse_int(options.swa_ratio.substr(colon + 1), "--swa-ratio");
  s.ffn_matrices = options.ffn == "gelu" ? 2 : 3;
  out << nn::memory_report(s);
  return 0;
}

}  // namespace qkv::cli
