// `qkv demo`: the article's worked example, step by step, generated from the book's seeds — or the same steps on
// the learner's own sentence or embeddings. With --pictures (or --png), every weight matrix it prints is
// also drawn, as PNG, SVG or PDF.
#include "commands.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "options.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/qkv.hpp"
#include "qkv/viz/heatmap.hpp"
#include "qkv/viz/show.hpp"

namespace qkv::cli {

namespace {

const std::vector<std::string> kJourney = {"Your", "journey", "starts", "with", "one", "step"};
constexpr int64_t kMaxTokens = 32;  // the matrices must fit a terminal
constexpr int64_t kMaxWidth = 64;   // d_in and d_out

// The book's 3-dimensional embeddings of "Your journey starts with one step" (section 3.3).
Tensor journey_inputs() {
  return Tensor::from_rows({{0.43f, 0.15f, 0.89f},
                            {0.55f, 0.87f, 0.66f},
                            {0.57f, 0.85f, 0.64f},
                            {0.22f, 0.58f, 0.33f},
                            {0.77f, 0.25f, 0.10f},
                            {0.05f, 0.80f, 0.55f}});
}

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// One random vector per distinct word, in order of first appearance (seeded like torch: randn(words, d)), looked
// up per token, so a repeated word gets the same embedding, as an embedding table would give it.
Tensor word_embeddings(const std::vector<std::string>& tokens, int64_t d, Generator& gen) {
  std::map<std::string, int64_t> vocab;
  for (const auto& w : tokens) vocab.emplace(w, static_cast<int64_t>(vocab.size()));
  std::vector<std::string> order(vocab.size());
  for (const auto& w : tokens)
    if (order[static_cast<size_t>(vocab[w])].empty()) order[static_cast<size_t>(vocab[w])] = w;
  const Tensor table = gen.randn({static_cast<int64_t>(vocab.size()), d});
  Tensor x = Tensor::empty({static_cast<int64_t>(tokens.size()), d});
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int64_t j = 0; j < d; ++j) x.data()[static_cast<int64_t>(i) * d + j] = table.at({vocab[tokens[i]], j});
  return x;
}

// What every section runs on.
struct Input {
  bool book = true;  // the book's sentence and numbers
  std::vector<std::string> tokens;
  Tensor x;          // (T, d_in)
  int64_t d_in = 3, d_out = 2;
  uint64_t seed = 123;
  std::string how;   // a sentence saying where X came from
};

Input resolve_input(const DemoOptions& o) {
  Input in;
  in.seed = o.seed.value_or(123);
  in.d_out = o.d_out.value_or(in.d_out);
  in.d_in = o.d_in.value_or(in.d_in);
  if (in.d_in < 1 || in.d_in > kMaxWidth || in.d_out < 1 || in.d_out > kMaxWidth) {
    throw UsageError("--d-in and --d-out must lie in 1…" + std::to_string(kMaxWidth) + " (got " + std::to_string(in.d_in) +
                     " and " + std::to_string(in.d_out) + ")");
  }
  if (in.d_out % 2 != 0) {
    throw UsageError("--d-out " + std::to_string(in.d_out) + " is not divisible by num_heads = 2 (the multi-head "
                     "section splits d_out between two heads); choose an even --d-out");
  }
  if (!o.embeddings.empty()) {
    in.book = false;
    in.tokens = split_words(o.tokens);
    if (in.tokens.empty()) throw UsageError("--embeddings needs --tokens \"w1 w2 …\": one word per row of the array");
    Tensor x = io::load_npy(o.embeddings);
    if (x.rank() != 2) throw UsageError(o.embeddings + ": needs a 2-D array (tokens × d_in), got shape " + x.shape().str());
    if (x.size(0) != static_cast<int64_t>(in.tokens.size())) {
      throw UsageError(o.embeddings + " has " + std::to_string(x.size(0)) + " rows but --tokens names " +
                       std::to_string(in.tokens.size()) + " tokens; give one token per row");
    }
    if (o.d_in && *o.d_in != x.size(1)) {
      throw UsageError("--d-in " + std::to_string(*o.d_in) + " differs from the " + std::to_string(x.size(1)) +
                       " columns of " + o.embeddings);
    }
    in.d_in = x.size(1);
    if (in.d_in > kMaxWidth) throw UsageError(o.embeddings + ": at most " + std::to_string(kMaxWidth) + " columns");
    for (float v : x.values())
      if (!std::isfinite(v)) throw UsageError(o.embeddings + ": holds NaN or infinite values; give finite embeddings");
    in.x = x;
    in.how = "embeddings from " + o.embeddings;
  } else if (o.sentence_given) {
    in.book = false;
    in.tokens = split_words(o.sentence);
    if (in.tokens.empty()) throw UsageError("--sentence is empty; give at least one word, e.g. --sentence \"the fat cat\"");
    Generator gen(in.seed);
    in.x = word_embeddings(in.tokens, in.d_in, gen);
    in.how = "one random " + std::to_string(in.d_in) + "-d vector per distinct word, drawn with randn after "
             "torch.manual_seed(" + std::to_string(in.seed) + ")";
  } else {
    if (o.d_in || o.d_out) {
      throw UsageError("--d-in and --d-out go with --sentence or --embeddings; the book's example is 3 → 2");
    }
    in.tokens = kJourney;
    in.x = journey_inputs();
    in.how = "the book's 3-d embeddings";
  }
  if (static_cast<int64_t>(in.tokens.size()) > kMaxTokens) {
    throw UsageError("the demo shows at most " + std::to_string(kMaxTokens) + " tokens (their matrices must fit a "
                     "screen); got " + std::to_string(in.tokens.size()));
  }
  if (!in.book && in.tokens.size() < 2) throw UsageError("give at least two tokens, so one can attend to another");
  return in;
}

void heading(std::ostream& out, const std::string& title) {
  out << "\n" << std::string(78, '=') << "\n" << title << "\n" << std::string(78, '=') << "\n";
}

std::vector<std::string> dims(const char* prefix, int64_t n) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i + 1));
  return out;
}

// Writes a heatmap into --pictures DIR (when given), in the chosen format, and says where. The colour scale: by
// default each picture's own largest weight, except where pictures are compared (before and after training: 0 … 1);
// --color-scale fixed puts every one on 0 … 1 (dropout's kept weights, doubled, on 0 … 2), auto each on its own.
class Pictures {
 public:
  Pictures(const std::string& dir, const viz::PictureOptions& options, const std::string& scale)
      : dir_(dir), options_(options), scale_(scale) {
    if (dir_.empty()) return;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) throw IoError(dir_ + ": cannot create the picture directory: " + ec.message());
  }
  bool on() const { return !dir_.empty(); }
  // The colour scale's top: `fixed` (the largest weight there can be) or 0, the picture's own largest.
  double vmax(bool fixed_by_default, double fixed = 1.0) const {
    return scale_ == "fixed" || (scale_.empty() && fixed_by_default) ? fixed : 0.0;
  }
  void heatmap(std::ostream& out, const std::string& stem, const std::string& title, const Tensor& weights,
               const std::vector<std::string>& tokens, bool fixed_by_default = false,
               std::function<bool(int64_t, int64_t)> masked = {}, double fixed = 1.0) {
    if (!on()) return;
    viz::HeatmapStyle style;
    style.title = title;
    style.row_labels = style.col_labels = tokens;
    style.vmax = vmax(fixed_by_default, fixed);
    style.masked = std::move(masked);
    const std::string path = picture(stem);
    viz::save_heatmap(path, weights, style, options_);
    out << "  [picture: " << path << "]\n";
  }
  std::string path(const std::string& file) const { return dir_ + "/" + file; }
  std::string picture(const std::string& stem) const { return viz::picture_path(dir_ + "/" + stem, options_); }
  const viz::PictureOptions& options() const { return options_; }

 private:
  std::string dir_;
  viz::PictureOptions options_;
  std::string scale_;  // "", "fixed" or "auto"
};

double entropy_bits(const Tensor& row) {
  double h = 0.0;
  for (float p : row.values())
    if (p > 0) h -= p * std::log2(static_cast<double>(p));
  return h;
}

Tensor row_of(const Tensor& m, int64_t r) {
  return Tensor::from(std::span<const float>(m.data() + r * m.size(1), static_cast<size_t>(m.size(1))), {1, m.size(1)});
}

// Prints every intermediate of one forward pass with token labels, counting the five products and the transpose.
void walk_through(std::ostream& out, const nn::AttentionTrace& t, const Input& in, const DemoOptions& options) {
  const viz::Style style{4, options.color};
  const int64_t d_out = t.queries.size(-1);
  const auto cols = dims("c", d_out);
  const auto& tok = in.tokens;
  out << "\n" << viz::matrix("Q = X·Wq   queries            (matrix product 1 of 5)", t.queries, tok, cols, style);
  out << "\n" << viz::matrix("K = X·Wk   keys               (matrix product 2 of 5)", t.keys, tok, cols, style);
  out << "\n" << viz::matrix("V = X·Wv   values             (matrix product 3 of 5)", t.values, tok, cols, style);
  out << "\n" << viz::matrix("Kᵀ   keys transposed (the one transpose): a column per token", transpose(t.keys, -2, -1),
                             cols, tok, style);
  out << "\n" << viz::matrix("Ω = Q·Kᵀ   attention scores   (matrix product 4 of 5; row i: query i against every key)",
                             t.scores, tok, tok, style);
  const std::string root = "√" + std::to_string(d_out);
  out << "\n" << viz::matrix("Ω / " + root + "   scaled scores (c = d_out = " + std::to_string(d_out) + ")",
                             div(t.scores, std::sqrt(static_cast<float>(d_out))), tok, tok, style);
  out << "\n" << viz::matrix("A = softmax(Ω / " + root + ")   attention weights, by rows", t.weights, tok, tok, style,
                             /*row_sums=*/true);
  out << "\n" << viz::heatmap("What attends to what", t.weights, tok, style);
  out << "\n" << viz::matrix("C = A·V   context vectors    (matrix product 5 of 5)", t.context, tok, cols, style);
  out << "\nFive matrix products and one transpose: every token's context vector mixes in the values of the\n"
         "tokens it attends to, in the proportions of its row of A.\n";
}

// Why divide by √c: the same scores with and without the scaling, at a width where it matters.
void scaling_illustration(std::ostream& out, uint64_t seed) {
  const int64_t c = 64, T = 6;
  Generator gen(seed);
  const Tensor q = gen.randn({T, c}), k = gen.randn({T, c});
  const Tensor scores = matmul(q, transpose(k, -2, -1));
  const Tensor raw = softmax(scores), scaled = softmax(div(scores, std::sqrt(static_cast<float>(c))));
  const viz::Style style{4, false};
  out << "\nWhy divide by √c? With c = " << c << ", random queries and keys give scores whose spread grows like √c = "
      << std::sqrt(static_cast<double>(c)) << ".\nThe same scores of query 1, softmaxed without and with the scaling:\n\n";
  out << viz::matrix("softmax(ω₁)        without scaling", row_of(raw, 0), {"weights"}, dims("k", T), style);
  out << viz::matrix("softmax(ω₁ / √64)  with scaling", row_of(scaled, 0), {"weights"}, dims("k", T), style);
  char line[200];
  std::snprintf(line, sizeof line,
                "entropy: %.2f bits without scaling, %.2f bits with it (%.2f bits = all %lld keys alike).\n",
                entropy_bits(row_of(raw, 0)), entropy_bits(row_of(scaled, 0)), std::log2(static_cast<double>(T)),
                static_cast<long long>(T));
  out << line
      << "Unscaled, the softmax is nearly a step function: almost all weight on one key, so its gradient almost\n"
         "vanishes and training stalls; dividing by √c keeps the scores' spread near 1 whatever the width.\n";
}

void section_v1(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "1. SelfAttention_v1 — raw parameter matrices, torch.manual_seed(" + std::to_string(in.book ? 123 : in.seed) + ")");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size());
  if (in.book) {
    out << "Input: \"Your journey starts with one step\", one 3-d embedding per token (n = 6, d = 3).\n\n";
  } else {
    out << "Input: \"" << [&] { std::string s; for (const auto& w : in.tokens) s += (s.empty() ? "" : " ") + w; return s; }()
        << "\", n = " << T << " tokens, d = " << in.d_in << ": " << in.how << ".\n\n";
  }
  out << viz::matrix("X   input embeddings", in.x, in.tokens, dims("x", in.d_in), style);

  manual_seed(in.book ? 123 : in.seed);
  nn::SelfAttentionV1 attention(in.d_in, in.d_out);
  out << "\nThree trainable d×c = " << in.d_in << "×" << in.d_out
      << " matrices, drawn with torch.rand in the order query, key, value:\n\n";
  out << viz::matrix("Wq  W_query", attention.W_query, dims("x", in.d_in), dims("c", in.d_out), style) << "\n";
  out << viz::matrix("Wk  W_key", attention.W_key, dims("x", in.d_in), dims("c", in.d_out), style) << "\n";
  out << viz::matrix("Wv  W_value", attention.W_value, dims("x", in.d_in), dims("c", in.d_out), style);

  const nn::AttentionTrace t = attention.trace(in.x);
  walk_through(out, t, in, options);
  pictures.heatmap(out, "01-v1-A", "SelfAttention_v1: A = softmax(QK\u1d40 / \u221a" + std::to_string(in.d_out) + ")",
                   t.weights, in.tokens);
  if (in.book) {
    // The numbers the book prints on the way, for x⁽²⁾ = "journey".
    char line[256];
    std::snprintf(line, sizeof line, "\nThe book, token 2 (\"journey\"): query_2 = [%.4f, %.4f];  ω₂₂ = %.4f\n",
                  t.queries.at({1, 0}), t.queries.at({1, 1}), t.scores.at({1, 1}));
    out << line << "attention weights of x⁽²⁾:\n";
    std::vector<float> row;
    for (int64_t j = 0; j < T; ++j) row.push_back(t.weights.at({1, j}));
    out << viz::bars(row, in.tokens);
  }
  scaling_illustration(out, in.seed);
}

void section_v2(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  const uint64_t seed = in.book ? 789 : in.seed;
  heading(out, "2. SelfAttention_v2 — nn.Linear projections, torch.manual_seed(" + std::to_string(seed) + ")");
  const viz::Style style{4, options.color};
  manual_seed(seed);
  nn::SelfAttentionV2 attention(in.d_in, in.d_out);
  out << "Linear stores its weight as (out, in) = " << in.d_out << "×" << in.d_in
      << " and computes x·Wᵀ, so the Wq of Q = X·Wq is W_query.weightᵀ (" << in.d_in << "×" << in.d_out
      << ").\nnn.Linear's initialisation (kaiming-uniform) gives smaller, centred weights than torch.rand.\n\n";
  out << viz::matrix("Wq = W_query.weightᵀ", transpose(attention.W_query.weight, 0, 1), dims("x", in.d_in),
                     dims("c", in.d_out), style) << "\n";
  out << viz::matrix("Wk = W_key.weightᵀ", transpose(attention.W_key.weight, 0, 1), dims("x", in.d_in),
                     dims("c", in.d_out), style) << "\n";
  out << viz::matrix("Wv = W_value.weightᵀ", transpose(attention.W_value.weight, 0, 1), dims("x", in.d_in),
                     dims("c", in.d_out), style);
  const nn::AttentionTrace t = attention.trace(in.x);
  walk_through(out, t, in, options);
  pictures.heatmap(out, "02-v2-A", "SelfAttention_v2: A = softmax(QK\u1d40 / \u221a" + std::to_string(in.d_out) + ")",
                   t.weights, in.tokens);
}

// Which token learns to attend to which: the book's cat → fat; for the learner's input --attend QUERY,KEY, else
// cat → fat when both are there, else the last token → the first.
struct TrainSetup {
  std::vector<std::string> tokens;
  Tensor x;
  int64_t query = 0, key = 0;
  int64_t d = 0;
};

// A token of --attend: a word (its first occurrence) or a 1-based position.
int64_t find_token(const std::vector<std::string>& tokens, const std::string& word, const char* role) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] == word) return static_cast<int64_t>(i);
  if (!word.empty() && word.find_first_not_of("0123456789") == std::string::npos && word.size() < 4) {
    const int64_t position = std::stoll(word);
    if (position >= 1 && position <= static_cast<int64_t>(tokens.size())) return position - 1;
  }
  std::string words;
  for (const auto& t : tokens) words += (words.empty() ? "" : " ") + t;
  throw UsageError(std::string("--attend: the ") + role + " \"" + printable(word) + "\" is neither a word of the input (" +
                   printable(words) + ") nor a position 1…" + std::to_string(tokens.size()));
}

TrainSetup train_setup(const Input& in, const std::string& attend) {
  TrainSetup s;
  if (in.book) {
    s.tokens = {"the", "fat", "cat", "sat", "on", "the", "mat"};
    s.d = 4;
    // Fixed embeddings: one random 4-d vector per distinct word (seed 123); Wq, Wk, Wv are drawn next.
    manual_seed(123);
    s.x = word_embeddings(s.tokens, s.d, default_generator());
  } else {
    s.tokens = in.tokens, s.x = in.x, s.d = in.d_in;
  }
  if (!attend.empty()) {
    const size_t comma = attend.find(',');
    if (comma == std::string::npos)
      throw UsageError("--attend takes QUERY,KEY (two words or positions), e.g. --attend cat,fat; got \"" +
                       printable(attend) + "\"");
    s.query = find_token(s.tokens, attend.substr(0, comma), "query");
    s.key = find_token(s.tokens, attend.substr(comma + 1), "key");
    return s;  // a word may learn to attend to itself
  }
  const auto cat = std::find(s.tokens.begin(), s.tokens.end(), "cat"), fat = std::find(s.tokens.begin(), s.tokens.end(), "fat");
  if (cat != s.tokens.end() && fat != s.tokens.end()) {  // the book's pair, when the sentence has both
    s.query = cat - s.tokens.begin();
    s.key = fat - s.tokens.begin();
  } else {  // else the last word learns to attend to the first
    s.query = static_cast<int64_t>(s.tokens.size()) - 1;
    s.key = 0;
  }
  return s;
}

void section_train(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  TrainSetup s = train_setup(in, options.attend);
  const std::string& qname = s.tokens[static_cast<size_t>(s.query)];
  const std::string& kname = s.tokens[static_cast<size_t>(s.key)];
  heading(out, "3. Training Wq, Wk, Wv — make \"" + qname + "\" attend to \"" + kname + "\"");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(s.tokens.size());
  if (!in.book) manual_seed(in.seed);  // the book's run continues from the embedding table's draws
  nn::SelfAttentionV1 attention(s.d, s.d);
  if (in.book) {
    out << "Sentence: \"the fat cat sat on the mat\"; fixed 4-d embeddings; SelfAttention_v1(4, 4).\n";
  } else {
    out << "Your input, SelfAttention_v1(" << s.d << ", " << s.d << "), starting from torch.manual_seed(" << in.seed << ").\n";
  }
  out << "Loss: −log A[" << qname << ", " << kname << "], the cross-entropy of " << qname
      << "'s attention row against the key \"" << kname << "\".\n\n";
  out << viz::matrix("X   embeddings (fixed)", s.x, s.tokens, dims("x", s.d), style);

  auto weights_now = [&]() {
    NoGradGuard no_grad;
    return attention.trace(s.x).weights;
  };
  auto query_row = [&](const Tensor& w) {
    std::vector<float> row;
    for (int64_t j = 0; j < T; ++j) row.push_back(w.at({s.query, j}));
    return row;
  };
  const Tensor before = weights_now();
  out << "\nBefore training, \"" << qname << "\" attends to:\n" << viz::bars(query_row(before), s.tokens);
  pictures.heatmap(out, "03-train-A-before", "Before training: A", before, s.tokens, true);
  viz::HeatmapStyle anim_style;
  anim_style.title = "Training: \"" + qname + "\" learns to attend to \"" + kname + "\"";
  anim_style.row_labels = anim_style.col_labels = s.tokens;
  viz::HeatmapAnimation animation(anim_style);

  optim::AdamW optimizer(attention.named_parameters(), {.lr = 0.05});
  std::vector<int64_t> targets(static_cast<size_t>(T), -100);  // only the query's row has a target
  targets[static_cast<size_t>(s.query)] = s.key;
  out << "\nAdamW, lr = 0.05:\n";
  const Tensor w_value_before = attention.W_value.clone();
  // At most kMaxSteps optimiser steps; the animation keeps the first ten and then every tenth (and the last), so a
  // run that never meets its goal writes ~60 frames, not 501.
  constexpr int kMaxSteps = 500;
  int step = 0;  // optimiser steps taken so far
  bool done = false;
  float attention_to_key = 0.0f;
  int64_t best = 0;
  for (;; ++step) {
    optimizer.zero_grad();
    const nn::AttentionTrace t = attention.trace(s.x);
    const Tensor loss = cross_entropy(div(t.scores, std::sqrt(static_cast<float>(s.d))), targets);
    attention_to_key = t.weights.at({s.query, s.key});
    best = 0;
    for (int64_t j = 1; j < T; ++j)
      if (t.weights.at({s.query, j}) > t.weights.at({s.query, best})) best = j;
    done = best == s.key && attention_to_key >= 0.5f;
    const bool last = done || step == kMaxSteps;
    char line[200];
    std::snprintf(line, sizeof line, "  step %3d   loss %.4f   A[%s, %s] = %.4f%s\n", step, loss.item(), qname.c_str(),
                  kname.c_str(), attention_to_key, done ? ("   ← " + qname + " now attends most to " + kname).c_str() : "");
    if (step < 5 || step % 10 == 0 || last) out << line;
    if (pictures.on() && (step < 10 || step % 10 == 0 || last)) {
      char caption[120];
      std::snprintf(caption, sizeof caption, "step %d   loss %.3f   A[%s, %s] = %.2f", step, loss.item(),
                    qname.c_str(), kname.c_str(), attention_to_key);
      animation.add_frame(t.weights.detach(), caption);
    }
    if (last) break;
    loss.backward();
    optimizer.step();
  }
  const Tensor after = weights_now();
  out << "\nAfter " << step << " steps, \"" << qname << "\" attends to:\n" << viz::bars(query_row(after), s.tokens);
  if (!done) {
    // Say so, and why it can happen: the score of key j is x_j·u for one vector u (u = Wk·Wqᵀ·x_q), so only a key
    // whose embedding is a corner of all the keys' convex hull can ever get the largest weight, and a repeated word
    // (the same embedding) shares its weight with its copies.
    const int64_t copies = std::count(s.tokens.begin(), s.tokens.end(), kname);
    char line[160];
    std::snprintf(line, sizeof line, "A[%s, %s] = %.4f; the largest weight is on \"%s\"", qname.c_str(), kname.c_str(),
                  attention_to_key, s.tokens[static_cast<size_t>(best)].c_str());
    out << "\nThe goal (\"" << qname << "\" attending most to \"" << kname << "\", with a weight of at least 0.5) was not "
        << "reached in " << kMaxSteps << " steps:\n" << line << ".\n";
    if (copies > 1)
      out << "\"" << kname << "\" appears " << copies << " times with one embedding, so its copies share the weight "
          << "equally.\nChoose another key with --attend QUERY,KEY.\n";
    else
      out << "A key's score is its embedding's dot product with one vector, so with " << T << " words in d = " << s.d
          << " dimensions\na word whose embedding lies inside the others' can never win. Give more dimensions "
          << "(--d-in), fewer words,\nor another pair (--attend QUERY,KEY).\n";
  }
  pictures.heatmap(out, "03-train-A-after", "After " + std::to_string(step) + " steps: A", after, s.tokens, true);
  if (pictures.on()) {
    animation.save_gif(pictures.path("03-train-A-steps.gif"), 12);
    out << "  [animation: " << pictures.path("03-train-A-steps.gif") << ", " << animation.frames() << " frames: "
        << (step < 10 ? "every step" : "the first ten steps, then every tenth") << "]\n";
  }
  float change = 0.0f;
  for (int64_t i = 0; i < attention.W_value.numel(); ++i)
    change = std::max(change, std::fabs(attention.W_value.data()[i] - w_value_before.data()[i]));
  out << "\n" << (change == 0.0f ? std::string("W_value did not change")
                                 : "W_value changed by at most " + format_real(std::round(change * 1e4) / 1e4))
      << ": the loss looks only at who attends to whom, which Wq and Wk decide;\n"
         "the values decide what is passed along once attention is paid.\n";
}

Tensor batch_of_two(const Tensor& x) {
  const Tensor one = reshape(x, {1, x.size(0), x.size(1)});
  return concat({one, one}, 0);  // torch.stack((inputs, inputs)): batch of 2
}

void print_batch_row(std::ostream& out, const std::string& title, const Tensor& batched, const Input& in,
                     const viz::Style& style) {
  out << "\n" << title << ", output shape " << batched.shape().str() << "; batch row 0:\n";
  const Tensor first = reshape(batched, {batched.size(0), batched.size(1) * batched.size(2)});
  out << viz::matrix("context vectors", top_left(first, 1, batched.size(1) * batched.size(2)).view_as_shape(
                                            {batched.size(1), batched.size(2)}),
                     in.tokens, dims("c", batched.size(2)), style);
}

Tensor causal_weights(const Tensor& scores, int64_t d_out) {
  return softmax(div(masked_fill(scores, causal_mask(scores.size(0)), -INFINITY), std::sqrt(static_cast<float>(d_out))));
}

void section_causal(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "4. Causal attention — a token may not look at the tokens after it");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size());
  manual_seed(in.book ? 789 : in.seed);
  nn::SelfAttentionV2 attention(in.d_in, in.d_out);
  const nn::AttentionTrace t = attention.trace(in.x);
  out << "SelfAttention_v2 with seed " << (in.book ? 789 : in.seed)
      << " again. The scores above the diagonal become −∞ before the softmax,\nso their weights are exactly 0 and every "
         "row still sums to 1:\n\n";
  const Tensor masked = masked_fill(t.scores, causal_mask(T), -INFINITY);
  out << viz::matrix("Ω masked  (−inf = the future)", masked, in.tokens, in.tokens, style);
  const Tensor weights = causal_weights(t.scores, in.d_out);
  out << "\n" << viz::matrix("A = softmax(Ω_masked / √" + std::to_string(in.d_out) + ")", weights, in.tokens, in.tokens,
                             style, true);
  out << "\n" << viz::heatmap("What attends to what, causally", weights, in.tokens, style);
  pictures.heatmap(out, "04-causal-A", "Causal: A = softmax(masked QK\u1d40 / \u221a" + std::to_string(in.d_out) + ")",
                   weights, in.tokens, false, viz::causal_cells());
  manual_seed(in.book ? 123 : in.seed);
  nn::CausalAttention causal(in.d_in, in.d_out, T, 0.0);
  print_batch_row(out, "CausalAttention(" + std::to_string(in.d_in) + ", " + std::to_string(in.d_out) +
                           ", context_length=" + std::to_string(T) + ", dropout=0.0), torch.manual_seed(" +
                           std::to_string(in.book ? 123 : in.seed) + ")",
                  causal(batch_of_two(in.x)), in, style);
}

void section_dropout(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "5. Dropout on the attention weights — only while training");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size());
  manual_seed(123);
  const Tensor dropped = dropout(Tensor::ones({T, T}), 0.5, true, default_generator());
  out << "torch.manual_seed(123); Dropout(0.5) on a " << T << "×" << T
      << " matrix of ones: about half the entries become 0,\nthe rest are scaled by 1/(1 − 0.5) = 2 so the expected sum "
         "stays the same:\n\n";
  out << viz::matrix("dropout(ones(" + std::to_string(T) + ", " + std::to_string(T) + "))", dropped, {}, {}, style);
  manual_seed(in.book ? 789 : in.seed);
  nn::SelfAttentionV2 attention(in.d_in, in.d_out);
  const Tensor weights = causal_weights(attention.trace(in.x).scores, in.d_out);
  manual_seed(123);
  out << "\nThe same on the causal weights of section 4, reseeded with 123 (as the book does):\n\n";
  const Tensor dropped_weights = dropout(weights, 0.5, true, default_generator());
  out << viz::matrix("dropout(A_causal)", dropped_weights, in.tokens, in.tokens, style, true);
  pictures.heatmap(out, "05-dropout-A", "Dropout(0.5) on the causal A (training only)", dropped_weights, in.tokens, false,
                   viz::causal_cells(), 2.0);
  out << "In eval() mode, or with dropout = 0, the weights pass through untouched and no random numbers are drawn.\n";
}

void section_mha(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "6. Multi-head attention");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size());
  const uint64_t seed = in.book ? 123 : in.seed;
  const std::string args = std::to_string(in.d_in) + ", " + std::to_string(in.d_out) + ", " + std::to_string(T) + ", 0.0";
  manual_seed(seed);
  nn::MultiHeadAttentionWrapper wrapper(in.d_in, in.d_out, T, 0.0, 2);
  out << "MultiHeadAttentionWrapper: two CausalAttention heads side by side, outputs concatenated.\n"
         "Head 1 is the CausalAttention above (same seed, same draws); head 2 adds " << in.d_out << " more columns.\n";
  const Tensor batch = batch_of_two(in.x);
  print_batch_row(out, "MultiHeadAttentionWrapper(" + args + ", num_heads=2), seed " + std::to_string(seed), wrapper(batch),
                  in, style);
  for (size_t h = 0; h < wrapper.heads.size(); ++h) {
    const Tensor w = wrapper.heads[h]->trace(in.x).weights;
    pictures.heatmap(out, "06-wrapper-head" + std::to_string(h + 1),
                     "MultiHeadAttentionWrapper, head " + std::to_string(h + 1) + ": A", w, in.tokens, false,
                     viz::causal_cells());
  }
  manual_seed(seed);
  nn::MultiHeadAttention mha(in.d_in, in.d_out, T, 0.0, 2);
  out << "\nMultiHeadAttention: one projection of width d_out split into 2 heads of head_dim = " << in.d_out / 2
      << ",\nviewed as (B, H, T, D) = (2, 2, " << T << ", " << in.d_out / 2
      << "), attended per head, merged back and passed through out_proj.\n";
  const nn::AttentionTrace t = mha.trace(batch);
  print_batch_row(out, "MultiHeadAttention(" + args + ", num_heads=2), seed " + std::to_string(seed), t.context, in, style);
  std::vector<viz::HeatmapPanel> panels;
  for (int64_t h = 0; h < 2; ++h) {
    const Tensor rows = Tensor::from(std::span<const float>(t.weights.data() + h * T * T, static_cast<size_t>(T * T)), {T, T});
    out << "\n" << viz::heatmap("Head " + std::to_string(h + 1) + " weights (batch row 0)", rows, in.tokens, style);
    pictures.heatmap(out, "06-mha-head" + std::to_string(h + 1),
                     "MultiHeadAttention, head " + std::to_string(h + 1) + ": A", rows, in.tokens, false,
                     viz::causal_cells());
    panels.push_back({"head " + std::to_string(h + 1), rows, viz::causal_cells()});
  }
  if (pictures.on()) {
    viz::save_heatmap_grid(pictures.picture("06-mha-heads"), "MultiHeadAttention: both heads", panels, 2, in.tokens,
                           pictures.vmax(false), pictures.options());
    out << "  [picture: " << pictures.picture("06-mha-heads") << "]\n";
  }
}

// gpt-oss's attention sinks on the causal attention of section 4: one more logit in every row's softmax, with no
// value, so a row can give part of its weight to nothing. Run through the fused kernel (scaled_dot_product_attention
// with AttentionConfig::sinks) and its weights recomputed from the log-sum-exp, which includes the sink.
void section_sinks(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "7. Attention sinks (gpt-oss) — a logit with no value in every row's softmax");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size());
  manual_seed(in.book ? 789 : in.seed);
  nn::SelfAttentionV2 attention(in.d_in, in.d_out);
  const nn::AttentionTrace t = attention.trace(in.x);
  const float sink = 1.0f;  // gpt-oss learns one per head; here a fixed 1.0 for the picture
  AttentionConfig config;
  config.num_heads = 1;
  config.causal = true;
  config.sinks = Tensor::from(std::span<const float>(&sink, 1), {1});
  Tensor lse;
  config.lse = &lse;
  const Tensor q = reshape(t.queries, {1, T, in.d_out}), k = reshape(t.keys, {1, T, in.d_out});
  const Tensor context = scaled_dot_product_attention(q, k, reshape(t.values, {1, T, in.d_out}), config);
  const Tensor weights = attention_weights(q, k, lse, config, 0, 0);  // (T, T): rows sum to 1 − the sink's share
  out << "SelfAttention_v2 (seed " << (in.book ? 789 : in.seed) << ") as in section 4, with a sink logit s = " << sink
      << " added to\nevery row's softmax denominator: A_ij = exp(ω_ij/√" << in.d_out << ") / (Σ_l exp(ω_il/√"
      << in.d_out << ") + exp(s)).\nThe sink carries no value, so what it takes is simply missing from the context "
         "vector:\n\n";
  out << viz::matrix("A with a sink (row sums < 1)", weights, in.tokens, in.tokens, style, true);
  Tensor share = Tensor::empty({T, 1});
  int64_t most = 0;
  for (int64_t i = 0; i < T; ++i) {
    share.data()[i] = std::exp(sink - lse.data()[i]);
    if (share.data()[i] > share.data()[most]) most = i;
  }
  out << "\n" << viz::matrix("the sink's share exp(s − lse)", share, in.tokens, {"sink"}, style);
  out << "'" << in.tokens[static_cast<size_t>(most)] << "' gives the sink the most: the fewer and weaker the keys a row "
      << "sees, the larger the sink's part\nof its denominator (trained models use it to attend to nothing).\n";
  out << "\n" << viz::matrix("context = A V (the sink adds nothing)", reshape(context, {T, in.d_out}), in.tokens,
                             dims("c", in.d_out), style);
  pictures.heatmap(out, "07-sinks-A", "Causal A with a sink logit of 1 (rows sum to less than 1)", weights, in.tokens, 1.0);
}

// A mixture of experts on the section's inputs: a router scores 4 experts per token, the top 2 are kept and their
// weights renormalised (Qwen3-MoE), and each token's output is the weighted sum of its two experts' outputs.
void section_moe(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "8. Mixture of experts — each token goes to the 2 of 4 experts its router picks");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size()), C = in.d_in, E = 4, F = 4;
  manual_seed(in.book ? 123 : in.seed);
  Generator& gen = default_generator();
  auto draw = [&](Shape shape) {
    Tensor w = Tensor::empty(shape);
    gen.normal_(w, 0.0, 1.0);
    return w;
  };
  const Tensor router = draw({E, C});
  std::vector<Tensor> gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    gate.push_back(draw({F, C}));
    up.push_back(draw({F, C}));
    down.push_back(draw({C, F}));
  }
  std::vector<int32_t> chosen;
  std::vector<float> chosen_weights;
  MoeConfig config;
  config.experts_per_token = 2;
  config.norm_topk_prob = true;
  config.chosen = &chosen;
  config.weights = &chosen_weights;
  const Tensor y = mixture_of_experts(in.x, router, gate, up, down, config);
  const std::vector<std::string> experts = dims("e", E);
  out << "Router W_r (" << E << " × " << C << ") and four SwiGLU experts of width " << F << ", drawn with randn after "
      << "torch.manual_seed(" << (in.book ? 123 : in.seed) << ").\np = softmax(W_r x) per token; the two largest are "
      << "kept and divided by their sum:\n\n";
  out << viz::matrix("p = softmax(x W_rᵀ)", softmax(linear(in.x, router, Tensor())), in.tokens, experts, style, true);
  Tensor routed = Tensor::zeros({T, E});  // each token's weight on its two experts, 0 elsewhere
  for (int64_t i = 0; i < T; ++i)
    for (int64_t s = 0; s < 2; ++s)
      routed.data()[i * E + chosen[static_cast<size_t>(i * 2 + s)]] = chosen_weights[static_cast<size_t>(i * 2 + s)];
  out << "\n" << viz::matrix("routing weights (top-2, renormalised)", routed, in.tokens, experts, style, true);
  int64_t idle = 0;
  for (int64_t e = 0; e < E; ++e)
    if (std::find(chosen.begin(), chosen.end(), static_cast<int32_t>(e)) == chosen.end()) ++idle;
  out << "\nEach token ran 2 of the 4 experts: half the expert parameters per token"
      << (idle > 0 ? ", and " + std::to_string(idle) + " expert(s) no token chose cost nothing" : std::string()) << ".\n\n";
  out << viz::matrix("y = Σ_s w_s · expert_s(x)", y, in.tokens, dims("c", C), style);
  if (pictures.on()) {
    viz::HeatmapStyle picture;
    picture.title = "Which expert each token was routed to (weights, top-2 of 4)";
    picture.row_labels = in.tokens;
    picture.col_labels = experts;
    picture.row_axis = "token";
    picture.col_axis = "expert";
    picture.vmax = 1.0;
    viz::save_heatmap(pictures.picture("08-moe-routing"), routed, picture, pictures.options());
    out << "  [picture: " << pictures.picture("08-moe-routing") << "]\n";
  }
}

// Grouped-query attention (Llama 3, Qwen, Gemma): 4 query heads share 2 key/value heads, so the cache holds half the
// keys and values of multi-head attention. Run through the fused kernel (num_kv_heads) and each head's weights
// recomputed from its log-sum-exp.
void section_gqa(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "9. Grouped-query attention — 4 query heads share 2 key/value heads");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size()), H = 4, H_kv = 2, D = 2;
  manual_seed(in.book ? 123 : in.seed);
  Generator& gen = default_generator();
  const Tensor wq = gen.randn({in.d_in, H * D}), wk = gen.randn({in.d_in, H_kv * D}), wv = gen.randn({in.d_in, H_kv * D});
  const Tensor q = matmul(in.x, wq), k = matmul(in.x, wk), v = matmul(in.x, wv);
  out << "W_q (" << in.d_in << " × " << H * D << "), W_k and W_v (" << in.d_in << " × " << H_kv * D << "), drawn with randn after "
      << "torch.manual_seed(" << (in.book ? 123 : in.seed) << "): head_dim " << D << ",\n"
      << H << " query heads but only " << H_kv << " key/value heads. Query heads 1 and 2 read K/V head 1, heads 3 and 4 "
      << "read K/V head 2\n(head h reads K/V head ⌊h·" << H_kv << "/" << H << "⌋: repeat_kv, without copying).\n\n";
  std::vector<std::string> kv_cols;
  for (int64_t g = 0; g < H_kv; ++g)
    for (int64_t d = 0; d < D; ++d) kv_cols.push_back("g" + std::to_string(g + 1) + "." + std::to_string(d + 1));
  out << viz::matrix("K = X·W_k   (the cached keys: 2 heads of 2)", k, in.tokens, kv_cols, style);
  out << "\n" << viz::matrix("V = X·W_v   (the cached values)", v, in.tokens, kv_cols, style);
  AttentionConfig config;
  config.num_heads = H;
  config.num_kv_heads = H_kv;
  config.causal = true;
  Tensor lse;
  config.lse = &lse;
  const Tensor q3 = reshape(q, {1, T, H * D}), k3 = reshape(k, {1, T, H_kv * D});
  const Tensor context = scaled_dot_product_attention(q3, k3, reshape(v, {1, T, H_kv * D}), config);
  std::vector<viz::HeatmapPanel> panels;
  for (int64_t h = 0; h < H; ++h) {
    const Tensor w = attention_weights(q3, k3, lse, config, 0, h);
    out << "\n" << viz::heatmap("head " + std::to_string(h + 1) + " (K/V head " + std::to_string(h * H_kv / H + 1) + ")", w,
                                in.tokens, style);
    panels.push_back({"head " + std::to_string(h + 1) + " · K/V " + std::to_string(h * H_kv / H + 1), w, viz::causal_cells()});
  }
  out << "\n" << viz::matrix("context (4 heads of 2, concatenated)", reshape(context, {T, H * D}), in.tokens,
                             dims("c", H * D), style);
  out << "\nThe cache per token and layer: multi-head attention would keep 2 · " << H << " · " << D << " = " << 2 * H * D
      << " values, grouped-query keeps 2 · " << H_kv << " · " << D << " = " << 2 * H_kv * D << ".\n"
      << "At Llama-3-8B's scale (32 heads on 8 K/V heads of 128, 32 layers, 32,768 tokens, bf16) `qkv memory` prints "
         "the book's\n17.18 GB for MHA against 4.29 GB for GQA.\n";
  if (pictures.on()) {
    viz::save_heatmap_grid(pictures.picture("09-gqa-heads"), "Grouped-query attention: 4 heads on 2 K/V heads", panels, 2,
                           in.tokens, pictures.vmax(false), pictures.options());
    out << "  [picture: " << pictures.picture("09-gqa-heads") << "]\n";
  }
}

// Sliding-window attention (Mistral, Gemma, gpt-oss): each query sees only its last W keys, so a layer's cache holds W
// tokens whatever the context. The causal attention of section 4 with a window of 3.
void section_swa(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "10. Sliding-window attention — each token sees only its last 3");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size()), W = 3;
  manual_seed(in.book ? 789 : in.seed);
  nn::SelfAttentionV2 attention(in.d_in, in.d_out);
  const nn::AttentionTrace t = attention.trace(in.x);
  const Tensor q = reshape(t.queries, {1, T, in.d_out}), k = reshape(t.keys, {1, T, in.d_out});
  const Tensor v = reshape(t.values, {1, T, in.d_out});
  auto weights_of = [&](int64_t window) {
    AttentionConfig config;
    config.num_heads = 1;
    config.causal = true;
    config.window = window;
    Tensor lse;
    config.lse = &lse;
    const Tensor context = scaled_dot_product_attention(q, k, v, config);
    return std::pair{attention_weights(q, k, lse, config, 0, 0), reshape(context, {T, in.d_out})};
  };
  const auto [causal, causal_context] = weights_of(0);
  const auto [windowed, windowed_context] = weights_of(W);
  out << "SelfAttention_v2 (seed " << (in.book ? 789 : in.seed) << ") as in section 4. Causal: query i sees keys 1 … i. "
      << "With a window of " << W << ": keys i − " << W - 1 << " … i,\nand the weight the older keys had goes to the "
      << W << " that remain (each row still sums to 1):\n\n";
  out << viz::matrix("A, causal", causal, in.tokens, in.tokens, style, true);
  out << "\n" << viz::matrix("A, causal with a window of 3", windowed, in.tokens, in.tokens, style, true);
  out << "\n" << viz::matrix("context, window of 3", windowed_context, in.tokens, dims("c", in.d_out), style);
  out << "\nA layer's cache holds at most " << W << " tokens' keys and values instead of all " << T << ": the saving "
      << "grows with the context.\nGemma 3 slides on 5 layers of 6 (window 1,024); at the book's SWA settings `qkv "
         "memory` prints 3.14 GB for\nMHA+SWA and 0.78 GB for GQA+SWA against 17.18 GB for plain MHA.\n";
  pictures.heatmap(out, "10-swa-causal", "Causal attention", causal, in.tokens, false, viz::causal_cells());
  pictures.heatmap(out, "10-swa-window3", "Sliding window of 3", windowed, in.tokens, false, viz::causal_cells(W));
}

// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values are rebuilt per head from a small latent
// the cache keeps; the query can be multiplied into the latent space instead (absorption), so decoding never rebuilds
// K. Without the decoupled RoPE key here (it adds dr shared values a token), to keep the numbers few.
void section_mla(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "11. Multi-head latent attention — cache a 2-value latent, not 2 heads' keys and values");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size()), H = 2, D = 2, R = 2;
  manual_seed(in.book ? 123 : in.seed);
  Generator& gen = default_generator();
  const Tensor wq = gen.randn({in.d_in, H * D}), w_down = gen.randn({in.d_in, R});
  const Tensor w_uk = gen.randn({R, H * D}), w_uv = gen.randn({R, H * D});
  const Tensor q = matmul(in.x, wq), latent = matmul(in.x, w_down);
  const Tensor keys = matmul(latent, w_uk), values = matmul(latent, w_uv);
  out << "W_q (" << in.d_in << " × " << H * D << "), the down-projection W_dkv (" << in.d_in << " × " << R
      << ") and the up-projections W_uk, W_uv (" << R << " × " << H * D << "),\ndrawn with randn after torch.manual_seed("
      << (in.book ? 123 : in.seed) << "). Each token's cache entry is its latent c = x·W_dkv:\n\n";
  out << viz::matrix("c = X·W_dkv   (the cache: " + std::to_string(R) + " values a token)", latent, in.tokens, dims("r", R), style);
  out << "\n" << viz::matrix("K = c·W_uk   (rebuilt: 2 heads of 2)", keys, in.tokens, dims("k", H * D), style);
  out << "\n" << viz::matrix("V = c·W_uv   (rebuilt)", values, in.tokens, dims("v", H * D), style);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<viz::HeatmapPanel> panels;
  Tensor context = Tensor::empty({T, H * D});
  float largest = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    const Tensor qh = narrow(q, h * D, D), kh = narrow(keys, h * D, D), vh = narrow(values, h * D, D);
    const Tensor uk_h = narrow(w_uk, h * D, D);  // (R, D): head h's columns of W_uk
    const Tensor expanded = matmul(qh, transpose(kh, -2, -1));
    const Tensor absorbed_q = matmul(qh, transpose(uk_h, -2, -1));  // q_h·W_uk,hᵀ: the query in latent space (T × R)
    const Tensor absorbed = matmul(absorbed_q, transpose(latent, -2, -1));
    for (int64_t i = 0; i < T * T; ++i) largest = std::max(largest, std::fabs(expanded.data()[i] - absorbed.data()[i]));
    Tensor scores = mul(expanded, scale);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = i + 1; j < T; ++j) scores.data()[i * T + j] = -INFINITY;
    const Tensor a = softmax(scores);
    const Tensor ch = matmul(a, vh);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t d = 0; d < D; ++d) context.data()[i * H * D + h * D + d] = ch.data()[i * D + d];
    if (h == 0) {
      out << "\nHead 1's scores two ways: q·kᵀ with K rebuilt, and (q·W_ukᵀ)·cᵀ — the query carried into the latent "
             "space,\nso decoding reads the cache as it is:\n\n";
      out << viz::matrix("q₁·k₁ᵀ (expanded)", expanded, in.tokens, in.tokens, style);
      out << "\n" << viz::matrix("(q₁·W_uk,₁ᵀ)·cᵀ (absorbed)", absorbed, in.tokens, in.tokens, style);
    }
    panels.push_back({"head " + std::to_string(h + 1), a, viz::causal_cells()});
  }
  char line[160];
  std::snprintf(line, sizeof line, "\nThe two agree to %.1e (float32 rounding): the same attention, from the latent alone.\n",
                static_cast<double>(largest));
  out << line;
  out << "\n" << viz::matrix("context (2 heads of 2)", context, in.tokens, dims("c", H * D), style);
  out << "\nThe cache per token and layer: " << R << " latent values against 2 · " << H << " · " << D << " = " << 2 * H * D
      << " for multi-head attention.\nAt the book's MLA settings (latent 1,024, 24 heads, 48 layers, 8,192 tokens) `qkv "
         "memory` prints 0.81 GB against 3.25 GB.\n";
  if (pictures.on()) {
    viz::save_heatmap_grid(pictures.picture("11-mla-heads"), "Latent attention: both heads, from the latent cache", panels,
                           2, in.tokens, pictures.vmax(false), pictures.options());
    out << "  [picture: " << pictures.picture("11-mla-heads") << "]\n";
  }
}

// Gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi Linear): no attention matrix at all — a (Dk × Dv) state, decayed by
// e^g and corrected by the delta rule at each token, is read by the query. Its size is fixed, whatever the context.
void section_deltanet(std::ostream& out, const Input& in, const DemoOptions& options, Pictures& pictures) {
  heading(out, "12. Gated DeltaNet — a fixed-size state instead of a growing cache");
  const viz::Style style{4, options.color};
  const int64_t T = static_cast<int64_t>(in.tokens.size()), Dk = 2, Dv = 2;
  manual_seed(in.book ? 123 : in.seed);
  Generator& gen = default_generator();
  const Tensor wq = gen.randn({in.d_in, Dk}), wk = gen.randn({in.d_in, Dk}), wv = gen.randn({in.d_in, Dv});
  const Tensor wa = gen.randn({in.d_in, 1}), wb = gen.randn({in.d_in, 1});
  auto l2 = [&](const Tensor& m) {  // each row divided by its length (Qwen3-Next's l2norm of q and k)
    Tensor r = Tensor::empty(m.shape());
    for (int64_t i = 0; i < m.size(0); ++i) {
      double n = 1e-12;
      for (int64_t d = 0; d < m.size(1); ++d) n += static_cast<double>(m.data()[i * m.size(1) + d]) * m.data()[i * m.size(1) + d];
      for (int64_t d = 0; d < m.size(1); ++d) r.data()[i * m.size(1) + d] = static_cast<float>(m.data()[i * m.size(1) + d] / std::sqrt(n));
    }
    return r;
  };
  const Tensor q = mul(l2(matmul(in.x, wq)), 1.0f / std::sqrt(static_cast<float>(Dk))), k = l2(matmul(in.x, wk));
  const Tensor v = matmul(in.x, wv);
  Tensor g = matmul(in.x, wa), beta = matmul(in.x, wb);
  for (float& a : g.values()) a = -std::log1p(std::exp(a));  // g = −softplus(a): a decay e^g in (0, 1)
  for (float& b : beta.values()) b = 1.0f / (1.0f + std::exp(-b));  // β = σ(b): how much of the error to write
  out << "q and k are X·W_q and X·W_k divided by their length (q also by √Dk), v = X·W_v; per token a decay e^g\n"
         "(g = −softplus(x·w_a), the simplest of Qwen3-Next's −exp(A_log)·softplus(a + dt_bias))"
         " and a write strength β = σ(x·w_b),\nall drawn with randn after torch.manual_seed(" << (in.book ? 123 : in.seed)
      << "). Token by token:\n    S ← e^g·S;   S ← S + k·(β·(v − Sᵀk))ᵀ;   o = Sᵀq\n"
         "The write replaces what S recalls for k by v (the delta rule), as much as β says.\n";
  std::vector<float> S(static_cast<size_t>(Dk * Dv), 0.0f);
  Tensor o = Tensor::empty({T, Dv});
  viz::HeatmapStyle frame_style;
  frame_style.title = "Gated DeltaNet's state |S| (Dk × Dv)";
  frame_style.row_labels = dims("k", Dk);
  frame_style.col_labels = dims("v", Dv);
  frame_style.row_axis = "key dimension";
  frame_style.col_axis = "value dimension";
  viz::HeatmapAnimation animation(frame_style);
  for (int64_t t = 0; t < T; ++t) {
    const float decay = std::exp(g.data()[t]), b = beta.data()[t];
    for (float& s : S) s *= decay;
    for (int64_t j = 0; j < Dv; ++j) {
      float recalled = 0.0f;  // (Sᵀk)_j
      for (int64_t i = 0; i < Dk; ++i) recalled += S[static_cast<size_t>(i * Dv + j)] * k.data()[t * Dk + i];
      const float error = b * (v.data()[t * Dv + j] - recalled);
      for (int64_t i = 0; i < Dk; ++i) S[static_cast<size_t>(i * Dv + j)] += k.data()[t * Dk + i] * error;
    }
    for (int64_t j = 0; j < Dv; ++j) {
      float read = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) read += S[static_cast<size_t>(i * Dv + j)] * q.data()[t * Dk + i];
      o.data()[t * Dv + j] = read;
    }
    const Tensor state = Tensor::from(std::span<const float>(S), {Dk, Dv});
    char title[120];
    std::snprintf(title, sizeof title, "S after '%s' (e^g = %.3f, β = %.3f)", in.tokens[static_cast<size_t>(t)].c_str(),
                  static_cast<double>(decay), static_cast<double>(b));
    out << "\n" << viz::matrix(title, state, dims("k", Dk), dims("v", Dv), style);
    Tensor magnitude = Tensor::empty({Dk, Dv});
    for (int64_t i = 0; i < Dk * Dv; ++i) magnitude.data()[i] = std::fabs(S[static_cast<size_t>(i)]);
    animation.add_frame(magnitude, "after '" + in.tokens[static_cast<size_t>(t)] + "'");
  }
  // the same through the kernel (qkv's gated_delta_rule, the recurrent form)
  const Tensor kernel = gated_delta_rule(reshape(q, {1, T, 1, Dk}), reshape(k, {1, T, 1, Dk}), reshape(v, {1, T, 1, Dv}),
                                         reshape(g, {1, T, 1}), reshape(beta, {1, T, 1}));
  float largest = 0.0f;
  for (int64_t i = 0; i < T * Dv; ++i) largest = std::max(largest, std::fabs(kernel.data()[i] - o.data()[i]));
  out << "\n" << viz::matrix("o = Sᵀq per token", o, in.tokens, dims("o", Dv), style);
  char line[200];
  std::snprintf(line, sizeof line, "qkv's gated_delta_rule kernel gives the same outputs to %.1e.\n", static_cast<double>(largest));
  out << line
      << "The state is " << Dk << " × " << Dv << " = " << Dk * Dv << " values after any number of tokens; attention's cache "
      << "would hold 2 · " << Dk << " = " << 2 * Dk << " values per token,\n" << 2 * Dk * T << " here and growing. "
         "Qwen3-Next puts three such layers before each attention layer.\n";
  if (pictures.on()) {
    const std::string gif = pictures.path("12-deltanet-state.gif");
    animation.save_gif(gif, 80);
    out << "  [animation: " << gif << "]\n";
  }
}

}  // namespace

const std::vector<std::string>& demo_sections() {
  static const std::vector<std::string> sections = {"v1",  "v2",   "train", "causal", "dropout", "mha",
                                                      "sinks", "moe", "gqa", "swa", "mla", "deltanet"};
  return sections;
}

int run_demo(const DemoOptions& options, std::ostream& out) {
  const Input input = resolve_input(options);
  Pictures pictures(options.pictures_dir, options.pictures, options.color_scale);
  const auto& wanted = options.sections.empty() ? demo_sections() : options.sections;
  std::set<std::string> chosen(wanted.begin(), wanted.end());
  out << "qkv " << kVersion << " — trainable self-attention, step by step (Raschka, LLMs from Scratch, §3.4)\n";
  if (chosen.count("v1")) section_v1(out, input, options, pictures);
  if (chosen.count("v2")) section_v2(out, input, options, pictures);
  if (chosen.count("train")) section_train(out, input, options, pictures);
  if (chosen.count("causal")) section_causal(out, input, options, pictures);
  if (chosen.count("dropout")) section_dropout(out, input, options, pictures);
  if (chosen.count("mha")) section_mha(out, input, options, pictures);
  if (chosen.count("sinks")) section_sinks(out, input, options, pictures);
  if (chosen.count("moe")) section_moe(out, input, options, pictures);
  if (chosen.count("gqa")) section_gqa(out, input, options, pictures);
  if (chosen.count("swa")) section_swa(out, input, options, pictures);
  if (chosen.count("mla")) section_mla(out, input, options, pictures);
  if (chosen.count("deltanet")) section_deltanet(out, input, options, pictures);
  return 0;
}

Runner setup_demo(CLI::App& cmd, CommandContext&) {
  auto o = std::make_shared<DemoOptions>();
  cmd.add_option("--section", o->sections, "Show only these sections (repeatable): v1, v2, train, causal, dropout, mha, sinks, moe, gqa, swa, mla, deltanet")
      ->check(one_of(demo_sections()));
  auto force_color = std::make_shared<bool>(false), no_color = std::make_shared<bool>(false);
  auto* color_flag = cmd.add_flag("--color", *force_color, "Colour the attention grids (default: on a terminal, unless "
                                                           "NO_COLOR is set)");
  cmd.add_flag("--no-color", *no_color, "Never use colour")->excludes(color_flag);
  cmd.add_option("--pictures,--png", o->pictures_dir,
                 "Also draw every weight matrix as a heatmap in DIR (--format), and the training as a GIF")
      ->transform(folder_path());
  add_picture_options(cmd, o->pictures);
  cmd.add_option("--color-scale", o->color_scale, "The heatmaps' colours: fixed (0 … 1 in every picture) or auto (each "
                                                  "to its largest weight); default: auto, but 0 … 1 where pictures are "
                                                  "compared (before and after training)")
      ->check(one_of({"fixed", "auto"}));
  auto* sentence = cmd.add_option("--sentence", o->sentence,
                                  "Your own sentence: one random embedding per distinct word (like the book)");
  auto* embeddings = cmd.add_option("--embeddings", o->embeddings,
                                    "Your own embeddings: a .npy array of (tokens × d_in), with --tokens");
  auto* tokens = cmd.add_option("--tokens", o->tokens, "The tokens of --embeddings' rows, space-separated");
  embeddings->needs(tokens)->excludes(sentence);
  tokens->needs(embeddings);
  cmd.add_option("--d-in", o->d_in, "Embedding width for --sentence (default 3)")->type_name("INT")
      ->check(int_in_range(1, kMaxWidth));
  cmd.add_option("--d-out", o->d_out, "Query/key/value width c (default 2; even: two heads share it)")->type_name("INT")
      ->check(int_in_range(1, kMaxWidth));
  cmd.add_option("--seed", o->seed, "Seed for your input's embeddings and weights (default 123)");
  cmd.add_option("--attend", o->attend, "Section 3 trains QUERY to attend to KEY (words or 1-based positions: "
                                        "--attend cat,fat; default: cat,fat when your sentence has both, else its last "
                                        "word to its first)");
  return [o, force_color, no_color, sentence] {
    // NO_COLOR (no-color.org): any non-empty value turns colour off unless --color asks for it.
    const char* no_color_env = std::getenv("NO_COLOR");
    const bool env_off = no_color_env && *no_color_env;
    o->color = !*no_color && (*force_color || (!env_off && isatty(STDOUT_FILENO)));
    o->sentence_given = sentence->count() > 0;
    return run_demo(*o, std::cout);
  };
}

}  // namespace qkv::cli
