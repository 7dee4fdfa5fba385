// The precision of matrix products, as PyTorch's CPU autocast sets it: float32 (the default), or bfloat16
// operands with float32 sums for Linear layers, the fused output head and matmul. Everything else stays float32:
// master weights, norms, softmax, losses, gradients and the optimiser. Per thread, like grad mode; an op records
// the precision it ran in, so its backward uses the same whatever is set when backward() runs.
// Not here: the bf16 kernels (kernels/gemm.hpp's gemm_bf16) and the rounded copies (Tensor::bf16).
#pragma once

#include <string>
#include <string_view>

namespace qkv {

enum class Precision {
  FP32,  // float32 products, bit for bit what qkv computed before bf16 existed
  BF16,  // bf16 × bf16 → float32 products: twice float32's arithmetic on CPUs with AVX512_BF16 or AMX
};

// This thread's precision for products (FP32 unless a PrecisionGuard says otherwise).
Precision precision();

// Inside this scope products run in `p` (torch.autocast("cpu", dtype=torch.bfloat16) for BF16).
class PrecisionGuard {
 public:
  explicit PrecisionGuard(Precision p);  // products in p until the guard goes, then as before
  ~PrecisionGuard();
  PrecisionGuard(const PrecisionGuard&) = delete;
  PrecisionGuard& operator=(const PrecisionGuard&) = delete;

 private:
  Precision previous_;
};

// "fp32" or "bf16".
const char* precision_name(Precision p);
// Reads "fp32", "bf16" or "auto" (ValueError naming `what` otherwise). auto is bf16 where the CPU multiplies bf16 in
// hardware (AVX512_BF16 or AMX-BF16), else fp32. bf16 asked for on a CPU without either is a ValueError naming the
// missing instruction sets: there it would run as float32 products plus conversions, slower than fp32.
Precision resolve_precision(std::string_view text, const std::string& what = "precision");
// One line for a run's header: "bf16 (auto: AVX512_BF16; products through oneDNN 2.6.3 matmul …)" or "fp32".
std::string describe_precision(Precision p, std::string_view asked = "");

}  // namespace qkv
