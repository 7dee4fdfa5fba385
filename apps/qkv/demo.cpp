// `qkv demo`: the seed article's worked example, step by step, generated from the book's seeds.
#include "commands.hpp"

#include <cmath>
#include <iostream>
#include <map>
#include <set>

#include "qkv/qkv.hpp"
#include "qkv/viz/show.hpp"

namespace qkv::cli {

namespace {

const std::vector<std::string> kJourney = {"Your", "journey", "starts", "with", "one", "step"};

// The book's 3-dimensional embeddings of "Your journey starts with one step" (section 3.3).
Tensor journey_inputs() {
  return Tensor::from_rows({{0.43f, 0.15f, 0.89f},
                            {0.55f, 0.87f, 0.66f},
                            {0.57f, 0.85f, 0.64f},
                            {0.22f, 0.58f, 0.33f},
                            {0.77f, 0.25f, 0.10f},
                            {0.05f, 0.80f, 0.55f}});
}

void heading(std::ostream& out, const std::string& title) {
  out << "\n" << std::string(78, '=') << "\n" << title << "\n" << std::string(78, '=') << "\n";
}

std::vector<std::string> dims(const char* prefix, int64_t n) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i + 1));
  return out;
}

// Prints every intermediate of one forward pass with token labels.
void walk_through(std::ostream& out, const nn::AttentionTrace& t, const DemoOptions& options) {
  const viz::Style style{4, options.color};
  const int64_t d_out = t.queries.size(-1);
  const auto cols = dims("c", d_out);
  out << "\n" << viz::matrix("Q = X·Wq   queries", t.queries, kJourney, cols, style);
  out << "\n" << viz::matrix("K = X·Wk   keys", t.keys, kJourney, cols, style);
  out << "\n" << viz::matrix("V = X·Wv   values", t.values, kJourney, cols, style);
  out << "\n" << viz::matrix("Ω = Q·Kᵀ   attention scores (row i: how query i matches every key)", t.scores, kJourney,
                              kJourney, style);
  out << "\n"
      << viz::matrix("A = softmax(Ω / √" + std::to_string(d_out) + ")   attention weights, by rows", t.weights,
                      kJourney, kJourney, style, /*row_sums=*/true);
  out << "\n" << viz::heatmap("What attends to what", t.weights, kJourney, style);
  out << "\n" << viz::matrix("C = A·V   context vectors", t.context, kJourney, cols, style);
}

void section_v1(std::ostream& out, const DemoOptions& options) {
  heading(out, "1. SelfAttention_v1 — raw parameter matrices, torch.manual_seed(123)");
  const viz::Style style{4, options.color};
  const Tensor x = journey_inputs();
  out << "Input: \"Your journey starts with one step\", one 3-d embedding per token (n = 6, d = 3).\n\n";
  out << viz::matrix("X   input embeddings", x, kJourney, dims("x", 3), style);

  manual_seed(123);
  nn::SelfAttentionV1 attention(3, 2);
  out << "\nThree trainable d×c = 3×2 matrices, drawn with torch.rand in the order query, key, value:\n\n";
  out << viz::matrix("Wq  W_query", attention.W_query, dims("x", 3), dims("c", 2), style) << "\n";
  out << viz::matrix("Wk  W_key", attention.W_key, dims("x", 3), dims("c", 2), style) << "\n";
  out << viz::matrix("Wv  W_value", attention.W_value, dims("x", 3), dims("c", 2), style);

  const nn::AttentionTrace t = attention.trace(x);
  walk_through(out, t, options);

  // The numbers the book prints on the way, for x² = "journey".
  char line[256];
  std::snprintf(line, sizeof line, "\nThe book, token 2 (\"journey\"): query_2 = [%.4f, %.4f];  ω₂₂ = %.4f\n",
                t.queries.at({1, 0}), t.queries.at({1, 1}), t.scores.at({1, 1}));
  out << line << "attention weights of x²:\n";
  std::vector<float> row;
  for (int64_t j = 0; j < 6; ++j) row.push_back(t.weights.at({1, j}));
  out << viz::bars(row, kJourney);
}

void section_v2(std::ostream& out, const DemoOptions& options) {
  heading(out, "2. SelfAttention_v2 — nn.Linear projections, torch.manual_seed(789)");
  const viz::Style style{4, options.color};
  const Tensor x = journey_inputs();
  manual_seed(789);
  nn::SelfAttentionV2 attention(3, 2);
  out << "Linear stores its weight as (out, in) = 2×3 and computes x·Wᵀ, so Wq below is W_query.weight.\n"
         "nn.Linear's initialisation (kaiming-uniform) gives smaller, centred weights than torch.rand.\n\n";
  out << viz::matrix("W_query.weight", attention.W_query.weight, dims("c", 2), dims("x", 3), style) << "\n";
  out << viz::matrix("W_key.weight", attention.W_key.weight, dims("c", 2), dims("x", 3), style) << "\n";
  out << viz::matrix("W_value.weight", attention.W_value.weight, dims("c", 2), dims("x", 3), style);
  walk_through(out, attention.trace(x), options);
}

void section_train(std::ostream& out, const DemoOptions& options) {
  heading(out, "3. Training Wq, Wk, Wv — make \"cat\" attend to \"fat\"");
  const viz::Style style{4, options.color};
  const std::vector<std::string> tokens = {"the", "fat", "cat", "sat", "on", "the", "mat"};
  // Fixed embeddings: one random 4-d vector per distinct word (seed 123), looked up per token, so both
  // "the" get the same vector, as a real embedding table would give them.
  manual_seed(123);
  const int64_t d = 4;
  std::map<std::string, int64_t> vocab;
  for (const auto& w : tokens) vocab.emplace(w, static_cast<int64_t>(vocab.size()));
  const Tensor table = default_generator().randn({static_cast<int64_t>(vocab.size()), d});
  Tensor x = Tensor::empty({static_cast<int64_t>(tokens.size()), d});
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int64_t j = 0; j < d; ++j) x.data()[static_cast<int64_t>(i) * d + j] = table.at({vocab[tokens[i]], j});

  nn::SelfAttentionV1 attention(d, d);
  const int64_t cat = 2, fat = 1;
  out << "Sentence: \"the fat cat sat on the mat\"; fixed 4-d embeddings; SelfAttention_v1(4, 4).\n"
         "Loss: −log A[cat, fat], the cross-entropy of cat's attention row against the key \"fat\".\n\n";
  out << viz::matrix("X   embeddings (fixed)", x, tokens, dims("x", d), style);

  auto cat_row = [&]() {
    NoGradGuard no_grad;
    const Tensor weights = attention.trace(x).weights;
    std::vector<float> row;
    for (int64_t j = 0; j < weights.size(1); ++j) row.push_back(weights.at({cat, j}));
    return row;
  };
  const std::vector<float> before = cat_row();
  out << "\nBefore training, \"cat\" attends to:\n" << viz::bars(before, tokens);

  optim::AdamW optimizer(attention.named_parameters(), {.lr = 0.05});
  std::vector<int64_t> targets(tokens.size(), -100);  // only cat's row has a target; the rest are ignored
  targets[cat] = fat;
  out << "\nAdamW, lr = 0.05:\n";
  const Tensor w_value_before = attention.W_value.clone();
  int step = 0;
  float loss_value = 0.0f;
  for (; step <= 500; ++step) {
    optimizer.zero_grad();
    const nn::AttentionTrace t = attention.trace(x);
    const float scale = std::sqrt(static_cast<float>(d));
    const Tensor loss = cross_entropy(div(t.scores, scale), targets);
    loss_value = loss.item();
    const float attention_to_fat = t.weights.at({cat, fat});
    int best = 0;
    for (int64_t j = 1; j < t.weights.size(1); ++j)
      if (t.weights.at({cat, j}) > t.weights.at({cat, best})) best = static_cast<int>(j);
    const bool done = best == fat && attention_to_fat >= 0.5f;
    if (step < 5 || step % 10 == 0 || done) {
      char line[160];
      std::snprintf(line, sizeof line, "  step %3d   loss %.4f   A[cat, fat] = %.4f%s\n", step, loss_value,
                    attention_to_fat, done ? "   ← cat now attends most to fat" : "");
      out << line;
    }
    if (done) break;
    loss.backward();
    optimizer.step();
  }
  const std::vector<float> after = cat_row();
  out << "\nAfter " << step << " steps, \"cat\" attends to:\n" << viz::bars(after, tokens);
  float change = 0.0f;
  for (int64_t i = 0; i < attention.W_value.numel(); ++i)
    change = std::max(change, std::fabs(attention.W_value.data()[i] - w_value_before.data()[i]));
  out << "\nW_value changed by at most " << change
      << ": the loss looks only at who attends to whom, which Wq and Wk decide;\n"
         "the values decide what is passed along once attention is paid.\n";
}

Tensor journey_batch() {
  const Tensor x = reshape(journey_inputs(), {1, 6, 3});
  return concat({x, x}, 0);  // torch.stack((inputs, inputs)): batch of 2, shape (2, 6, 3)
}

void print_batch_row(std::ostream& out, const std::string& title, const Tensor& batched, const viz::Style& style) {
  out << "\n" << title << ", output shape " << batched.shape().str() << "; batch row 0:\n";
  const Tensor first = reshape(batched, {batched.size(0), batched.size(1) * batched.size(2)});
  out << viz::matrix("context vectors", top_left(first, 1, batched.size(1) * batched.size(2)).view_as_shape(
                                             {batched.size(1), batched.size(2)}),
                      kJourney, dims("c", batched.size(2)), style);
}

void section_causal(std::ostream& out, const DemoOptions& options) {
  heading(out, "4. Causal attention — a token may not look at the tokens after it");
  const viz::Style style{4, options.color};
  manual_seed(789);
  nn::SelfAttentionV2 attention(3, 2);
  const nn::AttentionTrace t = attention.trace(journey_inputs());
  out << "SelfAttention_v2 with seed 789 again. The scores above the diagonal become −∞ before the softmax,\n"
         "so their weights are exactly 0 and every row still sums to 1:\n\n";
  const Tensor masked = masked_fill(t.scores, causal_mask(6), -INFINITY);
  out << viz::matrix("Ω masked  (−inf = the future)", masked, kJourney, kJourney, style);
  const Tensor weights = softmax(div(masked, std::sqrt(2.0f)));
  out << "\n" << viz::matrix("A = softmax(Ω_masked / √2)", weights, kJourney, kJourney, style, true);
  out << "\n" << viz::heatmap("What attends to what, causally", weights, kJourney, style);

  manual_seed(123);
  nn::CausalAttention causal(3, 2, 6, 0.0);
  print_batch_row(out, "CausalAttention(3, 2, context_length=6, dropout=0.0), torch.manual_seed(123)",
                  causal(journey_batch()), style);
}

void section_dropout(std::ostream& out, const DemoOptions& options) {
  heading(out, "5. Dropout on the attention weights — only while training");
  const viz::Style style{4, options.color};
  manual_seed(123);
  const Tensor dropped = dropout(Tensor::ones({6, 6}), 0.5, true, default_generator());
  out << "torch.manual_seed(123); Dropout(0.5) on a 6×6 matrix of ones: about half the entries become 0,\n"
         "the rest are scaled by 1/(1 − 0.5) = 2 so the expected sum stays the same:\n\n";
  out << viz::matrix("dropout(ones(6, 6))", dropped, {}, {}, style);
  manual_seed(789);
  nn::SelfAttentionV2 attention(3, 2);
  const Tensor scores = attention.trace(journey_inputs()).scores;
  const Tensor weights = softmax(div(masked_fill(scores, causal_mask(6), -INFINITY), std::sqrt(2.0f)));
  manual_seed(123);
  out << "\nThe same on the causal weights of section 4, reseeded with 123 (as the book does):\n\n";
  out << viz::matrix("dropout(A_causal)", dropout(weights, 0.5, true, default_generator()), kJourney, kJourney, style,
                      true);
  out << "In eval() mode, or with dropout = 0, the weights pass through untouched and no random numbers are drawn.\n";
}

void section_mha(std::ostream& out, const DemoOptions& options) {
  heading(out, "6. Multi-head attention");
  const viz::Style style{4, options.color};
  manual_seed(123);
  nn::MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 2);
  out << "MultiHeadAttentionWrapper: two CausalAttention heads side by side, outputs concatenated.\n"
         "Head 1 is the CausalAttention above (same seed, same draws); head 2 adds two more columns.\n";
  print_batch_row(out, "MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2), seed 123", wrapper(journey_batch()), style);
  manual_seed(123);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0, 2);
  out << "\nMultiHeadAttention: one projection of width d_out split into 2 heads of head_dim = 1,\n"
         "viewed as (B, H, T, D) = (2, 2, 6, 1), attended per head, merged back and passed through out_proj.\n";
  const nn::AttentionTrace t = mha.trace(journey_batch());
  print_batch_row(out, "MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), seed 123", t.context, style);
  for (int64_t h = 0; h < 2; ++h) {
    const Tensor head = reshape(t.weights, {2 * 2 * 6, 6});
    Tensor rows = Tensor::empty({6, 6});
    std::copy_n(head.data() + h * 36, 36, rows.data());
    out << "\n" << viz::heatmap("Head " + std::to_string(h + 1) + " weights (batch row 0)", rows, kJourney, style);
  }
}

}  // namespace

const std::vector<std::string>& demo_sections() {
  static const std::vector<std::string> sections = {"v1", "v2", "train", "causal", "dropout", "mha"};
  return sections;
}

int run_demo(const DemoOptions& options, std::ostream& out) {
  const auto& wanted = options.sections.empty() ? demo_sections() : options.sections;
  std::set<std::string> chosen(wanted.begin(), wanted.end());
  out << "qkv " << kVersion << " — trainable self-attention, step by step (Raschka, LLMs from Scratch, §3.4)\n";
  if (chosen.count("v1")) section_v1(out, options);
  if (chosen.count("v2")) section_v2(out, options);
  if (chosen.count("train")) section_train(out, options);
  if (chosen.count("causal")) section_causal(out, options);
  if (chosen.count("dropout")) section_dropout(out, options);
  if (chosen.count("mha")) section_mha(out, options);
  return 0;
}

}  // namespace qkv::cli
