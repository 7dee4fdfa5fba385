// Peak resident memory of one fused attention forward+backward, in a process of its own:
//   qkv_attention_rss B H T D [threads]     (the target: (1, 8, 4096, 64) under 100 MiB)
// Inputs, outputs and gradients are counted, as they would be for any caller.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "qkv/kernels.hpp"
#include "qkv/core/random.hpp"
#include "qkv/core/tensor.hpp"

// VmHWM from /proc/self/status: the peak resident set of this process image. (getrusage's ru_maxrss
// survives exec, so a child of a large process would report its parent's peak.)
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return -1.0;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: qkv_attention_rss B H T D [threads]\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), H = std::atoll(argv[2]), T = std::atoll(argv[3]), D = std::atoll(argv[4]);
  const int threads = argc > 5 ? std::atoi(argv[5]) : 0;
  const double at_start = peak_rss_mib();
  const qkv::kernels::AttentionDims dims{B, H, T, T, D};
  const auto s = qkv::kernels::AttentionStrides::btc(dims, T);
  qkv::Generator gen(0);
  const qkv::Shape shape{B, T, H * D};
  const qkv::Tensor q = gen.randn(shape), k = gen.randn(shape), v = gen.randn(shape), d_o = gen.randn(shape);
  qkv::Tensor o = qkv::Tensor::empty(shape), lse = qkv::Tensor::empty({B, H, T}), dq = qkv::Tensor::empty(shape),
              dk = qkv::Tensor::empty(shape), dv = qkv::Tensor::empty(shape);
  qkv::kernels::AttentionOptions options{.causal = true, .threads = threads};
  qkv::kernels::attention_forward(dims, {s, s, s, s}, options, q.data(), k.data(), v.data(), o.data(), lse.data());
  qkv::kernels::attention_backward(dims, {s, s, s, s}, options, q.data(), k.data(), v.data(), o.data(), lse.data(),
                                   d_o.data(), dq.data(), dk.data(), dv.data());
  std::printf("(B,H,T,D) = (%lld,%lld,%lld,%lld) causal fwd+bwd: peak RSS %.1f MiB (%.1f MiB at start)\n",
              static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(T),
              static_cast<long long>(D), peak_rss_mib(), at_start);
  return 0;
}
