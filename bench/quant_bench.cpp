// Products with stored weights (kernels/weights.hpp) on Qwen3-0.6B's shapes, for every storage type, in one run:
//   - the one-row product (generation): GB/s of weight bytes read, against the read bandwidth measured on the same
//     threads (a streaming read beyond the caches), and the tokens/s a Qwen3-0.6B-shaped model's matrices would allow;
//     every matrix is one of enough copies to fill 256 MiB, visited in turn, so each call reads from memory as a model's
//     layers do, not from the caches;
//   - the many-row product (a prompt of 512 tokens): GFLOP/s, % of the FMA peak, and the ratio to float32 sgemm on the
//     same shape; beside it the streaming integer path at the same M (the alternative gemm_weight does not take there),
//     and the row count where the two paths cross.
// Medians of repeats; 1 and 2 threads. Rates are per CPU-second the process got (divided by its threads): on a
// shared machine, wall-clock rates measure the other processes as much as this one; the share of the time the
// process had its CPUs is printed beside them.
//   - with --ggml-cpu PATH (a libggml-cpu-*.so, e.g. npm's node-llama-cpp's prebuilt llama.cpp), the same one-row
//     products through ggml's own kernels (its vec_dot against activations its from_float quantized beforehand), rows
//     split between the threads as qkv splits them: the peer, in the same run;
//   - on one thread, the one-row product of a 256 × 1024 matrix held in L2 (qkv, and ggml's beside it): the kernels'
//     own cost, the memory aside.
//   qkv_quant_bench [--threads 1,2] [--types q4_0,q4_k,...] [--ggml-cpu PATH] [--smoke]
#include <dlfcn.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "peak.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/weights.hpp"

namespace {

using qkv::kernels::WeightType;
using qkv::kernels::WeightView;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Deterministic values in [-1, 1).
void fill(float* x, int64_t n, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = static_cast<float>(static_cast<int64_t>(s >> 40) - (int64_t{1} << 23)) / static_cast<float>(1 << 23);
  }
}

// `copies` copies of an N × K matrix of `type`, made by quantizing 64 random rows and repeating their bytes.
struct Weights {
  Weights(WeightType type, int64_t N, int64_t K, int64_t copies)
      : type(type), N(N), K(K), row(qkv::kernels::row_bytes(type, K)), copies(copies),
        bytes(static_cast<size_t>(N * row * copies)) {
    const int64_t sample_rows = std::min<int64_t>(64, N);
    std::vector<float> values(static_cast<size_t>(sample_rows * K));
    fill(values.data(), sample_rows * K, static_cast<uint64_t>(N * 31 + K));
    std::vector<unsigned char> sample(static_cast<size_t>(sample_rows * row));
    qkv::kernels::quantize_rows(type, values.data(), sample.data(), sample_rows, K);
    unsigned char* out = bytes.data();
    for (int64_t r = 0; r < N * copies; ++r) std::memcpy(out + r * row, sample.data() + (r % sample_rows) * row, row);
  }
  WeightView view(int64_t copy) const { return {type, bytes.data() + copy * N * row, N, K}; }
  int64_t matrix_bytes() const { return N * row; }

  WeightType type;
  int64_t N, K, row, copies;
  qkv::memory::Buffer<unsigned char> bytes;
};

// Seconds per call of `call(copy)`, cycling through the copies: the median over `runs` sweeps of at least `min_calls`,
// in CPU-seconds of the process per thread (the machine is shared: see qkv::bench::process_cpu_seconds). Before each
// sweep, `between()` (a streaming read, so the bandwidth is measured under the same load as the sweeps). *busy: the
// share of the sweeps' wall time × threads the process had CPUs (1 on a quiet machine).
template <class Call, class Between>
double per_call(int64_t copies, int runs, int64_t min_calls, Call&& call, Between&& between, double* busy = nullptr) {
  const int64_t calls = std::max(copies, min_calls);
  const int threads = omp_get_max_threads();
  call(0);  // first touch, primitives, scratch
  std::vector<double> times;
  double wall = 0, cpu = 0;
  for (int r = 0; r < runs; ++r) {
    between();
    const double c0 = qkv::bench::process_cpu_seconds();
    const auto t = Clock::now();
    for (int64_t c = 0; c < calls; ++c) call(c % copies);
    wall += since(t);
    const double used = qkv::bench::process_cpu_seconds() - c0;
    cpu += used;
    times.push_back(used / threads / static_cast<double>(calls));
  }
  if (busy) *busy = cpu / (wall * threads);
  return median(times);
}
template <class Call>
double per_call(int64_t copies, int runs, int64_t min_calls, Call&& call) {
  return per_call(copies, runs, min_calls, call, [] {});
}

struct Shape {
  const char* name;
  int64_t N, K, per_token;  // per_token: how many such matrices a Qwen3-0.6B token reads (28 layers; the tied head once)
};

const Shape kShapes[] = {{"k, v (1024x1024)", 1024, 1024, 56},   {"q (2048x1024)", 2048, 1024, 28},
                         {"o (1024x2048)", 1024, 2048, 28},     {"gate, up (3072x1024)", 3072, 1024, 56},
                         {"down (1024x3072)", 1024, 3072, 28},  {"head (151936x1024)", 151936, 1024, 1}};
const Shape kSmokeShapes[] = {{"smoke (64x256)", 64, 256, 1}, {"smoke (96x512)", 96, 512, 1}};

std::vector<WeightType> parse_types(const std::string& list) {
  std::vector<WeightType> types;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const auto t = qkv::kernels::weight_type_from_name(list.substr(at, comma - at));
    if (!t) {
      std::fprintf(stderr, "unknown type in --types: %s\n", list.substr(at, comma - at).c_str());
      std::exit(2);
    }
    types.push_back(*t);
    at = comma + 1;
  }
  return types;
}

// ggml's CPU kernels, loaded at run time (ggml-cpu.h's ggml_type_traits_cpu): from_float quantizes a row of
// activations to the vec_dot_type's blocks, vec_dot multiplies one stored row with them.
class GgmlCpu {
 public:
  bool open(const std::string& path) {
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      std::fprintf(stderr, "--ggml-cpu %s: %s\n", path.c_str(), dlerror());
      return false;
    }
    traits_ = reinterpret_cast<const Traits* (*)(int)>(dlsym(handle_, "ggml_get_type_traits_cpu"));
    auto init = reinterpret_cast<void (*)()>(dlsym(handle_, "ggml_cpu_init"));
    if (!traits_ || !init) {
      std::fprintf(stderr, "--ggml-cpu %s: no ggml_get_type_traits_cpu / ggml_cpu_init\n", path.c_str());
      return false;
    }
    init();
    return true;
  }
  // Bytes of K activations in ggml's vec_dot_type for `type` (0 if unknown here).
  int64_t activation_bytes(WeightType type, int64_t K) const {
    switch (traits_(static_cast<int>(qkv::kernels::weight_type_info(type).ggml_type))->vec_dot_type) {
      case 0: return 4 * K;
      case 1: case 30: return 2 * K;
      case 8: return K / 32 * 34;
      case 15: return K / 256 * 292;
      default: return 0;
    }
  }
  void quantize(WeightType type, const float* x, void* out, int64_t K) const {
    traits_(static_cast<int>(qkv::kernels::weight_type_info(type).ggml_type))->from_float(x, out, K);
  }
  // y[n] = W_n · x for rows [0, N), the rows split between the threads in contiguous slices as gemm_weight splits them.
  void product(WeightType type, const void* w, int64_t N, int64_t K, const void* x, float* y) const {
    const Traits* t = traits_(static_cast<int>(qkv::kernels::weight_type_info(type).ggml_type));
    const int64_t bytes = qkv::kernels::row_bytes(type, K);
    const int parts = N * bytes < (int64_t{1} << 17) ? 1 : omp_get_max_threads();
    const int64_t slice = (N + parts - 1) / parts;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t n = p * slice, end = std::min(N, p * slice + slice); n < end; ++n)
        t->vec_dot(static_cast<int>(K), y + n, 0, static_cast<const unsigned char*>(w) + n * bytes, 0, x, 0, 1);
  }

 private:
  struct Traits {
    void (*from_float)(const float*, void*, int64_t);
    void (*vec_dot)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
    int vec_dot_type;
    int64_t nrows;
  };
  void* handle_ = nullptr;
  const Traits* (*traits_)(int) = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  std::string ggml_path;
  std::vector<int> thread_counts = {1, 2};
  std::vector<WeightType> types = {WeightType::F32,  WeightType::F16,  WeightType::BF16, WeightType::Q8_0,
                                   WeightType::Q4_0, WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K,
                                   WeightType::MXFP4};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") smoke = true;
    else if (arg == "--ggml-cpu" && i + 1 < argc) ggml_path = argv[++i];
    else if (arg == "--types" && i + 1 < argc) {
      types = parse_types(argv[++i]);
      // f32 first, so the types after it are quoted against its sgemm
      std::stable_partition(types.begin(), types.end(), [](WeightType t) { return t == WeightType::F32; });
    }
    else if (arg == "--threads" && i + 1 < argc) {
      thread_counts.clear();
      for (const char* p = argv[++i]; *p;) {
        thread_counts.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p) ++p;
      }
    } else {
      std::fprintf(stderr, "usage: qkv_quant_bench [--threads 1,2] [--types q4_0,q4_k,...] [--ggml-cpu PATH] [--smoke]\n");
      return 2;
    }
  }
  GgmlCpu ggml;
  if (!ggml_path.empty() && !ggml.open(ggml_path)) return 2;
  const int64_t pool = smoke ? (int64_t{8} << 20) : (int64_t{256} << 20);  // bytes of copies per shape
  const int runs = smoke ? 1 : 5;
  const int64_t many = smoke ? 16 : 512;
  std::printf("qkv_quant_bench: products with stored weights (kernels/weights.hpp)\n");
  std::printf("  Q4_0, Q8_0:  %s\n", qkv::kernels::gemm_weight_backend(WeightType::Q4_0));
  std::printf("  Q4_K, Q5_K:  %s\n", qkv::kernels::gemm_weight_backend(WeightType::Q4_K));
  std::printf("  Q6_K:        %s\n", qkv::kernels::gemm_weight_backend(WeightType::Q6_K));
  std::printf("  16-bit:      %s\n", qkv::kernels::gemm_weight_backend(WeightType::BF16));
  std::printf("  (one path for every M: a row's values do not depend on the rows beside it)\n");

  for (int threads : thread_counts) {
    omp_set_num_threads(threads);
    // The read bandwidth: single streaming passes over a buffer beyond the caches, one before each sweep of a product
    // (the ratios below take the medians of both, measured under the same load).
    const std::vector<float> stream(static_cast<size_t>((smoke ? (int64_t{64} << 20) : (int64_t{512} << 20)) / 4), 1.0f);
    std::vector<double> bandwidths, shape_bandwidths;
    auto read_once = [&] {  // bytes per CPU-second per thread, as the products; the faster of plain and prefetching
      double best = 0;
      for (bool prefetch : {false, true}) {
        const double c0 = qkv::bench::process_cpu_seconds();
        qkv::bench::read_pass(stream, prefetch);
        best = std::max(best, static_cast<double>(stream.size() * sizeof(float)) /
                                  ((qkv::bench::process_cpu_seconds() - c0) / threads));
      }
      shape_bandwidths.push_back(best);
      bandwidths.push_back(shape_bandwidths.back());
    };
    for (int i = 0; i < 3; ++i) read_once();
    std::printf("\n=== %d thread%s: read bandwidth %.1f GB/s (median of 3 streaming reads of %s, the faster of plain and prefetching) ===\n",
                threads, threads > 1 ? "s" : "", median(bandwidths) / 1e9, smoke ? "64 MiB" : "512 MiB");

    // ---- one row ----
    std::printf("\none row (M = 1): GB/s of weight bytes (%% of the read bandwidth measured between the sweeps, %% of the "
                "time the process had its CPUs)\n");
    const std::vector<Shape> shapes = smoke ? std::vector<Shape>(std::begin(kSmokeShapes), std::end(kSmokeShapes))
                                            : std::vector<Shape>(std::begin(kShapes), std::end(kShapes));
    std::printf("  %-6s", "type");
    for (const Shape& s : shapes) std::printf(" %25s", s.name);
    std::printf(" | a token: GB    ms  tok/s  limit\n");
    for (WeightType type : types) {
      std::printf("  %-6s", qkv::kernels::weight_type_name(type));
      double token_seconds = 0, token_bytes = 0;
      std::vector<double> type_bandwidths;
      for (const Shape& s : shapes) {
        const int64_t one = qkv::kernels::row_bytes(type, s.K) * s.N;
        const Weights w(type, s.N, s.K, std::max<int64_t>(1, pool / one));
        std::vector<float> x(static_cast<size_t>(s.K)), y(static_cast<size_t>(s.N));
        fill(x.data(), s.K, 7);
        shape_bandwidths.clear();
        double busy = 0;
        const double t = per_call(
            w.copies, runs, smoke ? 2 : 8,
            [&](int64_t c) { qkv::kernels::gemm_weight(w.view(c), 1, x.data(), s.K, 0.0f, y.data(), s.N); }, read_once,
            &busy);
        const double rate = static_cast<double>(one) / t, bandwidth = median(shape_bandwidths);
        type_bandwidths.push_back(bandwidth);
        std::printf(" %6.1f GB/s (%3.0f%%, %3.0f%%)", rate / 1e9, 100.0 * rate / bandwidth, 100.0 * busy);
        std::fflush(stdout);
        token_seconds += t * static_cast<double>(s.per_token);
        token_bytes += static_cast<double>(one) * static_cast<double>(s.per_token);
      }
      // the limit: the token's weight bytes at the read bandwidth measured between these sweeps
      std::printf(" | %5.3f %6.2f %6.1f %6.1f\n", token_bytes / 1e9, 1e3 * token_seconds, 1.0 / token_seconds,
                  median(type_bandwidths) / token_bytes);
    }

    // ---- one row: qkv against ggml's kernels, from memory and from L2 ----
    // Seconds per product of qkv and of ggml (0 without --ggml-cpu) on `copies` copies of the shape, alternating rounds
    // so both see the same load.
    auto one_row = [&](WeightType type, const Shape& s, int64_t copies, int64_t min_calls) {
      const Weights w(type, s.N, s.K, copies);
      std::vector<float> x(static_cast<size_t>(s.K)), y(static_cast<size_t>(s.N));
      fill(x.data(), s.K, 7);
      std::vector<unsigned char> act(ggml_path.empty() ? 0 : static_cast<size_t>(ggml.activation_bytes(type, s.K)));
      double t_qkv = 0, t_ggml = 0;
      for (int round = 0; round < 2; ++round) {
        t_qkv += per_call(w.copies, runs, min_calls, [&](int64_t c) {
          qkv::kernels::gemm_weight(w.view(c), 1, x.data(), s.K, 0.0f, y.data(), s.N);
        });
        if (ggml_path.empty()) continue;
        // ggml's kernels alone: its activations quantized once, outside the timing (ggml's mul_mat quantizes them
        // per product, with its scalar quantize_row_q8_K_ref for the K-quants: ~10 µs a row of 1024 here, more
        // than its dot products of a 1024 × 1024 matrix; qkv's times include its own quantization, ~0.3 µs)
        ggml.quantize(type, x.data(), act.data(), s.K);
        t_ggml += per_call(w.copies, runs, min_calls, [&](int64_t c) {
          ggml.product(type, w.view(c).data, s.N, s.K, act.data(), y.data());
        });
      }
      return std::pair{t_qkv / 2, t_ggml / 2};
    };
    if (!ggml_path.empty()) {
      std::printf("\none row, qkv against ggml's vec_dot (%s): GB/s of weight bytes, qkv / ggml\n", ggml_path.c_str());
      for (WeightType type : types) {
        std::printf("  %-6s", qkv::kernels::weight_type_name(type));
        for (const Shape& s : shapes) {
          if (s.N > 100000 && !smoke) continue;  // the head: as the others, and slow to fill
          const int64_t one = qkv::kernels::row_bytes(type, s.K) * s.N;
          const auto [t_qkv, t_ggml] = one_row(type, s, std::max<int64_t>(1, pool / one), smoke ? 2 : 8);
          std::printf("  %s %5.1f / %5.1f (%.2fx)", s.name, one / t_qkv / 1e9, one / t_ggml / 1e9, t_ggml / t_qkv);
          std::fflush(stdout);
        }
        std::printf("\n");
      }
    }
    // The same kernels with the matrix in L2, the memory aside: what each costs in instructions. On one thread only
    // (a product this small is not split).
    if (threads == 1) {
      const Shape l2{"256x1024", smoke ? 64 : 256, smoke ? 256 : 1024, 0};
      std::printf("\none row from L2 (one %s matrix, again and again): GB/s of weight bytes%s\n", l2.name,
                  ggml_path.empty() ? "" : ", qkv / ggml");
      for (WeightType type : types) {
        const int64_t one = qkv::kernels::row_bytes(type, l2.K) * l2.N;
        const auto [t_qkv, t_ggml] = one_row(type, l2, 1, smoke ? 20 : 4000);
        std::printf("  %-6s %5.1f", qkv::kernels::weight_type_name(type), one / t_qkv / 1e9);
        if (!ggml_path.empty()) std::printf(" / %5.1f (%.2fx)", one / t_ggml / 1e9, t_ggml / t_qkv);
        std::printf("\n");
        std::fflush(stdout);
      }
    }

    // ---- many rows ----
    const double peak = qkv::bench::measure_fma_peak(threads, smoke ? 0.02 : 0.2, /*cpu_time=*/true);
    std::printf("\nmany rows (M = %lld): GFLOP/s, %% of the FMA peak (%.0f GFLOP/s measured), ratio to float32 sgemm of the "
                "same shape; 'panels' is the alternative (W widened, sgemm)\n", static_cast<long long>(many), peak);
    for (const Shape& s : smoke ? shapes : std::vector<Shape>(std::begin(kShapes), std::end(kShapes) - 1)) {
      std::vector<float> x(static_cast<size_t>(many * s.K)), y(static_cast<size_t>(many * s.N));
      fill(x.data(), many * s.K, 9);
      const double flops = 2.0 * static_cast<double>(many) * s.N * s.K;
      double sgemm_rate = 0;
      for (WeightType type : types) {
        const Weights w(type, s.N, s.K, 1);
        const double t = per_call(1, runs, 1, [&](int64_t) {
          qkv::kernels::gemm_weight(w.view(0), many, x.data(), s.K, 0.0f, y.data(), s.N);
        });
        const double rate = flops / t / 1e9;
        if (type == WeightType::F32) sgemm_rate = rate;
        std::printf("  %-22s %-6s %7.1f GFLOP/s (%3.0f%% of peak", s.name, qkv::kernels::weight_type_name(type), rate,
                    100.0 * rate / peak);
        if (sgemm_rate > 0) std::printf(", %.2fx sgemm", rate / sgemm_rate);  // when f32 is among --types
        std::printf(")");
        if (type != WeightType::F32) {
          const double tp = per_call(1, smoke ? 1 : 3, 1, [&](int64_t) {
            qkv::kernels::gemm_weight_panels(w.view(0), many, x.data(), s.K, 0.0f, y.data(), s.N);
          });
          std::printf("; panels %6.1f GFLOP/s (%.2fx gemm_weight)", flops / tp / 1e9, t / tp);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }

    // ---- where the paths cross ----
    const Shape& cross = smoke ? kSmokeShapes[1] : kShapes[3];
      std::printf("\nstreaming (gemm_weight's path) vs panels on %s, ms per call by M\n", cross.name);
    for (WeightType type : types) {
      if (!qkv::kernels::is_block_quantized(type) && type != WeightType::BF16) continue;
      const int64_t one = qkv::kernels::row_bytes(type, cross.K) * cross.N;
      const Weights w(type, cross.N, cross.K, std::max<int64_t>(1, pool / one));
      std::printf("  %-6s", qkv::kernels::weight_type_name(type));
      for (int64_t M : {1, 2, 4, 8, 16, 32, 64, 128}) {
        std::vector<float> x(static_cast<size_t>(M * cross.K)), y(static_cast<size_t>(M * cross.N));
        fill(x.data(), M * cross.K, 11);
        const double ts = per_call(w.copies, runs, 4, [&](int64_t c) {
          qkv::kernels::gemm_weight_streaming(w.view(c), M, x.data(), cross.K, 0.0f, y.data(), cross.N);
        });
        const double tp = per_call(w.copies, runs, 4, [&](int64_t c) {
          qkv::kernels::gemm_weight_panels(w.view(c), M, x.data(), cross.K, 0.0f, y.data(), cross.N);
        });
        std::printf("  M=%-2lld %.3f/%.3f", static_cast<long long>(M), 1e3 * ts, 1e3 * tp);
      }
      std::printf("\n");
    }
    std::printf("\nread bandwidth over the section: %.1f GB/s median of %zu measurements (min %.1f, max %.1f)\n",
                median(bandwidths) / 1e9, bandwidths.size(), *std::min_element(bandwidths.begin(), bandwidths.end()) / 1e9,
                *std::max_element(bandwidths.begin(), bandwidths.end()) / 1e9);
  }
  return 0;
}
