// Sessions, the block KV cache, batched generation, the sampler chain and the streaming detokenizer: batched greedy
// generation equals each prompt alone token for token on every family's tiny folder and the book's GPT (and
// PyTorch's greedy text), the products give a row the same bits in any batch, the sampler's distributions are the
// hand-computed ones, a stream never hands out half a character, cancelling frees the blocks, an oversized batch
// is refused before anything runs.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/core/thread_governor.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/rope.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/nn/hf.hpp"
#include "qkv/nn/sampler.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/nn/session.hpp"
#include "qkv/text/stream.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::test {
namespace {

// ---- kernels ----

TEST(RowIndependentProducts, EveryRowHasTheSameBitsInAnyBatch) {
  // 13 rows: decoding's tiles and a last row alone (AVX-512: an 8-row tile, then 4 rows and 1, while 13 rows of K fit
  // in 40 KiB, else groups of 4; AVX2: groups of 3); 8 and 16: whole tiles; 24-37 rows: AVX-512's tiles over blocks of
  // columns; from 32 rows (AVX2) or 48 (AVX-512) the packed products (prompts), with panels of rows and columns cut
  // short by M, N and K
  for (const auto& [M, K] : std::vector<std::pair<int64_t, int64_t>>{{13, 5}, {13, 16}, {13, 37}, {13, 100}, {13, 1024},
                                                                      {8, 1024}, {16, 37}, {24, 1024}, {29, 5},
                                                                      {37, 100}, {64, 16}, {50, 1030}}) {
    const int64_t N = 75;
    const Tensor A = random_tensor({M, K}, 1), B = random_tensor({N, K}, 2);
    std::vector<float> all(static_cast<size_t>(M * N)), reference(static_cast<size_t>(M * N));
    kernels::gemm_rows_nt(M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, all.data(), N);
    kernels::gemm_rows_nt_reference(M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, reference.data(), N);
    for (int64_t m = 0; m < M; ++m) {
      std::vector<float> alone(static_cast<size_t>(N));
      kernels::gemm_rows_nt(1, N, K, 1.0f, A.data() + m * K, K, B.data(), K, 0.0f, alone.data(), N);
      for (int64_t n = 0; n < N; ++n) {
        EXPECT_EQ(alone[static_cast<size_t>(n)], all[static_cast<size_t>(m * N + n)]) << "K " << K << " row " << m;
        EXPECT_EQ(all[static_cast<size_t>(m * N + n)], reference[static_cast<size_t>(m * N + n)])
            << "every element is simd::dot's sum, whatever tile computed it: K " << K << " row " << m << " column " << n;
      }
    }
    // Through gemm() while a RowIndependentProducts is alive, and with β (a bias already in C)
    std::vector<float> via(static_cast<size_t>(M * N), 0.5f), expected(static_cast<size_t>(M * N), 0.5f);
    {
      const kernels::RowIndependentProducts on;
      kernels::gemm(false, true, M, N, K, 2.0f, A.data(), K, B.data(), K, 1.0f, via.data(), N);
    }
    EXPECT_FALSE(kernels::RowIndependentProducts::active());
    kernels::gemm_rows_nt(M, N, K, 2.0f, A.data(), K, B.data(), K, 1.0f, expected.data(), N);
    EXPECT_EQ(via, expected);
  }
}

TEST(RopeRows, EachRowAtItsOwnPositionIsTheBlockRotation) {
  kernels::RopeFrequencies f;
  const auto table = kernels::RopeTable::make(f.inverse_frequencies(8), 32);
  const int64_t heads = 2, D = 8, stride = 20;  // 4 values past the heads are kept
  const Tensor x = random_tensor({5, stride}, 3);
  const std::vector<int64_t> positions = {7, 0, 31, 3, 3};
  std::vector<float> rows(x.data(), x.data() + x.numel());
  kernels::rope_apply_rows(table, kernels::RopeLayout::RotateHalf, rows.data(), rows.data(), 5, positions.data(), stride,
                           heads, D);
  for (int64_t r = 0; r < 5; ++r) {
    std::vector<float> one(x.data() + r * stride, x.data() + (r + 1) * stride);
    kernels::rope_apply(table, kernels::RopeLayout::RotateHalf, one.data(), one.data(), 1, 1, stride, heads, D,
                        positions[static_cast<size_t>(r)], false);
    for (int64_t c = 0; c < stride; ++c) EXPECT_EQ(rows[static_cast<size_t>(r * stride + c)], one[static_cast<size_t>(c)]);
  }
}

// ---- batched generation equals generation alone ----

std::vector<int64_t> prompt_of(int64_t length, int64_t vocab, int64_t salt) {
  std::vector<int64_t> p;
  for (int64_t t = 0; t < length; ++t) p.push_back((t * 7 + salt * 13 + 3) % vocab);
  return p;
}

// Prompts of different lengths and limits; the second stops at a token it would produce (found by a first run).
std::vector<nn::GenerationRequest> requests_for(const nn::Decoder& model) {
  const int64_t V = model.vocab_size();
  std::vector<nn::GenerationRequest> requests;
  const int64_t lengths[] = {5, 11, 1, 17, 3}, limits[] = {9, 12, 6, 4, 10};
  for (int i = 0; i < 5; ++i) {
    nn::GenerationRequest r;
    r.prompt = prompt_of(lengths[i], V, i);
    r.max_new_tokens = limits[i];
    r.sampling.greedy = true;
    requests.push_back(r);
  }
  requests[4].sampling = {};  // one sampled sequence: its own seed gives it the same draws in any batch
  requests[4].sampling.seed = 42;
  requests[4].sampling.top_k = 20;
  nn::Session session(model);
  const auto first = nn::generate(session, {requests[1]});
  if (first[0].tokens.size() > 3) requests[1].stop_ids = {first[0].tokens[3]};
  return requests;
}

void expect_batched_equals_alone(const nn::Decoder& model, const std::string& name) {
  const std::vector<nn::GenerationRequest> requests = requests_for(model);
  std::vector<nn::GenerationResult> alone;
  for (const auto& r : requests) {
    nn::Session session(model);
    alone.push_back(nn::generate(session, {r})[0]);
  }
  // Small blocks, pieces and steps: prompts are cut, blocks are crossed, steps mix prompt pieces and decoding.
  nn::SessionOptions o;
  o.block_size = 4;
  o.prefill_chunk = 4;
  o.max_batch_tokens = 9;
  o.max_tokens = 1024;  // room for every sequence at once (a session holds the model's context by default)
  nn::SessionOptions large;
  large.max_tokens = 1024;
  for (const nn::SessionOptions& options : {large, o}) {
    nn::Session session(model, options);
    std::map<size_t, std::vector<int64_t>> streamed;
    const auto together = nn::generate(session, requests, [&](size_t i, int64_t t) {
      streamed[i].push_back(t);
      return true;
    });
    ASSERT_EQ(together.size(), requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(together[i].tokens, alone[i].tokens) << name << " request " << i << " block size " << options.block_size;
      EXPECT_EQ(together[i].finish, alone[i].finish) << name << " request " << i;
      EXPECT_EQ(streamed[i], together[i].tokens) << "the callback sees every token but the stop token";
    }
    EXPECT_EQ(session.cache().blocks_in_use(), 0) << "every sequence's blocks went back";
  }
  if (!requests[1].stop_ids.empty()) {
    EXPECT_EQ(alone[1].finish, nn::FinishReason::Stop) << name;
  }
  EXPECT_EQ(alone[0].finish, nn::FinishReason::Length) << name;
}

class SessionFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(SessionFamily, BatchedGreedyEqualsEachPromptAloneAndPyTorch) {
  const auto model = nn::load_hf_decoder(fixture("hf/" + GetParam()));
  model->eval();
  expect_batched_equals_alone(*model, GetParam());
  // The session's greedy text is PyTorch's (tools/decoder_reference.py)
  const auto expected = io::SafetensorsFile::open(fixture("hf/" + GetParam() + ".expected.safetensors"));
  const std::vector<int64_t> greedy = expected.int64s("greedy");
  nn::Session session(*model);
  nn::GenerationRequest r;
  r.prompt = expected.int64s("prompt");
  r.max_new_tokens = static_cast<int64_t>(greedy.size());
  r.sampling.greedy = true;
  EXPECT_EQ(nn::generate(session, {r})[0].tokens, greedy);
}

TEST_P(SessionFamily, PrefillLogitsAreTheForwardPasses) {
  const auto model = nn::load_hf_decoder(fixture("hf/" + GetParam()));
  model->eval();
  const std::vector<int64_t> ids = prompt_of(13, model->vocab_size(), 1);
  Tensor full;
  {
    NoGradGuard no_grad;
    full = model->forward(ids, 1, 13);
  }
  nn::SessionOptions o;
  o.block_size = 4;
  nn::Session session(*model, o);
  const int64_t seq = session.open();
  nn::Batch batch;
  for (int64_t t = 0; t < 13; ++t) batch.add(ids[static_cast<size_t>(t)], t, seq, true);
  const Tensor logits = session.decode(batch);
  // Qwen3-Next's recurrence amplifies float32's rounding (see Family's tolerance, test_decoder): 2e-5 of its largest logit
  double largest = 0.0;
  for (int64_t i = 0; i < full.numel(); ++i) largest = std::max(largest, std::fabs(static_cast<double>(full.data()[i])));
  const double atol = GetParam() == "qwen3_next" ? std::max(1e-5, 2e-5 * largest) : 1e-5;
  EXPECT_TRUE(all_close(logits, reshape(full, {13, model->vocab_size()}), 1e-4, atol));
  EXPECT_EQ(session.length(seq), 13);
  EXPECT_EQ(session.cache().blocks_in_use(), 4);
}

INSTANTIATE_TEST_SUITE_P(HuggingFace, SessionFamily,
                         ::testing::Values("llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3", "olmo2", "olmo3",
                                           "smollm3", "gemma2", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"),
                         [](const auto& info) { return info.param; });

// Qwen3-Next's Gated DeltaNet layers keep a state per sequence in the session (its conv's last inputs and its
// (Dk × Dv) states), not rows of the block cache, which holds its one attention layer only. A state holds all of
// its sequence: a fork takes it whole (and continues as the original does) or not at all, a cut goes to 0 only.
TEST(Session, AGatedDeltaNetStateIsForkedWholeAndCutToZeroOnly) {
  const auto model = nn::load_hf_decoder(fixture("hf/qwen3_next"));
  model->eval();
  EXPECT_EQ(model->block_cache_layers(), 1);
  const int64_t state = model->block_cache_state_floats();
  EXPECT_EQ(state, 3 * ((4 - 1) * (2 * 2 * 6 + 4 * 5) + 4 * 6 * 5));  // 3 layers × (conv inputs + states)
  nn::SessionOptions o;
  o.block_size = 4;
  nn::Session session(*model, o);
  EXPECT_EQ(session.cache().state_floats(), state);
  const int64_t seq = session.open();
  EXPECT_EQ(session.cache().bytes_allocated(), state * 4) << "an open sequence holds its state, no block yet";
  const std::vector<int64_t> ids = prompt_of(6, model->vocab_size(), 2);
  auto feed = [&](int64_t s, std::span<const int64_t> tokens, int64_t start) {
    nn::Batch batch;
    for (size_t t = 0; t < tokens.size(); ++t) batch.add(tokens[t], start + static_cast<int64_t>(t), s, t + 1 == tokens.size());
    return session.decode(batch).to_vector();
  };
  const std::vector<float> first = feed(seq, ids, 0);
  const int64_t whole = session.fork(seq);
  const std::vector<int64_t> next = {3, 9};
  EXPECT_EQ(feed(whole, next, 6), feed(seq, next, 6)) << "a whole fork continues as its source";
  for (auto attempt : {std::function<void()>([&] { session.fork(seq, 3); }), std::function<void()>([&] { session.truncate(seq, 3); })}) {
    try {
      attempt();
      ADD_FAILURE() << "a partial fork or cut of a recurrent state was accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("recurrent state (Gated DeltaNet)"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(session.length(seq), 8);
  session.truncate(seq, 0);  // the state starts again from zeros: the same prompt gives the same logits
  EXPECT_EQ(feed(seq, ids, 0), first);
  // and a fork of none of it is a fresh sequence
  const int64_t fresh = session.fork(seq, 0);
  EXPECT_EQ(feed(fresh, ids, 0), first);
}

// Latent attention in a session caches each token's latent and rotated key only (kv_lora_rank + qk_rope_head_dim
// values a layer, no values kind): deepseek_v3's fixture, 16 + 4 per layer, against 4 heads × (8 + 4) keys and 6
// values expanded; its tokens stay PyTorch's (SessionFamily above).
TEST(Session, LatentAttentionCachesTheLatentAlone) {
  const auto model = nn::load_hf_decoder(fixture("hf/deepseek_v3"));
  model->eval();
  nn::SessionOptions o;
  o.block_size = 4;
  nn::Session session(*model, o);
  EXPECT_TRUE(session.cache().keys_only());
  EXPECT_EQ(session.cache().width(), 16 + 4);
  EXPECT_EQ(session.cache().bytes_per_block(), 3 * 4 * 20 * 4);  // layers × positions × width × float32
  const int64_t seq = session.open();
  nn::Batch batch;
  for (int64_t t = 0; t < 6; ++t) batch.add(1 + t, t, seq, t == 5);
  const Tensor logits = session.decode(batch);
  Tensor full;
  {
    NoGradGuard no_grad;
    full = model->forward(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, 1, 6);
  }
  const int64_t V = model->vocab_size();
  for (int64_t v = 0; v < V; ++v) EXPECT_NEAR(logits.data()[v], full.data()[5 * V + v], 1e-4) << v;
  // A LoRA adapter on kv_b_proj (its B drawn non-zero) reaches the absorbed decode as it reaches the forward pass
  Generator gen(7);
  nn::LoraOptions lora;
  lora.rank = 2;
  lora.targets = {"model.layers.*.self_attn.kv_b_proj"};
  ASSERT_FALSE(nn::add_lora(*model, lora, gen).empty());
  for (auto& [name, t] : model->named_parameters())
    if (name.find("kv_b_proj.lora_B") != std::string::npos) gen.normal_(t, 0.0, 0.5);
  model->eval();
  Tensor adapted;
  {
    NoGradGuard no_grad;
    adapted = model->forward(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, 1, 6);
  }
  nn::Session again(*model, o);
  const int64_t seq2 = again.open();
  nn::Batch batch2;
  for (int64_t t = 0; t < 6; ++t) batch2.add(1 + t, t, seq2, t == 5);
  const Tensor adapted_logits = again.decode(batch2);
  float moved = 0.0f;
  for (int64_t v = 0; v < V; ++v) {
    EXPECT_NEAR(adapted_logits.data()[v], adapted.data()[5 * V + v], 1e-4) << v;
    moved = std::max(moved, std::fabs(adapted.data()[5 * V + v] - full.data()[5 * V + v]));
  }
  EXPECT_GT(moved, 1e-3f) << "the adapter changed nothing";
}

TEST(Session, TheBooksGptBatchedEqualsAlone) {
  Generator gen(123);
  nn::Decoder model(nn::GPTConfig{.vocab_size = 61, .context_length = 48, .emb_dim = 24, .n_heads = 3, .n_layers = 2,
                                  .drop_rate = 0.0, .qkv_bias = true},
                    gen);
  model.eval();
  expect_batched_equals_alone(model, "book GPT");
}

// The same on quantized storage (as a GGUF or --weights holds it), 256 wide so that every block format applies: a
// decoding step's 2–5 rows go through the few-rows kernels in groups of 4, or the tiles, and must give each sequence
// the bits it gets alone.
TEST(Session, BatchedEqualsAloneOnQuantizedStorage) {
  using kernels::WeightType;
  for (const WeightType type : {WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_K, WeightType::Q6_K}) {
    Generator gen(321);
    nn::Decoder model(nn::GPTConfig{.vocab_size = 61, .context_length = 48, .emb_dim = 256, .n_heads = 4,
                                    .n_layers = 2, .drop_rate = 0.0, .qkv_bias = true},
                      gen);
    model.eval();
    model.store_matrices(type);
    expect_batched_equals_alone(model, std::string("book GPT, ") + kernels::weight_type_name(type));
  }
}

// ---- threads ----

// The governor may run any step on 1 thread or on all: that is only safe because a step gives the same bits either
// way. A model large enough that every product, the attention and the norms split their rows among threads.
TEST(SessionThreads, OneThreadAndManyGiveTheSameBits) {
  nn::DecoderConfig c;
  c.family = &nn::family("qwen3");
  c.vocab_size = 3000, c.hidden_size = 256, c.intermediate_size = 704, c.num_layers = 2, c.num_heads = 8;
  c.num_kv_heads = 2, c.head_dim = 32, c.max_positions = 256, c.norm_eps = 1e-6;
  c.qk_norm = nn::QkNorm::PerHead;
  kernels::RopeFrequencies rope;
  rope.theta = 1e6;
  c.ropes = {rope};
  c.layers = {{0, 0}, {0, 0}};
  Generator gen(31);
  nn::Decoder model(c, gen);
  model.eval();
  const int before = num_threads();
  auto run = [&](int threads) {
    set_num_threads(threads);
    nn::SessionOptions o;
    o.adapt_threads = false;
    nn::Session session(model, o);
    const int64_t a = session.open(), b = session.open();
    std::vector<float> out;
    nn::Batch batch;
    for (int64_t t = 0; t < 40; ++t) batch.add((t * 37 + 5) % 3000, t, a, true);
    for (int64_t t = 0; t < 9; ++t) batch.add((t * 11 + 2) % 3000, t, b, t == 8);
    for (int step = 0; step < 6; ++step) {
      const Tensor logits = session.decode(batch);
      out.insert(out.end(), logits.data(), logits.data() + logits.numel());
      batch.clear();
      batch.add((step * 7 + 1) % 3000, session.length(a), a, true);
      batch.add((step * 5 + 3) % 3000, session.length(b), b, true);
    }
    return out;
  };
  const std::vector<float> one = run(1), two = run(2), five = run(5);
  set_num_threads(before);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0) << "1 and 2 threads";
  EXPECT_EQ(std::memcmp(one.data(), five.data(), one.size() * sizeof(float)), 0) << "1 and 5 threads";
}

// parallel_for_each: every index once, on any thread count, and a body's exception reaches the caller after the rest
TEST(ParallelForEach, RunsEveryIndexOnceAndRethrowsTheFirstError) {
  const int before = num_threads();
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    std::vector<std::atomic<int>> seen(37);
    parallel_for_each(37, [&](int64_t i) { seen[static_cast<size_t>(i)] += 1; });
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i].load(), 1) << "index " << i << ", " << threads << " threads";
    std::atomic<int> ran{0};
    EXPECT_THROW(parallel_for_each(10, [&](int64_t i) {
                   ++ran;
                   if (i == 4) throw ValueError("item 4");
                 }),
                 ValueError);
    EXPECT_EQ(ran.load(), 10) << "the other items still ran";
  }
  set_num_threads(before);
}

// The governor's choices from step times it is told: it stays on the full count while 1 thread is slower and tries
// 1 thread ever more rarely; it moves to 1 thread after two tries beat the full count and back when the full count
// is faster again; each kind of step learns apart, a new one starting where the last switch went; it sets the
// caller's count back after every step.
TEST(ThreadGovernor, FollowsTheStepTimesItIsGiven) {
  const int before = num_threads();
  set_num_threads(4);
  ThreadGovernor governor;
  double one_thread = 2.0, full = 1.0;  // seconds per step (a quiet machine: 1 thread is slower)
  int64_t on_one = 0;
  auto steps = [&](int n, int64_t key = 7) {
    for (int i = 0; i < n; ++i) {
      const int threads = governor.begin_step(key);
      EXPECT_TRUE(threads == 1 || threads == 4) << threads;
      EXPECT_EQ(num_threads(), threads) << "the step's count is the calling thread's";
      on_one += threads == 1;
      governor.end_step(threads == 1 ? one_thread : full);
      EXPECT_EQ(num_threads(), 4) << "the caller's count is back after each step";
    }
  };
  steps(1000);
  EXPECT_EQ(governor.switches(), 0);
  EXPECT_EQ(governor.current(7), 4);
  EXPECT_LE(on_one, 10) << "tries of 1 thread become rare while it keeps losing";
  EXPECT_GE(governor.trials(), 4);
  one_thread = 0.5;  // another program takes a core: 1 thread is now twice as fast
  on_one = 0;
  steps(600);  // the next try comes within 256 steps
  EXPECT_EQ(governor.switches(), 1);
  EXPECT_EQ(governor.current(7), 1);
  EXPECT_GE(on_one, 600 - 256 - 10) << "once switched, steps run on 1 thread";
  // A kind not seen yet (a prompt after the decoding steps) starts where the last switch went: on 1 thread, without
  // a step on the full count, which on this busy machine would be twice as slow.
  EXPECT_EQ(governor.current(8), 1);
  on_one = 0;
  steps(2, 8);
  EXPECT_EQ(on_one, 2) << "a new kind's first steps run on the count the busy machine chose";
  one_thread = 2.0;  // the core is free again
  steps(600);
  EXPECT_EQ(governor.switches(), 2);
  EXPECT_EQ(governor.current(7), 4);
  EXPECT_EQ(governor.current(9), 4) << "after the switch back, new kinds start on the full count again";
  one_thread = 0.97;  // 3% better is noise, not a reason to switch
  steps(500);
  EXPECT_EQ(governor.switches(), 2);
  {
    ThreadGovernor busy;  // busy from the start: settled after 2 steps, it switches after the 3rd and 4th (tries)
    int64_t slow_steps = 0;
    for (int i = 0; i < 40; ++i) {
      const int threads = busy.begin_step(3);
      slow_steps += threads == 4;
      busy.end_step(threads == 1 ? 0.5 : 1.0);
    }
    EXPECT_EQ(busy.current(3), 1);
    EXPECT_LE(slow_steps, 4) << "two steps to settle, and one try of the full count after the switch";
  }
  set_num_threads(1);  // the caller's own count changes: with 1 thread there is nothing to choose
  EXPECT_EQ(governor.begin_step(7), 1);
  governor.end_step(1.0);
  EXPECT_EQ(governor.full(), 1);
  set_num_threads(before);
}

TEST(Session, AChatContinuesFromItsCacheAndAForkSharesThePrefix) {
  const auto model = nn::load_hf_decoder(fixture("hf/qwen3"));
  model->eval();
  const int64_t V = model->vocab_size();
  const std::vector<int64_t> turn1 = prompt_of(9, V, 2), turn2 = prompt_of(6, V, 5);
  nn::SessionOptions o;
  o.block_size = 4;
  nn::Session session(*model, o);
  // Turn 1 in a kept sequence, then turn 2 appended to it
  const int64_t chat = session.open();
  nn::GenerationRequest r;
  r.sampling.greedy = true;
  r.max_new_tokens = 5;
  r.prompt = turn1;
  r.sequence = chat;
  const auto reply1 = nn::generate(session, {r})[0].tokens;
  EXPECT_EQ(session.length(chat), 9 + 4) << "the prompt and the reply but its last token";
  std::vector<int64_t> history = turn1;
  history.insert(history.end(), reply1.begin(), reply1.end());
  history.insert(history.end(), turn2.begin(), turn2.end());
  const int64_t held = session.common_prefix(chat, history);
  EXPECT_EQ(held, 13);
  r.prompt.assign(history.begin() + held, history.end());
  const auto reply2 = nn::generate(session, {r})[0].tokens;
  // The same history fed afresh
  nn::GenerationRequest fresh;
  fresh.sampling.greedy = true;
  fresh.max_new_tokens = 5;
  fresh.prompt = history;
  EXPECT_EQ(nn::generate(session, {fresh})[0].tokens, reply2);
  // A fork of the first 10 positions shares 2 whole blocks, copies the partial third on its first write
  const int64_t before = session.cache().blocks_in_use();
  const int64_t forked = session.fork(chat, 10);
  EXPECT_EQ(session.cache().blocks_in_use(), before);
  nn::GenerationRequest branch;
  branch.sampling.greedy = true;
  branch.max_new_tokens = 4;
  branch.sequence = forked;
  branch.prompt = turn2;
  std::vector<int64_t> whole(history.begin(), history.begin() + 10);
  whole.insert(whole.end(), turn2.begin(), turn2.end());
  fresh.prompt = whole;
  fresh.max_new_tokens = 4;
  EXPECT_EQ(nn::generate(session, {branch})[0].tokens, nn::generate(session, {fresh})[0].tokens);
  EXPECT_EQ(session.tokens(chat).size(), static_cast<size_t>(session.length(chat))) << "the original is untouched";
  session.close(forked);
  session.close(chat);
  EXPECT_EQ(session.cache().blocks_in_use(), 0);
}

// The KV cache's storage types (--kv-cache): a block cache of f16, bf16 or q8_0 gives back exactly the values those
// types round to (the kernels' conversions, checked against ggml elsewhere), within each type's error of what was
// written, in 1/2 or 34/128 of float32's bytes; q8_0 refuses a width that is not whole blocks of 32.
TEST(SessionKVCache, NarrowTypesStoreTheRoundedValuesInLessMemory) {
  using kernels::WeightType;
  const int64_t width = 64, layers = 2, positions = 7;
  std::vector<float> keys(static_cast<size_t>(layers * positions * width)), values(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 5));
    values[i] = std::cos(0.11f * static_cast<float>(i)) * 0.25f;
  }
  const int64_t f32_bytes = nn::KVBlockCache(layers, width, 4, 8).bytes_per_block();
  EXPECT_EQ(f32_bytes, layers * 2 * 4 * width * 4);
  for (WeightType type : {WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q8_0}) {
    nn::KVBlockCache cache(layers, width, 4, 8, type);
    EXPECT_EQ(cache.bytes_per_block(), type == WeightType::F32    ? f32_bytes
                                       : type == WeightType::Q8_0 ? f32_bytes * 34 / 128
                                                                  : f32_bytes / 2);
    cache.open(1);
    cache.grow(1, positions);
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t p = 0; p < positions; ++p)
        cache.write(l, 1, p, keys.data() + (l * positions + p) * width, values.data() + (l * positions + p) * width);
    for (int64_t l = 0; l < layers; ++l) {
      std::vector<float> got_k(static_cast<size_t>(positions * width)), got_v(got_k.size());
      cache.gather(l, 1, 0, positions, got_k.data(), got_v.data());
      for (int which = 0; which < 2; ++which) {
        const float* written = (which == 0 ? keys : values).data() + l * positions * width;
        const std::vector<float>& got = which == 0 ? got_k : got_v;
        std::vector<std::byte> stored(static_cast<size_t>(kernels::row_bytes(type, positions * width)));
        kernels::quantize_rows(type, written, stored.data(), 1, positions * width);
        std::vector<float> want(got.size());
        kernels::dequantize_rows(type, stored.data(), want.data(), 1, positions * width);
        for (int64_t i = 0; i < positions * width; ++i) {
          ASSERT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << kernels::weight_type_name(type) << " " << i;
          // each type's rounding: 2^-9 (bf16) or 2^-12 (f16) relative, half a step of absmax/127 per block (q8_0)
          float bound = 0.0f;
          if (type == WeightType::BF16) bound = std::abs(written[i]) * 0x1p-8f;
          if (type == WeightType::F16) bound = std::abs(written[i]) * 0x1p-11f + 1e-7f;
          if (type == WeightType::Q8_0) {
            float most = 0.0f;
            for (int64_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j) most = std::max(most, std::abs(written[j]));
            bound = most / 127.0f * 0.51f + most * 1e-3f;
          }
          EXPECT_LE(std::abs(got[static_cast<size_t>(i)] - written[i]), bound) << kernels::weight_type_name(type) << " " << i;
        }
      }
    }
  }
  EXPECT_THROW(nn::KVBlockCache(layers, 24, 4, 8, WeightType::Q8_0), ValueError);
  EXPECT_THROW(nn::KVBlockCache(layers, 64, 4, 8, WeightType::Q4_0), ValueError);
}

// A session with a narrow cache: the first logits of a prompt (which attend only to themselves) are close to float32's
// but not equal, the cache holds the same blocks in fewer bytes, batched generation still equals each prompt alone,
// and a model whose keys are not whole q8_0 blocks is refused with the fix named.
TEST(SessionKVCache, ASessionOnANarrowCacheStaysCloseAndBatchesAsAlone) {
  using kernels::WeightType;
  const auto model = nn::load_hf_decoder(fixture("hf/qwen3"));  // 2 kv heads of 16: whole q8_0 blocks
  model->eval();
  const int64_t V = model->vocab_size();
  const std::vector<int64_t> prompt = prompt_of(12, V, 3);
  auto last_logits = [&](WeightType type, int64_t* bytes) {
    nn::SessionOptions o;
    o.kv_type = type;
    nn::Session session(*model, o);
    const int64_t seq = session.open();
    nn::Batch batch;
    for (size_t i = 0; i < prompt.size(); ++i) batch.add(prompt[i], static_cast<int64_t>(i), seq, i + 1 == prompt.size());
    Tensor logits = session.decode(batch);
    *bytes = session.cache().bytes_allocated();
    return logits;
  };
  int64_t f32_bytes = 0;
  const Tensor exact = last_logits(WeightType::F32, &f32_bytes);
  float range = 0.0f;
  for (int64_t v = 0; v < V; ++v) range = std::max(range, std::abs(exact.data()[v]));
  for (WeightType type : {WeightType::F16, WeightType::BF16, WeightType::Q8_0}) {
    int64_t bytes = 0;
    const Tensor narrow = last_logits(type, &bytes);
    float most = 0.0f;
    for (int64_t v = 0; v < V; ++v) most = std::max(most, std::abs(narrow.data()[v] - exact.data()[v]));
    EXPECT_LT(most, 0.03f * range) << kernels::weight_type_name(type);
    if (type != WeightType::F16) EXPECT_GT(most, 0.0f) << kernels::weight_type_name(type) << ": nothing was rounded";
    EXPECT_EQ(bytes, type == WeightType::Q8_0 ? f32_bytes * 34 / 128 : f32_bytes / 2) << kernels::weight_type_name(type);
  }
  // Batched equals alone on a q8_0 cache too: rounding is per position, so a row's keys do not depend on the batch
  nn::SessionOptions o;
  o.kv_type = WeightType::Q8_0;
  std::vector<nn::GenerationRequest> requests;
  for (int64_t i = 0; i < 3; ++i) {
    nn::GenerationRequest r;
    r.prompt = prompt_of(5 + 4 * i, V, 10 + i);
    r.max_new_tokens = 6;
    r.sampling.greedy = true;
    requests.push_back(r);
  }
  nn::Session together(*model, o);
  const auto batched = nn::generate(together, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    nn::Session alone(*model, o);
    EXPECT_EQ(batched[i].tokens, nn::generate(alone, {requests[i]})[0].tokens) << "prompt " << i;
  }
  const auto llama = nn::load_hf_decoder(fixture("hf/llama"));  // 2 kv heads of 8: 16 values per position
  try {
    nn::Session refused(*llama, o);
    ADD_FAILURE() << "a q8_0 cache of 16-value keys was made";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("use f16 or bf16"), std::string::npos) << e.what();
  }
}

// A chat that continues its sequence in a full-sized cache: the blocks it already holds are not asked for again (qkv
// chat --max-context 48 refused its second turn, counting 3 blocks needed where 1 was new).
TEST(Session, AContinuedSequenceNeedsOnlyTheBlocksItAdds) {
  const auto model = nn::load_hf_decoder(fixture("hf/qwen3"));
  model->eval();
  nn::SessionOptions o;
  o.block_size = 16;
  o.max_tokens = 48;  // 3 blocks
  nn::Session session(*model, o);
  const int64_t chat = session.open();
  nn::GenerationRequest r;
  r.sampling.greedy = true;
  r.sequence = chat;
  r.prompt = prompt_of(20, model->vocab_size(), 4);
  r.max_new_tokens = 4;
  nn::generate(session, {r});
  EXPECT_EQ(session.cache().blocks_in_use(), 2);
  r.prompt = prompt_of(3, model->vocab_size(), 6);
  r.max_new_tokens = 48 - session.length(chat) - 3;  // up to the last position the cache holds
  const auto reply = nn::generate(session, {r})[0];
  EXPECT_EQ(reply.tokens.size(), static_cast<size_t>(r.max_new_tokens));
  EXPECT_EQ(session.cache().blocks_in_use(), 3);
  r.prompt = {1};
  r.max_new_tokens = 20;  // past the cache: refused, nothing taken
  EXPECT_THROW(nn::generate(session, {r}), ShapeError);
  EXPECT_EQ(session.cache().blocks_in_use(), 3);
}

TEST(Session, CancellingStopsASequenceAndFreesItsBlocks) {
  const auto model = nn::load_hf_decoder(fixture("hf/llama"));
  model->eval();
  nn::SessionOptions o;
  o.block_size = 4;
  nn::Session session(*model, o);
  std::vector<nn::GenerationRequest> requests(2);
  for (auto& r : requests) {
    r.prompt = prompt_of(6, model->vocab_size(), 3);
    r.max_new_tokens = 20;
    r.sampling.greedy = true;
  }
  int64_t in_use_after_cancel = -1;
  const auto results = nn::generate(session, requests, [&](size_t i, int64_t) {
    if (i == 0) return false;  // the first stops at its first token
    if (in_use_after_cancel < 0) in_use_after_cancel = session.cache().blocks_in_use();
    return true;
  });
  EXPECT_EQ(results[0].finish, nn::FinishReason::Cancelled);
  EXPECT_EQ(results[0].tokens.size(), 1u);
  EXPECT_EQ(results[1].finish, nn::FinishReason::Length);
  EXPECT_EQ(results[1].tokens.size(), 20u);
  EXPECT_EQ(in_use_after_cancel, 2) << "after the first step only the running sequence holds blocks (6 positions)";
  EXPECT_EQ(session.cache().blocks_in_use(), 0);
  EXPECT_GT(session.cache().bytes_allocated(), 0);
}

TEST(Session, ABatchLargerThanTheCacheIsRefusedBeforeAnythingRuns) {
  const auto model = nn::load_hf_decoder(fixture("hf/llama"));
  model->eval();
  nn::SessionOptions o;
  o.max_tokens = 32;
  o.block_size = 8;
  nn::Session session(*model, o);
  std::vector<nn::GenerationRequest> requests(3);
  for (auto& r : requests) {
    r.prompt = prompt_of(6, model->vocab_size(), 1);
    r.max_new_tokens = 6;  // 12 positions: 2 blocks each, 6 of the 4 there are
  }
  try {
    nn::generate(session, requests);
    ADD_FAILURE() << "no error";
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("6 KV cache blocks"), std::string::npos) << m;
    EXPECT_NE(m.find("max_tokens"), std::string::npos) << m;
  }
  EXPECT_EQ(session.cache().blocks_in_use(), 0);
  EXPECT_EQ(session.cache().blocks_allocated(), 0) << "nothing was allocated";
  // One request alone longer than the whole cache
  requests[0].max_new_tokens = 40;
  EXPECT_THROW(nn::generate(session, {requests[0]}), ShapeError);
  // A raw batch that needs more blocks than are free: refused, nothing changes
  const int64_t a = session.open();
  nn::Batch big;
  for (int64_t t = 0; t < 33; ++t) big.add(1, t, a);
  EXPECT_THROW(session.decode(big), ShapeError);
  EXPECT_EQ(session.length(a), 0);
  nn::Batch gap;
  gap.add(1, 3, a);
  EXPECT_THROW(session.decode(gap), ValueError) << "positions must continue the sequence";
  nn::Batch unknown;
  unknown.add(1, 0, 99);
  EXPECT_THROW(session.decode(unknown), ValueError);
  // Two requests that fit run
  requests.resize(2);
  requests[0].max_new_tokens = 6;
  EXPECT_EQ(nn::generate(session, requests).size(), 2u);
}

// ---- the sampler chain ----

std::vector<double> softmax(const std::vector<double>& z, double T) {
  double m = *std::max_element(z.begin(), z.end()), total = 0;
  std::vector<double> p;
  for (double v : z) total += std::exp((v - m) / T), p.push_back(std::exp((v - m) / T));
  for (double& v : p) v /= total;
  return p;
}

void expect_distribution(const std::vector<std::pair<int64_t, double>>& got, const std::map<int64_t, double>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [token, p] : got) {
    ASSERT_TRUE(expected.count(token)) << "token " << token << " kept";
    EXPECT_NEAR(p, expected.at(token), 1e-9) << "token " << token;
  }
}

TEST(Sampler, EachStepIsTheHandComputedDistribution) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, -1.0f, 1.0f};
  const std::vector<double> z(logits.begin(), logits.end());
  // temperature 0.5: softmax(z / 0.5)
  nn::SamplerOptions o;
  o.temperature = 0.5;
  const auto p = softmax(z, 0.5);
  expect_distribution(nn::Sampler(o).distribution(logits.data(), 5), {{0, p[0]}, {1, p[1]}, {2, p[2]}, {3, p[3]}, {4, p[4]}});
  // top-k 2 keeps 2.0 and both 1.0s (ties with the k-th stay, as transformers)
  o.top_k = 2;
  double t = p[0] + p[1] + p[4];
  expect_distribution(nn::Sampler(o).distribution(logits.data(), 5), {{0, p[0] / t}, {1, p[1] / t}, {4, p[4] / t}});
  // top-p: at T = 1, p ≈ .46 .17 .10 .04 .17 (sorted 0, 1, 4, 2, 3): 0.6 keeps 0 and 1 (mass before 4 is .63)
  o = {};
  o.top_p = 0.6;
  const auto q = softmax(z, 1.0);
  t = q[0] + q[1];
  expect_distribution(nn::Sampler(o).distribution(logits.data(), 5), {{0, q[0] / t}, {1, q[1] / t}});
  // min-p 0.3: p ≥ 0.3 · p(0): e^(z − 2) ≥ 0.3 keeps z ≥ 2 + ln 0.3 = 0.796: tokens 0, 1, 4
  o = {};
  o.min_p = 0.3;
  t = q[0] + q[1] + q[4];
  expect_distribution(nn::Sampler(o).distribution(logits.data(), 5), {{0, q[0] / t}, {1, q[1] / t}, {4, q[4] / t}});
  // penalties on tokens seen: 0 (twice) and 3 (once). Repetition 2: 2 → 1, −1 → −2; presence 0.5, frequency 0.25
  o = {};
  o.repetition_penalty = 2.0;
  o.presence_penalty = 0.5;
  o.frequency_penalty = 0.25;
  nn::Sampler penalised(o);
  penalised.accept(std::vector<int64_t>{0, 3, 0});
  const std::vector<double> zp = {2.0 / 2 - 0.5 - 2 * 0.25, 1.0, 0.5, -1.0 * 2 - 0.5 - 0.25, 1.0};
  const auto pp = softmax(zp, 1.0);
  expect_distribution(penalised.distribution(logits.data(), 5), {{0, pp[0]}, {1, pp[1]}, {2, pp[2]}, {3, pp[3]}, {4, pp[4]}});
  // penalty_last_n 1 looks at the last token only (0, once)
  o.penalty_last_n = 1;
  nn::Sampler last(o);
  last.accept(std::vector<int64_t>{3, 3, 0});
  const auto pl = softmax({2.0 / 2 - 0.5 - 0.25, 1.0, 0.5, -1.0, 1.0}, 1.0);
  expect_distribution(last.distribution(logits.data(), 5), {{0, pl[0]}, {1, pl[1]}, {2, pl[2]}, {3, pl[3]}, {4, pl[4]}});
  // greedy: the largest after penalties, lowest id among equals
  o = {};
  o.greedy = true;
  const std::vector<float> tied = {0.0f, 3.0f, 3.0f};
  EXPECT_EQ(nn::Sampler(o).sample(tied.data(), 3), 1);
  o.repetition_penalty = 2.0;
  nn::Sampler greedy(o);
  greedy.accept(1);
  EXPECT_EQ(greedy.sample(tied.data(), 3), 2);
  // vocab_limit: ids at or above it never come
  o = {};
  o.greedy = true;
  o.vocab_limit = 1;
  EXPECT_EQ(nn::Sampler(o).sample(tied.data(), 3), 0);
  // bad settings name themselves
  o = {};
  o.top_p = 0.0;
  EXPECT_THROW(nn::Sampler{o}, ValueError);
}

TEST(Sampler, DrawsFollowTheDistributionAndTheSeed) {
  const std::vector<float> logits = {1.0f, 0.0f, -0.5f, 0.7f};
  nn::SamplerOptions o;
  o.seed = 7;
  o.temperature = 0.8;
  nn::Sampler a(o), b(o);
  const auto d = a.distribution(logits.data(), 4);
  std::map<int64_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const int64_t t = a.sample(logits.data(), 4);
    EXPECT_EQ(t, b.sample(logits.data(), 4)) << "same seed, same draws";
    ++counts[t];
  }
  for (const auto& [token, p] : d) EXPECT_NEAR(counts[token] / double(n), p, 0.012) << token;
}

// ---- streaming text ----

bool whole_utf8(const std::string& s) { return !text::first_invalid_utf8(s).has_value(); }

TEST(StreamDecoder, ByteTokensThatSplitACharacterAreHeldBack) {
  const std::string message = "héllo 😀 世界, ok 👍🏽!";
  text::ByteTokenizer bytes;
  text::StreamDecoder stream(bytes);
  std::string out;
  int held = 0;
  for (int64_t id : bytes.encode(message)) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(whole_utf8(piece)) << "half a character handed out after byte " << id;
    held += piece.empty();
    out += piece;
  }
  out += stream.finish();
  EXPECT_EQ(out, message);
  EXPECT_EQ(stream.text(), message);
  EXPECT_GT(held, 10) << "the multi-byte characters waited for their last byte";
  // An unfinished character at the end comes out as U+FFFD from finish()
  text::StreamDecoder cut(bytes);
  EXPECT_EQ(cut.push(0xF0), "");
  EXPECT_EQ(cut.push(0x9F), "");
  const std::string rest = cut.finish();  // one U+FFFD per byte that is not a character
  EXPECT_TRUE(whole_utf8(rest));
  EXPECT_EQ(rest.rfind("\xEF\xBF\xBD", 0), 0u) << rest;
}

TEST(StreamDecoder, GptTwoByteLevelTokensOfEmojiAndCjkStreamWholeCharacters) {
  const auto dir = text::find_gpt2_vocabulary();
  if (!dir) GTEST_SKIP() << "GPT-2 vocabulary missing: run scripts/fetch-gpt2-vocab";
  const auto gpt2 = text::make_tokenizer("gpt2", *dir);
  const std::string message = "Hello 🦀 world 世界和平 — 😀😀 é";
  const std::vector<int64_t> ids = gpt2->encode(message);
  int splitting = 0;  // tokens that alone are not whole characters
  for (int64_t id : ids) splitting += !whole_utf8(gpt2->decode(std::vector<int64_t>{id})) || gpt2->decode(std::vector<int64_t>{id}).find("\xEF\xBF\xBD") != std::string::npos;
  EXPECT_GT(splitting, 2) << "the text must split characters between tokens for this test to mean anything";
  text::StreamDecoder stream(*gpt2);
  std::string out;
  for (int64_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "a replacement character was handed out";
    EXPECT_TRUE(whole_utf8(piece));
    out += piece;
  }
  out += stream.finish();
  EXPECT_EQ(out, message);
}

// ---- the CLI ----

TEST(GenerateCli, APromptsFileRunsAsOneBatchAndEachLineIsWhatThePromptGivesAlone) {
  const auto dir = std::filesystem::temp_directory_path() / ("qkv_session_cli_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string model = " --checkpoint " + fixture("pth/model.pth") + " --config " + fixture("pth/config.json");
  const std::vector<std::string> prompts = {"Hello", "Every eff", R"(\u00e9 \ud83d\ude00 x)", "A"};
  {
    std::ofstream f(dir / "prompts.jsonl");
    for (const auto& p : prompts) f << "\"" << p << "\"\n";
    f << "\n";  // a blank line is skipped
  }
  // The book's model reads bytes and 16 positions: the prompts and replies fit. (stderr is dropped: `; exit $?`
  // keeps run_cli's 2>&1 off the command.)
  const CliResult batch = run_cli("generate" + model + " --prompts " + (dir / "prompts.jsonl").string() +
                                  " --greedy --max-new-tokens 6 2>/dev/null; exit $?");
  ASSERT_EQ(batch.code, 0) << batch.out;
  std::vector<nlohmann::json> lines;
  for (size_t at = 0, end; (end = batch.out.find('\n', at)) != std::string::npos; at = end + 1)
    lines.push_back(nlohmann::json::parse(batch.out.substr(at, end - at)));
  ASSERT_EQ(lines.size(), prompts.size()) << batch.out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string prompt = nlohmann::json::parse("\"" + prompts[i] + "\"").get<std::string>();
    EXPECT_EQ(lines[i]["index"], i);
    EXPECT_EQ(lines[i]["prompt"], prompt);
    EXPECT_EQ(lines[i]["finish_reason"], "length");
    EXPECT_EQ(lines[i]["tokens"], 6);
    std::ofstream(dir / "one.txt") << prompt;
    const CliResult alone = run_cli("generate" + model + " --greedy --max-new-tokens 6 < " + (dir / "one.txt").string() +
                                    " 2>/dev/null; exit $?");
    ASSERT_EQ(alone.code, 0) << alone.out;
    EXPECT_EQ(prompt + lines[i]["text"].get<std::string>() + "\n", alone.out) << "prompt " << i;
  }
  // A line that is not a JSON string: the line is named, nothing is printed on stdout, exit 1
  for (const std::string bad : {"{\"prompt\": 1}", "not json", "42"}) {
    std::ofstream(dir / "bad.jsonl") << "\"fine\"\n" << bad << "\n\"fine\"\n";
    const CliResult r = run_cli("generate" + model + " --prompts " + (dir / "bad.jsonl").string() + " 2>" +
                                (dir / "err.txt").string() + "; exit $?");
    EXPECT_EQ(r.code, 1) << bad;
    EXPECT_EQ(r.out, "") << "nothing half-written";
    std::ifstream err(dir / "err.txt");
    const std::string message((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
    EXPECT_NE(message.find("bad.jsonl:2:"), std::string::npos) << message;
    EXPECT_NE(message.find("one JSON string"), std::string::npos) << message;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace qkv::test
