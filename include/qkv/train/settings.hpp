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

// Everything a qkv train run is made of: the model, the batch, the schedule and the data split (one schema names them)
struct TrainSettings {
  nn::GPTConfig model;  // the GPT to train
  int64_t batch_size = 8;   // windows per micro-batch on each process
  int64_t grad_accum = 1;   // micro-batches per optimiser step on each process: global batch = ranks × batch × accum
  int64_t max_steps = 500;  // optimiser steps in all
  int64_t warmup_steps = 50;  // linear warmup steps before the cosine decay
  double learning_rate = 1e-3;  // the learning rate after warmup
  double min_learning_rate = 1e-4;  // where the cosine decay ends
  double weight_decay = 0.1;  // AdamW's decoupled weight decay
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;  // AdamW's (PyTorch's defaults)
  double grad_clip = 1.0;  // 0: no clipping
  double train_fraction = 0.9;  // the share of the text's windows that train (the rest validate)
  int64_t eval_every = 50;  // steps between evaluations
  int64_t eval_batches = 10;  // batches per evaluation
  int64_t checkpoint_every = 100;  // 0: only at the end (and on interruption)
  uint64_t seed = 123;  // the weights' and the data order's seed
  std::string tokenizer = "gpt2";  // gpt2 (GPT-2's BPE) or bytes
  // Products in fp32, bf16 (bf16 operands, float32 sums: qkv/core/precision.hpp) or auto (bf16 where the CPU has
  // AVX512_BF16 or AMX). Weights, optimiser state and losses stay float32 either way.
  std::string precision = "fp32";
  // Under mpirun: gradients exchanged in fp32 or bf16 (rounded for the exchange, summed in float32 in rank order), in
  // buckets of this many MiB started as the backward completes them (0: one sum after the backward).
  std::string allreduce_precision = "fp32";
  int64_t allreduce_bucket_mib = 25;

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
