// AMX-BF16 kernel. Tiles: 0-3 accumulators (2 row blocks x 2 column blocks),
// 4-5 inputs (A: 16 rows x 32 bf16), 6-7 weights (B: one packed 1 KiB run).
// Rows come in blocks of 16 (row_block); two row blocks share each B load.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_compute/expert_kernel.h"
#include "cpu_compute/simd_avx512.h"

namespace moe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void ConfigureTiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Weight groups of gate/up processed together so their B panels stay in L2
// while all row blocks stream past them.
constexpr int kGateUpChunk = 2;
// Experts with at most this many rows go to the AVX-512 path: a 16-row tile
// would mostly multiply padding, and the loads are what matters there.
constexpr int kAvx512MaxRows = 4;
// Weight tiles are prefetched this many k-blocks ahead on the first pass over
// a panel (decode streams weights from DRAM once).
constexpr int kPrefetchBlocks = 4;

inline void PrefetchTile(const std::byte* p) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * line), _MM_HINT_T0);
}

class AmxKernel final : public ExpertKernel {
 public:
  AmxKernel(bool bf16, bool int8) : bf16_(bf16), int8_(int8) {}
  const char* name() const override { return "amx"; }
  // 16-row tiles for bf16; the integer formats run row by row (VNNI), where
  // padding to 16 rows would only gather and quantize zeros.
  int row_block(WeightFormat f) const override { return f == WeightFormat::kBf16 ? 16 : 1; }
  // int8/int4 run on the AVX-512-VNNI path (AMX-INT8 has it); AMX-INT8 tiles (tdpbusd) are future work.
  bool Supports(WeightFormat f) const override { return f == WeightFormat::kBf16 ? bf16_ : int8_; }

  void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& xr, int m, bf16_t* act,
              int c0, int c1) const override {
    if (g.quantized()) return Avx512VnniGateUp(g, packed, xr, m, act, c0, c1);
    const bf16_t* x = xr.bf16;
    if (m <= kAvx512MaxRows) return Avx512GateUp(g, packed, x, m, act, c0, c1);
    ConfigureTiles();
    const size_t blk = static_cast<size_t>(g.Kh) * 32;  // bytes per packed block
    const int kblocks = g.Kh / 32;
    const int ldx = g.Kh * 2;
    alignas(64) float t0[256], t1[256];
    for (int cc = c0; cc < c1; cc += kGateUpChunk) {
      const int ce = std::min(c1, cc + kGateUpChunk);
      for (int mb = 0; mb < m; mb += 32) {
        const bool two = mb + 16 < m;
        const bf16_t* x0 = x + static_cast<size_t>(mb) * g.Kh;
        const bf16_t* x1 = x0 + static_cast<size_t>(16) * g.Kh;
        for (int c = cc; c < ce; ++c) {
          const std::byte* gb = packed + (2 * c) * blk;
          const std::byte* ub = gb + blk;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int kb = 0; kb < kblocks; ++kb) {
            if (mb == 0 && kb + kPrefetchBlocks < kblocks) {
              PrefetchTile(gb + 1024 * (kb + kPrefetchBlocks));
              PrefetchTile(ub + 1024 * (kb + kPrefetchBlocks));
            }
            _tile_loadd(4, x0 + 32 * kb, ldx);
            _tile_loadd(6, gb + 1024 * kb, 64);
            _tile_loadd(7, ub + 1024 * kb, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
              _tile_loadd(5, x1 + 32 * kb, ldx);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, t0, 64);
          _tile_stored(1, t1, 64);
          for (int r = 0; r < 16; ++r) {
            simd::StoreSiluMul(_mm512_load_ps(t0 + 16 * r), _mm512_load_ps(t1 + 16 * r),
                               act + static_cast<size_t>(mb + r) * g.Ki + 16 * c);
          }
          if (two) {
            _tile_stored(2, t0, 64);
            _tile_stored(3, t1, 64);
            for (int r = 0; r < 16; ++r) {
              simd::StoreSiluMul(_mm512_load_ps(t0 + 16 * r), _mm512_load_ps(t1 + 16 * r),
                                 act + static_cast<size_t>(mb + 16 + r) * g.Ki + 16 * c);
            }
          }
        }
      }
    }
    _tile_release();
  }

  void DownAccumulate(const ExpertGeometry& g, const std::byte* packed, const KernelRows& ar, int m,
                      const int32_t* token, const float* weight, float* out, int ldo, int c0,
                      int c1) const override {
    if (g.quantized()) return Avx512VnniDownAccumulate(g, packed, ar, m, token, weight, out, ldo, c0, c1);
    const bf16_t* act = ar.bf16;
    if (m <= kAvx512MaxRows) return Avx512DownAccumulate(g, packed, act, m, token, weight, out, ldo, c0, c1);
    ConfigureTiles();
    const std::byte* d = packed + g.gate_up_bytes();
    const size_t blk = static_cast<size_t>(g.Ki) * 32;
    const int kblocks = g.Ki / 32;
    const int lda = g.Ki * 2;
    alignas(64) float t0[256], t1[256];
    auto scatter = [&](int row0, int c) {
      const __mmask16 m0 = simd::ColumnMask(32 * c, g.H), m1 = simd::ColumnMask(32 * c + 16, g.H);
      for (int r = 0; r < 16; ++r) {
        const int32_t t = token[row0 + r];
        if (t < 0) continue;
        float* o = out + static_cast<size_t>(t) * ldo + 32 * c;
        simd::AccumulateMasked(o, m0, weight[row0 + r], _mm512_load_ps(t0 + 16 * r));
        simd::AccumulateMasked(o + 16, m1, weight[row0 + r], _mm512_load_ps(t1 + 16 * r));
      }
    };
    for (int c = c0; c < c1; ++c) {
      const std::byte* b0 = d + (2 * c) * blk;
      const std::byte* b1 = b0 + blk;
      for (int mb = 0; mb < m; mb += 32) {
        const bool two = mb + 16 < m;
        const bf16_t* a0 = act + static_cast<size_t>(mb) * g.Ki;
        const bf16_t* a1 = a0 + static_cast<size_t>(16) * g.Ki;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < kblocks; ++kb) {
          if (mb == 0 && kb + kPrefetchBlocks < kblocks) {
            PrefetchTile(b0 + 1024 * (kb + kPrefetchBlocks));
            PrefetchTile(b1 + 1024 * (kb + kPrefetchBlocks));
          }
          _tile_loadd(4, a0 + 32 * kb, lda);
          _tile_loadd(6, b0 + 1024 * kb, 64);
          _tile_loadd(7, b1 + 1024 * kb, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a1 + 32 * kb, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, t0, 64);
        _tile_stored(1, t1, 64);
        scatter(mb, c);
        if (two) {
          _tile_stored(2, t0, 64);
          _tile_stored(3, t1, 64);
          scatter(mb + 16, c);
        }
      }
    }
    _tile_release();
  }

 private:
  const bool bf16_, int8_;
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeAmxKernel(bool bf16, bool int8) { return std::make_unique<AmxKernel>(bf16, int8); }

}  // namespace moe
