// One GPT training step, measured whole and op by op: tokens/s, model GFLOP/s and % of the machine's FMA peak
// (model FLOPs counted as PaLM and nanoGPT do: 6 × the parameters a token is multiplied by, i.e. without the
// embedding lookup tables, + 12 × layers × width × tokens, per token), peak RSS,
// and where the time goes (each op's forward and backward, the optimiser). tools/bench_gpt2_compare.py runs it
// beside PyTorch and llm.c.
//   qkv_train_profile [--vocab V] [--context T] [--emb C] [--heads H] [--layers L] [--batch B] [--steps N]
//                     [--threads N] [--drop P] [--tied] [--no-profile] [--no-ceiling] [--precision fp32|bf16|auto]
// With bf16 the step runs under PrecisionGuard(BF16) (qkv/core/precision.hpp) and its figures are read against both
// the fp32 FMA peak and the measured bf16 peak (VDPBF16PS chains, or AMX tiles where the CPU has them).
// After the step it times the step's GEMMs alone (--no-ceiling skips it): the speed the step could reach if every
// other op took no time, so "% of peak" can be read against what the BLAS gives on this machine.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "peak.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/core/profile.hpp"
#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/softmax.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

namespace {

// One matrix product a training step makes, `count` times per step.
struct GemmShape {
  bool trans_a, trans_b;
  int64_t M, N, K, count;
  bool head;  // the fused output head's (else a Linear layer's)
};

// Every GEMM of one step of model c over `rows` = B·T tokens, as the ops issue them: per layer the Q/K/V product
// and the three other Linear layers, each forward (x Wᵀ), dx (dy W) and dW (dyᵀ x); the head's three per block of
// rows (linear_cross_entropy's block size).
std::vector<GemmShape> step_gemms(const qkv::nn::GPTConfig& c, int64_t rows) {
  const int64_t C = c.emb_dim, L = c.n_layers, V = c.vocab_size;
  std::vector<GemmShape> shapes;
  for (const auto& [out, in] : {std::pair{3 * C, C}, std::pair{C, C}, std::pair{4 * C, C}, std::pair{C, 4 * C}}) {
    shapes.push_back({false, true, rows, out, in, L, false});   // y = x Wᵀ
    shapes.push_back({false, false, rows, in, out, L, false});  // dx = dy W
    shapes.push_back({true, false, out, in, rows, L, false});   // dW = dyᵀ x
  }
  const int64_t R = qkv::kernels::linear_cross_entropy_block_rows(rows, C, V);
  for (const auto& [block, count] : {std::pair{R, rows / R}, std::pair{rows % R, int64_t{1}}}) {
    if (block == 0 || count == 0) continue;
    shapes.push_back({false, true, block, V, C, count, true});   // logits = x Wᵀ
    shapes.push_back({false, false, block, C, V, count, true});  // dx = dlogits W
    shapes.push_back({true, false, V, C, block, count, true});   // dW += dlogitsᵀ x
  }
  return shapes;
}

struct GemmTime {
  double flops = 0, seconds = 0;
  double gflops() const { return seconds > 0 ? flops / seconds / 1e9 : 0.0; }
};

// The step's GEMMs alone: each shape timed on its own through qkv's gemm() on the step's threads (median of 3
// after a warm-up, operands reused, so warmer than in the step), weighted by its count. Nothing else runs, so a
// step cannot make its GEMMs faster than this: it is the ceiling that the step's "% of peak" is read against.
// With `onednn` (bf16 on AMX, where gemm_bf16 runs qkv's own tile loop), each run of a shape is followed by the same
// product through oneDNN's matmul alone, timed into the second pair: the two side by side, interleaved.
struct GemmTimes {
  GemmTime linear, head, linear_onednn, head_onednn;
};
GemmTimes measure_gemms(const std::vector<GemmShape>& shapes, qkv::Precision precision, bool onednn) {
  size_t a_size = 0, b_size = 0, c_size = 0;
  for (const GemmShape& g : shapes) {
    a_size = std::max(a_size, static_cast<size_t>(g.M * g.K));
    b_size = std::max(b_size, static_cast<size_t>(g.K * g.N));
    c_size = std::max(c_size, static_cast<size_t>(g.M * g.N));
  }
  qkv::Generator gen(7);
  std::vector<float> a(a_size), b(b_size), out(c_size);
  for (float& x : a) x = gen.uniform_float(-0.5f, 0.5f);
  for (float& x : b) x = gen.uniform_float(-0.5f, 0.5f);
  std::vector<uint16_t> a16(a_size), b16(b_size);
  qkv::kernels::f32_to_bf16(a.data(), a16.data(), static_cast<int64_t>(a_size));
  qkv::kernels::f32_to_bf16(b.data(), b16.data(), static_cast<int64_t>(b_size));
  GemmTimes times;
  for (const GemmShape& g : shapes) {
    const int64_t lda = g.trans_a ? g.M : g.K, ldb = g.trans_b ? g.K : g.N;
    std::vector<double> seconds, seconds_onednn;
    auto timed = [](auto&& product) {
      const auto began = std::chrono::steady_clock::now();
      product();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    };
    for (int run = 0; run < 4; ++run) {
      const double s = timed([&] {
        if (precision == qkv::Precision::BF16)
          qkv::kernels::gemm_bf16(g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, a16.data(), lda, b16.data(), ldb, 0.0f,
                                  out.data(), g.N);
        else
          qkv::kernels::gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, out.data(),
                             g.N);
      });
      const double o = !onednn ? 0.0 : timed([&] {
        qkv::kernels::gemm_bf16_onednn(g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, a16.data(), lda, b16.data(), ldb, 0.0f,
                                       out.data(), g.N);
      });
      if (run > 0) seconds.push_back(s), seconds_onednn.push_back(o);
    }
    std::sort(seconds.begin(), seconds.end());
    std::sort(seconds_onednn.begin(), seconds_onednn.end());
    const double flops = 2.0 * static_cast<double>(g.M) * g.N * g.K * g.count;
    GemmTime& part = g.head ? times.head : times.linear;
    part.flops += flops;
    part.seconds += seconds[1] * static_cast<double>(g.count);
    GemmTime& other = g.head ? times.head_onednn : times.linear_onednn;
    other.flops += flops;
    other.seconds += seconds_onednn[1] * static_cast<double>(g.count);
  }
  return times;
}

}  // namespace

int main(int argc, char** argv) {
  qkv::nn::GPTConfig c;
  c.drop_rate = 0.0;
  int64_t batch = 4, steps = 3;
  int threads = 0;
  bool profile = true, ceiling = true;
  std::string precision_text = "fp32";
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
    else if (a == "--no-ceiling") ceiling = false;
    else if (a == "--precision" && i + 1 < argc) precision_text = argv[++i];
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
  qkv::memory::cache_blocks_for_steps();  // as train::Trainer does, and after each step
  threads = qkv::num_threads();
  // Measured before the steps, after each and after them all, the highest reading kept: a VM's stolen time can only
  // lower one (a 2-thread reading of 377 GFLOP/s instead of ~467 once made a step look 74% efficient), and a
  // single core's turbo comes and goes (1-thread AVX2 readings of 110-129 GFLOP/s in one session).
  double peak = qkv::bench::measure_fma_peak(threads, 0.3);
  double bf16_peak = qkv::bench::measure_bf16_peak(threads, 0.3);
  qkv::Precision precision;
  try {
    precision = qkv::resolve_precision(precision_text, "--precision");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  const qkv::PrecisionGuard guard(precision);
  qkv::Generator gen(1);
  qkv::nn::Decoder model(c, gen);
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
    qkv::memory::cache_blocks_for_steps();
    optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    return loss.item();
  };
  step();  // the first step allocates every gradient and AdamW's state
  std::vector<double> seconds;
  for (int64_t s = 0; s < steps; ++s) {
    const auto began = std::chrono::steady_clock::now();
    step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
    peak = std::max(peak, qkv::bench::measure_fma_peak(threads, 0.15));
    bf16_peak = std::max(bf16_peak, qkv::bench::measure_bf16_peak(threads, 0.15));
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  peak = std::max(peak, qkv::bench::measure_fma_peak(threads, 0.3));
  const double params = static_cast<double>(model.parameter_count());
  // Model FLOPs count the parameters a token is multiplied by: not the lookup tables, i.e. the position embedding
  // and, when the head has its own weight, the token embedding (tied, it is the head's matrix and counts once), as
  // nanoGPT's MFU estimate does. Counting an untied token table, as 6 × all parameters would, credited the default
  // `qkv train` model (two 50,257 × 192 tables) with 1.8× the FLOPs its step does.
  const double lookup = static_cast<double>(c.context_length * c.emb_dim + (c.tie_weights ? 0 : c.vocab_size * c.emb_dim));
  const double flops_per_token = 6.0 * (params - lookup) + 12.0 * c.n_layers * c.emb_dim * T;
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
  std::printf("kernels: attention %s, GEMM %s\n", qkv::kernels::attention_isa(), qkv::kernels::gemm_backend());
  std::printf("precision: %s\n", qkv::describe_precision(precision, precision_text).c_str());
  if (bf16_peak > 0)
    std::printf("bf16 peak (%s) %.1f GFLOP/s = %.2f× the FMA peak; the step is %.1f%% of it\n",
                qkv::kernels::amx_bf16_ready() ? "AMX tiles" : "VDPBF16PS chains", bf16_peak, bf16_peak / peak, 100 * gflops / bf16_peak);
  if (profile) {
    const double total = qkv::bench::profiled_step(step);
    qkv::bench::print_op_profile(total, {{"clip + AdamW", optimizer_seconds}});
  }
  // The ceiling: the same GEMMs with nothing else running (see measure_gemms).
  double gemm_gflops = 0;
  if (ceiling) {
    const bool onednn = precision == qkv::Precision::BF16 && qkv::kernels::amx_bf16_ready() &&
                        std::string(qkv::kernels::gemm_bf16_backend()).find("oneDNN") != std::string::npos;
    const GemmTimes t = measure_gemms(step_gemms(c, tokens), precision, onednn);
    const GemmTime all{t.linear.flops + t.head.flops, t.linear.seconds + t.head.seconds};
    const GemmTime all_onednn{t.linear_onednn.flops + t.head_onednn.flops, t.linear_onednn.seconds + t.head_onednn.seconds};
    gemm_gflops = all.gflops();
    std::printf("\nthe step's GEMMs alone (each shape on its own through gemm(), %d thread(s), median of 3):\n", threads);
    for (const auto& [name, g] : {std::pair{"Linear layers", t.linear}, std::pair{"output head", t.head}, std::pair{"all", all}})
      std::printf("  %-14s %9.2f GFLOP %10.2f ms %7.1f GFLOP/s %6.1f%% of the FMA peak\n", name, g.flops / 1e9,
                  1e3 * g.seconds, g.gflops(), 100 * g.gflops() / peak);
    std::printf("  the step's model FLOP/s are %.0f%% of its GEMMs' alone\n", 100 * gflops / gemm_gflops);
    if (onednn) {
      std::printf("the same through oneDNN's matmul alone, each run after qkv's (gemm_bf16 runs qkv's AMX loop here):\n");
      for (const auto& [name, g, ours] : {std::tuple{"Linear layers", t.linear_onednn, t.linear},
                                          std::tuple{"output head", t.head_onednn, t.head}, std::tuple{"all", all_onednn, all}})
        std::printf("  %-14s %9.2f GFLOP %10.2f ms %7.1f GFLOP/s; qkv's loop takes %.2f× less time\n", name, g.flops / 1e9,
                    1e3 * g.seconds, g.gflops(), g.seconds / ours.seconds);
    }
  }
  std::printf("RESULT {\"tokens_per_second\": %.3f, \"gflops\": %.3f, \"peak_gflops\": %.3f, \"rss_mib\": %.1f, "
              "\"params\": %.0f, \"flops_per_token\": %.0f, \"gemm_gflops\": %.3f, "
              "\"attention_isa\": \"%s\", \"gemm_backend\": \"%s\", \"precision\": \"%s\", \"bf16_peak_gflops\": %.3f}\n",
              tokens_per_second, gflops, peak, rss_mib, params, flops_per_token, gemm_gflops,
              qkv::kernels::attention_isa(),
              precision == qkv::Precision::BF16 ? qkv::kernels::gemm_bf16_backend() : qkv::kernels::gemm_backend(),
              qkv::precision_name(precision), bf16_peak);
  return 0;
}
