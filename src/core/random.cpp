// MT19937 and PyTorch's ways of turning its words into uniform, normal and Bernoulli samples.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>

#include "qkv/core/random.hpp"

namespace qkv {

Generator::Generator(uint64_t seed) { manual_seed(seed); }

void Generator::manual_seed(uint64_t seed) {
  seed_ = seed;
  next_double_normal_.reset();
  reseed_engine(static_cast<uint32_t>(seed & 0xffffffffu));  // torch keeps the low 32 bits
}

void Generator::reseed_engine(uint32_t seed) {
  words_[0] = seed;
  for (uint32_t i = 1; i < 624; ++i) words_[i] = 1812433253u * (words_[i - 1] ^ (words_[i - 1] >> 30)) + i;
  index_ = 624;
}

void Generator::refill() {
  for (int i = 0; i < 624; ++i) {
    const uint32_t y = (words_[static_cast<size_t>(i)] & 0x80000000u) | (words_[static_cast<size_t>((i + 1) % 624)] & 0x7fffffffu);
    words_[static_cast<size_t>(i)] = words_[static_cast<size_t>((i + 397) % 624)] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
  }
  index_ = 0;
}

uint32_t Generator::next_u32() {
  if (index_ >= 624) refill();
  uint32_t y = words_[static_cast<size_t>(index_++)];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

uint64_t Generator::next_u64() {
  const uint64_t hi = next_u32();
  const uint64_t lo = next_u32();
  return (hi << 32) | lo;
}

float Generator::uniform_float(float from, float to) {
  // 24 random bits: every float in [0, 1) with this spacing is exactly representable.
  const float x = static_cast<float>(next_u32() & ((1u << 24) - 1)) * (1.0f / 16777216.0f);
  return std::fma(x, to - from, from);  // fused, as PyTorch's AVX2 kernel computes it, in any build
}

double Generator::uniform_double() {
  return static_cast<double>(next_u64() & ((uint64_t{1} << 53) - 1)) * (1.0 / 9007199254740992.0);
}

double Generator::normal_double() {
  if (next_double_normal_) {
    const double cached = *next_double_normal_;
    next_double_normal_.reset();
    return cached;
  }
  const double u1 = uniform_double();
  const double u2 = uniform_double();
  const double radius = std::sqrt(-2.0 * std::log(1.0 - u2));
  const double theta = 2.0 * std::numbers::pi * u1;
  next_double_normal_ = radius * std::sin(theta);
  return radius * std::cos(theta);
}

Generator Generator::drawing_nothing(uint64_t seed) {
  Generator g(seed);
  g.no_init_ = true;
  return g;
}

void Generator::uniform_(Tensor& t, double from, double to) {
  if (no_init_) return t.fill_(0.0f);
  const float lo = static_cast<float>(from), hi = static_cast<float>(to);
  for (float& v : t.values()) v = uniform_float(lo, hi);
}

namespace {

// PyTorch fills blocks of 16 normals with AVX2 and the Cephes-style log and sincos of avx_mathfun
// (aten/src/ATen/native/cpu/avx_mathfun.h), built with FMA contraction. To give the same bits we follow
// those polynomials step by step in scalar code, with std::fma exactly where that build fuses a multiply
// into an add (found by matching python3-torch 1.13 on 4,680 draws, bit for bit). The file compiles
// without contraction (-std=c++20), so every other operation rounds as written.

float cephes_log(float x) {
  x = std::max(x, std::bit_cast<float>(0x00800000u));  // the smallest normal float: no denormals
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 0x7f) + 1.0f;
  x = std::bit_cast<float>((bits & ~0x7f800000u) | std::bit_cast<uint32_t>(0.5f));  // mantissa in [0.5, 1)
  // Fold into [√½, √2): if x < √½ use 2x − 1 and one less exponent, else x − 1.
  const bool small = x < 0.707106781186547524f;
  const float extra = small ? x : 0.0f;
  x = x - 1.0f;
  e = e - (small ? 1.0f : 0.0f);
  x = x + extra;
  const float z = x * x;
  float y = 7.0376836292e-2f;
  for (float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                  2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    y = std::fma(y, x, c);
  y = y * x;
  y = std::fma(y, z, e * -2.12194440e-4f);
  y = std::fma(-z, 0.5f, y);
  x = x + y;
  return std::fma(e, 0.693359375f, x);  // ln 2 split in two parts, the larger exact
}

void cephes_sincos(float angle, float& sine, float& cosine) {
  uint32_t sign_sin = std::bit_cast<uint32_t>(angle) & 0x80000000u;
  float x = std::fabs(angle);
  int32_t octant = static_cast<int32_t>(x * 1.27323954473516f);  // x · 4/π
  octant = (octant + 1) & ~1;
  const float y = static_cast<float>(octant);
  sign_sin ^= static_cast<uint32_t>(octant & 4) << 29;
  const uint32_t sign_cos = static_cast<uint32_t>(~(octant - 2) & 4) << 29;
  const bool sine_poly_for_sine = (octant & 2) == 0;
  // x − y·π/4 in three parts (extended precision).
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);
  const float z = x * x;
  float cos_poly = std::fma(2.443315711809948e-5f, z, -1.388731625493765e-3f);
  cos_poly = std::fma(cos_poly, z, 4.166664568298827e-2f);
  cos_poly = cos_poly * z;
  cos_poly = std::fma(cos_poly, z, -(z * 0.5f));
  cos_poly = cos_poly + 1.0f;
  float sin_poly = std::fma(-1.9515295891e-4f, z, 8.3321608736e-3f);
  sin_poly = std::fma(sin_poly, z, -1.6666654611e-1f);
  sin_poly = sin_poly * z;
  sin_poly = std::fma(sin_poly, x, x);
  const float s = sine_poly_for_sine ? sin_poly : cos_poly;
  const float c = sine_poly_for_sine ? cos_poly : sin_poly;
  sine = std::bit_cast<float>(std::bit_cast<uint32_t>(s) ^ sign_sin);
  cosine = std::bit_cast<float>(std::bit_cast<uint32_t>(c) ^ sign_cos);
}

// Box–Muller over a block of 16 uniforms: pairs (j, j+8) become two normals.
void normal_fill_16(float* data, float mean, float std) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - data[j];  // [0,1) → (0,1] so the log is finite
    const float u2 = data[j + 8];
    const float radius = std::sqrt(-2.0f * cephes_log(u1));
    const float theta = 6.2831853071795864769f * u2;
    float sine, cosine;
    cephes_sincos(theta, sine, cosine);
    data[j] = std::fma(radius * cosine, std, mean);
    data[j + 8] = std::fma(radius * sine, std, mean);
  }
}
}  // namespace

void Generator::normal_(Tensor& t, double mean, double std) {
  if (no_init_) return t.fill_(0.0f);
  const int64_t n = t.numel();
  float* data = t.data();
  if (n < 16) {
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(normal_double() * std + mean);
    return;
  }
  const float m = static_cast<float>(mean), s = static_cast<float>(std);
  for (int64_t i = 0; i < n; ++i) data[i] = uniform_float(0.0f, 1.0f);
  for (int64_t i = 0; i + 16 <= n; i += 16) normal_fill_16(data + i, m, s);
  if (n % 16 != 0) {  // the tail: redraw the last 16 uniforms and transform them again
    float* tail = data + n - 16;
    for (int j = 0; j < 16; ++j) tail[j] = uniform_float(0.0f, 1.0f);
    normal_fill_16(tail, m, s);
  }
}

void Generator::bernoulli_(Tensor& t, double p) {
  for (float& v : t.values()) v = uniform_double() < p ? 1.0f : 0.0f;
}

Tensor Generator::rand(const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  uniform_(t, 0.0, 1.0);
  return t;
}

Tensor Generator::randn(const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  normal_(t, 0.0, 1.0);
  return t;
}

std::vector<uint64_t> Generator::state() const {
  std::vector<uint64_t> s;
  s.reserve(624 + 4);
  s.push_back(seed_);
  s.push_back(static_cast<uint64_t>(index_));
  s.push_back(next_double_normal_ ? 1 : 0);
  uint64_t bits = 0;
  if (next_double_normal_) std::memcpy(&bits, &*next_double_normal_, sizeof bits);
  s.push_back(bits);
  for (uint32_t w : words_) s.push_back(w);
  return s;
}

void Generator::set_state(const std::vector<uint64_t>& s) {
  if (s.size() != 628) {
    throw ValueError("Generator::set_state: the state has " + std::to_string(s.size()) +
                     " words; Generator::state() writes 628 (seed, position, normal cache, 624 engine words)");
  }
  if (s[1] > 624 || s[2] > 1) {
    throw ValueError("Generator::set_state: the state's position (" + std::to_string(s[1]) + ", at most 624) or cache "
                     "flag (" + std::to_string(s[2]) + ", 0 or 1) is out of range: the state is corrupt");
  }
  for (size_t i = 4; i < 628; ++i) {
    if (s[i] > 0xffffffffull) {
      throw ValueError("Generator::set_state: engine word " + std::to_string(i - 4) + " does not fit 32 bits: the state is corrupt");
    }
  }
  seed_ = s[0];
  index_ = static_cast<int>(s[1]);
  next_double_normal_.reset();
  if (s[2]) {
    double v;
    std::memcpy(&v, &s[3], sizeof v);
    next_double_normal_ = v;
  }
  for (size_t i = 0; i < 624; ++i) words_[i] = static_cast<uint32_t>(s[4 + i]);
}

Generator& default_generator() {
  static Generator generator;
  return generator;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

int64_t fan_in(const Tensor& t) {
  if (t.rank() < 2) throw ShapeError("fan_in: needs a tensor of at least 2 dimensions, got " + t.shape().str());
  int64_t receptive = 1;
  for (int i = 2; i < t.rank(); ++i) receptive *= t.size(i);
  return t.size(1) * receptive;
}

void kaiming_uniform_(Tensor& t, double a, Generator& gen) {
  // The same double arithmetic as torch.nn.init, so the bound rounds to the same float.
  const double gain = std::sqrt(2.0 / (1.0 + std::pow(a, 2)));
  const double std_dev = gain / std::sqrt(static_cast<double>(fan_in(t)));
  const double bound = std::sqrt(3.0) * std_dev;
  gen.uniform_(t, -bound, bound);
}

}  // namespace qkv
