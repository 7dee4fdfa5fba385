// Instruction fine-tuning, the book's chapter 7 (see qkv/train/instruct.hpp): splits, the Alpaca prompt or a chat
// template, the book's collate, and its training loop.
#include "qkv/train/instruct.hpp"
#include "qkv/train/classify.hpp"
#include "steps.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/io/file.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::train {

namespace {
std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}
}  // namespace

// ---- instruction fine-tuning ----

InstructionSplits split_instructions(const std::vector<text::Instruction>& entries, uint64_t seed) {
  std::vector<int64_t> order = iota(static_cast<int64_t>(entries.size()));
  if (seed != 0) {
    Generator gen(seed);
    order = randperm(static_cast<int64_t>(entries.size()), gen);
  }
  const size_t n = entries.size(), train = static_cast<size_t>(static_cast<double>(n) * 0.85),
               test = static_cast<size_t>(static_cast<double>(n) * 0.1);
  InstructionSplits s;
  for (size_t i = 0; i < n; ++i) {
    const text::Instruction& e = entries[static_cast<size_t>(order[i])];
    (i < train ? s.train : i < train + test ? s.test : s.validation).push_back(e);
  }
  return s;
}

EncodedInstruction encode_instruction(const text::Instruction& entry, const text::Tokenizer& tokenizer,
                                      const std::function<std::string(const text::Instruction&)>& prompt) {
  const std::string p = prompt ? prompt(entry) : text::alpaca_prompt(entry);
  EncodedInstruction e;
  // The book encodes prompt + response as one text; the prompt's own encoding gives where the response starts.
  e.ids = tokenizer.encode(p + (prompt ? entry.output : text::alpaca_response(entry)));
  e.prompt_tokens = static_cast<int64_t>(tokenizer.encode(p).size());
  return e;
}

InstructionBatch collate_instructions(const std::vector<const EncodedInstruction*>& entries, int64_t pad_id,
                                      int64_t allowed_max_length, bool mask_prompt) {
  InstructionBatch b;
  b.batch = static_cast<int64_t>(entries.size());
  size_t longest = 0;
  for (const auto* e : entries) longest = std::max(longest, e->ids.size() + 1);
  const int64_t T = static_cast<int64_t>(longest) - 1;
  b.tokens = allowed_max_length > 0 ? std::min(T, allowed_max_length) : T;
  for (const auto* e : entries) {
    std::vector<int64_t> padded = e->ids;
    padded.resize(longest, pad_id);  // the end of text, then padding, all pad_id
    std::vector<int64_t> targets(padded.begin() + 1, padded.end());
    bool first = true;
    for (int64_t& t : targets) {
      if (t != pad_id) continue;
      if (!first) t = -100;
      first = false;
    }
    if (mask_prompt)
      for (int64_t i = 0; i < std::min<int64_t>(e->prompt_tokens - 1, T); ++i) targets[static_cast<size_t>(i)] = -100;
    b.inputs.insert(b.inputs.end(), padded.begin(), padded.begin() + b.tokens);
    b.targets.insert(b.targets.end(), targets.begin(), targets.begin() + b.tokens);
  }
  return b;
}

double instruction_loss(const nn::LanguageModel& model, const std::vector<EncodedInstruction>& data,
                        const InstructOptions& o, int64_t batches) {
  NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(data.size()), available = (n + o.batch_size - 1) / o.batch_size;
  const int64_t count = batches > 0 ? std::min(batches, available) : available;
  if (count == 0) return NAN;
  double total = 0;
  int64_t counted = 0;  // batches with a target (an all-masked batch has no loss, 0/0)
  for (int64_t k = 0; k < count; ++k) {
    std::vector<const EncodedInstruction*> rows;
    for (int64_t i = k * o.batch_size; i < std::min(n, (k + 1) * o.batch_size); ++i) rows.push_back(&data[static_cast<size_t>(i)]);
    const InstructionBatch b = collate_instructions(rows, o.pad_id, o.allowed_max_length, o.mask_prompt);
    if (std::all_of(b.targets.begin(), b.targets.end(), [](int64_t t) { return t == -100; })) continue;
    total += model.loss(b.inputs, b.batch, b.tokens, b.targets).item();
    ++counted;
  }
  return counted ? total / static_cast<double>(counted) : NAN;
}

int64_t train_instructions(nn::LanguageModel& model, const std::vector<EncodedInstruction>& train,
                           const std::vector<EncodedInstruction>& validation, const InstructOptions& o,
                           const InstructCallbacks& callbacks) {
  if (o.batch_size < 1 || o.epochs < 0 || o.eval_freq < 1 || o.eval_iter < 1) throw ValueError("fine-tuning: batch size, eval frequency and eval batches must be positive");
  const int64_t n = static_cast<int64_t>(train.size()), per_epoch = n / o.batch_size;
  if (per_epoch == 0) {
    throw ValueError("the training split has " + std::to_string(n) + " entries, fewer than one batch of " +
                     std::to_string(o.batch_size) + "; use a smaller --batch-size or more data");
  }
  model.eval();
  optim::AdamW optimizer = make_adamw(model.named_trainable_parameters(), o.lr, o.weight_decay);
  int64_t step = 0, tokens = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    Generator shuffle(o.seed + static_cast<uint64_t>(epoch));
    const std::vector<int64_t> order = randperm(n, shuffle);
    for (int64_t k = 0; k < per_epoch; ++k) {
      std::vector<const EncodedInstruction*> rows;
      for (int64_t i = 0; i < o.batch_size; ++i) rows.push_back(&train[static_cast<size_t>(order[static_cast<size_t>(k * o.batch_size + i)])]);
      const InstructionBatch b = collate_instructions(rows, o.pad_id, o.allowed_max_length, o.mask_prompt);
      if (std::all_of(b.targets.begin(), b.targets.end(), [](int64_t t) { return t == -100; })) {
        throw ValueError("training batch " + std::to_string(step + 1) + " has nothing to learn: every target is masked, "
                         "as its prompts fill all " + std::to_string(b.tokens) + " positions (--allowed-max-length, the "
                         "model's context); use a model with a longer context, shorter prompts, or no --mask-prompt");
      }
      optimizer.zero_grad(true);
      const Tensor loss = model.loss(b.inputs, b.batch, b.tokens, b.targets);
      const double value = loss.item();
      check_finite(value, step + 1);
      loss.backward();
      optimizer.step();
      // Each batch is padded to its own longest entry, so the sizes change from step to step; the block cache hands a
      // shorter batch the blocks of a longer one, so once the longest has run no step faults in fresh pages.
      memory::cache_blocks_for_steps();
      tokens += b.batch * b.tokens;
      if (callbacks.on_step) callbacks.on_step({step + 1, epoch + 1, per_epoch * o.epochs, tokens, value});
      if (step % o.eval_freq == 0 && callbacks.on_eval)
        callbacks.on_eval({step + 1, tokens, instruction_loss(model, train, o, o.eval_iter), instruction_loss(model, validation, o, o.eval_iter)});
      ++step;
    }
  }
  return step;
}

}  // namespace qkv::train
