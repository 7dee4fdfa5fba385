// The server's scheduler: a bounded queue of generation requests and a step loop on one thread doing continuous
// batching over one nn::Session — every running request is a sequence of the session's block KV cache, and each step
// is ONE Session::decode of a batch holding the next token of every decoding request plus prompt pieces of those that
// joined; a prompt cache lets a new request fork the KV blocks of an earlier (kept) or running sequence its prompt
// begins with. Per-request token callbacks (which can stop their request) and cancellation from any thread. What a
// request asks for is tokens in, tokens out; text, HTTP and JSON belong to server.hpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/tensor.hpp"  // kernels::WeightType

namespace qkv::nn {
class Decoder;
}

namespace qkv::serve {

// How a request's next token is picked: fields of the session API's nn::SamplerOptions (penalties, then greedy or
// temperature, top-k, top-p, and a seeded draw); each running request owns an nn::Sampler made from them.
struct SamplingParams {
  bool greedy = false;              // the argmax (as temperature 0)
  double temperature = 1.0;         // 0: greedy
  int64_t top_k = 0;                // 0: no top-k
  double top_p = 1.0;               // 1: no nucleus
  double presence_penalty = 0.0;    // subtracted once from every token the reply has produced (OpenAI's meaning)
  double frequency_penalty = 0.0;   // subtracted once per time a token was produced
  uint64_t seed = 0;                // the draw's random stream
  int64_t vocab_limit = 0;          // sample only ids below this (0: the model's whole vocabulary)
};

// Why a request ended (OpenAI's finish_reason words: finish_reason_name)
enum class FinishReason {
  Stop,       // a stop token, or the token callback stopped it (a stop string)
  Length,     // max_new_tokens reached
  Cancelled,  // cancel(), the token callback said so, or the server shut down
  Error,      // the model failed on it (Outcome::error says how)
};
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "cancelled", "error"

// What the token callback says after each token
enum class TokenVerdict {
  Continue,  // go on
  Stop,      // the request is complete (finish_reason "stop": a stop string was seen)
  Cancel,    // nobody wants the rest (a client gone)
};

// What a request produced, handed to its on_finish
struct Outcome {
  FinishReason finish = FinishReason::Length;  // why it ended
  std::vector<int64_t> tokens;                 // the new tokens, without a stop token
  int64_t prompt_tokens = 0;                   // tokens of the prompt
  int64_t cached_tokens = 0;                   // of those, taken from the prompt cache (not computed again)
  double queued_seconds = 0;                   // from submit to the first step that ran it
  double first_token_seconds = 0;              // from submit to the first token (0: none)
  std::string error;                           // for FinishReason::Error: what failed
};

// One generation request
struct GenerationRequest {
  std::vector<int64_t> prompt;     // the tokens to continue (not empty; ids below the model's vocabulary)
  int64_t max_new_tokens = 16;     // tokens to add at most (≥ 1)
  SamplingParams sampling;         // how tokens are picked
  std::vector<int64_t> stop_ids;   // tokens that end it (not passed on, not counted)
  // Sees each new token (never a stop id), on the scheduler's thread: keep it short, and never block on a client.
  std::function<TokenVerdict(int64_t token)> on_token;
  // Called exactly once when the request ends, whatever the reason, on the scheduler's thread (or on the thread that
  // called shutdown() for requests still queued then).
  std::function<void(const Outcome&)> on_finish;
};

// Sizes and limits of a scheduler
struct SchedulerOptions {
  int64_t parallel = 4;       // requests that run at once (slots)
  int64_t queue_size = 16;    // requests that may wait for a slot beyond those; more → QueueFull
  int64_t context = 0;        // the most tokens (prompt + reply) a request may hold; 0: the model's context length
  // Prompt cache: finished requests' sequences are kept (least recently used evicted first) while they hold at most
  // this many tokens together, so a later prompt that begins with one of them (a chat's next turn) computes only the
  // rest. −1: one context's worth, at most 8192; 0: off (running sequences are still shared).
  int64_t prompt_cache_tokens = -1;
  int64_t max_batch_tokens = 512;  // a step feeds at most this many tokens (decoding requests come first)
  // Prompts are fed in pieces cut at multiples of this (the same cuts as nn::generate, so a prompt computes the same)
  int64_t prefill_chunk = 256;
  // How the session's KV cache stores keys and values (nn::SessionOptions::kv_type): f32, f16, bf16 or q8_0
  kernels::WeightType kv_type = kernels::WeightType::F32;
};

// Thrown by Scheduler::submit when parallel + queue_size requests are already admitted (HTTP 429)
class QueueFull : public Error {
 public:
  using Error::Error;
};

// Counters for /metrics, read together under the scheduler's lock
struct SchedulerStats {
  int64_t queued = 0, active = 0;            // requests waiting, requests running
  int64_t completed = 0, cancelled = 0, failed = 0, rejected = 0;  // requests ended so (rejected: QueueFull)
  int64_t prompt_tokens = 0, generated_tokens = 0;  // prompt tokens of requests that ran, tokens produced
  int64_t prompt_cache_hit_tokens = 0;       // prompt tokens taken from cached sequences instead of computed
  int64_t prefilled_tokens = 0;              // prompt tokens computed (prompt_tokens − hits, of started requests)
  int64_t kv_cache_bytes = 0;                // bytes of the session's KV blocks in use (running and kept sequences)
  int64_t kv_cache_tokens = 0;               // positions the session's sequences hold (shared prefixes once per holder)
  int64_t kv_cache_blocks_used = 0;          // the session's blocks in use
  int64_t kv_cache_blocks_total = 0;         // the blocks it may hold
  int64_t prompt_cache_sequences = 0;        // finished sequences kept for the prompt cache
  int64_t batch_tokens_max = 0;              // the most tokens one step fed (continuous batching at work)
  double first_token_seconds_sum = 0;        // Σ time to first token over requests that produced one
  int64_t first_token_count = 0;             // how many did
  int64_t steps = 0;                         // steps the loop ran
};

// A queue of requests and the loop that runs them (llama.cpp's server slots). Thread-safe: submit, cancel, stats and
// shutdown may be called from any thread; callbacks run on the loop's thread.
class Scheduler {
 public:
  // Starts the loop's thread. The model must outlive the scheduler. ValueError for options out of range (or for a
  // classifier, which does not generate).
  Scheduler(const nn::Decoder& model, const SchedulerOptions& options);
  ~Scheduler();  // shutdown(), then joins the loop
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request; returns its id (for cancel). QueueFull when the queue is full; ValueError for a request out of
  // range (an empty prompt, an id outside the vocabulary, max_new_tokens < 1, prompt + max_new_tokens past the
  // context: check_fits says so first); ShapeError after shutdown().
  int64_t submit(GenerationRequest request);
  // Cancels a request (queued or running): it ends at the next step with FinishReason::Cancelled and its cache is
  // freed. Unknown or finished ids are ignored.
  void cancel(int64_t id);
  // Stops taking requests; `cancel_running`: ends those in flight at the next step, else lets them finish. Queued
  // requests are cancelled. Returns when nothing runs any more.
  void shutdown(bool cancel_running);
  SchedulerStats stats() const;  // a snapshot of the counters
  // Runs `job` on the loop's thread between two steps, so that other work on the model (the chat page's attention
  // rows) never competes with generation for the threads, and waits for it; the job's exception reaches the caller.
  // ShapeError after shutdown().
  void run_between_steps(std::function<void()> job);

  int64_t context() const { return context_; }  // the most tokens a request may hold
  const SchedulerOptions& options() const { return options_; }  // what it was made with
  // ValueError naming the sizes and the fix when `prompt_tokens` + `max_new_tokens` passes context()
  void check_fits(int64_t prompt_tokens, int64_t max_new_tokens) const;

 private:
  struct Slot;
  struct State;
  void loop();
  void admit();
  void step();
  bool start(Slot& slot);
  bool waits_for_prefix(const Slot& slot) const;
  void finish(Slot& slot, FinishReason reason, const std::string& error = {});
  void cache_stats();  // the KV cache's figures into stats_ (under the lock)

  const nn::Decoder& model_;
  SchedulerOptions options_;
  int64_t context_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::unique_ptr<Slot>> queue_;   // waiting, oldest first
  std::vector<std::unique_ptr<Slot>> active_; // running (touched by the loop only, counted under the lock)
  std::vector<int64_t> cancelled_ids_;        // cancel() requests the loop has not applied yet
  std::deque<std::packaged_task<void()>> jobs_;  // run_between_steps' jobs, not yet run
  int64_t next_id_ = 1, admitted_ = 0;        // admitted_: queued + active
  bool accepting_ = true, stopping_ = false, cancel_running_ = false;
  SchedulerStats stats_;
  std::unique_ptr<State> state_;              // the session and the prompt cache (the loop's alone)
  std::thread thread_;
};

}  // namespace qkv::serve
