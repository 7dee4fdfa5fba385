// qkv: trainable self-attention, exactly, visibly and fast — the umbrella header.
#pragma once

#include "qkv/core/autograd.hpp"
#include "qkv/core/error.hpp"
#include "qkv/nn/attention.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/module.hpp"
#include "qkv/core/ops.hpp"
#include "qkv/train/optim.hpp"
#include "qkv/core/random.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/version.hpp"
