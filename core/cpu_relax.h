#pragma once

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

}  // namespace moe
