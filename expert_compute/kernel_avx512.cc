// AVX-512 kernel. bf16: vdpbf16ps over the packed layout, up to 8 rows x 2
// blocks of 16 columns in registers (16 accumulators). fp8: up to
// kFp8DirectRows rows, codes converted to exact bf16 in registers and the
// group scales applied to the sums (DotRowsFp8); more rows, each block pair
// converted once to bf16 (simd::Fp8BlocksToBf16) for the bf16 path. int8/int4/mxfp4: vpdpbusd
// (AVX-512-VNNI) straight from the packed integer layouts, up to 4 rows (each
// a hi and a lo int8 row) x 2 blocks in registers (16 int32 accumulators);
// each 64-byte weight row is loaded once per row chunk. int4 and mxfp4 share
// one path: nibbles as u8 weights (mxfp4's mapped by vpshufb to 2 x E2M1 + 12),
// the offset times the group's sum of x codes subtracted, group scales (f32,
// or mxfp4's E8M0 exponents) applied to the group's sums.
#include <immintrin.h>

#include <type_traits>

#include "model/quantization.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/packed_layout.h"
#include "expert_compute/simd_avx512.h"

namespace moe {
namespace {

constexpr int kRows = 8;

inline __m512bh Pair(const bf16_t* p) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

// acc[r][b] = sum over k pairs of x_r . block b, for R rows of x (stride ldx).
template <int R>
inline void DotRows(const bf16_t* b0, const bf16_t* b1, const bf16_t* x, int ldx, int Kp,
                    __m512 acc[kRows][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int p = 0; p < Kp / 2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + 32 * p);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + 32 * p);
    _mm_prefetch(reinterpret_cast<const char*>(b0 + 32 * p + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b1 + 32 * p + 512), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = Pair(x + static_cast<size_t>(r) * ldx + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
}

template <int R>
void GateUpRows(const ExpertGeometry& g, const bf16_t* gb, const bf16_t* ub, const bf16_t* x,
                bf16_t* act, int c, const simd::GateUpEpilogue& ep) {
  __m512 acc[kRows][2];
  DotRows<R>(gb, ub, x, g.ldx(), g.Kh, acc);
  for (int r = 0; r < R; ++r) ep.Store(acc[r][0], acc[r][1], act + static_cast<size_t>(r) * g.lda() + 16 * c);
}

template <int R>
void DownRows(const ExpertGeometry& g, const bf16_t* b0, const bf16_t* b1, const bf16_t* act,
              const float* weight, float* out, int ldo, int c, const simd::DownEpilogue& ep) {
  __m512 acc[kRows][2];
  DotRows<R>(b0, b1, act, g.lda(), g.Ki, acc);
  for (int r = 0; r < R; ++r) ep.Store(out + static_cast<size_t>(r) * ldo + 32 * c, weight[r], acc[r]);
}

// f(r, R) for row chunks [r, r + R) covering [0, m): chunks of kMax rows,
// then one of the remainder (R a compile-time constant).
template <int R, typename F>
inline void RemainderChunk(int n, int r, F& f) {
  if constexpr (R > 0) {
    if (n == R) return f(r, std::integral_constant<int, R>{});
    RemainderChunk<R - 1>(n, r, f);
  }
}

template <int kMax, typename F>
inline void ForRowChunks(int m, F&& f) {
  int r = 0;
  for (; r + kMax <= m; r += kMax) f(r, std::integral_constant<int, kMax>{});
  RemainderChunk<kMax - 1>(m - r, r, f);
}

}  // namespace

namespace {

// Activation group c from its bf16 gate and up blocks (Kh columns).
void GateUpPair(const ExpertGeometry& g, const bf16_t* gb, const bf16_t* ub, const bf16_t* x, int m, bf16_t* act,
                int c, const simd::GateUpEpilogue& ep) {
  ForRowChunks<kRows>(m, [&](int r, auto R) {
    GateUpRows<decltype(R)::value>(g, gb, ub, x + static_cast<size_t>(r) * g.ldx(),
                                   act + static_cast<size_t>(r) * g.lda(), c, ep);
  });
}

// Output group c from its two bf16 down blocks (Ki columns).
void DownPair(const ExpertGeometry& g, const bf16_t* b0, const bf16_t* b1, const bf16_t* act, int m,
              const float* weight, float* out, int ldo, int c, const simd::DownEpilogue& ep) {
  ForRowChunks<kRows>(m, [&](int r, auto R) {
    DownRows<decltype(R)::value>(g, b0, b1, act + static_cast<size_t>(r) * g.lda(), weight + r,
                                 out + static_cast<size_t>(r) * ldo, ldo, c, ep);
  });
}

}  // namespace

void Avx512GateUp(const ExpertGeometry& g, const std::byte* packed, const bf16_t* x, int m, bf16_t* act,
                  int c0, int c1) {
  const bf16_t* w = reinterpret_cast<const bf16_t*>(packed);
  const size_t blk = static_cast<size_t>(g.Kh) * 16;
  for (int c = c0; c < c1; ++c)
    GateUpPair(g, w + (2 * c) * blk, w + (2 * c + 1) * blk, x, m, act, c, simd::GateUpEpilogue(g, packed, c));
}

void Avx512Down(const ExpertGeometry& g, const std::byte* packed, const bf16_t* act, int m,
                const float* weight, float* out, int ldo, int c0, int c1) {
  const bf16_t* d = reinterpret_cast<const bf16_t*>(packed + g.gate_up_bytes());
  const size_t blk = static_cast<size_t>(g.Ki) * 16;
  for (int c = c0; c < c1; ++c)
    DownPair(g, d + (2 * c) * blk, d + (2 * c + 1) * blk, act, m, weight, out, ldo, c, simd::DownEpilogue(g, packed, c));
}

namespace {

// fp8 rows up to which the weights are converted in registers for each pass
// (decode: each weight meets a row or two); above, a block pair is converted
// once into a per-thread scratch (64 KiB at K = 2048: L2) and the bf16 rows
// run on it.
constexpr int kFp8DirectRows = 4;

// acc[r][b] = x_r . block b for R <= kFp8DirectRows rows of x and two fp8
// blocks of Kp columns: each 64-byte chunk row becomes two exact bf16 rows of
// codes in registers (simd::Fp8RowToBf16Exact), vdpbf16ps sums a scale
// group, and the group's per-channel scales multiply the f32 sums (no
// rounding of code x scale).
template <int R>
inline void DotRowsFp8(const std::byte* b0, const std::byte* b1, const bf16_t* x, int ldx, int Kp, int group,
                       __m512 acc[kRows][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* s0 = reinterpret_cast<const float*>(b0 + static_cast<size_t>(Kp) * 16);
  const float* s1 = reinterpret_cast<const float*>(b1 + static_cast<size_t>(Kp) * 16);
  for (int k0 = 0; k0 < Kp; k0 += group) {
    __m512 t[R][2];
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm512_setzero_ps();
    for (int k = k0; k < k0 + group; k += 4) {  // chunk row (k / 64, k % 64 / 4): k .. k+3 of the 16 channels
      const size_t off = static_cast<size_t>(k) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(b0 + off + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + off + 1024), _MM_HINT_T0);
      __m512i w0e, w0o, w1e, w1o;
      simd::Fp8RowToBf16Exact(b0 + off, w0e, w0o);
      simd::Fp8RowToBf16Exact(b1 + off, w1e, w1o);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh xe = Pair(x + static_cast<size_t>(r) * ldx + k), xo = Pair(x + static_cast<size_t>(r) * ldx + k + 2);
        t[r][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(t[r][0], xe, (__m512bh)w0e), xo, (__m512bh)w0o);
        t[r][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(t[r][1], xe, (__m512bh)w1e), xo, (__m512bh)w1o);
      }
    }
    const __m512 g0 = _mm512_loadu_ps(s0 + (k0 / group) * 16), g1 = _mm512_loadu_ps(s1 + (k0 / group) * 16);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(t[r][0], g0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(t[r][1], g1, acc[r][1]);
    }
  }
}

}  // namespace

void Avx512Fp8GateUp(const ExpertGeometry& g, const std::byte* packed, const bf16_t* x, int m, bf16_t* act, int c0,
                     int c1) {
  const size_t bb = g.block_bytes(g.Kh), blk = static_cast<size_t>(g.Kh) * 16;
  if (m <= kFp8DirectRows) {
    for (int c = c0; c < c1; ++c) {
      const simd::GateUpEpilogue ep(g, packed, c);
      ForRowChunks<kFp8DirectRows>(m, [&](int r, auto R) {
        __m512 acc[kRows][2];
        DotRowsFp8<decltype(R)::value>(packed + (2 * c) * bb, packed + (2 * c + 1) * bb,
                                       x + static_cast<size_t>(r) * g.ldx(), g.ldx(), g.Kh, g.group, acc);
        for (int i = 0; i < decltype(R)::value; ++i)
          ep.Store(acc[i][0], acc[i][1], act + static_cast<size_t>(r + i) * g.lda() + 16 * c);
      });
    }
    return;
  }
  bf16_t* w = reinterpret_cast<bf16_t*>(simd::ThreadScratch(4 * blk));
  for (int c = c0; c < c1; ++c) {
    simd::Fp8BlocksToBf16(packed + (2 * c) * bb, bb, 2, g.Kh, g.group, w);
    GateUpPair(g, w, w + blk, x, m, act, c, simd::GateUpEpilogue(g, packed, c));
  }
}

void Avx512Fp8Down(const ExpertGeometry& g, const std::byte* packed, const bf16_t* act, int m,
                   const float* weight, float* out, int ldo, int c0, int c1) {
  const std::byte* d = packed + g.gate_up_bytes();
  const size_t bb = g.block_bytes(g.Ki), blk = static_cast<size_t>(g.Ki) * 16;
  if (m <= kFp8DirectRows) {
    for (int c = c0; c < c1; ++c) {
      const simd::DownEpilogue ep(g, packed, c);
      ForRowChunks<kFp8DirectRows>(m, [&](int r, auto R) {
        __m512 acc[kRows][2];
        DotRowsFp8<decltype(R)::value>(d + (2 * c) * bb, d + (2 * c + 1) * bb, act + static_cast<size_t>(r) * g.lda(),
                                       g.lda(), g.Ki, g.group, acc);
        for (int i = 0; i < decltype(R)::value; ++i)
          ep.Store(out + static_cast<size_t>(r + i) * ldo + 32 * c, weight[r + i], acc[i]);
      });
    }
    return;
  }
  bf16_t* w = reinterpret_cast<bf16_t*>(simd::ThreadScratch(4 * blk));
  for (int c = c0; c < c1; ++c) {
    simd::Fp8BlocksToBf16(d + (2 * c) * bb, bb, 2, g.Ki, g.group, w);
    DownPair(g, w, w + blk, act, m, weight, out, ldo, c, simd::DownEpilogue(g, packed, c));
  }
}

namespace {

// Rows of quantized activations per pass over a weight block pair (int8/int4).
constexpr int kIntRows = 4;

inline __m512i Broadcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
// The exact dot product of a u8 x s8 accumulator, acc - corr, as f32.
inline __m512 Corrected(__m512i acc, __m512i corr) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr)); }
inline int32_t ChunkSum(const int32_t* s, int n) {
  int32_t sum = 0;
  for (int c = 0; c < n; ++c) sum += s[c];
  return sum;
}

// y[r][b] = x_r . block b for R quantized rows of x (Kp columns, ld apart) and two int8
// blocks: x's codes + 128 (u8) against the weights (s8), minus 128 x the
// column sums; hi and lo dots combined in f32, scaled per channel and row.
template <int R>
inline void DotRowsInt8(const ExpertGeometry& g, const std::byte* b0, const std::byte* b1, const KernelRows& x,
                        int ld, int Kp, __m512 y[kIntRows][2]) {
  __m512i acc[R][2][2];  // [row][block][hi, lo]
  for (int r = 0; r < R; ++r) acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = _mm512_setzero_si512();
  const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int p = 0; p < Kp / 4; ++p) {  // weight row p: k = 4p .. 4p+3 of the 16 channels
    const __m512i w0 = _mm512_loadu_si512(b0 + 64 * p);
    const __m512i w1 = _mm512_loadu_si512(b1 + 64 * p);
    _mm_prefetch(reinterpret_cast<const char*>(b0 + 64 * p + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b1 + 64 * p + 1024), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i xv = _mm512_xor_si512(Broadcast4(x.q + size_t(2 * r + h) * ld + 4 * p), bias);
        acc[r][0][h] = _mm512_dpbusd_epi32(acc[r][0][h], xv, w0);
        acc[r][1][h] = _mm512_dpbusd_epi32(acc[r][1][h], xv, w1);
      }
    }
  }
  const std::byte* blk[2] = {b0, b1};
  for (int b = 0; b < 2; ++b) {
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(layout::ColumnSums(blk[b], Kp)), 7);
    const __m512 scale = _mm512_loadu_ps(layout::Scales(g, blk[b], Kp));
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_fmadd_ps(Corrected(acc[r][b][1], corr), _mm512_set1_ps(kLoScale),
                                         Corrected(acc[r][b][0], corr));
      y[r][b] = _mm512_mul_ps(_mm512_mul_ps(dot, scale), _mm512_set1_ps(x.scale[r]));
    }
  }
}

// The u8 weight each nibble stands for in the nibble formats' dot products,
// and the offset subtracted from it: int4 the nibble itself (q + 8), mxfp4
// 2 x E2M1 + 12 (0..24; vpshufb's table, one copy per 128-bit lane).
template <bool kMx>
struct NibbleCodes {
  static constexpr int kOffset = kMx ? 12 : 8;
  static __m512i Table() {
    if constexpr (kMx) {
      alignas(16) int8_t t[16];
      for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(kE2M1Doubled[i] + kOffset);
      return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    }
    return _mm512_setzero_si512();
  }
  static __m512i Map(__m512i nibbles, __m512i table) {
    if constexpr (kMx) return _mm512_shuffle_epi8(table, nibbles);
    return nibbles;
  }
};

// acc[r][b][hi, lo] = (x_r . (q + offset)) over one group of two nibble
// blocks: n byte rows from w0/w1 (byte row j: k = 8j..8j+3 in the low
// nibbles, 8j+4..8j+7 in the high ones), x at the group's first column.
template <int R, bool kMx>
inline void GroupDotNibbles(const std::byte* w0, const std::byte* w1, const int8_t* x, int ld, int n,
                            __m512i acc[kIntRows][2][2]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i table = NibbleCodes<kMx>::Table();
  for (int r = 0; r < R; ++r) acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = _mm512_setzero_si512();
  for (int j = 0; j < n; ++j) {
    const __m512i v0 = _mm512_loadu_si512(w0 + 64 * j);
    const __m512i v1 = _mm512_loadu_si512(w1 + 64 * j);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + 64 * j + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + 64 * j + 1024), _MM_HINT_T0);
    using Codes = NibbleCodes<kMx>;
    const __m512i l0 = Codes::Map(_mm512_and_si512(v0, low4), table);
    const __m512i h0 = Codes::Map(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), table);
    const __m512i l1 = Codes::Map(_mm512_and_si512(v1, low4), table);
    const __m512i h1 = Codes::Map(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low4), table);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int8_t* xr = x + size_t(2 * r + h) * ld + 8 * j;
        const __m512i xl = Broadcast4(xr), xh = Broadcast4(xr + 4);
        acc[r][0][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][0][h], l0, xl), h0, xh);
        acc[r][1][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][1][h], l1, xl), h1, xh);
      }
    }
  }
}

// The 16 channels' scales of group gi of a nibble block: int4's f32, or
// mxfp4's 2^(e - 127) / 2 (its codes are doubled), exact through vscalefps.
template <bool kMx>
inline __m512 GroupScales(const ExpertGeometry& g, const std::byte* blk, int Kp, int gi) {
  if constexpr (kMx) return simd::Mxfp4HalfScales(layout::Mxfp4Exponents(blk, Kp) + 16 * gi);
  return _mm512_loadu_ps(layout::Scales(g, blk, Kp) + 16 * gi);
}

// DotRowsInt8's contract for two nibble blocks (int4, mxfp4): per group, the
// u8 dots minus the offset x the group's sum of x codes (sum32), hi and lo
// combined in f32 and accumulated with the group's scales; scaled per row at
// the end.
template <int R, bool kMx>
inline void DotRowsNibbles(const ExpertGeometry& g, const std::byte* b0, const std::byte* b1, const KernelRows& x,
                           int ld, int Kp, __m512 y[kIntRows][2]) {
  constexpr int kOffset = NibbleCodes<kMx>::kOffset;
  const int sums = Kp / 32, per_group = g.group / 32;
  __m512 f[kIntRows][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  __m512i acc[kIntRows][2][2];
  for (int k0 = 0; k0 < Kp; k0 += g.group) {
    GroupDotNibbles<R, kMx>(b0 + size_t(k0) * 8, b1 + size_t(k0) * 8, x.q + k0, ld, g.group / 8, acc);
    const __m512 s[2] = {GroupScales<kMx>(g, b0, Kp, k0 / g.group), GroupScales<kMx>(g, b1, Kp, k0 / g.group)};
    for (int r = 0; r < R; ++r) {
      const __m512i ch = _mm512_set1_epi32(kOffset * ChunkSum(x.sum32 + size_t(2 * r) * sums + k0 / 32, per_group));
      const __m512i cl = _mm512_set1_epi32(kOffset * ChunkSum(x.sum32 + size_t(2 * r + 1) * sums + k0 / 32, per_group));
      for (int b = 0; b < 2; ++b) {
        const __m512 dot = _mm512_fmadd_ps(Corrected(acc[r][b][1], cl), _mm512_set1_ps(kLoScale),
                                           Corrected(acc[r][b][0], ch));
        f[r][b] = _mm512_fmadd_ps(dot, s[b], f[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(x.scale[r]);
    y[r][0] = _mm512_mul_ps(f[r][0], s);
    y[r][1] = _mm512_mul_ps(f[r][1], s);
  }
}

template <int R>
inline void DotRowsInt(const ExpertGeometry& g, const std::byte* b0, const std::byte* b1, const KernelRows& x,
                       int ld, int Kp, __m512 y[kIntRows][2]) {
  if (g.format == WeightFormat::kInt8) return DotRowsInt8<R>(g, b0, b1, x, ld, Kp, y);
  if (g.format == WeightFormat::kMxfp4) return DotRowsNibbles<R, true>(g, b0, b1, x, ld, Kp, y);
  DotRowsNibbles<R, false>(g, b0, b1, x, ld, Kp, y);
}

}  // namespace

void Avx512VnniGateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m, bf16_t* act,
                      int c0, int c1) {
  const size_t bb = g.block_bytes(g.Kh);
  for (int c = c0; c < c1; ++c) {
    const std::byte* gb = packed + (2 * c) * bb;
    const std::byte* ub = gb + bb;
    const simd::GateUpEpilogue ep(g, packed, c);
    ForRowChunks<kIntRows>(m, [&](int r, auto R) {
      __m512 y[kIntRows][2];
      DotRowsInt<decltype(R)::value>(g, gb, ub, x.At(r, g.ldx(), g.Kh), g.ldx(), g.Kh, y);
      for (int i = 0; i < decltype(R)::value; ++i) {
        ep.Store(y[i][0], y[i][1], act + static_cast<size_t>(r + i) * g.lda() + 16 * c);
      }
    });
  }
}

void Avx512VnniDown(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                    const float* weight, float* out, int ldo, int c0, int c1) {
  const std::byte* d = packed + g.gate_up_bytes();
  const size_t bb = g.block_bytes(g.Ki);
  for (int c = c0; c < c1; ++c) {
    const std::byte* b0 = d + (2 * c) * bb;
    const std::byte* b1 = b0 + bb;
    const simd::DownEpilogue ep(g, packed, c);
    ForRowChunks<kIntRows>(m, [&](int r, auto R) {
      __m512 y[kIntRows][2];
      DotRowsInt<decltype(R)::value>(g, b0, b1, act.At(r, g.lda(), g.Ki), g.lda(), g.Ki, y);
      for (int i = 0; i < decltype(R)::value; ++i)
        ep.Store(out + static_cast<size_t>(r + i) * ldo + 32 * c, weight[r + i], y[i]);
    });
  }
}

namespace {

class Avx512Kernel final : public ExpertKernel {
 public:
  Avx512Kernel(bool bf16, bool int8) : bf16_(bf16), int8_(int8) {}
  const char* name() const override { return "avx512"; }
  int row_block(WeightFormat) const override { return 1; }
  bool Supports(WeightFormat f) const override { return f == WeightFormat::kBf16 || f == WeightFormat::kFp8 ? bf16_ : int8_; }
  void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m, bf16_t* act,
              int c0, int c1) const override {
    if (g.int_activations()) return Avx512VnniGateUp(g, packed, x, m, act, c0, c1);
    if (g.format == WeightFormat::kFp8) return Avx512Fp8GateUp(g, packed, x.bf16, m, act, c0, c1);
    Avx512GateUp(g, packed, x.bf16, m, act, c0, c1);
  }
  void Down(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m, const float* weight,
            float* out, int ldo, int c0, int c1) const override {
    if (g.int_activations()) return Avx512VnniDown(g, packed, act, m, weight, out, ldo, c0, c1);
    if (g.format == WeightFormat::kFp8) return Avx512Fp8Down(g, packed, act.bf16, m, weight, out, ldo, c0, c1);
    Avx512Down(g, packed, act.bf16, m, weight, out, ldo, c0, c1);
  }

 private:
  const bool bf16_, int8_;
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeAvx512Kernel(bool bf16, bool int8) {
  return std::make_unique<Avx512Kernel>(bf16, int8);
}

void QuantizeRowsAvx512(const bf16_t* x, int m, int K, int ld, int8_t* q, float* scale, int32_t* sum32) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as std::nearbyint
  for (int r = 0; r < m; ++r) {
    const bf16_t* xr = x + size_t(r) * ld;
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(simd::LoadBf16(xr + k)));
    const float s = _mm512_reduce_max_ps(amax) / 127.0f;
    scale[r] = s;
    const __m512 inv = _mm512_set1_ps(s > 0 ? 1.0f / s : 0.0f);
    int8_t* hi = q + size_t(2 * r) * ld;
    int8_t* lo = hi + ld;
    int32_t* sh = sum32 + size_t(2 * r) * (K / 32);
    int32_t* sl = sh + K / 32;
    for (int c = 0; c < K / 32; ++c) {
      __m512i shv = _mm512_setzero_si512(), slv = _mm512_setzero_si512();
      for (int j = 0; j < 2; ++j) {
        const int k = 32 * c + 16 * j;
        const __m512 v = _mm512_mul_ps(simd::LoadBf16(xr + k), inv);
        const __m512 h = _mm512_roundscale_ps(v, kRound);
        const __m512i qh = _mm512_cvtps_epi32(h);
        __m512i ql = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps(254.0f)), kRound);
        ql = _mm512_max_epi32(_mm512_min_epi32(ql, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        shv = _mm512_add_epi32(shv, qh);
        slv = _mm512_add_epi32(slv, ql);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtsepi32_epi8(qh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtsepi32_epi8(ql));
      }
      sh[c] = _mm512_reduce_add_epi32(shv);
      sl[c] = _mm512_reduce_add_epi32(slv);
    }
  }
}

}  // namespace moe
