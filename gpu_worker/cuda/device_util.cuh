// Device helpers the cuda backend's kernel files share (one definition each):
// launch constants, bf16 <-> f32, the streaming weight loads, the bf16 mma, and
// the reads of values out of a packed 16-channel block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/bf16.h"
#include "core/expert_activation.h"
#include "gpu_worker/cuda/kernels.h"
#include "expert_compute/packed_index.h"

namespace moe::cuda {

constexpr int kWarp = 32;
constexpr int kElemwiseThreads = 256;     // block size of the element-wise kernels
constexpr int kMaxElemwiseBlocks = 8192;  // grid-stride beyond this

// The low / high bf16 of a 32-bit word as f32.
__device__ __forceinline__ float BfLo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float BfHi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ bf16_t ToBf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// Zeroes a kernel's per-thread sums [A][B][4] (a fragment's 4 C elements, or
// 4 channels, per block and row tile).
template <int A, int B>
__device__ __forceinline__ void ZeroSums(float (&s)[A][B][4]) {
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[a][b][e] = 0.f;
}

// The model's expert epilogue (GroupedExpertArgs::activation, ::bias_offset)
// for the buffer or packed slot starting at `buffer`: every expert kernel's
// gate+up store and down's weighted add go through it. A SiLU expert without
// biases computes exactly g / (1 + exp(-g)) * u and y.
struct ExpertEpilogue {
  ExpertActivation activation;
  const float* bias;  // gate [ld], up [ld], down [Hn]; null without biases
  int ld;
  __device__ __forceinline__ ExpertEpilogue(const GroupedExpertArgs& a, const void* buffer)
      : activation(a.activation),
        bias(a.bias_offset != 0 ? reinterpret_cast<const float*>(static_cast<const uint8_t*>(buffer) + a.bias_offset)
                                : nullptr),
        ld(a.bias_ld) {}
  // act of intermediate channel n.
  __device__ __forceinline__ float Act(int n, float g, float u) const {
    if (bias != nullptr) g += bias[n], u += bias[ld + n];
    return ActivateGateUp(activation, g, u);
  }
  // Down's output channel n before the routing weight.
  __device__ __forceinline__ float Down(int n, float y) const { return bias != nullptr ? y + bias[2 * ld + n] : y; }
};

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

// 8 bytes of weights read exactly once per kernel (the packed tensor-core
// kernels' per-lane unit), kept out of L1.
__device__ __forceinline__ uint2 LoadStream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// d += A (16 x 16, a0..a3) . B (16 x 8, b0, b1): bf16 in, f32 accumulate.
__device__ __forceinline__ void MmaBf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int kFmtBf16 = 0, kFmtInt8 = 1, kFmtInt4 = 2, kFmtFp8 = 3, kFmtMxfp4 = 4;  // WeightFormat

// The magnitudes of the 4 E2M1 codes in the low nibbles of u's bytes (high
// nibbles zero), each twice its value (0, 1, 2, 3, 4, 6, 8 or 12), one per
// byte: looked up by __byte_perm in a table of 8 bytes.
__device__ __forceinline__ uint32_t E2m1DoubledMagnitudes(uint32_t u) {
  const uint32_t m = u & 0x07070707u, t = m | (m >> 4);
  return __byte_perm(0x03020100u, 0x0C080604u, (t & 0xFFu) | ((t >> 8) & 0xFF00u));
}

// The same codes as f32, each twice its value (and negatives): the sign (bit
// 3) moved to the f32's. Callers fold the 1/2 into the scale (Mxfp4Scale).
__device__ __forceinline__ void Mxfp4x4(uint32_t u, float (&f)[4]) {
  const uint32_t mag = E2m1DoubledMagnitudes(u);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    f[i] = __uint_as_float(__float_as_uint(static_cast<float>((mag >> (8 * i)) & 0xFFu)) | (((u >> (8 * i + 3)) & 1u) << 31));
}

// An E8M0 exponent's 2^(e - 127) / 2 (Mxfp4x4's codes are doubled), exact
// for every e < 255 (e = 0: 2^-128, an f32 subnormal).
__device__ __forceinline__ float Mxfp4Scale(uint32_t e) {
  return 0.5f * (e != 0 ? __uint_as_float(e << 23) : __uint_as_float(0x00400000u));
}

// The 4 E4M3 codes of `u` as f32, each exactly its value / 256: a code's bits
// moved into an f16's (sign to bit 15, exponent and mantissa to bits 13-7)
// make the f16 value / 2^8, subnormals included (no E4M3 code is NaN here: the
// loader refuses them). Callers fold the 256 into the scale.
__device__ __forceinline__ void Fp8x4(uint32_t u, float (&f)[4]) {
  const uint32_t lo = __byte_perm(u, 0, 0x1404), hi = __byte_perm(u, 0, 0x3424);  // code << 8 in each half
  const uint32_t hl = (lo & 0x80008000u) | ((lo >> 1) & 0x3F803F80u);
  const uint32_t hh = (hi & 0x80008000u) | ((hi >> 1) & 0x3F803F80u);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&hl));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hh));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

// The 4 bytes of `u` as f32, each minus kBias: 0x4B0000bb is 2^23 + bb.
template <int kBias>
__device__ __forceinline__ void Bytes4(uint32_t u, float (&f)[4]) {
  constexpr float kMagic = 8388608.f + kBias;
  f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - kMagic;
  f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - kMagic;
  f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - kMagic;
  f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - kMagic;
}

// Values k .. k+8 of row c of the packed block `blk` (k % 8 == 0) as f32:
// one or two 4-byte reads (int4: one word holds 4 low and 4 high nibbles).
template <int kFmt>
__device__ __forceinline__ void PackedValues8(const uint8_t* blk, int Kp, int group, int c, int k, float (&v)[8]) {
  if constexpr (kFmt == kFmtBf16) {
    const bf16_t* b = reinterpret_cast<const bf16_t*>(blk);
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // (k, k+1) pairs are adjacent
      const uint32_t pair = *reinterpret_cast<const uint32_t*>(b + layout::Bf16Index(c, k + i));
      v[i] = BfLo(pair), v[i + 1] = BfHi(pair);
    }
  } else if constexpr (kFmt == kFmtInt8) {
    const float s = reinterpret_cast<const float*>(blk + static_cast<size_t>(Kp) * 16)[c];
    float a[4], b[4];
    Bytes4<128>(*reinterpret_cast<const uint32_t*>(blk + layout::Int8Offset(c, k)) ^ 0x80808080u, a);
    Bytes4<128>(*reinterpret_cast<const uint32_t*>(blk + layout::Int8Offset(c, k + 4)) ^ 0x80808080u, b);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = s * a[i], v[4 + i] = s * b[i];
  } else if constexpr (kFmt == kFmtFp8) {
    const float s = 256.f * reinterpret_cast<const float*>(blk + static_cast<size_t>(Kp) * 16)[(k / group) * 16 + c];
    float a[4], b[4];
    Fp8x4(*reinterpret_cast<const uint32_t*>(blk + layout::Int8Offset(c, k)), a);
    Fp8x4(*reinterpret_cast<const uint32_t*>(blk + layout::Int8Offset(c, k + 4)), b);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = s * a[i], v[4 + i] = s * b[i];
  } else {
    bool high;  // k % 8 == 0: tile row (k % 64) / 4 is even, so its low nibbles; k + 4 the high ones
    const uint32_t w = *reinterpret_cast<const uint32_t*>(blk + layout::Int4Offset(c, k, &high));
    float s, a[4], b[4];
    if constexpr (kFmt == kFmtMxfp4) {  // E8M0 exponents after the chunks, one per 32 k
      s = Mxfp4Scale(blk[static_cast<size_t>(Kp) * 8 + (k / 32) * 16 + c]);
      Mxfp4x4(w & 0x0F0F0F0Fu, a);
      Mxfp4x4((w >> 4) & 0x0F0F0F0Fu, b);
    } else {
      s = reinterpret_cast<const float*>(blk + static_cast<size_t>(Kp) * 8)[(k / group) * 16 + c];
      Bytes4<8>(w & 0x0F0F0F0Fu, a);
      Bytes4<8>((w >> 4) & 0x0F0F0F0Fu, b);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = s * a[i], v[4 + i] = s * b[i];
  }
}

}  // namespace moe::cuda
