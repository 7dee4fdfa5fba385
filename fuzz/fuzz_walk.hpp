// Visits what a .pth holds, as a loader would: every accessor of every reachable object, each tensor read as
// weights and as int64s. Bounded (depth and count), since a pickle may make cycles through its memo.
#pragma once

#include "fuzz_common.hpp"
#include "qkv/io/pth.hpp"

namespace qkv::fuzz {

inline void walk(const qkv::io::PthFile& file, const qkv::io::PyRef& ref, int depth, int& budget) {
  if (depth > 6 || --budget < 0) return;
  expect_only_qkv_errors([&] { (void)ref.describe(); });
  switch (ref.kind()) {
    case qkv::io::PyKind::Tensor:
      expect_only_qkv_errors([&] { (void)file.weights(ref); });
      expect_only_qkv_errors([&] { (void)file.int64s(ref); });
      break;
    case qkv::io::PyKind::Dict:
      for (const auto& [k, v] : ref.items()) {
        walk(file, k, depth + 1, budget);
        walk(file, v, depth + 1, budget);
      }
      expect_only_qkv_errors([&] { (void)ref.get("model_state_dict"); });
      expect_only_qkv_errors([&] { (void)ref.get(int64_t{0}); });
      break;
    case qkv::io::PyKind::List:
    case qkv::io::PyKind::Tuple:
      for (size_t i = 0; i < ref.size(); ++i) walk(file, ref[i], depth + 1, budget);
      break;
    default:
      expect_only_qkv_errors([&] { (void)ref.as_number(); });
      expect_only_qkv_errors([&] { (void)ref.as_string(); });
  }
}

inline void walk(const qkv::io::PthFile& file) {
  int budget = 20000;
  walk(file, file.root(), 0, budget);
}

}  // namespace qkv::fuzz
