// Model-level benchmarks: training throughput (tokens/s) of GPTModel on the default `qkv train`
// configuration and on GPT-2's shape, generation with and without the KV cache, and tokenizer speed.
// `--smoke` runs each once on tiny sizes (CI). Compare with PyTorch and llm.c: tools/bench_gpt2_compare.py.
#include <benchmark/benchmark.h>

#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

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
  qkv::memory::set_block_cache_limit(int64_t{2} << 30);  // as train::Trainer does
  qkv::Generator gen(1);
  qkv::nn::GPTModel model(c, gen);
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
    return loss.item();
  };
  step();  // warm-up: the first step allocates every gradient and the AdamW state
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(ids.size()), benchmark::Counter::kIsIterationInvariantRate);
}

void bm_generate(benchmark::State& state, GPTConfig c, int64_t new_tokens, bool cache, int threads) {
  omp_set_num_threads(threads);
  qkv::Generator gen(2);
  qkv::nn::GPTModel model(c, gen);
  model.eval();
  qkv::nn::SamplingOptions options;
  options.max_new_tokens = new_tokens;
  options.temperature = 0.0;
  options.use_cache = cache;
  const std::vector<int64_t> prompt = {1, 2, 3, 4};
  for (auto _ : state) benchmark::DoNotOptimize(qkv::nn::generate(model, prompt, options).size());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(new_tokens), benchmark::Counter::kIsIterationInvariantRate);
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
  // One run each: without the cache, 256 tokens of GPT-2 124M take about a minute.
  for (bool cache : {true, false})
    benchmark::RegisterBenchmark(
        (std::string("generate_256/gpt2_124M/") + (cache ? "kv_cache" : "no_cache") + "/threads:2").c_str(), bm_generate,
        generator_model, new_tokens, cache, 2)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
  configure(benchmark::RegisterBenchmark("tokenize_gpt2/1MB", bm_tokenize, smoke ? 10000 : 1000000));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
