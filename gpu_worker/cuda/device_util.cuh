// Device helpers the cuda backend's kernel files share (one definition each):
// launch constants, bf16 <-> f32 and the streaming 16-byte weight load.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/bf16.h"

namespace moe::cuda {

constexpr int kWarp = 32;
constexpr int kElemwiseThreads = 256;     // block size of the element-wise kernels
constexpr int kMaxElemwiseBlocks = 8192;  // grid-stride beyond this

// The low / high bf16 of a 32-bit word as f32.
__device__ __forceinline__ float BfLo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float BfHi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ bf16_t ToBf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// 16 bytes of weights read exactly once per kernel: kept out of L1, and L2
// asked to fetch the surrounding 256 bytes (the next lanes' loads). volatile:
// the compiler must not hoist it out of the bounds checks that guard it.
__device__ __forceinline__ uint4 LoadStream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace moe::cuda
