#include "core/bf16.h"

namespace moe {

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;              // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;             // overflow -> Inf
  if (abs < 0x38800000u) {                                   // subnormal or zero
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150); f16 subnormal unit 2^-24
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t r = mant >> shift;
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

void Bf16ToF32(const bf16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
}

void F32ToBf16(const float* src, bf16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
}

void F16ToBf16(const uint16_t* src, bf16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(F16ToF32(src[i]));
}

bool AllFiniteBf16(const bf16_t* v, size_t n) {
  uint16_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((v[i] & 0x7f80u) == 0x7f80u);
  return bad == 0;
}

bool AllFiniteF32(const float* v, size_t n) {
  bool ok = true;
  for (size_t i = 0; i < n; ++i) ok &= std::isfinite(v[i]);
  return ok;
}

}  // namespace moe
