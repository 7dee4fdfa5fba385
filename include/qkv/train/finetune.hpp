// Fine-tuning, as the book's chapters 6 and 7 and appendix E do it:
//   which parameters train  names matched by patterns; the rest frozen (no gradient, no optimiser state);
//   classification          a new Linear(C, classes) head on the last (or last real) position's hidden state;
//   instruction following   Alpaca prompts, the book's collate (EOS padding, targets -100), greedy responses;
//   LoRA                    low-rank adapters on chosen Linear layers, saved in PEFT's layout, merged on request.
// Every loop is the book's: AdamW over the trainable parameters, evaluation every eval_freq steps over eval_iter
// batches, accuracy per epoch. Fine-tuning runs without dropout (the book's drop_rate 0.0).
// Not here: reading model files (model_file.hpp), the pictures (the CLI draws them with qkv::viz).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/nn/language_model.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/text/records.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::train {

// ---- which parameters train ----

// A pattern matches a parameter name when it is the name, a prefix of it ending at a dot ("trf_blocks.11" matches
// "trf_blocks.11.att.W_query.weight"), or a glob with '*' (any run of characters) matching it whole.
bool name_matches(const std::string& pattern, const std::string& name);
// Every parameter of `model` trains where a pattern matches its name and is frozen elsewhere. ValueError naming a
// pattern that matches no parameter (with a few of the names there are).
void set_trainable(nn::Module& model, const std::vector<std::string>& patterns);
// The counts the book prints: "Total trainable parameters before: 124,441,346" (thousands separated by commas).
std::string with_commas(int64_t n);

// ---- LoRA ----

// LoRA adapters to add: rank, alpha and the layers they adapt (appendix E's LinearWithLoRA)
struct LoraOptions {
  int64_t rank = 0;  // 0: no LoRA
  double alpha = 0;  // 0: alpha = rank
  // Presets all (every Linear layer), attention (W_query, W_key, W_value, out_proj / q,k,v,o_proj), qkv, mlp
  // (the feed-forward's Linear layers), or module-name patterns as name_matches takes them.
  std::vector<std::string> targets = {"all"};
};
// Adds an adapter to every Linear layer of `model` that the targets select and `exclude` does not (module names, such
// as the output head), in module order, drawing each A from `gen`. Returns the adapted modules' names. ValueError when
// the targets select nothing or the rank does not fit a layer.
std::vector<std::string> add_lora(nn::Module& model, const LoraOptions& options, Generator& gen,
                                  const std::vector<std::string>& exclude = {});
// Folds every adapter into its weight (W + (α/r)·B·A) and removes it.
void merge_lora(nn::Module& model);

// PEFT's adapter folder: adapter_model.safetensors ("base_model.model.<module>.lora_A.weight" (r, in),
// ".lora_B.weight" (out, r), and fully trained modules' tensors under "base_model.model.<name>") and
// adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, modules_to_save, base_model_name_or_path).
struct PeftAdapter {
  int64_t rank = 0;  // r
  double alpha = 0;  // lora_alpha: the update is scaled by alpha / r
  // the adapted modules' names; the fully trained ones (a new head)
  std::vector<std::string> target_modules, modules_to_save;
  std::string base_model;  // base_model_name_or_path: the model the adapter was trained on
  std::map<std::string, Tensor> tensors;  // names without the "base_model.model." prefix
};
void save_peft_adapter(const std::string& dir, nn::Module& model, const PeftAdapter& description,
                       const std::vector<std::pair<std::string, Tensor>>& saved_modules);
// IoError for a folder that is not a PEFT LoRA adapter (or one qkv cannot apply: another peft_type, dropout in
// inference is ignored, fan_in_fan_out).
PeftAdapter read_peft_adapter(const std::string& dir);
// Adds the adapter's LoRA layers to `model` with its weights, and copies its fully trained tensors (modules_to_save)
// into the parameters of the same names and shapes. ValueError, before anything changes, when it adapts a layer `model`
// does not have or a shape differs (an adapter for another model). Returns the tensors it found no place for (a
// classifier head, whose shape is not the vocabulary head's), for the caller.
std::map<std::string, Tensor> apply_peft_adapter(nn::Module& model, const PeftAdapter& adapter);

// ---- classification (chapter 6) ----

enum class Pooling { Last, LastReal };  // the last position (the book: padding included) or the last real token
enum class TrainableSet { LastBlock, All, Head };

// The book's classification fine-tuning recipe (chapter 6); every field an option of qkv finetune classify
struct ClassifierOptions {
  double lr = 5e-5, weight_decay = 0.1;  // AdamW's learning rate and weight decay
  // passes, examples per step, steps between evaluations, batches per evaluation
  int64_t epochs = 5, batch_size = 8, eval_freq = 50, eval_iter = 5;
  uint64_t seed = 123;  // the head's weights (torch.manual_seed(123); torch.nn.Linear(C, classes)), LoRA's A, shuffling
  TrainableSet trainable = TrainableSet::LastBlock;  // what trains besides the new head
  Pooling pooling = Pooling::Last;  // the position the head reads
  int64_t max_length = 0;  // 0: the longest training text (cut to the model's context)
  int64_t pad_id = 50256;  // padding token (GPT-2's <|endoftext|>)
  LoraOptions lora;  // LoRA instead of training the weights (rank 0: none)
  // The frozen blocks before the first trainable one compute the same residual for a text every epoch: keep it, up to
  // this many bytes (0: recompute every time). See SequenceClassifier::enable_prefix_cache.
  int64_t prefix_cache_bytes = int64_t{2} << 30;
};

// Texts as token ids, padded with pad_id to one length, and their class indices.
struct ClassificationSplit {
  std::vector<int64_t> ids;        // (size × length), row-major
  std::vector<int64_t> labels;     // class indices
  std::vector<int64_t> last_real;  // position of each text's last token
  int64_t length = 0;  // tokens per text
  // the number of texts
  int64_t size() const { return static_cast<int64_t>(labels.size()); }
};
// Labels in order of first appearance in the training texts, unless they are all integers: then in numeric order
// (so "0", "1" keep their meaning).
std::vector<std::string> label_names(const std::vector<text::LabelledText>& train);
// Tokenises, cuts to `length` tokens and pads. ValueError naming the file and line of a label not in `labels` (a label
// the training set has not seen) and for an empty split.
ClassificationSplit make_split(const std::vector<text::LabelledText>& texts, const std::vector<std::string>& labels,
                               const text::Tokenizer& tokenizer, int64_t length, int64_t pad_id, const std::string& label);
// The longest tokenised text of `texts`, at most `limit`.
int64_t longest_text(const std::vector<text::LabelledText>& texts, const text::Tokenizer& tokenizer, int64_t limit);

// A language model with a classification head read from one position of its hidden states.
class SequenceClassifier {
 public:
  // The head Linear(hidden_size, classes) with bias, drawn from `gen` as torch.nn.Linear draws it.
  SequenceClassifier(nn::LanguageModel& base, int64_t classes, Generator& gen);
  // Logits (B, classes) of ids (B × T) at `positions` (one per row).
  Tensor logits(std::span<const int64_t> ids, int64_t batch, int64_t tokens, std::span<const int64_t> positions) const;
  // The logits of rows `rows` of `data`, read where `pooling` says; through the prefix cache when it is on.
  Tensor batch_logits(const ClassificationSplit& data, std::span<const int64_t> rows, Pooling pooling) const;
  // When nothing before block k trains (embeddings and blocks 0…k−1 frozen) and the base runs without dropout, the
  // residual entering block k is a function of the text alone: batch_logits then computes it once per text (without a
  // gradient) and keeps it, up to `limit_bytes`, so later epochs run only blocks k… Returns k (0: nothing to cache).
  // Call after choosing what trains; the results are the same as without the cache.
  int64_t enable_prefix_cache(int64_t limit_bytes);
  // What the head is called in a state dict: out_head (the book's names) or score (Hugging Face's).
  std::string head_name() const;
  // The trainable parameters: the base's that train, then the head's ("<head_name>.weight", ".bias").
  std::vector<std::pair<std::string, Tensor>> trainable_parameters();
  // The base's state dict with the head in place of the vocabulary head (what model.pth holds).
  std::vector<std::pair<std::string, Tensor>> state_dict();
  nn::LanguageModel& base;
  nn::Linear head;

 private:
  int64_t cache_layer_ = 0, cache_limit_ = 0;
  mutable int64_t cache_bytes_ = 0;
  mutable std::map<const ClassificationSplit*, std::vector<Tensor>> cache_;
};

// Mean loss and accuracy of a classifier over a split
struct ClassifierMetrics {
  double loss = 0, accuracy = 0;  // mean cross-entropy (nats) and the fraction classified right
};
// Mean loss and accuracy over the first `batches` batches (0: all), in order, no gradient (the book's
// calc_loss_loader and calc_accuracy_loader).
ClassifierMetrics evaluate_classifier(const SequenceClassifier& model, const ClassificationSplit& data, int64_t batch_size,
                                      int64_t batches, Pooling pooling);
// The (classes × classes) counts of true (rows) against predicted (columns) labels over the whole split.
std::vector<std::vector<int64_t>> confusion_matrix(const SequenceClassifier& model, const ClassificationSplit& data,
                                                   int64_t batch_size, Pooling pooling, int64_t classes);

// torch.randperm(n, generator) for a generator seeded as `gen` (PyTorch 1.13's CPU algorithm), so an epoch's order can
// be reproduced in PyTorch.
std::vector<int64_t> randperm(int64_t n, Generator& gen);

// Where classification training is, after each step (ClassifierCallbacks::on_step)
struct ClassifierProgress {
  // steps taken, the epoch (1-based), texts seen, steps the run will take
  int64_t step = 0, epoch = 0, examples_seen = 0, steps_total = 0;
  double loss = 0;  // this step's
};
// An evaluation every eval_freq steps (ClassifierCallbacks::on_eval): the mean losses over eval_iter batches
struct ClassifierEvaluation {
  int64_t step = 0, examples_seen = 0;  // the step it follows and the texts seen by then
  double train_loss = 0, val_loss = 0;  // mean loss on the training and the validation split
};
// The accuracies at the end of an epoch (ClassifierCallbacks::on_epoch)
struct ClassifierEpoch {
  int64_t epoch = 0;  // the epoch that ended (1-based)
  // accuracy over eval_iter batches of each split, as the book's train_classifier_simple reports
  double train_accuracy = 0, val_accuracy = 0;
};
// What train_classifier reports as it goes; any may be empty
struct ClassifierCallbacks {
  std::function<void(const ClassifierProgress&)> on_step;  // after every step
  std::function<void(const ClassifierEvaluation&)> on_eval;  // after every evaluation
  std::function<void(const ClassifierEpoch&)> on_epoch;  // after every epoch
};
// The book's train_classifier_simple: epochs over the training split, shuffled per epoch (epoch e's order is
// randperm(n, Generator(seed + e)); the last partial batch dropped), AdamW on the trainable parameters. A non-finite
// loss is a TrainingDiverged error before the step is taken. Returns the steps taken.
int64_t train_classifier(SequenceClassifier& model, const ClassificationSplit& train, const ClassificationSplit& val,
                         const ClassifierOptions& options, const ClassifierCallbacks& callbacks);

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
  LoraOptions lora;  // LoRA instead of training the weights (rank 0: none)
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
