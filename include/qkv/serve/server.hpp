// `qkv serve`'s HTTP side: OpenAI's chat and text completions (streamed as server-sent events or whole), models,
// tokenize/detokenize, the attention of a token (the chat page's pictures), health and Prometheus metrics, the chat
// page, over cpp-httplib, with the limits a server left running needs
// (API key, body size, read timeouts, max_tokens and context, a bounded queue, cancellation when a client goes away).
// Generation itself is the Scheduler's (scheduler.hpp); loading is nn::load_pretrained's. Not here: the command line
// and signals (apps/qkv/serve.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "qkv/serve/scheduler.hpp"

namespace httplib {
class Server;
}

namespace qkv::nn {
struct Pretrained;
}

namespace qkv::serve {

// What the server listens on and the limits it keeps
struct ServerOptions {
  std::string host = "127.0.0.1";   // loopback unless told otherwise
  int port = 8080;                  // 0: any free port (Server::bind returns it)
  int64_t parallel = 4;             // requests generated at once
  int64_t queue_size = 16;          // requests that may wait beyond those (then 429 with Retry-After)
  int64_t context = 0;              // tokens a request may hold, prompt + reply (0: the model's context length)
  // Tokens of finished conversations kept for the prompt cache (−1: one context, at most 8192; 0: off; see
  // SchedulerOptions)
  int64_t prompt_cache_tokens = -1;
  std::string api_key;              // non-empty: every /v1 request needs "Authorization: Bearer <key>" (else 401)
  std::string model_name;           // the id /v1/models reports (empty: the checkpoint's folder name)
  size_t max_body_bytes = 4 << 20;  // larger request bodies get 413
  int read_timeout_seconds = 10;    // a client silent this long while sending is dropped
  int write_timeout_seconds = 10;   // a client not reading this long is dropped (and its request cancelled)
  // A request's headers and body must arrive within this many seconds of its first byte (a client trickling one
  // byte a second does not hold a worker); 0: no limit
  int request_deadline_seconds = 15;
  int drain_seconds = 10;           // on stop(): how long requests in flight may run before they are cancelled
  int threads = 0;                  // HTTP worker threads (0: parallel + queue_size + 8: one per streaming client)
  kernels::WeightType kv_cache = kernels::WeightType::F32;  // how the KV cache stores keys and values (SchedulerOptions)
};

// The HTTP server. Lifecycle: bind() → serve() on one thread (blocks) while another loads the model and calls
// set_model(); /health says 503 until then. stop() from any thread drains and makes serve() return.
class Server {
 public:
  explicit Server(const ServerOptions& options);  // ValueError for options out of range
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port; returns the port bound. IoError naming the address and the fix when it cannot.
  int bind();
  // Serves until stop(); true when it stopped cleanly
  bool serve();
  // The model is loaded: requests are served from now on. `name` is the id reported when options.model_name is empty.
  void set_model(std::unique_ptr<nn::Pretrained> model, const std::string& name);
  // The model could not be loaded: /health reports `message` with 500 until stop()
  void set_load_error(const std::string& message);
  // Stops taking requests (new ones get 503), lets those in flight finish for up to options.drain_seconds, cancels
  // the rest, and makes serve() return. Safe from any thread, more than once; not from a signal handler.
  void stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace qkv::serve
