// The training settings' schema, validation and learning-rate schedule (see qkv/train/settings.hpp).
#include "qkv/train/settings.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace qkv::train {

const std::vector<Setting<TrainSettings>>& train_settings_schema() {
  using settings::field;
  static const std::vector<Setting<TrainSettings>> schema = [] {
    std::vector<Setting<TrainSettings>> s;
    for (const auto& m : nn::gpt_config_schema()) s.push_back(settings::nested(&TrainSettings::model, m));
    const bool may_change = false;
    // The global batch (ranks × batch_size × grad_accum) must stay the same on resume; how it is split may change.
    s.push_back(field("batch_size", "--batch-size", "Windows per micro-batch on each process", &TrainSettings::batch_size,
                      may_change));
    s.push_back(field("grad_accum", "--grad-accum",
                      "Micro-batches per optimiser step on each process (the global batch is ranks × batch × this)",
                      &TrainSettings::grad_accum, may_change));
    s.push_back(field("max_steps", "--steps", "Optimiser steps", &TrainSettings::max_steps, may_change));
    s.push_back(field("warmup_steps", "--warmup", "Linear warmup steps", &TrainSettings::warmup_steps, may_change));
    s.push_back(field("learning_rate", "--lr", "Peak learning rate", &TrainSettings::learning_rate, may_change));
    s.push_back(field("min_learning_rate", "--min-lr", "Learning rate at the end of the cosine",
                      &TrainSettings::min_learning_rate, may_change));
    s.push_back(field("weight_decay", "--weight-decay", "AdamW weight decay", &TrainSettings::weight_decay, may_change));
    s.push_back(field("adam_beta1", "--adam-beta1", "AdamW's β1", &TrainSettings::adam_beta1, may_change));
    s.push_back(field("adam_beta2", "--adam-beta2", "AdamW's β2", &TrainSettings::adam_beta2, may_change));
    s.push_back(field("adam_eps", "--adam-eps", "AdamW's ε", &TrainSettings::adam_eps, may_change));
    s.push_back(field("grad_clip", "--grad-clip", "Gradient norm clip (0: off)", &TrainSettings::grad_clip, may_change));
    s.push_back(field("train_fraction", "--train-fraction", "Share of the text to train on (the rest validates)",
                      &TrainSettings::train_fraction));
    s.push_back(field("eval_every", "--eval-every", "Evaluate every N steps (0: never)", &TrainSettings::eval_every,
                      may_change));
    s.push_back(field("eval_batches", "--eval-batches", "Batches per evaluation", &TrainSettings::eval_batches,
                      may_change));
    s.push_back(field("checkpoint_every", "--checkpoint-every", "Checkpoint every N steps (0: only at the end)",
                      &TrainSettings::checkpoint_every, may_change));
    s.push_back(field("seed", "--seed", "Seed for weights, dropout and data order", &TrainSettings::seed));
    s.push_back(field("tokenizer", "--tokenizer", "gpt2 or bytes", &TrainSettings::tokenizer));
    s.push_back(field("precision", "--precision",
                      "Matrix products in fp32, bf16 (bf16 operands, float32 sums; CPUs with AVX512_BF16 or AMX) or auto",
                      &TrainSettings::precision, may_change));
    s.push_back(field("allreduce_precision", "--allreduce-precision",
                      "Under mpirun, gradients summed across processes in fp32, or exchanged as bf16 (half the bytes; "
                      "the sum itself in float32)",
                      &TrainSettings::allreduce_precision, may_change));
    s.push_back(field("allreduce_bucket_mib", "--allreduce-bucket-mib",
                      "Under mpirun, gradients are summed in buckets of this many MiB as the backward finishes them, "
                      "while it goes on (0: all at once after the backward)",
                      &TrainSettings::allreduce_bucket_mib, may_change));
    return s;
  }();
  return schema;
}

void TrainSettings::validate() const {
  model.validate();
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw ValueError(std::string(name) + " must be at least 1, got " + std::to_string(v));
  };
  positive(batch_size, "batch size");
  positive(grad_accum, "grad accum");
  positive(max_steps, "steps");
  if (warmup_steps < 0 || eval_every < 0 || eval_batches < 0 || checkpoint_every < 0) {
    throw ValueError("warmup, eval-every, eval-batches and checkpoint-every must not be negative");
  }
  if (!(learning_rate > 0) || !(min_learning_rate >= 0) || min_learning_rate > learning_rate) {
    throw ValueError("learning rates must satisfy 0 ≤ min-lr ≤ lr and lr > 0");
  }
  if (!(weight_decay >= 0) || !(grad_clip >= 0)) throw ValueError("weight decay and grad clip must not be negative");
  if (!(adam_beta1 >= 0 && adam_beta1 < 1) || !(adam_beta2 >= 0 && adam_beta2 < 1) || !(adam_eps > 0)) {
    throw ValueError("AdamW needs 0 ≤ β1, β2 < 1 and ε > 0");
  }
  if (!(train_fraction > 0 && train_fraction < 1)) throw ValueError("train fraction must lie in (0, 1)");
  if (tokenizer != "gpt2" && tokenizer != "bytes") throw ValueError("tokenizer must be gpt2 or bytes");
  if (precision != "fp32" && precision != "bf16" && precision != "auto")
    throw ValueError("precision = \"" + precision + "\" is not a precision; use fp32, bf16 or auto");
  if (allreduce_precision != "fp32" && allreduce_precision != "bf16")
    throw ValueError("allreduce precision = \"" + allreduce_precision + "\"; use fp32 or bf16");
  if (allreduce_bucket_mib < 0 || allreduce_bucket_mib > 65536)
    throw ValueError("allreduce bucket must be 0 to 65536 MiB, got " + std::to_string(allreduce_bucket_mib));
}

std::map<std::string, std::string> TrainSettings::to_strings() const {
  return settings::to_strings(train_settings_schema(), *this);
}

TrainSettings TrainSettings::from_strings(const std::map<std::string, std::string>& given) {
  std::map<std::string, std::string> values = given;
  // Checkpoints from before gradient accumulation and AdamW's β and ε were settings.
  values.emplace("grad_accum", "1");
  values.emplace("adam_beta1", "0.9");
  values.emplace("adam_beta2", "0.999");
  values.emplace("adam_eps", "1e-08");
  values.emplace("precision", "fp32");  // and before bf16
  values.emplace("allreduce_precision", "fp32");  // and before overlapped sums
  values.emplace("allreduce_bucket_mib", "25");
  const TrainSettings s = settings::from_strings(train_settings_schema(), values, TrainSettings{}, "the settings");
  s.validate();
  return s;
}

std::vector<std::string> settings_differences(const TrainSettings& checkpoint, const TrainSettings& run, bool must_match) {
  std::vector<std::string> out;
  for (const auto& s : train_settings_schema()) {
    if (s.must_match != must_match) continue;
    const std::string theirs = s.get(checkpoint), mine = s.get(run);
    if (theirs != mine) out.push_back(std::string(s.key) + ": checkpoint " + theirs + ", this run " + mine);
  }
  return out;
}

double learning_rate_at(const TrainSettings& s, int64_t step) {
  if (step < s.warmup_steps) return s.learning_rate * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  const double span = static_cast<double>(std::max<int64_t>(1, s.max_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  return s.min_learning_rate + 0.5 * (s.learning_rate - s.min_learning_rate) * (1.0 + std::cos(std::numbers::pi * progress));
}


}  // namespace qkv::train
