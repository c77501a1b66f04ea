#include "bench/amx_peak.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>

#include "expert_compute/amx_tiles.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

// Where each k block's tiles are read from. A: two 16-row tiles per k block,
// rows `a_ld` bytes apart (64: each tile one contiguous 1 KiB); `a_blocks`
// distinct k blocks (1: the same two tiles every time, L1). B: two 1 KiB
// tiles per k block, `b_pairs` column pairs of `b_blocks` distinct blocks
// each (1 pair of 1 block: L1). A bf16 tile holds 32 k and an int8 one 64 k in
// the same 64 bytes per row, so one placement serves both loops; K = 2048
// (Qwen3-30B-A3B's gate/up) is 64 bf16 or 32 int8 blocks.
struct Placement {
  const char* name;
  int a_ld, a_blocks, b_pairs, b_blocks;
};
constexpr int kK = 2048;
template <bool kInt8>
constexpr int kBlocks = kK / (kInt8 ? 64 : 32);
constexpr Placement kPlacements[] = {
    {"A, B in L1", 64, 1, 1, 1},
    {"A in L1, B from L2 (256 KiB)", 64, 1, 2, kBlocks<false>},
    {"A packed and B from L2", 64, kBlocks<false>, 2, kBlocks<false>},
    {"A rows 4224 B apart (the kernels' x) and B from L2", 4224, kBlocks<false>, 2, kBlocks<false>},
};
// The int8 loop with the operands placed as the kernels read them.
constexpr Placement kInt8Placement = {"", 4224, kBlocks<true>, 2, kBlocks<true>};

// The 2x2 tile loop over K for every column pair, `reps` times: tdpbf16ps,
// or with kInt8 tdpbssd (one int8 activation row per token: 16 tokens per A
// tile, as bf16). `scale_every` > 0 (int8): every that many k blocks the four
// int32 accumulator tiles leave the tiles and are added into f32 sums with a
// scale per token and block (what activations quantized per token and per
// block of K cost: a tile sum cannot carry a per-block scale); 0: the sums
// stay in the tiles for the whole K (one scale per token).
template <bool kInt8>
__attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f"))) void TileLoop(const std::byte* a, const std::byte* b,
                                                                              const Placement& p, int scale_every,
                                                                              int reps, float* sink) {
  constexpr int blocks = kBlocks<kInt8>;
  ConfigureAmxTiles();
  alignas(64) int32_t c[4][256] = {};  // written by the tile stores
  alignas(64) float y[4][256] = {};
  alignas(64) float xs[32][blocks];  // per token (two A tiles) and k block
  for (int t = 0; t < 32; ++t)
    for (int kb = 0; kb < blocks; ++kb) xs[t][kb] = 1.0f + 0.001f * static_cast<float>(t + kb);
  const size_t a_tile2 = static_cast<size_t>(16) * p.a_ld;  // second A tile: 16 rows further
  for (int rep = 0; rep < reps; ++rep) {
    for (int pair = 0; pair < p.b_pairs; ++pair) {
      const std::byte* b0 = b + static_cast<size_t>(pair) * 2 * p.b_blocks * 1024;
      const std::byte* b1 = b0 + static_cast<size_t>(p.b_blocks) * 1024;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int kb = 0; kb < blocks; ++kb) {
        const size_t ao = p.a_ld == 64 ? size_t(kb % p.a_blocks) * 2048 : size_t(kb % p.a_blocks) * 64;
        const size_t bo = size_t(kb % p.b_blocks) * 1024;
        _tile_loadd(4, a + ao, p.a_ld);
        _tile_loadd(5, a + ao + (p.a_ld == 64 ? 1024 : a_tile2), p.a_ld);
        _tile_loadd(6, b0 + bo, 64);
        _tile_loadd(7, b1 + bo, 64);
        if constexpr (kInt8) {
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        } else {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        if (kInt8 && scale_every > 0 && (kb + 1) % scale_every == 0) {  // (constant false for bf16)
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int i = 0; i < 4; ++i)
            for (int r = 0; r < 16; ++r) {
              const __m512 s = _mm512_set1_ps(xs[(i / 2) * 16 + r][kb]);
              // (maskz: GCC 12 warns of the plain conversion's undefined source in a target function)
              const __m512 sum = _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_load_si512(c[i] + 16 * r));
              _mm512_store_ps(y[i] + 16 * r, _mm512_fmadd_ps(sum, s, _mm512_load_ps(y[i] + 16 * r)));
            }
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(3, c[3], 64);
    }
  }
  _tile_release();
  sink[0] = y[0][0] + y[3][255] + static_cast<float>(c[0][0] + c[3][255]);
}

// Random operands, no zero bf16 values or denormals (the int8 loop only
// times, its bytes need no care).
void FillOperands(std::byte* p, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  auto* v = reinterpret_cast<uint16_t*>(p);
  for (size_t i = 0; i < bytes / 2; ++i) v[i] = static_cast<uint16_t>(0x3c00 + (rng() & 0x3ff));
}

// One loop's rate on `threads` threads: loop(a, b, reps, sink) does
// `flops_per_rep` per rep on buffers of a_bytes and b_bytes (random bf16 or
// int8 values, no zeros).
template <typename Loop>
AmxPeak Measure(ComputePool& pool, const char* name, size_t a_bytes, size_t b_bytes, double flops_per_rep,
                int threads, double seconds, Loop&& loop) {
  int reps = 1;
  std::vector<double> tflops;
  for (int run = -1; run < 5; ++run) {
    // Each thread times its own loop; the threads' rates add up (they run at once).
    std::vector<double> rate(threads, 0.0);
    pool.Run([&](int t, int) {
      if (t >= threads) return;
      auto* a = static_cast<std::byte*>(std::aligned_alloc(4096, (a_bytes + 4095) / 4096 * 4096));
      auto* b = static_cast<std::byte*>(std::aligned_alloc(4096, (b_bytes + 4095) / 4096 * 4096));
      alignas(64) float sink[512];
      FillOperands(a, a_bytes, 17 + t);
      FillOperands(b, b_bytes, 91 + t);
      loop(a, b, 1, sink);  // warm the caches
      const Clock::time_point t0 = Clock::now();
      loop(a, b, reps, sink);
      rate[t] = flops_per_rep * reps / std::chrono::duration<double>(Clock::now() - t0).count();
      std::free(a);
      std::free(b);
    });
    if (run < 0) {  // the first run sizes the later ones: about `seconds` each
      reps = std::max(1, static_cast<int>(seconds * rate[0] / flops_per_rep));
      continue;
    }
    double sum = 0;
    for (double r : rate) sum += r;
    tflops.push_back(sum / 1e12);
  }
  std::sort(tflops.begin(), tflops.end());
  return {name, threads, tflops[tflops.size() / 2], tflops.front(), tflops.back(), static_cast<int>(tflops.size())};
}

}  // namespace

std::vector<AmxPeak> MeasureAmxPeaks(ComputePool& pool, double seconds, bool int8) {
  std::vector<int> counts = {1};
  if (pool.size() >= 4) counts.push_back(pool.size() / 2);
  if (pool.size() > 1) counts.push_back(pool.size());
  std::vector<AmxPeak> out;
  auto measure = [&](const char* name, const Placement& p, bool is_int8, int scale_every) {
    const size_t a_bytes = p.a_ld == 64 ? size_t(p.a_blocks) * 2048 : size_t(32) * p.a_ld;
    const size_t b_bytes = size_t(p.b_pairs) * 2 * p.b_blocks * 1024;
    const double flops = 2.0 * 4 * p.b_pairs * 16 * 16 * kK;  // 4 tiles of 16 x 16 outputs over K, per pair
    for (int n : counts)
      out.push_back(Measure(pool, name, a_bytes, b_bytes, flops, n, seconds,
                            [&](const std::byte* a, const std::byte* b, int reps, float* sink) {
                              if (is_int8) TileLoop<true>(a, b, p, scale_every, reps, sink);
                              else TileLoop<false>(a, b, p, 0, reps, sink);
                            }));
  };
  for (const Placement& p : kPlacements) measure(p.name, p, false, 0);
  if (!int8) return out;
  measure("int8 (tdpbssd), A as the kernels' x, B from L2: one scale per token", kInt8Placement, true, 0);
  measure("int8, same: sums scaled per token and 128-K block", kInt8Placement, true, 2);
  measure("int8, same: sums scaled per token and 64-K block", kInt8Placement, true, 1);
  return out;
}

}  // namespace moe
