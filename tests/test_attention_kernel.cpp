// The fused attention kernel against the plain materialised reference (double precision), over the shape
// list of the issue: T = 1, T not a multiple of the tiles, D ∈ {1, 2, 16, 32, 64, 80, 128}, many and few
// heads, causal and not, dropout on and off, both layouts, and Tq ≠ Tk (decoding with a cache).
#include <omp.h>

#include <tuple>

#include "helpers.hpp"
#include "qkv/kernels.hpp"

namespace qkv::test {
namespace {

struct Case {
  int64_t B, H, Tq, Tk, D;
  bool causal;
  float dropout;
  bool btc;  // (B, T, H·D) layout, else (B, H, T, D)
  int64_t H_kv = 0;     // grouped-query attention: 0 means H
  int64_t window = 0;   // sliding window
  float softcap = 0.0f;
  int64_t kv_heads() const { return H_kv > 0 ? H_kv : H; }
};

std::string name(const Case& c) {
  return "B" + std::to_string(c.B) + "H" + std::to_string(c.H) + "Tq" + std::to_string(c.Tq) + "Tk" + std::to_string(c.Tk) +
         "D" + std::to_string(c.D) + (c.causal ? "_causal" : "") + (c.dropout > 0 ? "_dropout" : "") + (c.btc ? "_btc" : "_bhtd") +
         (c.H_kv ? "_kv" + std::to_string(c.H_kv) : "") + (c.window ? "_window" + std::to_string(c.window) : "") +
         (c.softcap > 0 ? "_softcap" : "");
}

kernels::AttentionLayout layout_of(const Case& c, const kernels::AttentionDims& d) {
  kernels::AttentionLayout l;
  if (c.btc) {
    l.q = l.o = kernels::AttentionStrides::btc(d, c.Tq);
    l.k = l.v = kernels::AttentionStrides::btc(d.kv_heads(), d.D, c.Tk);
  } else {
    l.q = l.o = kernels::AttentionStrides::bhtd(d, c.Tq);
    l.k = l.v = kernels::AttentionStrides::bhtd(d.kv_heads(), d.D, c.Tk);
  }
  return l;
}

// 1e-5 relative, plus 1e-5 of the tensor's scale (its largest |value|, at least 1: the inputs are N(0, 1), so a
// gradient that is exactly 0 in theory, as dq is for T = 1, shows float rounding of about 1e-7).
::testing::AssertionResult agree(const Tensor& fused, const Tensor& reference) {
  double largest = 0;
  for (float v : reference.values()) largest = std::max(largest, std::fabs(static_cast<double>(v)));
  return all_close(fused, reference, 1e-5, 1e-5 * std::max(largest, 1.0));
}

// A case's dimensions, layout, inputs (N(0, 1), seeds 1 to 4: q, k, v, dO) and kernel options (dropout seed 1234).
struct CaseInputs {
  kernels::AttentionDims d;
  kernels::AttentionLayout layout;
  Tensor q, k, v, d_o;
  kernels::AttentionOptions options;
  explicit CaseInputs(const Case& c)
      : d{c.B, c.H, c.Tq, c.Tk, c.D, c.H_kv},
        layout(layout_of(c, d)),
        q(random_tensor({c.B * c.H * c.Tq * c.D}, 1)),
        k(random_tensor({c.B * c.kv_heads() * c.Tk * c.D}, 2)),
        v(random_tensor({c.B * c.kv_heads() * c.Tk * c.D}, 3)),
        d_o(random_tensor({c.B * c.H * c.Tq * c.D}, 4)),
        options{.causal = c.causal, .window = c.window, .softcap = c.softcap, .dropout_p = c.dropout, .seed = 1234} {}
};

class FusedVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(FusedVsReference, ValuesAndAllGradientsAgree) {
  const Case c = GetParam();
  const CaseInputs in(c);
  const kernels::AttentionDims& d = in.d;
  const auto& layout = in.layout;
  const Tensor &q = in.q, &k = in.k, &v = in.v, &d_o = in.d_o;
  const kernels::AttentionOptions options = in.options;
  Tensor o = Tensor::empty(q.shape()), o_ref = Tensor::empty(q.shape()), lse = Tensor::empty({c.B * c.H * c.Tq});
  kernels::attention_forward(d, layout, options, q.data(), k.data(), v.data(), o.data(), lse.data());
  kernels::attention_forward_reference(d, layout, options, q.data(), k.data(), v.data(), o_ref.data());
  EXPECT_TRUE(agree(o, o_ref)) << "output";
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()), dv = Tensor::empty(v.shape());
  Tensor dq_ref = Tensor::empty(q.shape()), dk_ref = Tensor::empty(k.shape()), dv_ref = Tensor::empty(v.shape());
  kernels::attention_backward(d, layout, options, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(),
                              dq.data(), dk.data(), dv.data());
  kernels::attention_backward_reference(d, layout, options, q.data(), k.data(), v.data(), d_o.data(), dq_ref.data(),
                                        dk_ref.data(), dv_ref.data());
  EXPECT_TRUE(agree(dq, dq_ref)) << "dq";
  EXPECT_TRUE(agree(dk, dk_ref)) << "dk";
  EXPECT_TRUE(agree(dv, dv_ref)) << "dv";
}

// With bf16 products (options.bf16): against the reference on the same rounded operands, to bf16's precision. The
// kernel also rounds each tile of P and dS to bf16 (relative 2⁻⁹), so each output may be off by about 2⁻⁹ of the
// magnitude of its sum, more where dS = P ∘ (G − Di) cancels: 4e-3 relative plus 8e-3 of the tensor's scale (the
// worst seen is 7e-3, D = 1). A wrong pairing of the bf16 operands or a
// skipped tile is off by the values themselves. Where the build or the CPU lacks AVX512_BF16 the flag is ignored:
// then the bits are float32's.
TEST_P(FusedVsReference, ValuesAndAllGradientsAgreeWithBf16Products) {
  const Case c = GetParam();
  const CaseInputs in(c);
  const kernels::AttentionDims& d = in.d;
  const auto& layout = in.layout;
  const Tensor &q = in.q, &k = in.k, &v = in.v, &d_o = in.d_o;
  kernels::AttentionOptions options = in.options;
  options.bf16 = true;
  kernels::AttentionOptions fp32 = options;
  fp32.bf16 = false;
  auto run = [&](const kernels::AttentionOptions& o, std::vector<Tensor>& out) {
    out = {Tensor::empty(q.shape()), Tensor::empty({c.B * c.H * c.Tq}), Tensor::empty(q.shape()),
           Tensor::empty(k.shape()), Tensor::empty(v.shape())};
    kernels::attention_forward(d, layout, o, q.data(), k.data(), v.data(), out[0].data(), out[1].data());
    kernels::attention_backward(d, layout, o, q.data(), k.data(), v.data(), out[0].data(), out[1].data(), d_o.data(),
                                out[2].data(), out[3].data(), out[4].data());
  };
  std::vector<Tensor> got, exact;
  run(options, got);
  run(fp32, exact);
  const char* names[] = {"output", "lse", "dq", "dk", "dv"};
  if (!kernels::attention_bf16_available()) {
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(all_close(got[i], exact[i], 0, 0)) << names[i];
    return;
  }
  Tensor o_ref = Tensor::empty(q.shape()), dq_ref = Tensor::empty(q.shape()), dk_ref = Tensor::empty(k.shape()),
         dv_ref = Tensor::empty(v.shape());
  kernels::attention_forward_reference(d, layout, options, q.data(), k.data(), v.data(), o_ref.data());
  kernels::attention_backward_reference(d, layout, options, q.data(), k.data(), v.data(), d_o.data(), dq_ref.data(),
                                        dk_ref.data(), dv_ref.data());
  auto agree_bf16 = [](const Tensor& fused, const Tensor& reference) {
    double largest = 0;
    for (float x : reference.values()) largest = std::max(largest, std::fabs(static_cast<double>(x)));
    return all_close(fused, reference, 4e-3, 8e-3 * std::max(largest, 1.0));
  };
  EXPECT_TRUE(agree_bf16(got[0], o_ref)) << "output";
  EXPECT_TRUE(agree_bf16(got[2], dq_ref)) << "dq";
  EXPECT_TRUE(agree_bf16(got[3], dk_ref)) << "dk";
  EXPECT_TRUE(agree_bf16(got[4], dv_ref)) << "dv";
  // The log-sum-exp (what the pictures are recomputed from) to bf16's precision of the scores, |S| ≲ 2⁻⁸ |S| + 1e-3.
  EXPECT_TRUE(all_close(got[1], exact[1], 1e-2, 1e-2)) << "lse";
}

// K and V held in bf16 (a bf16 KV cache) give the bits of the same call on float32 K and V holding the same values:
// with bf16 products rounding a bf16 value is exact, and without them K and V are widened exactly.
TEST_P(FusedVsReference, Bf16KeysAndValuesAreReadAsTheirFloat32Values) {
  const Case c = GetParam();
  if (c.dropout > 0) return;  // inference only
  const kernels::AttentionDims d{c.B, c.H, c.Tq, c.Tk, c.D, c.H_kv};
  const auto layout = layout_of(c, d);
  const Tensor q = random_tensor({c.B * c.H * c.Tq * c.D}, 1);
  const int64_t kv = c.B * c.kv_heads() * c.Tk * c.D;
  std::vector<uint16_t> k16(static_cast<size_t>(kv)), v16(static_cast<size_t>(kv));
  const Tensor k = random_tensor({kv}, 2), v = random_tensor({kv}, 3);
  kernels::f32_to_bf16(k.data(), k16.data(), kv);
  kernels::f32_to_bf16(v.data(), v16.data(), kv);
  Tensor kw = Tensor::empty({kv}), vw = Tensor::empty({kv});
  kernels::bf16_to_f32(k16.data(), kw.data(), kv);
  kernels::bf16_to_f32(v16.data(), vw.data(), kv);
  kernels::AttentionOptions options{.causal = c.causal, .window = c.window, .softcap = c.softcap, .bf16 = true};
  Tensor o = Tensor::empty(q.shape()), lse = Tensor::empty({c.B * c.H * c.Tq});
  Tensor o_ref = Tensor::empty(q.shape()), lse_ref = Tensor::empty({c.B * c.H * c.Tq});
  kernels::attention_forward_bf16_kv(d, layout, options, q.data(), k16.data(), v16.data(), o.data(), lse.data());
  options.bf16 = kernels::attention_bf16_available();
  kernels::attention_forward(d, layout, options, q.data(), kw.data(), vw.data(), o_ref.data(), lse_ref.data());
  EXPECT_TRUE(all_close(o, o_ref, 0, 0)) << "output";
  EXPECT_TRUE(all_close(lse, lse_ref, 0, 0)) << "lse";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t D : {1, 2, 16, 32, 64, 80, 128})
    for (bool causal : {false, true}) out.push_back({1, 2, 37, 37, D, causal, 0.0f, true});
  for (bool causal : {false, true})
    for (float dropout : {0.0f, 0.3f})
      for (bool btc : {false, true}) {
        out.push_back({2, 3, 1, 1, 16, causal, dropout, btc});        // T = 1
        out.push_back({2, 3, 130, 130, 24, causal, dropout, btc});    // T beyond two blocks, not a multiple
        out.push_back({1, 1, 64, 64, 64, causal, dropout, btc});      // exactly one key block
        out.push_back({3, 12, 49, 49, 8, causal, dropout, btc});      // B·H large, T = one query block + 1
      }
  out.push_back({1, 2, 1, 70, 32, true, 0.0f, true});    // decoding: one query against a cache of 70 keys
  out.push_back({2, 2, 5, 90, 16, true, 0.2f, false});   // a chunk of 5 new queries against 90 keys
  out.push_back({1, 1, 200, 33, 16, false, 0.0f, true}); // more queries than keys
  // Grouped-query and multi-query attention (H_kv divides H), many and few groups, both layouts, dropout, a cache.
  for (bool btc : {false, true})
    for (bool causal : {false, true}) {
      out.push_back({2, 4, 70, 70, 16, causal, 0.0f, btc, 2});
      out.push_back({1, 6, 130, 130, 24, causal, 0.2f, btc, 1});     // multi-query
      out.push_back({3, 8, 17, 17, 8, causal, 0.0f, btc, 4});
    }
  out.push_back({1, 4, 1, 90, 32, true, 0.0f, true, 2});            // decoding against a cache, GQA
  out.push_back({1, 4, 5, 90, 16, true, 0.0f, false, 1, 31});        // a chunk against a cache, MQA, window
  // Sliding windows: narrower than a block, spanning blocks, wider than T, with GQA, dropout and a cache.
  for (int64_t window : {1, 7, 50, 200, 500})
    for (int64_t T : {17, 300}) out.push_back({1, 2, T, T, 16, true, 0.0f, true, 0, window});
  out.push_back({2, 4, 260, 260, 24, true, 0.3f, false, 2, 45});
  out.push_back({1, 2, 100, 100, 8, false, 0.0f, true, 0, 20});      // a window without the causal mask: the past only
  // Soft-capping (Gemma 2), alone and with everything else.
  out.push_back({1, 2, 60, 60, 16, true, 0.0f, true, 0, 0, 0.5f});
  out.push_back({2, 4, 140, 140, 16, true, 0.2f, false, 2, 70, 1.5f});
  out.push_back({1, 2, 37, 37, 32, false, 0.0f, true, 1, 0, 20.0f});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedVsReference, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name(info.param); });

// The fused forward and backward with these options: O, dQ, dK and dV, one after another.
std::vector<float> forward_and_backward(const kernels::AttentionDims& d, const kernels::AttentionLayout& layout,
                                        const kernels::AttentionOptions& options, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& d_o) {
  Tensor o = Tensor::empty(q.shape()), lse = Tensor::empty({d.B * d.H * d.Tq}), dq = Tensor::empty(q.shape()),
         dk = Tensor::empty(k.shape()), dv = Tensor::empty(v.shape());
  kernels::attention_forward(d, layout, options, q.data(), k.data(), v.data(), o.data(), lse.data());
  kernels::attention_backward(d, layout, options, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(),
                              dq.data(), dk.data(), dv.data());
  std::vector<float> all = o.to_vector();
  for (const Tensor* t : {&dq, &dk, &dv}) all.insert(all.end(), t->data(), t->data() + t->numel());
  return all;
}

// Few heads (items go round-robin between threads, and the backward splits heads into blocks) and many heads (each
// thread takes a contiguous run of heads), with and without dropout.
void expect_same_bits_for_any_thread_count(int64_t B, int64_t H, int64_t T, int64_t D, float dropout, bool bf16 = false) {
  const kernels::AttentionDims d{B, H, T, T, D};
  const auto strides = kernels::AttentionStrides::btc(d, T);
  const kernels::AttentionLayout layout{strides, strides, strides, strides};
  const int64_t n = B * T * H * D;
  const Tensor q = random_tensor({n}, 1), k = random_tensor({n}, 2), v = random_tensor({n}, 3);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    const kernels::AttentionOptions options{.causal = true, .dropout_p = dropout, .seed = 9, .threads = threads, .bf16 = bf16};
    results.push_back(forward_and_backward(d, layout, options, q, k, v, q));
  }
  EXPECT_EQ(results[0], results[1]) << B << "x" << H << " heads, T " << T;
  EXPECT_EQ(results[0], results[2]) << B << "x" << H << " heads, T " << T;
}

TEST(FusedAttention, SameBitsForAnyThreadCount) {
  expect_same_bits_for_any_thread_count(2, 3, 150, 32, 0.1f);
  expect_same_bits_for_any_thread_count(2, 12, 100, 16, 0.0f);
  // bf16 products: the same ownership, so the same guarantee
  expect_same_bits_for_any_thread_count(2, 3, 150, 32, 0.1f, true);
  expect_same_bits_for_any_thread_count(2, 12, 100, 16, 0.0f, true);
}

// dK and dV of a K/V head are sums over its group of query heads: for 1, 2 and 3 threads (one pass with whole groups,
// and two passes split by blocks) the bits are the same, with a sliding window too.
TEST(FusedAttention, GroupedQuerySameBitsForAnyThreadCount) {
  for (auto [B, H, H_kv, window] : {std::tuple{1, 4, 2, 0}, {2, 8, 2, 33}, {1, 6, 1, 0}, {3, 8, 4, 70}}) {
    const int64_t T = 150, D = 16;
    const kernels::AttentionDims d{B, H, T, T, D, H_kv};
    const kernels::AttentionLayout layout{kernels::AttentionStrides::btc(d, T),
                                          kernels::AttentionStrides::btc(H_kv, D, T),
                                          kernels::AttentionStrides::btc(H_kv, D, T), kernels::AttentionStrides::btc(d, T)};
    const Tensor q = random_tensor({B * T * H * D}, 1), k = random_tensor({B * T * H_kv * D}, 2),
                 v = random_tensor({B * T * H_kv * D}, 3), d_o = random_tensor({B * T * H * D}, 4);
    for (bool bf16 : {false, true}) {  // bf16 products: the same ownership, so the same guarantee
      std::vector<std::vector<float>> results;
      for (int threads : {1, 2, 3}) {
        const kernels::AttentionOptions options{.causal = true, .window = window, .threads = threads, .bf16 = bf16};
        results.push_back(forward_and_backward(d, layout, options, q, k, v, d_o));
      }
      EXPECT_EQ(results[0], results[1]) << B << "x" << H << "/" << H_kv << " window " << window << " bf16 " << bf16;
      EXPECT_EQ(results[0], results[2]) << B << "x" << H << "/" << H_kv << " window " << window << " bf16 " << bf16;
    }
  }
}

// The weights recomputed for a picture (attention_probabilities) are the reference's softmax, with GQA, a window and
// soft-capping: rows sum to 1 over exactly the keys in the window.
TEST(FusedAttention, ProbabilitiesOfAWindowedGroupedHead) {
  const int64_t B = 1, H = 4, H_kv = 2, T = 90, D = 8, W = 20;
  const kernels::AttentionDims d{B, H, T, T, D, H_kv};
  const kernels::AttentionLayout layout{kernels::AttentionStrides::btc(d, T), kernels::AttentionStrides::btc(H_kv, D, T),
                                        kernels::AttentionStrides::btc(H_kv, D, T), kernels::AttentionStrides::btc(d, T)};
  const Tensor q = random_tensor({T * H * D}, 1), k = random_tensor({T * H_kv * D}, 2), v = random_tensor({T * H_kv * D}, 3);
  const kernels::AttentionOptions options{.causal = true, .window = W, .softcap = 2.0f};
  Tensor o = Tensor::empty(q.shape()), lse = Tensor::empty({B * H * T}), weights = Tensor::empty({T, T});
  kernels::attention_forward(d, layout, options, q.data(), k.data(), v.data(), o.data(), lse.data());
  kernels::attention_probabilities(d, layout, options, q.data(), k.data(), lse.data(), 0, 3, weights.data());
  for (int64_t i = 0; i < T; ++i) {
    double total = 0;
    for (int64_t j = 0; j < T; ++j) {
      const float w = weights.data()[i * T + j];
      if (j > i || j <= i - W) {
        EXPECT_EQ(w, 0.0f) << i << "," << j;
      } else {
        EXPECT_GT(w, 0.0f) << i << "," << j;
      }
      total += w;
    }
    EXPECT_NEAR(total, 1.0, 1e-5) << i;
  }
}

TEST(FusedAttention, DropoutKeepsAboutOneMinusP) {
  int kept = 0;
  for (int64_t i = 0; i < 100; ++i)
    for (int64_t j = 0; j < 100; ++j) kept += kernels::attention_dropout_keep(5, 0.3f, 1, i, j);
  EXPECT_NEAR(kept / 10000.0, 0.7, 0.02);
  EXPECT_TRUE(kernels::attention_dropout_keep(5, 0.0f, 1, 2, 3));
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

std::vector<std::pair<std::string, Tensor>> run_with_path(nn::UnaryModule& m, const Tensor& x, const Tensor& g,
                                                          nn::AttentionPath path) {
  m.set_attention_path(path);
  m.zero_grad();
  Tensor input = x.clone().requires_grad_();
  Tensor out = m(input);
  out.backward(g);
  std::vector<std::pair<std::string, Tensor>> result = {{"output", out.detach()}, {"grad.input", input.grad()}};
  for (auto& [name, p] : m.named_parameters()) result.emplace_back("grad." + name, p.grad().clone());
  return result;
}

TEST(FusedModules, CausalAndMultiHeadAgreeWithThePlainPath) {
  manual_seed(3);
  nn::MultiHeadAttention mha(24, 48, 80, 0.0, 4, true);
  nn::CausalAttention causal(24, 16, 80, 0.0, true);
  const Tensor x = random_tensor({3, 77, 24}, 5);
  for (nn::UnaryModule* m : {static_cast<nn::UnaryModule*>(&mha), static_cast<nn::UnaryModule*>(&causal)}) {
    const Tensor g = random_tensor(m->forward(x).shape(), 6);
    const auto fused = run_with_path(*m, x, g, nn::AttentionPath::Fused);
    const auto plain = run_with_path(*m, x, g, nn::AttentionPath::Plain);
    ASSERT_EQ(fused.size(), plain.size());
    for (size_t i = 0; i < fused.size(); ++i)
      EXPECT_TRUE(all_close(fused[i].second, plain[i].second, 1e-5, 1e-5)) << m->type_name() << " " << fused[i].first;
  }
}

TEST(FusedModules, DropoutIsSeededAndOffInEval) {
  Generator gen(11);
  nn::MultiHeadAttention mha(8, 8, 16, 0.5, 2, false, gen);
  const Tensor x = random_tensor({2, 16, 8}, 1);
  mha.eval();
  const Tensor a = mha(x), b = mha(x);
  EXPECT_TRUE(all_close(a, b, 0, 0));
  mha.train();
  gen.manual_seed(4);
  const Tensor c = mha(x);
  gen.manual_seed(4);
  const Tensor d = mha(x);
  EXPECT_TRUE(all_close(c, d, 0, 0));       // same seed, same mask
  EXPECT_FALSE(all_close(a, c, 1e-3, 1e-3));  // and dropout changed something
}

TEST(FusedOp, Gradcheck) {
  AttentionConfig config;
  config.num_heads = 2;
  config.causal = true;
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& t) { return scaled_dot_product_attention(t[0], t[1], t[2], config); },
                        {random_tensor({2, 5, 6}, 1), random_tensor({2, 5, 6}, 2), random_tensor({2, 5, 6}, 3)}));
  AttentionConfig bhtd;
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& t) { return scaled_dot_product_attention(t[0], t[1], t[2], bhtd); },
                        {random_tensor({1, 2, 4, 3}, 4), random_tensor({1, 2, 6, 3}, 5), random_tensor({1, 2, 6, 3}, 6)}));
  // Grouped-query attention with a window and soft-capping: 4 query heads read 2 K/V heads.
  AttentionConfig gqa;
  gqa.num_heads = 4;
  gqa.causal = true;
  gqa.window = 3;
  gqa.softcap = 1.5f;
  gqa.scale = 0.7f;
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& t) { return scaled_dot_product_attention(t[0], t[1], t[2], gqa); },
                        {random_tensor({2, 6, 8}, 7), random_tensor({2, 6, 4}, 8), random_tensor({2, 6, 4}, 9)}));
  gqa.num_kv_heads = 1;  // the packed form, multi-query: (B, T, (4 + 2)·2)
  EXPECT_TRUE(gradcheck([&](const std::vector<Tensor>& t) { return scaled_dot_product_attention(t[0], gqa); },
                        {random_tensor({2, 5, 12}, 10)}));
}

// K/V heads that do not divide the query heads, or a count that disagrees with num_kv_heads, are ShapeErrors.
TEST(FusedOp, GroupedQueryShapesAreChecked) {
  AttentionConfig config;
  config.num_heads = 4;
  const Tensor q = random_tensor({1, 3, 8}, 1);
  EXPECT_THROW(scaled_dot_product_attention(q, random_tensor({1, 3, 6}, 2), random_tensor({1, 3, 6}, 3), config), ShapeError);
  EXPECT_THROW(scaled_dot_product_attention(q, random_tensor({1, 3, 5}, 2), random_tensor({1, 3, 5}, 3), config), ShapeError);
  config.num_kv_heads = 1;
  EXPECT_THROW(scaled_dot_product_attention(q, random_tensor({1, 3, 4}, 2), random_tensor({1, 3, 4}, 3), config), ShapeError);
  config.num_kv_heads = 3;
  EXPECT_THROW(scaled_dot_product_attention(random_tensor({1, 3, 20}, 1), config), ShapeError);
  config.num_kv_heads = 0;
  config.window = -1;
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, config), ValueError);
}

// One (B, T, 3·H·D) tensor of queries, keys and values side by side gives the same bits as the three tensors
// (the kernel only reads them with other strides), dropout included, and its gradient is theirs side by side.
TEST(FusedOp, PackedInputEqualsThreeTensors) {
  const int64_t B = 2, T = 7, C = 6;
  const Tensor qkv = random_tensor({B, T, 3 * C}, 7).requires_grad_();
  std::vector<Tensor> parts;
  for (int64_t part = 0; part < 3; ++part) {
    Tensor t = Tensor::empty({B, T, C});
    for (int64_t row = 0; row < B * T; ++row)
      std::copy_n(qkv.data() + row * 3 * C + part * C, C, t.data() + row * C);
    parts.push_back(t.requires_grad_());
  }
  AttentionConfig config;
  config.num_heads = 3;
  config.causal = true;
  config.dropout_p = 0.3;
  config.training = true;
  Generator gen_packed(5), gen_parts(5);
  config.generator = &gen_packed;
  const Tensor packed = scaled_dot_product_attention(qkv, config);
  config.generator = &gen_parts;
  const Tensor separate = scaled_dot_product_attention(parts[0], parts[1], parts[2], config);
  EXPECT_TRUE(all_close(packed, separate, 0, 0));
  const Tensor d_out = random_tensor({B, T, C}, 8);
  packed.backward(d_out);
  separate.backward(d_out);
  for (int64_t part = 0; part < 3; ++part)
    for (int64_t row = 0; row < B * T; ++row)
      for (int64_t c = 0; c < C; ++c)
        ASSERT_EQ(qkv.grad().data()[row * 3 * C + part * C + c], parts[part].grad().data()[row * C + c]) << part;
  EXPECT_THROW(scaled_dot_product_attention(random_tensor({B, T, 3 * C + 1}, 1), config), ShapeError);
  EXPECT_THROW(scaled_dot_product_attention(random_tensor({1, B, T, 3 * C}, 1), config), ShapeError);
  config.kv_tokens = 3;
  EXPECT_THROW(scaled_dot_product_attention(random_tensor({B, T, 3 * C}, 1), config), ValueError);
}

// Documented behaviour (README "Fused attention"): NaN or ±Inf in q, k or v make the affected rows NaN, as in
// PyTorch; T = 0 gives an empty result; D = 0 gives an empty result; nothing crashes.
TEST(FusedOp, NaNInfAndEmptyShapes) {
  AttentionConfig config;
  config.causal = true;
  Tensor q = random_tensor({1, 6, 4}, 1), k = random_tensor({1, 6, 4}, 2), v = random_tensor({1, 6, 4}, 3);
  k.data()[3 * 4] = NAN;  // key of token 3: rows 3.. see it
  Tensor out = scaled_dot_product_attention(q, k, v, config);
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(std::isnan(out.at({0, i, d})), i >= 3) << i << "," << d;
  Tensor inf_q = random_tensor({1, 6, 4}, 1);
  inf_q.data()[0] = INFINITY;
  out = scaled_dot_product_attention(inf_q, random_tensor({1, 6, 4}, 2), v, config);
  for (int64_t d = 0; d < 4; ++d) EXPECT_TRUE(std::isnan(out.at({0, 0, d})));
  for (int64_t d = 0; d < 4; ++d) EXPECT_FALSE(std::isnan(out.at({0, 1, d})));
  const Tensor empty = Tensor::zeros({2, 0, 8});
  Tensor e = scaled_dot_product_attention(empty.clone().requires_grad_(), empty.clone().requires_grad_(),
                                          empty.clone().requires_grad_(), config);
  EXPECT_EQ(e.shape(), (Shape{2, 0, 8}));
  const Tensor no_dim = Tensor::zeros({2, 5, 0});
  EXPECT_EQ(scaled_dot_product_attention(no_dim, no_dim, no_dim, config).shape(), (Shape{2, 5, 0}));
  config.num_heads = 3;
  EXPECT_THROW(scaled_dot_product_attention(q, k, v, config), ShapeError);  // 4 channels, 3 heads
}

}  // namespace
}  // namespace qkv::test
