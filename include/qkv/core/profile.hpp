// Where a training step's time goes, op by op: while profiling is on, each recorded op's forward time (the time
// since the previous op was recorded, on this thread) and the time of its backward closure are summed by op name.
// Off by default; the cost when off is one relaxed atomic load per op. For measuring, not for production.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace qkv {

// The time one op took in a profiled run, summed over its calls
struct OpTime {
  double forward_seconds = 0, backward_seconds = 0;  // in its forward and in its backward
  int64_t calls = 0;  // how many times it ran
};

void set_op_profiling(bool on);
// The forward time of the next op counts from now (call before a forward pass, after work that is not an op).
void op_profile_mark();
std::map<std::string, OpTime> op_profile();
void reset_op_profile();

}  // namespace qkv
