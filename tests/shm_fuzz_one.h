// The shm segment fuzz entry point, for the libFuzzer binary
// (tests/shm_fuzz_main.cc) and shm_segment_test's seeded run.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe::shm {

// libFuzzer-compatible body (returns 0): lays out a small segment in a local
// buffer with a valid request in slot 0, applies `data` as byte patches to the
// header, rings and slot headers, then runs Attach, ValidateSlotIndex on
// popped indices, ValidateRequestSlot and ValidateResponseSlot, and traps if
// an accepted value breaks an invariant.
int ShmFuzzOne(const uint8_t* data, size_t size);

}  // namespace moe::shm
