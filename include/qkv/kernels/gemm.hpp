// Matrix products: OpenBLAS sgemm, split between OpenMP threads by output slices, beside a plain reference; and
// products of bfloat16 operands with float32 accumulation through oneDNN's matmul (VDPBF16PS or AMX tiles).
// Not here: the attention kernel's own micro-kernels (src/kernels/micro_kernels.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// What a product does with denormals (magnitudes below float's smallest normal, 1.2e-38). Keep: IEEE arithmetic,
// as PyTorch. Flush: every thread of the product runs with FTZ and DAZ set (x86), so a denormal input or result
// is 0. For products of probabilities, whose tiny entries times a small weight land there: each such operation
// costs a microcode assist, ~100× an FMA (measured: the GPT-2 head's dlogits products 25% slower in the steps
// where a tenth of the probabilities fell below 1e-30). A flushed term changes a sum only when that sum is itself
// below ~1e-31.
enum class Denormals { Keep, Flush };

// C (M,N) = alpha * op(A) @ op(B) + beta * C, op(X) = X or Xᵀ. A is (M,K) or, transposed, (K,M);
// B is (K,N) or (N,K). lda/ldb/ldc are row strides. OpenBLAS runs single-threaded inside qkv; this function
// splits C between OpenMP threads by rows or columns (each thread owns its slice).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, Denormals denormals = Denormals::Keep);
// The BLAS kernels this process runs, e.g. "OpenBLAS SkylakeX" (OpenBLAS picks them at load time from the CPU, or
// from OPENBLAS_CORETYPE), for benchmarks to report beside their figures.
const char* gemm_backend();

// C (M,N) = alpha * op(A) @ op(B) + beta * C with bfloat16 operands (kernels/convert.hpp's bit patterns) and a
// float32 result, every product of two bf16 values summed in float32 — PyTorch's CPU autocast. The same layout
// rules as gemm(). Through oneDNN's matmul when qkv was built with it (one primitive per shape, created on first use
// and kept; oneDNN runs on qkv's OpenMP threads, so results are identical for a given thread count); otherwise, or
// where oneDNN has no bf16 kernel for the CPU, by widening both operands to float32 and calling gemm() — the same
// values, at float32's speed less the widening. qkv's own loops run instead where they were measured faster: one
// row times a transposed matrix (generation, VDPBF16PS at the memory rate) and, on AMX, every product but an output
// head's dW (oneDNN 2.6's AMX matmul reaches about a tenth of the tile rate on GPT-2's shapes; qkv's tile loop takes
// 1.1-1.28× less time over a training step's products, measured alone).
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Whether this CPU multiplies bf16 in hardware (AVX512_BF16 or AMX-BF16), so gemm_bf16 runs at up to twice
// float32's rate; false on a Zen 3 or an Ice Lake, where gemm_bf16 widens to float32.
bool bf16_native();
// Whether AMX-BF16 tiles (TDPBF16PS, Intel Sapphire Rapids and later) can run in this process: the CPU has them and
// Linux granted the tile state (asked for once, on the first call). gemm_bf16 and the fused attention kernel's bf16
// products use them where true; oneDNN's matmul asks for itself.
bool amx_bf16_ready();
// What gemm_bf16 runs here, e.g. "oneDNN 2.6.3 brgemm avx512_core_bf16" or "qkv's AMX tiles (TDPBF16PS); …", or
// why it widens ("widened to float32: the CPU lacks AVX512_BF16 and AMX-BF16"), for benchmarks and run headers.
const char* gemm_bf16_backend();
// gemm_bf16 through oneDNN's matmul alone, whatever gemm_bf16 would choose: for benchmarks that set qkv's AMX loop
// beside it. False (C untouched) when qkv was built without oneDNN or the CPU has no bf16 products.
bool gemm_bf16_onednn(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                      int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);
// The missing instruction sets in words when !bf16_native(), else "".
const char* bf16_missing();

// The reference: every operand widened exactly, products summed in double.
void gemm_bf16_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                         int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace qkv::kernels
