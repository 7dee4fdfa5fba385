// Test helpers: fixture paths, tensor comparison with relative+absolute tolerance, and a gradient check.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "qkv/kernels/threads.hpp"
#include "qkv/qkv.hpp"

namespace qkv::test {

inline std::string fixture(const std::string& name) { return std::string(QKV_FIXTURES) + "/" + name; }

// Every element satisfies |a − e| ≤ atol + rtol·|e|; reports the first few offenders.
// Runs the qkv command-line tool (stdout and stderr together), optionally behind a prefix such as `timeout`.
struct CliResult {
  int code;
  std::string out;
};
// Runs a shell command line, stdout and stderr together; code -1 when it did not exit normally (or did not start)
inline CliResult run_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return {-1, "could not start: " + command};
  std::string out;
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) out.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}
inline CliResult run_cli(const std::string& arguments, const std::string& prefix = "") {
  return run_command(prefix + std::string(QKV_CLI) + " " + arguments);
}

inline ::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double rtol = 1e-5,
                                            double atol = 1e-6) {
  if (!actual.defined() || !expected.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (!(actual.shape() == expected.shape())) {
    return ::testing::AssertionFailure() << "shape " << actual.shape().str() << " vs expected "
                                         << expected.shape().str();
  }
  int bad = 0;
  std::string report;
  double worst = 0.0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double a = actual.data()[i], e = expected.data()[i];
    const bool both_nan = std::isnan(a) && std::isnan(e);
    const double err = std::fabs(a - e);
    if (!both_nan && !(err <= atol + rtol * std::fabs(e))) {
      if (bad < 5) report += "\n  [" + std::to_string(i) + "] " + std::to_string(a) + " vs " + std::to_string(e);
      ++bad;
    }
    if (!both_nan) worst = std::max(worst, err);
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << actual.numel() << " elements differ (worst "
                                                << worst << ")" << report;
  return ::testing::AssertionSuccess();
}

// The library's thread count set for a scope and put back after, even when an ASSERT leaves the test early.
class ThreadCount {
 public:
  explicit ThreadCount(int threads) : before_(num_threads()) { set_num_threads(threads); }
  ~ThreadCount() { set_num_threads(before_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int before_;
};

inline Tensor random_tensor(const Shape& shape, uint64_t seed, float scale = 1.0f) {
  Generator gen(seed);
  Tensor t = gen.randn(shape);
  for (float& v : t.values()) v *= scale;
  return t;
}

// Central-difference gradient check. f maps the inputs to one tensor; the check differentiates
// L = Σ f(x) ⊙ R for a fixed random R, accumulating L in double. Returns the worst relative error.
inline ::testing::AssertionResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                            std::vector<Tensor> inputs, double eps = 1e-2, double tol = 1e-2) {
  for (auto& x : inputs) x = x.clone().requires_grad_(true);  // fresh leaves: no gradient from earlier checks
  Tensor out = f(inputs);
  const Tensor weights = random_tensor(out.shape(), 99);
  out.backward(weights);
  auto loss = [&]() {
    NoGradGuard no_grad;
    const Tensor y = f(inputs);
    double total = 0.0;
    for (int64_t i = 0; i < y.numel(); ++i) total += static_cast<double>(y.data()[i]) * weights.data()[i];
    return total;
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor& x = inputs[k];
    const Tensor analytic = x.grad();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float saved = x.data()[i];
      x.data()[i] = saved + static_cast<float>(eps);
      const double up = loss();
      x.data()[i] = saved - static_cast<float>(eps);
      const double down = loss();
      x.data()[i] = saved;
      const double numeric = (up - down) / (2.0 * eps);
      const double a = analytic.defined() ? analytic.data()[i] : 0.0;
      if (std::fabs(a - numeric) > tol * (1.0 + std::fabs(numeric))) {
        return ::testing::AssertionFailure() << "input " << k << " element " << i << ": analytic " << a
                                             << " vs numeric " << numeric;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace qkv::test
