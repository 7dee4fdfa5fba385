// The server's library parts without HTTP: the scheduler (continuous batching: requests running together give each
// the tokens nn::generate gives it alone; the prompt cache computes only a chat's new tokens and changes no token;
// a full queue refuses; cancel and a callback's verdict end a request; blocks go back) and ReplyText (whole UTF-8
// characters only; stop strings cut the reply, also across tokens). HTTP: tests/serve_check.sh.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "helpers.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/session.hpp"
#include "qkv/serve/reply_text.hpp"
#include "qkv/serve/scheduler.hpp"

using namespace qkv;

namespace {

std::unique_ptr<nn::Decoder> tiny_model(int64_t context = 64) {
  nn::GPTConfig g{.vocab_size = 61, .context_length = context, .emb_dim = 24, .n_heads = 4, .n_layers = 2, .drop_rate = 0.0,
                  .qkv_bias = true, .tie_weights = false};
  Generator gen(11);
  auto model = std::make_unique<nn::Decoder>(g, gen);
  model->eval();
  return model;
}

// Submits and waits for the outcome
struct Waiter {
  std::promise<serve::Outcome> done;
  serve::GenerationRequest request(std::vector<int64_t> prompt, int64_t max_new, serve::SamplingParams sampling = {}) {
    serve::GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = max_new;
    r.sampling = sampling;
    r.on_finish = [this](const serve::Outcome& o) { done.set_value(o); };
    return r;
  }
};

std::vector<int64_t> alone(const nn::Decoder& model, const std::vector<int64_t>& prompt, int64_t max_new, double temperature,
                           double top_p, uint64_t seed) {
  nn::SamplingOptions o;
  o.max_new_tokens = max_new;
  o.temperature = temperature;
  o.top_p = top_p;
  o.seed = seed;
  return nn::generate(model, prompt, o);
}

// The same request through the session API's generate, alone in its own session
std::vector<int64_t> session_alone(const nn::Decoder& model, const std::vector<int64_t>& prompt, int64_t max_new,
                                   const serve::SamplingParams& p, int64_t prefill_chunk = 256) {
  nn::SessionOptions so;
  so.prefill_chunk = prefill_chunk;
  nn::Session session(model, so);
  nn::GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new;
  r.sampling = {.greedy = p.greedy, .temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p,
                .presence_penalty = p.presence_penalty, .frequency_penalty = p.frequency_penalty, .seed = p.seed};
  return nn::generate(session, {r})[0].tokens;
}

// The counters once the step that ended the last request has counted it (on_finish runs just before)
serve::SchedulerStats settled(const serve::Scheduler& scheduler) {
  for (int i = 0; i < 2000; ++i) {
    const serve::SchedulerStats s = scheduler.stats();
    if (s.active + s.queued == 0) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return scheduler.stats();
}

std::vector<int64_t> pseudo_prompt(size_t n, int64_t vocab, int64_t salt) {
  std::vector<int64_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = (static_cast<int64_t>(i) * 7 + salt * 13 + 3) % vocab;
  return ids;
}

}  // namespace

// Three requests of different lengths, two slots and a queue of one: each gets exactly the tokens it gets alone,
// greedy and sampled with its seed.
TEST(ServeScheduler, RequestsTogetherGiveWhatEachGivesAlone) {
  auto model = tiny_model();
  serve::Scheduler scheduler(*model, {.parallel = 2, .queue_size = 1, .context = 64});
  const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {7, 8, 9, 10, 11, 12, 13}, {40}};
  Waiter w[3];
  serve::SamplingParams greedy{.greedy = true}, sampled{.temperature = 0.8, .top_p = 0.9, .seed = 42};
  for (int i = 0; i < 3; ++i) scheduler.submit(w[i].request(prompts[i], 12 + i, i == 1 ? sampled : greedy));
  for (int i = 0; i < 3; ++i) {
    const serve::Outcome o = w[i].done.get_future().get();
    EXPECT_EQ(o.finish, serve::FinishReason::Length);
    EXPECT_EQ(o.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    EXPECT_EQ(o.tokens, alone(*model, prompts[i], 12 + i, i == 1 ? 0.8 : 0.0, i == 1 ? 0.9 : 1.0, i == 1 ? 42 : 0)) << i;
  }
  const serve::SchedulerStats s = settled(scheduler);
  EXPECT_EQ(s.completed, 3);
  EXPECT_EQ(s.generated_tokens, 12 + 13 + 14);
  EXPECT_EQ(s.active + s.queued, 0);
  EXPECT_EQ(s.prompt_cache_sequences, 3);  // kept for the prompt cache (a budget of one context: 64 tokens)
  EXPECT_EQ(s.kv_cache_tokens, (3 + 11) + (7 + 12) + (1 + 13)) << "prompts and replies but their last tokens";
}

// Continuous batching: eight requests of different lengths at once (prompts cut into pieces of 8, a step of at most
// 24 tokens, so decoding and prefilling requests share steps) give each exactly what it gives alone through the
// scheduler and what the session API's generate gives it — greedy token for token, sampled with its seed. With the
// prompt cache off every block goes back.
TEST(ServeScheduler, EightStreamsAtOnceEqualEachAloneAndGenerate) {
  auto model = tiny_model(96);
  const serve::SchedulerOptions options{.parallel = 8, .queue_size = 0, .context = 96, .prompt_cache_tokens = 0,
                                        .max_batch_tokens = 24, .prefill_chunk = 8};
  std::vector<std::vector<int64_t>> prompts;
  std::vector<serve::SamplingParams> sampling;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(pseudo_prompt(static_cast<size_t>(1 + 5 * i), 61, i));
    serve::SamplingParams p{.greedy = i % 3 != 2};
    if (!p.greedy) p = {.temperature = 0.9, .top_p = 0.95, .presence_penalty = 0.5, .seed = static_cast<uint64_t>(100 + i)};
    sampling.push_back(p);
  }
  auto max_new = [](int i) { return int64_t{10 + 3 * i}; };
  std::vector<std::vector<int64_t>> alone_tokens;
  {
    serve::Scheduler solo(*model, options);
    for (int i = 0; i < 8; ++i) {
      Waiter w;
      solo.submit(w.request(prompts[static_cast<size_t>(i)], max_new(i), sampling[static_cast<size_t>(i)]));
      alone_tokens.push_back(w.done.get_future().get().tokens);
    }
  }
  serve::Scheduler scheduler(*model, options);
  Waiter w[8];
  for (int i = 0; i < 8; ++i) scheduler.submit(w[i].request(prompts[static_cast<size_t>(i)], max_new(i), sampling[static_cast<size_t>(i)]));
  for (int i = 0; i < 8; ++i) {
    const auto u = static_cast<size_t>(i);
    const serve::Outcome o = w[i].done.get_future().get();
    EXPECT_EQ(o.finish, serve::FinishReason::Length);
    EXPECT_EQ(o.tokens, alone_tokens[u]) << "request " << i << " together vs alone";
    // The session API's generate and the one-sequence nn::generate (greedy: the sampled ones' penalties count the
    // prompt there, the reply only here)
    if (sampling[u].greedy) {
      EXPECT_EQ(o.tokens, session_alone(*model, prompts[u], max_new(i), sampling[u], 8)) << "request " << i;
      EXPECT_EQ(o.tokens, alone(*model, prompts[u], max_new(i), 0.0, 1.0, 0)) << "request " << i << " vs nn::generate";
    }
  }
  const serve::SchedulerStats s = settled(scheduler);
  EXPECT_EQ(s.completed, 8);
  EXPECT_GT(s.batch_tokens_max, 8) << "decoding and prompt pieces shared steps";
  EXPECT_LE(s.batch_tokens_max, 24);
  EXPECT_EQ(s.kv_cache_blocks_used, 0) << "every sequence's blocks went back";
  EXPECT_EQ(s.kv_cache_bytes, 0);
}

// The prompt cache: a chat's second turn (turn 1's prompt, its reply and a new message) forks turn 1's kept sequence
// and computes only what it does not hold — the new message and the reply's last token, which was sampled but never
// fed — with the same tokens as with the cache off and as generate on the whole prompt. A third request sharing only
// the start forks that much; the cache's budget evicts the least recently used sequence.
TEST(ServeScheduler, AChatsSecondTurnPrefillsOnlyTheNewTokens) {
  auto model = tiny_model(256);
  serve::SamplingParams greedy{.greedy = true};
  const std::vector<int64_t> turn1 = pseudo_prompt(70, 61, 1), message = pseudo_prompt(9, 61, 2);
  auto run = [&](serve::Scheduler& scheduler, const std::vector<int64_t>& prompt, int64_t max_new) {
    Waiter w;
    scheduler.submit(w.request(prompt, max_new, greedy));
    const serve::Outcome o = w.done.get_future().get();
    settled(scheduler);
    return o;
  };
  serve::Scheduler cached(*model, {.parallel = 2, .queue_size = 2, .context = 256, .prompt_cache_tokens = 200});
  serve::Scheduler plain(*model, {.parallel = 2, .queue_size = 2, .context = 256, .prompt_cache_tokens = 0});
  const serve::Outcome first = run(cached, turn1, 12);
  EXPECT_EQ(first.cached_tokens, 0);
  EXPECT_EQ(first.tokens, run(plain, turn1, 12).tokens);
  EXPECT_EQ(settled(cached).prefilled_tokens, 70);
  EXPECT_EQ(settled(cached).prompt_cache_sequences, 1);
  std::vector<int64_t> turn2 = turn1;
  turn2.insert(turn2.end(), first.tokens.begin(), first.tokens.end());
  turn2.insert(turn2.end(), message.begin(), message.end());
  const serve::Outcome second = run(cached, turn2, 10);
  EXPECT_EQ(second.cached_tokens, 70 + 12 - 1);
  const serve::SchedulerStats s = settled(cached);
  EXPECT_EQ(s.prefilled_tokens - 70, 9 + 1) << "the new message and the reply's last token";
  EXPECT_EQ(s.prompt_cache_hit_tokens, 81);
  EXPECT_EQ(second.tokens, run(plain, turn2, 10).tokens) << "the cache changes no token";
  EXPECT_EQ(second.tokens, session_alone(*model, turn2, 10, greedy));
  EXPECT_EQ(s.prompt_cache_sequences, 1) << "turn 2 holds all of turn 1: turn 1 was dropped for it";
  // Sharing the first 40 tokens only
  std::vector<int64_t> other(turn1.begin(), turn1.begin() + 40);
  const std::vector<int64_t> tail = pseudo_prompt(30, 61, 5);
  other.insert(other.end(), tail.begin(), tail.end());
  const serve::Outcome third = run(cached, other, 8);
  EXPECT_EQ(third.cached_tokens, 40);
  EXPECT_EQ(third.tokens, run(plain, other, 8).tokens);
  // Budget 200 tokens: turn 2 (100 held) and the third (77) fit; one more of 103 evicts the least recently used
  EXPECT_EQ(settled(cached).prompt_cache_sequences, 2);
  run(cached, pseudo_prompt(100, 61, 9), 4);
  const serve::SchedulerStats e = settled(cached);
  EXPECT_LE(e.kv_cache_tokens, 200);
  EXPECT_EQ(e.prompt_cache_sequences, 2);
  EXPECT_EQ(run(cached, turn2, 2).cached_tokens, 40) << "turn 2's own sequence was the least recently used: evicted; "
                                                        "the third's 40 shared tokens remain";
  EXPECT_EQ(settled(plain).prompt_cache_hit_tokens, 0);
  EXPECT_EQ(settled(plain).kv_cache_blocks_used, 0);
}

// Two requests that begin with one long prefix (a system prompt) arriving in one step: the second waits a step for
// the first to compute the prefix, then forks it — the prefix is computed once — and each gives its tokens alone.
TEST(ServeScheduler, RequestsSharingAPrefixInOneStepComputeItOnce) {
  auto model = tiny_model(256);
  serve::SamplingParams greedy{.greedy = true};
  const std::vector<int64_t> system = pseudo_prompt(64, 61, 21);
  std::vector<int64_t> a = system, b = system;
  for (int64_t t : pseudo_prompt(16, 61, 22)) a.push_back(t);
  for (int64_t t : pseudo_prompt(20, 61, 23)) b.push_back(t);
  serve::Scheduler scheduler(*model, {.parallel = 2, .queue_size = 2, .context = 256, .prompt_cache_tokens = 0});
  // Both submitted while the loop is held between two steps, so that one step admits both
  std::promise<void> entered, go;
  std::shared_future<void> released = go.get_future().share();
  std::thread hold([&] { scheduler.run_between_steps([&] { entered.set_value(); released.wait(); }); });
  entered.get_future().wait();
  Waiter wa, wb;
  scheduler.submit(wa.request(a, 6, greedy));
  scheduler.submit(wb.request(b, 6, greedy));
  go.set_value();
  hold.join();
  const serve::Outcome oa = wa.done.get_future().get(), ob = wb.done.get_future().get();
  EXPECT_EQ(oa.cached_tokens, 0);
  EXPECT_EQ(ob.cached_tokens, 64) << "the second forked the first's prefix";
  EXPECT_EQ(settled(scheduler).prefilled_tokens, 80 + 20);
  EXPECT_EQ(oa.tokens, session_alone(*model, a, 6, greedy));
  EXPECT_EQ(ob.tokens, session_alone(*model, b, 6, greedy));
}

// LongRoPE (the tiny Phi-3 folder, rotation switch at 8 positions): a sequence growing past the switch is encoded again
// from its start, so only requests that stay short of it share blocks; each gives what it gives alone, also with
// others crossing the switch beside it.
TEST(ServeScheduler, TheRotationSwitchNeverRewritesSharedBlocks) {
  const auto model = nn::load_hf_decoder(test::fixture("hf/phi3"));
  model->eval();
  ASSERT_EQ(model->rotation_switch(), 8);
  serve::SamplingParams greedy{.greedy = true};
  serve::Scheduler scheduler(*model, {.parallel = 3, .queue_size = 3, .context = 64});
  auto run = [&](const std::vector<int64_t>& prompt, int64_t max_new) {
    Waiter w;
    scheduler.submit(w.request(prompt, max_new, greedy));
    const serve::Outcome o = w.done.get_future().get();
    settled(scheduler);
    EXPECT_EQ(o.tokens, session_alone(*model, prompt, max_new, greedy)) << prompt.size() << " + " << max_new;
    return o;
  };
  const std::vector<int64_t> turn1 = pseudo_prompt(4, 80, 1);
  const serve::Outcome first = run(turn1, 2);  // 6 positions: short of the switch
  std::vector<int64_t> turn2 = turn1;
  turn2.insert(turn2.end(), first.tokens.begin(), first.tokens.end());
  turn2.push_back(9);
  EXPECT_EQ(run(turn2, 1).cached_tokens, 5) << "7 + 1 positions stay short of the switch: shared";
  std::vector<int64_t> longer = turn2;
  longer.insert(longer.end(), {11, 12, 13});
  EXPECT_EQ(run(longer, 6).cached_tokens, 0) << "it crosses the switch: computed afresh";
  // Three at once, two crossing the switch while decoding
  Waiter w[3];
  const std::vector<std::vector<int64_t>> prompts = {pseudo_prompt(6, 80, 2), pseudo_prompt(3, 80, 3), turn1};
  for (int i = 0; i < 3; ++i) scheduler.submit(w[i].request(prompts[static_cast<size_t>(i)], 6 - 2 * (i == 2), greedy));
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(w[i].done.get_future().get().tokens,
              session_alone(*model, prompts[static_cast<size_t>(i)], 6 - 2 * (i == 2), greedy)) << i;
}

// Many requests through a small cache: the session's blocks stay bounded (kept sequences within the budget), no
// request is lost, and cancelled ones free their blocks.
TEST(ServeScheduler, BlocksStayBoundedOverManyRequests) {
  auto model = tiny_model(64);
  serve::Scheduler scheduler(*model, {.parallel = 4, .queue_size = 64, .context = 64, .prompt_cache_tokens = 48});
  std::vector<std::unique_ptr<Waiter>> waiters;
  std::vector<std::future<serve::Outcome>> outcomes;
  for (int i = 0; i < 60; ++i) {
    waiters.push_back(std::make_unique<Waiter>());
    serve::GenerationRequest r = waiters.back()->request(pseudo_prompt(static_cast<size_t>(3 + i % 20), 61, i % 7), 6,
                                                         {.greedy = true});
    if (i % 5 == 4) r.on_token = [](int64_t) { return serve::TokenVerdict::Cancel; };
    outcomes.push_back(waiters.back()->done.get_future());
    scheduler.submit(std::move(r));
  }
  int cancelled = 0;
  for (auto& f : outcomes) cancelled += f.get().finish == serve::FinishReason::Cancelled;
  EXPECT_EQ(cancelled, 12);
  const serve::SchedulerStats s = settled(scheduler);
  EXPECT_EQ(s.completed + s.cancelled, 60);
  EXPECT_LE(s.kv_cache_tokens, 48);
  EXPECT_LE(s.kv_cache_blocks_used, 48 / 16 + s.prompt_cache_sequences)
      << "only kept sequences hold blocks (a partly filled last one each)";
  EXPECT_GT(s.prompt_cache_hit_tokens, 0) << "prompts of the same salt share their start";
}

// A full queue refuses with QueueFull; cancel ends a running request at the next step; a callback's Stop ends it as
// complete; requests past the context are refused before they run.
TEST(ServeScheduler, QueueFullCancelAndStop) {
  auto model = tiny_model();
  serve::Scheduler scheduler(*model, {.parallel = 1, .queue_size = 0, .context = 32});
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  Waiter first;
  serve::GenerationRequest r = first.request({1, 2, 3}, 20, {.greedy = true});
  r.on_token = [released](int64_t) {
    released.wait();  // holds the only slot until the test has tried the next request
    return serve::TokenVerdict::Continue;
  };
  const int64_t id = scheduler.submit(std::move(r));
  Waiter second;
  EXPECT_THROW(scheduler.submit(second.request({4}, 2)), serve::QueueFull);
  EXPECT_EQ(scheduler.stats().rejected, 1);
  scheduler.cancel(id);
  release.set_value();
  const serve::Outcome o = first.done.get_future().get();
  EXPECT_EQ(o.finish, serve::FinishReason::Cancelled);
  EXPECT_LE(o.tokens.size(), 2u);
  Waiter third;  // the slot is free once on_finish has run: the next request is taken at once
  serve::GenerationRequest s = third.request({5, 6}, 20, {.greedy = true});
  int seen = 0;
  s.on_token = [&seen](int64_t) { return ++seen == 3 ? serve::TokenVerdict::Stop : serve::TokenVerdict::Continue; };
  scheduler.submit(std::move(s));
  const serve::Outcome t = third.done.get_future().get();
  EXPECT_EQ(t.finish, serve::FinishReason::Stop);
  EXPECT_EQ(t.tokens.size(), 3u);
  Waiter big;
  EXPECT_THROW(scheduler.submit(big.request(std::vector<int64_t>(30, 1), 3)), ValueError);  // 33 > 32
  EXPECT_THROW(scheduler.submit(big.request({99}, 3)), ValueError);                          // outside the vocabulary
  EXPECT_THROW(scheduler.submit(big.request({}, 3)), ValueError);
}

// A client that sends its next request the moment the last one ends is never turned away: the request is counted and
// its slot freed before on_finish tells the client (one slot, no queue, 40 requests back to back).
TEST(ServeScheduler, ARequestSentAsTheLastEndsFindsItsSlot) {
  auto model = tiny_model();
  serve::Scheduler scheduler(*model, {.parallel = 1, .queue_size = 0, .context = 32});
  for (int i = 0; i < 40; ++i) {
    Waiter w;
    ASSERT_NO_THROW(scheduler.submit(w.request({1 + i % 5, 2}, 2, {.greedy = true}))) << "request " << i;
    EXPECT_EQ(w.done.get_future().get().finish, serve::FinishReason::Length);
    const serve::SchedulerStats s = scheduler.stats();
    EXPECT_EQ(s.completed, i + 1);  // counted before its on_finish
    EXPECT_EQ(s.generated_tokens, 2 * (i + 1));
  }
  EXPECT_EQ(scheduler.stats().rejected, 0);
}

// --kv-cache bf16 on the server: its requests run on a bf16 block cache (half the bytes per block), each giving the
// tokens the same request gives alone in a session with that cache.
TEST(ServeScheduler, ANarrowKvCacheServesAsASessionWithIt) {
  auto model = tiny_model();
  serve::SchedulerOptions o{.parallel = 2, .queue_size = 2};
  o.kv_type = kernels::WeightType::BF16;
  serve::Scheduler scheduler(*model, o);
  std::vector<std::unique_ptr<Waiter>> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.push_back(std::make_unique<Waiter>());
    scheduler.submit(waiters.back()->request(pseudo_prompt(5 + 3 * static_cast<size_t>(i), 61, i), 10, {.greedy = true}));
  }
  for (int i = 0; i < 3; ++i) {
    const serve::Outcome out = waiters[static_cast<size_t>(i)]->done.get_future().get();
    nn::SessionOptions so;
    so.kv_type = kernels::WeightType::BF16;
    nn::Session session(*model, so);
    nn::GenerationRequest r;
    r.prompt = pseudo_prompt(5 + 3 * static_cast<size_t>(i), 61, i);
    r.max_new_tokens = 10;
    r.sampling.greedy = true;
    EXPECT_EQ(out.tokens, nn::generate(session, {r})[0].tokens) << "request " << i;
  }
  const serve::SchedulerStats stats = settled(scheduler);
  EXPECT_GT(stats.kv_cache_blocks_used, 0);
  EXPECT_EQ(stats.kv_cache_bytes, stats.kv_cache_blocks_used * nn::KVBlockCache(2, 24, 16, 1, kernels::WeightType::BF16).bytes_per_block());
}

// Work on the model between steps (the chat page's attention rows): it runs on the loop's thread while requests
// decode, and their tokens are the same as without it; a job's exception reaches its caller; after shutdown, refused.
TEST(ServeScheduler, JobsRunBetweenStepsAndChangeNoToken) {
  auto model = tiny_model();
  serve::Scheduler scheduler(*model, {.parallel = 2, .queue_size = 2});
  const std::vector<int64_t> prompt = pseudo_prompt(9, 61, 4);
  Waiter running;
  std::thread::id loop_thread;
  serve::GenerationRequest r = running.request(prompt, 24, {.greedy = true});
  r.on_token = [&loop_thread](int64_t) {
    loop_thread = std::this_thread::get_id();
    return serve::TokenVerdict::Continue;
  };
  scheduler.submit(std::move(r));
  int jobs = 0;
  std::thread::id job_thread;
  Tensor row;
  for (int i = 0; i < 5; ++i) {
    scheduler.run_between_steps([&] {
      job_thread = std::this_thread::get_id();
      row = model->attention_row(prompt, 8);
      ++jobs;
    });
  }
  const serve::Outcome o = running.done.get_future().get();
  EXPECT_EQ(jobs, 5);
  EXPECT_EQ(job_thread, loop_thread);
  EXPECT_NE(job_thread, std::this_thread::get_id());
  EXPECT_EQ(row.shape(), (Shape{2, 4, 9}));
  EXPECT_EQ(o.tokens, alone(*model, prompt, 24, 0.0, 1.0, 0));
  EXPECT_THROW(scheduler.run_between_steps([] { throw ValueError("from the job"); }), ValueError);
  scheduler.shutdown(false);
  EXPECT_THROW(scheduler.run_between_steps([] {}), ShapeError);
}

// ReplyText over bytes: a split character is held back until whole; a stop string ends the reply before it, even
// when it arrives a byte at a time and half of it looked like text.
TEST(ServeReplyText, WholeCharactersAndStopStrings) {
  text::ByteTokenizer bytes;
  auto feed = [&](serve::ReplyText& reply, const std::string& s, std::vector<std::string>* pieces) {
    for (unsigned char c : s) {
      if (reply.stopped()) break;
      pieces->push_back(reply.push(c));
    }
  };
  serve::ReplyText plain(bytes, {});
  std::vector<std::string> pieces;
  feed(plain, "h\xC3\xA9!", &pieces);  // hé!
  EXPECT_EQ(pieces, (std::vector<std::string>{"h", "", "\xC3\xA9", "!"}));
  EXPECT_EQ(plain.finish(), "");
  serve::ReplyText stop(bytes, {"END", "xyz"});
  pieces.clear();
  feed(stop, "abEN dEND tail", &pieces);
  EXPECT_TRUE(stop.stopped());
  EXPECT_EQ(stop.text(), "abEN d");  // "EN" looked like the start of END until the space came
  EXPECT_EQ(stop.finish(), "");
  serve::ReplyText unfinished(bytes, {"END"});
  pieces.clear();
  feed(unfinished, "okEN", &pieces);
  EXPECT_EQ(unfinished.text(), "ok");
  EXPECT_EQ(unfinished.finish(), "EN");  // the reply ended: what was held back is text after all
  EXPECT_EQ(serve::unfinished_utf8_tail("a\xE6\x97"), 2u);
  EXPECT_EQ(serve::unfinished_utf8_tail("a\xE6\x97\xA5"), 0u);
}
