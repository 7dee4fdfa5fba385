// Fine-tuning benchmarks: a GPT-2 124M-shaped model (the book's GPTModel, qkv_bias, tied head) with chapter 6's
// classification head, B 8 × T 120, AdamW steps in three recipes —
//   classify  the last block, the final norm and the head train (the book's recipe);
//   full      everything trains (the backward the frozen one is compared with);
//   lora      rank-16 adapters (alpha 16) on every Linear of the blocks, the head fully trained —
// each its forward, backward and step time (medians), GFLOP/s and % of the machine's FMA peak, then PyTorch 1.13 running
// the same recipes with the book's code (tools/bench_finetune_compare.py, at 1 and 2 threads, the better taken) side by
// side, and the peak RSS of LoRA training against frozen weights + activations + 1.2 × the adapter's state, each
// measured in a process of its own.
//   qkv_finetune_bench [--threads 2] [--steps 5] [--no-torch] [--smoke] [--precision fp32|bf16]
// (bf16: qkv's products in bf16 with float32 sums, beside PyTorch under CPU autocast)
//   qkv_finetune_bench --profile classify|cached|full|lora   where one step of that recipe spends its time, op by op
// OpenBLAS's kernel choice matters here (qkv's GEMMs and PyTorch's): run as
//   env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE qkv_finetune_bench
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "peak.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/core/profile.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/finetune.hpp"
#include "qkv/train/optim.hpp"

namespace {

struct Settings {
  int threads = 2, steps = 5;
  int64_t batch = 8, tokens = 120;
  bool torch = true, smoke = false;
  qkv::Precision precision = qkv::Precision::FP32;  // qkv's products (--precision bf16: autocast, the base in bf16)
};
Settings settings;

qkv::nn::GPTConfig model_config() {
  qkv::nn::GPTConfig c;  // GPT-2 124M: vocabulary 50257, context 1024, 768 wide, 12 heads, 12 layers
  c.qkv_bias = true;
  c.tie_weights = true;
  c.drop_rate = 0.0;
  if (settings.smoke) c.vocab_size = 512, c.context_length = 256, c.emb_dim = 64, c.n_heads = 4, c.n_layers = 2;
  return c;
}

struct Timing {
  double step_ms = 0, forward_ms = 0, backward_ms = 0, flops = 0;
  int64_t trainable = 0;
};
std::map<std::string, Timing> results;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The model, its head and the optimiser of one recipe.
struct Recipe {
  std::unique_ptr<qkv::nn::Decoder> model;
  std::unique_ptr<qkv::train::SequenceClassifier> classifier;
  std::unique_ptr<qkv::optim::AdamW> optimizer;
  std::vector<int64_t> ids, labels, positions;
  qkv::train::ClassificationSplit split;  // the batch as a split (for the prefix cache)
  std::vector<int64_t> rows;
};
Recipe make_recipe(const std::string& mode) {
  const qkv::nn::GPTConfig c = model_config();
  Recipe r;
  qkv::Generator gen(123);
  r.model = std::make_unique<qkv::nn::Decoder>(c, gen);
  r.model->eval();
  r.classifier = std::make_unique<qkv::train::SequenceClassifier>(*r.model, 2, gen);
  if (mode == "classify" || mode == "cached")
    qkv::nn::set_trainable(*r.model, {r.model->block_prefix(c.n_layers - 1), "final_norm"});
  if (mode == "cached") r.classifier->enable_prefix_cache(int64_t{1} << 30);
  if (mode == "lora") {
    qkv::nn::set_trainable(*r.model, {});
    qkv::nn::add_lora(*r.model, {.rank = 16, .alpha = 16, .targets = {"all"}}, gen, {"out_head"});
  }
  r.optimizer = std::make_unique<qkv::optim::AdamW>(r.classifier->trainable_parameters(),
                                                    qkv::optim::AdamWOptions{.lr = 5e-5, .weight_decay = 0.1});
  qkv::Generator data(1);
  for (int64_t i = 0; i < settings.batch * settings.tokens; ++i) r.ids.push_back(data.next_u32() % c.vocab_size);
  for (int64_t b = 0; b < settings.batch; ++b) r.labels.push_back(data.next_u32() % 2), r.positions.push_back(settings.tokens - 1);
  r.split.ids = r.ids;
  r.split.labels = r.labels;
  r.split.length = settings.tokens;
  r.split.last_real = r.positions;
  for (int64_t b = 0; b < settings.batch; ++b) r.rows.push_back(b);
  return r;
}

// FLOPs of one step: the blocks' GEMMs and causal attention forward (f for the whole stack), and what the backward
// computes. The frozen recipe's backward runs only the last block (its dX and dW: 2× its forward), and with the prefix
// cache its forward is that block's alone; LoRA's backward is every block's dX (1×; the adapters' own products are
// 2·r/C of it); the full one every block's dX and dW (2×).
double step_flops(const std::string& mode, const qkv::nn::GPTConfig& c) {
  const double n = static_cast<double>(settings.batch * settings.tokens), C = static_cast<double>(c.emb_dim);
  const double block = n * (2 * 12 * C * C + 2 * static_cast<double>(settings.tokens) * C);
  const double f = block * static_cast<double>(c.n_layers);
  if (mode == "classify") return f + 2 * block;
  if (mode == "cached") return 3 * block;
  if (mode == "lora") return 2 * f;
  return 3 * f;
}

void bm_recipe(benchmark::State& state, const std::string& mode) {
  omp_set_num_threads(settings.threads);
  const qkv::PrecisionGuard precision(settings.precision);
  qkv::memory::cache_blocks_for_steps();  // as the classification loop does, and after each step
  Recipe r = make_recipe(mode);
  std::vector<double> steps, forwards, backwards;
  auto step = [&] {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    r.optimizer->zero_grad(true);
    const qkv::Tensor loss = qkv::cross_entropy(r.classifier->batch_logits(r.split, r.rows, qkv::train::Pooling::Last), r.labels);
    const auto t1 = clock::now();
    loss.backward();
    const auto t2 = clock::now();
    r.optimizer->step();
    qkv::memory::cache_blocks_for_steps();
    const auto t3 = clock::now();
    forwards.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    backwards.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    steps.push_back(std::chrono::duration<double, std::milli>(t3 - t0).count());
    return loss.item();
  };
  step();  // warm-up: the first step allocates the gradients and AdamW's moments
  steps.clear(), forwards.clear(), backwards.clear();
  for (auto _ : state) benchmark::DoNotOptimize(step());
  const qkv::nn::GPTConfig c = model_config();
  Timing t{median(steps), median(forwards), median(backwards), step_flops(mode, c),
           r.model->trainable_parameter_count() + r.classifier->head.parameter_count()};
  results[mode] = t;
  state.counters["step_ms"] = t.step_ms;
  state.counters["fwd_ms"] = t.forward_ms;
  state.counters["bwd_ms"] = t.backward_ms;
  state.counters["GFLOP/s"] = t.flops / t.step_ms / 1e6;
}

// `--profile MODE`: one step of the recipe after a warm-up, op by op.
int profile_recipe(const std::string& mode) {
  omp_set_num_threads(settings.threads);
  const qkv::PrecisionGuard precision(settings.precision);
  qkv::memory::cache_blocks_for_steps();  // as the classification loop does, and after each step
  Recipe r = make_recipe(mode);
  double optimizer_seconds = 0;
  auto step = [&] {
    qkv::op_profile_mark();
    r.optimizer->zero_grad(true);
    qkv::cross_entropy(r.classifier->batch_logits(r.split, r.rows, qkv::train::Pooling::Last), r.labels).backward();
    const auto began = std::chrono::steady_clock::now();
    r.optimizer->step();
    qkv::memory::cache_blocks_for_steps();
    optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  step(), step();  // the gradients, AdamW's moments and (cached) the prefix are in place
  const double total = qkv::bench::profiled_step(step);
  std::printf("recipe %s, B %lld × T %lld, %d threads, GEMM kernel: %s", mode.c_str(), static_cast<long long>(settings.batch),
              static_cast<long long>(settings.tokens), settings.threads, qkv::kernels::gemm_backend());
  qkv::bench::print_op_profile(total, {{"AdamW", optimizer_seconds}});
  return 0;
}

// VmHWM of this process (the peak resident set), in MiB.
double peak_rss_mib() { return std::max(0.0, qkv::bench::proc_status_kb("VmHWM")) / 1024.0; }

// `--rss MODE` (a child process): the peak RSS of building the model and of training steps in that recipe.
//   weights  the model built and one forward without gradients;  pos_emb  only pos_emb trains, so the backward keeps
//   every block's activations as LoRA's does, with a 3 MiB gradient;  lora  the LoRA recipe.
int rss_child(const std::string& mode) {
  omp_set_num_threads(settings.threads);
  const qkv::PrecisionGuard precision(settings.precision);
  const qkv::nn::GPTConfig c = model_config();
  qkv::Generator gen(123);
  qkv::nn::Decoder model(c, gen);
  model.eval();
  qkv::train::SequenceClassifier classifier(model, 2, gen);
  std::vector<int64_t> ids, labels(static_cast<size_t>(settings.batch), 1), positions(static_cast<size_t>(settings.batch), settings.tokens - 1);
  for (int64_t i = 0; i < settings.batch * settings.tokens; ++i) ids.push_back(i % c.vocab_size);
  int64_t state_bytes = 0;
  if (mode == "weights") {
    qkv::NoGradGuard no_grad;
    benchmark::DoNotOptimize(classifier.logits(ids, settings.batch, settings.tokens, positions).data()[0]);
  } else {
    qkv::nn::set_trainable(model, mode == "pos_emb" ? std::vector<std::string>{"pos_emb"} : std::vector<std::string>{});
    if (mode == "lora") qkv::nn::add_lora(model, {.rank = 16, .alpha = 16}, gen, {"out_head"});
    classifier.head.weight.requires_grad_(mode == "lora");
    classifier.head.bias.requires_grad_(mode == "lora");
    auto trainable = classifier.trainable_parameters();
    for (const auto& [name, p] : trainable) state_bytes += 4 * p.numel() * 4;  // value, gradient, two moments
    qkv::optim::AdamW optimizer(trainable, {.lr = 5e-5, .weight_decay = 0.1});
    for (int s = 0; s < 2; ++s) {
      optimizer.zero_grad(true);
      qkv::cross_entropy(classifier.logits(ids, settings.batch, settings.tokens, positions), labels).backward();
      optimizer.step();
    }
  }
  std::printf("%.1f %.3f\n", peak_rss_mib(), static_cast<double>(state_bytes) / (1 << 20));
  return 0;
}

std::pair<double, double> rss_of(const char* self, const std::string& mode) {
  const std::string command = std::string(self) + " --rss " + mode + " --threads " + std::to_string(settings.threads) +
                              (settings.smoke ? " --smoke" : "") +
                              " --precision " + qkv::precision_name(settings.precision);
  FILE* pipe = popen(command.c_str(), "r");
  double peak = 0, state = 0;
  if (pipe) {
    if (std::fscanf(pipe, "%lf %lf", &peak, &state) != 2) peak = state = 0;
    pclose(pipe);
  }
  return {peak, state};
}

// PyTorch's numbers for a recipe: the best of its thread settings (its step time), from the book's code, under CPU
// autocast to bf16 when qkv runs in bf16. Debian's torch calls OpenBLAS's pthreads build, which runs on every core
// whatever torch.set_num_threads says: 1 intra-op thread leaves it both cores, 2 OpenMP threads spin against it
// unless told to sleep (OMP_WAIT_POLICY=PASSIVE, measured 1.9 s against 4.0–4.5 s for a LoRA step).
struct TorchRun {
  double step_ms = 0, forward_ms = 0, backward_ms = 0, rss = 0;
  std::string setting;
};
TorchRun torch_run(const std::string& mode) {
  TorchRun best;
  const std::pair<int, const char*> candidates[] = {{1, ""}, {2, ""}, {2, "OMP_WAIT_POLICY=PASSIVE "}};
  for (const auto& [threads, env] : candidates) {
    if (threads > settings.threads) continue;
    const std::string command = std::string("env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE ") + env + "/usr/bin/python3 " +
                                QKV_SOURCE_DIR + "/tools/bench_finetune_compare.py --mode " + mode + " --threads " +
                                std::to_string(threads) + " --steps " + std::to_string(settings.steps) + " --batch " +
                                std::to_string(settings.batch) + " --tokens " + std::to_string(settings.tokens) +
                                (settings.smoke ? " --tiny" : "") +
                                (settings.precision == qkv::Precision::BF16 ? " --autocast" : "") + " 2>/dev/null";
    FILE* pipe = popen(command.c_str(), "r");
    if (!pipe) continue;
    char line[1024] = {};
    const bool got = std::fgets(line, sizeof line, pipe) != nullptr;
    pclose(pipe);
    if (!got) continue;
    auto number = [&](const char* key) {  // "key": value
      const char* at = std::strstr(line, key);
      const char* colon = at ? std::strchr(at, ':') : nullptr;
      return colon ? std::atof(colon + 1) : 0.0;
    };
    TorchRun r{number("\"step_ms\""), number("\"forward_ms\""), number("\"backward_ms\""), number("\"peak_rss_mib\""),
               std::to_string(threads) + (*env ? " passive" : "")};
    if (r.step_ms > 0 && (best.step_ms == 0 || r.step_ms < best.step_ms)) best = r;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest = {argv[0]};
  std::string rss_mode, profile_mode;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) settings.threads = std::atoi(argv[++i]);
    else if (a == "--steps" && i + 1 < argc) settings.steps = std::atoi(argv[++i]);
    else if (a == "--rss" && i + 1 < argc) rss_mode = argv[++i];
    else if (a == "--profile" && i + 1 < argc) profile_mode = argv[++i];
    else if (a == "--no-torch") settings.torch = false;
    else if (a == "--precision" && i + 1 < argc) {
      try {
        settings.precision = qkv::resolve_precision(argv[++i], "--precision");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
      }
    }
    else if (a == "--smoke") settings.smoke = true, settings.steps = 1, settings.torch = std::getenv("QKV_BENCH_TORCH") != nullptr;
    else rest.push_back(argv[i]);
  }
  if (!rss_mode.empty()) return rss_child(rss_mode);
  if (!profile_mode.empty()) return profile_recipe(profile_mode);
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  for (const char* mode : {"classify", "cached", "full", "lora"})
    benchmark::RegisterBenchmark((std::string("finetune/") + mode).c_str(), [mode](benchmark::State& s) { bm_recipe(s, mode); })
        ->Iterations(settings.steps)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RunSpecifiedBenchmarks();

  const bool bf16 = settings.precision == qkv::Precision::BF16;
  const double seconds = settings.smoke ? 0.05 : 0.5;
  const double peak = bf16 ? qkv::bench::measure_bf16_peak(settings.threads, seconds) : qkv::bench::measure_fma_peak(settings.threads, seconds);
  std::printf("\nFine-tuning, GPT-2 124M-shaped, B %lld × T %lld, %d threads, %s, GEMM kernel: %s; %s peak %.0f GFLOP/s "
              "(%% peak: of it); PyTorch %s\n",
              static_cast<long long>(settings.batch), static_cast<long long>(settings.tokens), settings.threads,
              qkv::precision_name(settings.precision), bf16 ? qkv::kernels::gemm_bf16_backend() : qkv::kernels::gemm_backend(),
              bf16 ? (qkv::kernels::amx_bf16_ready() ? "bf16 (AMX tiles)" : "bf16 dot-product (VDPBF16PS)") : "FMA", peak, bf16 ? "under torch.autocast(\"cpu\", dtype=torch.bfloat16)" : "in float32");
  std::printf("%-9s %12s %9s %9s %9s %9s %8s | %9s %13s %8s\n", "recipe", "trainable", "step ms", "fwd ms", "bwd ms", "GFLOP/s",
              "% peak", "torch ms", "torch threads", "speed-up");
  std::map<std::string, TorchRun> torch;
  for (const char* mode : {"classify", "cached", "full", "lora"}) {
    const Timing& t = results[mode];
    if (settings.torch) torch[mode] = std::string(mode) == "cached" ? torch["classify"] : torch_run(mode);
    const TorchRun& p = torch[mode];
    std::printf("%-9s %12lld %9.1f %9.1f %9.1f %9.1f %7.1f%% | %9.1f %13s %7.2f×\n", mode, static_cast<long long>(t.trainable),
                t.step_ms, t.forward_ms, t.backward_ms, t.flops / t.step_ms / 1e6, 100 * t.flops / t.step_ms / 1e6 / peak,
                p.step_ms, p.setting.c_str(), p.step_ms > 0 ? p.step_ms / t.step_ms : 0.0);
  }
  const double epochs5 = (results["classify"].step_ms + 4 * results["cached"].step_ms) / 5;
  std::printf("the book's 5 epochs, per step (the first epoch fills the cache): %.1f ms", epochs5);
  if (settings.torch && torch["classify"].step_ms > 0) std::printf(", %.2f× PyTorch's", torch["classify"].step_ms / epochs5);
  std::printf("\n");
  const double ratio = results["classify"].backward_ms / std::max(1e-9, results["full"].backward_ms);
  std::printf("frozen recipe's backward / full backward: %.2f (target ≤ 0.4)\n", ratio);
  if (settings.torch && torch["classify"].backward_ms > 0)
    std::printf("  PyTorch's: %.2f\n", torch["classify"].backward_ms / std::max(1e-9, torch["full"].backward_ms));
  const auto [weights, none] = rss_of(argv[0], "weights");
  const auto [activations_run, pos_state] = rss_of(argv[0], "pos_emb");
  const auto [lora_peak, lora_state] = rss_of(argv[0], "lora");
  const double activations = activations_run - weights - pos_state;
  const double bound = weights + activations + 1.2 * lora_state;
  std::printf("LoRA peak RSS %.0f MiB; frozen weights %.0f + activations %.0f + 1.2 × adapter state %.1f = %.0f MiB: %s\n",
              lora_peak, weights, activations, lora_state, bound, lora_peak <= bound ? "within" : "over");
  if (settings.torch && torch["lora"].rss > 0) std::printf("  PyTorch's LoRA peak RSS %.0f MiB\n", torch["lora"].rss);
  (void)none;
  return 0;
}
