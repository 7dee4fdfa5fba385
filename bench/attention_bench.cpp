// Attention benchmarks: the fused kernel against the plain materialised path, in one run, with GFLOP/s,
// % of this machine's FMA peak (measured here, first, by small AVX2 and, where the build has it, AVX-512 FMA loops), the ratio to the plain
// path and the peak extra memory. `--smoke` runs every benchmark once on tiny shapes (CI); `--cold-allocations`
// leaves the block cache off, so each call also pays for fresh pages.
//
// FLOPs: forward 4·B·H·T²·D (QKᵀ and PV), half of it causal; backward twice the forward.
// Compare with PyTorch in the same session: tools/bench_compare.py.
#include <benchmark/benchmark.h>

#include "peak.hpp"
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "qkv/kernels.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::Tensor;

struct Shape4 {
  int64_t B, H, T, D;
  std::string str() const {
    return "B" + std::to_string(B) + "H" + std::to_string(H) + "T" + std::to_string(T) + "D" + std::to_string(D);
  }
};

std::map<int, double> g_peak_gflops;  // threads → measured FMA peak: the higher of a reading before and after
std::map<int, double> g_bf16_peak_gflops;  // threads → measured bf16 peak: VDPBF16PS or AMX, the faster (0 where the CPU has neither)
double g_peak_seconds = 0.3;           // per reading


// qkv runs OpenBLAS single-threaded and splits every GEMM between OpenMP threads itself.
void set_threads(int threads) { omp_set_num_threads(threads); }

double attention_flops(const Shape4& s, bool causal, bool backward) {
  const double forward = 4.0 * s.B * s.H * static_cast<double>(s.T) * s.T * s.D * (causal ? 0.5 : 1.0);
  return backward ? 3.0 * forward : forward;
}

void report(benchmark::State& state, double flops, int64_t extra_bytes) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["extra_MiB"] = static_cast<double>(extra_bytes) / (1024.0 * 1024.0);
}

// Fused: the autograd op on (B, T, H·D), as MultiHeadAttention calls it.
void bm_fused(benchmark::State& state, Shape4 s, bool causal, bool backward, int threads, bool bf16) {
  set_threads(threads);
  // bf16: the op under autocast, so the kernel's products take bf16 operands (the backward runs as recorded)
  const qkv::PrecisionGuard precision(bf16 ? qkv::Precision::BF16 : qkv::Precision::FP32);
  qkv::Generator gen(1);
  const qkv::Shape shape{s.B, s.T, s.H * s.D};
  Tensor q = gen.randn(shape), k = gen.randn(shape), v = gen.randn(shape);
  const Tensor d_o = gen.randn(shape);
  if (backward) q.requires_grad_(), k.requires_grad_(), v.requires_grad_();
  qkv::AttentionConfig config;
  config.num_heads = s.H;
  config.causal = causal;
  int64_t extra = 0;
  for (auto _ : state) {
    const int64_t base = qkv::memory::bytes_in_use();
    qkv::memory::reset_peak();
    Tensor out = qkv::scaled_dot_product_attention(q, k, v, config);
    if (backward) out.backward(d_o);
    benchmark::DoNotOptimize(out.data());
    extra = qkv::memory::peak_bytes() - base;
    if (backward) q.set_grad(Tensor()), k.set_grad(Tensor()), v.set_grad(Tensor());
  }
  report(state, attention_flops(s, causal, backward), extra);
}

// Plain: the book's composition on (B, H, T, D): QKᵀ, mask, softmax, ·V, each op materialised.
void bm_plain(benchmark::State& state, Shape4 s, bool causal, bool backward, int threads) {
  set_threads(threads);
  qkv::Generator gen(1);
  const qkv::Shape shape{s.B, s.H, s.T, s.D};
  Tensor q = gen.randn(shape), k = gen.randn(shape), v = gen.randn(shape);
  const Tensor d_o = gen.randn(shape);
  if (backward) q.requires_grad_(), k.requires_grad_(), v.requires_grad_();
  const Tensor mask = qkv::causal_mask(s.T);
  int64_t extra = 0;
  for (auto _ : state) {
    const int64_t base = qkv::memory::bytes_in_use();
    qkv::memory::reset_peak();
    Tensor scores = qkv::matmul(q, qkv::transpose(k, -2, -1));
    if (causal) scores = qkv::masked_fill(scores, mask, -INFINITY);
    Tensor out = qkv::matmul(qkv::softmax(qkv::div(scores, std::sqrt(static_cast<float>(s.D)))), v);
    if (backward) out.backward(d_o);
    benchmark::DoNotOptimize(out.data());
    extra = qkv::memory::peak_bytes() - base;
    if (backward) q.set_grad(Tensor()), k.set_grad(Tensor()), v.set_grad(Tensor());
  }
  report(state, attention_flops(s, causal, backward), extra);
}

// MultiHeadAttention(768 → 768, 12 heads, causal), forward + backward through every parameter and x.
void bm_mha(benchmark::State& state, int64_t B, int64_t T, int64_t C, int64_t H, qkv::nn::AttentionPath path,
            int threads) {
  set_threads(threads);
  qkv::Generator gen(2);
  qkv::nn::MultiHeadAttention mha(C, C, T, 0.0, H, false, gen);
  mha.set_attention_path(path);
  Tensor x = gen.randn({B, T, C}).requires_grad_();
  const Tensor g = gen.randn({B, T, C});
  const double linear_flops = 2.0 * B * T * C * C * 4;
  const double flops = 3.0 * (linear_flops + 4.0 * B * H * static_cast<double>(T) * T * (C / H) * 0.5);
  int64_t extra = 0;
  for (auto _ : state) {
    const int64_t base = qkv::memory::bytes_in_use();
    qkv::memory::reset_peak();
    mha.zero_grad();
    Tensor out = mha(x);
    out.backward(g);
    benchmark::DoNotOptimize(out.data());
    extra = qkv::memory::peak_bytes() - base;
    x.set_grad(Tensor());
  }
  report(state, flops, extra);
}

// The decoder variants: grouped-query K/V heads, a sliding window, RoPE applied to q and k first (as a Llama-style
// layer does, its own kernel pair), all through the same op. FLOPs counted as the causal mask leaves them: with a
// window W, each row sees min(i + 1, W) keys.
void bm_variant(benchmark::State& state, Shape4 s, int64_t kv_heads, int64_t window, bool with_rope, bool backward,
                int threads) {
  set_threads(threads);
  qkv::Generator gen(1);
  Tensor q = gen.randn({s.B, s.T, s.H * s.D}), k = gen.randn({s.B, s.T, kv_heads * s.D}), v = gen.randn({s.B, s.T, kv_heads * s.D});
  const Tensor d_o = gen.randn({s.B, s.T, s.H * s.D});
  if (backward) q.requires_grad_(), k.requires_grad_(), v.requires_grad_();
  qkv::AttentionConfig config;
  config.num_heads = s.H;
  config.causal = true;
  config.window = window;
  const auto table = std::make_shared<const qkv::kernels::RopeTable>(qkv::kernels::RopeTable::make(
      qkv::kernels::RopeFrequencies{.theta = 500000.0}.inverse_frequencies(s.D), s.T));
  for (auto _ : state) {
    Tensor qr = q, kr = k;
    if (with_rope) {
      qr = qkv::rope(q, table, qkv::kernels::RopeLayout::RotateHalf, s.H);
      kr = qkv::rope(k, table, qkv::kernels::RopeLayout::RotateHalf, kv_heads);
    }
    Tensor out = qkv::scaled_dot_product_attention(qr, kr, v, config);
    if (backward) out.backward(d_o);
    benchmark::DoNotOptimize(out.data());
    if (backward) q.set_grad(Tensor()), k.set_grad(Tensor()), v.set_grad(Tensor());
  }
  double pairs = 0;  // visible (query, key) pairs per head
  for (int64_t i = 0; i < s.T; ++i) pairs += static_cast<double>(window > 0 ? std::min(i + 1, window) : i + 1);
  const double forward = 4.0 * s.B * s.H * pairs * s.D;
  report(state, backward ? 3.0 * forward : forward, 0);
}

// Generation's attention: one query row per head over a paged KV cache (16-position pages, as a session's) of each
// cache type (f32; f16, bf16 and q8_0, read in place), every layer of a Qwen3-0.6B-shaped model (16 query heads on 8 K/V
// heads of 128) per iteration: what a token reads of the cache. Reported against the read bandwidth measured on the
// same threads before the first of them.
std::map<int, double> g_read_bandwidth;          // threads → bytes/s
std::map<std::string, double> g_decode_bytes;    // benchmark name → bytes of keys and values one iteration reads
void bm_decode(benchmark::State& state, qkv::kernels::WeightType type, int64_t layers, int64_t H, int64_t H_kv, int64_t D,
               int64_t Tk, int threads, int64_t bandwidth_bytes) {
  set_threads(threads);
  if (!g_read_bandwidth.count(threads)) g_read_bandwidth[threads] = qkv::bench::read_bandwidth(bandwidth_bytes);
  constexpr int64_t kPage = 16;
  const int64_t row = H_kv * D, row_bytes = qkv::kernels::row_bytes(type, row);
  qkv::Generator gen(3);
  std::vector<std::vector<unsigned char>> blocks;  // each page's keys and values: 16 rows of H_kv·D values
  std::vector<std::vector<qkv::kernels::KVPage>> pages(static_cast<size_t>(layers));
  auto page = [&] {
    const Tensor x = gen.randn({kPage, row});
    std::vector<unsigned char> bytes(static_cast<size_t>(kPage * row_bytes));
    qkv::kernels::quantize_rows(type, x.data(), bytes.data(), kPage, row);
    blocks.push_back(std::move(bytes));
    return blocks.back().data();
  };
  for (auto& layer : pages)
    for (int64_t t = 0; t < Tk; t += kPage) {
      const unsigned char* keys = page();
      layer.push_back({keys, page(), std::min(kPage, Tk - t)});
    }
  const Tensor q = gen.randn({H * D});
  std::vector<float> o(static_cast<size_t>(H * D));
  qkv::kernels::AttentionDims dims;
  dims.H = H, dims.H_kv = H_kv, dims.D = D, dims.Tq = 1, dims.Tk = Tk;
  for (auto _ : state)
    for (const auto& layer : pages) {
      const qkv::kernels::KVPages kv{layer, type, row_bytes};
      qkv::kernels::attention_decode(dims, {}, q.data(), kv, o.data());
      benchmark::DoNotOptimize(o.data());
    }
  report(state, 4.0 * static_cast<double>(layers * H * Tk * D), 0);
}

// The attention weights of one head, recomputed from q, k and the forward's log-sum-exp (what qkv attention
// draws), against that head's share of the fused forward pass (reported as head_share/…: the whole forward / H).
// Causal q, k, v in the projections' (B, T, H·D) layout and the config that reads them.
struct CausalInputs {
  Tensor q, k, v;
  qkv::AttentionConfig config;
  explicit CausalInputs(Shape4 s) {
    qkv::Generator gen(1);
    const qkv::Shape shape{s.B, s.T, s.H * s.D};
    q = gen.randn(shape), k = gen.randn(shape), v = gen.randn(shape);
    config.num_heads = s.H;
    config.causal = true;
  }
};

void bm_maps(benchmark::State& state, Shape4 s, int threads) {
  set_threads(threads);
  CausalInputs in(s);
  Tensor lse;
  in.config.lse = &lse;
  qkv::scaled_dot_product_attention(in.q, in.k, in.v, in.config);
  for (auto _ : state) {
    Tensor w = qkv::attention_weights(in.q, in.k, lse, in.config, 0, 0);
    benchmark::DoNotOptimize(w.data());
  }
  report(state, 2.0 * s.T * s.T * s.D * 0.5, 0);
}

void bm_head_share(benchmark::State& state, Shape4 s, int threads) {
  set_threads(threads);
  const CausalInputs in(s);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    Tensor out = qkv::scaled_dot_product_attention(in.q, in.k, in.v, in.config);
    benchmark::DoNotOptimize(out.data());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / s.H);
  }
  report(state, attention_flops(s, true, false) / s.H, 0);
}

// Collects medians (or single runs in smoke mode) and prints the comparison table at the end.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  struct Result {
    double ms = 0, gflops = 0, extra_mib = 0;
  };
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "median") continue;
      std::string name = run.benchmark_name();
      for (const char* suffix : {"_median", "/min_time:", "/iterations:", "/repeats:", "/real_time"}) {
        const size_t at = name.find(suffix);
        if (at != std::string::npos) name.erase(at);
      }
      Result r;
      r.ms = run.GetAdjustedRealTime() * (run.time_unit == benchmark::kMillisecond ? 1.0 : 1e-6);
      if (auto it = run.counters.find("GFLOP/s"); it != run.counters.end()) r.gflops = it->second.value;
      if (auto it = run.counters.find("extra_MiB"); it != run.counters.end()) r.extra_mib = it->second.value;
      results_[name] = r;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    // Read again now: a VM's stolen time can only lower a reading, so the higher one is the machine's.
    for (auto& [threads, peak] : g_peak_gflops) peak = std::max(peak, qkv::bench::measure_fma_peak(threads, g_peak_seconds));
    std::printf("\nSummary (medians): fused vs plain, same run. FMA peak measured here: 1 thread %.1f GFLOP/s, "
                "2 threads %.1f GFLOP/s. Kernel ISA: %s; plain path's GEMM: %s\n",
                g_peak_gflops[1], g_peak_gflops[2], qkv::kernels::attention_isa(), qkv::kernels::gemm_backend());
    std::printf("%-44s %9s %9s %7s %9s %8s %10s %10s\n", "benchmark", "fused ms", "GFLOP/s", "% peak", "plain ms",
                "speedup", "fused MiB", "plain MiB");
    for (const auto& [name, maps] : results_) {
      if (name.rfind("maps/", 0) != 0) continue;
      const auto share = results_.find("head_share/" + name.substr(5));
      if (share == results_.end()) continue;
      std::printf("recomputing one head's weights %-30s %8.3f ms; that head's share of the fused forward %8.3f ms: %.2fx\n",
                  name.substr(5).c_str(), maps.ms, share->second.ms, maps.ms / share->second.ms);
    }
    std::printf("\nGeneration's attention, one query row per head over a paged KV cache of each type (medians):\n");
    for (const auto& [name, r] : results_) {
      const auto bytes = g_decode_bytes.find(name);
      if (bytes == g_decode_bytes.end()) continue;
      const int threads = name.find("threads:2") != std::string::npos ? 2 : 1;
      const double rate = bytes->second / (r.ms / 1e3);
      std::printf("  %-52s %8.3f ms, %6.1f GB/s of keys and values (%3.0f%% of the read bandwidth, %.1f GB/s)\n",
                  name.c_str(), r.ms, rate / 1e9, 100.0 * rate / g_read_bandwidth[threads], g_read_bandwidth[threads] / 1e9);
    }
    // The decoder variants, each against its baseline in this run.
    std::printf("\nDecoder variants (medians, same run):\n");
    for (const auto& [name, r] : results_) {
      const int threads = name.find("threads:2") != std::string::npos ? 2 : 1;
      const double peak = g_peak_gflops[threads];
      auto partner = [&](const std::string& from, const std::string& to) -> const Result* {
        std::string other = name;
        const size_t at = other.find(from);
        if (at == std::string::npos) return nullptr;
        other.replace(at, from.size(), to);
        const auto it = results_.find(other);
        return it == results_.end() ? nullptr : &it->second;
      };
      if (name.rfind("gqa/", 0) == 0 && name.find("/kv4/") != std::string::npos) {
        if (const Result* mha = partner("/kv4/", "/kvH/"))
          std::printf("  %-52s GQA %7.2f ms %5.1f%% of peak; MHA %7.2f ms %5.1f%%\n", name.c_str(), r.ms,
                      100.0 * r.gflops / peak, mha->ms, 100.0 * mha->gflops / peak);
      } else if (name.rfind("window/", 0) == 0 && name.find("/W512/") != std::string::npos) {
        if (const Result* full = partner("/W512/", "/W0/"))
          std::printf("  %-52s window %8.2f ms, full causal %8.2f ms: %.2fx faster\n", name.c_str(), r.ms, full->ms,
                      full->ms / r.ms);
      } else if (name.rfind("rope/", 0) == 0 && name.find("/on/") != std::string::npos) {
        if (const Result* off = partner("/on/", "/off/"))
          std::printf("  %-52s with RoPE %7.2f ms, without %7.2f ms: +%.1f%%\n", name.c_str(), r.ms, off->ms,
                      100.0 * (r.ms / off->ms - 1.0));
      }
    }
    std::printf("\n");
    for (const auto& [name, fused] : results_) {
      if (name.rfind("fused/", 0) != 0) continue;
      const std::string rest = name.substr(6);
      const auto plain = results_.find("plain/" + rest);
      const int threads = rest.find("threads:2") != std::string::npos ? 2 : 1;
      const double peak = g_peak_gflops[threads];
      std::printf("%-44s %9.2f %9.1f %6.1f%% %9.2f %7.2fx %10.1f %10.1f\n", rest.c_str(), fused.ms, fused.gflops,
                  peak > 0 ? 100.0 * fused.gflops / peak : 0.0, plain != results_.end() ? plain->second.ms : 0.0,
                  plain != results_.end() ? plain->second.ms / fused.ms : 0.0, fused.extra_mib,
                  plain != results_.end() ? plain->second.extra_mib : 0.0);
    }
    // bf16 products against float32's, same shapes, same run
    std::printf("\nbf16 products (%s) vs float32, fused kernel, same run:%s\n", qkv::kernels::attention_bf16_products(),
                qkv::kernels::attention_bf16_available() ? "" : " not run (this CPU or build has no AVX512_BF16)");
    for (const auto& [name, half] : results_) {
      if (name.rfind("bf16/", 0) != 0) continue;
      const std::string rest = name.substr(5);
      const auto fp32 = results_.find("fused/" + rest);
      if (fp32 == results_.end()) continue;
      const int threads = rest.find("threads:2") != std::string::npos ? 2 : 1;
      std::printf("  %-44s bf16 %8.2f ms (%5.1f%% of the FMA peak, %5.1f%% of the bf16 peak); fp32 %8.2f ms: %.2fx\n",
                  rest.c_str(), half.ms, 100.0 * half.gflops / g_peak_gflops[threads],
                  g_bf16_peak_gflops[threads] > 0 ? 100.0 * half.gflops / g_bf16_peak_gflops[threads] : 0.0,
                  fp32->second.ms, fp32->second.ms / half.ms);
    }
  }

 private:
  std::map<std::string, Result> results_;
};

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false, console = true, cold = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) smoke = true;
    else if (std::strcmp(argv[i], "--cold-allocations") == 0) cold = true;
    else args.push_back(argv[i]);
    if (std::strncmp(argv[i], "--benchmark_format=", 19) == 0 && std::strcmp(argv[i], "--benchmark_format=console") != 0)
      console = false;  // JSON or CSV for tools: Google Benchmark's own reporter, no summary table
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  // Repeated calls reuse their large blocks, as in training (train::Trainer sets the same cache); without it every
  // iteration's outputs and gradients are fresh pages the kernel must zero (8–10% of a causal fwd+bwd at
  // (4, 12, 1024, 64)). --cold-allocations measures that cost too.
  if (!cold) qkv::memory::set_block_cache_limit(int64_t{1} << 30);

  if (smoke) g_peak_seconds = 0.01;
  for (int threads : {1, 2}) g_peak_gflops[threads] = qkv::bench::measure_fma_peak(threads, g_peak_seconds);
  if (qkv::kernels::attention_bf16_available())
    for (int threads : {1, 2}) g_bf16_peak_gflops[threads] = qkv::bench::measure_bf16_peak(threads, g_peak_seconds);

  const std::vector<Shape4> shapes = smoke ? std::vector<Shape4>{{1, 2, 64, 16}}
                                           : std::vector<Shape4>{{8, 12, 256, 64}, {4, 12, 1024, 64},
                                                                 {1, 12, 2048, 64}, {1, 8, 4096, 64}};
  auto configure = [&](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->UseRealTime();
    if (smoke) b->Iterations(1);
    else b->Repetitions(3)->ReportAggregatesOnly(true)->MinTime(0.2);
  };
  for (const Shape4& s : shapes)
    for (bool backward : {false, true})
      for (bool causal : {false, true})
        for (int threads : {1, 2}) {
          const std::string tag = std::string(backward ? "fwd+bwd/" : "fwd/") + (causal ? "causal/" : "full/") +
                                  s.str() + "/threads:" + std::to_string(threads);
          configure(benchmark::RegisterBenchmark(("fused/" + tag).c_str(), bm_fused, s, causal, backward, threads, false));
          configure(benchmark::RegisterBenchmark(("plain/" + tag).c_str(), bm_plain, s, causal, backward, threads));
          // bf16 products beside float32, causal (what training runs), where the CPU has AVX512_BF16
          if (causal && qkv::kernels::attention_bf16_available())
            configure(benchmark::RegisterBenchmark(("bf16/" + tag).c_str(), bm_fused, s, causal, backward, threads, true));
        }
  const int64_t B = smoke ? 1 : 4, T = smoke ? 32 : 1024, C = smoke ? 48 : 768, H = 12;
  for (int threads : {1, 2}) {
    const std::string tag = "fwd+bwd/MultiHeadAttention_B" + std::to_string(B) + "T" + std::to_string(T) + "C" +
                            std::to_string(C) + "H12/threads:" + std::to_string(threads);
    configure(benchmark::RegisterBenchmark(("fused/" + tag).c_str(), bm_mha, B, T, C, H, qkv::nn::AttentionPath::Fused,
                                           threads));
    configure(benchmark::RegisterBenchmark(("plain/" + tag).c_str(), bm_mha, B, T, C, H, qkv::nn::AttentionPath::Plain,
                                           threads));
  }
  // Grouped-query (16 query heads on 4 K/V heads) against multi-head at the same shape; a 512-token window at
  // T = 4096 against full causal; RoPE's two rotations before a forward.
  const Shape4 gqa = smoke ? Shape4{1, 4, 64, 16} : Shape4{4, 16, 1024, 64};
  const Shape4 long_seq = smoke ? Shape4{1, 2, 128, 16} : Shape4{1, 8, 4096, 64};
  const int64_t window = smoke ? 32 : 512;
  for (int threads : {1, 2}) {
    const std::string t = "threads:" + std::to_string(threads);
    configure(benchmark::RegisterBenchmark(("gqa/fwd+bwd/causal/" + gqa.str() + "/kv4/" + t).c_str(), bm_variant, gqa,
                                           int64_t{4}, int64_t{0}, false, true, threads));
    configure(benchmark::RegisterBenchmark(("gqa/fwd+bwd/causal/" + gqa.str() + "/kvH/" + t).c_str(), bm_variant, gqa,
                                           gqa.H, int64_t{0}, false, true, threads));
    for (bool backward : {false, true})
      for (int64_t w : {window, int64_t{0}}) {
        const std::string name = std::string("window/") + (backward ? "fwd+bwd/" : "fwd/") + long_seq.str() + "/W" +
                                 (w ? "512" : "0") + "/" + t;
        configure(benchmark::RegisterBenchmark(name.c_str(), bm_variant, long_seq, long_seq.H, w, false, backward, threads));
      }
    for (bool on : {true, false})
      configure(benchmark::RegisterBenchmark(("rope/fwd/causal/" + gqa.str() + (on ? "/on/" : "/off/") + t).c_str(),
                                             bm_variant, gqa, gqa.H, int64_t{0}, on, false, threads));
  }
  // Generation's attention at 144, 400 and 2,048 positions (a short reply, a longer one, a long chat)
  for (int threads : {1, 2}) {
    const int64_t layers = smoke ? 2 : 28, H = 16, H_kv = 8, D = smoke ? 32 : 128;
    for (int64_t Tk : smoke ? std::vector<int64_t>{37} : std::vector<int64_t>{144, 400, 2048})
      for (const auto type : {qkv::kernels::WeightType::F32, qkv::kernels::WeightType::F16, qkv::kernels::WeightType::BF16,
                              qkv::kernels::WeightType::Q8_0}) {
        const std::string name = "decode/qwen3-0.6b/L" + std::to_string(layers) + "/Tk" + std::to_string(Tk) + "/" +
                                 qkv::kernels::weight_type_name(type) + "/threads:" + std::to_string(threads);
        g_decode_bytes[name] = 2.0 * static_cast<double>(layers * Tk * qkv::kernels::row_bytes(type, H_kv * D));
        configure(benchmark::RegisterBenchmark(name.c_str(), bm_decode, type, layers, H, H_kv, D, Tk, threads,
                                               smoke ? (int64_t{16} << 20) : (int64_t{512} << 20)));
      }
  }
  const Shape4 probe = smoke ? Shape4{1, 2, 64, 16} : Shape4{1, 12, 1024, 64};
  for (int threads : {1, 2}) {
    const std::string tag = "causal/" + probe.str() + "/threads:" + std::to_string(threads);
    configure(benchmark::RegisterBenchmark(("maps/" + tag).c_str(), bm_maps, probe, threads));
    auto* share = benchmark::RegisterBenchmark(("head_share/" + tag).c_str(), bm_head_share, probe, threads);
    share->Unit(benchmark::kMillisecond)->UseManualTime();
    if (smoke) share->Iterations(1);
    else share->Repetitions(3)->ReportAggregatesOnly(true)->MinTime(0.2);
  }
  SummaryReporter reporter;
  if (console) benchmark::RunSpecifiedBenchmarks(&reporter);
  else benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
