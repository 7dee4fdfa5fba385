// Training the book's GPTModel (the decoder's gpt2 configuration) on token ids: AdamW, linear warmup then cosine decay, gradient clipping, evaluation
// on a validation split, and checkpoints that resume exactly (weights, optimiser state, step, the
// dropout generator's state, and the settings, in one safetensors file written atomically).
// Not here: reading text or drawing progress (the CLI does), plotting (plot.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "qkv/core/precision.hpp"
#include "qkv/nn/gpt.hpp"
#include "qkv/train/communicator.hpp"
#include "qkv/train/model_file.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/train/settings.hpp"
#include "qkv/text/dataset.hpp"

namespace qkv::train {

// The joint L2 norm of all gradients, and the factor torch.nn.utils.clip_grad_norm_ would scale them by
// (max_norm / (norm + 1e-6) when that is below 1, else 1; 1 when max_norm is 0).
double gradient_norm(const std::vector<std::pair<std::string, Tensor>>& parameters);
float clip_coefficient(double norm, double max_norm);
// Scales all gradients so their joint L2 norm is at most max_norm (torch.nn.utils.clip_grad_norm_);
// returns the norm before clipping.
double clip_grad_norm(const std::vector<std::pair<std::string, Tensor>>& parameters, double max_norm);

// The loss or the gradient became NaN or infinite: the step was not applied (the weights are the last good ones).
class TrainingDiverged : public Error {
 public:
  using Error::Error;
};

// What one optimiser step did
struct StepReport {
  int64_t step = 0;  // 1-based: the number of optimiser steps taken
  // mean loss of the step's batches, the rate it used, the gradient's norm before clipping, speed, wall time
  double loss = 0, learning_rate = 0, grad_norm = 0, tokens_per_second = 0, seconds = 0;
  // summing gradients across processes (0 in one process): every moment the step spent inside the sums — moving them
  // along during the backward (where the copies run on this process's core) and waiting for them after it
  double communication_seconds = 0;
};
// An evaluation's mean losses on the training and validation windows
struct EvalReport {
  int64_t step = 0;  // the step it follows
  double train_loss = 0, validation_loss = 0;  // mean next-token loss on each split (nats)
};

// The settings stored in a checkpoint (IoError if the file is not a qkv training checkpoint).
TrainSettings read_checkpoint_settings(const std::string& path);
// IoError unless the checkpoint holds every tensor its settings imply (weights, AdamW's moments, the generator),
// with their shapes; nothing is allocated. Run it before building a Trainer to resume from the file.
void check_checkpoint(const std::string& path, const TrainSettings& settings);
// The model of a checkpoint, in eval mode, for generation; every tensor is checked before the model is built. With
// `matrices` BF16 the matrices are read as bfloat16 (half the memory, no float32 copy first).
std::unique_ptr<nn::Decoder> load_checkpoint_model(const std::string& path, TrainSettings* settings = nullptr,
                                                   DType matrices = DType::F32);

// Writes a qkv checkpoint from its parts (what Trainer::save_checkpoint and qkv convert write): every parameter,
// every optimiser state tensor ("exp_avg.<name>", "exp_avg_sq.<name>"), the generator and the settings; atomically.
void write_checkpoint(const std::string& path, nn::Decoder& model,
                      const std::function<void(const std::function<void(const std::string&, Tensor&)>&)>& for_each_state,
                      const TrainSettings& settings, int64_t step, const std::vector<uint64_t>& rng_state,
                      const std::map<std::string, std::string>& extra_metadata = {});

// Trains the book's GPTModel (the decoder in its gpt2 configuration) on a token stream: batches, AdamW with warmup and cosine decay, clipping, evaluation, checkpoints (across processes with a Communicator)
class Trainer {
 public:
  // Splits `tokens` into training and validation windows of context_length; ValueError if either part is
  // shorter than one window. The model is made from settings.model and the seed.
  //
  // Data parallelism: with a communicator of N processes, every process holds the whole model and optimiser,
  // each optimiser step takes a global batch of N × batch_size × grad_accum windows, micro-batch s of it goes to
  // process s mod N, gradients are summed in rank order (Communicator::sum) and averaged, and every process takes
  // the same step. Each micro-batch's dropout is seeded by (seed, step, s), so the same global batch trains the
  // same way however it is split. Without a communicator: one process.
  //
  // With `model`, that decoder is trained instead (continued pretraining of a Hugging Face folder: Llama, Qwen,
  // Gemma or GPT-2 alike); settings.model then gives only the window length (context_length, at most the model's),
  // and the model's dropout draws from this trainer's generator.
  Trainer(const TrainSettings& settings, const std::vector<int64_t>& tokens, Communicator* communicator = nullptr,
          std::unique_ptr<nn::Decoder> model = nullptr);

  // Restores weights, optimiser state, step and generator from a checkpoint. IoError if the file is not a
  // qkv checkpoint; ValueError listing every setting that differs from this run's (a checkpoint from
  // another configuration).
  void resume(const std::string& checkpoint_path);
  // Continues from a model file of another kind (a book model_and_optimizer.pth, a .pth or safetensors state dict):
  // its weights, and when it has them its AdamW moments and step and its generator. The model must be this run's
  // (ValueError listing the differences); the settings stay this run's.
  void resume_from(const ModelFile& file);
  // Atomically writes the checkpoint (temp file, fsync, rename).
  void save_checkpoint(const std::string& path) const;

  // Trains until max_steps, or until *stop becomes true (checked between steps). Returns the last step. A
  // non-finite loss or gradient norm throws TrainingDiverged before the optimiser touches the weights.
  int64_t run(const std::function<void(const StepReport&)>& on_step, const std::function<void(const EvalReport&)>& on_eval,
              const std::function<void(int64_t step)>& on_checkpoint, const std::atomic<bool>* stop);

  // Mean loss over up to `batches` batches of the training or validation windows (no dropout, no grad).
  double evaluate(bool validation, int64_t batches);

  // Optimiser steps taken
  int64_t step() const { return step_; }
  // Windows per optimiser step over every process
  int64_t global_batch() const { return world_ * settings_.batch_size * settings_.grad_accum; }
  // Several processes, a mixture of experts: the experts' gradient sums run so far, and those skipped because no
  // process's tokens chose the expert that step (their gradients are zero on every process)
  std::pair<int64_t, int64_t> expert_sums() const { return {expert_sums_, expert_sums_skipped_}; }
  // The model being trained
  nn::Decoder& model() { return *model_; }
  // Windows in the training and validation splits
  int64_t train_windows() const;
  int64_t validation_windows() const;
  // The run's settings
  const TrainSettings& settings() const { return settings_; }
  // The precision run() and evaluate() multiply in: settings().precision resolved for this CPU.
  Precision precision() const { return precision_; }

 private:
  TrainSettings settings_;
  Precision precision_ = Precision::FP32;
  Generator generator_;  // weights at construction, then dropout
  std::unique_ptr<nn::Decoder> model_;
  // Under mpirun: the gradients' buckets (ranges of the arena, whole parameters) and which bucket holds each
  struct Bucket {
    int64_t first = 0, count = 0, parameters = 0, ready = 0;
    bool queued = false;
  };
  std::vector<Bucket> buckets_;
  std::unordered_map<const void*, size_t> bucket_of_;
  // Tables whose gradient lands in few rows (untied token embedding, learned positions; nn::Decoder::sparse_gradients):
  // outside the buckets, only the step's rows are summed, gathered into `rows` and put back after the sums.
  struct SparseTable {
    int64_t first = 0, width = 0;  // where its gradient starts in the arena, values per row
    std::vector<int64_t> rows;     // this step's
    std::vector<float> gathered;   // those rows' gradients, summed across processes in place
  };
  std::vector<SparseTable> sparse_;
  std::unordered_map<const void*, size_t> sparse_of_;
  // One expert's parameter (nn::Decoder::expert_use_index), outside the buckets: summed only in a step where some
  // process's tokens chose its expert (the processes agree on that with the step's loss); zero everywhere otherwise.
  struct ExpertUnit {
    int64_t first = 0, count = 0, expert = 0;  // its gradient in the arena, its flag
    bool queued = false;
  };
  std::vector<ExpertUnit> expert_units_;
  std::unordered_map<const void*, size_t> expert_unit_of_;
  std::vector<uint8_t> experts_chosen_;   // this step's, by any process
  int64_t expert_sums_ = 0, expert_sums_skipped_ = 0;
  // The last micro-batch's backward, its buckets' sums across processes started as it completes them; returns the
  // seconds spent inside the communicator meanwhile (starting sums, moving them along).
  double backward_summing(const Tensor& loss, const text::Batch& global);
  void scatter_sparse_rows();  // the sparse tables' summed rows back into the arena
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<text::SlidingWindowDataset> train_data_, validation_data_;
  std::unique_ptr<text::DataLoader> train_loader_, validation_loader_;
  int64_t step_ = 0;
  uint64_t settings_fingerprint_ = 0;  // of the token ids: a resumed run must see the same text
  SingleProcess single_;
  Communicator* comm_;
  int64_t world_ = 1;
  Tensor gradient_arena_;  // with several processes: every parameter's gradient, one after another
};

}  // namespace qkv::train
