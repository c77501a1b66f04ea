// AMX kernel. Tiles: 0-3 accumulators (2 row blocks x 2 column blocks),
// 4-5 inputs (A), 6-7 weights (B: one packed 1 KiB run).
// bf16: A is 16 rows x 32 bf16; rows come in blocks of 16 (row_block); two
// row blocks share each B load.
// int8/int4/mxfp4 (AMX-INT8, tdpbssd): A is 16 int8 rows x 64 k = 8 tokens'
// hi/lo pairs (KernelRows); B is the int8 chunk as packed, or the nibble
// chunk unpacked to int8 in registers (int4: q; mxfp4: 2 x E2M1, integers in
// [-12, 12], so the int8 products are exact and only the power-of-two block
// scale, applied to each block's int32 sums, is left). mxfp4's scale blocks
// are 32 k: its tiles are configured 32 k deep (ConfigureAmxTiles(32)), one
// tdpbssd per scale block. Groups of fewer than 8 rows (decode) and the
// tail of a group run on the AVX-512-VNNI path.
// fp8: each panel's blocks converted to bf16 once per call of the kernel
// (simd::Fp8BlocksToBf16, into a per-thread L2 scratch), then the bf16 tiles.
#include <immintrin.h>

#include <algorithm>

#include "model/quantization.h"
#include "expert_compute/amx_tiles.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/packed_layout.h"
#include "expert_compute/simd_avx512.h"

namespace moe {
namespace {

// Weight groups of gate/up processed together so their B panels stay in L2
// while all row blocks stream past them.
constexpr int kGateUpChunk = 2;
// Experts with at most this many rows go to the AVX-512 path: a 16-row tile
// would mostly multiply padding, and the loads are what matters there.
constexpr int kAvx512MaxRows = 4;
// The down projection walks its output groups in chunks whose weights (B)
// take at most this much, so they stay in L2 while every row block passes
// them; each row block of act is read once per chunk.
constexpr size_t kDownPanelBytes = 512 << 10;
inline int DownChunk(size_t block_bytes) { return std::max<int>(1, kDownPanelBytes / (2 * block_bytes)); }
// Weight tiles are prefetched this many k-blocks ahead on the first pass over
// a panel (decode streams weights from DRAM once).
constexpr int kPrefetchBlocks = 4;

inline void PrefetchTile(const std::byte* p) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * line), _MM_HINT_T0);
}

// The bf16 tile block both projections run: tiles 0/1 (+ 2/3 when `two`) accumulate rows
// x0 (x1) of `ldx` bytes against the packed column blocks b0 and b1 over `kblocks` 32-k
// blocks. `prefetch` reads ahead in the weights (the first row block of a chunk only).
inline void AmxBf16Block(const bf16_t* x0, const bf16_t* x1, int ldx, const std::byte* b0,
                         const std::byte* b1, int kblocks, bool two, bool prefetch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int kb = 0; kb < kblocks; ++kb) {
    if (prefetch && kb + kPrefetchBlocks < kblocks) {
      PrefetchTile(b0 + 1024 * (kb + kPrefetchBlocks));
      PrefetchTile(b1 + 1024 * (kb + kPrefetchBlocks));
    }
    _tile_loadd(4, x0 + 32 * kb, ldx);
    _tile_loadd(6, b0 + 1024 * kb, 64);
    _tile_loadd(7, b1 + 1024 * kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + 32 * kb, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// The bf16 tile loop over output groups [cc, ce) for all m rows of x (rows
// ld elements apart; tiles configured), the groups' block pairs consecutive
// from `blocks` (blk bytes each, kblocks 32-k blocks): each row block passes
// the panel while it stays in L2. emit(row0, c, t0, t1) takes each 16-row
// result, t0 from block 2c of the pair, t1 from 2c + 1.
template <typename Emit>
void AmxBf16Panel(const std::byte* blocks, size_t blk, int kblocks, const bf16_t* x, int ld, int m, int cc, int ce,
                  Emit&& emit) {
  alignas(64) float t0[256], t1[256];
  for (int mb = 0; mb < m; mb += 32) {
    const bool two = mb + 16 < m;
    const bf16_t* x0 = x + static_cast<size_t>(mb) * ld;
    const bf16_t* x1 = x0 + static_cast<size_t>(16) * ld;
    for (int c = cc; c < ce; ++c) {
      const std::byte* b0 = blocks + (2 * (c - cc)) * blk;
      AmxBf16Block(x0, x1, ld * 2, b0, b0 + blk, kblocks, two, mb == 0);
      _tile_stored(0, t0, 64);  // tile numbers are immediates
      _tile_stored(1, t1, 64);
      emit(mb, c, t0, t1);
      if (two) {
        _tile_stored(2, t0, 64);
        _tile_stored(3, t1, 64);
        emit(mb + 16, c, t0, t1);
      }
    }
  }
}

// bf16 gate/up of activation groups [cc, ce) (gate cc, up cc, gate cc + 1, ... from `pairs`) of the
// expert packed at `packed` (its epilogue: activation, biases).
void AmxBf16GateUpPanel(const ExpertGeometry& g, const std::byte* packed, const std::byte* pairs, const bf16_t* x,
                        int m, bf16_t* act, int cc, int ce) {
  AmxBf16Panel(pairs, static_cast<size_t>(g.Kh) * 32, g.Kh / 32, x, g.ldx(), m, cc, ce,
               [&](int row0, int c, const float* t0, const float* t1) {
                 const simd::GateUpEpilogue ep(g, packed, c);
                 for (int r = 0; r < 16; ++r)
                   ep.Store(_mm512_load_ps(t0 + 16 * r), _mm512_load_ps(t1 + 16 * r),
                            act + static_cast<size_t>(row0 + r) * g.lda() + 16 * c);
               });
}

// bf16 down projection of output groups [cc, ce) (blocks 2cc, 2cc + 1, ... from `blocks`) of the expert
// packed at `packed`, weighted into out.
void AmxBf16DownPanel(const ExpertGeometry& g, const std::byte* packed, const std::byte* blocks, const bf16_t* act,
                      int m, const float* weight, float* out, int ldo, int cc, int ce) {
  AmxBf16Panel(blocks, static_cast<size_t>(g.Ki) * 32, g.Ki / 32, act, g.lda(), m, cc, ce,
               [&](int row0, int c, const float* t0, const float* t1) {
                 const simd::DownEpilogue ep(g, packed, c);
                 for (int r = 0, rows = std::min(16, m - row0); r < rows; ++r) {
                   const __m512 y[2] = {_mm512_load_ps(t0 + 16 * r), _mm512_load_ps(t1 + 16 * r)};
                   ep.Store(out + static_cast<size_t>(row0 + r) * ldo + 32 * c, weight[row0 + r], y);
                 }
               });
}

// ---- AMX-INT8

constexpr int kTileTokens = 8;  // tokens per A tile (16 int8 rows: hi, lo of each)

// One nibble chunk (8 rows of 64 bytes) as an int8 B tile: tile row 2i is
// row i's low nibbles, 2i+1 its high ones; int4 (q + 8) -> q, mxfp4 (E2M1
// code) -> 2 x its value (vpshufb).
// AmxIntDots unpacks each chunk again for every 16-token row block, into 2 KiB
// that stay in L1. Unpacking a column pair once per call and reusing it was
// tried: its chunks (64 KiB at H = 2048) then come back from L2, and int4 at
// m = 1024 fell to 0.76x int8 in one expert_kernels run on the AMX host
// (this code: 1.13x and 1.28x in two others).
inline void UnpackNibbleTile(const std::byte* src, bool mxfp4, int8_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  alignas(16) int8_t table[16];
  for (int i = 0; i < 16; ++i) table[i] = static_cast<int8_t>(mxfp4 ? kE2M1Doubled[i] : i - 8);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
  for (int i = 0; i < 8; ++i) {
    const __m512i v = _mm512_loadu_si512(src + 64 * i);
    _mm512_store_si512(dst + 128 * i, _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4)));
    _mm512_store_si512(dst + 128 * i + 64, _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)));
  }
}

// The k per tdpbssd of a format's AMX path: 32 for scale groups of 32 (mxfp4's
// blocks, int4's groups of 32), else 64.
inline int AmxKStep(const ExpertGeometry& g) { return g.nibbles() && g.group % 64 != 0 ? 32 : 64; }

// The 16 channels' scales of group gi (int8: gi = 0, its per-channel scales;
// mxfp4: 2^(e - 127) / 2, its codes being doubled).
inline __m512 AmxGroupScales(const ExpertGeometry& g, const std::byte* blk, int Kp, int gi) {
  if (g.format == WeightFormat::kMxfp4) return simd::Mxfp4HalfScales(layout::Mxfp4Exponents(blk, Kp) + 16 * gi);
  return _mm512_loadu_ps(layout::Scales(g, blk, Kp) + 16 * gi);
}

// y[t][b] = (x_t . channels of block b), dequantized (weight and row scales),
// for the 8 * tiles tokens of x (1 or 2 A tiles) and the blocks b0, b1 of K =
// Kp (int8 rows ld bytes apart; tiles configured ConfigureAmxTiles(AmxKStep(g))).
// int32 tile sums per scale group (int8: the whole K; int4: g.group; mxfp4:
// 32), hi + lo / 254 in f32.
void AmxIntDots(const ExpertGeometry& g, const std::byte* b0, const std::byte* b1, const KernelRows& x, int ld,
                int Kp, int tiles, float (*y)[2][16], int8_t* unpack) {
  const bool nibbles = g.nibbles();
  const int step = AmxKStep(g);  // k per tdpbssd
  const int steps = Kp / step, per_group = nibbles ? g.group / step : steps;
  const int tokens = kTileTokens * tiles;
  for (int t = 0; t < tokens; ++t)
    for (int b = 0; b < 2; ++b) _mm512_store_ps(y[t][b], _mm512_setzero_ps());
  alignas(64) int32_t c[4][256];
  for (int k0 = 0; k0 < steps; k0 += per_group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = k0; kb < k0 + per_group; ++kb) {
      const int k = kb * step;
      if (nibbles) {
        // A 64-k chunk unpacks to 16 tile rows of 4 k; a 32-k step takes its half.
        if (k % 64 == 0) {
          UnpackNibbleTile(b0 + 8 * size_t(k), g.format == WeightFormat::kMxfp4, unpack);
          UnpackNibbleTile(b1 + 8 * size_t(k), g.format == WeightFormat::kMxfp4, unpack + 1024);
        }
        _tile_loadd(6, unpack + 16 * (k % 64), 64);
        _tile_loadd(7, unpack + 1024 + 16 * (k % 64), 64);
      } else {
        _tile_loadd(6, b0 + 16 * size_t(k), 64);
        _tile_loadd(7, b1 + 16 * size_t(k), 64);
      }
      _tile_loadd(4, x.q + size_t(k), ld);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if (tiles == 2) {
        _tile_loadd(5, x.q + size_t(16) * ld + size_t(k), ld);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (tiles == 2) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    const int gi = nibbles ? k0 / per_group : 0;
    const std::byte* blk[2] = {b0, b1};
    for (int b = 0; b < 2; ++b) {
      const __m512 s = AmxGroupScales(g, blk[b], Kp, gi);
      for (int t = 0; t < tokens; ++t) {
        const int32_t* ct = c[2 * (t / kTileTokens) + b] + 32 * (t % kTileTokens);  // rows 2i (hi), 2i+1 (lo)
        const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct + 16)), _mm512_set1_ps(kLoScale),
                                           _mm512_cvtepi32_ps(_mm512_load_si512(ct)));
        _mm512_store_ps(y[t][b], _mm512_fmadd_ps(dot, s, _mm512_load_ps(y[t][b])));
      }
    }
  }
  for (int t = 0; t < tokens; ++t)
    for (int b = 0; b < 2; ++b) _mm512_store_ps(y[t][b], _mm512_mul_ps(_mm512_load_ps(y[t][b]), _mm512_set1_ps(x.scale[t])));
}

void AmxIntGateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& x, int m, bf16_t* act,
                  int c0, int c1) {
  const int full = m / kTileTokens * kTileTokens;
  if (full > 0) {
    ConfigureAmxTiles(AmxKStep(g));
    const size_t bb = g.block_bytes(g.Kh);
    alignas(64) int8_t unpack[2048];
    alignas(64) float y[16][2][16];
    for (int c = c0; c < c1; ++c) {
      const std::byte* gb = packed + (2 * c) * bb;
      const simd::GateUpEpilogue ep(g, packed, c);
      for (int r = 0; r < full; r += 2 * kTileTokens) {
        const int tiles = r + 2 * kTileTokens <= full ? 2 : 1;
        AmxIntDots(g, gb, gb + bb, x.At(r, g.ldx(), g.Kh), g.ldx(), g.Kh, tiles, y, unpack);
        for (int i = 0; i < kTileTokens * tiles; ++i)
          ep.Store(_mm512_load_ps(y[i][0]), _mm512_load_ps(y[i][1]), act + size_t(r + i) * g.lda() + 16 * c);
      }
    }
    _tile_release();
  }
  if (full < m) Avx512VnniGateUp(g, packed, x.At(full, g.ldx(), g.Kh), m - full, act + size_t(full) * g.lda(), c0, c1);
}

void AmxIntDown(const ExpertGeometry& g, const std::byte* packed, const KernelRows& act, int m,
                const float* weight, float* out, int ldo, int c0, int c1) {
  const int full = m / kTileTokens * kTileTokens;
  if (full > 0) {
    ConfigureAmxTiles(AmxKStep(g));
    const std::byte* d = packed + g.gate_up_bytes();
    const size_t bb = g.block_bytes(g.Ki);
    alignas(64) int8_t unpack[2048];
    alignas(64) float y[16][2][16];
    const int chunk = DownChunk(bb);
    for (int cc = c0; cc < c1; cc += chunk) {
      const int ce = std::min(c1, cc + chunk);
      for (int r = 0; r < full; r += 2 * kTileTokens) {
        const int tiles = r + 2 * kTileTokens <= full ? 2 : 1;
        for (int c = cc; c < ce; ++c) {
          const std::byte* b0 = d + (2 * c) * bb;
          const simd::DownEpilogue ep(g, packed, c);
          AmxIntDots(g, b0, b0 + bb, act.At(r, g.lda(), g.Ki), g.lda(), g.Ki, tiles, y, unpack);
          for (int i = 0; i < kTileTokens * tiles; ++i) {
            const __m512 yi[2] = {_mm512_load_ps(y[i][0]), _mm512_load_ps(y[i][1])};
            ep.Store(out + static_cast<size_t>(r + i) * ldo + 32 * c, weight[r + i], yi);
          }
        }
      }
    }
    _tile_release();
  }
  if (full < m)
    Avx512VnniDown(g, packed, act.At(full, g.lda(), g.Ki), m - full, weight + full, out + size_t(full) * ldo, ldo,
                   c0, c1);
}

class AmxKernel final : public ExpertKernel {
 public:
  AmxKernel(bool bf16, bool int8) : bf16_(bf16), int8_(int8) {}
  const char* name() const override { return "amx"; }
  // 16-row tiles for bf16; the integer paths take any row count (8-token
  // tiles, the rest on VNNI), so padding would only gather and quantize zeros.
  int row_block(WeightFormat f) const override { return f == WeightFormat::kBf16 || f == WeightFormat::kFp8 ? 16 : 1; }
  bool Supports(WeightFormat f) const override { return f == WeightFormat::kBf16 || f == WeightFormat::kFp8 ? bf16_ : int8_; }

  void GateUp(const ExpertGeometry& g, const std::byte* packed, const KernelRows& xr, int m, bf16_t* act,
              int c0, int c1) const override {
    if (g.int_activations()) return AmxIntGateUp(g, packed, xr, m, act, c0, c1);
    const bool fp8 = g.format == WeightFormat::kFp8;
    if (m <= kAvx512MaxRows)
      return fp8 ? Avx512Fp8GateUp(g, packed, xr.bf16, m, act, c0, c1) : Avx512GateUp(g, packed, xr.bf16, m, act, c0, c1);
    ConfigureAmxTiles();
    const size_t blk = static_cast<size_t>(g.Kh) * 32;  // bytes per bf16 block
    const size_t bb = g.block_bytes(g.Kh);              // per packed block
    std::byte* scratch = fp8 ? simd::ThreadScratch(2 * kGateUpChunk * blk) : nullptr;
    for (int cc = c0; cc < c1; cc += kGateUpChunk) {
      const int ce = std::min(c1, cc + kGateUpChunk);
      const std::byte* pairs = packed + (2 * cc) * bb;
      if (fp8) {
        simd::Fp8BlocksToBf16(pairs, bb, 2 * (ce - cc), g.Kh, g.group, reinterpret_cast<bf16_t*>(scratch));
        pairs = scratch;
      }
      AmxBf16GateUpPanel(g, packed, pairs, xr.bf16, m, act, cc, ce);
    }
    _tile_release();
  }

  void Down(const ExpertGeometry& g, const std::byte* packed, const KernelRows& ar, int m, const float* weight,
            float* out, int ldo, int c0, int c1) const override {
    if (g.int_activations()) return AmxIntDown(g, packed, ar, m, weight, out, ldo, c0, c1);
    const bool fp8 = g.format == WeightFormat::kFp8;
    if (m <= kAvx512MaxRows)
      return fp8 ? Avx512Fp8Down(g, packed, ar.bf16, m, weight, out, ldo, c0, c1)
                 : Avx512Down(g, packed, ar.bf16, m, weight, out, ldo, c0, c1);
    ConfigureAmxTiles();
    const std::byte* d = packed + g.gate_up_bytes();
    const size_t blk = static_cast<size_t>(g.Ki) * 32, bb = g.block_bytes(g.Ki);
    const int chunk = DownChunk(blk);
    std::byte* scratch = fp8 ? simd::ThreadScratch(2 * chunk * blk) : nullptr;
    for (int cc = c0; cc < c1; cc += chunk) {
      const int ce = std::min(c1, cc + chunk);
      const std::byte* blocks = d + (2 * cc) * bb;
      if (fp8) {
        simd::Fp8BlocksToBf16(blocks, bb, 2 * (ce - cc), g.Ki, g.group, reinterpret_cast<bf16_t*>(scratch));
        blocks = scratch;
      }
      AmxBf16DownPanel(g, packed, blocks, ar.bf16, m, weight, out, ldo, cc, ce);
    }
    _tile_release();
  }

 private:
  const bool bf16_, int8_;
};

}  // namespace

std::unique_ptr<ExpertKernel> MakeAmxKernel(bool bf16, bool int8) { return std::make_unique<AmxKernel>(bf16, int8); }

}  // namespace moe
