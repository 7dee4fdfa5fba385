// Instruction fine-tuning as the book's chapter 7 does it: Alpaca prompts (or the model's chat template), the book's
// collate (EOS padding, targets -100), AdamW with evaluation every eval_freq steps, greedy responses. LoRA instead of
// training the weights when asked (nn/lora.hpp).
// Not here: reading model files (nn/pretrained.hpp), classification (train/classify.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/nn/language_model.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/text/records.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::train {

// ---- instruction fine-tuning (chapter 7) ----

// The book's instruction fine-tuning recipe (chapter 7); every field an option of qkv finetune instruct
struct InstructOptions {
  double lr = 5e-5, weight_decay = 0.1;  // AdamW's learning rate and weight decay
  // passes, examples per step, steps between evaluations, batches per evaluation
  int64_t epochs = 2, batch_size = 8, eval_freq = 5, eval_iter = 5;
  uint64_t seed = 123;  // the seed of LoRA's A and of the shuffling
  int64_t allowed_max_length = 1024;  // tokens per example at most (the collate cuts longer ones)
  bool mask_prompt = false;  // the loss on the response only
  int64_t pad_id = 50256;    // also the end of text appended to every entry
  nn::LoraOptions lora;  // LoRA instead of training the weights (rank 0: none)
};
// The book's split: 85 % train, 10 % test, the rest validation, after shuffling with `seed` (randperm); seed 0 keeps
// the file's order as the book does.
struct InstructionSplits {
  std::vector<text::Instruction> train, test, validation;  // the three splits, entries in order
};
InstructionSplits split_instructions(const std::vector<text::Instruction>& entries, uint64_t seed);
// One entry's token ids (prompt + response) and how many of them are the prompt.
struct EncodedInstruction {
  std::vector<int64_t> ids;  // prompt and response, token ids
  int64_t prompt_tokens = 0;  // how many of ids are the prompt
};
// The prompt is `prompt(entry)` (the Alpaca format unless a chat template renders it) and the response follows.
EncodedInstruction encode_instruction(const text::Instruction& entry, const text::Tokenizer& tokenizer,
                                      const std::function<std::string(const text::Instruction&)>& prompt = {});
// The book's custom_collate_fn: each entry + pad_id, padded with pad_id to the longest + 1, inputs = all but the last,
// targets = all but the first; every pad in the targets after the first becomes -100 (and with mask_prompt the
// prompt's targets too); then both cut to allowed_max_length.
struct InstructionBatch {
  std::vector<int64_t> inputs, targets;  // (batch × tokens) each, row-major; targets -100 where no loss is taken
  int64_t batch = 0, tokens = 0;  // rows and tokens per row
};
InstructionBatch collate_instructions(const std::vector<const EncodedInstruction*>& entries, int64_t pad_id,
                                      int64_t allowed_max_length, bool mask_prompt);
// Where instruction training is, after each step (InstructCallbacks::on_step)
struct InstructProgress {
  // steps taken, the epoch (1-based), steps the run will take, tokens seen
  int64_t step = 0, epoch = 0, steps_total = 0, tokens_seen = 0;
  double loss = 0;  // this step's loss
};
// An evaluation every eval_freq steps (InstructCallbacks::on_eval): the mean losses over eval_iter batches
struct InstructEvaluation {
  int64_t step = 0, tokens_seen = 0;  // the step it follows and the tokens seen by then
  double train_loss = 0, val_loss = 0;  // mean loss on the training and the validation split
};
// What train_instructions reports as it goes; either may be empty
struct InstructCallbacks {
  std::function<void(const InstructProgress&)> on_step;  // after every step
  std::function<void(const InstructEvaluation&)> on_eval;  // after every evaluation
};
// The book's train_model_simple on the collated instruction batches: shuffled per epoch as train_classifier's, the last
// partial batch dropped (the book's train loader has drop_last=True).
int64_t train_instructions(nn::LanguageModel& model, const std::vector<EncodedInstruction>& train,
                           const std::vector<EncodedInstruction>& validation, const InstructOptions& options,
                           const InstructCallbacks& callbacks);
// Mean loss over the first `batches` batches (0: all) of `data`, in order.
double instruction_loss(const nn::LanguageModel& model, const std::vector<EncodedInstruction>& data,
                        const InstructOptions& options, int64_t batches);

}  // namespace qkv::train
