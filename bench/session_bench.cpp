// Batched generation through nn::Session against one prompt at a time, on a Qwen3-0.6B-shaped decoder (random
// weights, float32), in one run:
//   - total tokens/s of 8 prompts of different lengths generated as one batch (greedy) against the same 8 one after
//     another — through a session each, and through nn::generate (the single-sequence path with OpenBLAS's sgemv) —
//     with the outputs checked identical (target ≥ 4×);
//   - each against its memory-bound limit: read bandwidth (measured here, same threads) ÷ the bytes a decoding step
//     reads (every weight matrix once per step, whatever the batch, plus each sequence's keys and values);
//   - the block cache's peak memory against the positions it held (memory follows the tokens, not a context).
//   qkv_session_bench [--shape qwen3-0.6b|small] [--prompts N] [--tokens N] [--threads N] [--repeats N] [--smoke]
//                     [--weights bf16|f16|q8_0|q4_0|q4_k|...] [--batch-only]  (the batch alone, for a profiler)
// --weights keeps the blocks' matrices in that storage type (Decoder::store_matrices), as a quantized GGUF or `qkv
// generate --weights` holds them: a step then reads fewer bytes, and the batch's rows share each block's unpacking.
// With --kv-types CONTEXT: instead, one sequence of a CONTEXT-token prompt then --tokens new ones on each KV cache type
// (f32, f16, bf16, q8_0; --kv-cache), in one run: the cache's bytes, decoding tok/s against float32's, and how far
// the narrow caches move the logits and the greedy tokens.
// With --products: instead, kernels::gemm_rows_nt (every product of a step) alone, C = A·Bᵀ with B 3072 × 1024 (an up
// projection) and 1024 × 3072 (a down projection) and A of 1 … 512 rows, B streamed from memory (24 distinct matrices,
// as a decoding step reads its weights) and from L2: GFLOP/s, % of the FMA peak measured in the same run, and B's read
// rate against the read bandwidth.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "peak.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/session.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string config_json(const std::string& shape) {
  if (shape == "smoke")
    return R"({"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
  if (shape == "small")  // a quick stand-in: 8 layers of Qwen3's width, a 32 Ki vocabulary
    return R"({"model_type": "qwen3", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 3072,
      "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
  return R"({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// --products: gemm_rows_nt by rows of A, B from memory and from L2, against the FMA peak and the read bandwidth
int products(int threads, int repeats) {
  const double peak = qkv::bench::measure_fma_peak(threads, 0.3) * 1e9, bandwidth = qkv::bench::read_bandwidth(int64_t{512} << 20);
  // A step's up (3072 × 1024) and down (1024 × 3072) projections: the rows of A are 4 or 12 KiB
  for (const auto& [N, K] : std::vector<std::pair<int64_t, int64_t>>{{3072, 1024}, {1024, 3072}}) {
    std::printf("gemm_rows_nt, C = A·Bᵀ, B %lld × %lld; %d threads; FMA peak %.1f GFLOP/s, read bandwidth %.1f GB/s; best of %d\n",
                static_cast<long long>(N), static_cast<long long>(K), threads, peak / 1e9, bandwidth / 1e9, repeats);
    for (const bool cold : {true, false}) {
      const int64_t mats = cold ? 24 : 1, n = cold ? N : 128 * 1024 / K;  // from L2: a 512 KiB B, again and again
      const int64_t calls = cold ? 1 : 200;
      std::vector<std::vector<float>> bs(static_cast<size_t>(mats), std::vector<float>(static_cast<size_t>(n * K)));
      qkv::Generator gen(3);
      for (auto& b : bs) {
        const qkv::Tensor r = gen.randn({n * K});
        std::copy_n(r.data(), n * K, b.data());
      }
      std::printf("  B from %s:\n", cold ? "memory (24 matrices of 12 MiB)" : "L2 (one 512 KiB matrix, 200 times)");
      for (int64_t M : {1, 4, 8, 12, 16, 24, 64, 208, 512}) {
        std::vector<float> a(static_cast<size_t>(M * K), 0.5f), c(static_cast<size_t>(M * n));
        double best = 1e30;
        for (int rep = 0; rep < repeats; ++rep) {
          const auto t = Clock::now();
          for (int64_t call = 0; call < calls; ++call)
            for (const auto& b : bs)
              qkv::kernels::gemm_rows_nt(M, n, K, 1.0f, a.data(), K, b.data(), K, 0.0f, c.data(), n);
          best = std::min(best, since(t));
        }
        const double flops = 2.0 * M * n * K * mats * calls, bytes = 4.0 * n * K * mats * calls;
        std::printf("    A of %2lld rows: %7.1f GFLOP/s = %3.0f%% of the FMA peak; B read at %5.1f GB/s (%3.0f%% of the read bandwidth)\n",
                    static_cast<long long>(M), flops / best / 1e9, 100.0 * flops / best / peak, bytes / best / 1e9,
                    100.0 * bytes / best / bandwidth);
      }
    }
  }
  return 0;
}

// --kv-types: each cache type on one long sequence, alternating types within each repeat
int kv_types(const qkv::nn::Decoder& model, int64_t context, int64_t tokens, int repeats) {
  using qkv::kernels::WeightType;
  const std::vector<WeightType> types = {WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q8_0};
  std::vector<int64_t> prompt;
  for (int64_t k = 0; k < context; ++k) prompt.push_back((k * 7919 + 11) % model.vocab_size());
  std::vector<std::vector<double>> decode(types.size());
  std::vector<std::vector<int64_t>> out(types.size());
  std::vector<qkv::Tensor> first(types.size());
  std::vector<int64_t> bytes(types.size());
  for (int rep = 0; rep < repeats; ++rep)
    for (size_t i = 0; i < types.size(); ++i) {
      qkv::nn::SessionOptions o;
      o.kv_type = types[i];
      o.max_tokens = context + tokens + 16;
      qkv::nn::Session session(model, o);
      const int64_t seq = session.open();
      qkv::nn::Batch batch;
      for (int64_t k = 0; k < context; ++k) batch.add(prompt[static_cast<size_t>(k)], k, seq, k + 1 == context);
      first[i] = session.decode(batch);  // the prompt, then greedy steps timed
      int64_t next = 0;
      auto argmax = [&](const qkv::Tensor& logits) {
        const float* l = logits.data();
        return static_cast<int64_t>(std::max_element(l, l + logits.size(1)) - l);
      };
      next = argmax(first[i]);
      out[i].assign(1, next);
      const auto t = Clock::now();
      for (int64_t n = 1; n < tokens; ++n) {
        batch.clear();
        batch.add(next, context + n - 1, seq, true);
        next = argmax(session.decode(batch));
        out[i].push_back(next);
      }
      decode[i].push_back(static_cast<double>(tokens - 1) / since(t));
      bytes[i] = session.cache().bytes_allocated();
    }
  std::printf("one sequence: a %lld-token prompt, then %lld greedy tokens; medians of %d runs, types alternating\n",
              static_cast<long long>(context), static_cast<long long>(tokens), repeats);
  const double base = median(decode[0]);
  float range = 0.0f;
  for (int64_t v = 0; v < first[0].size(1); ++v) range = std::max(range, std::abs(first[0].data()[v]));
  for (size_t i = 0; i < types.size(); ++i) {
    float most = 0.0f;
    for (int64_t v = 0; v < first[0].size(1); ++v) most = std::max(most, std::abs(first[i].data()[v] - first[0].data()[v]));
    size_t same = 0;
    while (same < out[i].size() && out[i][same] == out[0][same]) ++same;
    std::printf("  %-4s KV cache %8.2f MiB (%.3fx f32)  decoding %6.2f tok/s (%.2fx f32)  first logits: max |diff| "
                "%.2e (%.2e of their range); greedy tokens equal to f32's for the first %zu of %zu\n",
                qkv::kernels::weight_type_name(types[i]), bytes[i] / 1048576.0,
                static_cast<double>(bytes[i]) / static_cast<double>(bytes[0]), median(decode[i]), median(decode[i]) / base,
                most, most / range, same, out[i].size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "qwen3-0.6b";
  int64_t prompts = 8, tokens = 32, kv_context = 0;
  bool products_only = false, batch_only = false;
  std::optional<qkv::kernels::WeightType> weights;
  int threads = 2, repeats = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string("0"); };
    if (a == "--shape") shape = next();
    else if (a == "--prompts") prompts = std::stoll(next());
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--smoke") shape = "smoke", tokens = 4, repeats = 1;
    else if (a == "--kv-types") kv_context = std::stoll(next());
    else if (a == "--products") products_only = true;
    else if (a == "--batch-only") batch_only = true;  // (for profiling the batch: no runs one at a time)
    else if (a == "--weights") {
      const std::string name = next();
      weights = qkv::kernels::weight_type_from_name(name);
      if (!weights) {
        std::fprintf(stderr, "--weights %s: not a storage type (bf16, f16, q8_0, q4_0, q4_k, q5_k, q6_k)\n", name.c_str());
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  qkv::set_num_threads(threads);
  if (products_only) return products(threads, repeats);
  const double bandwidth = qkv::bench::read_bandwidth(shape == "smoke" ? (int64_t{64} << 20) : (int64_t{512} << 20));
  const qkv::nn::DecoderConfig config = qkv::nn::decoder_config_from_hf(config_json(shape), shape + " config");
  qkv::Generator gen(7);
  auto t = Clock::now();
  qkv::nn::Decoder model(config, gen);
  model.eval();
  if (weights) model.store_matrices(*weights);
  std::printf("%s: %lld parameters (random; the blocks' matrices %s) made in %.1f s; %d threads\n", shape.c_str(),
              static_cast<long long>(model.parameter_count()),
              weights ? qkv::kernels::weight_type_name(*weights) : "float32", since(t), threads);
  if (kv_context > 0) return kv_types(model, kv_context, tokens, repeats);
  int64_t matrix_bytes = 0;  // as stored: what a step reads
  for (const auto& p : config.layout()) {
    if (p.shape.rank() != 2) continue;
    matrix_bytes += p.shape[0] * qkv::kernels::row_bytes(model.parameter(p).weight_type(), p.shape[1]);
  }
  const int64_t kv_bytes_per_position = config.num_layers * 2 * config.kv_width() * 4;

  // Prompts of 12 … 40 tokens
  std::vector<qkv::nn::GenerationRequest> requests;
  for (int64_t i = 0; i < prompts; ++i) {
    qkv::nn::GenerationRequest r;
    for (int64_t k = 0; k < 12 + (i * 4) % 29; ++k) r.prompt.push_back((k * 7919 + i * 104729 + 11) % config.vocab_size);
    r.max_new_tokens = tokens;
    r.sampling.greedy = true;
    requests.push_back(r);
  }
  int64_t prompt_total = 0;
  for (const auto& r : requests) prompt_total += static_cast<int64_t>(r.prompt.size());
  const int64_t new_total = prompts * tokens;
  // KV read per decoding step, summed over the whole generation: sequence i at length L reads L positions.
  double kv_read = 0.0;
  for (const auto& r : requests)
    for (int64_t n = 0; n < tokens; ++n) kv_read += static_cast<double>(r.prompt.size() + n) * kv_bytes_per_position;
  // Memory-bound limits of the decoding steps (prefill aside): alone, every token reads all matrices; in a batch,
  // every step reads them once for all sequences.
  const double solo_limit = static_cast<double>(new_total) / ((static_cast<double>(new_total) * matrix_bytes + kv_read) / bandwidth);
  const double batch_limit = static_cast<double>(new_total) / ((static_cast<double>(tokens) * matrix_bytes + kv_read) / bandwidth);

  std::vector<double> solo_session, solo_legacy, batched, batched_decode, solo_decode;
  std::vector<std::vector<int64_t>> alone_out, legacy_out, batch_out;
  int64_t peak_bytes = 0, peak_held = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    // one at a time, through a session each
    alone_out.clear();
    if (!batch_only) {
      double decode_seconds = 0.0;
      t = Clock::now();
      for (const auto& r : requests) {
        qkv::nn::Session session(model);
        Clock::time_point first;
        bool started = false;
        alone_out.push_back(qkv::nn::generate(session, {r}, [&](size_t, int64_t) {
          if (!started) first = Clock::now(), started = true;
          return true;
        })[0].tokens);
        decode_seconds += since(first);
      }
      solo_session.push_back(since(t));
      solo_decode.push_back(decode_seconds);
      // one at a time, through nn::generate (sgemv for one row)
      legacy_out.clear();
      t = Clock::now();
      for (const auto& r : requests) {
        qkv::nn::SamplingOptions o;
        o.temperature = 0;
        o.max_new_tokens = tokens;
        legacy_out.push_back(qkv::nn::generate(model, r.prompt, o));
      }
      solo_legacy.push_back(since(t));
    }
    // all as one batch
    qkv::nn::Session session(model);
    Clock::time_point first;
    bool started = false;
    t = Clock::now();
    const auto results = qkv::nn::generate(session, requests, [&](size_t, int64_t) {
      if (!started) first = Clock::now(), started = true;
      peak_bytes = std::max(peak_bytes, session.cache().bytes_allocated());
      peak_held = std::max(peak_held, session.cache().tokens_held());
      return true;
    });
    batched.push_back(since(t));
    batched_decode.push_back(since(first));
    batch_out.clear();
    for (const auto& r : results) batch_out.push_back(r.tokens);
  }
  if (batch_only) {
    std::printf("as one batch: %.1f tok/s total (%.2f s), decoding %.1f tok/s; medians of %d runs\n", new_total / median(batched),
                median(batched), (new_total - prompts) / median(batched_decode), repeats);
    return 0;
  }
  const bool identical = batch_out == alone_out;
  int legacy_same = 0;
  for (size_t i = 0; i < legacy_out.size(); ++i) legacy_same += legacy_out[i] == alone_out[i];
  const double tb = median(batched), ts = median(solo_session), tl = median(solo_legacy);
  std::printf("%lld prompts (%lld prompt tokens, 12-40 each) x %lld new tokens, greedy; medians of %d runs\n",
              static_cast<long long>(prompts), static_cast<long long>(prompt_total), static_cast<long long>(tokens), repeats);
  std::printf("  bandwidth %.1f GB/s measured (read, %d threads); weights %.3f GB read per decoding step\n",
              bandwidth / 1e9, threads, matrix_bytes / 1e9);
  std::printf("  one at a time, nn::generate (sgemv):   %6.1f tok/s total (%.2f s)\n", new_total / tl, tl);
  std::printf("  one at a time, a session each:          %6.1f tok/s total (%.2f s); decoding %.1f tok/s = %.0f%% of its "
              "memory-bound limit %.1f\n", new_total / ts, ts, (new_total - prompts) / median(solo_decode),
              100.0 * (new_total - prompts) / median(solo_decode) / solo_limit, solo_limit);
  std::printf("  as one batch (session):                 %6.1f tok/s total (%.2f s); decoding %.1f tok/s = %.0f%% of its "
              "memory-bound limit %.1f\n", new_total / tb, tb, (new_total - prompts) / median(batched_decode),
              100.0 * (new_total - prompts) / median(batched_decode) / batch_limit, batch_limit);
  std::printf("  batched vs one at a time: %.2fx (sessions), %.2fx (nn::generate) (target >= 4x); outputs identical to "
              "each alone: %s; nn::generate's greedy text equal for %d of %lld\n", ts / tb, tl / tb,
              identical ? "yes" : "NO", legacy_same, static_cast<long long>(prompts));
  const int64_t preallocated = prompts * config.max_positions * kv_bytes_per_position;
  std::printf("  KV cache: peak %.2f MiB for %lld positions held at most (%.1f KiB a position, blocks of %lld); a "
              "context preallocated per sequence would be %.0f MiB\n", peak_bytes / 1048576.0,
              static_cast<long long>(peak_held), kv_bytes_per_position / 1024.0, 16LL, preallocated / 1048576.0);
  return identical ? 0 : 1;
}
