// Kernels over experts in the CPU server's packed layout (kernels.h:
// PackedLayout; the index math is expert_compute/packed_index.h, shared with the
// packer and the CPU kernels).
//
// Two kinds of grouped packed kernels: tensor-core ones (below, "tensor-core
// variant") for every group and format when H and I are multiples of 8, and CUDA-core
// weight-streaming GEMVs like the bf16 ones in expert_kernels.cu for other
// shapes, shaped by the layout: a block of 4 warps owns one
// 16-channel packed block (gate and up together for gate/up, one down block
// for down) of one group; its warps take every 4th 64-k chunk. A lane reads 16
// bytes per load, which the layout makes 4 channels x 4 k (int8: one 64-byte
// chunk row holds 4 k of all 16 channels) or 4 channels x 8 k (int4: a byte
// holds tile rows 2i and 2i+1), so every lane keeps the same 4 channels and
// the warp reduces over the 8 lanes that share them. Codes become f32 in
// registers (int8, int4: byte_perm into the mantissa of 2^23, one subtract;
// fp8: its bits moved into an f16's, Fp8x4), scales are applied per chunk
// (int4 groups; fp8 groups, to the weights) or in the epilogue (int8
// channels). fp8 blocks have int8's byte layout and int4's group scales.
// mxfp4 blocks have int4's nibble layout and computation, E2M1 codes turned
// into (doubled) values by a byte lookup (Mxfp4x4), and an E8M0 scale per 32
// k: a lane's 8 k lie in one scale block. int4 groups are 32 k (a lane's 8
// k in one group, as mxfp4's) or multiples of 64.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "expert_compute/packed_index.h"
#include "gpu_worker/cuda/device_util.cuh"
#include "gpu_worker/cuda/kernels.h"

namespace moe::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;


// row[k .. k+4) as f32, zero at and past len. kVec: len % 4 == 0 and rows
// 8-byte aligned, so an in-range quad is one load.
template <bool kVec>
__device__ __forceinline__ void Load4(const bf16_t* row, int k, int len, float (&v)[4]) {
  if (kVec && k + 4 <= len) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(row + k));
    v[0] = BfLo(r.x), v[1] = BfHi(r.x), v[2] = BfLo(r.y), v[3] = BfHi(r.y);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = k + i < len ? BfLo(row[k + i]) : 0.f;
  }
}

__device__ __forceinline__ float Dot4(const float (&w)[4], const float (&x)[4]) {
  return fmaf(w[0], x[0], fmaf(w[1], x[1], fmaf(w[2], x[2], w[3] * x[3])));
}

// The registers one lane reads from one 64-k chunk of NMAT blocks: int8 two
// 16-byte units (chunk rows lane / 4 and 8 + lane / 4), int4 and mxfp4 one
// unit and the group scales of its 4 channels.
template <int kFmt, int NMAT>
struct ChunkRegs {
  static constexpr int kUnits = kFmt == kFmtInt4 || kFmt == kFmtMxfp4 ? 1 : 2;
  uint4 w[NMAT][kUnits];
  float4 s[NMAT];
};

template <int kFmt, int NMAT>
__device__ __forceinline__ void LoadChunkRegs(const uint8_t* const (&blk)[NMAT], int ch, int Kp, int group, int lane,
                                              ChunkRegs<kFmt, NMAT>& r) {
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    if constexpr (kFmt != kFmtInt4 && kFmt != kFmtMxfp4) {
      r.w[m][0] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 1024 + 16 * lane);
      r.w[m][1] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 1024 + 16 * (lane + kWarp));
      if constexpr (kFmt == kFmtFp8) {
        const size_t off = static_cast<size_t>(Kp) * 16 + (static_cast<size_t>(64 * ch / group) * 16 + 4 * (lane & 3)) * 4;
        r.s[m] = __ldg(reinterpret_cast<const float4*>(blk[m] + off));
      }
    } else {
      r.w[m][0] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 512 + 16 * lane);
      if constexpr (kFmt == kFmtMxfp4) {  // the 4 exponents of the lane's channels in its 32-k block
        const size_t off = static_cast<size_t>(Kp) * 8 + static_cast<size_t>(2 * ch + (lane >> 4)) * 16 + 4 * (lane & 3);
        const uint32_t e = __ldg(reinterpret_cast<const uint32_t*>(blk[m] + off));
        r.s[m] = make_float4(Mxfp4Scale(e & 0xFFu), Mxfp4Scale((e >> 8) & 0xFFu), Mxfp4Scale((e >> 16) & 0xFFu),
                             Mxfp4Scale(e >> 24));
      } else {  // the group of the lane's 8 k (lanes 16-31 hold the chunk's second 32 k)
        const size_t off =
            static_cast<size_t>(Kp) * 8 + (static_cast<size_t>((64 * ch + 32 * (lane >> 4)) / group) * 16 + 4 * (lane & 3)) * 4;
        r.s[m] = __ldg(reinterpret_cast<const float4*>(blk[m] + off));
      }
    }
  }
}

// acc[m][r][c] += chunk ch of W_m[4cq + c, :] . x_r, cq = lane % 4 (int4
// group scales applied; the int8 channel scale is the caller's).
template <int kFmt, int M, int NMAT, bool kVec>
__device__ __forceinline__ void AddChunk(const ChunkRegs<kFmt, NMAT>& cr, int ch, const bf16_t* const (&xr)[M],
                                         int len, int lane, float (&acc)[NMAT][M][4]) {
  if constexpr (kFmt == kFmtInt8 || kFmt == kFmtFp8) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = 64 * ch + 4 * ((lane + kWarp * half) >> 2);
      float wf[NMAT][4][4];
#pragma unroll
      for (int m = 0; m < NMAT; ++m) {
        const uint4 w = cr.w[m][half];
        if constexpr (kFmt == kFmtInt8) {
          Bytes4<128>(w.x ^ 0x80808080u, wf[m][0]);
          Bytes4<128>(w.y ^ 0x80808080u, wf[m][1]);
          Bytes4<128>(w.z ^ 0x80808080u, wf[m][2]);
          Bytes4<128>(w.w ^ 0x80808080u, wf[m][3]);
        } else {  // fp8: code / 256 (Fp8x4); the group scale x 256 multiplies the sums below
          Fp8x4(w.x, wf[m][0]);
          Fp8x4(w.y, wf[m][1]);
          Fp8x4(w.z, wf[m][2]);
          Fp8x4(w.w, wf[m][3]);
        }
      }
#pragma unroll
      for (int r = 0; r < M; ++r) {
        if (xr[r] == nullptr) continue;
        float xv[4];
        Load4<kVec>(xr[r], k, len, xv);
#pragma unroll
        for (int m = 0; m < NMAT; ++m) {
          if constexpr (kFmt == kFmtFp8) {
            const float s[4] = {256.f * cr.s[m].x, 256.f * cr.s[m].y, 256.f * cr.s[m].z, 256.f * cr.s[m].w};
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][r][c] = fmaf(s[c], Dot4(wf[m][c], xv), acc[m][r][c]);
          } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][r][c] += Dot4(wf[m][c], xv);
          }
        }
      }
    }
  } else {
    static_assert(kFmt == kFmtInt4 || kFmt == kFmtMxfp4);
    const int k = 64 * ch + 8 * (lane >> 2);  // byte row lane / 4: k .. k+4 low nibbles, k+4 .. k+8 high
    float lo[NMAT][4][4], hi[NMAT][4][4];
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
      const uint32_t ws[4] = {cr.w[m][0].x, cr.w[m][0].y, cr.w[m][0].z, cr.w[m][0].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if constexpr (kFmt == kFmtMxfp4) {
          Mxfp4x4(ws[c] & 0x0F0F0F0Fu, lo[m][c]);
          Mxfp4x4((ws[c] >> 4) & 0x0F0F0F0Fu, hi[m][c]);
        } else {
          Bytes4<8>(ws[c] & 0x0F0F0F0Fu, lo[m][c]);
          Bytes4<8>((ws[c] >> 4) & 0x0F0F0F0Fu, hi[m][c]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (xr[r] == nullptr) continue;
      float x0[4], x1[4];
      Load4<kVec>(xr[r], k, len, x0);
      Load4<kVec>(xr[r], k + 4, len, x1);
#pragma unroll
      for (int m = 0; m < NMAT; ++m) {
        const float s[4] = {cr.s[m].x, cr.s[m].y, cr.s[m].z, cr.s[m].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][r][c] = fmaf(s[c], Dot4(lo[m][c], x0) + Dot4(hi[m][c], x1), acc[m][r][c]);
      }
    }
  }
}

// One warp's share of acc[mat][r][c] = sum_k W_mat[4cq + c, k] * x_r[k] over
// the chunks ch = warp, warp + kWarps, ... of the NMAT blocks `blk` (Kp
// columns), where cq = lane % 4; the int8 per-channel scale is left to the
// caller, the int4 group scales are applied. Rows with xr[r] == nullptr are
// skipped (warp-uniform). The next chunk's weights are loaded before this
// one is computed, so the HBM latency hides behind the rows' arithmetic.
template <int kFmt, int M, int NMAT, bool kVec>
__device__ __forceinline__ void PackedWarpDots(const uint8_t* const (&blk)[NMAT], int Kp, int group,
                                               const bf16_t* const (&xr)[M], int len, int warp, int lane,
                                               float (&acc)[NMAT][M][4]) {
  ZeroSums(acc);
  const int chunks = Kp / 64;
  if (warp >= chunks) return;
  ChunkRegs<kFmt, NMAT> cur, next;
  LoadChunkRegs<kFmt, NMAT>(blk, warp, Kp, group, lane, cur);
  for (int ch = warp; ch < chunks; ch += kWarps) {
    if (ch + kWarps < chunks) LoadChunkRegs<kFmt, NMAT>(blk, ch + kWarps, Kp, group, lane, next);
    AddChunk<kFmt, M, NMAT, kVec>(cur, ch, xr, len, lane, acc);
    cur = next;
  }
}

// Sums acc over the lanes that share its channels and leaves the warp's
// partials in red[warp][m][r][16].
template <int M, int NMAT>
__device__ __forceinline__ void WarpToShared(float (&acc)[NMAT][M][4], int warp, int lane,
                                             float (*red)[NMAT][M][16]) {
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = acc[m][r][c];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < 4) red[warp][m][r][4 * lane + c] = v;
      }
}

// int8 blocks: the 16 per-channel scales after the Kp/64 chunks; int4: 1.
template <int kFmt>
__device__ __forceinline__ float ChannelScale(const uint8_t* blk, int Kp, int c) {
  if constexpr (kFmt == kFmtInt8) return reinterpret_cast<const float*>(blk + static_cast<size_t>(Kp) * 16)[c];
  return 1.f;
}

// Grid (ceil(I / 16), num_groups): block (b, g) computes intermediate
// channels [16b, 16b + 16) of group g's rows, M rows per pass.
template <int kFmt, int M, bool kVec>
__global__ void __launch_bounds__(kThreads) PackedGateUpKernel(GroupedExpertArgs a, PackedSlots p) {
  const GroupDesc gd = a.groups[blockIdx.y];
  const int b = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const PackedLayout& l = p.layout;
  const uint8_t* base = p.packed + static_cast<size_t>(gd.buffer) * p.packed_stride;
  const ExpertEpilogue ep(a, base);
  const uint8_t* const blk[2] = {base + static_cast<size_t>(2 * b) * l.gate_up_block,
                                 base + static_cast<size_t>(2 * b + 1) * l.gate_up_block};
  __shared__ float red[kWarps][2][M][16];
  for (int pass = 0; pass < gd.count; pass += M) {
    const bf16_t* xr[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const int t = pass + r < gd.count ? a.token[gd.row_begin + pass + r] : -1;
      xr[r] = t >= 0 ? a.x + static_cast<size_t>(t) * a.hidden : nullptr;
    }
    float acc[2][M][4];
    PackedWarpDots<kFmt, M, 2, kVec>(blk, l.Kh, l.group, xr, a.hidden, warp, lane, acc);
    WarpToShared<M, 2>(acc, warp, lane, red);
    __syncthreads();
    for (int t = static_cast<int>(threadIdx.x); t < M * 16; t += kThreads) {
      const int r = t / 16, c = t % 16, n = 16 * b + c, row = gd.row_begin + pass + r;
      if (pass + r >= gd.count || n >= a.intermediate || a.token[row] < 0) continue;
      float g = 0.f, u = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) g += red[w][0][r][c], u += red[w][1][r][c];
      g *= ChannelScale<kFmt>(blk[0], l.Kh, c);
      u *= ChannelScale<kFmt>(blk[1], l.Kh, c);
      a.act[static_cast<size_t>(row) * a.intermediate + n] = ToBf16(ep.Act(n, g, u));
    }
    __syncthreads();
  }
}

// Grid (ceil(H / 16), num_groups): block (b, g) adds output channels
// [16b, 16b + 16) of group g's rows into the accumulator.
template <int kFmt, int M, bool kVec>
__global__ void __launch_bounds__(kThreads) PackedDownKernel(GroupedExpertArgs a, PackedSlots p) {
  const GroupDesc gd = a.groups[blockIdx.y];
  const int b = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const PackedLayout& l = p.layout;
  const ExpertEpilogue ep(a, p.packed + static_cast<size_t>(gd.buffer) * p.packed_stride);
  const uint8_t* const blk[1] = {p.packed + static_cast<size_t>(gd.buffer) * p.packed_stride + l.gate_up_bytes +
                                 static_cast<size_t>(b) * l.down_block};
  __shared__ float red[kWarps][1][M][16];
  for (int pass = 0; pass < gd.count; pass += M) {
    const bf16_t* xr[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const int row = gd.row_begin + pass + r;
      const bool valid = pass + r < gd.count && a.token[row] >= 0;
      xr[r] = valid ? a.act + static_cast<size_t>(row) * a.intermediate : nullptr;
    }
    float acc[1][M][4];
    PackedWarpDots<kFmt, M, 1, kVec>(blk, l.Ki, l.group, xr, a.intermediate, warp, lane, acc);
    WarpToShared<M, 1>(acc, warp, lane, red);
    __syncthreads();
    for (int t = static_cast<int>(threadIdx.x); t < M * 16; t += kThreads) {
      const int r = t / 16, c = t % 16, n = 16 * b + c, row = gd.row_begin + pass + r;
      if (pass + r >= gd.count || n >= a.hidden) continue;
      const int token = a.token[row];
      if (token < 0) continue;
      float y = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) y += red[w][0][r][c];
      y *= ChannelScale<kFmt>(blk[0], l.Ki, c);
      atomicAdd(a.accum + static_cast<size_t>(token) * a.hidden + n, a.weight[row] * ep.Down(n, y));
    }
    __syncthreads();
  }
}


// ---- tensor-core variant (any group: 8 to 64 rows per pass) -----------------
//
// mma.sync.m16n8k16 (bf16 in, f32 accumulate) straight from the packed
// bytes, dequantized in registers: the weights are the A operand (16
// channels x 16 k), 8 of the group's rows the B operand (16 k x 8 rows). A
// dot product does not depend on the order of k, nor the output on the
// order of the mma's rows, so both are permuted to fit the packed layout:
//   - mma row i is channel 2i (i < 8) or 2(i - 8) + 1 of the block, so lane
//     (gid, tig) holds channels 2 gid and 2 gid + 1: 8 adjacent bytes of a
//     chunk row (one 8-byte load for both);
//   - int8: k-step s of a 64-k chunk takes chunk rows 4s .. 4s + 3, lane tig
//     row 4s + tig, whose 4 bytes per channel are k = 16s + 4tig + {0..3};
//     they fill the lane's k slots {2tig, 2tig+1} and {2tig+8, 2tig+9}, and
//     the rows' activations at the same k are one 8-byte load;
//   - int4: a byte row holds tile rows 2i (low nibbles) and 2i+1 (high):
//     k-steps 2h and 2h+1 share byte row 4h + tig (low, then high nibbles),
//     k = 32h + 8tig + {0..3} and + {4..7}: one 16-byte activation load.
// Codes become f32 (byte_perm into 2^23's mantissa, one subtract) and bf16
// pairs (exact: |code| <= 128; int4 nibbles straight into bf16 mantissas,
// see NibblesToBf16x2; mxfp4's E2M1 codes, doubled, through a byte lookup
// into the same mantissas, see E2m1ToBf16x2); int8 channel scales apply in
// the epilogue, int4 group scales and mxfp4's E8M0 exponents to each chunk's
// partial sums (kHalves, groups of 32: each 32-k half's) or, from 32 rows
// per pass, to the bf16 weights themselves (exact for mxfp4: a power of 2);
// fp8's (multiples of 64) to each chunk's sums.
// A block of 4 warps owns 4 CB 16-channel matrix blocks: down, 64 CB output
// channels (CB blocks per warp); gate/up, 32 CB (warps 2i, 2i+1: gate and
// up of the same CB blocks, which meet in shared memory for silu(gate) * up).
// With CB = 2 each activation fragment feeds two blocks' mma's, and the
// block stages the pass's activations once for twice the channels. Each
// warp walks all of K. The blocks' weights, their group scales and the
// pass's activations move global -> shared with cp.async, kSC 64-k chunks
// per stage, kStages - 1 stages ahead (bytes in flight that hold no
// registers), and the warps read them with conflict-free 8- and 16-byte
// loads (rows swizzled: WeightUnit, MmaTile::XSwizzle). Down starts during
// gate/up's last blocks (a programmatic dependent launch: its first stages'
// weights go out before it waits for act). Measured on the H100: 2-3x fewer
// instructions per weight than register-prefetched
// loads with per-unit index math, and one row per group included, faster
// than the CUDA-core kernel at one row.
// kHalves: int4 groups of 32 k and mxfp4, a scale per 32-k half of each
// chunk (else one per chunk: groups of multiples of 64).
template <int kFmt, int NT, bool kHalves = false>
struct MmaTile {
  static constexpr bool kBytes = kFmt != kFmtInt4 && kFmt != kFmtMxfp4;  // int8, fp8: a byte per weight
  static constexpr bool kGrouped = kFmt != kFmtInt8;  // int4, fp8, mxfp4: group scales after the chunks
  // A group-scale row: 16 channels' f32 scales (int4, fp8) or E8M0 exponents (mxfp4).
  static constexpr int kSRowBytes = kFmt == kFmtMxfp4 ? 16 : 64;
  static constexpr int kRows = 8 * NT;                // rows per pass
  // 16-channel blocks per warp: two from 9 rows for int4, from 17 for int8
  // and fp8 (at 9-16 rows one gives twice the blocks: 4-5% faster on
  // DeepSeek-V3, Qwen3-30B-A3B's down 4%; int4 3% slower that way).
  static constexpr int CB = NT >= 2 && !(NT == 2 && kBytes) ? 2 : 1;
  static constexpr int kSC = NT >= 8 ? 1 : 2;         // 64-k chunks per stage
  static constexpr int kStages = NT >= 2 ? 3 : 4;     // the shared memory of 3 blocks per SM from 9 rows
  static constexpr int kChunkBytes = kBytes ? 1024 : 512;
  static constexpr int kSlots = kWarps * CB;  // 16-channel matrix blocks per thread block
  static constexpr int kWBytes = kSlots * kSC * kChunkBytes;
  // Group-scale rows a stage's chunks may use per slot: one per chunk, per 32-k half with kHalves.
  static constexpr int kSRows = kHalves ? 2 * kSC : kSC;
  static constexpr int kSBytes = kGrouped ? kSlots * kSRows * kSRowBytes : 0;
  static constexpr int kXBytes = kRows * kSC * 128;
  static constexpr int kStageBytes = kWBytes + kSBytes + kXBytes;
  static constexpr int kSmem = kStages * kStageBytes;
  // Activation row r's 16-byte unit q sits at unit q ^ XSwizzle(r): the 8
  // rows' 8-byte reads of one k-step (int8, fp8) or 16-byte reads (int4)
  // then hit distinct banks.
  __device__ static int XSwizzle(int r) { return kBytes ? (r & 3) << 1 : (r & 1) << 2; }
};

// Where 16-byte unit q (0..3) of chunk row r (64 bytes) sits in a staged
// chunk: rows 4s .. 4s + 3 of one k-step's reads fill all 32 banks.
__device__ __forceinline__ int WeightUnit(int r, int q) { return r * 64 + 16 * (q ^ (((r >> 1) & 1) << 1)); }

// The 4 E4M3 codes of `u`, each / 256 (Fp8x4: exact, subnormals included),
// as exact bf16 pairs: lo = bytes 0, 1; hi = bytes 2, 3. (Integer-only
// conversion straight to bf16 was tried: its branch for zero and subnormal
// codes cost 1.6x at 2-64 rows on the H100.)
__device__ __forceinline__ void Fp8ToBf16x2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  float f[4];
  Fp8x4(u, f);
  const __nv_bfloat162 l = __floats2bfloat162_rn(f[0], f[1]), h = __floats2bfloat162_rn(f[2], f[3]);
  lo = *reinterpret_cast<const uint32_t*>(&l);
  hi = *reinterpret_cast<const uint32_t*>(&h);
}

// The 4 codes of `u` (bytes, each minus kBias) as bf16 pairs: lo = bytes
// 0, 1; hi = bytes 2, 3 (low halves first, as the mma reads a register).
template <int kBias>
__device__ __forceinline__ void CodesToBf16x2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  float f[4];
  Bytes4<kBias>(u, f);
  const __nv_bfloat162 l = __floats2bfloat162_rn(f[0], f[1]), h = __floats2bfloat162_rn(f[2], f[3]);
  lo = *reinterpret_cast<const uint32_t*>(&l);
  hi = *reinterpret_cast<const uint32_t*>(&h);
}


// The nibbles at bit kShift (0: low, 4: high) of the 4 bytes of `u`, each
// minus 8, as bf16 pairs: lo = bytes 0, 1; hi = bytes 2, 3. A nibble n in
// the low mantissa bits of bf16 128 (0x4300) is 128 + n, exactly; one bf16x2
// subtract of 136 leaves n - 8 (no f32 round trip).
template <int kShift>
__device__ __forceinline__ void NibblesToBf16x2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  const uint32_t v = kShift ? u >> kShift : u;
  const uint32_t l = (__byte_perm(v, 0, 0x4140) & 0x000F000Fu) | 0x43004300u;
  const uint32_t h = (__byte_perm(v, 0, 0x4342) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 bias = __floats2bfloat162_rn(136.f, 136.f);
  const __nv_bfloat162 lv = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&l), bias);
  const __nv_bfloat162 hv = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&h), bias);
  lo = *reinterpret_cast<const uint32_t*>(&lv);
  hi = *reinterpret_cast<const uint32_t*>(&hv);
}

// The E2M1 codes in the nibbles at bit kShift of the 4 bytes of `u`, each
// twice its value (0, 1, 2, 3, 4, 6, 8, 12 and negatives, as Mxfp4x4's; the
// scale carries the 1/2), as bf16 pairs: the magnitude
// (E2m1DoubledMagnitudes) lands in the low mantissa bits of bf16
// 128 (0x43 from the placing __byte_perm's second operand), one bf16x2 subtract of 128
// leaves it exactly, and the code's sign bit moves to the bf16's.
template <int kShift>
__device__ __forceinline__ void E2m1ToBf16x2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  const uint32_t v = (kShift ? u >> kShift : u) & 0x0F0F0F0Fu;
  const uint32_t mag = E2m1DoubledMagnitudes(v);
  const uint32_t l = __byte_perm(mag, 0x43434343u, 0x4140), h = __byte_perm(mag, 0x43434343u, 0x4342);
  const uint32_t sgn = v & 0x08080808u;  // bit 3 of byte i -> bit 15 of its half
  const uint32_t sl = __byte_perm(sgn, 0, 0x1404) << 4, sh = __byte_perm(sgn, 0, 0x3424) << 4;
  const __nv_bfloat162 bias = __floats2bfloat162_rn(128.f, 128.f);
  const __nv_bfloat162 lv = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&l), bias);
  const __nv_bfloat162 hv = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&h), bias);
  lo = *reinterpret_cast<const uint32_t*>(&lv) | sl;
  hi = *reinterpret_cast<const uint32_t*>(&hv) | sh;
}

// A nibble format's codes (int4: NibblesToBf16x2; mxfp4: E2m1ToBf16x2).
template <int kFmt, int kShift>
__device__ __forceinline__ void NibbleCodesToBf16x2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  if constexpr (kFmt == kFmtMxfp4) E2m1ToBf16x2<kShift>(u, lo, hi);
  else NibblesToBf16x2<kShift>(u, lo, hi);
}

// The same, times the group scales (s, s) of their channel, rounded once to
// bf16 (int4: n - 8 is exact, the product is within 2^-9 of (n - 8) s; mxfp4:
// exact, s a power of 2): the mma then sums scaled weights and no per-group
// rescaling of the sums is needed.
template <int kFmt, int kShift>
__device__ __forceinline__ void ScaledNibblesToBf16x2(uint32_t u, __nv_bfloat162 s, uint32_t& lo, uint32_t& hi) {
  uint32_t l, h;
  NibbleCodesToBf16x2<kFmt, kShift>(u, l, h);
  const __nv_bfloat162 lv = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&l), s);
  const __nv_bfloat162 hv = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&h), s);
  lo = *reinterpret_cast<const uint32_t*>(&lv);
  hi = *reinterpret_cast<const uint32_t*>(&hv);
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 writes zeros.
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending)); }

// acc[cb][j] += m x (the channel pair's scales s) x part[cb][j]: a scale
// span's partial sums into the accumulators (C elements 0, 1: channel 2 gid;
// 2, 3: channel 2 gid + 1).
template <int CB, int NT>
__device__ __forceinline__ void AddScaledParts(float (&acc)[CB][NT][4], const float (&part)[CB][NT][4],
                                               const float2 (&s)[CB], float m) {
#pragma unroll
  for (int cb = 0; cb < CB; ++cb) {
    const float s0 = m * s[cb].x, s1 = m * s[cb].y;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      acc[cb][j][0] = fmaf(s0, part[cb][j][0], acc[cb][j][0]);
      acc[cb][j][1] = fmaf(s0, part[cb][j][1], acc[cb][j][1]);
      acc[cb][j][2] = fmaf(s1, part[cb][j][2], acc[cb][j][2]);
      acc[cb][j][3] = fmaf(s1, part[cb][j][3], acc[cb][j][3]);
    }
  }
}

// Blocks per SM the kernel's registers must allow. 64 rows: at most 168
// registers, 3 blocks (int8 and int4 8-15% faster than 2 blocks at 191-199
// registers; fp8's conversion then spills). int4 (and mxfp4, its layout) at
// 32 rows: 128, 4 blocks (3-6% faster on Qwen3-30B-A3B; int8 and fp8 lose).
template <int kFmt, int NT>
constexpr int MmaMinBlocks() {
  return NT >= 8 && kFmt != kFmtFp8 ? 3 : NT == 4 && (kFmt == kFmtInt4 || kFmt == kFmtMxfp4) ? 4 : 1;
}

// Long: one kernel body (pipeline, dequantization, MMA, epilogue) kept whole for the compiler's register allocation.
template <int kFmt, int NT, bool kDown, bool kHalves>
__global__ void __launch_bounds__(kThreads, MmaMinBlocks<kFmt, NT>()) PackedMmaKernel(GroupedExpertArgs a, PackedSlots p) {
  static_assert(kHalves == (kFmt == kFmtMxfp4) || kFmt == kFmtInt4, "scales per 32-k half: int4's groups of 32, mxfp4's");
  using T = MmaTile<kFmt, NT, kHalves>;
  constexpr int CB = T::CB;
  // down (the next launch) may start while this grid's last blocks run.
  if constexpr (!kDown) asm volatile("griddepcontrol.launch_dependents;");
  // int4 group scales: from 32 rows per pass multiplied into the bf16 weights
  // (rounded once: within 2^-9 of (n - 8) s), which spares rescaling each
  // chunk's sums per row (1159 instead of 1279 us at 64 rows, DeepSeek-V3,
  // stop 19); below, applied to the chunk's f32 sums.
  // mxfp4 the same (its scales are powers of 2: exact).
  constexpr bool kScaled = !T::kBytes && NT >= 4;
  // fp8: exact bf16 codes, the group scales applied to each chunk's sums.
  constexpr bool kPartSums = (!T::kBytes && !kScaled) || kFmt == kFmtFp8;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int tok[T::kRows];
  const GroupDesc gd = a.groups[blockIdx.y];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarp, lane = tid % kWarp;
  const int gid = lane / 4, tig = lane % 4;
  const PackedLayout& l = p.layout;
  const int H = a.hidden, I = a.intermediate;
  const int N = kDown ? H : I, len = kDown ? I : H, Kp = kDown ? l.Ki : l.Kh;
  const int nblocks = (N + 15) / 16, chunks = Kp / 64, stages = (chunks + T::kSC - 1) / T::kSC;
  const uint8_t* base = p.packed + static_cast<size_t>(gd.buffer) * p.packed_stride;
  const ExpertEpilogue ep(a, base);
  // Slot i = warp * CB + cb: down, channel block 4 CB x + i; gate/up, gate
  // (even warps) or up (odd) of channel block 2 CB x + (warp / 2) CB + cb.
  const int bx = static_cast<int>(blockIdx.x);
  auto slot_block = [&](int i) { return kDown ? kWarps * CB * bx + i : kWarps / 2 * CB * bx + (i / CB / 2) * CB + i % CB; };
  auto slot_ptr = [&](int i) -> const uint8_t* {
    const int c = min(slot_block(i), nblocks - 1);  // a block past N is staged as zeros, never written
    return kDown ? base + l.gate_up_bytes + static_cast<size_t>(c) * l.down_block
                 : base + static_cast<size_t>(2 * c + (i / CB) % 2) * l.gate_up_block;
  };
  // What this thread stages: its warp's own slots' weights (lane-strided
  // 16-byte units of each chunk) and group-scale rows, and MX 16-byte units
  // of the pass's activations (their rows' addresses set per pass).
  const uint8_t* wsrc[CB];
  bool wvalid[CB];
#pragma unroll
  for (int cb = 0; cb < CB; ++cb) wvalid[cb] = slot_block(warp * CB + cb) < nblocks, wsrc[cb] = slot_ptr(warp * CB + cb);
  constexpr int kPer = T::kChunkBytes / 16 / kWarp;  // a lane's units per chunk: 2 (int8, fp8), 1 (int4)
  constexpr int MX = T::kRows * 8 * T::kSC / kThreads;
  static_assert(MX >= 1 && T::kRows * 8 * T::kSC % kThreads == 0, "whole activation units per thread");
  const bf16_t* xsrc[MX];
  // The group-scale row of 32-k half u (half u % 2 of chunk u / 2; groups
  // are multiples of 32 k): exact through the float reciprocal (u + 0.5
  // lies >= 0.5 / (group / 32) from any integer multiple), no integer
  // division per chunk.
  const float inv_gph = 32.f / static_cast<float>(max(l.group, 32));
  auto group_row = [&](int u) { return static_cast<int>((static_cast<float>(u) + 0.5f) * inv_gph); };
  // Stage st's weights and scales and/or its activations (none past the
  // last stage) into buffer st % kStages.
  auto issue = [&](int st, bool weights, bool acts) {
    uint8_t* buf = smem + (st % T::kStages) * T::kStageBytes;
    if (weights && st < stages) {
      uint8_t* wdst = buf + warp * CB * T::kSC * T::kChunkBytes;
#pragma unroll
      for (int cb = 0; cb < CB; ++cb)
#pragma unroll
        for (int m = 0; m < T::kSC * kPer; ++m) {
          const int c = m / kPer, rest = lane + kWarp * (m % kPer), ch = T::kSC * st + c;
          const bool in = wvalid[cb] && ch < chunks;
          CopyAsync16(wdst + (cb * T::kSC + c) * T::kChunkBytes + WeightUnit(rest / 4, rest % 4),
                      in ? wsrc[cb] + static_cast<size_t>(ch) * T::kChunkBytes + 16 * rest : base, in ? 16 : 0);
        }
      if constexpr (T::kGrouped) {  // the group-scale rows (16 f32 or E8M0 exponents) the stage's chunks use
        constexpr int kQ = T::kSRowBytes / 16;  // 16-byte units per row
        if (lane < kQ * T::kSRows) {
          const int r0 = group_row(2 * T::kSC * st), rr = lane / kQ, q = lane % kQ;
#pragma unroll
          for (int cb = 0; cb < CB; ++cb) {
            const bool in = wvalid[cb] && (r0 + rr) * l.group < Kp;
            const uint8_t* src =
                wsrc[cb] + static_cast<size_t>(Kp) * (T::kBytes ? 16 : 8) + (r0 + rr) * T::kSRowBytes + 16 * q;
            CopyAsync16(buf + T::kWBytes + ((warp * CB + cb) * T::kSRows + rr) * T::kSRowBytes + 16 * q, in ? src : base,
                        in ? 16 : 0);
          }
        }
      }
    }
    if (acts && st < stages) {
#pragma unroll
      for (int m = 0; m < MX; ++m) {
        const int u = tid + kThreads * m, r = u / (8 * T::kSC), q = u % (8 * T::kSC), k = 64 * T::kSC * st;
        const bool in = xsrc[m] != nullptr && k + 8 * q < len;  // len % 8 == 0: a unit is wholly in or out
        CopyAsync16(buf + T::kWBytes + T::kSBytes + r * (128 * T::kSC) + 16 * (q ^ T::XSwizzle(r)),
                    in ? xsrc[m] + k : a.x, in ? 16 : 0);
      }
    }
  };
  for (int pass = 0; pass < gd.count; pass += T::kRows) {
    __syncthreads();  // the last pass's epilogue is done with tok and the buffers
    for (int r = tid; r < T::kRows; r += kThreads) tok[r] = pass + r < gd.count ? a.token[gd.row_begin + pass + r] : -1;
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MX; ++m) {
      const int u = tid + kThreads * m, r = u / (8 * T::kSC), k = 8 * (u % (8 * T::kSC)), t = tok[r];
      xsrc[m] = t < 0 ? nullptr
                      : kDown ? a.act + static_cast<size_t>(gd.row_begin + pass + r) * I + k
                              : a.x + static_cast<size_t>(t) * H + k;
    }
    // The first stages' weights go out before down waits for gate/up's act
    // (launched as its programmatic dependent, down starts during gate/up's
    // tail; the wait is a no-op otherwise); one commit group for them all.
    for (int st = 0; st < T::kStages - 1; ++st) issue(st, true, false);
    if constexpr (kDown) asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int st = 0; st < T::kStages - 1; ++st) issue(st, false, true);
    CopyAsyncCommit();
    float acc[CB][NT][4];
    ZeroSums(acc);
    for (int st = 0; st < stages; ++st) {
      if (st == 0) CopyAsyncWait<0>();  // the first stages' group
      else CopyAsyncWait<T::kStages - 2>();
      __syncthreads();  // stage st landed for every thread; buffer (st - 1) % kStages is free
      issue(st + T::kStages - 1, true, true);
      CopyAsyncCommit();
      const uint8_t* buf = smem + (st % T::kStages) * T::kStageBytes;
      const uint8_t* wb = buf + warp * CB * T::kSC * T::kChunkBytes;
      const uint8_t* xb = buf + T::kWBytes + T::kSBytes;
      const int r0 = T::kGrouped ? group_row(2 * T::kSC * st) : 0;
#pragma unroll
      for (int c = 0; c < T::kSC; ++c) {
        const int ch = T::kSC * st + c;
        if (ch >= chunks) break;
        // int4, fp8, mxfp4: the chunk's group scales of channels 2 gid, 2 gid + 1 (kHalves: its first 32 k's;
        // gsc_hi its second 32 k's).
        float2 gsc[CB], gsc_hi[CB];
#pragma unroll
        for (int cb = 0; cb < CB; ++cb) {
          auto scales = [&](int u) {  // the staged scale row of 32-k half u
            const uint8_t* row = buf + T::kWBytes + ((warp * CB + cb) * T::kSRows + group_row(u) - r0) * T::kSRowBytes;
            if constexpr (kFmt == kFmtMxfp4) {
              const uint32_t e = *reinterpret_cast<const uint16_t*>(row + 2 * gid);
              return make_float2(Mxfp4Scale(e & 0xFFu), Mxfp4Scale(e >> 8));
            } else {
              return *reinterpret_cast<const float2*>(row + 8 * gid);
            }
          };
          gsc[cb] = T::kGrouped ? scales(2 * ch) : make_float2(1.f, 1.f);
          if constexpr (kHalves) gsc_hi[cb] = scales(2 * ch + 1);
        }
        // kPartSums: the chunk's sums (kHalves: each half's), then scaled into acc.
        float part[CB][NT][4];
        if constexpr (kPartSums) ZeroSums(part);
        if constexpr (T::kBytes) {
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint2 xv[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j)
              xv[j] = *reinterpret_cast<const uint2*>(xb + (8 * j + gid) * (128 * T::kSC) +
                                                      16 * ((8 * c + 2 * s + tig / 2) ^ T::XSwizzle(gid)) + 8 * (tig % 2));
#pragma unroll
            for (int cb = 0; cb < CB; ++cb) {
              const uint2 wq = *reinterpret_cast<const uint2*>(wb + (cb * T::kSC + c) * T::kChunkBytes +
                                                               WeightUnit(4 * s + tig, gid / 2) + 8 * (gid % 2));
              uint32_t a0, a1, a2, a3;
              if constexpr (kFmt == kFmtInt8) {
                CodesToBf16x2<128>(wq.x ^ 0x80808080u, a0, a2);  // channel 2 gid
                CodesToBf16x2<128>(wq.y ^ 0x80808080u, a1, a3);  // channel 2 gid + 1
              } else {  // fp8: exact codes / 256; 256 x the scales on the chunk's sums
                Fp8ToBf16x2(wq.x, a0, a2);
                Fp8ToBf16x2(wq.y, a1, a3);
              }
#pragma unroll
              for (int j = 0; j < NT; ++j) MmaBf16(kPartSums ? part[cb][j] : acc[cb][j], a0, a1, a2, a3, xv[j].x, xv[j].y);
            }
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (kPartSums && kHalves) {
              if (h == 1) {  // the first half's sums, at its scales
                AddScaledParts(acc, part, gsc, 1.f);
                ZeroSums(part);
              }
            }
            uint4 xv[NT];  // k = 64c + 32h + 8tig + {0..7}: low nibbles' k-step, then the high ones'
#pragma unroll
            for (int j = 0; j < NT; ++j)
              xv[j] = *reinterpret_cast<const uint4*>(xb + (8 * j + gid) * (128 * T::kSC) +
                                                      16 * ((8 * c + 4 * h + tig) ^ T::XSwizzle(gid)));
#pragma unroll
            for (int cb = 0; cb < CB; ++cb) {
              const uint2 wq = *reinterpret_cast<const uint2*>(wb + (cb * T::kSC + c) * T::kChunkBytes +
                                                               WeightUnit(4 * h + tig, gid / 2) + 8 * (gid % 2));
              const float2 g = kHalves && h == 1 ? gsc_hi[cb] : gsc[cb];
              const __nv_bfloat162 gs0 = __floats2bfloat162_rn(g.x, g.x);
              const __nv_bfloat162 gs1 = __floats2bfloat162_rn(g.y, g.y);
#pragma unroll
              for (int hi = 0; hi < 2; ++hi) {
                uint32_t a0, a1, a2, a3;
                if constexpr (kScaled) {
                  if (hi == 0) {
                    ScaledNibblesToBf16x2<kFmt, 0>(wq.x, gs0, a0, a2);
                    ScaledNibblesToBf16x2<kFmt, 0>(wq.y, gs1, a1, a3);
                  } else {
                    ScaledNibblesToBf16x2<kFmt, 4>(wq.x, gs0, a0, a2);
                    ScaledNibblesToBf16x2<kFmt, 4>(wq.y, gs1, a1, a3);
                  }
                } else if (hi == 0) {
                  NibbleCodesToBf16x2<kFmt, 0>(wq.x, a0, a2);
                  NibbleCodesToBf16x2<kFmt, 0>(wq.y, a1, a3);
                } else {
                  NibbleCodesToBf16x2<kFmt, 4>(wq.x, a0, a2);
                  NibbleCodesToBf16x2<kFmt, 4>(wq.y, a1, a3);
                }
#pragma unroll
                for (int j = 0; j < NT; ++j)
                  MmaBf16(kPartSums ? part[cb][j] : acc[cb][j], a0, a1, a2, a3, hi ? xv[j].z : xv[j].x, hi ? xv[j].w : xv[j].y);
              }
            }
          }
        }
        if constexpr (kPartSums && kHalves) AddScaledParts(acc, part, gsc_hi, 1.f);
        else if constexpr (kPartSums) AddScaledParts(acc, part, gsc, kFmt == kFmtFp8 ? 256.f : 1.f);
      }
    }
    CopyAsyncWait<0>();
    __syncthreads();  // every warp is done with the buffers: up's sums meet gate's in them
    // C element e of lane l: mma row l/4 + 8 (e >= 2), i.e. channel 2 (l/4) + (e >= 2); row 2 (l%4) + (e & 1) of tile j.
    float* up_out = reinterpret_cast<float*>(smem);  // [kWarps / 2][CB][NT][4][kWarp]
    if constexpr (!kDown) {
      if (warp % 2 == 1) {
#pragma unroll
        for (int cb = 0; cb < CB; ++cb) {
          const bool has = slot_block(warp * CB + cb) < nblocks;
          const uint8_t* w = slot_ptr(warp * CB + cb);
          const float cs0 = has ? ChannelScale<kFmt>(w, Kp, 2 * gid) : 0.f, cs1 = has ? ChannelScale<kFmt>(w, Kp, 2 * gid + 1) : 0.f;
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              up_out[((((warp / 2) * CB + cb) * NT + j) * 4 + e) * kWarp + lane] = acc[cb][j][e] * (e < 2 ? cs0 : cs1);
        }
      }
      __syncthreads();
    }
    if (kDown || warp % 2 == 0) {
#pragma unroll
      for (int cb = 0; cb < CB; ++cb) {
        const int blk = slot_block(warp * CB + cb);
        if (blk >= nblocks) continue;
        const uint8_t* w = slot_ptr(warp * CB + cb);
        const float cs0 = ChannelScale<kFmt>(w, Kp, 2 * gid), cs1 = ChannelScale<kFmt>(w, Kp, 2 * gid + 1);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 8 * j + 2 * tig + (e & 1), n = 16 * blk + 2 * gid + (e >= 2 ? 1 : 0);
            const int t = tok[r];
            if (t < 0 || n >= N) continue;
            const int row = gd.row_begin + pass + r;
            const float v = acc[cb][j][e] * (e < 2 ? cs0 : cs1);
            if constexpr (kDown) {
              atomicAdd(a.accum + static_cast<size_t>(t) * H + n, a.weight[row] * ep.Down(n, v));
            } else {
              const float u = up_out[((((warp / 2) * CB + cb) * NT + j) * 4 + e) * kWarp + lane];
              a.act[static_cast<size_t>(row) * I + n] = ToBf16(ep.Act(n, v, u));
            }
          }
      }
    }
  }
}

// How many blocks of a kernel an SM holds, and the shared memory that holds
// it to fewer: a memory-bound launch of `tiles` equal blocks takes about
// ceil(tiles / (SMs x c)) waves of c blocks sharing each SM's bandwidth, so
// its time goes as ceil(tiles / (SMs x c)) x c. With few tiles per SM (a
// small model's 32 experts: 1.2 waves at the kernel's occupancy) a lower c
// ends the waves evenly (2 waves of 3 instead of 1.2 of 5).
struct WaveShape {
  bool ok = false;
  int sms = 0, max_blocks = 0, sm_smem = 0, reserved = 0, static_smem = 0, max_dynamic = 0;
  int SmemForEvenWaves(long tiles, int smem) const {
    int best = max_blocks;
    long best_cost = (tiles + static_cast<long>(sms) * best - 1) / (static_cast<long>(sms) * best) * best;
    for (int c = max_blocks - 1; c >= 3; --c) {  // 3 blocks (12 warps) still hide the latency
      const long cost = (tiles + static_cast<long>(sms) * c - 1) / (static_cast<long>(sms) * c) * c;
      if (cost < best_cost) best = c, best_cost = cost;
    }
    if (best == max_blocks) return smem;
    const int padded = sm_smem / best - reserved - static_smem;  // c = best blocks fill the SM's shared memory
    return std::min(std::max(smem, padded), max_dynamic);
  }
};
template <class Kernel>
WaveShape ShapeOf(Kernel kernel, int threads, int smem) {
  WaveShape w;
  int dev = 0;
  cudaFuncAttributes attr{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaFuncGetAttributes(&attr, kernel) != cudaSuccess ||
      cudaDeviceGetAttribute(&w.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&w.sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&w.reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&w.max_dynamic, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&w.max_blocks, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();
    return w;
  }
  w.static_smem = static_cast<int>(attr.sharedSizeBytes);
  w.max_dynamic -= w.static_smem;
  // Opted in once for any padding SmemForEvenWaves returns: no attribute call per launch.
  w.ok = w.max_blocks >= 2 &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, w.max_dynamic) == cudaSuccess;
  cudaGetLastError();
  return w;
}

// One launch of the tensor-core kernel: down as the programmatic dependent
// of gate/up (PackedMmaKernel waits for act after its first weights), at the
// occupancy whose waves end most evenly when the groups are known.
template <int kFmt, int NT, bool kDown, bool kHalves>
cudaError_t LaunchPackedMma(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  using T = MmaTile<kFmt, NT, kHalves>;
  const int nblocks = ((kDown ? a.hidden : a.intermediate) + 15) / 16, per = (kDown ? kWarps : kWarps / 2) * T::CB;
  const dim3 grid((nblocks + per - 1) / per, a.num_groups);
  const auto kernel = PackedMmaKernel<kFmt, NT, kDown, kHalves>;
  static const WaveShape shape = ShapeOf(kernel, kThreads, T::kSmem);
  const int smem = shape.ok && a.exact_groups ? shape.SmemForEvenWaves(static_cast<long>(grid.x) * grid.y, T::kSmem) : T::kSmem;
  if (!shape.ok && smem > 40 * 1024) {  // static shared memory (tok) counts too; shape.ok: opted in already
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = kDown ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, a, p);
}

// Rows per pass: 8, 16, 32 or 64 (the mma's n is 8 rows; fewer are padding).
template <int kFmt, bool kDown, bool kHalves = false>
cudaError_t LaunchPackedMmaByRows(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  if (a.max_count <= 8) return LaunchPackedMma<kFmt, 1, kDown, kHalves>(a, p, s);
  if (a.max_count <= 16) return LaunchPackedMma<kFmt, 2, kDown, kHalves>(a, p, s);
  if (a.max_count <= 32) return LaunchPackedMma<kFmt, 4, kDown, kHalves>(a, p, s);
  return LaunchPackedMma<kFmt, 8, kDown, kHalves>(a, p, s);
}


// One thread per 8 consecutive values of an output row (gate / up rows of H,
// down rows of I): one or two reads of the packed block (PackedValues8; a
// padded block always holds the whole group of 8), one 16-byte store when the
// row length is a multiple of 8, else element stores up to the row's end.
template <int kFmt>
__global__ void UnpackExpertKernel(const uint8_t* __restrict__ packed, size_t packed_stride, PackedLayout l, int H,
                                   int I, bf16_t* __restrict__ dst, size_t dst_stride, const int* count) {
  // blockIdx.y: the expert of a batch (LaunchUnpackExperts), `count` of them valid.
  if (count != nullptr && static_cast<int>(blockIdx.y) >= *count) return;
  packed += blockIdx.y * packed_stride;
  dst += blockIdx.y * dst_stride;
  const int H8 = (H + 7) / 8, I8 = (I + 7) / 8;
  const size_t gate_up_items = 2 * static_cast<size_t>(I) * H8, items = gate_up_items + static_cast<size_t>(H) * I8;
  for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < items;
       e += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int n, k, K, Kp;
    const uint8_t* blk;
    size_t row;  // first value of the output row
    if (e < gate_up_items) {  // gate (mat 0) / up (mat 1) [I, H]: their blocks interleave
      const int mat = static_cast<int>(e / (static_cast<size_t>(I) * H8));
      const size_t r = e - static_cast<size_t>(mat) * I * H8;
      n = static_cast<int>(r / H8), k = 8 * static_cast<int>(r % H8), K = H, Kp = l.Kh;
      blk = packed + static_cast<size_t>(2 * (n / 16) + mat) * l.gate_up_block;
      row = (static_cast<size_t>(mat) * I + n) * H;
    } else {  // down [H, I]
      const size_t r = e - gate_up_items;
      n = static_cast<int>(r / I8), k = 8 * static_cast<int>(r % I8), K = I, Kp = l.Ki;
      blk = packed + l.gate_up_bytes + static_cast<size_t>(n / 16) * l.down_block;
      row = 2 * static_cast<size_t>(I) * H + static_cast<size_t>(n) * I;
    }
    float v[8];
    PackedValues8<kFmt>(blk, Kp, l.group, n % 16, k, v);
    if (K % 8 == 0) {
      uint4 o;
      o.x = static_cast<uint32_t>(ToBf16(v[0])) | (static_cast<uint32_t>(ToBf16(v[1])) << 16);
      o.y = static_cast<uint32_t>(ToBf16(v[2])) | (static_cast<uint32_t>(ToBf16(v[3])) << 16);
      o.z = static_cast<uint32_t>(ToBf16(v[4])) | (static_cast<uint32_t>(ToBf16(v[5])) << 16);
      o.w = static_cast<uint32_t>(ToBf16(v[6])) | (static_cast<uint32_t>(ToBf16(v[7])) << 16);
      *reinterpret_cast<uint4*>(dst + row + k) = o;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (k + i < K) dst[row + k + i] = ToBf16(v[i]);
    }
  }
  if (l.bias_bytes != 0) {  // the f32 biases as they are, after the matrices
    const float* src = reinterpret_cast<const float*>(packed + l.bias_offset);
    float* out = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(dst) + Bf16BiasOffset(H, I));
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < l.bias_bytes / sizeof(float);
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
      out[i] = src[i];
  }
}

// Rows per pass for the largest group: 1, 2, 4 or kPackedRowsPerPass.
int PassRows(int max_count) {
  if (max_count <= 1) return 1;
  if (max_count <= 2) return 2;
  if (max_count <= 4) return 4;
  return kPackedRowsPerPass;
}

template <int kFmt, int M, bool kDown>
cudaError_t LaunchPacked(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  const int channels = kDown ? a.hidden : a.intermediate;
  const int len = kDown ? a.intermediate : a.hidden;
  const dim3 grid((channels + 15) / 16, a.num_groups);
  const bool vec = len % 4 == 0;
  if constexpr (kDown) {
    if (vec) PackedDownKernel<kFmt, M, true><<<grid, kThreads, 0, s>>>(a, p);
    else PackedDownKernel<kFmt, M, false><<<grid, kThreads, 0, s>>>(a, p);
  } else {
    if (vec) PackedGateUpKernel<kFmt, M, true><<<grid, kThreads, 0, s>>>(a, p);
    else PackedGateUpKernel<kFmt, M, false><<<grid, kThreads, 0, s>>>(a, p);
  }
  return cudaGetLastError();
}

template <int kFmt, bool kDown>
cudaError_t LaunchPackedByRows(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  switch (PassRows(a.max_count)) {
    case 1: return LaunchPacked<kFmt, 1, kDown>(a, p, s);
    case 2: return LaunchPacked<kFmt, 2, kDown>(a, p, s);
    case 4: return LaunchPacked<kFmt, 4, kDown>(a, p, s);
    default: return LaunchPacked<kFmt, kPackedRowsPerPass, kDown>(a, p, s);
  }
}

template <bool kDown>
cudaError_t LaunchPackedByFormat(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  if (a.num_groups == 0) return cudaSuccess;
  const bool mma = a.hidden % 8 == 0 && a.intermediate % 8 == 0;
  switch (p.layout.format) {
    case kFmtInt8:
      return mma ? LaunchPackedMmaByRows<kFmtInt8, kDown>(a, p, s) : LaunchPackedByRows<kFmtInt8, kDown>(a, p, s);
    case kFmtInt4:
      if (!layout::Int4GroupServed(p.layout.group)) return cudaErrorInvalidValue;
      if (!mma) return LaunchPackedByRows<kFmtInt4, kDown>(a, p, s);
      return p.layout.group == 32 ? LaunchPackedMmaByRows<kFmtInt4, kDown, true>(a, p, s)
                                  : LaunchPackedMmaByRows<kFmtInt4, kDown>(a, p, s);
    case kFmtFp8:
      if (p.layout.group <= 0 || p.layout.group % 64 != 0) return cudaErrorInvalidValue;
      return mma ? LaunchPackedMmaByRows<kFmtFp8, kDown>(a, p, s) : LaunchPackedByRows<kFmtFp8, kDown>(a, p, s);
    case kFmtMxfp4:
      if (p.layout.group != 32) return cudaErrorInvalidValue;
      return mma ? LaunchPackedMmaByRows<kFmtMxfp4, kDown, true>(a, p, s) : LaunchPackedByRows<kFmtMxfp4, kDown>(a, p, s);
    default: return cudaErrorInvalidValue;  // bf16 slots are row-major: LaunchGrouped*
  }
}

}  // namespace

cudaError_t LaunchPackedGateUp(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t stream) {
  return LaunchPackedByFormat<false>(a, p, stream);
}

cudaError_t LaunchPackedDown(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t stream) {
  return LaunchPackedByFormat<true>(a, p, stream);
}

cudaError_t LaunchUnpackExpert(const uint8_t* packed, const PackedLayout& layout, int hidden, int intermediate,
                               bf16_t* dst, cudaStream_t stream) {
  const size_t items = 2 * static_cast<size_t>(intermediate) * ((hidden + 7) / 8) +
                       static_cast<size_t>(hidden) * ((intermediate + 7) / 8);
  if (items == 0) return cudaSuccess;
  if ((layout.format == kFmtInt4 && !moe::layout::Int4GroupServed(layout.group)) ||
      (layout.format == kFmtFp8 && (layout.group <= 0 || layout.group % 64 != 0)))
    return cudaErrorInvalidValue;
  if (layout.format == kFmtMxfp4 && layout.group != 32) return cudaErrorInvalidValue;
  const int blocks = static_cast<int>(std::min<size_t>((items + kElemwiseThreads - 1) / kElemwiseThreads, kMaxElemwiseBlocks));
  switch (layout.format) {
    case kFmtBf16:
      UnpackExpertKernel<kFmtBf16><<<blocks, kElemwiseThreads, 0, stream>>>(packed, 0, layout, hidden, intermediate, dst, 0, nullptr);
      break;
    case kFmtInt8:
      UnpackExpertKernel<kFmtInt8><<<blocks, kElemwiseThreads, 0, stream>>>(packed, 0, layout, hidden, intermediate, dst, 0, nullptr);
      break;
    case kFmtInt4:
      UnpackExpertKernel<kFmtInt4><<<blocks, kElemwiseThreads, 0, stream>>>(packed, 0, layout, hidden, intermediate, dst, 0, nullptr);
      break;
    case kFmtFp8:
      UnpackExpertKernel<kFmtFp8><<<blocks, kElemwiseThreads, 0, stream>>>(packed, 0, layout, hidden, intermediate, dst, 0, nullptr);
      break;
    case kFmtMxfp4:
      UnpackExpertKernel<kFmtMxfp4><<<blocks, kElemwiseThreads, 0, stream>>>(packed, 0, layout, hidden, intermediate, dst, 0, nullptr);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchUnpackExperts(const uint8_t* packed, size_t packed_stride, const PackedLayout& layout, int hidden,
                                int intermediate, bf16_t* dst, size_t dst_stride, const int* count, int max_count,
                                cudaStream_t stream) {
  const size_t items = 2 * static_cast<size_t>(intermediate) * ((hidden + 7) / 8) +
                       static_cast<size_t>(hidden) * ((intermediate + 7) / 8);
  if (items == 0 || max_count <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::min<size_t>((items + kElemwiseThreads - 1) / kElemwiseThreads, 1024)),
                  static_cast<unsigned>(max_count));
  switch (layout.format) {
    case kFmtBf16:
      UnpackExpertKernel<kFmtBf16><<<grid, kElemwiseThreads, 0, stream>>>(packed, packed_stride, layout, hidden,
                                                                           intermediate, dst, dst_stride, count);
      break;
    default: return cudaErrorInvalidValue;  // integer slots hold the packed bytes as they are
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda
