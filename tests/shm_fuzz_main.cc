// libFuzzer entry for the shared-memory segment and request validators
// (built with clang -fsanitize=fuzzer,address,undefined when clang is there).
#include <cstddef>
#include <cstdint>

#include "tests/shm_fuzz_one.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return moe::shm::ShmFuzzOne(data, size);
}
