// Element access to one packed 16-channel block (expert_kernel.h describes
// the layouts): what the packer writes and the portable kernel and the
// unpacker read. Internal header; the SIMD kernels walk the same layout in
// whole registers and tiles.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "model/quantization.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/packed_index.h"

namespace moe::layout {

// The integer code of (c, k) in a kInt8, kInt4 or kMxfp4 block (int4: q in
// [-8, 7]; mxfp4: 2 x its E2M1 value, in [-12, 12]).
inline int Code(const ExpertGeometry& g, const std::byte* blk, int c, int k) {
  if (g.format == WeightFormat::kInt8) return reinterpret_cast<const int8_t*>(blk)[Int8Offset(c, k)];
  bool high;
  const uint8_t b = reinterpret_cast<const uint8_t*>(blk)[Int4Offset(c, k, &high)];
  const int nibble = high ? b >> 4 : b & 0x0F;
  return g.format == WeightFormat::kMxfp4 ? kE2M1Doubled[nibble] : nibble - 8;
}

// Writes int4 value q in [-8, 7] as (c, k)'s nibble of a kInt4 block (q + 8).
inline void SetInt4Code(std::byte* blk, int c, int k, int q) {
  bool high;
  uint8_t& b = reinterpret_cast<uint8_t*>(blk)[Int4Offset(c, k, &high)];
  const uint8_t n = static_cast<uint8_t>((q + 8) & 0x0F);
  b = high ? static_cast<uint8_t>((b & 0x0F) | (n << 4)) : static_cast<uint8_t>((b & 0xF0) | n);
}

// The f32 scales of a block with Kp columns: kInt8 scale[c]; kInt4 and kFp8 scale[(k/group)*16 + c].
inline const float* Scales(const ExpertGeometry& g, const std::byte* blk, int Kp) {
  return reinterpret_cast<const float*>(blk + size_t(Kp) * (g.format == WeightFormat::kInt4 ? 8 : 16));
}
// kMxfp4: the E8M0 exponents of a block, e[(k/32)*16 + c].
inline const uint8_t* Mxfp4Exponents(const std::byte* blk, int Kp) {
  return reinterpret_cast<const uint8_t*>(blk + size_t(Kp) * 8);
}
// What Code(c, k) is multiplied by in group k / g.group (kInt4, kFp8,
// kMxfp4; mxfp4: 2^(e - 127) / 2, as its codes are doubled).
inline float GroupScale(const ExpertGeometry& g, const std::byte* blk, int Kp, int c, int k) {
  const int i = (k / g.group) * 16 + c;
  if (g.format == WeightFormat::kMxfp4) return std::ldexp(0.5f, int{Mxfp4Exponents(blk, Kp)[i]} - 127);
  return Scales(g, blk, Kp)[i];
}
// kInt8: the 16 column sums of q after the scales.
inline const int32_t* ColumnSums(const std::byte* blk, int Kp) {
  return reinterpret_cast<const int32_t*>(blk + size_t(Kp) * 16 + 64);
}

// The value block stands for at (c, k).
inline float Value(const ExpertGeometry& g, const std::byte* blk, int Kp, int c, int k) {
  switch (g.format) {
    case WeightFormat::kBf16: return Bf16ToF32(reinterpret_cast<const bf16_t*>(blk)[Bf16Index(c, k)]);
    case WeightFormat::kInt8: return Scales(g, blk, Kp)[c] * static_cast<float>(Code(g, blk, c, k));
    case WeightFormat::kInt4:
    case WeightFormat::kMxfp4: return GroupScale(g, blk, Kp, c, k) * static_cast<float>(Code(g, blk, c, k));
    case WeightFormat::kFp8:
      return GroupScale(g, blk, Kp, c, k) * Fp8E4M3ToF32(reinterpret_cast<const uint8_t*>(blk)[Int8Offset(c, k)]);
  }
  return 0.0f;
}

}  // namespace moe::layout
