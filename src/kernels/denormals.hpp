// Flushing denormals for the length of a scope, one thread at a time (internal to src/kernels/).
#pragma once

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "qkv/kernels/gemm.hpp"  // Denormals

namespace qkv::kernels {

// With Denormals::Flush, sets FTZ and DAZ in this thread's MXCSR while it lives and restores the thread's mode
// after; with Keep (or off x86) it does nothing. MXCSR is per thread: inside a parallel region each thread that
// computes needs its own.
class DenormalMode {
 public:
  explicit DenormalMode(Denormals mode) {
#if defined(__SSE__)
    if (mode == Denormals::Flush) {
      saved_ = _mm_getcsr();
      _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
      changed_ = true;
    }
#else
    (void)mode;
#endif
  }
  ~DenormalMode() {
#if defined(__SSE__)
    if (changed_) _mm_setcsr(saved_);
#endif
  }
  DenormalMode(const DenormalMode&) = delete;
  DenormalMode& operator=(const DenormalMode&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  unsigned saved_ = 0;
  bool changed_ = false;
};

}  // namespace qkv::kernels
