// Sessions in the spirit of llama.h: a batch of tokens, each with its position and sequence id; a KV cache of
// fixed-size blocks shared by many sequences, which grow, end and are freed independently (memory follows the tokens
// held, not a preallocated context); and the generation loop on top — N prompts of different lengths decoded as one
// batch, each stopping at its own stop token or limit, each token exactly what the sequence would get alone (greedy:
// token for token), streamed through a callback that can stop it.
//   nn::Session session(*pretrained->model);
//   auto results = nn::generate(session, {{.prompt = ids_a}, {.prompt = ids_b}});
// What makes "the same as alone" hold: every product runs row-independent (kernels::RowIndependentProducts), a
// sequence's attention reads only its own blocks, and a prompt is cut into pieces at the same positions in any batch.
// Not here: the model (decoder.hpp), the sampler chain (sampler.hpp), text (text/stream.hpp), HTTP (serve/).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "qkv/core/inference.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/core/thread_governor.hpp"
#include "qkv/nn/sampler.hpp"

namespace qkv::nn {

class Decoder;

// One token of a batch: which sequence it extends, at which position, and whether its logits are wanted
struct BatchToken {
  int64_t id = 0;        // the token id
  int64_t position = 0;  // its position in its sequence: the sequence's length when it is fed (positions continue)
  int64_t sequence = 0;  // the sequence it belongs to (Session::open)
  bool logits = false;   // Session::decode returns a row of logits for it
};

// The tokens one Session::decode call feeds (llama_batch): any sequences, any mix of prompt pieces and single tokens
struct Batch {
  std::vector<BatchToken> tokens;  // in any order; a sequence's tokens are applied in position order
  // Appends a token
  void add(int64_t id, int64_t position, int64_t sequence, bool logits = false) {
    tokens.push_back({id, position, sequence, logits});
  }
  void clear() { tokens.clear(); }  // empties it
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }  // how many tokens it holds
};

// A KV cache of fixed-size blocks: each holds block_size positions of every layer's keys and values
// (layers × 2 × block_size × H_kv·D floats). A sequence owns a list of blocks; blocks are allocated as sequences
// reach them, returned to a free list when a sequence ends or is cut, and shared (counted) between sequences that
// fork from a common prefix. Memory is the most blocks ever held at once, never a whole context per sequence.
class KVBlockCache {
 public:
  // For `layers` layers of `width` (H_kv·D) values per position, at most max_blocks blocks of block_size positions,
  // stored as `type`: F32, F16, BF16 (rounded to nearest even) or Q8_0 (ggml's blocks of 32 with a half scale; width
  // must be a multiple of 32). ValueError for another type or a width Q8_0 cannot hold. keys_only: one row per
  // position and layer, no values (latent attention caches its latent and rotated key as the "key", read as both).
  KVBlockCache(int64_t layers, int64_t width, int64_t block_size, int64_t max_blocks,
               kernels::WeightType type = kernels::WeightType::F32, bool keys_only = false);

  int64_t block_size() const { return block_size_; }  // positions per block
  int64_t max_blocks() const { return max_blocks_; }   // the most blocks it may hold
  int64_t blocks_in_use() const { return in_use_; }    // blocks some sequence holds
  int64_t blocks_free() const { return max_blocks_ - in_use_; }  // blocks that can still be taken
  int64_t blocks_allocated() const;                    // blocks whose memory is allocated (in use or kept for reuse)
  kernels::WeightType type() const { return type_; }  // how keys and values are stored
  // Bytes of one block: every layer's keys and values for block_size positions, in the cache's type
  int64_t bytes_per_block() const { return layers_ * kinds_ * block_size_ * row_bytes_; }
  int64_t width() const { return width_; }              // values per position, layer and kind
  bool keys_only() const { return kinds_ == 1; }       // no values kept (see the constructor)
  int64_t bytes_allocated() const;  // memory held now: the blocks allocated and the open sequences' states
  int64_t tokens_held() const;  // Σ over sequences of their lengths (shared prefixes counted once per sequence)
  // Blocks that taking `length` positions of sequence `seq` (which holds length(seq)) would add, counting the copy
  // a shared, partly filled last block needs before it is written
  int64_t blocks_to_grow(int64_t seq, int64_t length) const;
  // Frees the memory of blocks no sequence holds (they are otherwise kept for the next sequences)
  void trim();

  bool contains(int64_t seq) const { return sequences_.count(seq) > 0; }  // whether the sequence is open
  int64_t length(int64_t seq) const;  // positions the sequence holds; ValueError for an unknown sequence
  void open(int64_t seq);             // a new empty sequence (ValueError if the id is taken)
  void close(int64_t seq);            // ends it: its blocks go back (shared ones when their last holder ends)
  // dst (new) starts as a copy of src's first `length` positions: whole blocks are shared, a partly filled last one
  // is copied. ShapeError when no block is free for that copy.
  void fork(int64_t src, int64_t dst, int64_t length);
  // Keeps the first `length` positions of seq; blocks past them go back.
  void truncate(int64_t seq, int64_t length);
  // Makes room for positions [length(seq), length) (taking blocks; copying a shared last block before it is written)
  // and sets the length. ShapeError when the cache has too few free blocks (nothing is taken then).
  void grow(int64_t seq, int64_t length);
  // Stores layer `layer`'s key and value (`width` floats each) for position `pos` of seq (taken by grow), converted to
  // the cache's type. ValueError for a value Q8_0 cannot hold (NaN, ±Inf). value is ignored (may be null) when keys_only.
  void write(int64_t layer, int64_t seq, int64_t pos, const float* key, const float* value);
  // Positions [begin, end) of layer `layer` of seq as floats ((end − begin) × width each), widened from the cache's
  // type; values may be null (not wanted, or keys_only)
  void gather(int64_t layer, int64_t seq, int64_t begin, int64_t end, float* keys, float* values) const;
  // The same positions where they lie, for kernels that read them in place (kernels::attention_decode): pages of
  // consecutive positions, row_bytes() apart, appended to `pages` (values = keys when keys_only)
  void pages(int64_t layer, int64_t seq, int64_t begin, int64_t end, std::vector<kernels::KVPage>& pages) const;
  int64_t row_bytes() const { return row_bytes_; }  // one position's key (or value) row of one layer, in bytes

  // Recurrent layers (Gated DeltaNet) keep a state per sequence instead of a row per position: `floats` float32 values,
  // zeros when a sequence opens, copied by a fork. A state holds all of its sequence, so a sequence with one can be
  // forked only whole and cut only to 0 (ValueError naming the reason otherwise). Call before any sequence opens.
  void keep_states(int64_t floats);
  int64_t state_floats() const { return state_floats_; }  // per sequence (0: no recurrent layers)
  float* state(int64_t seq);                              // seq's state values; ValueError for an unknown sequence
  // seq cut back to `length` positions with `saved` as its state (what state() held at that length): rolling back a
  // step that failed. ValueError for a state of the wrong size.
  void restore(int64_t seq, int64_t length, const std::vector<float>& saved);

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t length = 0;
    std::vector<float> state;  // the recurrent layers' state (keep_states)
  };
  int64_t state_floats_ = 0;
  int32_t take_block();
  void release(int32_t block);
  void truncate_blocks(Sequence& s, int64_t length);  // keeps `length` positions' blocks, the state untouched
  const Sequence& at(int64_t seq) const;
  std::byte* slot(int32_t block, int64_t layer, int kv, int64_t pos) const;
  std::byte* block_data(int32_t block) const;  // where a block's bytes lie
  int64_t layers_, width_, block_size_, max_blocks_, in_use_ = 0;
  kernels::WeightType type_;
  int64_t row_bytes_;  // one position's key (or value) of one layer
  int64_t kinds_ = 2;  // keys and values, or keys alone
  std::unordered_map<int64_t, Sequence> sequences_;
  // Block id i lies at region_.data() + i · bytes_per_block(): its pages are used as it is written, faulting in 2 MiB at a
  // time, and given back by trim(). Without a region (the address space refused; AddressSanitizer builds), each block
  // is an allocation of its own in storage_.
  memory::Region region_;
  std::vector<std::unique_ptr<std::byte[]>> storage_;  // by block id (null in a region, and once trimmed)
  std::vector<int32_t> refs_;                      // holders of each block
  std::vector<int32_t> spare_;                     // allocated blocks nobody holds
  std::vector<int32_t> unallocated_;               // ids whose memory was trimmed
};

// One Session::decode call as the model runs it (Decoder::forward_batch): rows grouped by sequence, in position order
struct BatchPlan {
  std::vector<int64_t> ids, positions;  // per row
  // A sequence's rows: rows [row0, row0 + rows), at positions start… (start: what the sequence held before, or 0
  // when it is encoded again: LongRoPE's rotation switch, Decoder::rotation_switch)
  struct Run {
    int64_t sequence = 0, row0 = 0, rows = 0, start = 0;  // which sequence, its rows and first position
  };
  std::vector<Run> runs;            // one per sequence in the batch
  std::vector<int64_t> logit_rows;  // the rows whose logits are returned, in the order returned
};

// How a session's cache is sized and a generation's batches are cut
struct SessionOptions {
  int64_t max_tokens = 0;    // the cache holds at most this many positions over all sequences (0: the model's context)
  int64_t block_size = 16;   // positions per cache block
  // generate(): a step feeds at most this many tokens (prompt pieces), and prompts are cut into pieces at positions
  // that are multiples of prefill_chunk — the same cuts in any batch, so a prompt is computed identically.
  int64_t max_batch_tokens = 512;
  int64_t prefill_chunk = 256;  // see max_batch_tokens
  // decode() runs each kind of batch on 1 thread while that is faster than the full count (another program holds a
  // core); see ThreadGovernor. The results are the same either way.
  bool adapt_threads = true;
  // How the KV cache stores keys and values: F32, F16, BF16 or Q8_0 (llama.cpp's --cache-type-k/v). Attention reads
  // them widened to float32; the narrower types hold 2× and 3.8× the tokens in the same memory and round each value.
  kernels::WeightType kv_type = kernels::WeightType::F32;
};

// A model with a KV cache for many sequences (llama_context): open sequences, decode batches, fork, cut and close
class Session {
 public:
  // The model must outlive the session. ValueError for options out of range.
  explicit Session(const Decoder& model, const SessionOptions& options = {});

  int64_t open();                           // a new empty sequence; returns its id
  void close(int64_t seq);                  // ends a sequence and frees its blocks
  // A new sequence holding the first `length` positions of seq (−1: all of them): a shared prefix (a chat's history,
  // a system prompt) computed once. Whole blocks are shared, not copied.
  int64_t fork(int64_t seq, int64_t length = -1);
  void truncate(int64_t seq, int64_t length);  // keeps the first `length` positions (to edit or roll back)
  int64_t length(int64_t seq) const;           // positions the sequence holds
  const std::vector<int64_t>& tokens(int64_t seq) const;  // the token ids it holds, in order
  // How many of `ids` the sequence already holds as its first tokens (where a new prompt can continue from)
  int64_t common_prefix(int64_t seq, std::span<const int64_t> ids) const;
  // Feeds the batch: every token's keys and values join its sequence's cache; returns the logits (rows, V) of the
  // tokens marked `logits`, in batch order. ValueError for an unknown sequence, a token id outside the vocabulary or
  // positions that do not continue their sequence; ShapeError when the cache lacks the blocks for it or a position
  // passes the model's context: then nothing changes. A sequence that grows past the model's rotation switch
  // (LongRoPE, Phi-3) is encoded again from its start in this call, as it would be alone (an error in that call
  // empties it).
  Tensor decode(const Batch& batch);

  const Decoder& model() const { return model_; }          // what it runs
  const KVBlockCache& cache() const { return cache_; }      // its blocks
  const SessionOptions& options() const { return options_; }  // how it was made
  int64_t capacity() const { return cache_.max_blocks() * cache_.block_size(); }  // positions the cache can hold

 private:
  const Decoder& model_;
  SessionOptions options_;
  KVBlockCache cache_;
  std::unordered_map<int64_t, std::vector<int64_t>> tokens_;
  int64_t next_id_ = 0;
  std::unique_ptr<ThreadGovernor> governor_;  // with options.adapt_threads
  Tensor decode_batch(const Batch& batch);
};

// One prompt to continue
struct GenerationRequest {
  std::vector<int64_t> prompt;    // tokens to feed first (with sequence ≥ 0: what to append to it; may be empty then)
  int64_t max_new_tokens = 100;   // tokens to add at most
  SamplerOptions sampling;        // greedy, temperature, … and the seed of this sequence's draws
  std::vector<int64_t> stop_ids;  // tokens that end it (not passed on, not counted)
  int64_t sequence = -1;          // −1: a new sequence, closed at the end; else an open one to continue (kept open)
};

// Why a sequence ended
enum class FinishReason { Stop, Length, Cancelled };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "cancelled" (OpenAI's finish_reason words)

// What one request produced
struct GenerationResult {
  std::vector<int64_t> tokens;  // the new tokens, without the stop token
  FinishReason finish = FinishReason::Length;  // why it ended
  int64_t prompt_tokens = 0;    // tokens fed before generating (the prompt)
  int64_t sequence = -1;        // the sequence it ran in (closed unless the request gave one)
};

// Sees each new token of request `index` (never a stop token); returns false to stop that request (Cancelled: its
// blocks are freed at once unless the request continued an open sequence).
using TokenCallback = std::function<bool(size_t index, int64_t token)>;

// Runs the requests as one batch until each stops (its stop token, max_new_tokens, the model's context, or the
// callback). Prompts are fed in pieces of at most options().prefill_chunk tokens, then every running sequence
// decodes one token per step. A sequence holding its prompt and max_new_tokens would not fit the cache even alone,
// or all together would not: ShapeError before anything runs, naming the sizes and the fix. ValueError for an empty
// prompt of a new sequence, an id outside the vocabulary or bad sampler options.
std::vector<GenerationResult> generate(Session& session, const std::vector<GenerationRequest>& requests,
                                       const TokenCallback& on_token = {});

}  // namespace qkv::nn
