// qkv: trainable self-attention, exactly, visibly and fast — the umbrella header.
#pragma once

#include "qkv/autograd.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/attention.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/module.hpp"
#include "qkv/ops.hpp"
#include "qkv/optim.hpp"
#include "qkv/random.hpp"
#include "qkv/tensor.hpp"
#include "qkv/version.hpp"
