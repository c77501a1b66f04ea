// AVX-512 helpers shared by the avx512 and amx kernels (both files are built
// with AVX-512-BF16 and -VNNI enabled). Internal header.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "core/expert_activation.h"
#include "expert_compute/expert_kernel.h"

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

// o[j] = w * y[0][j], o[16 + j] = w * y[1][j] for the lanes in m0, m1 (one
// output group of 32 columns; Down's store).
inline void StoreWeighted(float* o, __mmask16 m0, __mmask16 m1, float w, const __m512 y[2]) {
  const __m512 wv = _mm512_set1_ps(w);
  _mm512_mask_storeu_ps(o, m0, _mm512_mul_ps(wv, y[0]));
  _mm512_mask_storeu_ps(o + 16, m1, _mm512_mul_ps(wv, y[1]));
}

// Lanes of columns [col0, col0+16) that are < H.
inline __mmask16 ColumnMask(int col0, int H) {
  const int valid = H - col0;
  return valid >= 16 ? static_cast<__mmask16>(0xffff)
                     : valid <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << valid) - 1);
}

// The model's gate+up epilogue for activation group c (columns 16c ..
// 16c+15) of one expert: its biases added when it has them, the activation
// (ExpertGeometry::activation) applied lane by lane as ActivateGateUp
// (core/expert_activation.h) computes it, the bf16 result stored. A SiLU
// expert without biases stores exactly StoreSiluMul's bits.
class GateUpEpilogue {
 public:
  GateUpEpilogue(const ExpertGeometry& g, const std::byte* packed, int c) : a_(g.activation) {
    if (const float* b = g.bias(packed); b != nullptr) {
      gate_bias_ = _mm512_loadu_ps(b + 16 * c);
      up_bias_ = _mm512_loadu_ps(b + g.Ki + 16 * c);
      biased_ = true;
    }
  }
  void Store(__m512 g, __m512 u, uint16_t* dst) const {
    if (biased_) g = _mm512_add_ps(g, gate_bias_), u = _mm512_add_ps(u, up_bias_);
    if (a_.kind == ActivationKind::kSilu) return StoreSiluMul(g, u, dst);
    // g' = min(g, limit), u' = clamp(u, -limit, limit): g' / (1 + exp(-alpha g')) * (u' + 1).
    const __m512 limit = _mm512_set1_ps(a_.limit);
    g = _mm512_min_ps(g, limit);
    u = _mm512_max_ps(_mm512_min_ps(u, limit), _mm512_sub_ps(_mm512_setzero_ps(), limit));
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), Exp(_mm512_mul_ps(_mm512_set1_ps(-a_.alpha), g)));
    const __m512 a = _mm512_mul_ps(_mm512_div_ps(g, den), _mm512_add_ps(u, _mm512_set1_ps(1.0f)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(a));
  }

 private:
  ExpertActivation a_;
  bool biased_ = false;
  __m512 gate_bias_, up_bias_;
};

// Down's epilogue for output group c (columns 32c .. 32c+31, those < H): y
// plus the expert's down bias when it has one, times the row's routing
// weight (StoreWeighted's store).
class DownEpilogue {
 public:
  DownEpilogue(const ExpertGeometry& g, const std::byte* packed, int c)
      : m0_(ColumnMask(32 * c, g.H)), m1_(ColumnMask(32 * c + 16, g.H)) {
    if (const float* b = g.bias(packed); b != nullptr) {
      bias_[0] = _mm512_loadu_ps(b + 2 * g.Ki + 32 * c);
      bias_[1] = _mm512_loadu_ps(b + 2 * g.Ki + 32 * c + 16);
      biased_ = true;
    }
  }
  void Store(float* o, float w, const __m512 y[2]) const {
    if (!biased_) return StoreWeighted(o, m0_, m1_, w, y);
    const __m512 yb[2] = {_mm512_add_ps(y[0], bias_[0]), _mm512_add_ps(y[1], bias_[1])};
    StoreWeighted(o, m0_, m1_, w, yb);
  }

 private:
  __mmask16 m0_, m1_;
  bool biased_ = false;
  __m512 bias_[2];
};

// The 16 scales of one fp8 block's group (x 256) in the lanes of a bf16
// row's f32 halves: s_lo lane i is channel i / 2, s_hi channel 8 + i / 2.
struct Fp8Scales {
  __m512 lo, hi;
  explicit Fp8Scales(const float* s16) {
    const __m512i lanes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(s16), _mm512_set1_ps(256.0f));
    lo = _mm512_permutexvar_ps(lanes, s);
    hi = _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(8)), s);
  }
};

// One 64-byte fp8 chunk row (k = 4p .. 4p+3 of 16 channels) as the bf16 rows
// 2p (k 4p, 4p+1) and 2p + 1 (k 4p+2, 4p+3): code x scale rounded once. E4M3
// bits become f16 bits exactly (the sign-extended code << 7 puts the sign at
// bit 15 and exponent and mantissa at bits 13-7; bit 14, a copy of the sign,
// is cleared): the f16 is the value / 256, subnormals included, and f16 ->
// f32 is exact; the 256 is in the scales.
// lo and hi (channels 0-7 and 8-15, 4 k each as 16-bit values) as the rows of
// k pairs (4p, 4p+1) and (4p+2, 4p+3) of the 16 channels: even and odd dwords.
inline void SplitKPairs(__m512i lo, __m512i hi, __m512i& even_row, __m512i& odd_row) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  even_row = _mm512_permutex2var_epi32(lo, even, hi);
  odd_row = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
}

inline void Fp8RowToBf16(const std::byte* row, const Fp8Scales& s, __m512i& even_row, __m512i& odd_row) {
  const __m512i f16_bits = _mm512_set1_epi16(static_cast<short>(0xBF80));
  const __m512i v = _mm512_loadu_si512(row);
  const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(v)), 7), f16_bits);
  const __m512i hi = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1)), 7), f16_bits);
  auto convert = [&](__m512i f16) {
    const __m512 a = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(f16)), s.lo);
    const __m512 c = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)), s.hi);
    return (__m512i)_mm512_cvtne2ps_pbh(c, a);
  };
  SplitKPairs(lo, hi, even_row, odd_row);
  even_row = convert(even_row);
  odd_row = convert(odd_row);
}

// Codes -> exact bf16 in integer ops (the decode path: no f32 round trip;
// the scales go to the f32 sums, kernel_avx512.cc's DotRowsFp8). 32 sign-extended codes s (one
// per 16-bit lane): a normal code (exponent e > 0) is bf16 bits sign | (e +
// 120) << 7 | m << 4 — (s << 4) keeps the sign at bit 15 and puts e, m at bits
// 10-4, and adding 120 << 7 cannot carry into the sign. Zero and subnormal
// codes (e = 0: m x 2^-9) are looked up (vpermw on m) in the rare vectors
// that hold one.
inline __m512i Fp8CodesToBf16(__m512i s) {
  const __m512i w = _mm512_slli_epi16(s, 4);
  const __m512i normal = _mm512_add_epi16(_mm512_and_si512(w, _mm512_set1_epi16(static_cast<short>(0x87F0))),
                                          _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(s, _mm512_set1_epi16(0x78));
  if (sub == 0) return normal;
  // bf16 of m x 2^-9, m = 0..7, indexed by bits 0-4 of s (e = 0: bits 3, 4 are zero).
  alignas(64) static constexpr uint16_t kTiny[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i lut = _mm512_load_si512(kTiny);
  const __m512i tiny = _mm512_or_si512(_mm512_permutexvar_epi16(s, lut), _mm512_and_si512(w, _mm512_set1_epi16(static_cast<short>(0x8000))));
  return _mm512_mask_mov_epi16(normal, sub, tiny);
}

// One 64-byte fp8 chunk row as the exact bf16 rows 2p and 2p + 1 (as
// Fp8RowToBf16, without scales).
inline void Fp8RowToBf16Exact(const std::byte* row, __m512i& even_row, __m512i& odd_row) {
  const __m512i v = _mm512_loadu_si512(row);
  SplitKPairs(Fp8CodesToBf16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(v))),
              Fp8CodesToBf16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1))), even_row, odd_row);
}

// kFp8 blocks (expert_kernel.h) as kBf16 blocks: `n` blocks of Kp columns,
// `src_stride` bytes apart, into consecutive bf16 blocks at dst (Kp * 32
// bytes each), Fp8RowToBf16 row by row.
inline void Fp8BlocksToBf16(const std::byte* src, size_t src_stride, int n, int Kp, int group, uint16_t* dst) {
  for (int b = 0; b < n; ++b) {
    const std::byte* blk = src + b * src_stride;
    const float* scales = reinterpret_cast<const float*>(blk + static_cast<size_t>(Kp) * 16);
    uint16_t* out = dst + static_cast<size_t>(b) * Kp * 16;
    for (int ch = 0; ch < Kp / 64; ++ch) {
      const Fp8Scales s(scales + (64 * ch / group) * 16);
      for (int q = 0; q < 16; ++q) {
        __m512i e, o;
        Fp8RowToBf16(blk + 1024 * ch + 64 * q, s, e, o);
        _mm512_storeu_si512(out + 32 * (32 * ch + 2 * q), e);
        _mm512_storeu_si512(out + 32 * (32 * ch + 2 * q + 1), o);
      }
    }
  }
}

// 16 MXFP4 E8M0 exponents as the f32 scales 2^(e - 127) / 2 (the kernels'
// E2M1 codes are doubled), exact for every e < 255 through vscalefps.
inline __m512 Mxfp4HalfScales(const uint8_t* e16) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e16)));
  return _mm512_scalef_ps(_mm512_set1_ps(0.5f), _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(127))));
}

// A 64-byte aligned per-thread scratch of at least `bytes` (grown, never shrunk).
inline std::byte* ThreadScratch(size_t bytes) {
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  thread_local std::unique_ptr<std::byte, Free> buf;
  thread_local size_t cap = 0;
  if (bytes > cap) {
    const size_t want = (bytes + 4095) / 4096 * 4096;
    buf.reset(static_cast<std::byte*>(std::aligned_alloc(64, want)));
    if (buf == nullptr) {  // at most a few MiB per thread: out of memory is fatal here
      std::fprintf(stderr, "moe: out of memory for a %zu-byte kernel scratch\n", want);
      std::abort();
    }
    cap = want;
  }
  return buf.get();
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
void Avx512Down(const ExpertGeometry& g, const std::byte* packed, const uint16_t* act, int m,
                const float* weight, float* out, int ldo, int c0, int c1);
// The same for fp8 experts (bf16 x, act).
void Avx512Fp8GateUp(const ExpertGeometry& g, const std::byte* packed, const uint16_t* x, int m, uint16_t* act,
                     int c0, int c1);
void Avx512Fp8Down(const ExpertGeometry& g, const std::byte* packed, const uint16_t* act, int m,
                   const float* weight, float* out, int ldo, int c0, int c1);
// Its AVX-512-VNNI entry points for int8/int4 experts (x, act quantized as
// KernelRows describes); the amx kernel's path for those formats too.
void Avx512VnniGateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m,
                      uint16_t* act, int c0, int c1);
void Avx512VnniDown(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                    const float* weight, float* out, int ldo, int c0, int c1);
}  // namespace moe
