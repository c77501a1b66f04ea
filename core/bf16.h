// bfloat16 and float16 <-> float32 conversions (round to nearest even, NaN kept).
// Pure functions; safe from any thread.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "moe/types.h"  // bf16_t

namespace moe {

inline float Bf16ToF32(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

void Bf16ToF32(const bf16_t* src, float* dst, size_t n);
void F32ToBf16(const float* src, bf16_t* dst, size_t n);
void F16ToBf16(const uint16_t* src, bf16_t* dst, size_t n);

// True iff every value is finite (no NaN, no Inf).
bool AllFiniteBf16(const bf16_t* v, size_t n);
bool AllFiniteF32(const float* v, size_t n);

}  // namespace moe
