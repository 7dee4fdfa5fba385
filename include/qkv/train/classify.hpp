// Classification fine-tuning as the book's chapter 6 does it: a new Linear(C, classes) head on the last (or last real)
// position's hidden state, the layers chosen to train (the rest frozen) or LoRA adapters, AdamW, evaluation every
// eval_freq steps over eval_iter batches and accuracy per epoch. Fine-tuning runs without dropout (drop_rate 0.0).
// Not here: reading model files (nn/pretrained.hpp), LoRA itself (nn/lora.hpp), pictures (the CLI draws them).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "qkv/core/random.hpp"
#include "qkv/nn/language_model.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/text/records.hpp"
#include "qkv/text/tokenizer.hpp"

namespace qkv::train {

// ---- classification (chapter 6) ----

enum class Pooling { Last, LastReal };  // the last position (the book: padding included) or the last real token

// The book's classification fine-tuning recipe (chapter 6); every field an option of qkv finetune classify
struct ClassifierOptions {
  double lr = 5e-5, weight_decay = 0.1;  // AdamW's learning rate and weight decay
  // passes, examples per step, steps between evaluations, batches per evaluation
  int64_t epochs = 5, batch_size = 8, eval_freq = 50, eval_iter = 5;
  uint64_t seed = 123;  // the head's weights (torch.manual_seed(123); torch.nn.Linear(C, classes)), LoRA's A, shuffling
  Pooling pooling = Pooling::Last;  // the position the head reads
  int64_t max_length = 0;  // 0: the longest training text (cut to the model's context)
  int64_t pad_id = 50256;  // padding token (GPT-2's <|endoftext|>)
  nn::LoraOptions lora;  // LoRA instead of training the weights (rank 0: none)
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
  // The head Linear(hidden_size, classes), drawn from `gen` as torch.nn.Linear draws it: with a bias as the book's
  // chapter 6, without one as Hugging Face's *ForSequenceClassification (score).
  SequenceClassifier(nn::LanguageModel& base, int64_t classes, Generator& gen, bool bias = true);
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

}  // namespace qkv::train
