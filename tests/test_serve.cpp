// The server's library parts without HTTP: the scheduler (requests running together give each the tokens
// nn::generate gives it alone; a full queue refuses; cancel and a callback's verdict end a request) and ReplyText
// (whole UTF-8 characters only; stop strings cut the reply, also across tokens). HTTP: tests/serve_check.sh.
#include <gtest/gtest.h>

#include <future>
#include <mutex>

#include "qkv/core/autograd.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/serve/reply_text.hpp"
#include "qkv/serve/scheduler.hpp"

using namespace qkv;

namespace {

std::unique_ptr<nn::Decoder> tiny_model() {
  nn::GPTConfig g{.vocab_size = 61, .context_length = 64, .emb_dim = 24, .n_heads = 4, .n_layers = 2, .drop_rate = 0.0,
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
  const serve::SchedulerStats s = scheduler.stats();
  EXPECT_EQ(s.completed, 3);
  EXPECT_EQ(s.generated_tokens, 12 + 13 + 14);
  EXPECT_EQ(s.active + s.queued, 0);
  EXPECT_EQ(s.kv_cache_bytes, 0);  // every cache freed
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
  Waiter third;
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
