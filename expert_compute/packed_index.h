// Byte / element offsets inside one packed 16-channel block (the layouts
// expert_kernel.h describes). Dependency-free and host/device, so the CUDA
// kernels that read packed experts in GPU memory (gpu_worker/cuda) use the
// same index math as the packer and the CPU kernels (packed_layout.h).
#pragma once

#include <cstddef>

#include "core/host_device.h"

namespace moe::layout {

// kBf16: W[c, k] is bf16 element ((k/2)*16 + c)*2 + k%2 of the block.
MOE_HOST_DEVICE inline size_t Bf16Index(int c, int k) { return (size_t(k / 2) * 16 + c) * 2 + k % 2; }

// kInt8: byte offset of q[c, k] within the block's chunks.
MOE_HOST_DEVICE inline size_t Int8Offset(int c, int k) {
  return size_t(k / 64) * 1024 + ((k % 64) / 4) * 64 + c * 4 + k % 4;
}

// kInt4: the scale groups the kernels compute (CPU and GPU): 32 k (Kimi-K2's
// compressed-tensors checkpoints; half a 64-k chunk, as mxfp4's blocks) or
// whole 64-k chunks.
MOE_HOST_DEVICE constexpr bool Int4GroupServed(int group) { return group == 32 || (group > 0 && group % 64 == 0); }

// kInt4: byte offset of q[c, k]'s nibble, and whether it is the high one
// (tile rows 2i and 2i+1 share byte row i).
MOE_HOST_DEVICE inline size_t Int4Offset(int c, int k, bool* high) {
  const int row = (k % 64) / 4;
  *high = row & 1;
  return size_t(k / 64) * 512 + (row / 2) * 64 + c * 4 + k % 4;
}

// kMxfp4: bytes of a block's E8M0 scales (K/32 groups of 16), padded so the
// next block starts 64-byte aligned.
MOE_HOST_DEVICE inline size_t Mxfp4ScaleBytes(int K) { return (size_t(K) / 2 + 63) / 64 * 64; }

}  // namespace moe::layout
