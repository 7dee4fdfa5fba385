// `qkv quantize`: a model (a Hugging Face folder or a GGUF file) written as a GGUF file llama.cpp loads, its matrices
// in one of ggml's types (nn::quantize_to_gguf). Thin: options, a progress bar, a summary.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "commands.hpp"
#include "options.hpp"
#include "progress.hpp"
#include "qkv/io/file.hpp"
#include "qkv/nn/gguf_export.hpp"

namespace qkv::cli {

namespace {

struct QuantizeCommand {
  std::string checkpoint, out, type, name;
  bool overwrite = false;
};

int run_quantize(const QuantizeCommand& o) {
  const auto type = nn::gguf_file_type_from_name(o.type);
  if (!type) throw UsageError("--type " + o.type + " is not one of " + nn::gguf_file_type_names());
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!o.overwrite && fs::is_regular_file(o.out, ec))
    throw UsageError(o.out + " already exists (" + io::describe_file(o.out) + "); give --overwrite to replace it, or "
                     "another --out");
  nn::GgufExportOptions options;
  options.type = *type;
  options.name = o.name;
  // A bar for models that take a while (tens of MiB and up); a tiny model's file is written before it would show.
  ProgressLine line;
  bool drawn = false;
  const auto began = std::chrono::steady_clock::now();
  options.progress = [&](uint64_t done, uint64_t total) {
    if (total < (uint64_t{32} << 20)) return;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    const double left = done > 0 ? seconds * static_cast<double>(total - done) / static_cast<double>(done) : 0.0;
    line.draw(static_cast<int64_t>(done >> 10), static_cast<int64_t>(total >> 10),
              " " + mib(done) + " of " + mib(total) + "  ETA " + format_duration(left));
    drawn = true;
  };
  const nn::GgufExportReport r = nn::quantize_to_gguf(o.checkpoint, o.out, options);
  if (drawn) line.message("");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::string types;
  for (const auto& [name, count] : r.tensors_by_type) types += (types.empty() ? "" : ", ") + std::to_string(count) + " " + name;
  std::fprintf(stderr, "qkv quantize: %s → %s (%s, %s): %s (tensors %s, %.2f bits per parameter: %s); %.1f s\n",
               o.checkpoint.c_str(), o.out.c_str(), r.architecture.c_str(), nn::gguf_file_type_name(*type),
               mib(r.file_bytes).c_str(), mib(r.tensor_bytes).c_str(),
               r.parameters ? 8.0 * static_cast<double>(r.tensor_bytes) / static_cast<double>(r.parameters) : 0.0,
               types.c_str(), seconds);
  return 0;
}

}  // namespace

Runner setup_quantize(CLI::App& cmd, CommandContext&) {
  auto o = std::make_shared<QuantizeCommand>();
  // (or without the names, in this order: qkv quantize SRC OUT.gguf --type q4_k_m)
  cmd.add_option("--checkpoint,SRC", o->checkpoint,
                 "The model: a Hugging Face folder (with its tokenizer.json) or a GGUF file; --checkpoint may be left out")
      ->required()->transform(folder_path());
  cmd.add_option("--out,OUT", o->out,
                 "The GGUF file to write (written to a temporary beside it, renamed when whole); --out may be left out")
      ->required();
  cmd.add_option("--type", o->type, "The matrices' type: " + nn::gguf_file_type_names() + " (plain types: every matrix; "
                                    "q4_k_m, q5_k_m: llama.cpp's mixes; mxfp4_moe: a mixture of experts' experts MXFP4, the rest q8_0, as gpt-oss is "
                                    "published)")
      ->required();
  cmd.add_option("--name", o->name, "general.name (default: the folder's name, or the GGUF's own)");
  cmd.add_flag("--overwrite", o->overwrite, "Replace --out if it exists");
  return [o] { return run_quantize(*o); };
}

}  // namespace qkv::cli
