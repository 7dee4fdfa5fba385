// The book's modules: golden numbers from the seeds, and parity with python3-torch on values and all
// gradients (fixtures/modules, made by tools/torch_reference.py).
#include <fstream>

#include "helpers.hpp"
#include "qkv/io/safetensors.hpp"
#include "qkv/nn/apply.hpp"

namespace qkv::test {
namespace {

Tensor journey() {
  return Tensor::from_rows({{0.43f, 0.15f, 0.89f}, {0.55f, 0.87f, 0.66f}, {0.57f, 0.85f, 0.64f},
                            {0.22f, 0.58f, 0.33f}, {0.77f, 0.25f, 0.10f}, {0.05f, 0.80f, 0.55f}});
}

Tensor batch_of_two(const Tensor& x) { return concat({reshape(x, {1, 6, 3}), reshape(x, {1, 6, 3})}, 0); }

TEST(Book, SelfAttentionV1Seed123) {
  manual_seed(123);
  nn::SelfAttentionV1 attention(3, 2);
  EXPECT_TRUE(all_close(attention.W_query,
                        Tensor::from_rows({{0.29611194f, 0.51656228f}, {0.25167072f, 0.68855679f}, {0.07397246f, 0.86652195f}}),
                        0, 1e-8));
  const auto t = attention.trace(journey());
  EXPECT_TRUE(all_close(t.context, Tensor::from_rows({{0.2996f, 0.8053f}, {0.3061f, 0.8210f}, {0.3058f, 0.8203f},
                                                      {0.2948f, 0.7939f}, {0.2927f, 0.7891f}, {0.2990f, 0.8040f}}),
                        0, 5e-5));
  EXPECT_NEAR(t.queries.at({1, 0}), 0.4306, 5e-5);
  EXPECT_NEAR(t.queries.at({1, 1}), 1.4551, 5e-5);
  EXPECT_NEAR(t.scores.at({1, 1}), 1.8524, 5e-5);
  const float weights[] = {0.1500f, 0.2264f, 0.2199f, 0.1311f, 0.0906f, 0.1820f};
  for (int j = 0; j < 6; ++j) EXPECT_NEAR(t.weights.at({1, j}), weights[j], 5e-5);
}

TEST(Book, SelfAttentionV2Seed789) {
  manual_seed(789);
  nn::SelfAttentionV2 attention(3, 2);
  EXPECT_TRUE(all_close(attention.W_query.weight,
                        Tensor::from_rows({{0.31605908f, 0.45680857f, 0.51183486f}, {-0.16828540f, -0.33787704f, -0.09177387f}}),
                        0, 1e-8));
  EXPECT_TRUE(all_close(attention(journey()),
                        Tensor::from_rows({{-0.0739f, 0.0713f}, {-0.0748f, 0.0703f}, {-0.0749f, 0.0702f},
                                           {-0.0760f, 0.0685f}, {-0.0763f, 0.0679f}, {-0.0754f, 0.0693f}}),
                        0, 5e-5));
}

TEST(Book, CausalAttentionSeed123) {
  manual_seed(123);
  nn::CausalAttention attention(3, 2, 6, 0.0);
  const Tensor out = attention(batch_of_two(journey()));
  ASSERT_EQ(out.shape(), (Shape{2, 6, 2}));
  const Tensor row = Tensor::from_rows({{-0.4519f, 0.2216f}, {-0.5874f, 0.0058f}, {-0.6300f, -0.0632f},
                                        {-0.5675f, -0.0843f}, {-0.5526f, -0.0981f}, {-0.5299f, -0.1081f}});
  EXPECT_TRUE(all_close(out, concat({reshape(row, {1, 6, 2}), reshape(row, {1, 6, 2})}, 0), 0, 5e-5));
}

TEST(Book, CausalWeightsFromV2Seed789) {
  manual_seed(789);
  nn::SelfAttentionV2 v2(3, 2);
  const auto t = v2.trace(journey());
  const Tensor masked = softmax(div(masked_fill(t.scores, causal_mask(6), -INFINITY), std::sqrt(2.0f)));
  const std::vector<std::vector<float>> rows = {{1},
                                                {0.5517f, 0.4483f},
                                                {0.3800f, 0.3097f, 0.3103f},
                                                {0.2758f, 0.2460f, 0.2462f, 0.2319f},
                                                {0.2175f, 0.1983f, 0.1984f, 0.1888f, 0.1971f},
                                                {0.1935f, 0.1663f, 0.1666f, 0.1542f, 0.1666f, 0.1529f}};
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j)
      EXPECT_NEAR(masked.at({i, j}), j <= i ? rows[i][j] : 0.0f, 5e-5) << i << "," << j;
}

TEST(Book, MultiHeadWrapperAndMultiHeadSeed123) {
  manual_seed(123);
  nn::MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 2);
  const Tensor w = wrapper(batch_of_two(journey()));
  ASSERT_EQ(w.shape(), (Shape{2, 6, 4}));
  const float first[6][2] = {{-0.4519f, 0.2216f}, {-0.5874f, 0.0058f}, {-0.6300f, -0.0632f},
                             {-0.5675f, -0.0843f}, {-0.5526f, -0.0981f}, {-0.5299f, -0.1081f}};
  const float last[6][2] = {{0.4772f, 0.1063f}, {0.5891f, 0.3257f}, {0.6202f, 0.3860f},
                            {0.5478f, 0.3589f}, {0.5321f, 0.3428f}, {0.5077f, 0.3493f}};
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 2; ++j) {
        EXPECT_NEAR(w.at({b, i, j}), first[i][j], 5e-5);
        EXPECT_NEAR(w.at({b, i, j + 2}), last[i][j], 5e-5);
      }
  manual_seed(123);
  nn::MultiHeadAttention mha(3, 2, 6, 0.0, 2);
  const Tensor m = mha(batch_of_two(journey()));
  const float expected[6][2] = {{0.3190f, 0.4858f}, {0.2943f, 0.3897f}, {0.2856f, 0.3593f},
                                {0.2693f, 0.3873f}, {0.2639f, 0.3928f}, {0.2575f, 0.4028f}};
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 2; ++j) EXPECT_NEAR(m.at({b, i, j}), expected[i][j], 5e-5);
}

TEST(Modules, StateDictNamesFollowThePythonClasses) {
  nn::MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 2, true);
  std::vector<std::string> names;
  const nn::StateDict state = wrapper.state_dict();
  for (const auto& [name, t] : state.entries()) names.push_back(name);
  const std::vector<std::string> expected = {
      "heads.0.mask",           "heads.0.W_query.weight", "heads.0.W_query.bias", "heads.0.W_key.weight",
      "heads.0.W_key.bias",     "heads.0.W_value.weight", "heads.0.W_value.bias", "heads.1.mask",
      "heads.1.W_query.weight", "heads.1.W_query.bias",   "heads.1.W_key.weight", "heads.1.W_key.bias",
      "heads.1.W_value.weight", "heads.1.W_value.bias"};
  EXPECT_EQ(names, expected);
  nn::MultiHeadAttention mha(4, 6, 8, 0.1, 3);
  EXPECT_EQ(mha.parameter_count(), 3 * 6 * 4 + 6 * 6 + 6);
}

TEST(Modules, BadArgumentsAndInputsGetClearErrors) {
  EXPECT_THROW(nn::SelfAttentionV1(0, 2), ValueError);
  EXPECT_THROW(nn::SelfAttentionV2(3, 0), ValueError);
  EXPECT_THROW(nn::CausalAttention(3, 2, 6, 1.5), ValueError);
  try {
    nn::MultiHeadAttention(3, 5, 6, 0.0, 2);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by num_heads"), std::string::npos) << e.what();
  }
  nn::MultiHeadAttention mha(3, 4, 6, 0.0, 2);
  try {
    mha(Tensor::zeros({1, 7, 3}));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("context_length is 6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mha(Tensor::zeros({1, 5, 4})), ShapeError);
  EXPECT_THROW(mha(Tensor::zeros({5})), ShapeError);
  nn::SelfAttentionV1 v1(3, 2);
  EXPECT_THROW(v1(Tensor::zeros({6, 4})), ShapeError);
}

TEST(Modules, LoadStateDictIsStrictAndListsEveryProblem) {
  nn::SelfAttentionV2 a(3, 2, true);
  nn::StateDict state = a.state_dict();
  nn::StateDict bad;
  bad.insert("W_query.weight", Tensor::zeros({2, 3}));
  bad.insert("W_key.weight", Tensor::zeros({3, 3}));
  bad.insert("extra", Tensor::zeros({1}));
  try {
    a.load_state_dict(bad);
    FAIL();
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("missing keys: W_query.bias, W_key.bias, W_value.weight, W_value.bias"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected keys: extra"), std::string::npos) << m;
    EXPECT_NE(m.find("W_key.weight: expected (2, 3), got (3, 3)"), std::string::npos) << m;
  }
  // Nothing was half-loaded.
  EXPECT_TRUE(all_close(a.W_query.weight, *state.find("W_query.weight"), 0, 0));
}

// linear_concat equals torch.cat of the separate linears, in values and every gradient, whether the weights
// share one buffer (read in place) or not (copied together first), with and without biases.
TEST(Modules, LinearConcatEqualsTheSeparateLinears) {
  const std::vector<int64_t> outs = {3, 2, 5};
  for (const bool shared : {true, false}) {
    for (const bool with_bias : {true, false}) {
      SCOPED_TRACE(std::string(shared ? "shared buffer" : "separate tensors") + (with_bias ? ", biases" : ""));
      const Tensor all_w = random_tensor({10, 4}, 2), all_b = random_tensor({10}, 3);
      std::vector<Tensor> w, b, ref_w, ref_b;
      for (int64_t i = 0, at = 0; i < 3; at += outs[i], ++i) {
        const Tensor wi = all_w.view_at(at * 4, {outs[i], 4}), bi = all_b.view_at(at, {outs[i]});
        w.push_back((shared ? wi.detach() : wi.clone()).requires_grad_());
        if (with_bias) b.push_back((shared ? bi.detach() : bi.clone()).requires_grad_());
        ref_w.push_back(wi.clone().requires_grad_());
        ref_b.push_back(with_bias ? bi.clone().requires_grad_() : Tensor());
      }
      EXPECT_EQ(contiguous_run(w), shared);
      const Tensor x = random_tensor({2, 3, 4}, 1).requires_grad_(), ref_x = x.detach().clone().requires_grad_();
      const Tensor out = linear_concat(x, w, b);
      const Tensor ref = concat({linear(ref_x, ref_w[0], ref_b[0]), linear(ref_x, ref_w[1], ref_b[1]),
                                 linear(ref_x, ref_w[2], ref_b[2])}, -1);
      ASSERT_TRUE(all_close(out, ref));
      const Tensor d_out = random_tensor(out.shape(), 9);
      out.backward(d_out);
      ref.backward(d_out);
      EXPECT_TRUE(all_close(x.grad(), ref_x.grad()));
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(all_close(w[i].grad(), ref_w[i].grad())) << i;
        if (with_bias) {
          EXPECT_TRUE(all_close(b[i].grad(), ref_b[i].grad())) << i;
        }
      }
      // A second pass adds to the gradients, as every op does.
      linear_concat(x, w, b).backward(d_out);
      EXPECT_TRUE(all_close(w[1].grad(), mul(ref_w[1].grad(), 2.0f)));
    }
  }
  const Tensor x = random_tensor({2, 4}, 1);
  const std::vector<Tensor> ws = {random_tensor({3, 4}, 2), random_tensor({2, 5}, 3)};
  EXPECT_THROW(linear_concat(x, ws), ShapeError);  // in-features 4 and 5
  const std::vector<Tensor> fine = {random_tensor({3, 4}, 2), random_tensor({2, 4}, 3)};
  EXPECT_THROW(linear_concat(x, fine, std::vector<Tensor>{random_tensor({3}, 4)}), ValueError);  // 1 bias, 2 weights
  EXPECT_THROW(linear_concat(x, fine, std::vector<Tensor>{random_tensor({3}, 4), Tensor()}), ValueError);  // mixed
  EXPECT_THROW(linear_concat(random_tensor({2, 5}, 1), fine), ShapeError);
  EXPECT_THROW(linear_concat(x, std::vector<Tensor>{}), ValueError);
}

// MultiHeadAttention keeps W_query, W_key and W_value (and their biases) in one buffer, through loading too, and
// its one-product path gives what the three separate projections give: values and every gradient.
TEST(Modules, MultiHeadAttentionProjectsQueriesKeysAndValuesInOneProduct) {
  Generator gen(123);
  nn::MultiHeadAttention mha(6, 6, 8, 0.0, 2, true, gen);
  auto packed = [](const nn::MultiHeadAttention& m) {
    const Tensor w[] = {m.W_query.weight, m.W_key.weight, m.W_value.weight};
    const Tensor b[] = {m.W_query.bias, m.W_key.bias, m.W_value.bias};
    return contiguous_run(w) && contiguous_run(b);
  };
  EXPECT_TRUE(packed(mha));
  Generator other_gen(7);
  nn::MultiHeadAttention loaded(6, 6, 8, 0.0, 2, true, other_gen);
  loaded.load_state_dict(mha.state_dict());
  EXPECT_TRUE(packed(loaded));
  Tensor x = random_tensor({2, 8, 6}, 4).requires_grad_();
  auto run = [&](nn::MultiHeadAttention& m, bool one_product) {
    for (auto& [name, p] : m.named_parameters()) p.set_grad(Tensor());
    x.set_grad(Tensor());
    nn::AttentionStep::Record record;  // a record takes the three-projection path
    const Tensor out = one_product ? m(x) : m.forward(x, nn::AttentionStep{.record = &record});
    out.backward(random_tensor(out.shape(), 5));
    std::vector<Tensor> results{out.detach(), x.grad()};
    for (auto& [name, p] : m.named_parameters()) results.push_back(p.grad());
    return results;
  };
  const std::vector<Tensor> one = run(loaded, true), three = run(loaded, false);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(all_close(one[i], three[i], 1e-5, 1e-6)) << i;
  // A weight moved out of the buffer is copied in for the product: still the same numbers.
  loaded.W_key.relocate(Tensor::empty({6, 6}), Tensor::empty({6}));
  EXPECT_FALSE(packed(loaded));
  const std::vector<Tensor> moved = run(loaded, true);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(all_close(moved[i], three[i], 1e-5, 1e-6)) << i;
}

std::vector<std::string> cases() {
  std::ifstream in(fixture("modules/cases.txt"));
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.push_back(line);
  return names;
}

class TorchParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchParity, OutputAndAllGradientsMatch) {
  const std::string base = fixture("modules/" + GetParam());
  auto module = nn::load_attention_module(base + ".module.safetensors");
  const auto inputs = io::SafetensorsFile::open(base + ".input.safetensors");
  const auto expected = io::SafetensorsFile::open(base + ".expected.safetensors");
  nn::ApplyOptions options;
  options.train = expected.metadata().at("train") == "true";
  options.seed = std::stoull(expected.metadata().at("seed"));
  const auto result = nn::apply_module(*module, inputs.tensor("input"), inputs.tensor("grad_output"), options);
  ASSERT_EQ(result.size(), expected.tensors().size());
  for (const auto& [name, value] : result) {
    ASSERT_TRUE(expected.contains(name)) << name;
    EXPECT_TRUE(all_close(value, expected.tensor(name), 1e-5, 1e-6)) << GetParam() << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TorchParity, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace qkv::test
