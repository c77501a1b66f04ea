// AVX-512 helpers shared by the avx512 and amx kernels (both files are built
// with AVX-512-BF16 and -VNNI enabled). Internal header.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace moe::simd {

// exp(x) to ~1e-7 relative: range reduction to [-ln2/2, ln2/2], degree-6 polynomial, scalef.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// bf16(silu(g) * u) for 16 lanes, stored at dst.
inline void StoreSiluMul(__m512 g, __m512 u, uint16_t* dst) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), Exp(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  const __m512 a = _mm512_div_ps(_mm512_mul_ps(g, u), den);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(a));
}

// 16 bf16 at p as f32.
inline __m512 LoadBf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// o[j] += w * y[j] for the lanes in `mask`.
inline void AccumulateMasked(float* o, __mmask16 mask, float w, __m512 y) {
  const __m512 cur = _mm512_maskz_loadu_ps(mask, o);
  _mm512_mask_storeu_ps(o, mask, _mm512_fmadd_ps(_mm512_set1_ps(w), y, cur));
}

// Lanes of columns [col0, col0+16) that are < H.
inline __mmask16 ColumnMask(int col0, int H) {
  const int valid = H - col0;
  return valid >= 16 ? static_cast<__mmask16>(0xffff)
                     : valid <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << valid) - 1);
}

}  // namespace moe::simd

namespace moe {
struct ExpertGeometry;
struct KernelRows;
// The avx512 kernel's entry points (kernel_avx512.cc), also used by the amx
// kernel for experts with very few rows, where 16-row tiles would mostly
// multiply padding.
void Avx512GateUp(const ExpertGeometry& g, const std::byte* packed, const uint16_t* x, int m,
                  uint16_t* act, int c0, int c1);
void Avx512DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const uint16_t* act, int m,
                          const int32_t* token, const float* weight, float* out, int ldo, int c0, int c1);
// Its AVX-512-VNNI entry points for int8/int4 experts (x, act quantized as
// KernelRows describes); the amx kernel's path for those formats too.
void Avx512VnniGateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m,
                      uint16_t* act, int c0, int c1);
void Avx512VnniDownAccumulate(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                              const int32_t* token, const float* weight, float* out, int ldo, int c0, int c1);
}  // namespace moe
