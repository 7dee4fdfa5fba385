// The settings of a training run, declared once (train_settings_schema): model shape, optimisation, evaluation,
// checkpoints, seed and tokenizer.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "qkv/core/settings.hpp"
#include "qkv/nn/gpt.hpp"

namespace qkv::train {

struct TrainSettings {
  nn::GPTConfig model;
  int64_t batch_size = 8;   // windows per micro-batch on each process
  int64_t grad_accum = 1;   // micro-batches per optimiser step on each process: global batch = ranks × batch × accum
  int64_t max_steps = 500;
  int64_t warmup_steps = 50;
  double learning_rate = 1e-3;
  double min_learning_rate = 1e-4;
  double weight_decay = 0.1;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;  // AdamW's (PyTorch's defaults)
  double grad_clip = 1.0;  // 0: no clipping
  double train_fraction = 0.9;
  int64_t eval_every = 50;
  int64_t eval_batches = 10;
  int64_t checkpoint_every = 100;  // 0: only at the end (and on interruption)
  uint64_t seed = 123;
  std::string tokenizer = "gpt2";

  void validate() const;  // ValueError naming the bad setting
  std::map<std::string, std::string> to_strings() const;  // every setting of train_settings_schema()
  // Parses every setting with checks, then validates the whole once. ValueError naming the setting.
  static TrainSettings from_strings(const std::map<std::string, std::string>& values);
};

// Every training setting once (the model's from gpt_config_schema, then the run's): the CLI's options, the
// checkpoint's strings, validation and the resume diff all come from this table.
const std::vector<Setting<TrainSettings>>& train_settings_schema();

// The differences between a checkpoint's settings and this run's, one "key: checkpoint X, this run Y" per
// setting; `must_match` picks the settings that would make a resumed run train another model or data.
std::vector<std::string> settings_differences(const TrainSettings& checkpoint, const TrainSettings& run, bool must_match);

// Linear warmup to learning_rate over warmup_steps, then cosine decay to min_learning_rate at max_steps.
double learning_rate_at(const TrainSettings& settings, int64_t step);

}  // namespace qkv::train
