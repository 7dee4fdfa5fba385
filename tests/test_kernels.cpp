// Kernels against their plain scalar references.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "qkv/kernels.hpp"

namespace qkv::test {
namespace {

TEST(Kernels, GemmMatchesReferenceForEveryTransposeCombination) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] : {std::tuple{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 48, 80}}) {
        const Tensor A = random_tensor(ta ? Shape{K, M} : Shape{M, K}, 1);
        const Tensor B = random_tensor(tb ? Shape{N, K} : Shape{K, N}, 2);
        Tensor C = random_tensor({M, N}, 3), R = C.clone();
        kernels::gemm(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 2.0f, C.data(), N);
        kernels::gemm_reference(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 2.0f, R.data(), N);
        EXPECT_TRUE(all_close(C, R, 1e-5, 1e-5)) << "ta=" << ta << " tb=" << tb << " " << M << "x" << N << "x" << K;
      }
}

TEST(Kernels, GemmWithEmptyInnerDimensionScalesC) {
  Tensor C = Tensor::full({2, 2}, 3.0f);
  kernels::gemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, C.data(), 2);
  EXPECT_TRUE(all_close(C, Tensor::full({2, 2}, 1.5f)));
}

// Benchmarks print which BLAS kernels ran (OpenBLAS picks them from the CPU or OPENBLAS_CORETYPE).
TEST(Kernels, GemmBackendNamesTheBlasAndItsKernels) {
  const std::string name = kernels::gemm_backend();
  EXPECT_EQ(name.rfind("OpenBLAS ", 0), 0u) << name;
  EXPECT_GT(name.size(), std::string("OpenBLAS ").size()) << name;
}

// Denormals::Flush: products whose terms fall below float's smallest normal give 0 instead of denormals, on every
// thread of the product; normal products keep their bits; and each thread's own mode is back afterwards.
TEST(Kernels, GemmFlushesDenormalsOnlyWhenAskedAndRestoresTheMode) {
  const int64_t M = 256, N = 256, K = 64;  // 8 MFLOP: split between threads when there are several
  const float tiny = 1e-36f, small = 1e-4f;  // tiny · small = 1e-40, a denormal
  std::vector<float> A(static_cast<size_t>(M * K), tiny), B(static_cast<size_t>(K * N), small);
  std::vector<float> keep(static_cast<size_t>(M * N)), flushed(keep.size());
  for (int threads : {1, 2}) {
    const ThreadCount scope(threads);
    kernels::gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, flushed.data(), N, kernels::Denormals::Flush);
    kernels::gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, keep.data(), N);
    for (size_t i = 0; i < keep.size(); ++i) {
      ASSERT_EQ(flushed[i], 0.0f) << "threads " << threads << " element " << i;
      ASSERT_GT(keep[i], 0.0f) << "the mode leaked into a later product: threads " << threads << " element " << i;
      ASSERT_LT(keep[i], std::numeric_limits<float>::min());
    }
    volatile float x = tiny;  // the calling thread's own arithmetic keeps its denormals too
    EXPECT_GT(x * small, 0.0f);
  }
  const Tensor a = random_tensor({M, K}, 4), b = random_tensor({K, N}, 5);  // normal values: the same bits either way
  kernels::gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, flushed.data(), N, kernels::Denormals::Flush);
  kernels::gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, keep.data(), N);
  EXPECT_EQ(flushed, keep);
}

// AdamW's moments never hold denormals (each later step would pay a microcode assist per element), and the
// weights come out as the plain reference's, which keeps them.
TEST(Kernels, AdamWFlushesDenormalMomentsAndKeepsTheWeights) {
  const int64_t n = 100000;  // parallel when there are threads
  const float denormal = 1e-40f;
  std::vector<float> w(n, 0.5f), g(n, 0.0f), m(n, denormal), v(n, denormal);
  for (int64_t j = 0; j < n; j += 2) g[static_cast<size_t>(j)] = 1e-21f;  // (1 − β2)·g² ≈ 1e-45: a denormal
  std::vector<float> w_ref = w, m_ref = m, v_ref = v;
  const kernels::AdamWStep s{0.999f, 0.9f, 0.999f, 0.1f, 0.001f, 1e-3f, 0.05f, 1e-8f};
  kernels::adamw_update(w.data(), g.data(), m.data(), v.data(), n, s);
  kernels::adamw_update_reference(w_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, s);
  EXPECT_GT(v_ref[1], 0.0f);  // the reference keeps the denormals this test is about
  for (int64_t j = 0; j < n; ++j) {
    const size_t i = static_cast<size_t>(j);
    ASSERT_TRUE(v[i] == 0.0f || v[i] >= std::numeric_limits<float>::min()) << "v[" << j << "] = " << v[i];
    ASSERT_TRUE(m[i] == 0.0f || std::fabs(m[i]) >= std::numeric_limits<float>::min()) << "m[" << j << "] = " << m[i];
    ASSERT_EQ(w[i], w_ref[i]) << j;
  }
  volatile float x = denormal;  // the calling thread's own arithmetic keeps its denormals
  EXPECT_GT(x * 0.5f, 0.0f);
}

// Probabilities far below float's precision come out as exact zeros, never denormals (which made every later
// product ~100× slower: a tied GPT-2 head at random init trained 15× slower).
TEST(Kernels, SoftmaxAndCrossEntropyLeaveNoDenormals) {
  const int64_t V = 1000, rows = 3;
  Tensor logits = Tensor::empty({rows, V});
  for (int64_t i = 0; i < rows * V; ++i) logits.data()[i] = static_cast<float>((i * 37) % V) * 0.2f;  // a 200-wide spread
  Tensor probs = Tensor::empty(logits.shape()), grad = Tensor::zeros(logits.shape());
  kernels::softmax_rows(logits.data(), probs.data(), rows, V);
  const std::vector<int64_t> targets{0, 1, 2};
  kernels::cross_entropy_backward(probs.data(), targets.data(), grad.data(), rows, V, -100, 1.0f / 4096);
  int zeros = 0;
  for (const Tensor* t : {&probs, &grad})
    for (float v : t->values()) {
      EXPECT_TRUE(v == 0.0f || std::fabs(v) >= std::numeric_limits<float>::min()) << v;
      zeros += v == 0.0f;
    }
  EXPECT_GT(zeros, 0);
  Tensor sums = Tensor::zeros({rows});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < V; ++j) sums.data()[r] += probs.data()[r * V + j];
  EXPECT_TRUE(all_close(sums, Tensor::ones({rows}), 1e-5, 1e-5));
}

// Training turns on the block cache: a freed block is handed out again for the same size (no page faults).
TEST(Memory, BlockCacheReusesAFreedBlockOfTheSameSize) {
  memory::set_block_cache_limit(int64_t{64} << 20);
  const float* first = nullptr;
  {
    const Tensor a = Tensor::zeros({int64_t{1} << 21});  // 8 MiB
    first = a.data();
  }
  const Tensor b = Tensor::empty({int64_t{1} << 21});
  EXPECT_EQ(b.data(), first);
  const Tensor c = Tensor::zeros({int64_t{1} << 21});  // the cache is empty again: a fresh block, zeroed
  EXPECT_NE(c.data(), first);
  EXPECT_EQ(c.data()[12345], 0.0f);
  // Small blocks too, and kernel scratch shares the cache with tensors.
  const float* small = nullptr;
  { small = Tensor::zeros({100}).data(); }
  const int64_t fresh = memory::fresh_blocks();
  { EXPECT_EQ(Tensor::empty({100}).data(), small); }
  { EXPECT_EQ(memory::Buffer<float>(100).data(), small); }
  EXPECT_EQ(memory::fresh_blocks(), fresh);
  memory::set_block_cache_limit(0);  // and a lower limit frees what the cache held
  { const Tensor fresh_one = Tensor::zeros({100}); }
  EXPECT_EQ(memory::fresh_blocks(), fresh + 1);
}

// AddressSanitizer builds give every block back to the system (for their use-after-free checks) and leave a Region
// empty: the tests below check that instead.
#if defined(__SANITIZE_ADDRESS__) || defined(QKV_ASAN)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif

// A layer's activations (64 KiB to 4 MiB) are reused without the block cache: freed, the next block of the same size is
// that one, not a fresh one (glibc would map and unmap such blocks, or trim them off its heap, and every pass would
// fault them in again); blocks of 4 MiB and more still go back to the system.
TEST(Memory, MediumBlocksAreReusedWithoutTheBlockCache) {
  memory::set_block_cache_limit(0);
  constexpr int64_t kOdd = 300007;  // 1.14 MiB of floats: a size no other test asks for
  const float* first = nullptr;
  { first = Tensor::zeros({kOdd}).data(); }
  const int64_t fresh = memory::fresh_blocks();
  {
    const Tensor again = Tensor::zeros({kOdd});
    if (!kAsan) EXPECT_EQ(again.data(), first);
    EXPECT_EQ(again.data()[kOdd - 1], 0.0f);  // zeros() still zeroes what it reuses
  }
  EXPECT_EQ(memory::fresh_blocks(), fresh + (kAsan ? 1 : 0));
  // More than 32 MiB of other medium sizes freed: the cache makes room, and the last size freed is reused again.
  for (int64_t k = 0; k < 12; ++k) { const Tensor other = Tensor::empty({(int64_t{3} << 20) / 4 - 1024 * k}); }
  const int64_t after_others = memory::fresh_blocks();
  { const Tensor last = Tensor::empty({(int64_t{3} << 20) / 4 - 1024 * 11}); }
  EXPECT_EQ(memory::fresh_blocks(), after_others + (kAsan ? 1 : 0));
  { const Tensor big = Tensor::empty({int64_t{1} << 21}); }  // 8 MiB: fresh each time
  const int64_t before_big = memory::fresh_blocks();
  { const Tensor big = Tensor::empty({int64_t{1} << 21}); }
  EXPECT_EQ(memory::fresh_blocks(), before_big + 1);
}

// A block held serves smaller requests, and goes back whole: a shorter batch reuses a longer one's blocks. The block
// cache (training) serves requests down to a quarter of a block, the medium cache (64 KiB to 4 MiB, always on) down
// to half. Below 64 KiB, and under AddressSanitizer (whose bounds checks need the size asked for), only its own size.
TEST(Memory, ACachedBlockServesSmallerRequests) {
  memory::set_block_cache_limit(int64_t{256} << 20);
  constexpr int64_t kBlock = int64_t{1} << 23;  // 32 MiB of floats (a quarter is past the medium cache's 4 MiB)
  const float* first = nullptr;
  { first = Tensor::empty({kBlock}).data(); }
  const int64_t in_use = memory::bytes_in_use(), fresh = memory::fresh_blocks();
  {
    const Tensor shorter = Tensor::zeros({kBlock / 4 + 1});
    EXPECT_EQ(shorter.data() == first, !kAsan);
    EXPECT_EQ(memory::bytes_in_use() - in_use, kAsan ? (kBlock / 4 + 1) * 4 : kBlock * 4);  // the whole block counts
    EXPECT_EQ(shorter.data()[kBlock / 4], 0.0f);
  }
  EXPECT_EQ(memory::bytes_in_use(), in_use);
  EXPECT_EQ(memory::fresh_blocks(), fresh + (kAsan ? 1 : 0));
  {
    const Tensor full = Tensor::empty({kBlock});  // it went back whole: the full size fits it again
    EXPECT_EQ(full.data(), first);
    const Tensor under_a_quarter = Tensor::empty({kBlock / 4 - 1024});  // less than a quarter never takes it
    EXPECT_NE(under_a_quarter.data(), first);
  }
  const float* small = nullptr;
  { small = Tensor::empty({1000}).data(); }  // 4 KB
  { EXPECT_NE(Tensor::empty({900}).data(), small); }
  memory::set_block_cache_limit(0);
  { const Tensor fresh_one = Tensor::empty({kBlock}); }
  const int64_t before = memory::fresh_blocks();
  { const Tensor again = Tensor::empty({kBlock / 4 + 1}); }  // nothing held now: the limit's drop freed it
  EXPECT_EQ(memory::fresh_blocks(), before + 1);
  // The medium cache: a 3 MiB block (or one up to 4 MiB that other tests left) serves 2 MiB, and not under half of it.
  constexpr int64_t kMedium = (int64_t{3} << 20) / 4 - 4099;
  const float* medium = nullptr;
  { medium = Tensor::empty({kMedium}).data(); }
  const int64_t before_medium = memory::fresh_blocks();
  { const Tensor two_mib = Tensor::empty({int64_t{1} << 19}); }
  EXPECT_EQ(memory::fresh_blocks(), before_medium + (kAsan ? 1 : 0));
  { EXPECT_NE(Tensor::empty({kMedium / 2 - 1024}).data(), medium); }
}

// Steps whose batches change length, as instruction tuning's do: once the longest has run, shorter ones take (almost)
// nothing from the system, and a longer one afterwards replaces the blocks it outgrows rather than holding both.
// Blocks are taken smallest-first, so a request can find the blocks that would fit it taken by smaller ones (one
// small fresh block here and there): the fresh bytes stay under 1/8 of what the steps ask for. Blocks kept by exact
// size only, as before, took 85-94% of them fresh.
TEST(Memory, StepsOfChangingLengthReuseTheLongestStepsBlocks) {
  memory::set_block_cache_limit(0);
  memory::reset_peak();
  constexpr int64_t kRow = 4096;  // floats a position of the narrowest width
  auto step = [](int64_t T) {     // a layer's activations: three widths, two of each, 0.5 to 9 MiB
    std::vector<Tensor> held;
    for (int i = 0; i < 6; ++i) held.push_back(Tensor::empty({T * kRow * (1 + i % 3)}));
  };
  auto asked = [](std::initializer_list<int64_t> lengths) {  // the bytes the steps of these lengths ask for
    int64_t bytes = 0;
    for (const int64_t T : lengths) bytes += T * kRow * 4 * 12;
    return bytes;
  };
  const int64_t floor = int64_t{1} << 20;
  memory::cache_blocks_for_steps(floor);
  step(128);  // over the floor: the blocks go back, and the limit follows the step's peak
  memory::cache_blocks_for_steps(floor);
  step(128);
  memory::cache_blocks_for_steps(floor);
  const int64_t fresh = memory::fresh_blocks(), fresh_bytes = memory::fresh_bytes();
  const std::initializer_list<int64_t> shorter = {100, 65, 128, 90, 127, 64};
  for (const int64_t T : shorter) {
    step(T);
    memory::cache_blocks_for_steps(floor);
    EXPECT_LE(memory::bytes_in_use() + memory::block_cache_bytes(), memory::block_cache_limit());
  }
  if (!kAsan) EXPECT_LE(memory::fresh_bytes() - fresh_bytes, asked(shorter) / 8);
  step(192);  // longer than any: fresh blocks, which replace those of the shorter steps
  EXPECT_GT(memory::fresh_blocks(), fresh);
  EXPECT_LE(memory::bytes_in_use() + memory::block_cache_bytes(), memory::peak_bytes());
  memory::cache_blocks_for_steps(floor);  // the limit follows the longer step's peak
  step(192);
  memory::cache_blocks_for_steps(floor);
  const int64_t after_longer = memory::fresh_bytes();
  const std::initializer_list<int64_t> mixed = {96, 150, 192, 100, 96, 150, 192, 100};
  for (const int64_t T : mixed) {
    step(T);
    memory::cache_blocks_for_steps(floor);
  }
  if (!kAsan) EXPECT_LE(memory::fresh_bytes() - after_longer, asked(mixed) / 8);
  memory::set_block_cache_limit(0);
}

// The KV cache's address space: reserved, written where needed, pages given back read as zeros.
TEST(Memory, RegionIsWrittenInPlaceAndGivesPagesBack) {
  memory::Region region(size_t{5} << 20);
  if (kAsan) {
    EXPECT_EQ(region.data(), nullptr);  // its owner allocates pieces of its own
    return;
  }
  ASSERT_NE(region.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(region.data()) % (size_t{2} << 20), 0u);  // aligned for huge pages
  EXPECT_EQ(region.size(), size_t{6} << 20);                                        // whole huge pages
  std::memset(region.data(), 7, region.size());
  region.release(size_t{1} << 20, size_t{2} << 20);  // [1 MiB, 3 MiB): its pages go back
  EXPECT_EQ(region.data()[(size_t{1} << 20) - 1], std::byte{7});
  EXPECT_EQ(region.data()[size_t{1} << 20], std::byte{0});
  EXPECT_EQ(region.data()[(size_t{3} << 20) - 1], std::byte{0});
  EXPECT_EQ(region.data()[size_t{3} << 20], std::byte{7});
  memory::Region moved = std::move(region);
  EXPECT_EQ(region.data(), nullptr);
  EXPECT_EQ(moved.data()[0], std::byte{7});
}

// Steps whose tensors outgrow the floor: after a step, the limit follows the most the step held at once, so the
// next step's blocks all come from the cache.
TEST(Memory, CacheForStepsFollowsTheStepsPeak) {
  memory::set_block_cache_limit(0);
  memory::reset_peak();
  const int64_t floor = int64_t{1} << 20, before = memory::block_cache_limit();
  memory::cache_blocks_for_steps(floor);
  EXPECT_GE(memory::block_cache_limit(), std::max(before, floor));
  auto step = [] {  // three 8 MiB tensors at once
    std::vector<Tensor> held;
    for (int i = 0; i < 3; ++i) held.push_back(Tensor::empty({int64_t{1} << 21}));
  };
  step();  // 24 MiB at its peak: more than a 1 MiB floor would keep
  memory::cache_blocks_for_steps(floor);
  EXPECT_GE(memory::block_cache_limit(), memory::bytes_in_use() + (int64_t{24} << 20));
  step();  // kept this time
  const int64_t fresh = memory::fresh_blocks();
  step();
  EXPECT_EQ(memory::fresh_blocks(), fresh);
  memory::set_block_cache_limit(0);
}

// The fused head's rows per block: 64 MiB of logits or C rows, whichever is more, up to 256 MiB, never more than N.
TEST(Kernels, LinearCrossEntropyBlocksAreTheWeightsSizeUpTo256MiB) {
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(2048, 768, 50257), 768);    // GPT-2 124M: C rows
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(2048, 64, 50257), 333);     // narrow: 16M floats of logits
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(4096, 1600, 50257), 1335);  // GPT-2 XL: capped at 64M floats
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(100, 768, 50257), 100);     // never more than the rows
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(64, 32, 97), 64);
  EXPECT_EQ(kernels::linear_cross_entropy_block_rows(5, 8, 1 << 30), 1);         // a huge vocabulary: one row at a time
}

TEST(Kernels, SoftmaxMatchesReferenceAndSumsToOne) {
  const Tensor x = random_tensor({7, 13}, 4, 10.0f);
  Tensor y = Tensor::empty(x.shape()), r = Tensor::empty(x.shape());
  kernels::softmax_rows(x.data(), y.data(), 7, 13);
  kernels::softmax_rows_reference(x.data(), r.data(), 7, 13);
  EXPECT_TRUE(all_close(y, r, 1e-6, 1e-7));
  for (int i = 0; i < 7; ++i) {
    double s = 0;
    for (int j = 0; j < 13; ++j) s += y.at({i, j});
    EXPECT_NEAR(s, 1.0, 1e-6);
  }
}

// The vector e^x behind softmax, cross-entropy and attention: 16-lane (AVX-512) and 8-lane (AVX2) code give the same
// bits for the same input, it is accurate to a few ulp over the range that is not flushed, and below e^−80 it is
// exactly 0. A row of 40 covers both widths on an AVX-512 build: elements 0–31 in 16 lanes, 32–39 in 8.
TEST(Kernels, SoftmaxExpIsTheSameInEveryVectorWidthAndAccurate) {
  std::vector<float> x(40);
  for (int j = 0; j < 8; ++j) {
    const float v = -79.5f + 11.3f * static_cast<float>(j) + 0.0137f * static_cast<float>(j * j);
    x[j] = x[j + 16] = x[j + 32] = v;
    x[j + 8] = x[j + 24] = -200.0f + static_cast<float>(j);  // flushed: far below the row's max
  }
  Tensor y = Tensor::empty({1, 40}), r = Tensor::empty({1, 40});
  kernels::softmax_rows(x.data(), y.data(), 1, 40);
  kernels::softmax_rows_reference(x.data(), r.data(), 1, 40);
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(y.data()[j], y.data()[j + 16]) << j;
    EXPECT_EQ(y.data()[j], y.data()[j + 32]) << j;
    EXPECT_EQ(y.data()[j + 8], 0.0f) << j;
  }
  // Relative error: a few ulp, plus what rounding x − max to float costs (|x − max| · 2⁻²⁴), which the double
  // reference does not pay.
  const float max_value = *std::max_element(x.begin(), x.end());
  for (int j = 0; j < 40; ++j) {
    if (r.data()[j] < 1e-34f) continue;  // flushed here, a denormal-free tiny number there
    const double tolerance = 5e-7 + std::fabs(x[j] - max_value) * 6e-8;
    EXPECT_NEAR(y.data()[j] / r.data()[j], 1.0, tolerance) << j << ": " << y.data()[j] << " vs " << r.data()[j];
  }
}

TEST(Kernels, SoftmaxIsStableForHugeScoresAndNaNOnAllMaskedRows) {
  const float inf = INFINITY;
  const Tensor x = Tensor::from({1000.0f, 1001.0f, -inf, -inf, -inf, -inf}, {2, 3});
  Tensor y = Tensor::empty(x.shape());
  kernels::softmax_rows(x.data(), y.data(), 2, 3);
  EXPECT_NEAR(y.at({0, 0}), 0.268941, 1e-6);
  EXPECT_NEAR(y.at({0, 1}), 0.731059, 1e-6);
  EXPECT_EQ(y.at({0, 2}), 0.0f);
  EXPECT_TRUE(std::isnan(y.at({1, 0})));  // like torch.softmax of an all −∞ row
}

TEST(Kernels, TransposeBatched) {
  const Tensor x = random_tensor({3, 37, 45}, 5);
  Tensor y = Tensor::empty({3, 45, 37});
  kernels::transpose_batched(x.data(), y.data(), 3, 37, 45);
  for (int b = 0; b < 3; ++b)
    for (int i = 0; i < 37; ++i)
      for (int j = 0; j < 45; ++j) ASSERT_EQ(y.at({b, j, i}), x.at({b, i, j}));
}

}  // namespace
}  // namespace qkv::test
