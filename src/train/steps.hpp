// What both fine-tuning loops share (internal to train/): the optimiser over what trains, and the check that a step's
// loss is finite before it is applied.
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "qkv/train/optim.hpp"
#include "qkv/train/trainer.hpp"

namespace qkv::train {

// AdamW over the trainable parameters; ValueError when nothing trains.
inline optim::AdamW make_adamw(std::vector<std::pair<std::string, Tensor>> parameters, double lr, double weight_decay) {
  if (parameters.empty()) throw ValueError("fine-tuning: no parameter is trainable");
  return optim::AdamW(std::move(parameters), {.lr = lr, .weight_decay = weight_decay});
}

// TrainingDiverged before a step whose loss is not finite is applied.
inline void check_finite(double loss, int64_t step) {
  if (!std::isfinite(loss)) {
    throw TrainingDiverged("step " + std::to_string(step) + ": the loss became " + std::to_string(loss) +
                           "; the step was not applied (try a lower --lr)");
  }
}

}  // namespace qkv::train
