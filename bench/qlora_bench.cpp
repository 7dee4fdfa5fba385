// LoRA training on a frozen base whose matrices stay quantized (QLoRA on a CPU), against the same LoRA step on the
// same base kept in bf16: issue 41's target is ≥ 1.5× the tokens/s on AVX2, and a peak memory within the quantized
// base + the adapters' parameters, gradients and AdamW moments + the activations.
//
//   qkv_qlora_bench [--shape qwen3-0.6b|llama-3.2-1b|…] [--weights q4_k,bf16] [--batch 4] [--tokens 128] [--steps 4]
//                   [--rank 16] [--threads 2] [--dir DIR] [--vary] [--no-block-cache] [--smoke]
//
// The folder (random weights, stored in bf16 as Hugging Face folders are) is made once in a child process. Each
// storage type then runs in a child of its own, so each peak RSS is that run's alone:
//   load_pretrained(folder, weights = TYPE): every matrix of the blocks converted while loading, as `qkv finetune
//     --weights TYPE` does, the embedding table (the tied head) float32;
//   rank-r adapters (alpha = r) on every Linear of the blocks, the base frozen;
//   `steps` AdamW steps of next-token cross-entropy over B × T random tokens (the first a warm-up); the median of the
//     others is the step time. Each step reuses the last one's memory blocks, as the trainer and `qkv finetune`
//     do; --no-block-cache measures steps whose activations are fresh pages. --vary gives each step its own length,
//     drawn from [T/2, T], as `finetune instruct`'s batches are (each padded to its longest entry); the rate is then
//     the tokens of the timed steps over their time.
// Each row also shows the median minor page faults a step took: memory that a step gets fresh from the system.
// A third child per type measures the activations: the same steps with one rank-1 adapter on the first block's query
// projection, so the backward keeps every block's activations and the adapters' state is ~nothing. The memory bound
// is then: RSS after loading (the base) + the activations' growth + the rank-r adapters' state (4 floats a parameter:
// value, gradient, two moments), with 10% slack for the allocator.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "hf_shapes.hpp"
#include "peak.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/train/optim.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// This process's resident memory now (VmRSS) or at its peak (VmHWM), MiB.
double status_mib(const char* key) { return std::max(0.0, qkv::bench::proc_status_kb(key)) / 1024.0; }

struct Settings {
  std::string shape = "qwen3-0.6b";
  int64_t batch = 4, tokens = 128, rank = 16;
  int steps = 4, threads = 2;
  bool smoke = false, block_cache = true, vary = false;
} settings;

// Minor page faults this process has taken so far.
int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// `--run TYPE [--probe]` (a child): prints "step_ms tokens_per_s faults rss_after_load_mib peak_mib state_mib loss0
// loss_last matrices".
int run_child(const fs::path& dir, const std::string& type_name, bool probe) {
  qkv::set_num_threads(settings.threads);
  qkv::nn::PretrainedOptions load;
  load.tokenizer = false;
  load.weights = qkv::kernels::weight_type_from_name(type_name);
  auto pretrained = qkv::nn::load_pretrained(dir.string(), load);
  auto* model = dynamic_cast<qkv::nn::Decoder*>(pretrained->model.get());
  if (!model) {
    std::fprintf(stderr, "%s: not a decoder\n", dir.c_str());
    return 1;
  }
  const double after_load = status_mib("VmRSS");
  std::string held;  // the storage types of the matrices, as loaded (a type ggml's blocks cannot hold stays float32)
  for (const auto& [name, p] : model->named_parameters()) {
    const std::string t = qkv::kernels::weight_type_name(p.weight_type());
    if (p.rank() == 2 && held.find(t) == std::string::npos) held += (held.empty() ? "" : "+") + t;
  }
  qkv::nn::set_trainable(*model, {});
  qkv::Generator gen(5);
  const qkv::nn::LoraOptions lora =
      probe ? qkv::nn::LoraOptions{.rank = 1, .alpha = 1, .targets = {model->block_prefix(0) + "*q_proj"}}
            : qkv::nn::LoraOptions{.rank = settings.rank, .alpha = static_cast<double>(settings.rank), .targets = {"all"}};
  qkv::nn::add_lora(*model, lora, gen);
  auto trainable = model->named_trainable_parameters();
  int64_t state_bytes = 0;
  for (const auto& [name, p] : trainable) state_bytes += 4 * p.numel() * 4;  // value, gradient, two moments
  qkv::optim::AdamW optimizer(trainable, {.lr = 1e-3, .weight_decay = 0.0});
  const int64_t B = settings.batch, T = settings.tokens, V = model->config.vocab_size;
  qkv::Generator data(11), lengths(13);
  std::vector<int64_t> rows(static_cast<size_t>(B * T));  // B rows of T random ids, the same every step
  for (auto& id : rows) id = static_cast<int64_t>(data.next_u32() % static_cast<uint32_t>(V));
  std::vector<double> times, faults;
  double first_loss = 0, last_loss = 0, timed_tokens = 0, timed_seconds = 0;
  // Steps reuse the last step's memory blocks, as train::Trainer and `qkv finetune` do (and after each step).
  // --no-block-cache: each step's activations are fresh pages.
  if (settings.block_cache) qkv::memory::cache_blocks_for_steps();
  const auto span = static_cast<uint32_t>(T - T / 2 + 1);  // --vary's lengths, T/2 to T
  for (int s = 0; s < settings.steps; ++s) {
    // This step's length: T, or with --vary one drawn from [T/2, T]; the first t_step ids of each row, with
    // next-token targets (the last position of each row has none).
    const int64_t t_step = settings.vary ? T / 2 + static_cast<int64_t>(lengths.next_u32() % span) : T;
    std::vector<int64_t> ids(static_cast<size_t>(B * t_step)), targets(ids.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < t_step; ++t) {
        ids[b * t_step + t] = rows[b * T + t];
        targets[b * t_step + t] = t + 1 < t_step ? rows[b * T + t + 1] : -100;
      }
    const int64_t faults0 = minor_faults();
    const auto t0 = Clock::now();
    optimizer.zero_grad(true);
    qkv::Tensor loss = model->loss(ids, B, t_step, targets);
    loss.backward();
    optimizer.step();
    const double seconds = since(t0);
    (s == 0 ? first_loss : last_loss) = loss.item();
    if (settings.block_cache) qkv::memory::cache_blocks_for_steps();
    if (s == 0) continue;  // the first step allocates and warms up
    times.push_back(seconds);
    faults.push_back(static_cast<double>(minor_faults() - faults0));
    timed_tokens += static_cast<double>(B * t_step);
    timed_seconds += seconds;
  }
  std::sort(times.begin(), times.end());
  std::sort(faults.begin(), faults.end());
  const double rate =
      settings.vary ? timed_tokens / timed_seconds : static_cast<double>(B * T) / times[times.size() / 2];
  std::printf("%.3f %.3f %.0f %.1f %.1f %.3f %.4f %.4f %s\n", 1e3 * times[times.size() / 2], rate, faults[faults.size() / 2],
              after_load, status_mib("VmHWM"), static_cast<double>(state_bytes) / (1 << 20), first_loss, last_loss,
              held.c_str());
  return 0;
}

struct Run {
  double step_ms = 0, rate = 0, faults = 0, loaded = 0, peak = 0, state = 0, loss0 = 0, loss1 = 0;
  std::string held;
  bool ok = false;
};

Run run_of(const char* self, const fs::path& dir, const std::string& type, bool probe) {
  const std::string command = std::string(self) + " --run " + type + (probe ? " --probe" : "") + " --dir " + dir.string() +
                              " --shape " + settings.shape + " --batch " + std::to_string(settings.batch) + " --tokens " +
                              std::to_string(settings.tokens) + " --steps " + std::to_string(settings.steps) +
                              " --rank " + std::to_string(settings.rank) + " --threads " +
                              std::to_string(settings.threads) + (settings.smoke ? " --smoke" : "") +
                              (settings.vary ? " --vary" : "") +
                              (settings.block_cache ? "" : " --no-block-cache");
  Run r;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return r;
  char held[256] = {};
  r.ok = std::fscanf(pipe, "%lf %lf %lf %lf %lf %lf %lf %lf %255s", &r.step_ms, &r.rate, &r.faults, &r.loaded, &r.peak,
                     &r.state, &r.loss0, &r.loss1, held) == 9;
  r.held = held;
  r.ok = pclose(pipe) == 0 && r.ok;
  return r;
}

int make_folder(const fs::path& dir) {
  const std::string json = qkv::bench::config_json(settings.shape, settings.smoke);
  if (json.empty()) {
    std::fprintf(stderr, "unknown --shape %s: %s\n", settings.shape.c_str(), qkv::bench::kShapeNames);
    return 2;
  }
  const auto t = Clock::now();
  const qkv::nn::DecoderConfig c = qkv::nn::decoder_config_from_hf(json, settings.shape + " config");
  qkv::Generator gen(7);
  qkv::nn::Decoder model(c, gen);
  qkv::nn::save_hf_folder(dir.string(), model, qkv::nn::HfDType::BF16);
  std::printf("made %s: %lld parameters in bf16, in %.1f s\n", dir.c_str(), static_cast<long long>(model.parameter_count()),
              since(t));
  return 0;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string run_type, dir_arg, types = "q4_k,bf16";
  bool probe = false, make = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--shape") settings.shape = next();
    else if (a == "--weights") types = next();
    else if (a == "--batch") settings.batch = std::atoll(next().c_str());
    else if (a == "--tokens") settings.tokens = std::atoll(next().c_str());
    else if (a == "--steps") settings.steps = std::atoi(next().c_str());
    else if (a == "--rank") settings.rank = std::atoll(next().c_str());
    else if (a == "--threads") settings.threads = std::atoi(next().c_str());
    else if (a == "--dir") dir_arg = next();
    else if (a == "--run") run_type = next();
    else if (a == "--probe") probe = true;
    else if (a == "--make") make = true;
    else if (a == "--smoke") settings.smoke = true;
    else if (a == "--no-block-cache") settings.block_cache = false;
    else if (a == "--vary") settings.vary = true;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: qkv_qlora_bench [--shape S] [--weights q4_k,bf16] [--batch B] "
                   "[--tokens T] [--steps N] [--rank R] [--threads N] [--dir DIR] [--vary] [--no-block-cache] [--smoke]\n", a.c_str());
      return 2;
    }
  }
  if (settings.smoke) settings.batch = std::min<int64_t>(settings.batch, 2), settings.tokens = std::min<int64_t>(settings.tokens, 16),
                      settings.steps = std::min(settings.steps, 3), settings.rank = std::min<int64_t>(settings.rank, 4);
  if (settings.batch < 1 || settings.tokens < 2 || settings.steps < 2 || settings.rank < 1 || settings.threads < 1) {
    std::fprintf(stderr, "--batch, --rank, --threads at least 1; --tokens and --steps at least 2\n");
    return 2;
  }
  const fs::path dir = dir_arg.empty() ? fs::temp_directory_path() / ("qkv_qlora_" + settings.shape + (settings.smoke ? "_smoke" : ""))
                                       : fs::path(dir_arg);
  try {
    if (make) return make_folder(dir);
    if (!run_type.empty()) return run_child(dir, run_type, probe);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv_qlora_bench: %s\n", e.what());
    return 1;
  }
  for (const std::string& t : split(types))
    if (!qkv::kernels::weight_type_from_name(t)) {
      std::fprintf(stderr, "--weights %s: not a storage type (f32, bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k)\n", t.c_str());
      return 2;
    }
  if (!fs::exists(dir / "config.json")) {
    const std::string command = std::string(argv[0]) + " --make --dir " + dir.string() + " --shape " + settings.shape +
                                (settings.smoke ? " --smoke" : "");
    if (std::system(command.c_str()) != 0) return 1;
  }
  std::printf("LoRA rank %lld (alpha = rank) on every Linear of the blocks of a %s-shaped decoder, base frozen; "
              "B %lld × T %s random tokens, %d AdamW steps (%s of the last %d), %d threads, block cache %s\n",
              static_cast<long long>(settings.rank), settings.smoke ? "smoke" : settings.shape.c_str(),
              static_cast<long long>(settings.batch),
              (settings.vary ? "from " + std::to_string(settings.tokens / 2) + " to " + std::to_string(settings.tokens) +
                                   " (--vary)"
                             : std::to_string(settings.tokens)).c_str(),
              settings.steps, settings.vary ? "tokens over time" : "median", settings.steps - 1, settings.threads,
              settings.block_cache ? "on" : "off (--no-block-cache)");
  std::printf("%-6s | %-11s | %9s %9s %12s | %10s %12s %11s %10s %9s | %s\n", "base", "matrices", "step ms", "tok/s",
              "faults/step", "base MiB", "activations", "adapters", "bound MiB", "peak MiB", "loss, first -> last step");
  std::optional<double> bf16_rate;
  std::vector<std::pair<std::string, double>> rates;
  for (const std::string& type : split(types)) {
    const Run r = run_of(argv[0], dir, type, false);
    const Run a = run_of(argv[0], dir, type, true);
    if (!r.ok || !a.ok) {
      std::printf("%-6s | failed (run it alone: %s --run %s --dir %s)\n", type.c_str(), argv[0], type.c_str(), dir.c_str());
      return 1;
    }
    const double activations = std::max(0.0, a.peak - a.loaded);
    const double bound = 1.1 * (r.loaded + activations + r.state);
    std::printf("%-6s | %-11s | %9.1f %9.1f %12.0f | %10.0f %12.0f %11.1f %10.0f %9.0f %s | %.3f -> %.3f\n", type.c_str(),
                r.held.c_str(), r.step_ms, r.rate, r.faults,
                r.loaded, activations, r.state, bound, r.peak, r.peak <= bound ? "✔" : "✘", r.loss0, r.loss1);
    rates.emplace_back(type, r.rate);
    if (type == "bf16") bf16_rate = r.rate;
  }
  if (bf16_rate)
    for (const auto& [type, rate] : rates)
      if (type != "bf16")
        std::printf("%s base ÷ bf16 base: %.2f× the tokens/s (target ≥ 1.5× on AVX2)\n", type.c_str(), rate / *bf16_rate);
  std::printf("bound: 1.1 × (the base's RSS after loading + the activations, measured with one rank-1 adapter on the first "
              "block + the adapters' parameters, gradients and AdamW moments)\n");
  return 0;
}
