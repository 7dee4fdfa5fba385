// Model-level benchmarks: training throughput (tokens/s) of GPTModel on the default `qkv train`
// configuration and on GPT-2's shape, generation with and without the KV cache, and tokenizer speed.
// `--smoke` runs each once on tiny sizes (CI). Compare with PyTorch and llm.c: tools/bench_gpt2_compare.py.
#include <benchmark/benchmark.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "peak.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/text/tokenizer.hpp"
#include "qkv/train/trainer.hpp"

namespace {

using qkv::nn::GPTConfig;

GPTConfig config(int64_t vocab, int64_t ctx, int64_t emb, int64_t heads, int64_t layers) {
  GPTConfig c;
  c.vocab_size = vocab, c.context_length = ctx, c.emb_dim = emb, c.n_heads = heads, c.n_layers = layers;
  c.drop_rate = 0.1;
  return c;
}

// One AdamW step: forward, cross-entropy, backward, clipping, update.
void bm_train_step(benchmark::State& state, GPTConfig c, int64_t batch, int threads) {
  omp_set_num_threads(threads);
  qkv::memory::cache_blocks_for_steps();  // as train::Trainer does, and after each step
  qkv::Generator gen(1);
  qkv::nn::Decoder model(c, gen);
  qkv::optim::AdamW optimizer(model.named_parameters(), {.lr = 3e-4, .weight_decay = 0.1});
  const auto parameters = model.named_parameters();
  std::vector<int64_t> ids(static_cast<size_t>(batch * c.context_length)), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(gen.next_u32() % c.vocab_size), targets[i] = static_cast<int64_t>(gen.next_u32() % c.vocab_size);
  auto step = [&] {
    optimizer.zero_grad();
    const qkv::Tensor loss = model.loss(ids, batch, c.context_length, targets);
    loss.backward();
    qkv::train::clip_grad_norm(parameters, 1.0);
    optimizer.step();
    qkv::memory::cache_blocks_for_steps();
    return loss.item();
  };
  step();  // warm-up: the first step allocates every gradient and the AdamW state
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(ids.size()), benchmark::Counter::kIsIterationInvariantRate);
}

// What each generation run measured, for the summary: tokens/s and the bytes one token reads.
struct GenerationResult {
  std::vector<double> tokens_per_second;  // one per run
  double bytes_per_token = 0, weight_bytes = 0, cache_bytes = 0;
  double median() const {
    std::vector<double> v = tokens_per_second;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  }
};
std::map<std::string, GenerationResult> g_generation;

// bf16: the matrices held in bf16 alone (what `qkv generate --precision bf16` does) and the KV cache in bf16.
void bm_generate(benchmark::State& state, const std::string& name, GPTConfig c, int64_t new_tokens, bool cache,
                 int threads, bool bf16) {
  omp_set_num_threads(threads);
  qkv::Generator gen(2);
  qkv::nn::Decoder model(c, gen);
  model.eval();
  const qkv::PrecisionGuard precision(bf16 ? qkv::Precision::BF16 : qkv::Precision::FP32);
  if (bf16) model.weights_to_bf16();
  qkv::nn::SamplingOptions options;
  options.max_new_tokens = new_tokens;
  options.temperature = 0.0;
  options.use_cache = cache;
  const std::vector<int64_t> prompt = {1, 2, 3, 4};
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(qkv::nn::generate(model, prompt, options).size());
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(new_tokens), benchmark::Counter::kIsIterationInvariantRate);
  // Bytes one token reads: every matrix but the embedding tables (a row each), and half the final cache on average.
  GenerationResult r;
  r.tokens_per_second = g_generation[name].tokens_per_second;  // the runs before this one
  model.for_each_parameter([&](const std::string& name, qkv::Tensor& p) {
    const double bytes = static_cast<double>(p.numel()) * (p.dtype() == qkv::DType::BF16 ? 2 : 4);
    r.weight_bytes += bytes;
    if (p.rank() == 2 && name.find("_emb.") == std::string::npos) r.bytes_per_token += bytes;
  });
  r.cache_bytes = static_cast<double>(model.make_cache(1, static_cast<int64_t>(prompt.size()) + new_tokens).bytes());
  r.bytes_per_token += 0.5 * r.cache_bytes;
  r.tokens_per_second.push_back(static_cast<double>(new_tokens) * static_cast<double>(state.iterations()) /
                                std::max(seconds, 1e-9));
  g_generation[name] = r;
}

void bm_tokenize(benchmark::State& state, int64_t bytes) {
  const auto dir = qkv::text::find_gpt2_vocabulary();
  if (!dir) {
    state.SkipWithError("GPT-2 vocabulary not found: run scripts/fetch-gpt2-vocab");
    return;
  }
  const auto tokenizer = qkv::text::make_tokenizer("gpt2", *dir);
  std::string text;
  const std::string verse = "And God said, Let there be light: and there was light. 1:3 It's the 2nd day — naïve café; ";
  while (static_cast<int64_t>(text.size()) < bytes) text += verse + std::to_string(text.size()) + "\n";
  for (auto _ : state) {
    // A fresh tokenizer each time would measure file loading; the BPE cache is part of real encoding.
    benchmark::DoNotOptimize(tokenizer->encode(text).size());
  }
  state.counters["MB/s"] = benchmark::Counter(static_cast<double>(text.size()) / 1e6, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) smoke = true;
    else args.push_back(argv[i]);
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  auto configure = [&](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->UseRealTime();
    if (smoke) b->Iterations(1);
    else b->Repetitions(3)->ReportAggregatesOnly(true);
  };
  const GPTConfig small = smoke ? config(300, 16, 32, 2, 1) : config(50257, 128, 192, 6, 4);  // qkv train's default
  const GPTConfig gpt2 = smoke ? config(300, 32, 48, 4, 2) : config(50257, 256, 768, 12, 12);  // GPT-2 124M, T = 256
  for (int threads : {1, 2}) {
    configure(benchmark::RegisterBenchmark(("train_step/default_config_B8T128/threads:" + std::to_string(threads)).c_str(),
                                           bm_train_step, small, 8, threads));
    configure(benchmark::RegisterBenchmark(("train_step/gpt2_124M_B2T256/threads:" + std::to_string(threads)).c_str(),
                                           bm_train_step, gpt2, 2, threads));
  }
  const GPTConfig generator_model = smoke ? config(300, 64, 32, 2, 1) : config(50257, 1024, 768, 12, 12);
  const int64_t new_tokens = smoke ? 8 : 256;
  // One run each: without the cache, 256 tokens of GPT-2 124M take about a minute. With bf16 (where the CPU has it):
  // the matrices and the KV cache in bf16, three runs.
  const bool bf16 = qkv::kernels::bf16_native();
  for (const char* mode : {"kv_cache", "no_cache", "kv_cache_bf16"}) {
    const bool cache = std::string(mode) != "no_cache", half = std::string(mode) == "kv_cache_bf16";
    if (half && !bf16) continue;
    const std::string name = std::string("generate_256/gpt2_124M/") + mode + "/threads:2";
    auto* b = benchmark::RegisterBenchmark(name.c_str(), bm_generate, name, generator_model, new_tokens, cache, 2, half);
    b->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
    if (cache && !smoke) b->Repetitions(3);
  }
  configure(benchmark::RegisterBenchmark("tokenize_gpt2/1MB", bm_tokenize, smoke ? 10000 : 1000000));
  benchmark::RunSpecifiedBenchmarks();
  // Generation against the memory-bound limit: the machine's read bandwidth (measured now, 2 threads) ÷ the bytes a
  // token reads.
  if (!g_generation.empty()) {
    omp_set_num_threads(2);
    const double bandwidth = qkv::bench::read_bandwidth(smoke ? (int64_t{64} << 20) : (int64_t{512} << 20));
    std::printf("\nGeneration, 2 threads: read bandwidth %.1f GB/s measured (medians of the runs)\n", bandwidth / 1e9);
    for (const auto& [name, r] : g_generation) {
      const double limit = bandwidth / r.bytes_per_token;
      std::printf("  %-44s %7.1f tok/s; %.0f MB a token -> limit %.1f tok/s: %.0f%%; weights %.0f MB, KV cache %.1f MB\n",
                  name.c_str(), r.median(), r.bytes_per_token / 1e6, limit, 100.0 * r.median() / limit,
                  r.weight_bytes / 1e6, r.cache_bytes / 1e6);
    }
    const auto fp32 = g_generation.find("generate_256/gpt2_124M/kv_cache/threads:2");
    const auto half = g_generation.find("generate_256/gpt2_124M/kv_cache_bf16/threads:2");
    if (fp32 != g_generation.end() && half != g_generation.end())
      std::printf("  bf16 / fp32: %.2fx tokens/s, weights %.2fx\n", half->second.median() / fp32->second.median(),
                  half->second.weight_bytes / fp32->second.weight_bytes);
  }
  benchmark::Shutdown();
  return 0;
}
