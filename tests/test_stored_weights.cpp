// A decoder whose matrices are kept as stored (bf16, f16, ggml's block formats) computes what float32 computes on the
// widened (dequantized) weights — within float32's rounding for bf16, within the 8-bit activations' rounding for the
// block types — in the bytes those types take, the same for a sequence alone or in a batch, and refuses to train them.
// Not here: the products themselves against their references (test_quant.cpp, test_kernel_table.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "helpers.hpp"
#include "qkv/core/autograd.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/nn/decoder.hpp"

namespace qkv::test {
namespace {

using kernels::WeightType;

// A Qwen3-shaped decoder whose rows are 256 values (the K-quants' block), untied head, grouped-query attention.
nn::DecoderConfig config() {
  nn::DecoderConfig c;
  c.family = &nn::family("qwen3");
  c.vocab_size = 96, c.hidden_size = 256, c.intermediate_size = 512, c.num_layers = 2, c.num_heads = 4, c.num_kv_heads = 2;
  c.head_dim = 64, c.max_positions = 64, c.qk_norm = nn::QkNorm::PerHead;
  c.ropes = {kernels::RopeFrequencies{.theta = 1e6}};
  c.layers = {{0, 0}, {0, 0}};
  return c;
}

const std::vector<int64_t> kIds = {3, 17, 42, 5, 88, 1, 60, 23, 9, 71, 30, 2};

// The model's matrices (what store_matrices converts) converted to `type` and back to float32: the values stored
// weights compute with, in a float32 model.
void round_trip_matrices(nn::Decoder& model, WeightType type) {
  model.store_matrices(type);
  for (const nn::DecoderConfig::Parameter& p : model.config.layout()) {
    Tensor& t = model.parameter(p);
    if (t.dtype() != DType::F32) t.to_weight_type_(WeightType::F32);
  }
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (float v : t.values()) m = std::max(m, std::fabs(double{v}));
  return m;
}
double max_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double{a.data()[i]} - b.data()[i]));
  return m;
}

// Bytes every parameter takes as stored.
int64_t parameter_bytes(nn::Decoder& model) {
  int64_t total = 0;
  for (const Tensor& t : model.parameters()) total += t.storage_bytes();
  return total;
}

TEST(StoredWeights, LogitsEqualFloat32OnTheWidenedWeights) {
  NoGradGuard no_grad;
  const PrecisionGuard fp32(Precision::FP32);
  Generator gen(11);
  nn::Decoder original(config(), gen);
  const Tensor exact = original.forward(kIds, 1, 12);
  for (WeightType type : {WeightType::BF16, WeightType::F16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_K,
                          WeightType::Q5_K, WeightType::Q6_K, WeightType::MXFP4}) {
    const char* name = kernels::weight_type_name(type);
    Generator g1(11), g2(11);
    nn::Decoder stored(config(), g1), widened(config(), g2);
    const int64_t f32_bytes = parameter_bytes(stored);
    stored.store_matrices(type);
    round_trip_matrices(widened, type);
    // memory: every block matrix and the head in the type's bytes, the embedding and norms in float32
    int64_t want = 0, matrices = 0;
    for (const nn::DecoderConfig::Parameter& p : stored.config.layout()) {
      const bool matrix = p.shape.rank() == 2 && p.role() != nn::Role::TokenEmbedding;
      want += matrix ? p.shape[0] * kernels::row_bytes(type, p.shape[1]) : p.shape.numel() * 4;
      if (matrix) {
        ++matrices;
        EXPECT_EQ(stored.parameter(p).weight_type(), type) << name << " " << p.name;
      }
    }
    EXPECT_EQ(matrices, 2 * 7 + 1);
    EXPECT_EQ(parameter_bytes(stored), want) << name;
    EXPECT_LT(parameter_bytes(stored), f32_bytes) << name;
    const Tensor got = stored.forward(kIds, 1, 12), reference = widened.forward(kIds, 1, 12);
    const double size = max_abs(reference), diff = max_diff(got, reference), from_exact = max_diff(reference, exact);
    if (!kernels::is_block_quantized(type)) {
      // float32 arithmetic on the same values: only the order of the sums differs
      EXPECT_LE(diff, 2e-5 * size) << name;
    } else {
      // 8-bit activations (one scale per 32 or 256 values, ~0.4% steps, through two layers): a few percent of the
      // largest logit at most (measured 1.4–1.8%); for the 4-bit types less than the weights' own rounding moved them
      EXPECT_LE(diff, 3e-2 * size) << name;
      if (type == WeightType::Q4_0 || type == WeightType::Q4_K || type == WeightType::MXFP4) EXPECT_LT(diff, from_exact) << name;
    }
    EXPECT_GT(from_exact, 0.0) << name << ": the weights were not rounded at all";
  }
}

// Batched generation equals solo generation: a sequence's logits are the same bits alone and as one row of a batch of
// three, with stored weights (the products' rows do not depend on the rows beside them).
TEST(StoredWeights, ASequenceGivesTheSameLogitsAloneAndInABatch) {
  NoGradGuard no_grad;
  const PrecisionGuard fp32(Precision::FP32);
  for (WeightType type : {WeightType::BF16, WeightType::Q8_0, WeightType::Q4_K}) {
    Generator gen(3);
    nn::Decoder model(config(), gen);
    model.eval();
    model.store_matrices(type);
    const int64_t T = 4;
    const std::vector<int64_t> batch(kIds.begin(), kIds.end());  // three sequences of 4
    const Tensor together = model.forward(batch, 3, T);
    for (int64_t b = 0; b < 3; ++b) {
      const Tensor alone = model.forward(std::span(kIds).subspan(static_cast<size_t>(b * T), T), 1, T);
      EXPECT_EQ(0, std::memcmp(alone.data(), together.data() + b * alone.numel(), alone.numel() * sizeof(float)))
          << kernels::weight_type_name(type) << ": sequence " << b << " alone differs from its row of the batch";
    }
  }
}

// A stored weight cannot be trained (a clear error naming the fix); frozen, the gradient reaches what is trained
// through it (dX = dY·W, as LoRA on a quantized base needs), close to float32's on the dequantized weights.
TEST(StoredWeights, TrainingAStoredWeightIsRefusedButGradientsFlowThroughAFrozenOne) {
  const PrecisionGuard fp32(Precision::FP32);
  Generator g1(5), g2(5);
  nn::Decoder stored(config(), g1), widened(config(), g2);
  stored.store_matrices(WeightType::Q8_0);
  round_trip_matrices(widened, WeightType::Q8_0);
  std::vector<int64_t> targets(kIds.begin() + 1, kIds.end());
  targets.push_back(0);
  try {
    (void)stored.loss(kIds, 1, 12, targets);
    FAIL() << "training a q8_0 weight was not refused";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("q8_0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("freeze"), std::string::npos) << e.what();
  }
  Tensor grads[2];
  nn::Decoder* models[2] = {&stored, &widened};
  for (int i = 0; i < 2; ++i) {
    for (Tensor& t : models[i]->parameters()) t.requires_grad_(false);
    models[i]->tok_emb.requires_grad_(true);
    models[i]->loss(kIds, 1, 12, targets).backward();
    grads[i] = models[i]->tok_emb.grad();
    ASSERT_TRUE(grads[i].defined());
  }
  for (float v : grads[0].values()) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LE(max_diff(grads[0], grads[1]), 0.05 * max_abs(grads[1]));
  EXPECT_GT(max_abs(grads[1]), 0.0);
}

// Conversions: rows that are not a multiple of the block are refused with the fix; a view of a stored matrix is whole
// rows; copy_ widens (and quantizes) as ggml does.
TEST(StoredWeights, TensorConversionsAndViews) {
  Tensor odd = random_tensor({4, 48}, 1);
  try {
    odd.to_weight_type_(WeightType::Q4_K);
    FAIL() << "48 values a row became q4_K";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("256"), std::string::npos) << e.what();
  }
  Tensor w = random_tensor({6, 64}, 2);
  const std::vector<float> values = w.to_vector();
  w.to_weight_type_(WeightType::Q8_0);
  EXPECT_EQ(w.dtype(), DType::Stored);
  EXPECT_EQ(w.storage_bytes(), 6 * 68);
  EXPECT_THROW((void)w.data(), ValueError);
  std::vector<float> want(6 * 64);
  kernels::dequantize_rows(WeightType::Q8_0, w.stored_bytes(), want.data(), 6, 64);
  Tensor back = Tensor::empty({6, 64});
  back.copy_(w);
  EXPECT_EQ(back.to_vector(), want);
  const Tensor rows = w.view_at(2 * 64, {3, 64});
  EXPECT_EQ(static_cast<const unsigned char*>(rows.stored_bytes()), static_cast<const unsigned char*>(w.stored_bytes()) + 2 * 68);
  EXPECT_THROW((void)w.view_at(10, {1, 64}), ShapeError);
  for (size_t i = 0; i < values.size(); ++i) ASSERT_NEAR(want[i], values[i], 0.02 * max_abs(Tensor::from(values, {6, 64})));
}

}  // namespace
}  // namespace qkv::test
