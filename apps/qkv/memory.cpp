// `qkv memory`: what attention variants cost in memory, printed from their settings (nn/footprint.hpp) — with no
// settings the book's chapter-4 bonus figures — or from a Hugging Face folder's config.json.
#include <fstream>
#include <iostream>
#include <memory>
#include <ostream>
#include <sstream>

#include "commands.hpp"
#include "options.hpp"
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

Runner setup_memory(CLI::App& cmd, CommandContext&) {
  auto o = std::make_shared<MemoryCommand>();
  cmd.add_option("folder", o->folder, "A Hugging Face model folder (its config.json)")->transform(folder_path());
  nn::MemorySettings& ms = o->settings;
  const std::vector<CLI::Option*> settings = {
      cmd.add_option("--emb", ms.emb_dim, "Residual width (emb_dim)")->check(int_at_least(1)),
      cmd.add_option("--heads", ms.heads, "Query heads")->check(int_at_least(1)),
      cmd.add_option("--layers", ms.layers, "Layers")->check(int_at_least(1)),
      cmd.add_option("--kv-groups", ms.kv_groups, "GQA: query heads per K/V head")->check(int_at_least(1)),
      cmd.add_option("--latent", ms.latent_dim, "MLA: the latent cached per token and layer")->check(int_at_least(1)),
      cmd.add_option("--window", ms.window, "SWA: the sliding layers' window")->check(int_at_least(1)),
      cmd.add_option("--swa-ratio", o->swa_ratio, "SWA: a:b sliding to full layers (default 1:0, all sliding)"),
      cmd.add_option("--hidden", ms.hidden_dim, "MoE: the dense FFN's hidden width")->check(int_at_least(1)),
      cmd.add_option("--experts", ms.experts, "MoE: experts")->check(int_at_least(1)),
      cmd.add_option("--experts-per-token", ms.top_k, "MoE: experts per token (top-k)")->check(int_at_least(1)),
      cmd.add_option("--ffn", o->ffn, "MoE: swiglu (3 matrices) or gelu (2)")->check(one_of({"swiglu", "gelu"})),
  };
  cmd.add_option("--context", ms.context, "Tokens cached per sequence")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--batch", ms.batch, "Sequences")->capture_default_str()->check(int_at_least(1));
  cmd.add_option("--dtype", o->dtype, "Bytes a value: fp32, bf16, fp16, fp8, int8")->capture_default_str()
      ->check(one_of({"fp32", "bf16", "fp16", "fp8", "int8"}));
  return [o, settings] {
    for (const CLI::Option* option : settings) o->custom = o->custom || option->count() > 0;
    if (o->custom && !o->folder.empty()) throw UsageError("give a folder or settings (--emb, --heads, …), not both");
    return run_memory(*o, std::cout);
  };
}

}  // namespace qkv::cli
