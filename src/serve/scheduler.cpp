// The scheduler's queue and step loop (see qkv/serve/scheduler.hpp). One thread runs the model; HTTP threads only
// queue, cancel and read counters, so the model never runs two things at once and a slow client never stalls it.
// Each step is one nn::Session::decode over every running request; the prompt cache is the session's forks.
#include "qkv/serve/scheduler.hpp"

#include <algorithm>
#include <chrono>

#include "qkv/core/autograd.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/sampler.hpp"
#include "qkv/nn/session.hpp"

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

// One request and, once it runs, its sequence of the session
struct Scheduler::Slot {
  int64_t id = 0;
  GenerationRequest request;
  Outcome outcome;
  Clock::time_point submitted = Clock::now();
  bool started = false, cancel = false, done = false;
  int64_t seq = -1;               // its session sequence once started
  int64_t most = 0;               // the positions it may come to hold: prompt + max_new_tokens
  std::vector<int64_t> pending;   // tokens still to feed: the prompt's uncached rest, then each sampled token
  size_t fed = 0;                 // of pending, fed already
  nn::Sampler sampler;            // its own chain and random stream: the same draws in any batch
};

// The loop's own: the session every request runs in and the finished sequences kept for the prompt cache
struct Scheduler::State {
  nn::Session session;
  struct Kept {
    int64_t seq = 0;
    uint64_t used = 0;  // when a request last finished in it or forked from it (LRU)
  };
  std::vector<Kept> kept;
  uint64_t clock = 0;
  int64_t cache_tokens = 0;  // the prompt cache's budget in positions
  State(const nn::Decoder& model, const nn::SessionOptions& o) : session(model, o) {}

  int64_t kept_tokens() const {
    int64_t n = 0;
    for (const Kept& k : kept) n += session.length(k.seq);
    return n;
  }
  // Closes the least recently used kept sequence other than `except`; false when there is none
  bool evict_one(int64_t except = -1) {
    auto victim = kept.end();
    for (auto it = kept.begin(); it != kept.end(); ++it)
      if (it->seq != except && (victim == kept.end() || it->used < victim->used)) victim = it;
    if (victim == kept.end()) return false;
    session.close(victim->seq);
    kept.erase(victim);
    return true;
  }
  void drop(int64_t seq) {
    for (auto it = kept.begin(); it != kept.end(); ++it)
      if (it->seq == seq) {
        session.close(seq);
        kept.erase(it);
        return;
      }
  }
  bool is_kept(int64_t seq) const {
    return std::any_of(kept.begin(), kept.end(), [&](const Kept& k) { return k.seq == seq; });
  }
};

namespace {
nn::SamplerOptions sampler_options(const SamplingParams& p) {
  nn::SamplerOptions o;
  o.greedy = p.greedy;
  o.temperature = p.temperature;
  o.top_k = p.top_k;
  o.top_p = p.top_p;
  o.presence_penalty = p.presence_penalty;
  o.frequency_penalty = p.frequency_penalty;
  o.seed = p.seed;
  o.vocab_limit = p.vocab_limit;
  return o;
}

int64_t blocks_for(int64_t positions, int64_t block_size) { return (positions + block_size - 1) / block_size; }
}  // namespace

Scheduler::Scheduler(const nn::Decoder& model, const SchedulerOptions& options) : model_(model), options_(options) {
  if (options.parallel < 1 || options.parallel > 256)
    throw ValueError("--parallel " + std::to_string(options.parallel) + " is out of range; give 1 to 256 requests at once");
  if (options.queue_size < 0 || options.queue_size > 65536)
    throw ValueError("the queue size " + std::to_string(options.queue_size) + " is out of range; give 0 to 65536");
  if (options.context < 0) throw ValueError("--ctx-size must not be negative (0: the model's context length)");
  if (options.prompt_cache_tokens < -1)
    throw ValueError("the prompt cache size must be −1 (one context), 0 (off) or a number of tokens");
  if (options.max_batch_tokens < 1 || options.prefill_chunk < 1)
    throw ValueError("max_batch_tokens and prefill_chunk must be positive");
  context_ = options.context > 0 ? std::min(options.context, model.context_length()) : model.context_length();
  // The session's blocks: every slot's worst case (prompt + reply up to the context, one block of slack for a fork's
  // copied last block), then the prompt cache's budget (each kept sequence may waste part of a block). Blocks are
  // allocated as sequences reach them: this bounds memory, it does not take it.
  nn::SessionOptions so;
  so.max_batch_tokens = options.max_batch_tokens;
  so.prefill_chunk = options.prefill_chunk;
  so.kv_type = options.kv_type;
  const int64_t bs = so.block_size;
  // The default keeps one context of conversations, at most 8192 positions (a 40 Ki context of a 0.6B model would
  // otherwise keep gigabytes; --cache-tokens asks for more)
  const int64_t cache_tokens =
      options.prompt_cache_tokens < 0 ? std::min<int64_t>(context_, 8192) : options.prompt_cache_tokens;
  const int64_t blocks = options.parallel * (blocks_for(context_, bs) + 1) + blocks_for(cache_tokens, bs) +
                         (cache_tokens > 0 ? options.parallel + 8 : 0);
  so.max_tokens = blocks * bs;
  state_ = std::make_unique<State>(model, so);
  state_->cache_tokens = cache_tokens;
  stats_.kv_cache_blocks_total = state_->session.cache().max_blocks();
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
  slot->sampler = nn::Sampler(sampler_options(request.sampling));  // ValueError for settings out of range
  slot->request = std::move(request);
  slot->outcome.prompt_tokens = static_cast<int64_t>(slot->request.prompt.size());
  slot->most = slot->outcome.prompt_tokens + slot->request.max_new_tokens;
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

void Scheduler::run_between_steps(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  std::future<void> done = task.get_future();
  {
    std::lock_guard lock(mutex_);
    if (!accepting_) throw ShapeError("the server is shutting down; no new requests are taken");
    jobs_.push_back(std::move(task));
    wake_.notify_all();
  }
  done.get();
}

void Scheduler::loop() {
  NoGradGuard no_grad;
  for (;;) {
    std::vector<std::unique_ptr<Slot>> dropped;  // queued requests cancelled before they ran
    std::deque<std::packaged_task<void()>> jobs;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !jobs_.empty() || !active_.empty() || !cancelled_ids_.empty() ||
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
      jobs.swap(jobs_);
    }
    for (auto& job : jobs) job();
    for (auto& slot : dropped) finish(*slot, FinishReason::Cancelled);
    step();
    std::lock_guard lock(mutex_);
    if (stopping_ && admitted_ == 0) {
      idle_.notify_all();
      if (queue_.empty() && jobs_.empty()) return;
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

// Gives a slot its sequence: a fork of the cached or running sequence sharing the longest prefix of its prompt, else
// a new one. The blocks it may come to need must be free beyond what the running requests may still take (kept
// sequences are evicted for them, least recently used first); false when they are not yet: it waits for a later step.
bool Scheduler::start(Slot& slot) {
  State& st = *state_;
  nn::Session& session = st.session;
  const nn::KVBlockCache& cache = session.cache();
  const int64_t bs = cache.block_size();
  const std::vector<int64_t>& prompt = slot.request.prompt;
  // The longest shared prefix, leaving at least one prompt token to feed (its logits give the first token)
  // A model with a rotation switch (LongRoPE, Phi-3) encodes a sequence again from its start when it grows past the
  // switch, writing over every position: shared blocks must never see that, so with such a model only sequences that
  // stay short of the switch share (`most`: the most positions the source may come to hold).
  // A model with recurrent layers (Gated DeltaNet) keeps a state that holds all of a sequence: only a sequence the
  // prompt begins with whole can be forked (a chat's earlier turn, prompt and reply).
  const int64_t rotation_switch = model_.rotation_switch();
  const bool recurrent = cache.state_floats() > 0;
  int64_t source = -1, reuse = 0;
  auto consider = [&](int64_t seq, int64_t most) {
    if (rotation_switch > 0 && (slot.most > rotation_switch || most > rotation_switch)) return;
    const int64_t n = std::min(session.common_prefix(seq, prompt), static_cast<int64_t>(prompt.size()) - 1);
    if (recurrent && n != session.length(seq)) return;
    if (n > reuse) {
      reuse = n;
      source = seq;
    }
  };
  for (const State::Kept& k : st.kept) consider(k.seq, session.length(k.seq));
  for (const auto& other : active_)
    if (other->started && !other->done) consider(other->seq, other->most);
  auto available = [&] {
    int64_t reserved = 0;
    for (const auto& other : active_)
      if (other->started && !other->done) reserved += cache.blocks_to_grow(other->seq, other->most);
    return cache.blocks_free() - reserved;
  };
  // A fork shares the source's blocks; the fork copies a shared, partly filled last block before writing to it, and
  // so does a running source (one more block than it had reserved)
  auto need = [&] {
    const bool running_source = source >= 0 && !st.is_kept(source);
    return blocks_for(slot.most, bs) - reuse / bs + (running_source && reuse % bs != 0 ? 1 : 0);
  };
  while (need() > available() && st.evict_one(source)) {
  }
  if (need() > available() && source >= 0 && st.is_kept(source)) {  // the source itself must go: no reuse
    st.drop(source);
    source = -1;
    reuse = 0;
    while (need() > available() && st.evict_one()) {
    }
  }
  if (need() > available()) return false;
  if (reuse > 0) {
    slot.seq = session.fork(source, reuse);
    if (st.is_kept(source)) {
      if (reuse == session.length(source)) st.drop(source);  // the new sequence holds all of it
      else
        for (State::Kept& k : st.kept)
          if (k.seq == source) k.used = ++st.clock;
    }
  } else {
    slot.seq = session.open();
  }
  slot.started = true;
  slot.outcome.queued_seconds = seconds_since(slot.submitted);
  slot.outcome.cached_tokens = reuse;
  slot.pending.assign(prompt.begin() + reuse, prompt.end());
  slot.fed = 0;
  return true;
}

// Whether a request whose prompt begins with what a started request is still prefilling (a block or more beyond
// what that one holds now) should wait for it: it then forks those positions at a later step instead of computing
// them a second time beside it (two clients sending one system prompt at once). Not where LongRoPE's switch would
// forbid the sharing (see start).
bool Scheduler::waits_for_prefix(const Slot& slot) const {
  const nn::Session& session = state_->session;
  const int64_t bs = session.cache().block_size(), rotation_switch = model_.rotation_switch();
  if (session.cache().state_floats() > 0) return false;  // recurrent states fork whole only (see start)
  const std::vector<int64_t>& prompt = slot.request.prompt;
  for (const auto& other : active_) {
    if (other.get() == &slot || other->done || !other->started || !other->outcome.tokens.empty()) continue;
    if (rotation_switch > 0 && (slot.most > rotation_switch || other->most > rotation_switch)) continue;
    const std::vector<int64_t>& theirs = other->request.prompt;
    const size_t limit = std::min(theirs.size(), prompt.size() - 1);  // one token of ours is always fed
    size_t shared = 0;
    while (shared < limit && theirs[shared] == prompt[shared]) ++shared;
    if (static_cast<int64_t>(shared) >= session.length(other->seq) + bs) return true;
  }
  return false;
}

void Scheduler::finish(Slot& slot, FinishReason reason, const std::string& error) {
  slot.done = true;
  slot.outcome.finish = reason;
  slot.outcome.error = error;
  if (slot.seq >= 0) {
    // A request that ended well leaves its sequence (prompt and reply) to the prompt cache; the rest free theirs now.
    State& st = *state_;
    const bool keep = st.cache_tokens > 0 && (reason == FinishReason::Stop || reason == FinishReason::Length) &&
                      st.session.length(slot.seq) > 0;
    if (keep) {
      st.kept.push_back({slot.seq, ++st.clock});
      while (!st.kept.empty() && st.kept_tokens() > st.cache_tokens && st.evict_one()) {
      }
    } else {
      st.session.close(slot.seq);
    }
    slot.seq = -1;
  }
  slot.pending = {};
  {  // counted and its admission freed before the client hears of it: its next request finds the room this one left
    std::lock_guard lock(mutex_);
    stats_.prompt_tokens += slot.started ? slot.outcome.prompt_tokens : 0;
    stats_.generated_tokens += static_cast<int64_t>(slot.outcome.tokens.size());
    if (!slot.outcome.tokens.empty()) {
      stats_.first_token_seconds_sum += slot.outcome.first_token_seconds;
      ++stats_.first_token_count;
    }
    if (reason == FinishReason::Cancelled) ++stats_.cancelled;
    else if (reason == FinishReason::Error) ++stats_.failed;
    else ++stats_.completed;
    --admitted_;
    cache_stats();
  }
  if (slot.request.on_finish) {
    try {
      slot.request.on_finish(slot.outcome);
    } catch (...) {  // a callback's failure must not take the loop down; the request is over either way
    }
  }
}

// One step: requests that got a slot take a sequence (and what the prompt cache holds of their prompt); then ONE
// batch holds each decoding request's last token and the prompt pieces of those still prefilling, the model runs
// once, and every request whose row came back samples its next token with its own sampler.
void Scheduler::step() {
  State& st = *state_;
  nn::Session& session = st.session;
  const int64_t V = model_.vocab_size();
  for (auto& holder : active_) {
    Slot& slot = *holder;
    if (slot.cancel) finish(slot, FinishReason::Cancelled);
  }
  int64_t hits = 0, computed = 0;
  for (auto& holder : active_) {
    Slot& slot = *holder;
    if (slot.done || slot.started) continue;
    try {
      if (waits_for_prefix(slot)) continue;  // its prefix is being computed: shared at a later step
      if (!start(slot)) break;  // first come, first served: later requests wait behind it
    } catch (const std::exception& e) {
      finish(slot, FinishReason::Error, e.what());
      continue;
    }
    hits += slot.outcome.cached_tokens;
    computed += slot.outcome.prompt_tokens - slot.outcome.cached_tokens;
  }
  {  // counted now: a request this step ends is counted whole before its on_finish
    std::lock_guard lock(mutex_);
    ++stats_.steps;
    stats_.prompt_cache_hit_tokens += hits;
    stats_.prefilled_tokens += computed;
  }
  // The batch: decoding requests first (one token each: inter-token latency), then prompt pieces up to the cap, each
  // cut at the next multiple of prefill_chunk as nn::generate cuts it.
  nn::Batch batch;
  std::vector<Slot*> sampled;  // whose logits row each returned row is
  const int64_t chunk = options_.prefill_chunk, cap = options_.max_batch_tokens;
  for (int pass = 0; pass < 2; ++pass)
    for (auto& holder : active_) {
      Slot& slot = *holder;
      if (slot.done || !slot.started) continue;
      const int64_t left = static_cast<int64_t>(slot.pending.size() - slot.fed);
      const bool decoding = !slot.outcome.tokens.empty();
      if (left <= 0 || decoding != (pass == 0)) continue;
      const int64_t pos = session.length(slot.seq);
      const int64_t piece = std::min(left, (pos / chunk + 1) * chunk - pos);
      if (batch.size() > 0 && batch.size() + piece > cap) continue;  // the next step
      for (int64_t k = 0; k < piece; ++k)
        batch.add(slot.pending[slot.fed + static_cast<size_t>(k)], pos + k, slot.seq, k + 1 == left);
      slot.fed += static_cast<size_t>(piece);
      if (piece == left) sampled.push_back(&slot);
    }
  if (batch.size() > 0) {
    Tensor logits;
    try {
      logits = session.decode(batch);
    } catch (const std::exception& e) {  // nothing changed in the session; the requests in this batch fail
      const std::string what = e.what();
      for (auto& holder : active_)
        if (holder->started && !holder->done &&
            std::any_of(batch.tokens.begin(), batch.tokens.end(), [&](const nn::BatchToken& t) { return t.sequence == holder->seq; }))
          finish(*holder, FinishReason::Error, what);
      sampled.clear();
    }
    for (size_t row = 0; row < sampled.size(); ++row) {
      Slot& slot = *sampled[row];
      const GenerationRequest& r = slot.request;
      if (slot.done) continue;
      try {
        const int64_t token = slot.sampler.sample(logits.data() + static_cast<int64_t>(row) * V, V);
        slot.pending.assign(1, token);
        slot.fed = 0;
        if (std::find(r.stop_ids.begin(), r.stop_ids.end(), token) != r.stop_ids.end()) {
          finish(slot, FinishReason::Stop);
          continue;
        }
        if (slot.outcome.tokens.empty()) slot.outcome.first_token_seconds = seconds_since(slot.submitted);
        slot.outcome.tokens.push_back(token);
        slot.sampler.accept(token);  // the penalties count the reply's tokens (OpenAI's meaning), not the prompt's
        const TokenVerdict verdict = r.on_token ? r.on_token(token) : TokenVerdict::Continue;
        if (verdict == TokenVerdict::Stop) finish(slot, FinishReason::Stop);
        else if (verdict == TokenVerdict::Cancel) finish(slot, FinishReason::Cancelled);
        else if (static_cast<int64_t>(slot.outcome.tokens.size()) >= r.max_new_tokens) finish(slot, FinishReason::Length);
      } catch (const std::exception& e) {
        finish(slot, FinishReason::Error, e.what());
      }
    }
  }
  // Drop the requests that ended (finish counted them).
  std::lock_guard lock(mutex_);
  stats_.batch_tokens_max = std::max(stats_.batch_tokens_max, batch.size());
  std::erase_if(active_, [](const std::unique_ptr<Slot>& slot) { return slot->done; });
  cache_stats();
}

// The KV cache's figures in the stats (under the lock)
void Scheduler::cache_stats() {
  const nn::KVBlockCache& cache = state_->session.cache();
  stats_.kv_cache_blocks_used = cache.blocks_in_use();
  stats_.kv_cache_bytes = cache.blocks_in_use() * cache.bytes_per_block();
  stats_.kv_cache_tokens = cache.tokens_held();
  stats_.prompt_cache_sequences = static_cast<int64_t>(state_->kept.size());
}

}  // namespace qkv::serve
