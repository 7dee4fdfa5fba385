// A load benchmark of `qkv serve`: the server in this process on a free loopback port, driven by N concurrent
// streaming HTTP clients (/v1/completions, server-sent events) on a Qwen3-shaped decoder (random weights, float32,
// a byte tokenizer over a 128-id vocabulary so every token is one streamed character). One run prints medians of
// repeats of:
//   - aggregate tokens/s of 1 and of 8 concurrent streams (and the ratio 8-stream / 1-stream; target ≥ 4×), time to
//     first token and inter-token latency p50/p99 as the clients see them (ITL target: 8-stream p50 ≤ 2× lone);
//   - time to first token of a 128-token prompt arriving while 7 streams decode, against its prefill alone (≤ 2×);
//   - a chat's second turn over a --history-token first turn: time to first token with the prompt cache (it forks
//     the first turn's blocks) against the same prompt with nothing cached (target ≥ 5× faster).
// Not a test: it asserts nothing (tests/test_serve.cpp checks the tokens; this measures time).
//   qkv_serve_bench [--layers N] [--tokens N] [--prompt N] [--history N] [--streams N] [--threads N] [--repeats N]
//                   [--smoke]
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "qkv/core/autograd.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/serve/server.hpp"
#include "qkv/text/tokenizer.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}
double median(const std::vector<double>& v) { return quantile(v, 0.5); }

// What one streamed request saw
struct Stream {
  Clock::time_point start, first, end;
  std::vector<Clock::time_point> arrivals;  // of each event carrying text
  std::string text;
  int64_t tokens = 0;                       // completion_tokens from the usage chunk
  bool ok = false;
};

// POSTs a streamed completion of `prompt` (token ids) for `max_tokens` tokens, greedy, and records when each event
// arrives (counting `decoding` up at its first text)
Stream complete(int port, const std::vector<int64_t>& prompt, int64_t max_tokens, std::atomic<int>* decoding = nullptr) {
  Stream s;
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(600, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = json{{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", true},
                  {"stream_options", {{"include_usage", true}}}}.dump();
  req.set_header("Content-Type", "application/json");
  std::string buffer;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();
    buffer.append(data, n);
    for (size_t at; (at = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, at);
      buffer.erase(0, at + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const json j = json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("usage") && j["usage"].is_object()) s.tokens = j["usage"].value("completion_tokens", int64_t{0});
      if (j.contains("choices") && !j["choices"].empty()) {
        const std::string piece = j["choices"][0].value("text", std::string());
        if (!piece.empty()) {
          if (s.arrivals.empty()) {
            s.first = now;
            if (decoding) ++*decoding;
          }
          s.arrivals.push_back(now);
          s.text += piece;
        }
      }
    }
    return true;
  };
  s.start = Clock::now();
  const httplib::Result r = client.send(req);
  s.end = Clock::now();
  s.ok = r && r->status == 200 && !s.arrivals.empty();
  return s;
}

// Runs `n` streams at once; returns them
std::vector<Stream> together(int port, const std::vector<std::vector<int64_t>>& prompts, int64_t max_tokens) {
  std::vector<Stream> out(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i)
    threads.emplace_back([&, i] { out[i] = complete(port, prompts[i], max_tokens); });
  for (auto& t : threads) t.join();
  return out;
}

std::vector<int64_t> prompt_of(int64_t n, int64_t salt) {
  std::vector<int64_t> ids;
  for (int64_t k = 0; k < n; ++k) ids.push_back(32 + (k * 7919 + salt * 104729 + 11) % 95);  // printable ASCII
  return ids;
}

// Aggregate tokens/s, TTFTs and ITL gaps of a set of streams
struct Figures {
  double tokens_per_second = 0;
  std::vector<double> ttft, itl;
  bool ok = true;
};
Figures figures_of(const std::vector<Stream>& streams) {
  Figures f;
  Clock::time_point begin = streams.front().start, end = streams.front().end;
  int64_t tokens = 0;
  for (const Stream& s : streams) {
    begin = std::min(begin, s.start);
    end = std::max(end, s.end);
    tokens += s.tokens;
    f.ok = f.ok && s.ok;
    if (s.ok) f.ttft.push_back(seconds(s.start, s.first));
    for (size_t k = 1; k < s.arrivals.size(); ++k) f.itl.push_back(seconds(s.arrivals[k - 1], s.arrivals[k]));
  }
  f.tokens_per_second = static_cast<double>(tokens) / seconds(begin, end);
  return f;
}

std::string config_json(int64_t layers, bool smoke) {
  if (smoke)
    return R"({"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
  return R"({"model_type": "qwen3", "vocab_size": 128, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": )" + std::to_string(layers) + R"(, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": true})";
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 8, tokens = 64, prompt = 32, history = 1000, streams = 8;
  int threads = 2, repeats = 3;
  bool smoke = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string("0"); };
    if (a == "--layers") layers = std::stoll(next());
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--prompt") prompt = std::stoll(next());
    else if (a == "--history") history = std::stoll(next());
    else if (a == "--streams") streams = std::stoll(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--smoke") smoke = true, tokens = 6, history = 100, repeats = 1;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (layers < 1 || tokens < 2 || prompt < 1 || history < 16 || streams < 2 || threads < 1 || repeats < 1) {
    std::fprintf(stderr, "every count must be positive (--tokens ≥ 2, --history ≥ 16, --streams ≥ 2)\n");
    return 2;
  }
  qkv::set_num_threads(threads);
  const qkv::nn::DecoderConfig config = qkv::nn::decoder_config_from_hf(config_json(layers, smoke), "bench config");
  qkv::Generator gen(7);
  auto pretrained = std::make_unique<qkv::nn::Pretrained>();
  pretrained->model = std::make_unique<qkv::nn::Decoder>(config, gen);
  pretrained->model->eval();
  pretrained->tokenizer = std::make_unique<qkv::text::ByteTokenizer>();
  pretrained->description = "bench";
  std::printf("Qwen3-shaped decoder, %lld layers, %lld parameters (random, float32); %d threads; %lld tokens per stream, "
              "%lld-token prompts\n",
              static_cast<long long>(config.num_layers), static_cast<long long>(pretrained->model->parameter_count()),
              threads, static_cast<long long>(tokens), static_cast<long long>(prompt));

  qkv::serve::ServerOptions options;
  options.port = 0;
  options.parallel = streams;
  options.queue_size = streams;
  options.context = std::min<int64_t>(4096, history + 512);
  options.prompt_cache_tokens = 2 * options.context;
  options.request_deadline_seconds = 0;
  qkv::serve::Server server(options);
  const int port = server.bind();
  std::thread serving([&] { server.serve(); });
  server.set_model(std::move(pretrained), "bench");

  std::vector<double> lone_tps, many_tps, lone_ttft, lone_itl50, lone_itl99, many_ttft, many_itl50, many_itl99;
  std::vector<double> joined_ttft, alone_prefill, cached_turn, uncached_turn;
  bool ok = true;
  int64_t salt = 1;
  ok = ok && complete(port, prompt_of(prompt, salt++), 4).ok;  // a warm-up: first-touch of the weights and the blocks
  for (int rep = 0; rep < repeats; ++rep) {
    // One stream, then `streams` at once (fresh prompts each time: no prompt cache hit)
    const Figures lone = figures_of({complete(port, prompt_of(prompt, salt++), tokens)});
    std::vector<std::vector<int64_t>> prompts;
    for (int64_t i = 0; i < streams; ++i) prompts.push_back(prompt_of(prompt, salt++));
    const Figures many = figures_of(together(port, prompts, tokens));
    ok = ok && lone.ok && many.ok;
    lone_tps.push_back(lone.tokens_per_second);
    many_tps.push_back(many.tokens_per_second);
    lone_ttft.push_back(median(lone.ttft));
    lone_itl50.push_back(quantile(lone.itl, 0.5));
    lone_itl99.push_back(quantile(lone.itl, 0.99));
    many_ttft.push_back(median(many.ttft));
    many_itl50.push_back(quantile(many.itl, 0.5));
    many_itl99.push_back(quantile(many.itl, 0.99));

    // A 128-token prompt alone (its time to first token is its prefill), then arriving while streams − 1 decode
    alone_prefill.push_back(figures_of({complete(port, prompt_of(128, salt++), 2)}).ttft.at(0));
    {
      std::vector<Stream> busy(static_cast<size_t>(streams - 1));
      std::vector<std::thread> clients;
      std::atomic<int> decoding{0};
      for (size_t i = 0; i < busy.size(); ++i) {
        const std::vector<int64_t> p = prompt_of(prompt, salt++);
        clients.emplace_back([&, i, p] { busy[i] = complete(port, p, 4 * tokens, &decoding); });
      }
      // Once every one of them decodes (their prompts are in), and a few steps more
      while (decoding < static_cast<int>(busy.size())) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(std::chrono::milliseconds(smoke ? 10 : 200));
      const Stream joined = complete(port, prompt_of(128, salt++), 2);
      for (auto& c : clients) c.join();
      ok = ok && joined.ok;
      joined_ttft.push_back(seconds(joined.start, joined.first));
    }

    // A chat over a long history: turn 1, then turn 2 (turn 1, its reply, a new message) with the cache, and the
    // same-length prompt sharing nothing (what the second turn costs without a prompt cache)
    const std::vector<int64_t> turn1 = prompt_of(history, salt++);
    const Stream first = complete(port, turn1, 16);
    std::vector<int64_t> turn2 = turn1;
    for (unsigned char c : first.text) turn2.push_back(c);
    const std::vector<int64_t> message = prompt_of(24, salt++);
    turn2.insert(turn2.end(), message.begin(), message.end());
    const Stream second = complete(port, turn2, 2);
    std::vector<int64_t> fresh = turn2;
    fresh[0] = fresh[0] == 33 ? 34 : 33;  // shares no prefix with anything cached
    const Stream cold = complete(port, fresh, 2);
    ok = ok && first.ok && second.ok && cold.ok;
    cached_turn.push_back(seconds(second.start, second.first));
    uncached_turn.push_back(seconds(cold.start, cold.first));
  }
  server.stop();
  serving.join();

  const double ratio = median(many_tps) / median(lone_tps);
  std::printf("medians of %d repeats:\n", repeats);
  std::printf("  1 stream : %8.1f tokens/s   TTFT %7.1f ms   ITL p50 %6.1f ms  p99 %6.1f ms\n", median(lone_tps),
              1e3 * median(lone_ttft), 1e3 * median(lone_itl50), 1e3 * median(lone_itl99));
  std::printf("  %lld streams: %8.1f tokens/s   TTFT %7.1f ms   ITL p50 %6.1f ms  p99 %6.1f ms\n",
              static_cast<long long>(streams), median(many_tps), 1e3 * median(many_ttft), 1e3 * median(many_itl50),
              1e3 * median(many_itl99));
  std::printf("  %lld-stream / 1-stream aggregate tokens/s: %.2fx (target >= 4x); ITL p50 ratio %.2fx (target <= 2x)\n",
              static_cast<long long>(streams), ratio, median(many_itl50) / median(lone_itl50));
  std::printf("  128-token prompt: TTFT alone %.1f ms, while %lld streams decode %.1f ms: %.2fx (target <= 2x)\n",
              1e3 * median(alone_prefill), static_cast<long long>(streams - 1), 1e3 * median(joined_ttft),
              median(joined_ttft) / median(alone_prefill));
  std::printf("  chat turn 2 over a %lld-token history: TTFT with prompt cache %.1f ms, without %.1f ms: %.1fx faster "
              "(target >= 5x)\n",
              static_cast<long long>(history), 1e3 * median(cached_turn), 1e3 * median(uncached_turn),
              median(uncached_turn) / median(cached_turn));
  std::printf("every request answered: %s\n", ok ? "yes" : "NO");
  return ok ? 0 : 1;
}
