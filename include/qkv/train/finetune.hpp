// Fine-tuning, as the book's chapters 6 and 7 and appendix E do it: one include for all of it.
//   which parameters train, LoRA, PEFT adapters   nn/lora.hpp
//   classification (chapter 6)                    train/classify.hpp
//   instruction following (chapter 7)             train/instruct.hpp
#pragma once

#include <cstdint>
#include <string>

#include "qkv/nn/lora.hpp"
#include "qkv/train/classify.hpp"
#include "qkv/train/instruct.hpp"

namespace qkv::train {

// The counts the book prints: "Total trainable parameters before: 124,441,346" (thousands separated by commas).
std::string with_commas(int64_t n);

}  // namespace qkv::train
