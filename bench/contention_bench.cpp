// Generation on 1 and 2 threads, on a quiet machine and with another program spinning on a core, under each way
// OpenMP's idle threads can wait: libgomp's default (300,000 pauses of spinning), bounded spins (GOMP_SPINCOUNT) —
// what the qkv program sets, see apps/qkv/thread_waits.cpp — and OMP_WAIT_POLICY=PASSIVE (sleep at once); each with a
// fixed thread count and with the session's adaptive one (qkv/core/thread_governor.hpp: 1 thread while that is faster).
// Each run is a child process (libgomp reads its environment once, at start); runs alternate, medians are printed,
// with the ratios the inference issue sets: 2 threads ≥ 1 thread when busy, and quiet speed within 5% of the default.
// A second table times a later 256-token prompt in the same session (a chat's next turn, a server's next request):
// a step of a kind the governor has not seen, which starts on the count the decoding steps chose.
//   qkv_contention_bench [--shape small|qwen3-0.6b] [--tokens N] [--repeats R] [--smoke]
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "qkv/kernels/threads.hpp"
#include "qkv/nn/session.hpp"
#include "qkv/nn/hf.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string config_json(const std::string& shape) {
  if (shape == "smoke")
    return R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": true})";
  if (shape == "small")  // 42 M parameters: a learner's model, where a token is a few milliseconds
    return R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536,
      "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": true})";
  if (shape == "qwen3-0.6b")
    return R"({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
      "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": true})";
  std::fprintf(stderr, "unknown --shape %s: small, qwen3-0.6b (or smoke)\n", shape.c_str());
  std::exit(2);
}

// Tokens of the later prompt each child times: a chat's next turn, or a server's next request, in the same session
constexpr int64_t kLaterPrompt = 256;

// The child: loads the folder, generates greedily through a session (adaptive: its ThreadGovernor chooses each
// step's thread count; fixed: always `threads`), then feeds a later prompt of kLaterPrompt tokens in the same session.
// Prints its decoding rate (tokens/s after the first token) and the later prompt's (tokens/s to its first token).
int run(const fs::path& dir, int threads, int64_t tokens, bool adaptive) {
  qkv::set_num_threads(threads);
  auto model = qkv::nn::load_hf_decoder(dir.string());
  model->eval();
  qkv::nn::GenerationRequest request;
  request.prompt.resize(16);
  for (size_t i = 0; i < request.prompt.size(); ++i)
    request.prompt[i] = static_cast<int64_t>((i * 7919 + 11) % model->config.vocab_size);
  request.max_new_tokens = tokens;
  request.sampling.greedy = true;
  qkv::nn::SessionOptions options;
  options.adapt_threads = adaptive;
  qkv::nn::Session session(*model, options);
  std::vector<Clock::time_point> stamps;
  qkv::nn::generate(session, {request}, [&](size_t, int64_t) {
    stamps.push_back(Clock::now());
    return true;
  });
  const double seconds = std::chrono::duration<double>(stamps.back() - stamps.front()).count();
  qkv::nn::GenerationRequest later;
  for (int64_t i = 0; i < kLaterPrompt; ++i)
    later.prompt.push_back((i * 104729 + 3) % model->config.vocab_size);
  later.max_new_tokens = 1;
  later.sampling.greedy = true;
  const auto start = Clock::now();
  qkv::nn::generate(session, {later});
  const double prompt_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("%.6f %.6f\n", static_cast<double>(stamps.size() - 1) / seconds,
              static_cast<double>(kLaterPrompt) / prompt_seconds);
  return 0;
}

pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& env, int out_fd) {
  std::vector<char*> argv, envp;
  std::vector<std::string> args_copy = args, env_copy;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    if (entry.rfind("OMP_WAIT_POLICY=", 0) == 0 || entry.rfind("GOMP_SPINCOUNT=", 0) == 0) continue;
    env_copy.push_back(entry);
  }
  for (const auto& e : env) env_copy.push_back(e);
  for (auto& a : args_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (out_fd >= 0) posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
  pid_t pid = -1;
  if (posix_spawn(&pid, args_copy[0].c_str(), &actions, nullptr, argv.data(), envp.data()) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// One child run: its decoding and later prompt's tokens/s, or zeros when it failed.
std::pair<double, double> measure(const char* self, const fs::path& dir, int threads, int64_t tokens,
                                  const std::vector<std::string>& env, bool adaptive) {
  int fds[2];
  if (pipe(fds) != 0) return {0.0, 0.0};
  const pid_t pid = spawn({self, "--run", dir.string(), std::to_string(threads), std::to_string(tokens),
                          adaptive ? "adaptive" : "fixed"},
                         env, fds[1]);
  close(fds[1]);
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof buffer)) > 0;) out.append(buffer, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  if (pid <= 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return {0.0, 0.0};
  double decoding = 0, prompt = 0;
  if (std::sscanf(out.c_str(), "%lf %lf", &decoding, &prompt) != 2) return {0.0, 0.0};
  return {decoding, prompt};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--run")
    return run(argv[2], std::atoi(argv[3]), std::atoll(argv[4]), std::string(argv[5]) == "adaptive");
  std::string shape = "small";
  int64_t tokens = 64;
  int repeats = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--shape") shape = next();
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--smoke") shape = "smoke", tokens = 4, repeats = 1;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("qkv_contention_" + shape);
  if (!fs::exists(dir / "config.json")) {
    qkv::Generator gen(7);
    qkv::nn::Decoder model(qkv::nn::decoder_config_from_hf(config_json(shape), shape), gen);
    qkv::nn::save_hf_folder(dir.string(), model);
    std::printf("made %s: %lld parameters, random weights\n", dir.c_str(), static_cast<long long>(model.parameter_count()));
  }
  const char* self = "/proc/self/exe";
  char path[4096];
  const ssize_t n = readlink(self, path, sizeof path - 1);
  if (n <= 0) return 1;
  path[n] = 0;

  // The first row is the reference ("today": libgomp's default, a fixed count); the qkv row is what the qkv program
  // and a default Session do.
  struct Policy {
    const char* name;
    std::vector<std::string> env;
    bool adaptive;
  };
  const std::vector<Policy> policies = {{"libgomp default, fixed", {}, false},
                                        {"GOMP_SPINCOUNT=1000, fixed", {"GOMP_SPINCOUNT=1000"}, false},
                                        {"GOMP_SPINCOUNT=1000, adaptive (qkv)", {"GOMP_SPINCOUNT=1000"}, true},
                                        {"OMP_WAIT_POLICY=PASSIVE, fixed", {"OMP_WAIT_POLICY=PASSIVE"}, false},
                                        {"OMP_WAIT_POLICY=PASSIVE, adaptive", {"OMP_WAIT_POLICY=PASSIVE"}, true}};
  // rates[busy][policy][threads] (decoding) and prompt_rates (the later prompt)
  std::map<int, std::map<int, std::map<int, std::vector<double>>>> rates, prompt_rates;
  for (int busy = 0; busy < 2; ++busy) {
    pid_t spinner = -1;
    if (busy) {
      spinner = fork();
      if (spinner == 0) {
        volatile uint64_t counter = 0;  // a busy core: the loop's stores cannot be optimised away
        for (;;) counter = counter + 1;
      }
    }
    for (int r = 0; r < repeats; ++r)
      for (size_t p = 0; p < policies.size(); ++p)
        for (int threads = 1; threads <= 2; ++threads) {
          const auto [decoding, prompt] = measure(path, dir, threads, tokens, policies[p].env, policies[p].adaptive);
          rates[busy][static_cast<int>(p)][threads].push_back(decoding);
          prompt_rates[busy][static_cast<int>(p)][threads].push_back(prompt);
        }
    if (spinner > 0) {
      kill(spinner, SIGKILL);
      waitpid(spinner, nullptr, 0);
    }
  }
  auto table = [&](auto& r) {
    std::printf("%-38s %9s %9s %9s | %9s %9s %9s | %s\n", "idle threads wait by, count", "quiet 1t", "quiet 2t",
                "2t/1t", "busy 1t", "busy 2t", "2t/1t", "quiet 2t vs default");
    const double reference = median(r[0][0][2]);
    for (size_t p = 0; p < policies.size(); ++p) {
      const double q1 = median(r[0][p][1]), q2 = median(r[0][p][2]);
      const double b1 = median(r[1][p][1]), b2 = median(r[1][p][2]);
      std::printf("%-38s %9.1f %9.1f %8.2fx | %9.1f %9.1f %8.2fx | %.2fx\n", policies[p].name, q1, q2, q2 / q1, b1, b2,
                  b2 / b1, q2 / reference);
    }
  };
  std::printf("\n%s, greedy, %lld new tokens, tokens/s (median of %d alternating runs)\n", shape.c_str(),
              static_cast<long long>(tokens), repeats);
  table(rates);
  std::printf("\nthen a %lld-token prompt in the same session (a chat's next turn, a server's next request), "
              "tokens/s\n", static_cast<long long>(kLaterPrompt));
  table(prompt_rates);
  std::printf("targets: busy 2t/1t >= 1.0; quiet 2t within 5%% of the default\n");
  return 0;
}
