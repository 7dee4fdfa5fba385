// `qkv serve`: the OpenAI-compatible HTTP server (qkv/serve/server.hpp) as a command — its options, loading the
// model while /health already answers, and SIGTERM/SIGINT: stop taking requests, finish or cancel those in flight,
// exit 0. Not here: HTTP and scheduling (src/serve/).
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "commands.hpp"
#include "options.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/serve/server.hpp"

namespace qkv::cli {

namespace {
volatile std::sig_atomic_t g_signal = 0;  // the last SIGTERM or SIGINT received

struct ServeCommand {
  std::string checkpoint, adapter;
  std::string kv_cache = "f32";  // --kv-cache, into server.kv_cache
  serve::ServerOptions server;
};
ServeCommand& serve_command() {
  static ServeCommand command;
  return command;
}
}  // namespace

Runner setup_serve(CLI::App& command, CommandContext&) {
  ServeCommand& c = serve_command();
  CLI::App* cmd = &command;
  cmd->add_option("--checkpoint,MODEL", c.checkpoint,
                  "The model: a Hugging Face folder or any checkpoint qkv reads; --checkpoint may be left out")
      ->required();
  cmd->add_option("--adapter", c.adapter, "A PEFT LoRA adapter folder to apply");
  cmd->add_option("--host", c.server.host, "Address to listen on (127.0.0.1: this machine only)")->capture_default_str();
  cmd->add_option("--port", c.server.port, "Port to listen on (0: any free one, printed)")->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--parallel", c.server.parallel, "Requests generated at once")->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--queue-size", c.server.queue_size, "Requests that may wait beyond those (more get 429)")
      ->capture_default_str()->check(CLI::Range(0, 65536));
  cmd->add_option("--ctx-size", c.server.context, "Tokens a request may hold, prompt + reply (0: the model's context)")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->add_option("--cache-tokens", c.server.prompt_cache_tokens,
                  "Tokens of finished conversations kept so a next turn computes only its new tokens (-1: one context, "
                  "at most 8192; 0: no prompt cache)")
      ->capture_default_str()->check(CLI::Range(int64_t{-1}, int64_t{1} << 40));
  add_kv_cache_option(*cmd, c.kv_cache);
  cmd->add_option("--api-key", c.server.api_key, "Require 'Authorization: Bearer KEY' (default: $QKV_API_KEY; none: open)");
  cmd->add_option("--model-name", c.server.model_name, "The model id /v1/models reports (default: the folder's name)");
  cmd->add_option("--max-body", c.server.max_body_bytes, "Largest request body in bytes (more get 413)")
      ->capture_default_str()->check(CLI::Range(size_t{1024}, size_t{1} << 30));
  cmd->add_option("--timeout", c.server.read_timeout_seconds, "Seconds a client may stay silent while sending or not read")
      ->capture_default_str()->check(CLI::Range(1, 3600));
  cmd->add_option("--request-timeout", c.server.request_deadline_seconds,
                  "Seconds a request's headers and body may take to arrive in all (0: no limit)")
      ->capture_default_str()->check(CLI::Range(0, 3600));
  return [] { return run_serve(); };
}

int run_serve() {
  ServeCommand& c = serve_command();
  if (c.server.api_key.empty())
    if (const char* key = std::getenv("QKV_API_KEY")) c.server.api_key = key;
  c.server.write_timeout_seconds = c.server.read_timeout_seconds;
  c.server.kv_cache = *kernels::weight_type_from_name(c.kv_cache);  // checked by the option
  // A signal only sets a flag (all a handler may safely do); a watcher thread polls it and calls stop(), which locks
  // and joins. (Blocking the signals and sigwait-ing would not do: OpenBLAS starts threads before main, and the
  // kernel may hand the signal to one of them.) A client gone mid-write must not kill the process: SIGPIPE off.
  std::signal(SIGPIPE, SIG_IGN);
  struct sigaction action {};
  action.sa_handler = [](int sig) { g_signal = sig; };
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  serve::Server server(c.server);
  const int port = server.bind();
  std::fprintf(stderr, "qkv serve: listening on http://%s:%d (loading %s)%s\n", c.server.host.c_str(), port,
               c.checkpoint.c_str(), c.server.api_key.empty() ? "" : "; an API key is required");
  std::atomic<bool> done{false}, failed{false}, stopping{false};
  std::thread loader([&] {
    try {
      nn::PretrainedOptions o;
      o.adapter = c.adapter;
      auto model = nn::load_pretrained(c.checkpoint, o);
      if (model->is_classifier() || model->model->is_classifier())
        throw UsageError(model->description + " is a classifier, not a language model: it has nothing to generate with");
      std::string name = std::filesystem::path(c.checkpoint).filename().string();
      if (name.empty()) name = std::filesystem::path(c.checkpoint).parent_path().filename().string();
      const std::string description = model->description;
      server.set_model(std::move(model), name);
      std::fprintf(stderr, "qkv serve: ready: %s\n", description.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "qkv serve: error: %s\n", e.what());
      server.set_load_error(e.what());
      failed = true;
      stopping = true;
    }
  });
  std::thread waiter([&] {
    while (!done) {  // stop() again each tick until serve() returns: it may not have started listening yet
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int sig = g_signal;
      if ((sig == SIGTERM || sig == SIGINT) && !stopping) {
        std::fprintf(stderr, "qkv serve: %s: finishing the requests in flight, then exiting\n",
                     sig == SIGTERM ? "SIGTERM" : "SIGINT");
        stopping = true;
      }
      if (stopping) server.stop();
    }
  });
  const bool clean = server.serve();
  loader.join();
  done = true;
  waiter.join();
  server.stop();
  if (failed) return 1;
  std::fprintf(stderr, "qkv serve: stopped\n");
  return clean ? 0 : 1;
}

}  // namespace qkv::cli
