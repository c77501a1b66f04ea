// AVX-512-BF16 kernel: vdpbf16ps over the packed layout, up to 8 rows x 2
// blocks of 16 columns in registers (16 accumulators).
#include <immintrin.h>

#include "cpu_compute/expert_kernel.h"
#include "cpu_compute/simd_avx512.h"

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
                bf16_t* act, int c) {
  __m512 acc[kRows][2];
  DotRows<R>(gb, ub, x, g.Kh, g.Kh, acc);
  for (int r = 0; r < R; ++r) simd::StoreSiluMul(acc[r][0], acc[r][1], act + static_cast<size_t>(r) * g.Ki + 16 * c);
}

template <int R>
void DownRows(const ExpertGeometry& g, const bf16_t* b0, const bf16_t* b1, const bf16_t* act,
              const int32_t* token, const float* weight, float* out, int ldo, int c) {
  __m512 acc[kRows][2];
  DotRows<R>(b0, b1, act, g.Ki, g.Ki, acc);
  const __mmask16 m0 = simd::ColumnMask(32 * c, g.H), m1 = simd::ColumnMask(32 * c + 16, g.H);
  for (int r = 0; r < R; ++r) {
    if (token[r] < 0) continue;
    float* o = out + static_cast<size_t>(token[r]) * ldo + 32 * c;
    simd::AccumulateMasked(o, m0, weight[r], acc[r][0]);
    simd::AccumulateMasked(o + 16, m1, weight[r], acc[r][1]);
  }
}

template <typename F>
inline void ForRowChunks(int m, F&& f) {
  int r = 0;
  for (; r + kRows <= m; r += kRows) f(r, std::integral_constant<int, kRows>{});
  switch (m - r) {
    case 1: f(r, std::integral_constant<int, 1>{}); break;
    case 2: f(r, std::integral_constant<int, 2>{}); break;
    case 3: f(r, std::integral_constant<int, 3>{}); break;
    case 4: f(r, std::integral_constant<int, 4>{}); break;
    case 5: f(r, std::integral_constant<int, 5>{}); break;
    case 6: f(r, std::integral_constant<int, 6>{}); break;
    case 7: f(r, std::integral_constant<int, 7>{}); break;
    default: break;
  }
}

}  // namespace

void Avx512GateUp(const ExpertGeometry& g, const std::byte* packed, const bf16_t* x, int m, bf16_t* act,
                  int c0, int c1) {
    const bf16_t* w = reinterpret_cast<const bf16_t*>(packed);
    const size_t blk = static_cast<size_t>(g.Kh) * 16;
    for (int c = c0; c < c1; ++c) {
      const bf16_t* gb = w + (2 * c) * blk;
      const bf16_t* ub = gb + blk;
      ForRowChunks(m, [&](int r, auto R) {
        GateUpRows<decltype(R)::value>(g, gb, ub, x + static_cast<size_t>(r) * g.Kh,
                                       act + static_cast<size_t>(r) * g.Ki, c);
      });
    }
}

void Avx512DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const bf16_t* act, int m,
                          const int32_t* token, const float* weight, float* out, int ldo, int c0, int c1) {
    const bf16_t* d = reinterpret_cast<const bf16_t*>(packed + g.gate_up_bytes());
    const size_t blk = static_cast<size_t>(g.Ki) * 16;
    for (int c = c0; c < c1; ++c) {
      const bf16_t* b0 = d + (2 * c) * blk;
      const bf16_t* b1 = b0 + blk;
      ForRowChunks(m, [&](int r, auto R) {
        DownRows<decltype(R)::value>(g, b0, b1, act + static_cast<size_t>(r) * g.Ki, token + r,
                                     weight + r, out, ldo, c);
      });
    }
}

namespace {

class Avx512Kernel final : public ExpertKernel {
 public:
  Avx512Kernel(bool bf16, bool int8) : bf16_(bf16), int8_(int8) {}
  const char* name() const override { return "avx512"; }
  int row_block() const override { return 1; }
  bool Supports(WeightFormat f) const override { return f == WeightFormat::kBf16 ? bf16_ : false; }
  void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m, bf16_t* act,
              int c0, int c1) const override {
    Avx512GateUp(g, packed, x.bf16, m, act, c0, c1);
  }
  void DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                      const int32_t* token, const float* weight, float* out, int ldo, int c0,
                      int c1) const override {
    Avx512DownAccumulate(g, packed, act.bf16, m, token, weight, out, ldo, c0, c1);
  }

 private:
  const bool bf16_, int8_;
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeAvx512Kernel(bool bf16, bool int8) {
  return std::make_unique<Avx512Kernel>(bf16, int8);
}

void QuantizeRowsAvx512(const bf16_t* x, int m, int K, int8_t* q, float* scale, int32_t* sum64) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as std::nearbyint
  for (int r = 0; r < m; ++r) {
    const bf16_t* xr = x + size_t(r) * K;
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(simd::LoadBf16(xr + k)));
    const float s = _mm512_reduce_max_ps(amax) / 127.0f;
    scale[r] = s;
    const __m512 inv = _mm512_set1_ps(s > 0 ? 1.0f / s : 0.0f);
    int8_t* hi = q + size_t(2 * r) * K;
    int8_t* lo = hi + K;
    int32_t* sh = sum64 + size_t(2 * r) * (K / 64);
    int32_t* sl = sh + K / 64;
    for (int c = 0; c < K / 64; ++c) {
      __m512i shv = _mm512_setzero_si512(), slv = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const int k = 64 * c + 16 * j;
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
