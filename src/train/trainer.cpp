// The training loop and its checkpoints (see qkv/train/trainer.hpp).
#include "qkv/train/trainer.hpp"

#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numbers>

#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/optim.hpp"

namespace qkv::train {

namespace {


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

double gradient_norm(const std::vector<std::pair<std::string, Tensor>>& parameters) {
  // Σ g² per parameter in fixed chunks (kernels::sum_of_squares: the same for any thread count).
  double total = 0.0;
  for (const auto& [name, p] : parameters) {
    const Tensor g = p.grad();
    if (g.defined()) total += kernels::sum_of_squares(g.data(), g.numel());
  }
  return std::sqrt(total);
}

float clip_coefficient(double norm, double max_norm) {
  const double coefficient = max_norm / (norm + 1e-6);
  return max_norm > 0 && coefficient < 1.0 ? static_cast<float>(coefficient) : 1.0f;
}

double clip_grad_norm(const std::vector<std::pair<std::string, Tensor>>& parameters, double max_norm) {
  const double norm = gradient_norm(parameters);
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
  if (!file.metadata().count("format") || file.metadata().at("format") != nn::kQkvCheckpointFormat) {
    throw IoError(path + ": not a qkv training checkpoint (its __metadata__ has no format \"" + nn::kQkvCheckpointFormat + "\")");
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

std::unique_ptr<nn::Decoder> load_checkpoint_model(const std::string& path, TrainSettings* settings_out, DType matrices) {
  const TrainSettings settings = read_checkpoint_settings(path);
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  check_tensors(file, settings, false);
  auto model = nn::Decoder::for_loading(settings.model.decoder_config());  // every parameter is read below
  model->for_each_parameter([&](const std::string& name, Tensor& p) {
    if (matrices == DType::BF16 && p.rank() == 2) p.to_bf16_(/*keep_values=*/false);
    file.read_weights("model." + name, p);  // straight into the parameter, bf16 rounded where it is one
  });
  model->eval();
  if (settings_out) *settings_out = settings;
  return model;
}

Trainer::Trainer(const TrainSettings& settings, const std::vector<int64_t>& tokens, Communicator* communicator,
                 std::unique_ptr<nn::Decoder> model)
    : settings_(settings), generator_(settings.seed), comm_(communicator ? communicator : &single_) {
  settings_.validate();
  if (model) {
    if (settings_.model.context_length > model->context_length()) {
      throw ValueError("context_length " + std::to_string(settings_.model.context_length) + " is longer than the " +
                       std::to_string(model->context_length()) + " positions the model has");
    }
    model->use_generator(generator_);
    model_ = std::move(model);
  }
  const int64_t vocab = model_ ? model_->vocab_size() : settings_.model.vocab_size;
  precision_ = resolve_precision(settings_.precision);
  // Every step allocates the same sizes: keep large freed blocks for the next step instead of page-faulting in
  // fresh ones (qkv/kernels/memory.hpp); the limit follows the step's peak after each step.
  memory::cache_blocks_for_steps();
  world_ = comm_->size();
  for (int64_t id : tokens) {
    if (id < 0 || id >= vocab) {
      throw ValueError("token id " + std::to_string(id) + " does not fit vocab_size " + std::to_string(vocab));
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
    // The share as people write it: 10%, not the 9.999999999999998% that 100 × (1 − 0.9) is in doubles.
    char share[32];
    std::snprintf(share, sizeof share, "%.3g%%", 100 * (1 - settings_.train_fraction));
    throw ValueError(std::string("validation split (the last ") + share + " of the text, from --train-fraction " +
                     format_real(settings_.train_fraction) + "): " + e.what());
  }
  // The loader hands out whole global batches; each process takes its micro-batches from them (run()).
  try {
    train_loader_ = std::make_unique<text::DataLoader>(*train_data_, global_batch(), true, settings_.seed);
  } catch (const ValueError& e) {
    throw ValueError(std::string("training split: ") + e.what() + " (the global batch is " + std::to_string(world_) +
                     " process(es) × batch " + std::to_string(settings_.batch_size) + " × grad-accum " +
                     std::to_string(settings_.grad_accum) + ")");
  }
  validation_loader_ = std::make_unique<text::DataLoader>(
      *validation_data_, std::min<int64_t>(settings_.batch_size, validation_data_->size()), false, settings_.seed);
  if (!model_) model_ = std::make_unique<nn::Decoder>(settings_.model, generator_);
  optimizer_ = std::make_unique<optim::AdamW>(
      model_->named_trainable_parameters(), optim::AdamWOptions{.lr = settings_.learning_rate, .beta1 = settings_.adam_beta1, .beta2 = settings_.adam_beta2,
                                                .eps = settings_.adam_eps, .weight_decay = settings_.weight_decay});
  std::vector<int64_t> all = train_data_->ids();
  all.insert(all.end(), validation_data_->ids().begin(), validation_data_->ids().end());
  settings_fingerprint_ = fingerprint(all);
}

void write_checkpoint(const std::string& path, nn::Decoder& model,
                      const std::function<void(const std::function<void(const std::string&, Tensor&)>&)>& for_each_state,
                      const TrainSettings& settings, int64_t step, const std::vector<uint64_t>& rng_state,
                      const std::map<std::string, std::string>& extra_metadata) {
  std::vector<io::TensorData> tensors;
  for (const auto& [name, p] : model.named_parameters()) tensors.push_back(io::TensorData::from_tensor("model." + name, p));
  for_each_state([&](const std::string& name, Tensor& t) { tensors.push_back(io::TensorData::from_tensor("optimizer." + name, t)); });
  std::vector<int64_t> words(rng_state.begin(), rng_state.end());
  tensors.push_back(io::TensorData::from_int64s("rng.state", words));
  std::map<std::string, std::string> metadata = settings.to_strings();
  metadata["format"] = nn::kQkvCheckpointFormat;
  metadata["step"] = std::to_string(step);
  for (const auto& [k, v] : extra_metadata) metadata[k] = v;
  io::save_safetensors(path, tensors, metadata);
}

void Trainer::save_checkpoint(const std::string& path) const {
  write_checkpoint(path, *model_, [&](const auto& fn) { optimizer_->for_each_state(fn); }, settings_, step_, generator_.state(),
                   {{"world_size", std::to_string(world_)}, {"global_batch", std::to_string(global_batch())},
                    {"data_fingerprint", std::to_string(settings_fingerprint_)}});
}

void Trainer::resume_from(const ModelFile& file) {
  const std::string& label = file.description;
  if (file.classifier_weight.defined()) {
    throw ValueError(label + " is a fine-tuned classifier, not a language model (its out_head has " +
                     std::to_string(file.classifier_weight.size(0)) + " classes); pretrain from its base model instead");
  }
  if (const nn::GPTConfig config = nn::GPTConfig::of(file.model->config); !(config == settings_.model)) {
    std::string diff;
    const auto theirs = config.to_strings(), mine = settings_.model.to_strings();
    for (const auto& [k, v] : theirs)
      if (k != "drop_rate" && mine.at(k) != v) diff += "\n  " + k + ": file " + v + ", this run " + mine.at(k);
    if (!diff.empty()) throw ValueError(label + " holds another model than this run's settings:" + diff);
  }
  auto source = file.model->named_parameters();
  auto target = model_->named_parameters();
  for (size_t i = 0; i < target.size(); ++i) target[i].second.copy_(source[i].second);
  step_ = 0;
  if (file.optimizer) {
    optimizer_->ensure_state();
    optimizer_->for_each_state([&](const std::string& name, Tensor& t) {
      if (const Tensor* moment = file.optimizer->state(name)) t.copy_(*moment);
    });
    step_ = file.optimizer->step;
  }
  optimizer_->set_step_count(step_);
  if (!file.rng_state.empty()) {
    try {
      generator_.set_state(file.rng_state);
    } catch (const ValueError& e) {
      throw IoError(label + ": qkv_rng_state: " + e.what());
    }
  }
}

void Trainer::resume(const std::string& path) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  if (!file.metadata().count("format") || file.metadata().at("format") != nn::kQkvCheckpointFormat) {
    throw IoError(path + ": not a qkv training checkpoint (its __metadata__ has no format \"" + nn::kQkvCheckpointFormat + "\")");
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
  // The global batch must be the same (how it is split between processes and micro-batches may change).
  const int64_t stored_world = file.metadata().count("world_size") ? parse_int(file.metadata().at("world_size"), path + ": world_size") : 1;
  const int64_t stored_global = stored_world * stored.batch_size * stored.grad_accum;
  if (stored_global != global_batch()) {
    mismatches += "\n  global batch: checkpoint " + std::to_string(stored_world) + " process(es) × batch " +
                  std::to_string(stored.batch_size) + " × grad-accum " + std::to_string(stored.grad_accum) + " = " +
                  std::to_string(stored_global) + " windows, this run " + std::to_string(world_) + " × " +
                  std::to_string(settings_.batch_size) + " × " + std::to_string(settings_.grad_accum) + " = " +
                  std::to_string(global_batch()) + "; choose --batch-size and --grad-accum so that processes × batch × "
                  "accum = " + std::to_string(stored_global);
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

int64_t Trainer::train_windows() const { return train_data_->size(); }
int64_t Trainer::validation_windows() const { return validation_data_->size(); }

double Trainer::evaluate(bool validation, int64_t batches) {
  NoGradGuard no_grad;
  const PrecisionGuard precision(precision_);
  model_->eval();
  text::DataLoader fixed(validation ? *validation_data_ : *train_data_,
                         std::min<int64_t>(settings_.batch_size, (validation ? validation_data_ : train_data_)->size()),
                         false, settings_.seed);
  const int64_t n = std::min<int64_t>(std::max<int64_t>(batches, 1), fixed.batches_per_epoch());
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const text::Batch b = fixed.batch(i);
    total += model_->loss(b.inputs, b.batch, b.tokens, b.targets).item();
  }
  model_->train();
  return total / static_cast<double>(n);
}

namespace {
// The dropout seed of micro-batch `slice` of optimiser step `step`: the same whichever process runs it.
uint64_t slice_seed(uint64_t seed, int64_t step, int64_t slice) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  for (uint64_t v : {static_cast<uint64_t>(step), static_cast<uint64_t>(slice)}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}
}  // namespace

double Trainer::backward_summing(const Tensor& loss, const text::Batch& global) {
  const bool bf16 = settings_.allreduce_precision == "bf16";
  double inside = 0.0;  // seconds spent in the communicator: starting sums and moving them along
  auto timed = [&inside](auto&& call) {
    const auto began = std::chrono::steady_clock::now();
    call();
    inside += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  for (Bucket& b : buckets_) b.ready = 0, b.queued = false;
  auto queue = [&](Bucket& b) {
    b.queued = true;
    timed([&] { comm_->enqueue_sum(gradient_arena_.data() + b.first, b.count, bf16); });
  };
  if (settings_.allreduce_bucket_mib == 0) {
    loss.backward();
    for (Bucket& b : buckets_) queue(b);
    return inside;
  }
  // The rows of the sparse tables this step's global batch reaches (every process's, every micro-batch's): the other
  // rows' gradients are zero on every process, and so is their sum.
  const auto reached = model_->sparse_gradients(global.inputs, global.tokens);
  for (const auto& table : reached) {
    if (auto it = sparse_of_.find(table.table.impl()); it != sparse_of_.end()) sparse_[it->second].rows = table.rows;
  }
  std::vector<bool> sparse_queued(sparse_.size(), false);
  for (ExpertUnit& u : expert_units_) u.queued = false;
  auto queue_expert = [&](ExpertUnit& u) {  // an expert no process's tokens chose: zero everywhere, not summed
    u.queued = true;
    if (experts_chosen_.at(static_cast<size_t>(u.expert))) {
      ++expert_sums_;
      timed([&] { comm_->enqueue_sum(gradient_arena_.data() + u.first, u.count, bf16); });
    } else {
      ++expert_sums_skipped_;
    }
  };
  auto queue_rows = [&](size_t i) {
    SparseTable& t = sparse_[i];
    sparse_queued[i] = true;
    timed([&] {
      t.gathered.resize(t.rows.size() * static_cast<size_t>(t.width));
      for (size_t r = 0; r < t.rows.size(); ++r) {
        std::copy_n(gradient_arena_.data() + t.first + t.rows[r] * t.width, t.width, t.gathered.data() + r * t.width);
      }
      comm_->enqueue_sum(t.gathered.data(), static_cast<int64_t>(t.gathered.size()), bf16);
    });
  };
  // As the backward finishes each parameter, its bucket may be complete: its sum starts while the backward goes on
  // (in the walk's order, the same on every process), and queued sums are moved along at every finished parameter.
  const GradientReadyGuard guard([&](const Tensor& leaf) {
    if (auto it = bucket_of_.find(leaf.impl()); it != bucket_of_.end()) {
      Bucket& b = buckets_[it->second];
      if (++b.ready == b.parameters) queue(b);
    } else if (auto sparse = sparse_of_.find(leaf.impl()); sparse != sparse_of_.end()) {
      queue_rows(sparse->second);
    } else if (auto unit = expert_unit_of_.find(leaf.impl()); unit != expert_unit_of_.end()) {
      queue_expert(expert_units_[unit->second]);
    }
    timed([&] { comm_->progress(); });
  });
  loss.backward();
  for (Bucket& b : buckets_)  // a parameter the step did not reach: its bucket goes now, in bucket order
    if (!b.queued) queue(b);
  for (size_t i = 0; i < sparse_.size(); ++i)
    if (!sparse_queued[i]) queue_rows(i);
  for (ExpertUnit& u : expert_units_)
    if (!u.queued) queue_expert(u);
  return inside;
}

void Trainer::scatter_sparse_rows() {
  for (SparseTable& t : sparse_) {
    for (size_t r = 0; r < t.rows.size(); ++r) {
      std::copy_n(t.gathered.data() + r * t.width, t.width, gradient_arena_.data() + t.first + t.rows[r] * t.width);
    }
  }
}

int64_t Trainer::run(const std::function<void(const StepReport&)>& on_step,
                     const std::function<void(const EvalReport&)>& on_eval,
                     const std::function<void(int64_t step)>& on_checkpoint, const std::atomic<bool>* stop) {
  model_->train();
  const PrecisionGuard precision(precision_);
  const auto parameters = model_->named_trainable_parameters();
  const int64_t B = settings_.batch_size, K = settings_.grad_accum, slices = world_ * K;
  if (world_ > 1 && !gradient_arena_.defined()) {
    // Every gradient a view into one buffer, so the cross-process sum reads and writes it in place (no copies).
    int64_t total = 0;
    for (const auto& [name, p] : parameters) total += p.numel();
    gradient_arena_ = Tensor::zeros({total});
    int64_t at = 0;
    for (const auto& [name, p] : parameters) {
      Tensor handle = p;
      handle.set_grad(gradient_arena_.view_at(at, p.shape()));
      at += p.numel();
    }
    // Buckets of whole parameters, from the arena's end (the backward finishes the last layers first), each summed
    // across processes as soon as the backward has finished every parameter in it. With buckets, the sparse tables
    // are left out: each step sums only their rows it reached. (Without, one dense sum after the backward: the
    // reference the overlapped sums must equal bit for bit.)
    const int64_t cap = settings_.allreduce_bucket_mib * (int64_t{1} << 20) / static_cast<int64_t>(sizeof(float));
    buckets_.clear();
    bucket_of_.clear();
    sparse_.clear();
    sparse_of_.clear();
    expert_units_.clear();
    expert_unit_of_.clear();
    std::unordered_map<const void*, int64_t> sparse_width;
    if (cap > 0) {
      for (const auto& table : model_->sparse_gradients({}, 0)) sparse_width[table.table.impl()] = table.table.size(1);
    }
    at = total;
    bool cut = true;  // the next parameter starts a bucket
    for (auto p = parameters.rbegin(); p != parameters.rend(); ++p) {
      const int64_t n = p->second.numel();
      at -= n;
      if (auto it = sparse_width.find(p->second.impl()); it != sparse_width.end()) {
        sparse_of_[it->first] = sparse_.size();
        sparse_.push_back({at, it->second, {}, {}});
        cut = true;  // buckets are contiguous ranges of the arena
        continue;
      }
      if (const int64_t expert = cap > 0 ? model_->expert_use_index(p->first) : -1; expert >= 0) {
        expert_unit_of_[p->second.impl()] = expert_units_.size();
        expert_units_.push_back({at, n, expert, false});
        cut = true;
        continue;
      }
      if (cut || (cap > 0 && buckets_.back().count + n > cap)) buckets_.push_back({at, 0, 0, 0});
      cut = false;
      buckets_.back().first = at;
      buckets_.back().count += n;
      ++buckets_.back().parameters;
      bucket_of_[p->second.impl()] = buckets_.size() - 1;
    }
  }
  const float share = 1.0f / static_cast<float>(slices);  // each micro-batch's part of the mean loss
  while (step_ < settings_.max_steps && !comm_->any(stop && stop->load())) {
    const auto start = std::chrono::steady_clock::now();
    const double lr = learning_rate_at(settings_, step_);
    optimizer_->set_lr(lr);
    const text::Batch global = train_loader_->batch(step_);
    const int64_t T = global.tokens;
    // One process: gradients are written afresh by the backward pass. Several: they are views into the arena the
    // processes sum, so they stay and are cleared.
    optimizer_->zero_grad(/*set_to_none=*/world_ == 1);
    // Σ micro-batch losses, count of non-finite ones; then, with experts summed apart, how many processes chose each
    std::vector<double> local(2, 0.0);
    model_->record_expert_use(!expert_units_.empty());  // (clears what evaluations chose)
    double communication = 0.0;    // seconds inside the gradients' sums: during the backward and the wait after it
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slice = k * world_ + comm_->rank();
      const std::span<const int64_t> inputs(global.inputs.data() + slice * B * T, static_cast<size_t>(B * T));
      const std::span<const int64_t> targets(global.targets.data() + slice * B * T, static_cast<size_t>(B * T));
      generator_.manual_seed(slice_seed(settings_.seed, step_, slice));
      Tensor loss = model_->loss(inputs, B, T, targets);
      const float value = loss.item();
      local[0] += value;
      const bool last = k == K - 1;
      if (last) {
        // Every process learns the step's loss before the last backward, whose gradient sums are collectives, and
        // which experts any process's tokens chose.
        if (!std::isfinite(value)) local[1] += 1;
        if (!expert_units_.empty()) {
          const std::vector<uint8_t> chose = model_->take_expert_use();
          local.resize(2 + chose.size());
          for (size_t i = 0; i < chose.size(); ++i) local[2 + i] = chose[i];
        }
        comm_->sum(local.data(), static_cast<int64_t>(local.size()));
        experts_chosen_.assign(local.size() - 2, 0);
        for (size_t i = 2; i < local.size(); ++i) experts_chosen_[i - 2] = local[i] > 0.0;
        if (local[1] > 0) {
          throw TrainingDiverged("step " + std::to_string(step_ + 1) + ": the loss is " +
                                 std::to_string(local[0] / slices) + " (the training diverged); stopped before applying the step");
        }
      } else if (!std::isfinite(value)) {
        local[1] += 1;
        continue;
      }
      if (slices > 1) loss = mul(loss, share);
      if (last && world_ > 1) {
        communication += backward_summing(loss, global);
      } else {
        loss.backward();
      }
    }
    if (world_ > 1) {  // what is left of Σ gradients over processes once the backward is done
      const auto began = std::chrono::steady_clock::now();
      comm_->finish_sums();
      scatter_sparse_rows();
      communication += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    }
    // The norm is a read-only pre-pass; the clipping factor is applied inside AdamW's one sweep over parameter,
    // gradient and moments instead of a pass of its own. The same on every process.
    const double norm = gradient_norm(parameters);
    if (!std::isfinite(norm)) {
      throw TrainingDiverged("step " + std::to_string(step_ + 1) + ": the gradient norm is " + std::to_string(norm) +
                             " (the training diverged); stopped before applying the step");
    }
    optimizer_->set_gradient_scale(clip_coefficient(norm, settings_.grad_clip));
    optimizer_->step();
    memory::cache_blocks_for_steps();
    ++step_;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (on_step) {
      on_step({step_, local[0] / static_cast<double>(slices), lr, norm,
               static_cast<double>(global_batch() * T) / seconds, seconds, communication});
    }
    if (settings_.eval_every > 0 && (step_ % settings_.eval_every == 0 || step_ == settings_.max_steps) && on_eval) {
      on_eval({step_, evaluate(false, settings_.eval_batches), evaluate(true, settings_.eval_batches)});
    }
    if (settings_.checkpoint_every > 0 && step_ % settings_.checkpoint_every == 0 && on_checkpoint) on_checkpoint(step_);
  }
  return step_;
}

}  // namespace qkv::train
