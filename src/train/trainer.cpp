// The training loop and its checkpoints (see qkv/train/trainer.hpp).
#include "qkv/train/trainer.hpp"

#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdlib>
#include <numbers>

#include "qkv/core/autograd.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/kernels/optim.hpp"

namespace qkv::train {

namespace {

constexpr const char* kFormat = "qkv-gpt-checkpoint-1";

// FNV-1a over the token ids: a resumed run must train on the same text.
uint64_t fingerprint(const std::vector<int64_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t t : tokens) {
    h ^= static_cast<uint64_t>(t);
    h *= 1099511628211ull;
  }
  return h;
}


}  // namespace

double clip_grad_norm(const std::vector<std::pair<std::string, Tensor>>& parameters, double max_norm) {
  // Σ g² per parameter in fixed chunks (kernels::sum_of_squares: the same for any thread count).
  double total = 0.0;
  for (const auto& [name, p] : parameters) {
    const Tensor g = p.grad();
    if (g.defined()) total += kernels::sum_of_squares(g.data(), g.numel());
  }
  const double norm = std::sqrt(total);
  const double coefficient = max_norm / (norm + 1e-6);
  if (max_norm > 0 && coefficient < 1.0) {
    for (const auto& [name, p] : parameters) {
      Tensor g = p.grad();
      if (g.defined()) kernels::scale(g.data(), g.numel(), static_cast<float>(coefficient));
    }
  }
  return norm;
}

TrainSettings read_checkpoint_settings(const std::string& path) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (!file.metadata().count("format") || file.metadata().at("format") != kFormat) {
    throw IoError(path + ": not a qkv training checkpoint (its __metadata__ has no format \"" + kFormat + "\")");
  }
  try {
    return TrainSettings::from_strings(file.metadata());
  } catch (const ValueError& e) {
    throw IoError(path + ": " + e.what());
  }
}

namespace {
// Every tensor the configuration implies is in the file with its shape — checked before anything is allocated,
// so a small file cannot make qkv build a huge model from its metadata alone.
void check_tensors(const io::SafetensorsFile& file, const TrainSettings& settings, bool with_optimizer) {
  const std::string& path = file.path();
  auto expect = [&](const std::string& name, const Shape& shape) {
    const io::TensorInfo* info = file.find(name);
    if (!info) throw IoError(path + ": missing tensor " + name + "; the checkpoint is incomplete or not from qkv train");
    if (!(Shape(std::span<const int64_t>(info->shape)) == shape)) {
      throw IoError(path + ": " + name + " has shape " + Shape(std::span<const int64_t>(info->shape)).str() +
                    ", but the checkpoint's own settings need " + shape.str());
    }
  };
  for (const auto& [name, shape] : settings.model.parameter_shapes()) {
    expect("model." + name, shape);
    if (with_optimizer) {
      expect("optimizer.exp_avg." + name, shape);
      expect("optimizer.exp_avg_sq." + name, shape);
    }
  }
  if (with_optimizer) expect("rng.state", Shape{628});
}
}  // namespace

void check_checkpoint(const std::string& path, const TrainSettings& settings) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  check_tensors(file, settings, true);
}

std::unique_ptr<nn::GPTModel> load_checkpoint_model(const std::string& path, TrainSettings* settings_out) {
  const TrainSettings settings = read_checkpoint_settings(path);
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  check_tensors(file, settings, false);
  auto model = nn::GPTModel::uninitialised(settings.model, settings.seed);
  for (auto& [name, p] : model->named_parameters()) p.copy_(file.weights("model." + name));
  model->eval();
  if (settings_out) *settings_out = settings;
  return model;
}

Trainer::Trainer(const TrainSettings& settings, const std::vector<int64_t>& tokens) : settings_(settings), generator_(settings.seed) {
  settings_.validate();
  for (int64_t id : tokens) {
    if (id < 0 || id >= settings_.model.vocab_size) {
      throw ValueError("token id " + std::to_string(id) + " does not fit vocab_size " + std::to_string(settings_.model.vocab_size));
    }
  }
  auto [train_ids, validation_ids] = text::split_tokens(tokens, settings_.train_fraction);
  const int64_t T = settings_.model.context_length;
  try {
    train_data_ = std::make_unique<text::SlidingWindowDataset>(std::move(train_ids), T, T);
  } catch (const ValueError& e) {
    throw ValueError(std::string("training split: ") + e.what());
  }
  try {
    validation_data_ = std::make_unique<text::SlidingWindowDataset>(std::move(validation_ids), T, T);
  } catch (const ValueError& e) {
    throw ValueError(std::string("validation split (the last ") + format_real(100 * (1 - settings_.train_fraction)) +
                     "% of the text): " + e.what());
  }
  train_loader_ = std::make_unique<text::DataLoader>(*train_data_, settings_.batch_size, true, settings_.seed);
  validation_loader_ = std::make_unique<text::DataLoader>(
      *validation_data_, std::min<int64_t>(settings_.batch_size, validation_data_->size()), false, settings_.seed);
  model_ = std::make_unique<nn::GPTModel>(settings_.model, generator_);
  optimizer_ = std::make_unique<optim::AdamW>(
      model_->named_parameters(), optim::AdamWOptions{.lr = settings_.learning_rate, .weight_decay = settings_.weight_decay});
  std::vector<int64_t> all = train_data_->ids();
  all.insert(all.end(), validation_data_->ids().begin(), validation_data_->ids().end());
  settings_fingerprint_ = fingerprint(all);
}

void Trainer::save_checkpoint(const std::string& path) const {
  std::vector<io::TensorData> tensors;
  for (const auto& [name, p] : model_->named_parameters()) tensors.push_back(io::TensorData::from_tensor("model." + name, p));
  optimizer_->for_each_state(
      [&](const std::string& name, Tensor& t) { tensors.push_back(io::TensorData::from_tensor("optimizer." + name, t)); });
  const std::vector<uint64_t> state = generator_.state();
  std::vector<int64_t> words(state.begin(), state.end());
  tensors.push_back(io::TensorData::from_int64s("rng.state", words));
  std::map<std::string, std::string> metadata = settings_.to_strings();
  metadata["format"] = kFormat;
  metadata["step"] = std::to_string(step_);
  metadata["data_fingerprint"] = std::to_string(settings_fingerprint_);
  io::save_safetensors(path, tensors, metadata);
}

void Trainer::resume(const std::string& path) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (!file.metadata().count("format") || file.metadata().at("format") != kFormat) {
    throw IoError(path + ": not a qkv training checkpoint (its __metadata__ has no format \"" + kFormat + "\")");
  }
  // Settings that shape the model or the data must match; optimisation settings (steps, learning rates,
  // evaluation and checkpoint intervals) may be changed on resume.
  TrainSettings stored;
  try {
    stored = TrainSettings::from_strings(file.metadata());
  } catch (const ValueError& e) {
    throw IoError(path + ": " + e.what());
  }
  std::string mismatches;
  for (const std::string& d : settings_differences(stored, settings_, /*must_match=*/true)) mismatches += "\n  " + d;
  if (file.metadata().count("data_fingerprint") && file.metadata().at("data_fingerprint") != std::to_string(settings_fingerprint_)) {
    mismatches += "\n  text: the checkpoint was trained on different text (token fingerprint differs)";
  }
  if (!mismatches.empty()) {
    throw ValueError(path + " comes from another configuration; it differs in:" + mismatches +
                     "\nResume with the same settings and text (qkv train --resume takes them from the checkpoint "
                     "unless you override them).");
  }
  nn::StateDict state;
  for (const auto& [name, p] : model_->named_parameters()) {
    if (!file.contains("model." + name)) throw IoError(path + ": missing tensor model." + name);
    state.insert(name, file.weights("model." + name));
  }
  const nn::StateDict current = model_->state_dict(/*with_derived=*/false);
  for (const auto& [name, t] : current.entries())
    if (!state.find(name)) state.insert(name, t.clone());  // buffers (masks) and tied aliases come from the model
  try {
    model_->load_state_dict(state);
  } catch (const Error& e) {
    throw IoError(path + ": " + e.what());
  }
  optimizer_->ensure_state();
  optimizer_->for_each_state([&](const std::string& name, Tensor& t) {
    if (!file.contains("optimizer." + name)) throw IoError(path + ": missing tensor optimizer." + name);
    const Tensor stored = file.weights("optimizer." + name);
    if (!(stored.shape() == t.shape())) throw IoError(path + ": optimizer." + name + " has the wrong shape");
    t.copy_(stored);
  });
  const std::vector<int64_t> words = file.int64s("rng.state");
  try {
    generator_.set_state(std::vector<uint64_t>(words.begin(), words.end()));
  } catch (const ValueError& e) {
    throw IoError(path + ": rng.state: " + e.what());
  }
  const int64_t step = parse_int(file.metadata().count("step") ? file.metadata().at("step") : "", path + ": step");
  if (step < 0) throw IoError(path + ": step = " + std::to_string(step) + " is negative; the checkpoint is corrupt");
  step_ = step;
  optimizer_->set_step_count(step_);
}

double Trainer::evaluate(bool validation, int64_t batches) {
  NoGradGuard no_grad;
  model_->eval();
  text::DataLoader fixed(validation ? *validation_data_ : *train_data_,
                         std::min<int64_t>(settings_.batch_size, (validation ? validation_data_ : train_data_)->size()),
                         false, settings_.seed);
  const int64_t n = std::min<int64_t>(std::max<int64_t>(batches, 1), fixed.batches_per_epoch());
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const text::Batch b = fixed.batch(i);
    total += nn::language_model_loss(model_->forward(b.inputs, b.batch, b.tokens), b.targets).item();
  }
  model_->train();
  return total / static_cast<double>(n);
}

int64_t Trainer::run(const std::function<void(const StepReport&)>& on_step,
                     const std::function<void(const EvalReport&)>& on_eval,
                     const std::function<void(int64_t step)>& on_checkpoint, const std::atomic<bool>* stop) {
  model_->train();
  const auto parameters = model_->named_parameters();
  while (step_ < settings_.max_steps && !(stop && stop->load())) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = learning_rate_at(settings_, step_);
    optimizer_->set_lr(lr);
    const text::Batch batch = train_loader_->batch(step_);
    optimizer_->zero_grad();
    const Tensor loss = nn::language_model_loss(model_->forward(batch.inputs, batch.batch, batch.tokens), batch.targets);
    const float loss_value = loss.item();
    if (!std::isfinite(loss_value)) {
      throw TrainingDiverged("step " + std::to_string(step_ + 1) + ": the loss is " + std::to_string(loss_value) +
                             " (the training diverged); stopped before applying the step");
    }
    loss.backward();
    const double norm = clip_grad_norm(parameters, settings_.grad_clip);
    if (!std::isfinite(norm)) {
      throw TrainingDiverged("step " + std::to_string(step_ + 1) + ": the gradient norm is " + std::to_string(norm) +
                             " (the training diverged); stopped before applying the step");
    }
    optimizer_->step();
    ++step_;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (on_step) {
      on_step({step_, loss.item(), lr, norm, static_cast<double>(batch.batch * batch.tokens) / seconds, seconds});
    }
    if (settings_.eval_every > 0 && (step_ % settings_.eval_every == 0 || step_ == settings_.max_steps) && on_eval) {
      on_eval({step_, evaluate(false, settings_.eval_batches), evaluate(true, settings_.eval_batches)});
    }
    if (settings_.checkpoint_every > 0 && step_ % settings_.checkpoint_every == 0 && on_checkpoint) on_checkpoint(step_);
  }
  return step_;
}

}  // namespace qkv::train
