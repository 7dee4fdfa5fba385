// Conversions between float32 and the 16-bit floating-point storage types (bfloat16, IEEE half), vectorised, beside
// their scalar references. Pure loops on raw pointers; values are little-endian 16-bit patterns.
// Not here: which tensors hold which dtype (io/safetensors.hpp).
#pragma once

#include <cstdint>

namespace qkv::kernels {

// bf16 → f32 is exact: the 16 bits become the high half of the float.
void bf16_to_f32(const uint16_t* src, float* dst, int64_t n);
// f32 → bf16, rounding to nearest even; NaN stays NaN (a quiet NaN with the sign kept), ±Inf stays ±Inf.
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n);
// IEEE half → f32, exact for every half (subnormals, infinities, NaN), with F16C where the CPU has it.
void f16_to_f32(const uint16_t* src, float* dst, int64_t n);
// f32 → IEEE half, rounding to nearest even (beyond ±65504 to ±Inf, below 2⁻²⁴ through the subnormals to ±0), as ggml's
// ggml_fp32_to_fp16: a NaN becomes the quiet NaN 0x7e00 with its sign (F16C would keep part of the payload).
void f32_to_f16(const float* src, uint16_t* dst, int64_t n);

// Copies n floats from src (any alignment: a file mapping's) to dst and says whether all of them are finite, in one
// pass over both (a loader's copy and its NaN/Inf check together).
bool copy_finite(const void* src, float* dst, int64_t n);
// Whether all n floats are finite (no NaN, no ±Inf), threads splitting the array.
bool all_finite(const float* x, int64_t n);

// The same, one element at a time from the bit layouts: the references.
float bf16_to_f32_reference(uint16_t h);
uint16_t f32_to_bf16_reference(float f);
float f16_to_f32_reference(uint16_t h);
uint16_t f32_to_f16_reference(float f);

}  // namespace qkv::kernels
