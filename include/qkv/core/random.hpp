// Random numbers that match PyTorch's CPU generator draw for draw: the same seed gives the same weights,
// the same dropout masks and the same embeddings as torch.manual_seed(n) in python3-torch 1.13.
// PyTorch's recipe (ATen's CPUGeneratorImpl and cpu/DistributionTemplates.h):
//   engine   MT19937 seeded with the low 32 bits of the seed;
//   rand     per element, (u32 & (2²⁴−1)) · 2⁻²⁴ in float, then · (to − from) + from;
//   randn    fewer than 16 elements: Box–Muller in double from two 53-bit uniforms, the sine half
//            cached for the next call; 16 or more: all uniforms first, then Box–Muller in float over
//            blocks of 16 (j with j+8), the tail block redrawn and recomputed, with the Cephes log and
//            sincos polynomials PyTorch's AVX2 kernel uses (bit-exact on this machine's python3-torch);
//   bernoulli per element, a 53-bit double uniform u, and the result is u < p.
// Not here: counter-based random streams for dropout in the kernels (kernels/attention.hpp, kernels/elementwise.hpp).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/core/tensor.hpp"

namespace qkv {

// PyTorch's CPU generator (MT19937 with its normal cache and vectorised draws): the same seed gives the same tensors, bit for bit
class Generator {
 public:
  explicit Generator(uint64_t seed = 67280421310721ULL);  // PyTorch's default seed

  void manual_seed(uint64_t seed);  // Restarts the stream from `seed` (torch.manual_seed)
  // The seed it was started from
  uint64_t initial_seed() const { return seed_; }

  uint32_t next_u32();  // one MT19937 output
  uint64_t next_u64();  // two outputs, the first in the high half (PyTorch's random64)
  float uniform_float(float from, float to);  // one u32 → float in [from, to)
  double uniform_double();                     // one u64 → double in [0, 1)
  double normal_double();                      // PyTorch's normal_distribution<double> with its cache

  // Fills in place; PyTorch's tensor.uniform_(from, to), normal_(mean, std), bernoulli_(p).
  void uniform_(Tensor& t, double from = 0.0, double to = 1.0);
  void normal_(Tensor& t, double mean = 0.0, double std = 1.0);
  void bernoulli_(Tensor& t, double p);

  Tensor rand(const Shape& shape);  // A new tensor of uniform [0, 1) draws (torch.rand)
  Tensor randn(const Shape& shape);  // A new tensor of standard normal draws (torch.randn)

  // A generator whose tensor fills (uniform_, normal_, rand, randn) write zeros and draw nothing, for building
  // a model whose weights a loader will overwrite (GPT-2's 1558M parameters would otherwise cost seconds of
  // pointless sampling). Single draws (next_u32, …) work as usual. set_drawing(true) makes it an ordinary
  // generator again.
  static Generator drawing_nothing(uint64_t seed = 0);
  void set_drawing(bool on) { no_init_ = !on; }
  bool draws() const { return !no_init_; }

  // The full state (engine words, position, normal cache, seed), for checkpoints.
  std::vector<uint64_t> state() const;
  void set_state(const std::vector<uint64_t>& state);  // throws ValueError on a malformed state

 private:
  void reseed_engine(uint32_t seed);
  void refill();

  uint64_t seed_ = 0;
  std::array<uint32_t, 624> words_{};
  int index_ = 624;
  std::optional<double> next_double_normal_;
  bool no_init_ = false;
};

// The process-wide generator that modules draw their initial weights from, like torch's default one.
// Threads: a Generator is not synchronised. The default generator belongs to the thread that builds modules
// (as in PyTorch); code that builds modules on several threads passes each its own Generator.
Generator& default_generator();
void manual_seed(uint64_t seed);  // default_generator().manual_seed(seed)

// Torch-compatible initialisers (torch.nn.init): kaiming_uniform_(a) uses gain √(2/(1+a²)) and
// bound = √3 · gain / √fan_in, with fan_in = t.size(1) for a 2-D weight (out, in).
void kaiming_uniform_(Tensor& t, double a, Generator& gen);
int64_t fan_in(const Tensor& t);

}  // namespace qkv
