// Multi-head latent attention decoding, measured in one run (issue 43's target: at T = 8,192 the absorbed decode,
// reading only the latent cache, ≥ 1.5× the tokens/s of the same model decoding from expanded K/V). A DeepSeek-V2-
// Lite-shaped attention (C 2048, 16 heads, qk_nope 128 + qk_rope 64, v 128, kv_lora_rank 512, a plain q_proj) in a
// two-layer decoder with a small MLP and vocabulary, so attention dominates. The caches are filled with random rows
// (a decode step's cost does not depend on what they hold) and one token is decoded at a time; medians of repeats,
// the two modes alternating. Not a test: `qkv_latent_attention_bench [--smoke]`.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/core/random.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/session.hpp"

namespace {

using qkv::nn::Decoder;

// Random contents for a cache's buffers
void fill(qkv::nn::KVCache& cache, qkv::Generator& gen) {
  for (auto& layer : cache.layers)
    for (qkv::Tensor* t : {&layer.keys, &layer.values})
      if (t->defined()) gen.uniform_(*t, -1.0, 1.0);
}
// The cache marked as holding T positions (the rows a run of steps appended are written again by the next)
void rewind(qkv::nn::KVCache& cache, int64_t T) {
  for (int64_t& f : cache.filled) f = T;
  cache.length = T;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const int64_t T = smoke ? 256 : 8192, steps = smoke ? 2 : 8;
  const int reps = smoke ? 1 : 7;
  qkv::nn::DecoderConfig c;
  c.family = &qkv::nn::family("deepseek_v3");
  c.vocab_size = 1024;
  c.hidden_size = 2048;
  c.intermediate_size = 1024;
  c.num_layers = 2;
  c.num_heads = c.num_kv_heads = 16;
  c.head_dim = 64;  // qk_rope_head_dim
  c.qk_nope_head_dim = 128;
  c.v_head_dim = 128;
  c.kv_lora_rank = 512;
  c.q_lora_rank = 0;
  c.max_positions = T + steps * (reps + 1) + 2;  // the session below decodes every repeat's tokens on
  c.rope_layout = qkv::RopeLayout::Interleaved;
  c.ropes = {qkv::RopeFrequencies{}};
  c.layers.assign(static_cast<size_t>(c.num_layers), qkv::nn::DecoderLayerSettings{});
  qkv::Generator gen(1);
  Decoder model(c, gen);
  model.eval();
  qkv::NoGradGuard no_grad;

  const int64_t R = c.kv_lora_rank, dr = c.head_dim, H = c.num_heads, dq = c.qk_head_dim(), dv = c.v_head_dim;
  std::printf("latent attention decoding, %d threads: %lld layers, C %lld, %lld heads (qk %lld + %lld, v %lld), latent %lld, "
              "T = %lld\n",
              omp_get_max_threads(), static_cast<long long>(c.num_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(H), static_cast<long long>(c.qk_nope_head_dim), static_cast<long long>(dr),
              static_cast<long long>(dv), static_cast<long long>(R), static_cast<long long>(T));
  // KV bytes read per token and layer: absorbed reads the latent rows once for all heads; expanded reads every
  // head's key and value (stored padded to one head width, max(qk, v))
  const double absorbed_bytes = static_cast<double>(T) * (R + dr) * 4;
  const double expanded_bytes = static_cast<double>(T) * H * 2 * std::max(dq, dv) * 4;
  const double expanded_unpadded = static_cast<double>(T) * H * (dq + dv) * 4;

  std::vector<double> times[2];
  qkv::nn::KVCache caches[2];
  for (int mode = 0; mode < 2; ++mode) {
    model.latent_decode = mode == 0 ? Decoder::LatentDecode::Absorbed : Decoder::LatentDecode::Expanded;
    caches[mode] = model.make_cache(1, T + steps + 1);
    fill(caches[mode], gen);
  }
  std::vector<int64_t> token = {7};
  for (int r = 0; r <= reps; ++r)  // r = 0: warm-up, not kept
    for (int mode = 0; mode < 2; ++mode) {
      model.latent_decode = mode == 0 ? Decoder::LatentDecode::Absorbed : Decoder::LatentDecode::Expanded;
      rewind(caches[mode], T);
      const auto start = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < steps; ++s) model.forward_cached(token, 1, 1, caches[mode]);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / static_cast<double>(steps);
      if (r > 0) times[mode].push_back(seconds);
    }
  double median[2];
  for (int mode = 0; mode < 2; ++mode) {
    std::sort(times[mode].begin(), times[mode].end());
    median[mode] = times[mode][times[mode].size() / 2];
  }
  const char* names[2] = {"absorbed (latent cache)", "expanded (K/V cache)   "};
  const double bytes[2] = {absorbed_bytes, expanded_bytes};
  for (int mode = 0; mode < 2; ++mode)
    std::printf("  %s %8.2f tokens/s  %7.3f ms/token  KV read %8.2f MB/token/layer (%6.1f GB/s over both layers)\n",
                names[mode], 1.0 / median[mode], median[mode] * 1e3, bytes[mode] / 1e6,
                bytes[mode] * static_cast<double>(c.num_layers) / median[mode] / 1e9);
  std::printf("  expanded K/V unpadded would be %.2f MB/token/layer; latent bytes / expanded: %.3f\n", expanded_unpadded / 1e6,
              absorbed_bytes / expanded_unpadded);
  std::printf("absorbed / expanded tokens/s: %.2fx (target >= 1.5x)\n", median[1] / median[0]);

  // The same model in a session (qkv generate, chat and serve's path): its block cache keeps the latent rows only.
  // A T-token prompt prefilled once, then tokens decoded one at a time, medians of the same repeats.
  qkv::nn::SessionOptions options;
  options.max_tokens = T + steps * (reps + 1) + 1;
  options.adapt_threads = false;
  qkv::nn::Session session(model, options);
  const int64_t seq = session.open();
  for (int64_t start = 0; start < T; start += 512) {
    qkv::nn::Batch prompt;
    for (int64_t t = start; t < std::min<int64_t>(T, start + 512); ++t) prompt.add((t * 7919 + 11) % c.vocab_size, t, seq, t == T - 1);
    session.decode(prompt);
  }
  std::vector<double> session_times;
  int64_t position = T;
  for (int r = 0; r <= reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < steps; ++s) {
      qkv::nn::Batch one;
      one.add(7, position++, seq, true);
      session.decode(one);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / static_cast<double>(steps);
    if (r > 0) session_times.push_back(seconds);
  }
  std::sort(session_times.begin(), session_times.end());
  const double session_median = session_times[session_times.size() / 2];
  std::printf("  session (block cache of latents) %8.2f tokens/s  %7.3f ms/token  cache %.2f MB/token/layer at T = %lld "
              "(%.2fx the absorbed KV cache's tokens/s, %.2fx the expanded one's)\n",
              1.0 / session_median, session_median * 1e3,
              static_cast<double>(session.cache().bytes_per_block()) / static_cast<double>(session.cache().block_size()) /
                  static_cast<double>(c.num_layers) * static_cast<double>(T) / 1e6,
              static_cast<long long>(T), median[0] / session_median, median[1] / session_median);
  return 0;
}
