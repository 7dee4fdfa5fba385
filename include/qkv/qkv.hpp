// qkv: trainable self-attention, exactly, visibly and fast — the umbrella header (qkv::qkv; pictures are in
// qkv::viz, qkv/viz/*.hpp, which links libpng).
//
// Layers, each calling only those to its left:
//   kernels (raw float loops) ← core (Tensor, tape, ops, random, io) ← nn (modules) ← train (optimisers, loop)
//   text (tokenizers, chat templates, datasets) sits on core, below nn; viz (pictures) sits beside, on core.
// The umbrella covers the book's classes and today's decoders (load_pretrained, generate); the rest (training loops,
// fine-tuning, file formats) is one include away: qkv/train/*.hpp, qkv/io/*.hpp.
//
// Concurrency contract:
// - Calls on different objects may run concurrently: two threads may each build, train or run their own modules
//   and tensors. One object (a Tensor, a Module, a Generator, an optimiser) is never synchronised: share it
//   only for reading (a model in eval mode may serve several threads that each keep their own KV cache).
// - The tape's grad mode (NoGradGuard) is per thread.
// - default_generator() is one process-wide Generator, as in PyTorch: modules built without a generator draw
//   from it, so build modules on one thread or pass each thread its own Generator.
// - Inside qkv, threads come from OpenMP (OMP_NUM_THREADS, omp_set_num_threads); OpenBLAS runs
//   single-threaded and qkv splits each GEMM between its OpenMP threads. Results are deterministic for a
//   given thread count; the attention kernel gives the same bits for any count.
// - The library never calls exit; errors are exceptions (qkv/core/error.hpp).
#pragma once

#include "qkv/core/autograd.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/core/precision.hpp"
#include "qkv/core/random.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/nn/attention.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/module.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/version.hpp"

// Today's decoders: load a checkpoint with its tokenizer and chat template (nn::load_pretrained), generate from it.
#include "qkv/nn/decoder.hpp"
#include "qkv/nn/generate.hpp"
#include "qkv/nn/lora.hpp"
#include "qkv/nn/pretrained.hpp"
#include "qkv/text/chat_template.hpp"
#include "qkv/text/tokenizer.hpp"
