// Classification fine-tuning, the book's chapter 6 (see qkv/train/classify.hpp): splits of labelled texts, the
// classifier over a language model's hidden states, its training loop and metrics.
#include "qkv/train/classify.hpp"
#include "qkv/train/finetune.hpp"
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

// ---- classification ----

std::vector<std::string> label_names(const std::vector<text::LabelledText>& train) {
  std::vector<std::string> out;
  for (const auto& t : train)
    if (std::find(out.begin(), out.end(), t.label) == out.end()) out.push_back(t.label);
  const bool integers = std::all_of(out.begin(), out.end(), [](const std::string& s) {
    return !s.empty() && s.size() < 18 && std::all_of(s.begin() + (s[0] == '-' ? 1 : 0), s.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
           s != "-";
  });
  if (integers) std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) { return std::stoll(a) < std::stoll(b); });
  return out;
}

int64_t longest_text(const std::vector<text::LabelledText>& texts, const text::Tokenizer& tokenizer, int64_t limit) {
  int64_t longest = 0;
  for (const auto& t : texts) longest = std::max<int64_t>(longest, static_cast<int64_t>(tokenizer.encode(t.text).size()));
  return std::min(longest, limit);
}

ClassificationSplit make_split(const std::vector<text::LabelledText>& texts, const std::vector<std::string>& labels,
                               const text::Tokenizer& tokenizer, int64_t length, int64_t pad_id, const std::string& label) {
  if (texts.empty()) throw ValueError(label + ": no texts (an empty split)");
  if (length < 1) throw ValueError(label + ": the texts have no tokens");
  ClassificationSplit s;
  s.length = length;
  for (const auto& t : texts) {
    const auto at = std::find(labels.begin(), labels.end(), t.label);
    if (at == labels.end()) {
      std::string known;
      for (const auto& l : labels) known += (known.empty() ? "'" : ", '") + l + "'";
      throw ValueError(label + ":" + std::to_string(t.line) + ": label '" + t.label +
                       "' is not in the training set (which has " + known + ")");
    }
    std::vector<int64_t> ids = tokenizer.encode(t.text);
    if (static_cast<int64_t>(ids.size()) > length) ids.resize(static_cast<size_t>(length));
    s.last_real.push_back(std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - 1));
    ids.resize(static_cast<size_t>(length), pad_id);
    s.ids.insert(s.ids.end(), ids.begin(), ids.end());
    s.labels.push_back(at - labels.begin());
  }
  return s;
}

SequenceClassifier::SequenceClassifier(nn::LanguageModel& base_, int64_t classes, Generator& gen, bool bias)
    : base(base_), head(base_.hidden_size(), classes, bias, gen) {}

Tensor SequenceClassifier::logits(std::span<const int64_t> ids, int64_t batch, int64_t tokens,
                                  std::span<const int64_t> positions) const {
  return head(gather_tokens(base.hidden_states(ids, batch, tokens), positions));
}

int64_t SequenceClassifier::enable_prefix_cache(int64_t limit_bytes) {
  cache_.clear();
  cache_bytes_ = 0;
  cache_limit_ = limit_bytes;
  const int64_t L = base.num_layers();
  int64_t first = L;  // the first block with a trainable parameter (L: only the final norm and the head train)
  for (const auto& [name, p] : base.named_trainable_parameters()) {
    if (name.rfind(base.final_norm_prefix(), 0) == 0) continue;
    int64_t layer = -1;
    for (int64_t i = 0; i < L && layer < 0; ++i)
      if (name.rfind(base.block_prefix(i), 0) == 0) layer = i;
    first = std::min(first, layer < 0 ? 0 : layer);  // anything outside the blocks (an embedding) trains: no cache
  }
  cache_layer_ = limit_bytes > 0 && !base.is_training() ? first : 0;
  return cache_layer_;
}

Tensor SequenceClassifier::batch_logits(const ClassificationSplit& data, std::span<const int64_t> rows, Pooling pooling) const {
  const int64_t B = static_cast<int64_t>(rows.size()), T = data.length;
  std::vector<int64_t> ids, positions;
  for (int64_t i : rows) {
    ids.insert(ids.end(), data.ids.begin() + i * T, data.ids.begin() + (i + 1) * T);
    positions.push_back(pooling == Pooling::Last ? T - 1 : data.last_real[static_cast<size_t>(i)]);
  }
  if (cache_layer_ == 0) return logits(ids, B, T, positions);
  std::vector<Tensor>& cached = cache_[&data];
  cached.resize(static_cast<size_t>(data.size()));
  std::vector<int64_t> missing;
  for (int64_t i : rows)
    if (!cached[static_cast<size_t>(i)].defined() && std::find(missing.begin(), missing.end(), i) == missing.end()) missing.push_back(i);
  const int64_t C = base.hidden_size();
  std::map<int64_t, Tensor> fresh;  // rows computed now but not kept (over the limit)
  if (!missing.empty()) {
    NoGradGuard no_grad;
    std::vector<int64_t> missing_ids;
    for (int64_t i : missing) missing_ids.insert(missing_ids.end(), data.ids.begin() + i * T, data.ids.begin() + (i + 1) * T);
    const Tensor r = base.residual_before(missing_ids, static_cast<int64_t>(missing.size()), T, cache_layer_);
    for (size_t k = 0; k < missing.size(); ++k) {
      Tensor row = Tensor::from(std::span<const float>(r.data() + static_cast<int64_t>(k) * T * C, static_cast<size_t>(T * C)), {T, C});
      if (cache_bytes_ + T * C * 4 <= cache_limit_) {
        cached[static_cast<size_t>(missing[k])] = row;
        cache_bytes_ += T * C * 4;
      } else {
        fresh[missing[k]] = row;
      }
    }
  }
  Tensor x = Tensor::empty({B, T, C});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = rows[static_cast<size_t>(b)];
    const Tensor& row = cached[static_cast<size_t>(i)].defined() ? cached[static_cast<size_t>(i)] : fresh.at(i);
    std::copy_n(row.data(), T * C, x.data() + b * T * C);
  }
  return head(gather_tokens(base.hidden_from(x, cache_layer_), positions));
}

std::string SequenceClassifier::head_name() const { return base.classifier_head_name(); }

std::vector<std::pair<std::string, Tensor>> SequenceClassifier::trainable_parameters() {
  auto out = base.named_trainable_parameters();
  for (auto& [name, p] : head.named_trainable_parameters()) out.emplace_back(head_name() + "." + name, p);
  return out;
}

std::vector<std::pair<std::string, Tensor>> SequenceClassifier::state_dict() {
  std::vector<std::pair<std::string, Tensor>> out;
  const std::string vocab_head = base.head_prefix(), mine = head_name() + ".";
  const bool tied = vocab_head != "out_head." && vocab_head != "lm_head.";
  const nn::StateDict state = base.state_dict(), head_state = head.state_dict();
  for (const auto& [name, t] : state.entries()) {
    if (!tied && name.compare(0, vocab_head.size(), vocab_head) == 0) continue;
    if (name.compare(0, mine.size(), mine) == 0) continue;
    out.emplace_back(name, t);
  }
  for (const auto& [name, t] : head_state.entries())
    if (name.find("lora_") == std::string::npos) out.emplace_back(mine + name, t);
  return out;
}

namespace {

std::vector<int64_t> labels_of(const ClassificationSplit& data, std::span<const int64_t> rows) {
  std::vector<int64_t> out;
  for (int64_t i : rows) out.push_back(data.labels[static_cast<size_t>(i)]);
  return out;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

}  // namespace

std::vector<int64_t> randperm(int64_t n, Generator& gen) {
  std::vector<int64_t> r = iota(n);
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t z = static_cast<int64_t>(gen.next_u32() % static_cast<uint64_t>(n - i));
    std::swap(r[static_cast<size_t>(i)], r[static_cast<size_t>(z + i)]);
  }
  return r;
}

ClassifierMetrics evaluate_classifier(const SequenceClassifier& model, const ClassificationSplit& data, int64_t batch_size,
                                      int64_t batches, Pooling pooling) {
  NoGradGuard no_grad;
  const int64_t n = data.size(), available = (n + batch_size - 1) / batch_size;
  const int64_t count = batches > 0 ? std::min(batches, available) : available;
  ClassifierMetrics m;
  if (count == 0) return {NAN, NAN};
  int64_t correct = 0, seen = 0;
  const std::vector<int64_t> order = iota(n);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t begin = k * batch_size, rows = std::min(batch_size, n - begin);
    const auto chosen = std::span(order).subspan(static_cast<size_t>(begin), static_cast<size_t>(rows));
    const std::vector<int64_t> labels = labels_of(data, chosen);
    const Tensor logits = model.batch_logits(data, chosen, pooling);
    m.loss += cross_entropy(logits, labels).item();
    const int64_t classes = logits.size(1);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * classes;
      if (std::max_element(row, row + classes) - row == labels[static_cast<size_t>(r)]) ++correct;
    }
    seen += rows;
  }
  m.loss /= static_cast<double>(count);
  m.accuracy = static_cast<double>(correct) / static_cast<double>(seen);
  return m;
}

std::vector<std::vector<int64_t>> confusion_matrix(const SequenceClassifier& model, const ClassificationSplit& data,
                                                   int64_t batch_size, Pooling pooling, int64_t classes) {
  NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(classes), std::vector<int64_t>(static_cast<size_t>(classes)));
  const std::vector<int64_t> order = iota(data.size());
  for (int64_t begin = 0; begin < data.size(); begin += batch_size) {
    const int64_t rows = std::min(batch_size, data.size() - begin);
    const auto chosen = std::span(order).subspan(static_cast<size_t>(begin), static_cast<size_t>(rows));
    const std::vector<int64_t> labels = labels_of(data, chosen);
    const Tensor logits = model.batch_logits(data, chosen, pooling);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * classes;
      counts[static_cast<size_t>(labels[static_cast<size_t>(r)])][static_cast<size_t>(std::max_element(row, row + classes) - row)]++;
    }
  }
  return counts;
}

int64_t train_classifier(SequenceClassifier& model, const ClassificationSplit& train, const ClassificationSplit& val,
                         const ClassifierOptions& o, const ClassifierCallbacks& callbacks) {
  if (o.batch_size < 1 || o.epochs < 0 || o.eval_freq < 1 || o.eval_iter < 1) throw ValueError("fine-tuning: batch size, eval frequency and eval batches must be positive");
  const int64_t per_epoch = train.size() / o.batch_size;
  if (per_epoch == 0) {
    throw ValueError("the training split has " + std::to_string(train.size()) + " texts, fewer than one batch of " +
                     std::to_string(o.batch_size) + "; use a smaller --batch-size");
  }
  model.base.eval();
  model.enable_prefix_cache(o.prefix_cache_bytes);
  optim::AdamW optimizer = make_adamw(model.trainable_parameters(), o.lr, o.weight_decay);
  int64_t step = 0, examples = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    Generator shuffle(o.seed + static_cast<uint64_t>(epoch));
    const std::vector<int64_t> order = randperm(train.size(), shuffle);
    for (int64_t k = 0; k < per_epoch; ++k) {
      const auto chosen = std::span(order).subspan(static_cast<size_t>(k * o.batch_size), static_cast<size_t>(o.batch_size));
      optimizer.zero_grad(true);
      const Tensor loss = cross_entropy(model.batch_logits(train, chosen, o.pooling), labels_of(train, chosen));
      const double value = loss.item();
      check_finite(value, step + 1);
      loss.backward();
      optimizer.step();
      memory::cache_blocks_for_steps();  // every batch has the same shape: the next step reuses these blocks
      examples += o.batch_size;
      if (callbacks.on_step) callbacks.on_step({step + 1, epoch + 1, examples, per_epoch * o.epochs, value});
      if (step % o.eval_freq == 0 && callbacks.on_eval) {
        const double tl = evaluate_classifier(model, train, o.batch_size, o.eval_iter, o.pooling).loss;
        const double vl = evaluate_classifier(model, val, o.batch_size, o.eval_iter, o.pooling).loss;
        callbacks.on_eval({step + 1, examples, tl, vl});
      }
      ++step;
    }
    if (callbacks.on_epoch) {
      callbacks.on_epoch({epoch + 1, evaluate_classifier(model, train, o.batch_size, o.eval_iter, o.pooling).accuracy,
                          evaluate_classifier(model, val, o.batch_size, o.eval_iter, o.pooling).accuracy});
    }
  }
  return step;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace qkv::train
