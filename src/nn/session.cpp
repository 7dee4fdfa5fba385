// The block KV cache, sessions and the batched generation loop (see qkv/nn/session.hpp).
#include "qkv/nn/session.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "qkv/core/autograd.hpp"
#include "qkv/core/error.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::nn {

// ---- the block cache ----

KVBlockCache::KVBlockCache(int64_t layers, int64_t width, int64_t block_size, int64_t max_blocks, kernels::WeightType type,
                           bool keys_only)
    : layers_(layers), width_(width), block_size_(block_size), max_blocks_(max_blocks), type_(type),
      kinds_(keys_only ? 1 : 2) {
  using kernels::WeightType;
  if (layers <= 0 || width <= 0 || block_size <= 0 || max_blocks <= 0)
    throw ValueError("KV cache: layers, width, block size and block count must be positive");
  if (max_blocks > (int64_t{1} << 30)) throw ValueError("KV cache: more than 2^30 blocks; use larger blocks");
  if (type != WeightType::F32 && type != WeightType::F16 && type != WeightType::BF16 && type != WeightType::Q8_0)
    throw ValueError(std::string("KV cache: keys and values cannot be stored as ") + kernels::weight_type_name(type) +
                     "; use f32, f16, bf16 or q8_0");
  if (type == WeightType::Q8_0 && width % 32 != 0)
    throw ValueError("KV cache: q8_0 stores blocks of 32 values, but this model's keys have " + std::to_string(width) +
                     " per position (kv heads × head size); use f16 or bf16");
  row_bytes_ = kernels::row_bytes(type, width);
  // Reserved for every block it may hold (address space only: MAP_NORESERVE); refused or overflowing, blocks of their own
  const int64_t bytes = bytes_per_block();
  if (bytes <= std::numeric_limits<int64_t>::max() / max_blocks_) region_ = memory::Region(static_cast<size_t>(bytes * max_blocks_));
}

std::byte* KVBlockCache::block_data(int32_t block) const {
  return region_.data() ? region_.data() + static_cast<size_t>(block) * static_cast<size_t>(bytes_per_block())
                        : storage_[static_cast<size_t>(block)].get();
}

int64_t KVBlockCache::blocks_allocated() const {
  return static_cast<int64_t>(storage_.size() - unallocated_.size());
}

int64_t KVBlockCache::tokens_held() const {
  int64_t n = 0;
  for (const auto& [id, s] : sequences_) n += s.length;
  return n;
}

const KVBlockCache::Sequence& KVBlockCache::at(int64_t seq) const {
  const auto it = sequences_.find(seq);
  if (it == sequences_.end()) throw ValueError("KV cache: sequence " + std::to_string(seq) + " is not open");
  return it->second;
}

int64_t KVBlockCache::length(int64_t seq) const { return at(seq).length; }

void KVBlockCache::open(int64_t seq) {
  Sequence s;
  s.state.assign(static_cast<size_t>(state_floats_), 0.0f);
  if (!sequences_.emplace(seq, std::move(s)).second)
    throw ValueError("KV cache: sequence " + std::to_string(seq) + " is already open");
}

int64_t KVBlockCache::bytes_allocated() const {
  return blocks_allocated() * bytes_per_block() +
         static_cast<int64_t>(sequences_.size()) * state_floats_ * static_cast<int64_t>(sizeof(float));
}

void KVBlockCache::keep_states(int64_t floats) {
  if (!sequences_.empty()) throw ValueError("KV cache: keep_states before any sequence opens");
  if (floats < 0) throw ValueError("KV cache: a state of " + std::to_string(floats) + " values");
  state_floats_ = floats;
}

float* KVBlockCache::state(int64_t seq) {
  (void)at(seq);
  return sequences_.at(seq).state.data();
}

void KVBlockCache::restore(int64_t seq, int64_t length, const std::vector<float>& saved) {
  Sequence& s = sequences_.at((at(seq), seq));
  if (static_cast<int64_t>(saved.size()) != state_floats_ || length < 0 || length > s.length)
    throw ValueError("KV cache: cannot restore sequence " + std::to_string(seq) + " to " + std::to_string(length) +
                     " positions with a state of " + std::to_string(saved.size()) + " values");
  truncate_blocks(s, length);
  s.state = saved;
}

void KVBlockCache::truncate_blocks(Sequence& s, int64_t length) {
  const size_t keep = static_cast<size_t>((length + block_size_ - 1) / block_size_);
  for (size_t b = keep; b < s.blocks.size(); ++b) release(s.blocks[b]);
  s.blocks.resize(keep);
  s.length = length;
}

int32_t KVBlockCache::take_block() {
  if (in_use_ >= max_blocks_) throw ShapeError("KV cache: no free block (a bug: callers check blocks_free first)");
  int32_t id;
  if (!spare_.empty()) {
    id = spare_.back();
    spare_.pop_back();
  } else {
    if (!unallocated_.empty()) {
      id = unallocated_.back();
      unallocated_.pop_back();
    } else {
      id = static_cast<int32_t>(storage_.size());
      storage_.emplace_back();
      refs_.push_back(0);
    }
    if (!region_.data())
      storage_[static_cast<size_t>(id)].reset(new std::byte[static_cast<size_t>(bytes_per_block())]);  // written before read
  }
  refs_[static_cast<size_t>(id)] = 1;
  ++in_use_;
  return id;
}

void KVBlockCache::release(int32_t block) {
  if (--refs_[static_cast<size_t>(block)] == 0) {
    spare_.push_back(block);
    --in_use_;
  }
}

void KVBlockCache::trim() {
  const auto bytes = static_cast<size_t>(bytes_per_block());
  for (int32_t id : spare_) {
    if (region_.data()) region_.release(static_cast<size_t>(id) * bytes, bytes);
    storage_[static_cast<size_t>(id)].reset();
    unallocated_.push_back(id);
  }
  spare_.clear();
}

void KVBlockCache::close(int64_t seq) {
  const Sequence s = at(seq);
  for (int32_t b : s.blocks) release(b);
  sequences_.erase(seq);
}

int64_t KVBlockCache::blocks_to_grow(int64_t seq, int64_t length) const {
  const Sequence& s = at(seq);
  if (length <= s.length) return 0;
  const int64_t have = static_cast<int64_t>(s.blocks.size());
  const int64_t need = (length + block_size_ - 1) / block_size_;
  // A shared last block that is partly filled is copied before the first write into it.
  const bool copy = s.length % block_size_ != 0 && refs_[static_cast<size_t>(s.blocks.back())] > 1;
  return need - have + (copy ? 1 : 0);
}

void KVBlockCache::grow(int64_t seq, int64_t length) {
  const int64_t needed = blocks_to_grow(seq, length);
  if (needed > blocks_free())
    throw ShapeError("KV cache: " + std::to_string(needed) + " more blocks of " + std::to_string(block_size_) +
                     " positions are needed but " + std::to_string(blocks_free()) + " of " + std::to_string(max_blocks_) +
                     " are free; free sequences or make the session with a larger max_tokens");
  Sequence& s = sequences_.at(seq);
  if (length <= s.length) return;
  if (s.length % block_size_ != 0 && refs_[static_cast<size_t>(s.blocks.back())] > 1) {  // copy on write
    const int32_t shared = s.blocks.back(), own = take_block();
    std::memcpy(block_data(own), block_data(shared), static_cast<size_t>(bytes_per_block()));
    release(shared);
    s.blocks.back() = own;
  }
  while (static_cast<int64_t>(s.blocks.size()) * block_size_ < length) s.blocks.push_back(take_block());
  s.length = length;
}

void KVBlockCache::truncate(int64_t seq, int64_t length) {
  Sequence& s = sequences_.at((at(seq), seq));
  if (length < 0 || length > s.length)
    throw ValueError("KV cache: cannot cut sequence " + std::to_string(seq) + " of " + std::to_string(s.length) +
                     " positions to " + std::to_string(length));
  if (state_floats_ > 0 && length != s.length) {
    if (length != 0)
      throw ValueError("KV cache: sequence " + std::to_string(seq) + " has a recurrent state (Gated DeltaNet), which "
                       "holds all of its " + std::to_string(s.length) + " positions: it can be cut to 0, not to " +
                       std::to_string(length) + " (feed its first positions again instead)");
    std::fill(s.state.begin(), s.state.end(), 0.0f);
  }
  truncate_blocks(s, length);
}

void KVBlockCache::fork(int64_t src, int64_t dst, int64_t length) {
  const Sequence& s = at(src);
  if (length < 0 || length > s.length)
    throw ValueError("KV cache: cannot fork " + std::to_string(length) + " positions of a sequence of " +
                     std::to_string(s.length));
  if (state_floats_ > 0 && length != s.length && length != 0)
    throw ValueError("KV cache: sequence " + std::to_string(src) + " has a recurrent state (Gated DeltaNet), which "
                     "holds all of its " + std::to_string(s.length) + " positions: a fork takes all of them or none, "
                     "not " + std::to_string(length));
  if (sequences_.count(dst)) throw ValueError("KV cache: sequence " + std::to_string(dst) + " is already open");
  const size_t blocks = static_cast<size_t>((length + block_size_ - 1) / block_size_);
  Sequence copy;
  copy.blocks.assign(s.blocks.begin(), s.blocks.begin() + static_cast<std::ptrdiff_t>(blocks));
  copy.length = length;
  copy.state = length == s.length ? s.state : std::vector<float>(static_cast<size_t>(state_floats_), 0.0f);
  for (int32_t b : copy.blocks) ++refs_[static_cast<size_t>(b)];  // shared; a partial last block is copied on write
  sequences_.emplace(dst, std::move(copy));
}

std::byte* KVBlockCache::slot(int32_t block, int64_t layer, int kv, int64_t pos) const {
  return block_data(block) + ((layer * kinds_ + kv) * block_size_ + pos % block_size_) * row_bytes_;
}

void KVBlockCache::write(int64_t layer, int64_t seq, int64_t pos, const float* key, const float* value) {
  const int32_t block = sequences_.at(seq).blocks[static_cast<size_t>(pos / block_size_)];
  std::byte* k = slot(block, layer, 0, pos);
  std::byte* v = kinds_ == 2 ? slot(block, layer, 1, pos) : nullptr;
  if (type_ == kernels::WeightType::F32) {
    std::memcpy(k, key, static_cast<size_t>(row_bytes_));
    if (v) std::memcpy(v, value, static_cast<size_t>(row_bytes_));
    return;
  }
  try {
    kernels::quantize_rows(type_, key, k, 1, width_);
    if (v) kernels::quantize_rows(type_, value, v, 1, width_);
  } catch (const std::invalid_argument& e) {
    throw ValueError(std::string("KV cache: ") + e.what());
  }
}

void KVBlockCache::gather(int64_t layer, int64_t seq, int64_t begin, int64_t end, float* keys, float* values) const {
  thread_local std::vector<kernels::KVPage> runs;  // one block's run of positions each
  runs.clear();
  pages(layer, seq, begin, end, runs);
  int64_t at = 0;  // rows written so far
  for (const kernels::KVPage& run : runs) {
    if (type_ == kernels::WeightType::F32) {
      const size_t bytes = static_cast<size_t>(run.positions * row_bytes_);
      std::memcpy(keys + at * width_, run.keys, bytes);
      if (values && kinds_ == 2) std::memcpy(values + at * width_, run.values, bytes);
    } else {
      kernels::dequantize_rows(type_, run.keys, keys + at * width_, run.positions, width_);
      if (values && kinds_ == 2) kernels::dequantize_rows(type_, run.values, values + at * width_, run.positions, width_);
    }
    at += run.positions;
  }
}

void KVBlockCache::pages(int64_t layer, int64_t seq, int64_t begin, int64_t end, std::vector<kernels::KVPage>& pages) const {
  const Sequence& s = at(seq);
  for (int64_t p = begin; p < end;) {
    const int32_t block = s.blocks[static_cast<size_t>(p / block_size_)];
    const int64_t n = std::min(end, (p / block_size_ + 1) * block_size_) - p;
    const std::byte* keys = slot(block, layer, 0, p);
    pages.push_back({keys, kinds_ == 2 ? slot(block, layer, 1, p) : keys, n});
    p += n;
  }
}

// ---- the session ----

namespace {
int64_t cache_blocks(const Decoder& model, const SessionOptions& o) {
  if (o.block_size <= 0 || o.block_size > 4096) throw ValueError("session: block_size must lie in [1, 4096]");
  if (o.max_tokens < 0) throw ValueError("session: max_tokens must be ≥ 0 (0: the model's context)");
  if (o.max_batch_tokens <= 0 || o.prefill_chunk <= 0)
    throw ValueError("session: max_batch_tokens and prefill_chunk must be positive");
  const int64_t tokens = o.max_tokens > 0 ? o.max_tokens : model.context_length();
  return (tokens + o.block_size - 1) / o.block_size;
}
}  // namespace

Session::Session(const Decoder& model, const SessionOptions& options)
    : model_(model), options_(options),
      cache_(std::max<int64_t>(1, model.block_cache_layers()), model.block_cache_width(), options.block_size,
             cache_blocks(model, options), options.kv_type, /*keys_only=*/model.config.latent()) {
  if (model.is_classifier())
    throw ValueError("session: the model is a classifier (" + std::to_string(model.config.num_labels) +
                     " classes), not a language model");
  cache_.keep_states(model.block_cache_state_floats());  // Gated DeltaNet's, per sequence
  if (options.adapt_threads) governor_ = std::make_unique<ThreadGovernor>();
}

int64_t Session::open() {
  const int64_t id = next_id_++;
  cache_.open(id);
  tokens_[id];
  return id;
}

void Session::close(int64_t seq) {
  cache_.close(seq);
  tokens_.erase(seq);
}

int64_t Session::fork(int64_t seq, int64_t length) {
  const int64_t n = length < 0 ? cache_.length(seq) : length;
  const int64_t id = next_id_++;
  cache_.fork(seq, id, n);
  const std::vector<int64_t>& held = tokens_.at(seq);
  tokens_[id].assign(held.begin(), held.begin() + n);
  return id;
}

void Session::truncate(int64_t seq, int64_t length) {
  cache_.truncate(seq, length);
  tokens_.at(seq).resize(static_cast<size_t>(length));
}

int64_t Session::length(int64_t seq) const { return cache_.length(seq); }

const std::vector<int64_t>& Session::tokens(int64_t seq) const {
  (void)cache_.length(seq);  // ValueError for an unknown sequence
  return tokens_.at(seq);
}

int64_t Session::common_prefix(int64_t seq, std::span<const int64_t> ids) const {
  const std::vector<int64_t>& held = tokens(seq);
  const size_t n = std::min(held.size(), ids.size());
  return static_cast<int64_t>(std::mismatch(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(n), ids.begin()).first - held.begin());
}

Tensor Session::decode(const Batch& batch) {
  if (!governor_) return decode_batch(batch);
  // Batches of one size are one kind of step: the governor compares a step only with steps that feed as many rows.
  governor_->begin_step(static_cast<int64_t>(batch.tokens.size()));
  const auto start = std::chrono::steady_clock::now();
  try {
    Tensor logits = decode_batch(batch);
    governor_->end_step(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return logits;
  } catch (...) {
    governor_->abandon_step();
    throw;
  }
}

Tensor Session::decode_batch(const Batch& batch) {
  if (batch.tokens.empty()) throw ValueError("session: an empty batch; add at least one token");
  const int64_t V = model_.vocab_size(), context = model_.context_length();
  // Rows grouped by sequence (in the order sequences first appear), each sequence's in position order.
  std::vector<size_t> order(batch.tokens.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::unordered_map<int64_t, size_t> first;
  for (size_t i = 0; i < batch.tokens.size(); ++i) first.emplace(batch.tokens[i].sequence, i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const BatchToken &x = batch.tokens[a], &y = batch.tokens[b];
    const size_t fx = first.at(x.sequence), fy = first.at(y.sequence);
    return fx != fy ? fx < fy : x.position < y.position;
  });
  // Each sequence's tokens, checked: open, in the vocabulary, continuing it, inside the context.
  struct Group {
    int64_t sequence = 0, start = 0;
    std::vector<size_t> tokens;  // indices into batch.tokens, in position order
  };
  std::vector<Group> groups;
  for (size_t index : order) {
    const BatchToken& t = batch.tokens[index];
    if (!cache_.contains(t.sequence))
      throw ValueError("session: sequence " + std::to_string(t.sequence) + " is not open (Session::open gives one)");
    if (t.id < 0 || t.id >= V)
      throw ValueError("session: token id " + std::to_string(t.id) + " is outside the model's vocabulary [0, " +
                       std::to_string(V) + ")");
    if (groups.empty() || groups.back().sequence != t.sequence) groups.push_back({t.sequence, cache_.length(t.sequence), {}});
    Group& g = groups.back();
    const int64_t given = static_cast<int64_t>(g.tokens.size());
    if (t.position != g.start + given)
      throw ValueError("session: a token of sequence " + std::to_string(t.sequence) + " at position " +
                       std::to_string(t.position) + ", but the sequence holds " + std::to_string(g.start) +
                       " positions" + (given > 0 ? " and the batch gives it " + std::to_string(given) + " before" : "") +
                       ": positions must continue the sequence (truncate it first to rewrite)");
    if (t.position >= context)
      throw ShapeError("session: position " + std::to_string(t.position) + " of sequence " + std::to_string(t.sequence) +
                       " is past the model's " + std::to_string(context) + " positions (max_position_embeddings)");
    g.tokens.push_back(index);
  }
  // The plan: a sequence's rows together. A sequence growing past the model's rotation switch (LongRoPE) has keys
  // cached with the short factors: it is encoded again from its start, as alone (and as transformers) it would be.
  const int64_t rotation_switch = model_.rotation_switch();
  BatchPlan plan;
  std::vector<int64_t> row_of(batch.tokens.size());
  std::vector<bool> recomputed;
  for (const Group& g : groups) {
    const int64_t end = g.start + static_cast<int64_t>(g.tokens.size());
    const bool again = rotation_switch > 0 && g.start > 0 && g.start <= rotation_switch && end > rotation_switch;
    recomputed.push_back(again);
    BatchPlan::Run run{g.sequence, static_cast<int64_t>(plan.ids.size()), 0, again ? 0 : g.start};
    if (again)
      for (int64_t p = 0; p < g.start; ++p) {
        plan.ids.push_back(tokens_.at(g.sequence)[static_cast<size_t>(p)]);
        plan.positions.push_back(p);
      }
    for (size_t index : g.tokens) {
      row_of[index] = static_cast<int64_t>(plan.ids.size());
      plan.ids.push_back(batch.tokens[index].id);
      plan.positions.push_back(batch.tokens[index].position);
    }
    run.rows = static_cast<int64_t>(plan.ids.size()) - run.row0;
    plan.runs.push_back(run);
  }
  int64_t blocks_needed = 0;
  for (const BatchPlan::Run& run : plan.runs) blocks_needed += cache_.blocks_to_grow(run.sequence, run.start + run.rows);
  if (blocks_needed > cache_.blocks_free())
    throw ShapeError("session: the batch needs " + std::to_string(blocks_needed) + " more KV cache blocks of " +
                     std::to_string(cache_.block_size()) + " positions but " + std::to_string(cache_.blocks_free()) +
                     " of " + std::to_string(cache_.max_blocks()) + " are free (" + std::to_string(capacity()) +
                     " positions in all); decode fewer sequences at once, close some, or make the session with a "
                     "larger max_tokens");
  // The returned rows, in batch order
  for (size_t i = 0; i < batch.tokens.size(); ++i)
    if (batch.tokens[i].logits) plan.logit_rows.push_back(row_of[i]);
  // Make room (keeping the old lengths and recurrent states, so an error in the forward leaves the sequences as they
  // were)
  std::vector<int64_t> before;
  std::vector<std::vector<float>> states;
  const auto floats = static_cast<size_t>(cache_.state_floats());
  for (const Group& g : groups) {
    before.push_back(g.start);
    if (floats > 0) states.emplace_back(cache_.state(g.sequence), cache_.state(g.sequence) + floats);
    cache_.grow(g.sequence, g.start + static_cast<int64_t>(g.tokens.size()));
  }
  Tensor logits;
  try {
    logits = model_.forward_batch(plan, cache_);
  } catch (...) {
    for (size_t i = 0; i < groups.size(); ++i) {
      // A sequence being encoded again may have lost its old keys: it is emptied (its tokens can be fed again).
      const int64_t keep = recomputed[i] ? 0 : before[i];
      if (floats > 0)
        cache_.restore(groups[i].sequence, keep, recomputed[i] ? std::vector<float>(floats, 0.0f) : states[i]);
      else
        cache_.truncate(groups[i].sequence, keep);
      tokens_.at(groups[i].sequence).resize(static_cast<size_t>(keep));
    }
    throw;
  }
  for (const Group& g : groups) {
    std::vector<int64_t>& held = tokens_.at(g.sequence);
    for (size_t index : g.tokens) held.push_back(batch.tokens[index].id);
  }
  return logits;
}

// ---- generation ----

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
  }
  return "?";
}

std::vector<GenerationResult> generate(Session& session, const std::vector<GenerationRequest>& requests,
                                       const TokenCallback& on_token) {
  NoGradGuard no_grad;
  const Decoder& model = session.model();
  const int64_t V = model.vocab_size(), context = model.context_length();
  const int64_t bs = session.cache().block_size();
  // Check everything before anything runs.
  int64_t blocks_total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    const std::string which = "request " + std::to_string(i);
    if (r.max_new_tokens < 0) throw ValueError(which + ": max_new_tokens must be ≥ 0");
    r.sampling.validate();
    const int64_t held = r.sequence >= 0 ? session.length(r.sequence) : 0;
    if (r.sequence < 0 && r.prompt.empty()) throw ValueError(which + ": the prompt is empty; give at least one token");
    if (r.sequence >= 0 && r.prompt.empty() && held == 0)
      throw ValueError(which + ": its sequence holds nothing and the prompt is empty; give at least one token");
    if (r.sequence >= 0 && r.prompt.empty())
      throw ValueError(which + ": continuing a sequence needs at least one new token (its last token's logits are not kept)");
    for (int64_t id : r.prompt)
      if (id < 0 || id >= V)
        throw ValueError(which + ": token id " + std::to_string(id) + " is outside the model's vocabulary [0, " +
                         std::to_string(V) + ")");
    const int64_t fed = held + static_cast<int64_t>(r.prompt.size());
    if (fed > context)
      throw ShapeError(which + ": " + std::to_string(fed) + " tokens are more than the model's " +
                       std::to_string(context) + " positions; shorten the prompt");
    const int64_t most = std::min(context, fed + r.max_new_tokens);
    const int64_t blocks = (most + bs - 1) / bs;
    if (blocks > session.cache().max_blocks())
      throw ShapeError(which + ": its prompt and max_new_tokens need " + std::to_string(most) + " positions, but the "
                       "KV cache holds " + std::to_string(session.capacity()) + "; lower max_new_tokens or make the "
                       "session with a larger max_tokens");
    // What it adds to the cache: a continued sequence already holds its first blocks (counted free of them)
    blocks_total += r.sequence >= 0 ? session.cache().blocks_to_grow(r.sequence, most) : blocks;
  }
  if (blocks_total > session.cache().blocks_free())
    throw ShapeError("generate: " + std::to_string(requests.size()) + " requests may need " + std::to_string(blocks_total) +
                     " KV cache blocks of " + std::to_string(bs) + " positions together, but " +
                     std::to_string(session.cache().blocks_free()) + " are free (" + std::to_string(session.capacity()) +
                     " positions in all); run fewer prompts at once, lower max_new_tokens, or make the session with a "
                     "larger max_tokens");

  struct Running {
    int64_t seq = -1;
    bool owned = false, done = false;
    std::vector<int64_t> pending;  // tokens still to feed
    size_t fed = 0;                // of pending, fed already
    Sampler sampler;
  };
  std::vector<GenerationResult> results(requests.size());
  std::vector<Running> running(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    Running& s = running[i];
    s.owned = r.sequence < 0;
    s.seq = s.owned ? session.open() : r.sequence;
    s.sampler = Sampler(r.sampling);
    s.sampler.accept(session.tokens(s.seq));
    s.sampler.accept(r.prompt);
    s.pending = r.prompt;
    results[i].prompt_tokens = static_cast<int64_t>(r.prompt.size());
    results[i].sequence = s.seq;
    if (r.max_new_tokens == 0) {
      s.done = true;
      results[i].finish = FinishReason::Length;
    }
  }
  auto finish = [&](size_t i, FinishReason why) {
    running[i].done = true;
    results[i].finish = why;
    if (running[i].owned) session.close(running[i].seq);
  };
  const int64_t chunk = session.options().prefill_chunk, cap = session.options().max_batch_tokens;
  try {
    Batch batch;
    std::vector<size_t> sampled;  // which request each logits row belongs to
    for (;;) {
      batch.clear();
      sampled.clear();
      for (size_t i = 0; i < running.size(); ++i) {
        Running& s = running[i];
        if (s.done) continue;
        // The next piece: up to the next multiple of prefill_chunk, so a prompt is cut at the same positions in any
        // batch (a piece's rows attend in one kernel call; solo and batched runs must make the same calls).
        const int64_t pos = session.length(s.seq);
        const int64_t left = static_cast<int64_t>(s.pending.size() - s.fed);
        const int64_t piece = std::min(left, (pos / chunk + 1) * chunk - pos);
        if (batch.size() > 0 && batch.size() + piece > cap) continue;  // next step
        for (int64_t k = 0; k < piece; ++k)
          batch.add(s.pending[s.fed + static_cast<size_t>(k)], pos + k, s.seq, k + 1 == left);
        s.fed += static_cast<size_t>(piece);
        if (piece == left) sampled.push_back(i);
      }
      if (batch.size() == 0) break;
      const Tensor logits = session.decode(batch);
      for (size_t row = 0; row < sampled.size(); ++row) {
        const size_t i = sampled[row];
        Running& s = running[i];
        const GenerationRequest& r = requests[i];
        const int64_t token = s.sampler.sample(logits.data() + static_cast<int64_t>(row) * V, V);
        s.pending.assign(1, token);
        s.fed = 0;
        if (std::find(r.stop_ids.begin(), r.stop_ids.end(), token) != r.stop_ids.end()) {
          finish(i, FinishReason::Stop);
          continue;
        }
        results[i].tokens.push_back(token);
        s.sampler.accept(token);
        if (on_token && !on_token(i, token)) finish(i, FinishReason::Cancelled);
        else if (static_cast<int64_t>(results[i].tokens.size()) >= r.max_new_tokens ||
                 session.length(s.seq) >= context)
          finish(i, FinishReason::Length);
      }
    }
  } catch (...) {  // a failed step or callback: owned sequences are freed, the caller's are left as they are
    for (size_t i = 0; i < running.size(); ++i)
      if (!running[i].done && running[i].owned) session.close(running[i].seq);
    throw;
  }
  return results;
}

}  // namespace qkv::nn
