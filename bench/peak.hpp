// The machine's FMA peak, measured: independent FMA chains on every thread, AVX2 and, where the build has it,
// AVX-512 (the faster counts). Shared by the benchmarks that report "% of peak".
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "qkv/core/profile.hpp"
#include "qkv/kernels/gemm.hpp"

namespace qkv::bench {

// A field of this process's /proc/self/status in kB ("VmHWM": the peak resident set, "VmRSS": now, "RssFile": the
// mapped files' part), or −1 when it has none. Peak RSS from here, not getrusage's ru_maxrss: a process started by
// posix_spawn shares its parent's memory until it execs, and ru_maxrss keeps the parent's resident size from then.
inline double proc_status_kb(const char* key) {
  std::ifstream status("/proc/self/status");
  const std::string prefix = std::string(key) + ":";
  for (std::string line; std::getline(status, line);)
    if (line.rfind(prefix, 0) == 0) return std::atof(line.c_str() + prefix.size());
  return -1;
}

inline void keep(float v) {
  volatile float sink = v;
  (void)sink;
}

// Seconds of CPU time this process has used, all threads together. On a shared machine a rate per CPU-second the
// process got is what the code does; a wall-clock rate also measures the other processes.
inline double process_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The best of three timed runs of `chains(iterations)` on every thread (each returns a value to keep, so the loop
// cannot be dropped), in GFLOP/s of `flops` per iteration and thread; per wall-clock second, or per CPU-second of the
// process divided by the threads (cpu_time).
template <class Chains>
double best_of_three(int threads, int64_t iterations, double flops, Chains chains, bool cpu_time = false) {
  double best = 0.0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = process_cpu_seconds();
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += chains(iterations);
    const double elapsed = cpu_time ? (process_cpu_seconds() - cpu_start) / threads
                                    : std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    keep(sink);
    best = std::max(best, static_cast<double>(iterations) * flops * threads / elapsed / 1e9);
  }
  return best;
}

#if defined(__AVX512F__)
inline float lanes_sum(const __m512* acc) {  // of 12 accumulators
  __m512 total = acc[0];
  for (int i = 1; i < 12; ++i) total = _mm512_add_ps(total, acc[i]);
  float lanes[16], sum = 0.0f;  // not _mm512_reduce_add_ps: GCC 12 warns inside it (-Wuninitialized)
  _mm512_storeu_ps(lanes, total);
  for (float l : lanes) sum += l;
  return sum;
}
#endif

// 12 independent FMA chains per thread hide the 4-cycle latency on both FMA pipes.
inline double measure_fma_peak(int threads, double seconds, bool cpu_time = false) {
  double best = best_of_three(threads, static_cast<int64_t>(seconds * 2e8 / 3), 12 * 8 * 2, [](int64_t iterations) {
    float sink = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12  // acc[] must live in registers: rolled (GCC at -O2), it goes through memory at a third the rate
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    }
    float lanes[8];
    __m256 total = acc[0];
    for (int i = 1; i < 12; ++i) total = _mm256_add_ps(total, acc[i]);
    _mm256_storeu_ps(lanes, total);
    for (float l : lanes) sink += l;
#else
    float acc[12][8] = {};
    for (int64_t it = 0; it < iterations; ++it)
      for (int i = 0; i < 12; ++i)
        for (int l = 0; l < 8; ++l) acc[i][l] = acc[i][l] * 0.999999f + 1e-7f;
    for (auto& row : acc)
      for (float v : row) sink += v;
#endif
    return sink;
  }, cpu_time);
#if defined(__AVX512F__)
  // A machine with AVX-512 may have twice the FMA width (two 512-bit units), or the same (Zen 4 splits 512-bit
  // FMAs in two): the peak is the faster of the two loops, so "% of peak" is of what the machine can do.
  best = std::max(best, best_of_three(threads, static_cast<int64_t>(seconds * 1e8 / 3), 12 * 16 * 2, [](int64_t iterations) {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    }
    return lanes_sum(acc);
  }, cpu_time));
#endif
  return best;
}

// The bf16 dot-product peak: independent VDPBF16PS chains (each does 32 bf16 products and their sums into 16 floats,
// counted as 64 FLOPs) on every thread; 0 where the build lacks AVX512_BF16.
inline double measure_vdpbf16ps_peak(int threads, double seconds) {
#if defined(__AVX512BF16__)
  return best_of_three(threads, static_cast<int64_t>(seconds * 1e8 / 3), 12 * 64, [](int64_t iterations) {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(1e-4f));
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    return lanes_sum(acc);
  });
#else
  (void)threads;
  (void)seconds;
  return 0.0;
#endif
}

// AMX: four independent 16 × 16 float32 tiles, each TDPBF16PS a (16 × 32) · (32 × 16) product, 16,384 flops; the
// operand tiles stay loaded, so this is the tile unit's rate alone. 0 where the CPU, build or kernel has no AMX.
inline double measure_amx_peak(int threads, double seconds) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!kernels::amx_bf16_ready()) return 0.0;
  return best_of_three(threads, static_cast<int64_t>(seconds * 2e7 / 3), 4 * 16384, [](int64_t iterations) {
    struct alignas(64) Config {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = 16;
    }
    alignas(64) uint16_t operand[16 * 32];
    std::fill_n(operand, 16 * 32, uint16_t{0x3a83});  // 1e-3 in bf16
    alignas(64) float out[16 * 16];
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_loadd(6, operand, 64);
    _tile_loadd(7, operand, 64);
    for (int64_t it = 0; it < iterations; ++it) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
  });
#else
  (void)threads;
  (void)seconds;
  return 0.0;
#endif
}

// The bf16 peak: the faster of VDPBF16PS chains and AMX tiles (where the CPU has them), 0 without either.
inline double measure_bf16_peak(int threads, double seconds) {
  return std::max(measure_vdpbf16ps_peak(threads, seconds), measure_amx_peak(threads, seconds));
}

// One pass summing `buffer` (well beyond the caches) on the run's threads, in bytes per second. `prefetch`: each step
// also asks for the line 8 KiB ahead, as the generation kernels do (one thread's stream on a Zen 5 reads faster so).
inline double read_pass(const std::vector<float>& buffer, bool prefetch = false) {
  const auto t = std::chrono::steady_clock::now();
  double total = 0.0;
  const int64_t n = static_cast<int64_t>(buffer.size());
  // Four independent vector sums per thread: the loads, not the adds, set the pace.
#pragma omp parallel reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    const int64_t begin = n * t / parts / 32 * 32, end = t + 1 == parts ? n / 32 * 32 : n * (t + 1) / parts / 32 * 32;
    const float* p = buffer.data();
#if defined(__AVX__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = begin; i < end; i += 32) {
      if (prefetch) {
        __builtin_prefetch(p + i + 2048, 0, 3);
        __builtin_prefetch(p + i + 2048 + 16, 0, 3);
      }
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else  // a portable build (QKV_NATIVE=OFF): SSE2, eight 16-byte loads a step
    __m128 a[8];
    for (auto& v : a) v = _mm_setzero_ps();
    for (int64_t i = begin; i < end; i += 32) {
      if (prefetch) {
        __builtin_prefetch(p + i + 2048, 0, 3);
        __builtin_prefetch(p + i + 2048 + 16, 0, 3);
      }
      for (int v = 0; v < 8; ++v) a[v] = _mm_add_ps(a[v], _mm_loadu_ps(p + i + 4 * v));
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_add_ps(_mm_add_ps(_mm_add_ps(a[0], a[1]), _mm_add_ps(a[2], a[3])),
                                   _mm_add_ps(_mm_add_ps(a[4], a[5]), _mm_add_ps(a[6], a[7]))));
#endif
    for (float l : lanes) total += l;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  if (total < 0) std::printf("%f", total);
  return static_cast<double>(buffer.size() * sizeof(float)) / seconds;
}

// Read bandwidth: the best of a few passes summing a buffer well beyond the caches, on the run's threads.
inline double read_bandwidth(int64_t bytes) {
  std::vector<float> buffer(static_cast<size_t>(bytes / 4), 1.0f);
  double best = 0.0;
  for (int pass = 0; pass < 5; ++pass) best = std::max(best, read_pass(buffer));
  return best;
}

// Runs `step` once with the op profile on (qkv/core/profile.hpp), from an empty profile; returns its seconds.
template <class Step>
double profiled_step(Step&& step) {
  qkv::reset_op_profile();
  qkv::set_op_profiling(true);
  const auto began = std::chrono::steady_clock::now();
  step();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  qkv::set_op_profiling(false);
  return total;
}

// The op profile of one profiled step (qkv::op_profile()), largest first: each op's forward and backward
// milliseconds, its share of the step's `total` seconds and its calls, then the rows timed outside the ops
// (`extra`: name, seconds) and what no row accounts for.
inline void print_op_profile(double total, const std::vector<std::pair<std::string, double>>& extra) {
  const auto profile = qkv::op_profile();
  std::vector<std::pair<std::string, qkv::OpTime>> rows(profile.begin(), profile.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second.forward_seconds + a.second.backward_seconds > b.second.forward_seconds + b.second.backward_seconds;
  });
  std::printf("\nwhere one step's %.3f s go (op: forward ms, backward ms, share of the step, calls):\n", total);
  double accounted = 0;
  for (const auto& [name, t] : rows) {
    accounted += t.forward_seconds + t.backward_seconds;
    std::printf("  %-22s %9.1f %9.1f %6.1f%% %6lld\n", name.c_str(), 1e3 * t.forward_seconds, 1e3 * t.backward_seconds,
                100 * (t.forward_seconds + t.backward_seconds) / total, static_cast<long long>(t.calls));
  }
  for (const auto& [name, seconds] : extra) {
    accounted += seconds;
    std::printf("  %-22s %9.1f %9s %6.1f%%\n", name.c_str(), 1e3 * seconds, "", 100 * seconds / total);
  }
  std::printf("  %-22s %9.1f %9s %6.1f%%\n", "other (loss, glue)", 1e3 * (total - accounted), "", 100 * (total - accounted) / total);
}

}  // namespace qkv::bench
