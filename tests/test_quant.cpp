// The storage types against ggml itself: quantizing and dequantizing give the bytes and floats of ggml's own build
// (tests/fixtures/quant/, made by tools/ggml_quant_reference.py through ctypes from npm's node-llama-cpp), bit for bit;
// round trips stay within each format's error; bad column counts and non-finite weights are refused with a message.
// Not here: the products with stored weights (test_kernel_table.cpp's rows, and the cases below that need ggml).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include "helpers.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/weights.hpp"

namespace qkv::test {
namespace {

using kernels::WeightType;

// tools/ggml_quant_reference.py's generator and inputs, step for step (values made in double, then rounded to float).
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 40) - 8388608.0) / 8388608.0; }

 private:
  uint64_t state_;
};

constexpr int kTrickyRows = 12, kBulkRows = 512, kCols = 256;

std::vector<float> tricky_row(int r) {
  SplitMix g(1000 + r);
  std::vector<double> u(kCols);
  for (double& v : u) v = g.uniform();
  std::vector<float> x(kCols);
  for (int i = 0; i < kCols; ++i) {
    const double v = u[i];
    double y = 0.0;
    switch (r) {
      case 0: y = 0.0; break;
      case 1: y = v; break;
      case 2: y = i == 37 ? 1000.0 : v; break;
      case 3: y = std::ldexp(v, -20); break;
      case 4: y = std::ldexp(v, -135); break;
      case 5: y = -std::fabs(v) - 0.25; break;
      case 6: y = i % 32 == 0 ? 127.0 : static_cast<double>((i * 37) % 253 - 126) + 0.5; break;
      case 7: y = i % 32 == 0 ? -8.0 : static_cast<double>(i % 16) - 7.5; break;
      case 8: y = -0.5; break;
      case 9: y = std::ldexp(v, 14); break;
      case 10: y = std::ldexp(v, -3 * (i / 32)); break;
      case 11: y = i % 2 ? static_cast<double>(static_cast<float>(v * std::fabs(v) * 4.0)) : std::fabs(v) + 0.125; break;
    }
    x[i] = static_cast<float>(y);
  }
  return x;
}

std::vector<float> rows_of(int first, int count, bool bulk) {
  std::vector<float> x;
  for (int r = first; r < first + count; ++r) {
    if (!bulk) {
      const auto row = tricky_row(r);
      x.insert(x.end(), row.begin(), row.end());
      continue;
    }
    SplitMix g(0x5EED0000ull + static_cast<uint64_t>(r));
    for (int b = 0; b < kCols / 32; ++b) {
      const int exponent = static_cast<int>(g.next() >> 60) - 8;
      for (int i = 0; i < 32; ++i) x.push_back(static_cast<float>(std::ldexp(g.uniform(), exponent)));
    }
  }
  return x;
}

uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 0xCBF29CE484222325ull) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

std::vector<unsigned char> read_fixture(const std::string& name) {
  std::ifstream in(fixture("quant/" + name), std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

uint64_t u64_at(const std::vector<unsigned char>& bytes, size_t at) {
  uint64_t v;
  std::memcpy(&v, bytes.data() + at, sizeof v);
  return v;
}

const WeightType kBlockTypes[] = {WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K,
                                  WeightType::MXFP4};

TEST(Quant, TypeTableIsGgmls) {
  struct Row {
    WeightType type;
    uint32_t ggml;
    int64_t elements, bytes;
  };
  for (const Row& r : {Row{WeightType::F32, 0, 1, 4}, Row{WeightType::F16, 1, 1, 2}, Row{WeightType::BF16, 30, 1, 2},
                       Row{WeightType::Q8_0, 8, 32, 34}, Row{WeightType::Q4_0, 2, 32, 18}, Row{WeightType::Q4_K, 12, 256, 144},
                       Row{WeightType::Q5_K, 13, 256, 176}, Row{WeightType::Q6_K, 14, 256, 210},
                       Row{WeightType::MXFP4, 39, 32, 17}}) {
    const auto& info = kernels::weight_type_info(r.type);
    EXPECT_EQ(info.ggml_type, r.ggml) << info.name;
    EXPECT_EQ(info.block_elements, r.elements) << info.name;
    EXPECT_EQ(info.block_bytes, r.bytes) << info.name;
    EXPECT_EQ(kernels::weight_type_from_ggml(r.ggml), r.type) << info.name;
    EXPECT_EQ(kernels::weight_type_from_name(info.name), r.type) << info.name;
    EXPECT_EQ(kernels::row_bytes(r.type, 1024), 1024 / r.elements * r.bytes) << info.name;
  }
  EXPECT_EQ(kernels::weight_type_from_name("Q4_k"), WeightType::Q4_K);
  EXPECT_FALSE(kernels::weight_type_from_name("q4_1"));
  EXPECT_FALSE(kernels::weight_type_from_ggml(3));   // Q4_1
  EXPECT_FALSE(kernels::weight_type_from_ggml(15));  // Q8_K: activations only, never a stored weight here
}

TEST(Quant, BadColumnCountsAreRefusedWithTheFix) {
  try {
    kernels::row_bytes(WeightType::Q4_K, 1000);
    FAIL() << "1000 columns of q4_K accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("not a multiple of 256"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kernels::row_bytes(WeightType::Q8_0, 33), std::invalid_argument);
  EXPECT_THROW(kernels::row_bytes(WeightType::F16, -2), std::invalid_argument);
  EXPECT_THROW(kernels::row_bytes(WeightType::F32, std::numeric_limits<int64_t>::max()), std::invalid_argument);
  EXPECT_EQ(kernels::row_bytes(WeightType::Q4_0, 0), 0);
  std::vector<float> x(48, 1.0f);
  std::vector<unsigned char> out(64);
  EXPECT_THROW(kernels::quantize_rows(WeightType::Q4_0, x.data(), out.data(), 1, 48), std::invalid_argument);
  EXPECT_THROW(kernels::dequantize_rows(WeightType::Q4_0, out.data(), x.data(), 1, 48), std::invalid_argument);
}

// ggml's quantizers make meaningless blocks of NaN or ±Inf (the C conversion of NaN to an integer is undefined), so
// qkv refuses them, naming the value's place; the float storage types keep them (F16's NaN is ggml's 0x7e00).
TEST(Quant, NonFiniteWeightsAreRefusedByBlockTypes) {
  std::vector<float> x(2 * 256, 0.5f);
  x[256 + 7] = std::numeric_limits<float>::quiet_NaN();
  std::vector<unsigned char> out(2 * 210);
  for (WeightType type : kBlockTypes) {
    try {
      kernels::quantize_rows(type, x.data(), out.data(), 2, 256);
      FAIL() << kernels::weight_type_name(type) << " quantized a NaN";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("row 1, column 7"), std::string::npos) << e.what();
    }
  }
  x[256 + 7] = -std::numeric_limits<float>::infinity();
  EXPECT_THROW(kernels::quantize_rows(WeightType::Q6_K, x.data(), out.data(), 2, 256), std::invalid_argument);
  std::vector<uint16_t> halves(2 * 256);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  kernels::quantize_rows(WeightType::F16, x.data(), halves.data(), 2, 256);
  EXPECT_EQ(halves[3], 0x7e00);
  EXPECT_EQ(halves[256 + 7], 0xfc00);
}

// The bytes of ggml_quantize_chunk (llama-quantize without an importance matrix) for every tricky row, the hash of
// its bytes for 512 random rows, and the hash of dequantize_row_*'s floats: all equal, on 1 and 2 threads.
TEST(Quant, QuantizeAndDequantizeAreGgmlsBitForBit) {
  const std::vector<float> tricky = rows_of(0, kTrickyRows, false), bulk = rows_of(0, kBulkRows, true);
  for (WeightType type : kBlockTypes) {
    const char* name = kernels::weight_type_name(type);
    const std::vector<unsigned char> expected = read_fixture(std::string(name) + ".bin");
    const int64_t row = kernels::row_bytes(type, kCols);
    ASSERT_EQ(expected.size(), static_cast<size_t>(kTrickyRows * row + 16)) << name << ": fixture missing or stale";
    for (int threads : {1, 2}) {
      ThreadCount scope(threads);
      std::vector<unsigned char> got(kTrickyRows * row), got_bulk(kBulkRows * row);
      kernels::quantize_rows(type, tricky.data(), got.data(), kTrickyRows, kCols);
      for (int64_t i = 0; i < kTrickyRows * row; ++i)
        ASSERT_EQ(got[i], expected[i]) << name << ": tricky row " << i / row << ", byte " << i % row << " of the row";
      kernels::quantize_rows(type, bulk.data(), got_bulk.data(), kBulkRows, kCols);
      EXPECT_EQ(fnv1a(got_bulk.data(), got_bulk.size()), u64_at(expected, kTrickyRows * row)) << name << ": random rows";
      // ggml's floats of its bytes (equal to qkv's, as checked above)
      std::vector<float> floats((kTrickyRows + kBulkRows) * kCols);
      kernels::dequantize_rows(type, expected.data(), floats.data(), kTrickyRows, kCols);
      kernels::dequantize_rows(type, got_bulk.data(), floats.data() + kTrickyRows * kCols, kBulkRows, kCols);
      EXPECT_EQ(fnv1a(floats.data(), floats.size() * 4), u64_at(expected, kTrickyRows * row + 8)) << name << ": dequantized";
      for (int64_t c : {0, 37, 255})  // stored_value reads the same floats one at a time
        EXPECT_EQ(kernels::stored_value(type, expected.data() + 2 * row, c), floats[2 * kCols + c]) << name;
    }
  }
}

// Half and bfloat16 roundings as ggml_fp32_to_fp16_row and ggml_fp32_to_bf16_row_ref (ties, overflow, subnormals,
// NaNs), both qkv's vector loops and its scalar references; widening every one of the 65,536 patterns as ggml does.
TEST(Quant, HalfAndBfloat16AreGgmls) {
  const uint32_t specials[] = {0x00000000, 0x80000000, 0x3f800000, 0xbf800000, 0x477fe000, 0x477fefff, 0x477ff000,
                               0x47800000, 0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001,
                               0x7fa00000, 0xffffffff, 0x7fc12345, 0x38800000, 0x387fffff, 0x387ff000, 0x387fe000,
                               0x33800000, 0x33000000, 0x33000001, 0x33400000, 0x32ffffff, 0x00000001, 0x80000001,
                               0x00800000, 0x3f801000, 0x3f803000, 0x3f808000, 0x3f818000, 0x3f7fffff, 0x4b800000,
                               0xc7c35000};
  std::vector<uint32_t> bits(std::begin(specials), std::end(specials));
  SplitMix g(0xF16);
  for (int i = 0; i < 512; ++i) bits.push_back(static_cast<uint32_t>(g.next()));
  std::vector<float> values(bits.size());
  std::memcpy(values.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> every(65536);
  for (int i = 0; i < 65536; ++i) every[i] = static_cast<uint16_t>(i);
  for (const char* name : {"f16", "bf16"}) {
    const bool half = std::string(name) == "f16";
    const std::vector<unsigned char> expected = read_fixture(std::string(name) + ".bin");
    ASSERT_EQ(expected.size(), values.size() * 2 + 8) << name << ": fixture missing or stale";
    std::vector<uint16_t> got(values.size());
    kernels::quantize_rows(half ? WeightType::F16 : WeightType::BF16, values.data(), got.data(), 1, static_cast<int64_t>(values.size()));
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t want;
      std::memcpy(&want, expected.data() + 2 * i, 2);
      const uint16_t scalar = half ? kernels::f32_to_f16_reference(values[i]) : kernels::f32_to_bf16_reference(values[i]);
      ASSERT_EQ(got[i], want) << name << " of float bits 0x" << std::hex << bits[i];
      ASSERT_EQ(scalar, want) << name << " (scalar) of float bits 0x" << std::hex << bits[i];
    }
    std::vector<float> widened(65536);
    kernels::dequantize_rows(half ? WeightType::F16 : WeightType::BF16, every.data(), widened.data(), 1, 65536);
    EXPECT_EQ(fnv1a(widened.data(), widened.size() * 4), u64_at(expected, values.size() * 2)) << name << ": widened";
  }
}

// Quantizing then dequantizing random rows stays within each format's error: the RMS error over the RMS value, measured
// Q8_0 0.0038, Q4_0 0.071, Q4_K 0.057, Q5_K 0.029, Q6_K 0.014, MXFP4 0.145 on uniform values (a little less with a
// power-of-two scale per 32); the bounds leave about 40% room, and a round trip that is too exact fails too.
TEST(Quant, RoundTripErrorsAreEachFormats) {
  const std::vector<float> x = rows_of(1, 1, false);  // uniform in [-1, 1)
  const std::vector<float> y = rows_of(0, 64, true);  // a power-of-two scale per 32
  for (WeightType type : kBlockTypes) {
    for (const std::vector<float>* rows : {&x, &y}) {
      const int64_t n = static_cast<int64_t>(rows->size()) / kCols;
      std::vector<unsigned char> q(n * kernels::row_bytes(type, kCols));
      std::vector<float> back(rows->size());
      kernels::quantize_rows(type, rows->data(), q.data(), n, kCols);
      kernels::dequantize_rows(type, q.data(), back.data(), n, kCols);
      double err = 0, norm = 0;  // over the whole matrix: K-quants scale small sub-blocks against their super-block's range
      for (size_t i = 0; i < rows->size(); ++i) err += std::pow(back[i] - (*rows)[i], 2), norm += std::pow((*rows)[i], 2);
      const double relative = std::sqrt(err / norm);
      const double bound = type == WeightType::Q8_0 ? 0.006 : type == WeightType::Q4_0 ? 0.1 : type == WeightType::Q4_K ? 0.08
                           : type == WeightType::Q5_K ? 0.04 : type == WeightType::MXFP4 ? 0.2 : 0.02;
      EXPECT_LT(relative, bound) << kernels::weight_type_name(type);
      EXPECT_GT(relative, bound / 20) << kernels::weight_type_name(type) << ": suspiciously exact";
    }
  }
}

// MXFP4 blocks widened and quantized again keep every value: what makes writing a published gpt-oss's experts into a
// GGUF file (mxfp4_moe) lossless although the writer widens them first. Blocks of random codes under exponents 8 to
// 247 (values well inside float's normal range), including blocks whose largest code is below 4 (the quantizer then
// picks a smaller exponent, and the codes double).
TEST(Quant, Mxfp4BlocksWidenedAndQuantizedAgainKeepTheirValues) {
  const int64_t rows = 64, K = 256, bytes = kernels::row_bytes(WeightType::MXFP4, K);
  std::vector<unsigned char> blocks(static_cast<size_t>(rows * bytes));
  SplitMix g(11);
  for (int64_t b = 0; b < rows * K / 32; ++b) {
    unsigned char* block = blocks.data() + b * 17;
    block[0] = static_cast<unsigned char>(8 + g.next() % 240);
    const unsigned mask = b % 3 == 0 ? 0x33 : 0xff;  // codes ≤ 3 (values ≤ 1.5) in every third block
    for (int i = 1; i < 17; ++i) block[i] = static_cast<unsigned char>(g.next() & mask);
  }
  std::vector<float> values(static_cast<size_t>(rows * K)), again(values.size());
  kernels::dequantize_rows(WeightType::MXFP4, blocks.data(), values.data(), rows, K);
  std::vector<unsigned char> requantized(blocks.size());
  kernels::quantize_rows(WeightType::MXFP4, values.data(), requantized.data(), rows, K);
  kernels::dequantize_rows(WeightType::MXFP4, requantized.data(), again.data(), rows, K);
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(values[i], again[i]) << "value " << i;
  EXPECT_NE(blocks, requantized) << "no block took a smaller exponent: the doubled codes went untested";
}

// Products at sizes where threads split the work (the kernel table's are small): on 1 and 2 threads the one-row path
// gives the same bits (each row of W is one thread's), both paths stay within float rounding of their references, and
// the integer path (8-bit activations) stays within 1% of Σ|w·x| of the float32 product.
TEST(Quant, ProductsSplitBetweenThreadsMatchTheirReferences) {
  const int64_t N = 520, K = 768;
  const std::vector<float> values = rows_of(0, static_cast<int>(N * K / kCols), true);
  for (WeightType type : {WeightType::F16, WeightType::BF16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_K,
                          WeightType::Q5_K, WeightType::Q6_K, WeightType::MXFP4}) {
    const char* name = kernels::weight_type_name(type);
    std::vector<unsigned char> stored(N * kernels::row_bytes(type, K));
    kernels::quantize_rows(type, values.data(), stored.data(), N, K);
    const kernels::WeightView w{type, stored.data(), N, K};
    for (int64_t M : {int64_t{2}, int64_t{70}}) {
      std::vector<float> x(M * K);
      SplitMix g(static_cast<uint64_t>(M));
      for (float& v : x) v = static_cast<float>(g.uniform());
      std::vector<float> y1(M * N), y2(M * N), integer(M * N), exact(M * N);
      {
        ThreadCount one(1);
        kernels::gemm_weight(w, M, x.data(), K, 0.0f, y1.data(), N);
      }
      {
        ThreadCount two(2);
        kernels::gemm_weight(w, M, x.data(), K, 0.0f, y2.data(), N);
      }
      kernels::gemm_weight_reference(w, M, x.data(), K, 0.0f, exact.data(), N);
      kernels::gemm_weight_integer_reference(w, M, x.data(), K, 0.0f, integer.data(), N);
      EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * 4)) << name << ": 1 and 2 threads differ";
      std::vector<float> dense(N * K);
      kernels::dequantize_rows(type, stored.data(), dense.data(), N, K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double size = 0;
          for (int64_t k = 0; k < K; ++k) size += std::fabs(double{dense[n * K + k]} * x[m * K + k]);
          const size_t i = m * N + n;
          const float want = kernels::is_block_quantized(type) ? integer[i] : exact[i];
          ASSERT_NEAR(y1[i], want, 1e-5 * size) << name << " M " << M << " [" << m << "," << n << "]";
          ASSERT_NEAR(y2[i], want, 1e-5 * size) << name << " M " << M << " (2 threads)";
          ASSERT_NEAR(y1[i], exact[i], 0.01 * size) << name << ": 8-bit activations too far from float32";
        }
      // the backward on two threads (columns in whole blocks) against its reference
      std::vector<float> dx(M * K), dx_want(M * K);
      {
        ThreadCount two(2);
        kernels::gemm_weight_backward(w, M, y1.data(), N, 0.0f, dx.data(), K);
      }
      kernels::gemm_weight_backward_reference(w, M, y1.data(), N, 0.0f, dx_want.data(), K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
          double size = 0;
          for (int64_t n = 0; n < N; ++n) size += std::fabs(double{dense[n * K + k]} * y1[m * N + n]);
          ASSERT_NEAR(dx[m * K + k], dx_want[m * K + k], 1e-5 * size) << name << " backward, M " << M;
        }
    }
  }
}

// Batched generation must equal solo generation token for token: a row of Y is the same bits alone (M = 1), at any
// place among M = 2, 5, 8, 33 or 70 rows (groups of 4 and every tail) and on 1 or 2 threads, for every stored type.
// (F32 storage is kernels::gemm, whose one-row path sums in another order than its tiles: not checked here.)
TEST(Quant, ARowDoesNotDependOnTheRowsBesideItNorOnTheThreads) {
  const int64_t N = 520, K = 768;
  const std::vector<float> values = rows_of(0, static_cast<int>(N * K / kCols), true);
  const int64_t pool = 70;
  std::vector<float> x(pool * K);
  SplitMix g(7);
  for (float& v : x) v = static_cast<float>(g.uniform());
  for (WeightType type : {WeightType::F16, WeightType::BF16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_K,
                          WeightType::Q5_K, WeightType::Q6_K, WeightType::MXFP4}) {
    const char* name = kernels::weight_type_name(type);
    std::vector<unsigned char> stored(N * kernels::row_bytes(type, K));
    kernels::quantize_rows(type, values.data(), stored.data(), N, K);
    const kernels::WeightView w{type, stored.data(), N, K};
    std::vector<float> solo(pool * N);
    {
      ThreadCount one(1);
      for (int64_t m = 0; m < pool; ++m) kernels::gemm_weight(w, 1, x.data() + m * K, K, 0.0f, solo.data() + m * N, N);
    }
    for (int threads : {1, 2}) {
      ThreadCount count(threads);
      for (int64_t M : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{8}, int64_t{33}, int64_t{70}}) {
        // rows first … first + M − 1 of the pool, so each row is met at several places of a call
        for (int64_t first : {int64_t{0}, pool - M, (pool - M) / 3}) {
          std::vector<float> y(M * N);
          kernels::gemm_weight(w, M, x.data() + first * K, K, 0.0f, y.data(), N);
          for (int64_t m = 0; m < M; ++m)
            ASSERT_EQ(0, std::memcmp(y.data() + m * N, solo.data() + (first + m) * N, N * sizeof(float)))
                << name << ": row " << first + m << " at place " << m << " of M = " << M << " on " << threads
                << " threads differs from the row alone";
        }
      }
    }
    // The same rows as three parts of unequal sizes (a layer's q, k and v) in one call: each part's columns are what
    // the part gives alone, with beta 1 adding to what Y held; parts of another type go part by part
    const int64_t sizes[] = {300, 17, 203};
    std::vector<kernels::WeightView> parts;
    for (int64_t at = 0; const int64_t n : sizes) {
      parts.push_back({type, stored.data() + at * kernels::row_bytes(type, K), n, K});
      at += n;
    }
    std::vector<float> f32(static_cast<size_t>(sizes[1] * K));
    kernels::dequantize_rows(type, parts[1].data, f32.data(), sizes[1], K);
    for (int threads : {1, 2})
      for (const bool mixed : {false, true})
        for (int64_t M : {int64_t{1}, int64_t{6}, int64_t{33}}) {
          ThreadCount count(threads);
          std::vector<kernels::WeightView> call = parts;
          if (mixed) call[1] = {WeightType::F32, f32.data(), sizes[1], K};
          std::vector<float> y(M * N, 1.0f), want(M * N, 1.0f);
          kernels::gemm_weights(call, M, x.data(), K, 1.0f, y.data(), N);
          for (int64_t column = 0; const kernels::WeightView& part : call) {
            kernels::gemm_weight(part, M, x.data(), K, 1.0f, want.data() + column, N);
            column += part.rows;
          }
          ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
              << name << ": parts in one call differ from each part alone (M = " << M << ", " << threads
              << " threads" << (mixed ? ", one part float32" : "") << ")";
        }
  }
}

// gemm_weight of the M rows of x against `want`, on 1 and 2 threads: bit for bit where `exact` (`what` names the
// arithmetic missed), else within bound(i) of want[i].
template <class Bound>
void expect_products(const kernels::WeightView& w, const std::vector<float>& x, int64_t M, const std::vector<float>& want,
                     bool exact, Bound&& bound, const std::string& what) {
  const int64_t N = w.rows, K = w.cols;
  for (int threads : {1, 2}) {
    ThreadCount count(threads);
    std::vector<float> y(M * N);
    kernels::gemm_weight(w, M, x.data(), K, 0.0f, y.data(), N);
    for (int64_t i = 0; i < M * N; ++i) {
      const bool ok = exact ? y[i] == want[i] : std::fabs(y[i] - want[i]) <= bound(i);
      if (!ok) {
        ADD_FAILURE() << kernels::weight_type_name(w.type) << " K " << K << " M " << M << " [" << i / N << "," << i % N
                      << "] on " << threads << " threads: " << y[i] << " against " << want[i]
                      << (exact ? ": not " + what : std::string(": beyond its bound"));
        return;
      }
    }
  }
}

// Where Q4_0 and Q8_0 run with the rows of W in the lanes (AVX-512 VNNI: 16 rows per vector; AVX2: 8), a row
// of Y is, bit for bit, a sum of scalar float32 chains c_j ← fma(float(Σ w·q), d_w·d_x, c_j) over the blocks b ≡ j (mod
// C) in order: C = 1 (AVX-512), or C = 8 (AVX2, as its backend says) summed as ((c₀ + c₁) + (c₄ + c₅)) + ((c₂ + c₃) +
// (c₆ + c₇)). X is quantized to 8-bit blocks as the kernels do (d_x = max|x|/127 in float32, q = x·(1/d_x) rounded to
// nearest even). At 1, 3, 6 and 70 rows of X (the few-rows kernels, and the tiles unpacked once for all), 37 rows of W
// (whole tiles and a last partial one), 5 and 17 blocks (whole groups of 8 blocks or not, and the rest), on 1 and 2
// threads. Elsewhere the one-row kernels sum lanes in another order: their values are checked against the references
// above.
TEST(Quant, RowsInLanesFollowThePerBlockChainBitForBit) {
  for (const int64_t K : {int64_t{160}, int64_t{544}}) {
    const int64_t N = 37, blocks = K / 32;
    const std::vector<float> values = rows_of(0, static_cast<int>((N * K + kCols - 1) / kCols), true);
    for (WeightType type : {WeightType::Q4_0, WeightType::Q8_0}) {
      const std::string backend = kernels::gemm_weight_backend(type);
      const bool lanes = backend.find("across a vector's lanes") != std::string::npos;
      const int chains = backend.find("blocks in 8 chains") != std::string::npos ? 8 : 1;
      const int64_t row = kernels::row_bytes(type, K);
      std::vector<unsigned char> stored(N * row);
      kernels::quantize_rows(type, values.data(), stored.data(), N, K);
      const kernels::WeightView w{type, stored.data(), N, K};
      // each weight's level and each block's scale, from the stored bytes
      std::vector<int> level(N * K);
      std::vector<float> scale(N * blocks);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < blocks; ++b) {
          const unsigned char* block = stored.data() + n * row + b * (type == WeightType::Q4_0 ? 18 : 34);
          uint16_t half;
          std::memcpy(&half, block, 2);
          scale[n * blocks + b] = kernels::f16_to_f32_reference(half);
          for (int j = 0; j < 32; ++j)
            level[n * K + b * 32 + j] = type == WeightType::Q8_0 ? static_cast<int8_t>(block[2 + j])
                                        : j < 16 ? (block[2 + j] & 0xf) - 8 : (block[2 + j - 16] >> 4) - 8;
        }
      for (int64_t M : {int64_t{1}, int64_t{3}, int64_t{6}, int64_t{70}}) {
        std::vector<float> x(M * K);
        SplitMix g(static_cast<uint64_t>(M) + 17);
        for (float& v : x) v = static_cast<float>(g.uniform() - 0.5);
        std::vector<float> want(M * N);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            float c[8] = {};
            for (int64_t b = 0; b < blocks; ++b) {
              const float* xb = x.data() + m * K + b * 32;
              float amax = 0.0f;
              for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
              const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
              int32_t sum = 0;
              for (int j = 0; j < 32; ++j)
                sum += level[n * K + b * 32 + j] * static_cast<int32_t>(std::nearbyint(xb[j] * id));
              float& acc = c[b % chains];
              acc = std::fma(static_cast<float>(sum), scale[n * blocks + b] * dx, acc);
            }
            want[m * N + n] = chains == 1 ? c[0] : ((c[0] + c[1]) + (c[4] + c[5])) + ((c[2] + c[3]) + (c[6] + c[7]));
          }
        expect_products(w, x, M, want, lanes, [&](int64_t i) {
          double size = 0;
          for (int64_t k = 0; k < K; ++k)
            size += std::fabs(level[(i % N) * K + k] * double{scale[(i % N) * blocks + k / 32]} * x[(i / N) * K + k]);
          return 1e-5 * size;
        }, "the chains of blocks");
      }
    }
  }
}

// Where Q4_K and Q5_K run with the rows of W in the lanes (AVX2 and AVX-512 builds, as their backend says), a row of Y
// is, bit for bit, c_S − c_M over two scalar float32 chains: per block, the exact integers S = Σ_j scale_j·Σ q_w·q_x
// and M = Σ_j min_j·Σ q_x (j over the 8 sub-blocks of 32 values), then c_S ← fma(float(S), d·d_x, c_S) and c_M ←
// fma(float(M), dmin·d_x, c_M). X is quantized as ggml's q8_K (per 256 values, the signed largest value maps to −127,
// q = nearest integer, to even). Both the one-row kernel (1, 3 and 6 rows of X) and the tiles (70) follow it, for 1
// and 4 blocks, 37 rows of W (a partial last tile), on 1 and 2 threads. Elsewhere (the plain C++ build): close to it.
TEST(Quant, KQuantRowsFollowTheirTwoChainsBitForBit) {
  for (const int64_t K : {int64_t{256}, int64_t{1024}}) {
    const int64_t N = 37, blocks = K / 256;
    const std::vector<float> values = rows_of(1, static_cast<int>((N * K + kCols - 1) / kCols), true);
    for (WeightType type : {WeightType::Q4_K, WeightType::Q5_K}) {
      const bool chains = std::string(kernels::gemm_weight_backend(type)).find("a chain of scaled sums and one of mins") !=
                          std::string::npos;
      const bool five = type == WeightType::Q5_K;
      const int64_t row = kernels::row_bytes(type, K), block_bytes = five ? 176 : 144;
      std::vector<unsigned char> stored(N * row);
      kernels::quantize_rows(type, values.data(), stored.data(), N, K);
      const kernels::WeightView w{type, stored.data(), N, K};
      // the levels (0 … 15 or 0 … 31), sub-block scales and mins, and the block's two halves, from the stored bytes
      std::vector<int> level(N * K), scale(N * K / 32), min(N * K / 32);
      std::vector<float> d(N * blocks), dmin(N * blocks);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < blocks; ++b) {
          const unsigned char* blk = stored.data() + n * row + b * block_bytes;
          uint16_t half[2];
          std::memcpy(half, blk, 4);
          d[n * blocks + b] = kernels::f16_to_f32_reference(half[0]);
          dmin[n * blocks + b] = kernels::f16_to_f32_reference(half[1]);
          const unsigned char* sc = blk + 4;  // ggml's 12 bytes of 6-bit scales and mins
          const unsigned char* qh = blk + 16;
          const unsigned char* qs = blk + (five ? 48 : 16);
          for (int j = 0; j < 8; ++j) {
            const int at = static_cast<int>((n * K + b * 256) / 32 + j);
            scale[at] = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4);
            min[at] = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
            for (int i = 0; i < 32; ++i) {
              const unsigned char byte = qs[32 * (j / 2) + i];
              level[n * K + b * 256 + 32 * j + i] = (j % 2 ? byte >> 4 : byte & 0xf) + (five && (qh[i] >> j) & 1 ? 16 : 0);
            }
          }
        }
      for (int64_t M : {int64_t{1}, int64_t{3}, int64_t{6}, int64_t{70}}) {
        std::vector<float> x(M * K);
        SplitMix g(static_cast<uint64_t>(M) + 5);
        for (float& v : x) v = static_cast<float>(g.uniform() - 0.5);
        // q8_K of each block of 256
        std::vector<int> q(M * K);
        std::vector<float> dx(M * blocks);
        for (int64_t i = 0; i < M * blocks; ++i) {
          const float* xb = x.data() + i * 256;
          float largest = -INFINITY, smallest = INFINITY;
          for (int k = 0; k < 256; ++k) largest = std::max(largest, xb[k]), smallest = std::min(smallest, xb[k]);
          const float iscale = -127.0f / (largest >= -smallest ? largest : smallest);
          for (int k = 0; k < 256; ++k) q[i * 256 + k] = std::min(127, static_cast<int>(std::nearbyint(iscale * xb[k])));
          dx[i] = 1.0f / iscale;
        }
        std::vector<float> want(M * N);
        std::vector<double> size(M * N);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            float cs = 0.0f, cm = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
              int32_t S = 0, Msum = 0;
              for (int j = 0; j < 8; ++j) {
                const int at = static_cast<int>((n * K + b * 256) / 32 + j);
                int32_t dot = 0, sum = 0;
                for (int i = 0; i < 32; ++i) {
                  const int64_t k = b * 256 + 32 * j + i;
                  dot += level[n * K + k] * q[m * K + k];
                  sum += q[m * K + k];
                  size[m * N + n] += std::fabs(double{d[n * blocks + b]} * scale[at] * level[n * K + k] * x[m * K + k]) +
                                     std::fabs(double{dmin[n * blocks + b]} * min[at] * x[m * K + k]);
                }
                S += scale[at] * dot;
                Msum += min[at] * sum;
              }
              cs = std::fma(static_cast<float>(S), d[n * blocks + b] * dx[m * blocks + b], cs);
              cm = std::fma(static_cast<float>(Msum), dmin[n * blocks + b] * dx[m * blocks + b], cm);
            }
            want[m * N + n] = cs - cm;
          }
        expect_products(w, x, M, want, chains, [&](int64_t i) { return 1e-5 * size[i]; }, "the two chains");
      }
    }
  }
}

// A NaN or ±Inf in a row of X: that row of Y is NaN on every path (the integer path gives its block a NaN scale), the
// other rows are untouched.
TEST(Quant, NonFiniteActivationsGiveNanRows) {
  const int64_t N = 8, K = 512;
  const std::vector<float> values = rows_of(0, static_cast<int>(N * K / kCols), true);
  for (WeightType type : kBlockTypes) {
    std::vector<unsigned char> stored(N * kernels::row_bytes(type, K));
    kernels::quantize_rows(type, values.data(), stored.data(), N, K);
    const kernels::WeightView w{type, stored.data(), N, K};
    for (int64_t M : {int64_t{2}, int64_t{70}}) {  // a NaN among 2 rows, an Inf among 70
      std::vector<float> x(M * K, 0.25f), y(M * N);
      x[K + 300] = M == 2 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      kernels::gemm_weight(w, M, x.data(), K, 0.0f, y.data(), N);
      for (int64_t n = 0; n < N; ++n) {
        EXPECT_TRUE(std::isfinite(y[n])) << kernels::weight_type_name(type);
        EXPECT_TRUE(std::isnan(y[N + n]) || (M == 70 && std::isinf(y[N + n]))) << kernels::weight_type_name(type) << " M " << M;
      }
    }
  }
}

}  // namespace
}  // namespace qkv::test
