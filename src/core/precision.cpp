// The product precision (see qkv/core/precision.hpp).
#include "qkv/core/precision.hpp"

#include "qkv/core/error.hpp"
#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/gemm.hpp"

namespace qkv {

namespace {
thread_local Precision g_precision = Precision::FP32;
}

Precision precision() { return g_precision; }

PrecisionGuard::PrecisionGuard(Precision p) : previous_(g_precision) { g_precision = p; }
PrecisionGuard::~PrecisionGuard() { g_precision = previous_; }

const char* precision_name(Precision p) { return p == Precision::BF16 ? "bf16" : "fp32"; }

Precision resolve_precision(std::string_view text, const std::string& what) {
  if (text == "fp32") return Precision::FP32;
  if (text == "auto") return kernels::bf16_native() ? Precision::BF16 : Precision::FP32;
  if (text == "bf16") {
    if (!kernels::bf16_native()) {
      throw ValueError(what + " = bf16: this CPU lacks " + std::string(kernels::bf16_missing()) +
                       ", so bf16 products would be widened to float32 and run slower than fp32; use fp32 (or auto, "
                       "which picks bf16 only where the CPU has it)");
    }
    return Precision::BF16;
  }
  throw ValueError(what + " = \"" + std::string(text) + "\" is not a precision; use fp32, bf16 or auto");
}

std::string describe_precision(Precision p, std::string_view asked) {
  std::string out = precision_name(p);
  if (p == Precision::BF16)
    out += std::string(" (") + (asked == "auto" ? "auto; " : "") + "bf16 products with float32 sums: " +
           kernels::gemm_bf16_backend() + "; attention " +
           (kernels::attention_bf16_available() ? std::string("qkv's kernel on ") + kernels::attention_bf16_products()
                                                 : std::string("float32 (no bf16 kernel in this build)")) +
           ")";
  else if (asked == "auto")
    out += std::string(" (auto: this CPU lacks ") + kernels::bf16_missing() + ")";
  return out;
}

}  // namespace qkv
