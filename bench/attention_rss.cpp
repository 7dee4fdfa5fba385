// Peak resident memory of one fused attention forward+backward, in a process of its own:
//   qkv_attention_rss B H T D [threads]     (the target: (1, 8, 4096, 64) under 100 MiB)
// Inputs, outputs and gradients are counted, as they would be for any caller.
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>

#include "qkv/kernels.hpp"
#include "qkv/random.hpp"
#include "qkv/tensor.hpp"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: qkv_attention_rss B H T D [threads]\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), H = std::atoll(argv[2]), T = std::atoll(argv[3]), D = std::atoll(argv[4]);
  const int threads = argc > 5 ? std::atoi(argv[5]) : 0;
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
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
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  std::printf("(B,H,T,D) = (%lld,%lld,%lld,%lld) causal fwd+bwd: peak RSS %.1f MiB (%.1f MiB at start)\n",
              static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(T),
              static_cast<long long>(D), after.ru_maxrss / 1024.0, before.ru_maxrss / 1024.0);
  return 0;
}
