// Kernels: pure compute on raw float pointers. No allocation in hot loops, no graph, no I/O. Every fast
// kernel has a plain scalar reference (suffix _reference) that tests/test_kernel_table.cpp compares it with.
// Layouts are row-major; every comment states the shapes. This header gathers the kernel headers.
// Threads: kernels use OpenMP (OMP_NUM_THREADS or omp_set_num_threads); OpenBLAS runs single-threaded inside
// qkv. Calls on disjoint outputs may run concurrently.
#pragma once

#include "qkv/kernels/activations.hpp"
#include "qkv/kernels/attention.hpp"
#include "qkv/kernels/attention_decode.hpp"
#include "qkv/kernels/convert.hpp"
#include "qkv/kernels/conv1d.hpp"
#include "qkv/kernels/delta_rule.hpp"
#include "qkv/kernels/elementwise.hpp"
#include "qkv/kernels/embedding.hpp"
#include "qkv/kernels/gemm.hpp"
#include "qkv/kernels/memory.hpp"
#include "qkv/kernels/moe.hpp"
#include "qkv/kernels/norms.hpp"
#include "qkv/kernels/optim.hpp"
#include "qkv/kernels/quant.hpp"
#include "qkv/kernels/rope.hpp"
#include "qkv/kernels/softmax.hpp"
#include "qkv/kernels/threads.hpp"
#include "qkv/kernels/weights.hpp"
