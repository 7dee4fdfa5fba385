// The tape's own rules, shape errors and NaN handling (the ops' gradient checks: test_kernel_table.cpp).
#include "helpers.hpp"

namespace qkv::test {
namespace {

using Inputs = std::vector<Tensor>;

// The gradient checks of every op are one table: tests/test_kernel_table.cpp.

TEST(CrossEntropy, ValueMatchesHandComputation) {
  const Tensor logits = Tensor::from({1.0f, 2.0f, 3.0f, 0.0f, 0.0f, 0.0f}, {2, 3});
  const std::vector<int64_t> targets = {2, 0};
  const double row0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double row1 = std::log(3.0);
  EXPECT_NEAR(cross_entropy(logits, targets).item(), (row0 + row1) / 2, 1e-6);
  const std::vector<int64_t> bad = {3, 0};
  EXPECT_THROW(cross_entropy(logits, bad), ValueError);
}

TEST(Tape, GradientsAccumulateWhenATensorIsUsedTwice) {
  Tensor x = Tensor::from({2.0f, 3.0f}, {2}).requires_grad_();
  Tensor y = sum(mul(x, x) + x);  // dy/dx = 2x + 1
  y.backward();
  EXPECT_TRUE(all_close(x.grad(), Tensor::from({5.0f, 7.0f}, {2})));
  // A second backward on a fresh graph adds to the existing gradient; zero_grad clears it.
  sum(x).backward();
  EXPECT_TRUE(all_close(x.grad(), Tensor::from({6.0f, 8.0f}, {2})));
  x.zero_grad();
  EXPECT_TRUE(all_close(x.grad(), Tensor::zeros({2})));
}

// Both operands one tensor, its gradient fresh: the first is written and the second added to it, never the
// second written over the first.
TEST(Tape, AnOpWhoseOperandsAreOneTensorGetsBothContributions) {
  using Op = Tensor (*)(const Tensor&, const Tensor&);
  for (auto [op, want] : {std::pair<Op, float>{&add, 2.0f}, {&sub, 0.0f}, {&mul, 6.0f}}) {
    Tensor x = Tensor::from({3.0f, 3.0f}, {2}).requires_grad_();
    sum(op(x, x)).backward();
    EXPECT_TRUE(all_close(x.grad(), Tensor::full({2}, want))) << x.grad().values()[0] << " instead of " << want;
  }
}

// GradientReadyGuard reports each leaf once, when its gradient is final: the last layer's weights before the first's,
// a weight read by two layers (tied) only after both, and what it sees then is the gradient the backward leaves.
TEST(Tape, EachLeafIsReportedOnceWhenItsGradientIsFinal) {
  Tensor x = random_tensor({4, 3}, 1), w1 = random_tensor({3, 3}, 2), w2 = random_tensor({3, 3}, 3);
  w1.requires_grad_(true);
  w2.requires_grad_(true);
  const Tensor loss = sum(matmul(matmul(matmul(x, w1), w2), w1));  // w1 read first and last
  std::vector<std::string> seen;
  std::vector<Tensor> at_report;
  {
    const GradientReadyGuard guard([&](const Tensor& leaf) {
      seen.push_back(leaf.impl() == w1.impl() ? "w1" : leaf.impl() == w2.impl() ? "w2" : "other");
      at_report.push_back(leaf.grad().clone());
    });
    loss.backward();
  }
  ASSERT_EQ(seen, (std::vector<std::string>{"w2", "w1"}));
  EXPECT_TRUE(all_close(at_report[0], w2.grad(), 0, 0));
  EXPECT_TRUE(all_close(at_report[1], w1.grad(), 0, 0));
  // Outside the guard nothing is reported.
  const Tensor again = sum(matmul(x, w2));
  again.backward();
  EXPECT_EQ(seen.size(), 2u);
}

TEST(Tape, ASecondBackwardThroughAFreedGraphIsAnError) {
  Tensor x = Tensor::from({2.0f}, {1}).requires_grad_();
  Tensor y = sum(mul(x, x));
  y.backward();
  EXPECT_THROW(y.backward(), ValueError);
  EXPECT_TRUE(all_close(x.grad(), Tensor::from({4.0f}, {1})));  // the first pass's gradient is intact
}

TEST(Tape, NoGradGuardRecordsNothing) {
  Tensor x = Tensor::ones({2}).requires_grad_();
  {
    NoGradGuard guard;
    EXPECT_FALSE(grad_enabled());
    Tensor y = x * 2.0f;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_THROW(y.backward(Tensor::ones({2})), ValueError);
  }
  EXPECT_TRUE(grad_enabled());
  EXPECT_TRUE((x * 2.0f).requires_grad());
}

TEST(Tape, BackwardNeedsAScalarOrAGradient) {
  Tensor x = Tensor::ones({2, 2}).requires_grad_();
  Tensor y = x * 3.0f;
  EXPECT_THROW(y.backward(), ShapeError);
  EXPECT_THROW(y.backward(Tensor::ones({3})), ShapeError);
  EXPECT_STREQ(y.grad_fn_name(), "MulScalarBackward");
}

TEST(Tape, InputsThatNeedNoGradGetNone) {
  Tensor a = random_tensor({2, 3}, 1).requires_grad_();
  Tensor b = random_tensor({3, 2}, 2);
  sum(matmul(a, b)).backward();
  EXPECT_TRUE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(Shapes, MismatchesNameTheOpAndBothShapes) {
  const Tensor a = Tensor::zeros({2, 3}), b = Tensor::zeros({4, 5});
  try {
    matmul(a, b);
    FAIL() << "matmul accepted (2, 3) @ (4, 5)";
  } catch (const ShapeError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("matmul"), std::string::npos) << message;
    EXPECT_NE(message.find("(2, 3)"), std::string::npos) << message;
    EXPECT_NE(message.find("(4, 5)"), std::string::npos) << message;
  }
  try {
    add(a, b);
    FAIL() << "add accepted (2, 3) + (4, 5)";
  } catch (const ShapeError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("add"), std::string::npos) << message;
    EXPECT_NE(message.find("(2, 3)"), std::string::npos) << message;
    EXPECT_NE(message.find("(4, 5)"), std::string::npos) << message;
  }
  EXPECT_THROW(Shape({1, 2, 3, 4, 5}), ShapeError);
  EXPECT_THROW(Tensor::from({1.0f, 2.0f}, {3}), ShapeError);
  EXPECT_THROW(reshape(a, {4, -1}), ShapeError);
}

TEST(Shapes, ReshapeSharesStorage) {
  const Tensor a = random_tensor({2, 6}, 1);
  const Tensor b = reshape(a, {3, 4});
  EXPECT_TRUE(b.shares_storage_with(a));
  EXPECT_EQ(b.shape(), (Shape{3, 4}));
}

TEST(NaN, PropagatesThroughAttentionWithoutCrashing) {
  manual_seed(123);
  nn::SelfAttentionV2 attention(3, 2);
  Tensor x = Tensor::ones({4, 3});
  x.data()[4] = NAN;  // token 1
  const Tensor out = attention(x);
  // Token 1's key and value are NaN, so every query's weights (and contexts) become NaN.
  for (float v : out.values()) EXPECT_TRUE(std::isnan(v));
}

}  // namespace
}  // namespace qkv::test
