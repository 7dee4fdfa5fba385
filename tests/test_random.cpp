// The generator against python3-torch's draws (fixtures/rng.safetensors, made by tools/torch_reference.py).
#include <bit>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"

namespace qkv::test {
namespace {

const uint64_t kSeeds[] = {0, 123, 789, (uint64_t{1} << 40) + 5};

int64_t ulp_distance(float a, float b) {
  return std::abs(static_cast<int64_t>(std::bit_cast<int32_t>(a)) - std::bit_cast<int32_t>(b));
}

// Exact equality, or within `max_ulp` units in the last place where PyTorch's vectorised math may round differently.
::testing::AssertionResult within_ulp(const Tensor& actual, const Tensor& expected, int64_t max_ulp) {
  if (!(actual.shape() == expected.shape())) return ::testing::AssertionFailure() << "shapes differ";
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const int64_t d = ulp_distance(actual.data()[i], expected.data()[i]);
    if (d > max_ulp) {
      return ::testing::AssertionFailure() << "element " << i << ": " << actual.data()[i] << " vs "
                                           << expected.data()[i] << " (" << d << " ulp)";
    }
  }
  return ::testing::AssertionSuccess();
}

class TorchDraws : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { file_ = new io::SafetensorsFile(io::SafetensorsFile::open(fixture("rng.safetensors"))); }
  static void TearDownTestSuite() { delete file_; }
  static Tensor expected(const std::string& name) { return file_->tensor(name); }
  static io::SafetensorsFile* file_;
};
io::SafetensorsFile* TorchDraws::file_ = nullptr;

TEST_F(TorchDraws, RandIsBitExact) {
  for (uint64_t seed : kSeeds)
    for (int64_t n : {1, 5, 16, 37}) {
      Generator gen(seed);
      EXPECT_TRUE(within_ulp(gen.rand({n}), expected("rand." + std::to_string(seed) + "." + std::to_string(n)), 0))
          << "seed " << seed << " n " << n;
    }
}

TEST_F(TorchDraws, UniformRangeIsBitExact) {
  for (uint64_t seed : kSeeds) {
    Generator gen(seed);
    Tensor t = Tensor::empty({20});
    gen.uniform_(t, -2.5, 0.75);
    EXPECT_TRUE(within_ulp(t, expected("rand_range." + std::to_string(seed)), 0));
  }
}

TEST_F(TorchDraws, RandnBelowSixteenIsBitExactIncludingTheCache) {
  for (uint64_t seed : kSeeds) {
    for (int64_t n : {1, 7, 15}) {
      Generator gen(seed);
      EXPECT_TRUE(within_ulp(gen.randn({n}), expected("randn." + std::to_string(seed) + "." + std::to_string(n)), 0))
          << "seed " << seed << " n " << n;
    }
    Generator gen(seed);
    const Tensor first = gen.randn({3}), second = gen.randn({3});
    EXPECT_TRUE(within_ulp(concat({first, second}, 0), expected("randn_pair." + std::to_string(seed)), 0));
  }
}

TEST_F(TorchDraws, RandnFromSixteenOnIsBitExact) {
  for (uint64_t seed : kSeeds)
    for (int64_t n : {16, 17, 37, 100, 1000}) {
      Generator gen(seed);
      EXPECT_TRUE(within_ulp(gen.randn({n}), expected("randn." + std::to_string(seed) + "." + std::to_string(n)), 0))
          << "seed " << seed << " n " << n;
    }
}

TEST_F(TorchDraws, LinearInitialisationIsBitExact) {
  for (uint64_t seed : kSeeds) {
    const std::string s = std::to_string(seed);
    {
      Generator gen(seed);
      nn::Linear layer(5, 3, true, gen);
      EXPECT_TRUE(within_ulp(layer.weight, expected("linear." + s + ".weight"), 0));
      EXPECT_TRUE(within_ulp(layer.bias, expected("linear." + s + ".bias"), 0));
    }
    Generator gen(seed);
    nn::Linear wide(768, 24, true, gen);
    EXPECT_TRUE(within_ulp(wide.weight, expected("linear_wide." + s + ".weight"), 0));
    EXPECT_TRUE(within_ulp(wide.bias, expected("linear_wide." + s + ".bias"), 0));
  }
}

TEST_F(TorchDraws, EmbeddingInitialisationMatches) {
  for (uint64_t seed : kSeeds) {
    Generator gen(seed);
    EXPECT_TRUE(within_ulp(gen.randn({10, 4}), expected("embedding." + std::to_string(seed)), 0));
    Generator small(seed);
    EXPECT_TRUE(within_ulp(small.randn({3, 4}), expected("embedding_small." + std::to_string(seed)), 0));
  }
}

TEST_F(TorchDraws, DropoutMasksAreIdentical) {
  for (uint64_t seed : kSeeds) {
    Generator gen(seed);
    EXPECT_TRUE(within_ulp(dropout(Tensor::ones({6, 6}), 0.5, true, gen), expected("dropout." + std::to_string(seed)), 0));
    Generator gen2(seed);
    EXPECT_TRUE(within_ulp(dropout(Tensor::ones({3, 50}), 0.1, true, gen2),
                           expected("dropout_p01." + std::to_string(seed)), 0));
  }
}

TEST(Generator, TheBooksDropoutRow) {
  manual_seed(123);
  const Tensor dropped = dropout(Tensor::ones({6, 6}), 0.5, true, default_generator());
  const float expected[] = {2, 2, 0, 2, 2, 0};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(dropped.at({0, j}), expected[j]);
}

TEST(Generator, StateRoundTripContinuesTheSameStream) {
  Generator a(5);
  a.randn({3});  // leaves a cached normal behind
  const auto state = a.state();
  const Tensor next = a.randn({40});
  Generator b(0);
  b.set_state(state);
  EXPECT_TRUE(all_close(b.randn({40}), next, 0, 0));
  EXPECT_THROW(b.set_state({1, 2, 3}), ValueError);
}

}  // namespace
}  // namespace qkv::test
