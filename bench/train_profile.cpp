// One GPT training step, measured whole and op by op: tokens/s, model GFLOP/s and % of the machine's FMA peak
// (model FLOPs counted as llm.c and PaLM do: 6 × parameters + 12 × layers × width × tokens, per token), peak RSS,
// and where the time goes (each op's forward and backward, the optimiser). tools/bench_gpt2_compare.py runs it
// beside PyTorch and llm.c.
//   qkv_train_profile [--vocab V] [--context T] [--emb C] [--heads H] [--layers L] [--batch B] [--steps N]
//                     [--threads N] [--drop P] [--tied] [--no-profile]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "peak.hpp"
#include "qkv/core/profile.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

int main(int argc, char** argv) {
  qkv::nn::GPTConfig c;
  c.drop_rate = 0.0;
  int64_t batch = 4, steps = 3;
  int threads = 0;
  bool profile = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--vocab") c.vocab_size = next();
    else if (a == "--context") c.context_length = next();
    else if (a == "--emb") c.emb_dim = next();
    else if (a == "--heads") c.n_heads = next();
    else if (a == "--layers") c.n_layers = next();
    else if (a == "--batch") batch = next();
    else if (a == "--steps") steps = next();
    else if (a == "--threads") threads = static_cast<int>(next());
    else if (a == "--drop") c.drop_rate = std::atof(argv[++i]);
    else if (a == "--tied") c.tie_weights = true;
    else if (a == "--no-profile") profile = false;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (std::getenv("QKV_FTZ")) {  // experiment: flush denormals to zero on every thread
#pragma omp parallel
    _mm_setcsr(_mm_getcsr() | 0x8040);
  }
  if (threads > 0) qkv::set_num_threads(threads);
  qkv::memory::set_block_cache_limit(int64_t{2} << 30);  // as train::Trainer does
  threads = qkv::num_threads();
  // Measured before the steps and again after them, the higher reading kept: a VM's stolen time can only lower
  // one (a 2-thread reading of 377 GFLOP/s instead of ~467 once made a step look 74% efficient).
  double peak = qkv::bench::measure_fma_peak(threads, 0.3);
  qkv::Generator gen(1);
  qkv::nn::GPTModel model(c, gen);
  qkv::optim::AdamW optimizer(model.named_parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  const auto parameters = model.named_parameters();
  const int64_t T = c.context_length, tokens = batch * T;
  std::vector<int64_t> ids(static_cast<size_t>(tokens)), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>(gen.next_u32() % c.vocab_size);
    targets[i] = static_cast<int64_t>(gen.next_u32() % c.vocab_size);
  }
  double optimizer_seconds = 0;
  auto step = [&] {
    qkv::op_profile_mark();
    optimizer.zero_grad(/*set_to_none=*/true);  // as train::Trainer on one process
    const qkv::Tensor loss = model.loss(ids, batch, T, targets);
    loss.backward();
    const auto began = std::chrono::steady_clock::now();
    const double norm = qkv::train::gradient_norm(parameters);
    optimizer.set_gradient_scale(qkv::train::clip_coefficient(norm, 1.0));
    optimizer.step();
    optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    return loss.item();
  };
  step();  // the first step allocates every gradient and AdamW's state
  std::vector<double> seconds;
  for (int64_t s = 0; s < steps; ++s) {
    const auto began = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  peak = std::max(peak, qkv::bench::measure_fma_peak(threads, 0.3));
  const double params = static_cast<double>(model.parameter_count());
  const double flops_per_token = 6.0 * params + 12.0 * c.n_layers * c.emb_dim * T;
  const double tokens_per_second = tokens / median;
  const double gflops = flops_per_token * tokens_per_second / 1e9;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double rss_mib = usage.ru_maxrss / 1024.0;
  std::printf("qkv train step: %lld parameters, B=%lld T=%lld, %d thread(s): median %.3f s (%lld steps) → %.1f tok/s, "
              "%.1f GFLOP/s = %.1f%% of the FMA peak (%.1f GFLOP/s), peak RSS %.0f MiB (tensors at most %.0f MiB)\n",
              static_cast<long long>(params), static_cast<long long>(batch), static_cast<long long>(T), threads, median,
              static_cast<long long>(steps), tokens_per_second, gflops, 100 * gflops / peak, peak, rss_mib,
              static_cast<double>(qkv::memory::peak_bytes()) / (1 << 20));
  if (profile) {
    qkv::reset_op_profile();
    qkv::set_op_profiling(true);
    const auto began = std::chrono::steady_clock::now();
    step();
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    qkv::set_op_profiling(false);
    const auto profile = qkv::op_profile();
    std::vector<std::pair<std::string, qkv::OpTime>> rows(profile.begin(), profile.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a.second.forward_seconds + a.second.backward_seconds > b.second.forward_seconds + b.second.backward_seconds;
    });
    std::printf("\nwhere one step's %.3f s go (op: forward ms, backward ms, share of the step, calls):\n", total);
    double accounted = optimizer_seconds;
    for (const auto& [name, t] : rows) {
      accounted += t.forward_seconds + t.backward_seconds;
      std::printf("  %-22s %9.1f %9.1f %6.1f%% %6lld\n", name.c_str(), 1e3 * t.forward_seconds, 1e3 * t.backward_seconds,
                  100 * (t.forward_seconds + t.backward_seconds) / total, static_cast<long long>(t.calls));
    }
    std::printf("  %-22s %9.1f %9s %6.1f%%\n", "clip + AdamW", 1e3 * optimizer_seconds, "", 100 * optimizer_seconds / total);
    std::printf("  %-22s %9.1f %9s %6.1f%%\n", "other (loss, glue)", 1e3 * (total - accounted), "", 100 * (total - accounted) / total);
  }
  std::printf("RESULT {\"tokens_per_second\": %.3f, \"gflops\": %.3f, \"peak_gflops\": %.3f, \"rss_mib\": %.1f, "
              "\"params\": %.0f, \"flops_per_token\": %.0f}\n",
              tokens_per_second, gflops, peak, rss_mib, params, flops_per_token);
  return 0;
}
