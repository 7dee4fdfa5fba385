// The scheduler's queue and step loop (see qkv/serve/scheduler.hpp). One thread runs the model; HTTP threads only
// queue, cancel and read counters, so the model never runs two things at once and a slow client never stalls it.
#include "qkv/serve/scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "qkv/core/autograd.hpp"
#include "qkv/core/random.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/language_model.hpp"

namespace qkv::serve {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "error";
}

// One request and, once it runs, its KV cache. With sessions the cache becomes a sequence id of nn::Session.
struct Scheduler::Slot {
  int64_t id = 0;
  GenerationRequest request;
  Outcome outcome;
  Clock::time_point submitted = Clock::now();
  bool started = false, cancel = false, done = false;
  nn::KVCache cache;
  std::vector<int64_t> sequence;           // prompt + reply: what the cache holds (re-encoded at a rotation switch)
  Tensor logits;                           // (1, V): the next token's
  Generator gen;
  std::unordered_map<int64_t, int64_t> counts;  // how often each token was produced (presence/frequency penalties)
  std::vector<float> scratch;              // penalised logits
};

Scheduler::Scheduler(const nn::LanguageModel& model, const SchedulerOptions& options) : model_(model), options_(options) {
  if (options.parallel < 1 || options.parallel > 256)
    throw ValueError("--parallel " + std::to_string(options.parallel) + " is out of range; give 1 to 256 requests at once");
  if (options.queue_size < 0 || options.queue_size > 65536)
    throw ValueError("the queue size " + std::to_string(options.queue_size) + " is out of range; give 0 to 65536");
  if (options.context < 0) throw ValueError("--ctx-size must not be negative (0: the model's context length)");
  context_ = options.context > 0 ? std::min(options.context, model.context_length()) : model.context_length();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  shutdown(true);
  if (thread_.joinable()) thread_.join();
}

void Scheduler::check_fits(int64_t prompt_tokens, int64_t max_new_tokens) const {
  if (prompt_tokens + max_new_tokens > context_)
    throw ValueError("this request needs " + std::to_string(prompt_tokens) + " prompt tokens + " +
                     std::to_string(max_new_tokens) + " new tokens, past the server's context of " +
                     std::to_string(context_) + " tokens; shorten the messages or lower max_tokens");
}

int64_t Scheduler::submit(GenerationRequest request) {
  if (request.prompt.empty()) throw ValueError("the prompt is empty; give at least one token");
  if (request.max_new_tokens < 1) throw ValueError("max_tokens must be at least 1");
  const int64_t V = model_.vocab_size();
  for (int64_t id : request.prompt)
    if (id < 0 || id >= V)
      throw ValueError("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  check_fits(static_cast<int64_t>(request.prompt.size()), request.max_new_tokens);
  auto slot = std::make_unique<Slot>();
  slot->request = std::move(request);
  slot->outcome.prompt_tokens = static_cast<int64_t>(slot->request.prompt.size());
  slot->gen = Generator(slot->request.sampling.seed);
  std::lock_guard lock(mutex_);
  if (!accepting_) throw ShapeError("the server is shutting down; no new requests are taken");
  if (admitted_ >= options_.parallel + options_.queue_size) {
    ++stats_.rejected;
    throw QueueFull("the server is busy: " + std::to_string(admitted_) + " requests are running or queued (--parallel " +
                    std::to_string(options_.parallel) + ", queue " + std::to_string(options_.queue_size) +
                    "); retry shortly");
  }
  slot->id = next_id_++;
  const int64_t id = slot->id;
  queue_.push_back(std::move(slot));
  ++admitted_;
  wake_.notify_all();
  return id;
}

void Scheduler::cancel(int64_t id) {
  std::lock_guard lock(mutex_);
  cancelled_ids_.push_back(id);
  wake_.notify_all();
}

void Scheduler::shutdown(bool cancel_running) {
  std::unique_lock lock(mutex_);
  accepting_ = false;
  stopping_ = true;
  cancel_running_ = cancel_running_ || cancel_running;
  wake_.notify_all();
  idle_.wait(lock, [&] { return admitted_ == 0; });
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lock(mutex_);
  SchedulerStats s = stats_;
  s.queued = static_cast<int64_t>(queue_.size());
  s.active = admitted_ - s.queued;
  return s;
}

void Scheduler::loop() {
  NoGradGuard no_grad;
  for (;;) {
    std::vector<std::unique_ptr<Slot>> dropped;  // queued requests cancelled before they ran
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !active_.empty() || !cancelled_ids_.empty() ||
               (!queue_.empty() && static_cast<int64_t>(active_.size()) < options_.parallel);
      });
      // Apply cancellations: a queued request leaves the queue, a running one ends at this step.
      auto wanted = [&](int64_t id) {
        return (stopping_) || std::find(cancelled_ids_.begin(), cancelled_ids_.end(), id) != cancelled_ids_.end();
      };
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (wanted((*it)->id)) {
          dropped.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& slot : active_)
        if ((stopping_ && cancel_running_) ||
            std::find(cancelled_ids_.begin(), cancelled_ids_.end(), slot->id) != cancelled_ids_.end())
          slot->cancel = true;
      cancelled_ids_.clear();
      admit();
    }
    for (auto& slot : dropped) finish(*slot, FinishReason::Cancelled);
    if (!dropped.empty()) {
      std::lock_guard lock(mutex_);
      admitted_ -= static_cast<int64_t>(dropped.size());
      stats_.cancelled += static_cast<int64_t>(dropped.size());
    }
    step();
    std::lock_guard lock(mutex_);
    if (stopping_ && admitted_ == 0) {
      idle_.notify_all();
      if (queue_.empty()) return;
    }
  }
}

// Moves queued requests into free slots, oldest first (under the lock).
void Scheduler::admit() {
  while (!queue_.empty() && static_cast<int64_t>(active_.size()) < options_.parallel) {
    active_.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
}

void Scheduler::finish(Slot& slot, FinishReason reason, const std::string& error) {
  slot.done = true;
  slot.outcome.finish = reason;
  slot.outcome.error = error;
  slot.cache = nn::KVCache();  // the memory goes back now, not when the HTTP side lets go
  slot.logits = Tensor();
  if (slot.request.on_finish) {
    try {
      slot.request.on_finish(slot.outcome);
    } catch (...) {  // a callback's failure must not take the loop down; the request is over either way
    }
  }
}

// One step: every running request that has not begun feeds its prompt, then each one picks a token and feeds it.
// Today the requests run one after another on their own caches; with nn::Session this loop builds one nn::Batch
// (each slot's prompt piece or last token, with its sequence id) and calls Session::decode once.
void Scheduler::step() {
  const int64_t V = model_.vocab_size();
  for (auto& holder : active_) {
    Slot& slot = *holder;
    const GenerationRequest& r = slot.request;
    if (slot.cancel) {
      finish(slot, FinishReason::Cancelled);
      continue;
    }
    try {
      if (!slot.started) {  // prefill: the cache is made for this request's prompt and reply, as nn::generate does
        slot.started = true;
        slot.outcome.queued_seconds = seconds_since(slot.submitted);
        slot.sequence = r.prompt;
        slot.cache = model_.make_cache(1, static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
        slot.logits = model_.forward_cached(r.prompt, 1, static_cast<int64_t>(r.prompt.size()), slot.cache);
      }
      const SamplingParams& p = r.sampling;
      const int64_t limit = p.vocab_limit > 0 ? std::min(V, p.vocab_limit) : V;
      const float* row = slot.logits.data();
      if ((p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) && !slot.counts.empty()) {
        slot.scratch.assign(row, row + V);
        for (const auto& [token, count] : slot.counts)
          slot.scratch[static_cast<size_t>(token)] -=
              static_cast<float>(p.presence_penalty + static_cast<double>(count) * p.frequency_penalty);
        row = slot.scratch.data();
      }
      nn::SamplingOptions o;
      o.temperature = p.greedy ? 0.0 : p.temperature;
      o.top_k = p.top_k;
      o.top_p = p.top_p;
      const int64_t token = nn::sample_token(row, limit, o, slot.gen);
      if (std::find(r.stop_ids.begin(), r.stop_ids.end(), token) != r.stop_ids.end()) {
        finish(slot, FinishReason::Stop);
        continue;
      }
      if (slot.outcome.tokens.empty()) slot.outcome.first_token_seconds = seconds_since(slot.submitted);
      slot.outcome.tokens.push_back(token);
      slot.sequence.push_back(token);
      ++slot.counts[token];
      const TokenVerdict verdict = r.on_token ? r.on_token(token) : TokenVerdict::Continue;
      if (verdict == TokenVerdict::Stop) {
        finish(slot, FinishReason::Stop);
        continue;
      }
      if (verdict == TokenVerdict::Cancel) {
        finish(slot, FinishReason::Cancelled);
        continue;
      }
      if (static_cast<int64_t>(slot.outcome.tokens.size()) >= r.max_new_tokens) {
        finish(slot, FinishReason::Length);
        continue;
      }
      if (slot.cache.length == model_.rotation_switch() && model_.rotation_switch() > 0) {
        // LongRoPE (Phi-3): crossing the switch, the whole sequence is encoded again with the long factors, as alone
        slot.cache = model_.make_cache(1, static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
        slot.logits = model_.forward_cached(slot.sequence, 1, static_cast<int64_t>(slot.sequence.size()), slot.cache);
      } else {
        slot.logits = model_.forward_cached(std::vector<int64_t>{token}, 1, 1, slot.cache);
      }
    } catch (const std::exception& e) {
      finish(slot, FinishReason::Error, e.what());
    }
  }
  // Count, then drop the requests that ended.
  std::lock_guard lock(mutex_);
  ++stats_.steps;
  int64_t bytes = 0, tokens = 0;
  for (auto it = active_.begin(); it != active_.end();) {
    Slot& slot = **it;
    if (!slot.done) {
      bytes += slot.cache.bytes();
      tokens += slot.cache.length;
      ++it;
      continue;
    }
    stats_.prompt_tokens += slot.started ? slot.outcome.prompt_tokens : 0;
    stats_.generated_tokens += static_cast<int64_t>(slot.outcome.tokens.size());
    if (!slot.outcome.tokens.empty()) {
      stats_.first_token_seconds_sum += slot.outcome.first_token_seconds;
      ++stats_.first_token_count;
    }
    if (slot.outcome.finish == FinishReason::Cancelled) ++stats_.cancelled;
    else if (slot.outcome.finish == FinishReason::Error) ++stats_.failed;
    else ++stats_.completed;
    --admitted_;
    it = active_.erase(it);
  }
  stats_.kv_cache_bytes = bytes;
  stats_.kv_cache_tokens = tokens;
}

}  // namespace qkv::serve
