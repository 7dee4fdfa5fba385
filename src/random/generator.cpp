// MT19937 and PyTorch's ways of turning its words into uniform, normal and Bernoulli samples.
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>

#include "qkv/random.hpp"

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
  return x * (to - from) + from;
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

void Generator::uniform_(Tensor& t, double from, double to) {
  const float lo = static_cast<float>(from), hi = static_cast<float>(to);
  for (float& v : t.values()) v = uniform_float(lo, hi);
}

namespace {
// Box–Muller over a block of 16 uniforms in float: pairs (j, j+8) become two normals.
void normal_fill_16(float* data, float mean, float std) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - data[j];  // [0,1) → (0,1] so the log is finite
    const float u2 = data[j + 8];
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float theta = 2.0f * std::numbers::pi_v<float> * u2;
    data[j] = radius * std::cos(theta) * std + mean;
    data[j + 8] = radius * std::sin(theta) * std + mean;
  }
}
}  // namespace

void Generator::normal_(Tensor& t, double mean, double std) {
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
  if (s.size() != 628 || s[1] > 624 || s[2] > 1) {
    throw ValueError("Generator::set_state: malformed state (" + std::to_string(s.size()) +
                     " words; expected 628 from Generator::state())");
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
