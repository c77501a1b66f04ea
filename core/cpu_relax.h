#pragma once

#include <sched.h>

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe {

// One iteration of a spin-wait: tells the core this thread is spinning (x86
// pause, Arm yield), which frees the sibling hyper-thread and saves power.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How often a spin-wait gives its CPU away (SpinYielder).
inline constexpr std::chrono::microseconds kSpinYieldPeriod{20};

// A spin-wait's courtesy to a thread that shares its CPU: Tick(now), called
// from the wait loop with the time it just read, calls sched_yield() every
// kSpinYieldPeriod. Alone on its CPU the yield returns at once (a syscall,
// about a microsecond in 20); beside a runnable thread it hands the CPU over
// now, where a spin of pauses only holds it until the scheduler's slice ends
// (3 ms and more, seen at the next tick: 4 ms at HZ=250). A pause-only
// spinner beside a thread that has work (a compute thread pinned to the same
// PU, another server connection bound to the pool's first PU for its region,
// a connection whose request just arrived) halved that thread's CPU and
// stalled it for whole slices (tests: kernel_test, shm_segment_test).
class SpinYielder {
 public:
  void Tick(std::chrono::steady_clock::time_point now) {
    if (now < next_) return;
    if (next_ != std::chrono::steady_clock::time_point()) sched_yield();
    next_ = now + kSpinYieldPeriod;
  }

 private:
  std::chrono::steady_clock::time_point next_{};
};

}  // namespace moe
