// bf16 products: the kernel against its reference, Tensor::bf16's rounded copies, every op that multiplies under
// PrecisionGuard(BF16) against float32 arithmetic on the rounded operands, and training that tracks float32.
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "qkv/kernels.hpp"
#include "qkv/qkv.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::test {
namespace {

std::vector<uint16_t> to_bf16(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = kernels::f32_to_bf16_reference(t.data()[i]);
  return out;
}

// t with every value rounded to bf16 (as float32): what a bf16 product reads.
Tensor rounded(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i)
    out.data()[i] = kernels::bf16_to_f32_reference(kernels::f32_to_bf16_reference(t.data()[i]));
  return out;
}

TEST(Bf16, GemmMatchesReferenceForEveryLayoutAlphaAndBeta) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      // On AMX (alpha 1, beta 0 or 1) every shape runs on qkv's tiles: edges of 32 rows and columns, odd K and M (the
      // transposed A's pairs of rows), a K of several 1,024 chunks, more blocks of columns than of rows and the
      // reverse (which the threads split), a transposed A 8× wider than B (oneDNN's).
      for (auto [M, N, K] : {std::tuple{1, 1, 1}, {1, 70, 33}, {3, 5, 7}, {17, 33, 9}, {64, 48, 80}, {130, 96, 257},
                             {45, 1100, 191}, {64, 1024, 256}, {33, 65, 2100}, {97, 40, 63}, {300, 33, 20}})
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.5f, 1.0f}, {2.0f, 0.25f}, {1.0f, 1.0f}}) {
          const int64_t pad = 3;  // row strides longer than the rows
          const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
          const Tensor A = random_tensor({ta ? K : M, lda}, 1), B = random_tensor({tb ? N : K, ldb}, 2);
          const std::vector<uint16_t> a = to_bf16(A), b = to_bf16(B);
          Tensor C = random_tensor({M, ldc}, 3), R = C.clone();
          kernels::gemm_bf16(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, C.data(), ldc);
          kernels::gemm_bf16_reference(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, R.data(), ldc);
          // Same exact products; float32 sums in another order: ~K ulps at worst.
          EXPECT_TRUE(all_close(C, R, 1e-5, 1e-5 * K)) << "ta=" << ta << " tb=" << tb << " " << M << "x" << N << "x" << K
                                                      << " alpha " << alpha << " beta " << beta;
        }
}

// oneDNN's matmul alone (benchmarks set it beside qkv's AMX loop): the same values, or false where there is none.
TEST(Bf16, OneDnnAloneMatchesReferenceOrSaysItIsMissing) {
  const int64_t M = 70, N = 48, K = 81;
  const Tensor A = random_tensor({M, K}, 4), B = random_tensor({N, K}, 5);
  const std::vector<uint16_t> a = to_bf16(A), b = to_bf16(B);
  Tensor C = random_tensor({M, N}, 6), R = C.clone();
  const Tensor before = C.clone();
  const bool ran = kernels::gemm_bf16_onednn(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 1.0f, C.data(), N);
#if defined(QKV_TEST_HAVE_DNNL)
  EXPECT_EQ(ran, kernels::bf16_native());
#else
  EXPECT_FALSE(ran);
#endif
  if (!ran) {
    EXPECT_TRUE(all_close(C, before, 0.0, 0.0));
    return;
  }
  kernels::gemm_bf16_reference(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 1.0f, R.data(), N);
  EXPECT_TRUE(all_close(C, R, 1e-5, 1e-5 * K));
}

TEST(Bf16, GemmWithEmptyInnerDimensionScalesC) {
  Tensor C = Tensor::full({2, 2}, 3.0f);
  kernels::gemm_bf16(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, C.data(), 2);
  EXPECT_TRUE(all_close(C, Tensor::full({2, 2}, 1.5f)));
}

// Benchmarks and run headers say what ran: oneDNN where the CPU multiplies bf16 and qkv has oneDNN, else widening.
TEST(Bf16, BackendSaysWhatRuns) {
  const std::string name = kernels::gemm_bf16_backend();
#if defined(QKV_TEST_HAVE_DNNL)
  if (kernels::bf16_native()) {
    if (kernels::amx_bf16_ready()) EXPECT_EQ(name.rfind("qkv's AMX tiles (TDPBF16PS); oneDNN ", 0), 0u) << name;
    else EXPECT_EQ(name.rfind("oneDNN ", 0), 0u) << name;
    return;
  }
#endif
  EXPECT_EQ(name.rfind("widened to float32", 0), 0u) << name;
  if (!kernels::bf16_native()) {
    EXPECT_NE(name.find("AVX512_BF16"), std::string::npos) << name;
  }
}

TEST(Bf16, PrecisionIsReadAndCheckedAgainstTheCpu) {
  EXPECT_EQ(resolve_precision("fp32"), Precision::FP32);
  EXPECT_EQ(resolve_precision("auto"), kernels::bf16_native() ? Precision::BF16 : Precision::FP32);
  try {
    resolve_precision("fast", "--precision");
    FAIL() << "fast is not a precision";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("--precision = \"fast\" is not a precision; use fp32, bf16 or auto"), std::string::npos)
        << e.what();
  }
  if (kernels::bf16_native()) {
    EXPECT_EQ(resolve_precision("bf16"), Precision::BF16);
  } else {  // refused, naming what is missing: it would run slower than fp32
    try {
      resolve_precision("bf16");
      FAIL() << "bf16 on a CPU without bf16 products";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("AVX512_BF16"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(precision(), Precision::FP32);
  {
    const PrecisionGuard guard(Precision::BF16);
    EXPECT_EQ(precision(), Precision::BF16);
  }
  EXPECT_EQ(precision(), Precision::FP32);
}

// The copy is rounded to nearest even (NaN kept), made once, and made again after any write to the storage — through
// the tensor or through a view of it (a parameter written by the optimiser through its handle into an arena).
TEST(Bf16, TensorCopyIsRoundedOnceAndRefreshedAfterWrites) {
  Tensor t = Tensor::from({1.0f, 1.00390625f, 1.01171875f, -3.3f, NAN, INFINITY}, {6});
  const std::vector<uint16_t> expected = to_bf16(t);
  const uint16_t* copy = t.bf16();
  EXPECT_EQ(std::vector<uint16_t>(copy, copy + 6), expected);
  EXPECT_EQ(copy[1], 0x3f80);  // a tie: to even
  EXPECT_EQ(copy[2], 0x3f82);  // a tie: to even, upwards
  EXPECT_TRUE(std::isnan(kernels::bf16_to_f32_reference(copy[4])));
  EXPECT_EQ(t.bf16(), copy);  // unchanged storage: the same copy

  t.data()[0] = 2.0f;
  EXPECT_EQ(t.bf16()[0], 0x4000);
  const Tensor whole = Tensor::zeros({8});
  const Tensor part = whole.view_at(4, {4});
  EXPECT_EQ(part.bf16()[1], 0);
  Tensor writer = whole.view_at(0, {8});
  writer.data()[5] = -1.0f;
  EXPECT_EQ(part.bf16()[1], 0xbf80);
}

// ‖a − b‖ / ‖b‖
double relative_error(const Tensor& a, const Tensor& b) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff += std::pow(static_cast<double>(a.data()[i]) - b.data()[i], 2);
    norm += std::pow(static_cast<double>(b.data()[i]), 2);
  }
  return std::sqrt(diff / norm);
}

// Runs op on fresh leaf copies of `inputs` in precision p, then backward from dy outside the guard (an op records
// its precision, so its backward keeps it). Returns the output, then each leaf's gradient.
std::vector<Tensor> run(Precision p, const std::vector<Tensor>& inputs, const Tensor& dy,
                        const std::function<Tensor(const std::vector<Tensor>&)>& op) {
  std::vector<Tensor> leaves;
  for (const Tensor& t : inputs) leaves.push_back(t.clone().requires_grad_());
  Tensor y;
  {
    const PrecisionGuard guard(p);
    y = op(leaves);
  }
  y.backward(dy);
  std::vector<Tensor> out{y.detach()};
  for (const Tensor& t : leaves) out.push_back(t.grad());
  return out;
}

std::vector<Tensor> rounded(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(rounded(t));
  return out;
}

// Under BF16 a product is float32 arithmetic on bf16-rounded operands: x and W forward; dy, W and x backward. So
// each op equals itself run in FP32 on rounded inputs with a rounded dy, to float32's rounding of the sums.
TEST(Bf16, ProductsAreFloat32ArithmeticOnRoundedOperands) {
  struct Case {
    const char* name;
    std::vector<Tensor> inputs;  // every one rounded in the reference (biases are not multiplied: left out here)
    Tensor dy;
    std::function<Tensor(const std::vector<Tensor>&)> op;
  };
  const std::vector<Case> cases = {
      {"linear", {random_tensor({2, 5, 40}, 11), random_tensor({24, 40}, 12, 0.2f)}, random_tensor({2, 5, 24}, 14),
       [](const std::vector<Tensor>& t) { return linear(t[0], t[1], Tensor()); }},
      {"matmul, batched", {random_tensor({3, 4, 16}, 21), random_tensor({3, 16, 8}, 22, 0.3f)}, random_tensor({3, 4, 8}, 26),
       [](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }},
      {"matmul, shared B", {random_tensor({3, 4, 16}, 21), random_tensor({16, 8}, 22, 0.3f)}, random_tensor({3, 4, 8}, 26),
       [](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }},
      {"linear_concat",
       {random_tensor({3, 4, 16}, 31), random_tensor({8, 16}, 32, 0.3f), random_tensor({8, 16}, 33, 0.3f),
        random_tensor({4, 16}, 34, 0.3f)},
       random_tensor({3, 4, 20}, 35),
       [](const std::vector<Tensor>& t) {
         const std::vector<Tensor> ws = {t[1], t[2], t[3]};
         return linear_concat(t[0], ws);
       }},
  };
  for (const Case& c : cases) {
    const std::vector<Tensor> half = run(Precision::BF16, c.inputs, c.dy, c.op);
    const std::vector<Tensor> ref = run(Precision::FP32, rounded(c.inputs), rounded(c.dy), c.op);
    const std::vector<Tensor> full = run(Precision::FP32, c.inputs, c.dy, c.op);
    for (size_t i = 0; i < half.size(); ++i) {
      EXPECT_TRUE(all_close(half[i], ref[i], 1e-5, 1e-5)) << c.name << ", " << (i ? "gradient " : "output ") << i;
      EXPECT_TRUE(all_close(half[i], full[i], 3e-2, 3e-2)) << c.name << ": bf16 keeps 8 bits, " << i;
    }
    EXPECT_FALSE(all_close(half[0], full[0], 1e-6, 1e-6)) << c.name << ": it did round";
  }
}

// Biases add in float32, and a LoRA update's u = x Aᵀ is rounded again before u Bᵀ: both checked against float32
// to bf16's tolerance.
TEST(Bf16, BiasesAndLoraTrackFloat32) {
  const std::vector<Tensor> inputs = {random_tensor({3, 4, 16}, 41), random_tensor({12, 16}, 42, 0.3f),
                                      random_tensor({12}, 43), random_tensor({4, 16}, 44, 0.3f),
                                      random_tensor({12, 4}, 45, 0.3f)};
  const Tensor dy = random_tensor({3, 4, 12}, 46);
  auto op = [](const std::vector<Tensor>& t) { return lora_linear(t[0], t[1], t[2], t[3], t[4], 2.0f); };
  const std::vector<Tensor> half = run(Precision::BF16, inputs, dy, op), full = run(Precision::FP32, inputs, dy, op);
  // Relative to each tensor's size: dA and dB come from du = s·dy B, whose small entries lose most to rounding.
  for (size_t i = 0; i < half.size(); ++i) EXPECT_LT(relative_error(half[i], full[i]), 1e-2) << i;
  EXPECT_TRUE(all_close(half[3], full[3], 1e-6, 1e-6));  // the bias gradient: float32 sums of dy
}

// The fused head and loss: logits from rounded operands; softmax and loss in float32; gradients from dlogits
// rounded to bf16. The loss equals float32 arithmetic on the rounded operands; gradients track float32.
TEST(Bf16, FusedHeadLossAndGradientsTrackFloat32) {
  const std::vector<Tensor> inputs = {random_tensor({2, 8, 32}, 31), random_tensor({300, 32}, 32, 0.3f), random_tensor({300}, 33)};
  std::vector<int64_t> targets(16);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = static_cast<int64_t>((i * 37) % 300);
  targets[3] = -100;
  auto op = [&](const std::vector<Tensor>& t) { return linear_cross_entropy(t[0], t[1], t[2], targets, -100); };
  const Tensor one = Tensor::scalar(1.0f);
  const std::vector<Tensor> half = run(Precision::BF16, inputs, one, op), full = run(Precision::FP32, inputs, one, op);
  const std::vector<Tensor> ref = run(Precision::FP32, {rounded(inputs[0]), rounded(inputs[1]), inputs[2]}, one, op);
  EXPECT_NEAR(half[0].item(), ref[0].item(), 1e-5);
  EXPECT_NEAR(half[0].item(), full[0].item(), 1e-2 * full[0].item());
  EXPECT_NE(half[0].item(), full[0].item());
  EXPECT_TRUE(all_close(half[1], full[1], 3e-2, 3e-3));
  EXPECT_TRUE(all_close(half[2], full[2], 3e-2, 3e-3));
  EXPECT_TRUE(all_close(half[3], ref[3], 1e-5, 1e-7));  // the bias gradient: float32 dlogits of the rounded logits
}

// The fused attention op under BF16 runs the kernel's bf16 products (where the CPU has them): outputs and every
// gradient track float32 to bf16's precision, and differ from it; the backward runs as the forward did, even when
// the guard is gone by then. The pictures' weights, recomputed in float32 from the bf16 forward's log-sum-exp, sum
// to 1 within bf16's precision.
TEST(Bf16, FusedAttentionTracksFloat32) {
  const std::vector<Tensor> inputs = {random_tensor({2, 40, 32}, 51), random_tensor({2, 40, 16}, 52),
                                      random_tensor({2, 40, 16}, 53)};
  const Tensor dy = random_tensor({2, 40, 32}, 54);
  Tensor lse;
  AttentionConfig config;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.causal = true;
  auto op = [&](const std::vector<Tensor>& t) {
    config.lse = &lse;
    return scaled_dot_product_attention(t[0], t[1], t[2], config);
  };
  const std::vector<Tensor> half = run(Precision::BF16, inputs, dy, op);
  const Tensor half_lse = lse;
  const std::vector<Tensor> full = run(Precision::FP32, inputs, dy, op);
  for (size_t i = 0; i < half.size(); ++i) {
    EXPECT_LT(relative_error(half[i], full[i]), 1e-2) << i;
    if (kernels::attention_bf16_available()) EXPECT_GT(relative_error(half[i], full[i]), 0.0) << i;
    else EXPECT_TRUE(all_close(half[i], full[i], 0, 0)) << i;
  }
  config.lse = nullptr;
  const Tensor weights = attention_weights(inputs[0], inputs[1], half_lse, config, 1, 3);
  for (int64_t i = 0; i < 40; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < 40; ++j) sum += weights.data()[i * 40 + j];
    EXPECT_NEAR(sum, 1.0, 1e-2) << "row " << i;
  }
}

train::TrainSettings tiny_run(const std::string& precision) {
  train::TrainSettings settings;
  settings.model = nn::GPTConfig{.vocab_size = 97, .context_length = 32, .emb_dim = 64, .n_heads = 4, .n_layers = 2,
                                 .drop_rate = 0.0, .qkv_bias = false};
  settings.batch_size = 4;
  settings.max_steps = 40;
  settings.warmup_steps = 4;
  settings.learning_rate = 3e-3;
  settings.eval_every = 0;
  settings.checkpoint_every = 0;
  settings.precision = precision;
  return settings;
}

std::vector<double> train_losses(const train::TrainSettings& settings) {
  std::vector<int64_t> tokens(6000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 7 + i / 13) % 97);
  train::Trainer trainer(settings, tokens);
  std::vector<double> losses;
  trainer.run([&](const train::StepReport& r) { losses.push_back(r.loss); }, [](const train::EvalReport&) {},
              [](int64_t) {}, nullptr);
  return losses;
}

// bf16 training tracks float32: 40 steps of a small GPT, every loss within 2% of float32's; and it is repeatable,
// bit for bit, for a given thread count. Where the CPU lacks bf16 products the library widens (the CLI refuses).
TEST(Bf16, TrainingTracksFloat32WithinTwoPercentAndRepeats) {
  const ThreadCount scope(2);
  const std::vector<double> fp32 = train_losses(tiny_run("fp32"));
  if (!kernels::bf16_native()) {  // here the trainer refuses bf16, naming what the CPU lacks, and auto trains in fp32
    EXPECT_THROW(
        try { train_losses(tiny_run("bf16")); } catch (const ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("AVX512_BF16"), std::string::npos) << e.what();
          throw;
        },
        ValueError);
    EXPECT_EQ(train_losses(tiny_run("auto")), fp32);
    return;
  }
  const train::TrainSettings bf16 = tiny_run("auto");
  const std::vector<double> half = train_losses(bf16), again = train_losses(bf16);
  ASSERT_EQ(half.size(), 40u);
  for (size_t i = 0; i < half.size(); ++i)
    EXPECT_NEAR(half[i], fp32[i], 0.02 * fp32[i]) << "step " << i + 1;
  EXPECT_LT(half.back(), 0.8 * half.front());  // it trained
  EXPECT_EQ(half, again);
  EXPECT_NE(half, fp32);  // and it did run in bf16
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

// A bad --precision is a usage error naming the choices, on train (a setting) and on the commands that multiply;
// bf16 on a CPU without bf16 products is refused naming what is missing; auto says what it took.
TEST(Bf16Cli, PrecisionIsCheckedAndReported) {
  for (const std::string command : {"train --steps 1", "eval --text /dev/null", "generate --prompt hi", "attention"}) {
    const CliResult r = run_cli(command + " --precision fast");
    EXPECT_EQ(r.code, 2) << command << ": " << r.out;
    EXPECT_NE(r.out.find("\"fast\" is not a precision; use fp32, bf16 or auto"), std::string::npos) << command << ": " << r.out;
  }
  // The book's GPT evaluated with its matrices held in bf16: PyTorch's float32 loss to bf16's tolerance (or refused
  // where the CPU lacks bf16 products); the model's generate runs in bf16 too.
  const std::string model = " --checkpoint " + fixture("pth/model.pth") + " --config " + fixture("pth/config.json");
  const CliResult eval = run_cli("eval" + model + " --text " + fixture("pth/eval.txt") + " --json --precision bf16");
  if (kernels::bf16_native()) {
    ASSERT_EQ(eval.code, 0) << eval.out;
    const double expected = io::SafetensorsFile::open(fixture("pth/expected.safetensors")).tensor("eval.stride16").data()[0];
    const double loss = nlohmann::json::parse(eval.out.substr(eval.out.find('{')))["loss"].get<double>();  // after stderr
    EXPECT_NEAR(loss, expected, 0.01 * expected);
    EXPECT_NE(loss, expected);
    const CliResult gen = run_cli("generate" + model + " --prompt Hello --greedy --max-new-tokens 4 --precision bf16");
    EXPECT_EQ(gen.code, 0) << gen.out;
  } else {
    EXPECT_EQ(eval.code, 2) << eval.out;
  }
  const CliResult bf16 = run_cli("eval --text /dev/null --precision bf16");
  if (kernels::bf16_native()) {
    EXPECT_NE(bf16.out.find("precision: bf16 (bf16 products with float32 sums"), std::string::npos) << bf16.out;
  } else {
    EXPECT_EQ(bf16.code, 2) << bf16.out;
    EXPECT_NE(bf16.out.find("lacks AVX512_BF16"), std::string::npos) << bf16.out;
  }
}

}  // namespace
}  // namespace qkv::test

#include "qkv/nn/generate.hpp"
#include "qkv/nn/hf.hpp"

namespace qkv::test {
namespace {

// A BF16 tensor holds bfloat16 values only: half the memory, no float32 values to read (a clear error, not a
// crash), views of it are BF16 too, and products take it in bf16 whatever the precision.
TEST(Bf16Weights, ATensorBecomesBf16InPlaceForEveryHandle) {
  Tensor w = random_tensor({6, 8}, 51);
  const std::vector<uint16_t> expected = to_bf16(w);
  const Tensor handle = w;  // another handle of the same tensor
  const int64_t before = memory::bytes_in_use();
  w.to_bf16_();
  EXPECT_EQ(handle.dtype(), DType::BF16);
  EXPECT_EQ(memory::bytes_in_use() - before, 6 * 8 * (2 - 4));  // 2 bytes a value instead of 4
  EXPECT_EQ(std::vector<uint16_t>(handle.bf16(), handle.bf16() + 48), expected);
  try {
    (void)handle.data();
    FAIL() << "a bf16 tensor has no float32 values";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16 tensor (6, 8) has no float32 values"), std::string::npos) << e.what();
  }
  const Tensor row = w.view_at(8, {8});
  EXPECT_EQ(row.dtype(), DType::BF16);
  EXPECT_EQ(row.bf16()[0], expected[8]);
  EXPECT_TRUE(row.shares_storage_with(w));
  EXPECT_FALSE(row.shares_storage_with(random_tensor({8}, 1)));
  // A product with it under FP32 widens it inside the kernel (kernels::gemm_weight): float32 arithmetic on the rounded
  // weights and the activations as they are — the precision decides the arithmetic, not the storage.
  const Tensor x = random_tensor({3, 8}, 52);
  const Tensor y = linear(x, w, Tensor());
  const Tensor ref = linear(x, [&] {
    Tensor r = Tensor::empty({6, 8});
    for (int64_t i = 0; i < 48; ++i) r.data()[i] = kernels::bf16_to_f32_reference(expected[static_cast<size_t>(i)]);
    return r;
  }(), Tensor());
  EXPECT_TRUE(all_close(y, ref, 1e-5, 1e-5));
  // A lookup widens its rows exactly; training it is refused.
  const std::vector<int64_t> ids = {5, 0};
  const Tensor rows = embedding(w, ids, {2});
  EXPECT_EQ(rows.at({0, 3}), kernels::bf16_to_f32_reference(expected[5 * 8 + 3]));
  Tensor trained = random_tensor({6, 8}, 53).requires_grad_();
  trained.to_bf16_();
  EXPECT_THROW(embedding(trained, ids, {2}), ValueError);
}

// A KV cache made under BF16 holds bf16 keys and values: half the bytes, and generation token by token through it
// answers as the whole bf16 forward over the same prefix does, to bf16's tolerance; with grouped-query heads (llama),
// q/k norms (qwen3) and a sliding window of 4 that the cache slides past (gemma3), and GPT-2's own class.
TEST(Bf16Weights, ABf16KvCacheHalvesTheCacheAndAnswersAsTheWholeForward) {
  std::vector<std::pair<std::string, std::shared_ptr<nn::LanguageModel>>> models;
  for (const std::string family : {"llama", "qwen3", "gemma3"}) models.emplace_back(family, nn::load_hf_decoder(fixture("hf/" + family)));
  Generator gen(7);
  models.emplace_back("GPTModel", std::make_shared<nn::Decoder>(
                                      nn::GPTConfig{.vocab_size = 50, .context_length = 32, .emb_dim = 32, .n_heads = 4,
                                                    .n_layers = 2, .drop_rate = 0.0, .qkv_bias = true}, gen));
  for (auto& [name, model] : models) {
    model->eval();
    NoGradGuard no_grad;
    const nn::KVCache full_cache = model->make_cache(1, 20);
    const PrecisionGuard guard(Precision::BF16);
    nn::KVCache cache = model->make_cache(1, 20);
    EXPECT_EQ(cache.layers[0].keys.dtype(), DType::BF16) << name;
    EXPECT_EQ(cache.bytes() * 2, full_cache.bytes()) << name;
    std::vector<int64_t> ids = {1, 5, 9, 2, 7, 3};
    Tensor last = model->forward_cached(ids, 1, 6, cache);
    for (int64_t step = 0; step < 12; ++step) {
      const Tensor whole = model->forward(ids, 1, static_cast<int64_t>(ids.size()));
      const int64_t T = whole.size(1);
      const Tensor want = select_token(whole, T - 1);
      EXPECT_LT(relative_error(last, want), 3e-2) << name << " at " << ids.size() << " tokens";
      const int64_t next = (step * 7 + 3) % 11 + 1;
      ids.push_back(next);
      const std::vector<int64_t> one = {next};
      last = model->forward_cached(one, 1, 1, cache);
    }
    EXPECT_EQ(cache.length, 18) << name;
  }
}

// A folder read with its matrices in bf16 is the folder read in float32 and then rounded, bit for bit; it answers as
// the float32 model multiplying in bf16 does, within bf16's tolerance, and its matrices take half the memory.
TEST(Bf16Weights, AFolderLoadsInBf16AndAnswersAsTheFloat32ModelInBf16) {
  for (const std::string family : {"llama", "qwen3", "gemma3"}) {
    const std::string dir = fixture("hf/" + family);
    const auto half = nn::load_hf_decoder(dir, DType::BF16);
    const auto rounded_after = nn::load_hf_decoder(dir);
    rounded_after->weights_to_bf16();
    const auto full = nn::load_hf_decoder(dir);
    for (auto* m : {half.get(), rounded_after.get(), full.get()}) m->eval();
    int64_t matrices = 0;
    half->for_each_parameter([&](const std::string& name, Tensor& p) {
      EXPECT_EQ(p.dtype(), p.rank() == 2 ? DType::BF16 : DType::F32) << family << " " << name;
      matrices += p.rank() == 2;
    });
    EXPECT_GT(matrices, 4) << family;
    const std::vector<int64_t> ids = {1, 5, 9, 2, 7, 3, 4, 8};
    NoGradGuard no_grad;
    const Tensor a = half->forward(ids, 2, 4), b = rounded_after->forward(ids, 2, 4);
    EXPECT_TRUE(all_close(a, b, 0, 0)) << family;
    Tensor c;
    {
      const PrecisionGuard guard(Precision::BF16);
      c = full->forward(ids, 2, 4);
    }
    EXPECT_LT(relative_error(a, c), 2e-2) << family;  // only the embedding lookup reads differently rounded values
    EXPECT_LT(relative_error(a, full->forward(ids, 2, 4)), 5e-2) << family;
    nn::SamplingOptions options;
    options.temperature = 0;
    options.max_new_tokens = 6;
    EXPECT_EQ(nn::generate(*half, ids, options).size(), 6u) << family;
    // Saved as a BF16 folder, its matrices are written as they are (no widening) and load back bit for bit; the
    // float32 vectors (norms) are rounded by the file's dtype, so the answers stay within bf16's tolerance.
    const std::string out = (std::filesystem::temp_directory_path() / ("qkv_bf16_weights_" + family)).string();
    std::filesystem::remove_all(out);
    nn::save_hf_folder(out, *half, nn::HfDType::BF16);
    const auto back = nn::load_hf_decoder(out, DType::BF16);
    back->eval();
    const auto saved = half->named_parameters(), loaded = back->named_parameters();
    ASSERT_EQ(saved.size(), loaded.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      const Tensor& p = saved[i].second;
      if (p.rank() != 2) continue;
      EXPECT_EQ(std::vector<uint16_t>(p.bf16(), p.bf16() + p.numel()),
                std::vector<uint16_t>(loaded[i].second.bf16(), loaded[i].second.bf16() + p.numel())) << saved[i].first;
    }
    EXPECT_LT(relative_error(back->forward(ids, 2, 4), a), 2e-2) << family;
    std::filesystem::remove_all(out);
  }
}

}  // namespace
}  // namespace qkv::test
