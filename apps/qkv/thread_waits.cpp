// How long qkv's idle OpenMP threads spin before they sleep, set before libgomp starts.
// libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, in its own initialiser, before main() runs; its default
// (neither set) spins 300,000 pauses (6–14 ms) at every barrier. On a machine where another program holds a core,
// that spinning thread takes the time its partner needs, and 2 threads ran 2–5× slower than 1 (docs/performance.md,
// "Threads on a busy machine"). A bounded spin keeps a quiet machine's speed (the waits inside a token are
// microseconds) and sleeps soon enough to give a busy core back. An executable's .preinit_array runs before any
// shared library's initialiser, so this is the one place a program can choose it; a user's own setting is kept.
#include <cstdlib>

namespace {

// Pauses before a waiting thread sleeps: 15–50 µs on today's cores (a pause is 40–140 cycles), longer than the gaps
// between a token's parallel loops, far shorter than the scheduler's slice a busy core would lose to it.
constexpr const char* kSpinCount = "1000";

void bound_openmp_spinning(int, char**, char**) {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr)
    setenv("GOMP_SPINCOUNT", kSpinCount, 0);
}

}  // namespace

__attribute__((section(".preinit_array"), used)) static void (*const qkv_bound_openmp_spinning)(int, char**, char**) =
    bound_openmp_spinning;
