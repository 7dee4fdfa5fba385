#!/usr/bin/python3
"""The bytes ggml itself makes of fixed inputs, for tests/test_quant.cpp to compare qkv's quantizers with, bit for bit.

Loads the real ggml (libggml-base.so of npm's node-llama-cpp, a prebuilt llama.cpp; its exports include
ggml_quantize_chunk, quantize_row_*_ref, dequantize_row_* and the half/bfloat16 conversions) through ctypes and writes
one small file per type under tests/fixtures/quant/:

  /usr/bin/python3 tools/ggml_quant_reference.py [--lib PATH/libggml-base.so] [--out tests/fixtures/quant]
  (npm install node-llama-cpp@3.22.1 --ignore-scripts in a scratch folder gives the library under
   node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/)

Inputs come from a generator the C++ test repeats exactly (splitmix64; every value a 24-bit integer times a power of
two, so no rounding happens in making them): TRICKY_ROWS rows of 256 values that reach the quantizers' edge cases
(all zeros, one large outlier, tiny and denormal values, negative-only, constant, .5 ties, sub-blocks of very different
scales), then BULK_ROWS rows of random values with a random power-of-two scale per 32 values.
  q8_0.bin q4_0.bin q4_K.bin q5_K.bin q6_K.bin mxfp4.bin: ggml_quantize_chunk's bytes of the tricky rows (no importance matrix:
      llama-quantize's path), then the FNV-1a 64-bit hash of its bytes of the bulk rows, then the hash of
      dequantize_row_*'s floats of all rows (tricky, then bulk). Little-endian.
  f16.bin bf16.bin: ggml_fp32_to_fp16_row's / ggml_fp32_to_bf16_row_ref's 16-bit results for HALF_SPECIALS followed
      by HALF_RANDOM random 32-bit patterns (NaNs with payloads, infinities, denormals, ties), then the hash of
      ggml_fp16_to_fp32_row's / ggml_bf16_to_fp32_row's floats of all 65,536 patterns.
"""
import argparse
import ctypes
import glob
import os
import struct
import sys

import numpy as np

TRICKY_ROWS = 12
BULK_ROWS = 512
COLS = 256
HALF_RANDOM = 512
# Edges of the half and bfloat16 roundings (float32 values, as bit patterns where a literal would not be exact).
HALF_SPECIALS = [0x00000000, 0x80000000, 0x3f800000, 0xbf800000,
                 0x477fe000,  # 65504, the largest half
                 0x477fefff,  # just below the tie between 65504 and 65536: 65504
                 0x477ff000,  # the tie: to even, i.e. Inf
                 0x47800000, 0x7f7fffff, 0x7f800000, 0xff800000,
                 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000, 0xffffffff, 0x7fc12345,  # NaNs, signalling and quiet
                 0x38800000,  # 2^-14, the least normal half
                 0x387fffff, 0x387ff000, 0x387fe000,  # below it: rounding up into the normals, ties
                 0x33800000,  # 2^-24, the least subnormal half
                 0x33000000,  # 2^-25: a tie, to even 0
                 0x33000001, 0x33400000, 0x32ffffff, 0x00000001, 0x80000001, 0x00800000,  # float denormals, the least normal
                 0x3f801000,  # 1 + 2^-11: a half tie, to even 1
                 0x3f803000,  # 1 + 3·2^-11: a tie, to even 1 + 2^-9
                 0x3f808000,  # 1 + 2^-8: a bfloat16 tie, to even 1
                 0x3f818000,  # 1 + 3·2^-8: a bfloat16 tie, to even 1 + 2^-6
                 0x3f7fffff, 0x4b800000, 0xc7c35000]
TYPES = {"q8_0": 8, "q4_0": 2, "q4_K": 12, "q5_K": 13, "q6_K": 14, "mxfp4": 39}
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_K": (256, 144), "q5_K": (256, 176), "q6_K": (256, 210),
         "mxfp4": (32, 17)}
MASK = (1 << 64) - 1


class Rng:
    """splitmix64 (tests/test_quant.cpp has the same)."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self):
        """[-1, 1) on a grid of 2^-23: exact in float32."""
        return ((self.next() >> 40) - (1 << 23)) / float(1 << 23)


def tricky_row(r):
    g = Rng(1000 + r)
    u = [g.uniform() for _ in range(COLS)]
    if r == 0:
        return [0.0] * COLS                                     # all zeros
    if r == 1:
        return u                                                # uniform
    if r == 2:
        return [1000.0 if i == 37 else v for i, v in enumerate(u)]  # one large outlier
    if r == 3:
        return [v * 2.0 ** -20 for v in u]                      # tiny: the scales become subnormal halves
    if r == 4:
        return [v * 2.0 ** -135 for v in u]                     # float denormals: the scales underflow to 0
    if r == 5:
        return [-abs(v) - 0.25 for v in u]                      # negative only
    if r == 6:                                                  # Q8_0 ties: d = 1, values k + 0.5
        return [127.0 if i % 32 == 0 else float((i * 37) % 253 - 126) + 0.5 for i in range(COLS)]
    if r == 7:                                                  # Q4_0 with d = 1: values on the truncation edges
        return [-8.0 if i % 32 == 0 else float(i % 16) - 7.5 for i in range(COLS)]
    if r == 8:
        return [-0.5] * COLS                                    # constant: max == min
    if r == 9:
        return [v * 2.0 ** 14 for v in u]                       # large
    if r == 10:                                                 # sub-blocks of very different scales
        return [v * 2.0 ** (-3 * (i // 32)) for i, v in enumerate(u)]
    if r == 11:
        return [float(np.float32(v * abs(v) * 4.0)) if i % 2 else abs(v) + 0.125 for i, v in enumerate(u)]  # heavy tail
    raise ValueError(r)


def bulk_row(r):
    g = Rng(0x5EED0000 + r)
    out = []
    for _ in range(COLS // 32):
        scale = 2.0 ** (int(g.next() >> 60) - 8)                # 2^-8 … 2^7 per 32 values
        out += [g.uniform() * scale for _ in range(32)]
    return out


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def find_lib(path):
    if path:
        return path
    here = os.path.dirname(os.path.abspath(__file__))
    for root in [os.path.join(here, "..", ".cache", "node", "node_modules")]:
        found = glob.glob(os.path.join(root, "@node-llama-cpp", "linux-x64", "bins", "linux-x64", "libggml-base.so"))
        if found:
            return found[0]
    sys.exit("libggml-base.so not found: npm install node-llama-cpp@3.22.1 --ignore-scripts, then pass --lib")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"))
    args = parser.parse_args()
    lib = ctypes.CDLL(find_lib(args.lib))
    ptr = ctypes.c_void_p
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ptr, ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ptr]
    for name in ["ggml_fp32_to_fp16_row", "ggml_fp32_to_bf16_row_ref", "ggml_fp16_to_fp32_row", "ggml_bf16_to_fp32_row"]:
        getattr(lib, name).argtypes = [ptr, ptr, ctypes.c_int64]
    os.makedirs(args.out, exist_ok=True)

    tricky = np.array([tricky_row(r) for r in range(TRICKY_ROWS)], dtype=np.float32)
    bulk = np.array([bulk_row(r) for r in range(BULK_ROWS)], dtype=np.float32)
    for name, ggml_type in TYPES.items():
        per_block, block_bytes = BLOCK[name]
        def quantize(x):
            out = np.zeros(x.shape[0] * x.shape[1] // per_block * block_bytes, dtype=np.uint8)
            n = lib.ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
            assert n == out.size
            ref = np.zeros_like(out)  # quantize_row_*_ref, the function ggml_quantize_chunk runs without an imatrix
            getattr(lib, "quantize_row_%s_ref" % name).argtypes = [ptr, ptr, ctypes.c_int64]
            getattr(lib, "quantize_row_%s_ref" % name)(x.ctypes.data, ref.ctypes.data, x.size)
            assert (ref == out).all()
            return out
        def dequantize(q, rows):
            out = np.zeros(rows * COLS, dtype=np.float32)
            getattr(lib, "dequantize_row_%s" % name).argtypes = [ptr, ptr, ctypes.c_int64]
            getattr(lib, "dequantize_row_%s" % name)(q.ctypes.data, out.ctypes.data, out.size)
            return out
        q_tricky, q_bulk = quantize(tricky), quantize(bulk)
        floats = np.concatenate([dequantize(q_tricky, TRICKY_ROWS), dequantize(q_bulk, BULK_ROWS)])
        with open(os.path.join(args.out, name + ".bin"), "wb") as f:
            f.write(q_tricky.tobytes())
            f.write(struct.pack("<QQ", fnv1a(q_bulk.tobytes()), fnv1a(floats.tobytes())))
        print("%s: %d tricky bytes, bulk hash %016x, dequantized hash %016x" % (
            name, q_tricky.size, fnv1a(q_bulk.tobytes()), fnv1a(floats.tobytes())))

    g = Rng(0xF16)
    bits = np.array(HALF_SPECIALS + [g.next() & 0xFFFFFFFF for _ in range(HALF_RANDOM)], dtype=np.uint32)
    values = bits.view(np.float32)
    every = np.arange(65536, dtype=np.uint16)
    for name, to_half, from_half in [("f16", "ggml_fp32_to_fp16_row", "ggml_fp16_to_fp32_row"),
                                     ("bf16", "ggml_fp32_to_bf16_row_ref", "ggml_bf16_to_fp32_row")]:
        halves = np.zeros(values.size, dtype=np.uint16)
        getattr(lib, to_half)(values.ctypes.data, halves.ctypes.data, values.size)
        widened = np.zeros(65536, dtype=np.float32)
        getattr(lib, from_half)(every.ctypes.data, widened.ctypes.data, 65536)
        with open(os.path.join(args.out, name + ".bin"), "wb") as f:
            f.write(halves.tobytes())
            f.write(struct.pack("<Q", fnv1a(widened.tobytes())))
        print("%s: %d values, widened hash %016x" % (name, values.size, fnv1a(widened.tobytes())))


if __name__ == "__main__":
    main()
