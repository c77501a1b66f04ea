// Kernels over experts in the CPU server's packed layout (kernels.h:
// PackedLayout; the index math is cpu_compute/packed_index.h, shared with the
// packer and the CPU kernels).
//
// The grouped packed kernels are weight-streaming GEMVs like the bf16 ones in
// expert_kernels.cu, shaped by the layout: a block of 4 warps owns one
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
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cpu_compute/packed_index.h"
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
// 16-byte units (chunk rows lane / 4 and 8 + lane / 4), int4 one unit and the
// group scales of its 4 channels.
template <int kFmt, int NMAT>
struct ChunkRegs {
  static constexpr int kUnits = kFmt == kFmtInt4 ? 1 : 2;
  uint4 w[NMAT][kUnits];
  float4 s[NMAT];
};

template <int kFmt, int NMAT>
__device__ __forceinline__ void LoadChunkRegs(const uint8_t* const (&blk)[NMAT], int ch, int Kp, int group, int lane,
                                              ChunkRegs<kFmt, NMAT>& r) {
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    if constexpr (kFmt != kFmtInt4) {
      r.w[m][0] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 1024 + 16 * lane);
      r.w[m][1] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 1024 + 16 * (lane + kWarp));
      if constexpr (kFmt == kFmtFp8) {
        const size_t off = static_cast<size_t>(Kp) * 16 + (static_cast<size_t>(64 * ch / group) * 16 + 4 * (lane & 3)) * 4;
        r.s[m] = __ldg(reinterpret_cast<const float4*>(blk[m] + off));
      }
    } else {
      r.w[m][0] = LoadStream16(blk[m] + static_cast<size_t>(ch) * 512 + 16 * lane);
      const size_t off = static_cast<size_t>(Kp) * 8 + (static_cast<size_t>(64 * ch / group) * 16 + 4 * (lane & 3)) * 4;
      r.s[m] = __ldg(reinterpret_cast<const float4*>(blk[m] + off));
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
    static_assert(kFmt == kFmtInt4);
    const int k = 64 * ch + 8 * (lane >> 2);  // byte row lane / 4: k .. k+4 low nibbles, k+4 .. k+8 high
    float lo[NMAT][4][4], hi[NMAT][4][4];
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
      const uint32_t ws[4] = {cr.w[m][0].x, cr.w[m][0].y, cr.w[m][0].z, cr.w[m][0].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        Bytes4<8>(ws[c] & 0x0F0F0F0Fu, lo[m][c]);
        Bytes4<8>((ws[c] >> 4) & 0x0F0F0F0Fu, hi[m][c]);
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
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[m][r][c] = 0.f;
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
      a.act[static_cast<size_t>(row) * a.intermediate + n] = ToBf16(g / (1.f + __expf(-g)) * u);
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
      atomicAdd(a.accum + static_cast<size_t>(token) * a.hidden + n, a.weight[row] * y);
    }
    __syncthreads();
  }
}


// ---- tensor-core variant (2 to 64 rows) -----------------------------------
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
// A warp's weight load of one k-step reads 256 contiguous bytes. Codes
// become f32 (byte_perm into 2^23's mantissa, one subtract) and bf16 pairs
// (exact: |code| <= 128; int4 nibbles straight into bf16 mantissas, see
// NibblesToBf16x2); int8 channel scales apply in the epilogue, int4
// group scales (groups are multiples of 64) to each chunk's partial sums
// or, from 32 rows per pass, to the bf16 weights themselves.
// A block of 4 warps owns 64 output channels of down (a 16-channel block per
// warp) or 32 of gate/up (warps 2i, 2i+1: gate and up of one block, which
// meet in shared memory for silu(gate) * up). Each warp walks all of K; the
// pass's activations of each 64-k chunk are staged once per block in shared
// memory (cp.async, double-buffered, zeros past K and for padding rows) and
// the next chunk's weights are loaded into registers while this one computes.

// The 4 E4M3 codes of `u`, each / 256 (Fp8x4: exact, subnormals included),
// as exact bf16 pairs: lo = bytes 0, 1; hi = bytes 2, 3. (Integer-only
// conversion straight to bf16 was tried: its branch for zero and subnormal
// codes cost 1.6x at 2-64 rows on the H100, RESULTS stop 21.)
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

// The same, times the group scales (s, s) of their channel, rounded once to
// bf16 (n - 8 is exact, the product is within 2^-9 of (n - 8) s): the mma
// then sums scaled weights and no per-group rescaling of the sums is needed.
template <int kShift>
__device__ __forceinline__ void ScaledNibblesToBf16x2(uint32_t u, __nv_bfloat162 s, uint32_t& lo, uint32_t& hi) {
  uint32_t l, h;
  NibblesToBf16x2<kShift>(u, l, h);
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

// Long: one kernel body (staging, chunk loop, dequantization, MMA, epilogue) kept whole for the compiler's register allocation.
// int4 up to 16 rows: at most 96 registers, 5 blocks per SM (issue-bound with
// 4: 397 instead of 405 us at 8 rows, 463 instead of 487 at 16; 6 blocks
// spill and lose).
template <int kFmt, int NT, bool kDown>
__global__ void __launch_bounds__(kThreads, kFmt == kFmtInt4 && NT <= 2 ? 5 : 1) PackedMmaKernel(GroupedExpertArgs a, PackedSlots p) {
  constexpr int kRows = 8 * NT;  // rows per pass
  // 64-k chunks per stage: int8 4 KB of weights per warp in flight up to 16
  // rows, 2 KB above; int4 2 KB up to 32 rows, 1 KB above (the shared
  // buffers' bound). Measured on the H100 (bench/RESULTS.md, stop 19): more
  // costs int4 occupancy (8 chunks: 549 instead of 400 us at 8 rows).
  constexpr bool kBytes = kFmt != kFmtInt4;  // int8, fp8: a byte per weight
  constexpr int SC = kBytes ? (NT <= 2 ? 4 : 2) : (NT <= 4 ? 4 : 2);
  // int4 group scales: from 32 rows per pass multiplied into the bf16 weights
  // (rounded once: within 2^-9 of (n - 8) s), which spares rescaling each
  // chunk's sums per row (1159 instead of 1279 us at 64 rows, DeepSeek-V3);
  // below, applied to the chunk's f32 sums (the multiply per weight costs
  // more than it saves there: 420 instead of 410 us at 8 rows).
  constexpr bool kScaled = NT >= 4;
  // fp8: exact bf16 codes, the group scales applied to each chunk's sums.
  constexpr bool kPartSums = (kFmt == kFmtInt4 && !kScaled) || kFmt == kFmtFp8;
  constexpr int kStride = 64 * SC + 16;  // bf16 per shared row: + 16 makes the 8-byte reads conflict-free
  __shared__ __align__(16) bf16_t xs[2][kRows][kStride];
  __shared__ float up_out[kDown ? 1 : 2][NT][4][kWarp];
  const GroupDesc gd = a.groups[blockIdx.y];
  const int b = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarp, lane = tid % kWarp;
  const int gid = lane / 4, tig = lane % 4;
  const PackedLayout& l = p.layout;
  const int H = a.hidden, I = a.intermediate;
  const int N = kDown ? H : I, len = kDown ? I : H, Kp = kDown ? l.Ki : l.Kh;
  const uint8_t* base = p.packed + static_cast<size_t>(gd.buffer) * p.packed_stride;
  // This warp's matrix: down, channel block 4b + warp; gate/up, gate (even
  // warps) or up (odd) of channel block 2b + warp / 2.
  const int cb = kDown ? 4 * b + warp : 2 * b + warp / 2;
  const bool has = cb < (N + 15) / 16;
  const uint8_t* w = kDown ? base + l.gate_up_bytes + static_cast<size_t>(has ? cb : 0) * l.down_block
                           : base + static_cast<size_t>(2 * (has ? cb : 0) + warp % 2) * l.gate_up_block;
  constexpr int kLoads = kBytes ? 4 : 2;  // 8-byte weight loads per lane and chunk
  constexpr size_t kChunkBytes = kBytes ? 1024 : 512;
  const int chunks = Kp / 64, stages = (chunks + SC - 1) / SC;
  for (int pass = 0; pass < gd.count; pass += kRows) {
    // The pass's rows as 16-byte units of one stage's SC chunks, staged into xs[buf].
    auto stage = [&](int st, int buf) {
      for (int u = tid; u < kRows * 8 * SC; u += kThreads) {
        const int r = u / (8 * SC), q = u % (8 * SC), k = 64 * SC * st + 8 * q, row = gd.row_begin + pass + r;
        const int t = pass + r < gd.count ? a.token[row] : -1;
        const bf16_t* src = kDown ? a.act + static_cast<size_t>(row) * I + k : a.x + static_cast<size_t>(max(t, 0)) * H + k;
        const bool in = t >= 0 && k < len;  // len % 8 == 0: a unit is wholly in or out
        CopyAsync16(&xs[buf][r][8 * q], in ? src : a.x, in ? 16 : 0);
      }
      CopyAsyncCommit();
    };
    uint2 cur[SC][kLoads], next[SC][kLoads];
    float2 scur[SC], snext[SC];  // int4, fp8: each chunk's group scales of channels 2 gid, 2 gid + 1
    auto load = [&](int st, uint2 (&q)[SC][kLoads], float2 (&sc)[SC]) {
#pragma unroll
      for (int c = 0; c < SC; ++c) {
        const int ch = SC * st + c;
        const bool in = has && ch < chunks;
#pragma unroll
        for (int i = 0; i < kLoads; ++i)
          q[c][i] = in ? LoadStream8(w + static_cast<size_t>(ch) * kChunkBytes + (4 * i + tig) * 64 + 8 * gid)
                       : make_uint2(0, 0);
        if constexpr (kFmt == kFmtInt4 || kFmt == kFmtFp8) {
          const float* g = reinterpret_cast<const float*>(w + static_cast<size_t>(Kp) * (kBytes ? 16 : 8)) +
                           (64 * ch / l.group) * 16;
          sc[c] = in ? __ldg(reinterpret_cast<const float2*>(g + 2 * gid)) : make_float2(0.f, 0.f);
        }
      }
    };
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    stage(0, 0);
    load(0, cur, scur);
    for (int st = 0; st < stages; ++st) {
      if (st + 1 < stages) {
        stage(st + 1, (st + 1) & 1);
        load(st + 1, next, snext);
        CopyAsyncWait<1>();
      } else {
        CopyAsyncWait<0>();
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < SC; ++c) {
      const int ch = SC * st + c;
      if (ch >= chunks) break;
      const bf16_t(*xc)[kStride] = xs[st & 1];
      // int4: the chunk's group scales of channels 2 gid and 2 gid + 1, as bf16
      // pairs (kScaled) or applied to the chunk's sums `part` below.
      const __nv_bfloat162 gs0 = __floats2bfloat162_rn(scur[c].x, scur[c].x), gs1 = __floats2bfloat162_rn(scur[c].y, scur[c].y);
      float part[NT][4];
      if constexpr (kPartSums) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[j][e] = 0.f;
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t a0, a1, a2, a3;
        if constexpr (kFmt == kFmtInt8) {
          CodesToBf16x2<128>(cur[c][s].x ^ 0x80808080u, a0, a2);  // channel 2 gid
          CodesToBf16x2<128>(cur[c][s].y ^ 0x80808080u, a1, a3);  // channel 2 gid + 1
        } else if constexpr (kFmt == kFmtFp8) {  // exact codes / 256; 256 x the scales on the chunk's sums
          Fp8ToBf16x2(cur[c][s].x, a0, a2);
          Fp8ToBf16x2(cur[c][s].y, a1, a3);
        } else {
          const uint32_t w0 = cur[c][s / 2].x, w1 = cur[c][s / 2].y;
          if constexpr (kScaled) {
            if (s % 2 == 0) {
              ScaledNibblesToBf16x2<0>(w0, gs0, a0, a2);
              ScaledNibblesToBf16x2<0>(w1, gs1, a1, a3);
            } else {
              ScaledNibblesToBf16x2<4>(w0, gs0, a0, a2);
              ScaledNibblesToBf16x2<4>(w1, gs1, a1, a3);
            }
          } else if (s % 2 == 0) {
            NibblesToBf16x2<0>(w0, a0, a2);
            NibblesToBf16x2<0>(w1, a1, a3);
          } else {
            NibblesToBf16x2<4>(w0, a0, a2);
            NibblesToBf16x2<4>(w1, a1, a3);
          }
        }
        const int k = 64 * c + (kBytes ? 16 * s + 4 * tig : 32 * (s / 2) + 8 * tig + 4 * (s % 2));
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint2 xv = *reinterpret_cast<const uint2*>(&xc[8 * j + gid][k]);
          MmaBf16(kPartSums ? part[j] : acc[j], a0, a1, a2, a3, xv.x, xv.y);
        }
      }
      if constexpr (kPartSums) {
        const float s0 = kFmt == kFmtFp8 ? 256.f * scur[c].x : scur[c].x, s1 = kFmt == kFmtFp8 ? 256.f * scur[c].y : scur[c].y;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          acc[j][0] = fmaf(s0, part[j][0], acc[j][0]);
          acc[j][1] = fmaf(s0, part[j][1], acc[j][1]);
          acc[j][2] = fmaf(s1, part[j][2], acc[j][2]);
          acc[j][3] = fmaf(s1, part[j][3], acc[j][3]);
        }
      }
      }
#pragma unroll
      for (int c = 0; c < SC; ++c) {
#pragma unroll
        for (int i = 0; i < kLoads; ++i) cur[c][i] = next[c][i];
        scur[c] = snext[c];
      }
      __syncthreads();  // xs[st & 1] is staged again for stage st + 2
    }
    // C element e of lane l: mma row l/4 + 8 (e >= 2), i.e. channel 2 (l/4) + (e >= 2); row 2 (l%4) + (e & 1) of tile j.
    const float cs0 = has ? ChannelScale<kFmt>(w, Kp, 2 * gid) : 0.f, cs1 = has ? ChannelScale<kFmt>(w, Kp, 2 * gid + 1) : 0.f;
    if constexpr (!kDown) {
      if (warp % 2 == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) up_out[warp / 2][j][e][lane] = acc[j][e] * (e < 2 ? cs0 : cs1);
      }
      __syncthreads();
    }
    if (has && (kDown || warp % 2 == 0)) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = pass + 8 * j + 2 * tig + (e & 1), n = 16 * cb + 2 * gid + (e >= 2 ? 1 : 0);
          if (r >= gd.count || n >= N) continue;
          const int row = gd.row_begin + r, t = a.token[row];
          if (t < 0) continue;
          const float v = acc[j][e] * (e < 2 ? cs0 : cs1);
          if constexpr (kDown) {
            atomicAdd(a.accum + static_cast<size_t>(t) * H + n, a.weight[row] * v);
          } else {
            const float u = up_out[warp / 2][j][e][lane];
            a.act[static_cast<size_t>(row) * I + n] = ToBf16(v / (1.f + __expf(-v)) * u);
          }
        }
    }
    if constexpr (!kDown) __syncthreads();  // up_out is rewritten by the next pass
  }
}

template <int kFmt, int NT, bool kDown>
cudaError_t LaunchPackedMma(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  const int nblocks = ((kDown ? a.hidden : a.intermediate) + 15) / 16;
  const dim3 grid(kDown ? (nblocks + 3) / 4 : (nblocks + 1) / 2, a.num_groups);
  PackedMmaKernel<kFmt, NT, kDown><<<grid, kThreads, 0, s>>>(a, p);
  return cudaGetLastError();
}

// Rows per pass: 8, 16, 32 or 64 (the mma's n is 8 rows; fewer are padding).
template <int kFmt, bool kDown>
cudaError_t LaunchPackedMmaByRows(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t s) {
  if (a.max_count <= 8) return LaunchPackedMma<kFmt, 1, kDown>(a, p, s);
  if (a.max_count <= 16) return LaunchPackedMma<kFmt, 2, kDown>(a, p, s);
  if (a.max_count <= 32) return LaunchPackedMma<kFmt, 4, kDown>(a, p, s);
  return LaunchPackedMma<kFmt, 8, kDown>(a, p, s);
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
  const bool mma = a.max_count >= kPackedMmaMinRows && a.hidden % 8 == 0 && a.intermediate % 8 == 0;
  switch (p.layout.format) {
    case kFmtInt8:
      return mma ? LaunchPackedMmaByRows<kFmtInt8, kDown>(a, p, s) : LaunchPackedByRows<kFmtInt8, kDown>(a, p, s);
    case kFmtInt4:
      if (p.layout.group <= 0 || p.layout.group % 64 != 0) return cudaErrorInvalidValue;
      return mma ? LaunchPackedMmaByRows<kFmtInt4, kDown>(a, p, s) : LaunchPackedByRows<kFmtInt4, kDown>(a, p, s);
    case kFmtFp8:
      if (p.layout.group <= 0 || p.layout.group % 64 != 0) return cudaErrorInvalidValue;
      return mma ? LaunchPackedMmaByRows<kFmtFp8, kDown>(a, p, s) : LaunchPackedByRows<kFmtFp8, kDown>(a, p, s);
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
  if ((layout.format == kFmtInt4 || layout.format == kFmtFp8) && (layout.group <= 0 || layout.group % 64 != 0))
    return cudaErrorInvalidValue;
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
