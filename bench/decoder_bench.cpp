// Today's decoders at the shapes people run: Qwen3-0.6B, Llama-3.2-1B and Gemma-3-270M, with random weights in float32,
// built from the models' own config.json. Measures, in one run:
//   - loading the Hugging Face folder against reading its bytes from a warm page cache (target ≤ 1.5×);
//   - generation with the KV cache (greedy, batch 1): tokens/s against the memory-bound limit, i.e. the machine's
//     measured read bandwidth ÷ the bytes one token reads (every weight matrix once, the KV cache so far);
//   - peak RSS against weights + KV cache (target ≤ 1.2×).
//   qkv_decoder_bench [--shape qwen3-0.6b|llama-3.2-1b|gemma-3-270m] [--dir DIR] [--tokens N] [--threads N] [--smoke]
//                     [--precision fp32|bf16] (bf16: matrices read and kept as bfloat16, half the bytes per token)
//                     [--stored f32|bf16] (the folder's dtype; a bf16 folder is loaded as it is stored, products
//                     widen bf16 inside the kernel, as `qkv generate` does) [--tokenizer DIR] (copy DIR's
//                     tokenizer.json and tokenizer_config.json into the folder: the load then includes the tokenizer,
//                     through load_pretrained, as an application's would)
// The folder (DIR, default /tmp/qkv_bench_<shape>[_bf16]) is made once, in a child process, so this process's peak RSS
// is the loaded model's alone.
#include <sys/resource.h>
#include <unistd.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "hf_shapes.hpp"
#include "peak.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/text/hf_tokenizer.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"

namespace {

namespace fs = std::filesystem;
using qkv::Tensor;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string config_json(const std::string& shape, bool smoke) {
  const std::string json = qkv::bench::config_json(shape, smoke);
  if (json.empty()) {
    std::fprintf(stderr, "unknown --shape %s: %s\n", shape.c_str(), qkv::bench::kShapeNames);
    std::exit(2);
  }
  return json;
}

// Reads every file of the folder once (to warm the page cache) and again, timed.
double read_folder_seconds(const fs::path& dir, int64_t* bytes) {
  std::vector<char> chunk(1 << 24);
  double seconds = 0.0;
  for (int pass = 0; pass < 2; ++pass) {
    *bytes = 0;
    const auto t = Clock::now();
    for (const auto& entry : fs::directory_iterator(dir)) {
      std::ifstream in(entry.path(), std::ios::binary);
      while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) *bytes += in.gcount();
    }
    seconds = since(t);
  }
  return seconds;
}

int make_folder(const std::string& shape, const fs::path& dir, bool smoke, bool bf16, const std::string& tokenizer) {
  const auto t = Clock::now();
  const qkv::nn::DecoderConfig c = qkv::nn::decoder_config_from_hf(config_json(shape, smoke), shape + " config");
  qkv::Generator gen(7);
  qkv::nn::Decoder model(c, gen);
  qkv::nn::save_hf_folder(dir.string(), model, bf16 ? qkv::nn::HfDType::BF16 : qkv::nn::HfDType::F32);
  if (!tokenizer.empty())
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(fs::path(tokenizer) / name, dir / name, fs::copy_options::overwrite_existing);
  std::printf("made %s: %lld parameters, random weights in %s%s, in %.1f s\n", dir.c_str(),
              static_cast<long long>(model.parameter_count()), bf16 ? "bf16" : "f32",
              tokenizer.empty() ? "" : (", the tokenizer of " + tokenizer).c_str(), since(t));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "qwen3-0.6b", dir_arg;
  int64_t tokens = 32;
  int threads = 2;
  bool smoke = false, make = false;
  std::string precision_text = "fp32", stored = "f32", tokenizer;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--shape") shape = next();
    else if (a == "--dir") dir_arg = next();
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--smoke") smoke = true;
    else if (a == "--make") make = true;
    else if (a == "--precision") precision_text = next();
    else if (a == "--stored") stored = next();
    else if (a == "--tokenizer") tokenizer = next();
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (stored != "f32" && stored != "bf16") {
    std::fprintf(stderr, "--stored %s: f32 or bf16\n", stored.c_str());
    return 2;
  }
  const bool stored_bf16 = stored == "bf16";
  const fs::path dir = dir_arg.empty() ? fs::temp_directory_path() / ("qkv_bench_" + (smoke ? "smoke" : shape) +
                                                                      (stored_bf16 ? "_bf16" : "") +
                                                                      (tokenizer.empty() ? "" : "_tokenizer"))
                                       : fs::path(dir_arg);
  if (make) return make_folder(shape, dir, smoke, stored_bf16, tokenizer);
  if (!fs::exists(dir / "config.json")) {
    std::vector<std::string> args = {argv[0], "--make", "--shape", shape, "--dir", dir.string(), "--stored", stored};
    if (smoke) args.push_back("--smoke");
    if (!tokenizer.empty()) args.insert(args.end(), {"--tokenizer", tokenizer});
    if (qkv::bench::run_child(args) != 0) return 1;
  }
  qkv::set_num_threads(threads);
  // Bandwidth first, on a buffer well beyond the caches but smaller than any of these models, so this process's
  // peak RSS stays the model's.
  const double bandwidth = qkv::bench::read_bandwidth(smoke ? (int64_t{64} << 20) : (int64_t{512} << 20));
  int64_t folder_bytes = 0;
  const double read_seconds = read_folder_seconds(dir, &folder_bytes);
  // Loaded twice: the first load's fresh pages may be this VM's first touch of that memory (measured below), the
  // second reuses pages the first gave back, as a long-running process would.
  // bf16: the matrices are read as bfloat16 (what `qkv generate --precision bf16` does): half the bytes to hold and to
  // read per token, and products in bf16.
  const qkv::Precision precision = qkv::resolve_precision(precision_text, "--precision");
  const qkv::PrecisionGuard guard(precision);
  const qkv::DType matrices = precision == qkv::Precision::BF16 ? qkv::DType::BF16 : qkv::DType::F32;
  const int64_t matrix_element = matrices == qkv::DType::BF16 || stored_bf16 ? 2 : 4;
  // What an application does: load_pretrained, the tokenizer with the weights when the folder has one, a bf16
  // folder's matrices kept as stored.
  qkv::nn::PretrainedOptions load;
  load.matrices = matrices;
  load.keep_stored = stored_bf16;
  load.tokenizer = fs::exists(dir / "tokenizer.json");
  auto t = Clock::now();
  auto pretrained = qkv::nn::load_pretrained(dir.string(), load);
  const double first_load_seconds = since(t);
  pretrained.reset();
  t = Clock::now();
  pretrained = qkv::nn::load_pretrained(dir.string(), load);
  const double load_seconds = since(t);
  qkv::nn::Decoder* model = pretrained->model.get();
  const auto& c = model->config;
  int64_t matrix_bytes = 0;  // what one token reads of the weights: every matrix, the head once (tied: the table)
  int64_t weight_bytes = 0;
  for (const auto& p : c.layout())
    if (p.shape.rank() == 2) matrix_bytes += p.shape.numel() * matrix_element;
  for (const auto& [name, p] : model->named_parameters()) weight_bytes += p.numel() * (p.rank() == 2 ? matrix_element : 4);
  std::vector<int64_t> prompt(16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int64_t>((i * 7919 + 11) % static_cast<size_t>(c.vocab_size));
  qkv::nn::SamplingOptions options;
  options.temperature = 0;
  options.max_new_tokens = tokens;
  std::vector<Clock::time_point> stamps;
  t = Clock::now();
  qkv::nn::generate(*model, prompt, options, [&](int64_t) { stamps.push_back(Clock::now()); });
  // Decoding speed from the first new token on (the prompt's prefill is its own cost).
  const double decode_seconds = std::chrono::duration<double>(stamps.back() - stamps.front()).count();
  const double per_token = decode_seconds / static_cast<double>(std::max<size_t>(stamps.size() - 1, 1));
  const int64_t positions = static_cast<int64_t>(prompt.size()) + tokens;
  const int64_t cache_bytes = model->make_cache(1, positions).bytes();
  // Per token: the matrices, and on average half the cache's final size of keys and values read.
  const double bytes_per_token = static_cast<double>(matrix_bytes) + 0.5 * static_cast<double>(cache_bytes);
  const double limit = bandwidth / bytes_per_token;
  // The head's matrix-vector product alone (1 × C by the V × C table): what streaming weights reaches here.
  double gemv_rate = 0.0;
  {
    qkv::NoGradGuard no_grad;
    const Tensor x = Tensor::ones({1, 1, c.hidden_size});
    for (int rep = 0; rep < 5; ++rep) {
      const auto g = Clock::now();
      const Tensor y = qkv::linear(x, model->head, Tensor());
      gemv_rate = std::max(gemv_rate, static_cast<double>(model->head.numel() * matrix_element) / since(g));
    }
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double rss = static_cast<double>(usage.ru_maxrss) * 1024.0;
  double tokenizer_seconds = 0.0;  // the tokenizer's share of the load, alone (after the peak RSS is read)
  if (load.tokenizer) {
    t = Clock::now();
    const auto tokenizer_alone = qkv::text::HfTokenizer::from_folder(dir.string());
    tokenizer_seconds = since(t);
  }

  std::printf("\n%s (%s family), %lld parameters, %d threads, stored %s, matrices in %s\n", smoke ? "smoke" : shape.c_str(),
              c.family->name.c_str(), static_cast<long long>(model->parameter_count()), threads, stored.c_str(),
              stored_bf16 && matrices == qkv::DType::F32 ? "bf16 as stored (products widen them)" : qkv::dtype_name(matrices));
  std::printf("  load      %.2f s for %.2f GB%s; reading those bytes from the warm page cache %.2f s: %.2fx (target <= 1.5x);"
              " first load %.2f s (%.2fx)\n", load_seconds, static_cast<double>(folder_bytes) / 1e9,
              pretrained->tokenizer ? (", tokenizer included (" + std::to_string(static_cast<int>(tokenizer_seconds * 1e3)) + " ms of it)").c_str() : "",
              read_seconds, load_seconds / read_seconds, first_load_seconds, first_load_seconds / read_seconds);
  std::printf("  bandwidth %.1f GB/s measured (read, %d threads); %.3f GB read per token -> limit %.1f tok/s\n",
              bandwidth / 1e9, threads, bytes_per_token / 1e9, limit);
  std::printf("  generate  %.1f tok/s (%.1f ms/token over %zu tokens, %.1f GB/s): %.0f%% of the memory-bound limit (target >= 80%%)\n",
              1.0 / per_token, per_token * 1e3, stamps.size(), bytes_per_token / per_token / 1e9,
              100.0 * (1.0 / per_token) / limit);
  std::printf("            the head's matrix-vector product alone streams %.1f GB/s (%.0f%% of the read bandwidth); "
              "generation reaches %.0f%% of that rate\n", gemv_rate / 1e9, 100.0 * gemv_rate / bandwidth,
              100.0 * bytes_per_token / per_token / gemv_rate);
  std::printf("  memory    peak RSS %.2f GB; weights %.2f GB + KV cache %.1f MiB: %.2fx (target <= 1.2x); the folder's "
              "bytes + KV cache: %.2fx (target <= 1.15x)\n", rss / 1e9,
              static_cast<double>(weight_bytes) / 1e9, static_cast<double>(cache_bytes) / (1 << 20),
              rss / static_cast<double>(weight_bytes + cache_bytes), rss / static_cast<double>(folder_bytes + cache_bytes));
  return 0;
}
