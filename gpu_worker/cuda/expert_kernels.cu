// Kernels of the cuda backend; declared (with their contracts) in kernels.h.
//
// The grouped expert kernels are weight-streaming GEMVs: decode sends a few
// rows to each of many experts, so the work is bound by reading each expert's
// weights once from HBM. Each warp owns J output columns (rows of a weight
// matrix) of one group; its 32 lanes split the K dimension into 16-byte chunks,
// load the J weight rows once and apply every chunk to all M rows of the group
// (x rows come from L1/L2: they are shared by every warp of the group), then
// reduce across lanes with shuffles. Register arrays are indexed only with
// compile-time constants (M and J are template parameters), so nothing spills.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "gpu_worker/cuda/device_util.cuh"
#include "gpu_worker/cuda/kernels.h"

namespace moe::cuda {
namespace {

constexpr int kGemvWarps = 4;          // warps per block of the grouped kernels
constexpr int kGemvThreads = kGemvWarps * kWarp;


__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return static_cast<uint32_t>(ToBf16(lo)) | (static_cast<uint32_t>(ToBf16(hi)) << 16);
}

// A weight chunk: read exactly once per kernel (device_util.cuh).
__device__ __forceinline__ uint4 LoadWeight16(const bf16_t* p) { return LoadStream16(p); }

// 8 consecutive bf16 of a row of length K from column k (k % 8 == 0, k < K).
// kVec: one 16-byte load (K % 8 == 0, 16-byte aligned row). Otherwise element
// loads, zero past K.
template <bool kVec, bool kWeight>
__device__ __forceinline__ uint4 LoadChunk(const bf16_t* row, int k, int K) {
  if constexpr (kVec) {
    if constexpr (kWeight) {
      return LoadWeight16(row + k);
    } else {
      return __ldg(reinterpret_cast<const uint4*>(row + k));
    }
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = k + 2 * i < K ? row[k + 2 * i] : 0u;
      const uint32_t hi = k + 2 * i + 1 < K ? row[k + 2 * i + 1] : 0u;
      w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ float Dot8(const float (&x)[8], const uint4& w, float acc) {
  acc = fmaf(x[0], BfLo(w.x), acc);
  acc = fmaf(x[1], BfHi(w.x), acc);
  acc = fmaf(x[2], BfLo(w.y), acc);
  acc = fmaf(x[3], BfHi(w.y), acc);
  acc = fmaf(x[4], BfLo(w.z), acc);
  acc = fmaf(x[5], BfHi(w.z), acc);
  acc = fmaf(x[6], BfLo(w.w), acc);
  acc = fmaf(x[7], BfHi(w.w), acc);
  return acc;
}

// One warp: acc[m][r][j] = sum_k w[m][j][k] * xr[r][k] over k < K, for NMAT
// weight rows per column j and M input rows (rows with valid[r] false are
// skipped and yield 0). On return every lane holds the full sums.
template <int M, int J, int NMAT, bool kVec>
__device__ __forceinline__ void WarpGemv(const bf16_t* const (&w)[NMAT][J],
                                         const bf16_t* const (&xr)[M], const bool (&valid)[M],
                                         int K, int lane, float (&acc)[NMAT][M][J]) {
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) acc[m][r][j] = 0.f;

  const int chunks = (K + 7) / 8;
#pragma unroll 2
  for (int c = lane; c < chunks; c += kWarp) {
    const int k = c * 8;
    uint4 wv[NMAT][J];
#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
      for (int j = 0; j < J; ++j) wv[m][j] = LoadChunk<kVec, true>(w[m][j], k, K);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (!valid[r]) continue;  // warp-uniform
      const uint4 xv = LoadChunk<kVec, false>(xr[r], k, K);
      const float xf[8] = {BfLo(xv.x), BfHi(xv.x), BfLo(xv.y), BfHi(xv.y),
                           BfLo(xv.z), BfHi(xv.z), BfLo(xv.w), BfHi(xv.w)};
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < J; ++j) acc[m][r][j] = Dot8(xf, wv[m][j], acc[m][r][j]);
    }
  }

#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        float v = acc[m][r][j];
#pragma unroll
        for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
        acc[m][r][j] = v;
      }
}

// Where a thread of the grouped gemv kernels works: its block's group g,
// its lane, and the first of the J output columns its warp owns (block b
// handles group b / tiles and tile b % tiles of kGemvWarps * J columns).
struct GemvPlace {
  int g, lane, n0;
};
template <int J>
__device__ __forceinline__ GemvPlace PlaceOf(int tiles) {
  const int g = static_cast<int>(blockIdx.x) / tiles;
  const int tile = static_cast<int>(blockIdx.x) - g * tiles;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  return GemvPlace{g, static_cast<int>(threadIdx.x) % kWarp, (tile * kGemvWarps + warp) * J};
}

// Grid: num_groups * tiles blocks; block b handles group b / tiles and the
// kGemvWarps * J intermediate columns of tile b % tiles.
template <int M, int J, bool kVec>
__global__ void __launch_bounds__(kGemvThreads) GroupedGateUpKernel(GroupedExpertArgs a,
                                                                    int tiles) {
  const GemvPlace at = PlaceOf<J>(tiles);
  const int lane = at.lane, n0 = at.n0;
  const int H = a.hidden, I = a.intermediate;
  if (n0 >= I) return;  // whole warp; no block-level synchronization below
  const GroupDesc gd = a.groups[at.g];

  const bf16_t* gate = a.experts + static_cast<size_t>(gd.buffer) * a.expert_stride;
  const bf16_t* up = gate + static_cast<size_t>(I) * H;
  const ExpertEpilogue ep(a, gate);
  const bf16_t* w[2][J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const size_t n = static_cast<size_t>(min(n0 + j, I - 1));  // clamped; masked at the store
    w[0][j] = gate + n * H;
    w[1][j] = up + n * H;
  }

  for (int p = 0; p < gd.count; p += M) {
    const bf16_t* xr[M];
    bool valid[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const int t = p + r < gd.count ? a.token[gd.row_begin + p + r] : -1;
      valid[r] = t >= 0;
      xr[r] = a.x + static_cast<size_t>(max(t, 0)) * H;
    }
    float acc[2][M][J];
    WarpGemv<M, J, 2, kVec>(w, xr, valid, H, lane, acc);
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (lane == ((r * J + j) % kWarp) && valid[r] && n0 + j < I) {
          a.act[static_cast<size_t>(gd.row_begin + p + r) * I + n0 + j] = ToBf16(ep.Act(n0 + j, acc[0][r][j], acc[1][r][j]));
        }
      }
  }
}

// Grid as above over the H output columns; adds weight * (act . down) into
// the accumulator rows of the tokens.
template <int M, int J, bool kVec>
__global__ void __launch_bounds__(kGemvThreads) GroupedDownKernel(GroupedExpertArgs a,
                                                                  int tiles) {
  const GemvPlace at = PlaceOf<J>(tiles);
  const int lane = at.lane, n0 = at.n0;
  const int H = a.hidden, I = a.intermediate;
  if (n0 >= H) return;
  const GroupDesc gd = a.groups[at.g];

  const ExpertEpilogue ep(a, a.experts + static_cast<size_t>(gd.buffer) * a.expert_stride);
  const bf16_t* down = a.experts + static_cast<size_t>(gd.buffer) * a.expert_stride +
                       2 * static_cast<size_t>(I) * H;
  const bf16_t* w[1][J];
#pragma unroll
  for (int j = 0; j < J; ++j) w[0][j] = down + static_cast<size_t>(min(n0 + j, H - 1)) * I;

  for (int p = 0; p < gd.count; p += M) {
    const bf16_t* xr[M];
    bool valid[M];
    int tok[M];
    float wt[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const int row = gd.row_begin + p + r;
      tok[r] = p + r < gd.count ? a.token[row] : -1;
      valid[r] = tok[r] >= 0;
      wt[r] = valid[r] ? a.weight[row] : 0.f;
      xr[r] = a.act + static_cast<size_t>(valid[r] ? row : gd.row_begin) * I;
    }
    float acc[1][M][J];
    WarpGemv<M, J, 1, kVec>(w, xr, valid, I, lane, acc);
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if (lane == ((r * J + j) % kWarp) && valid[r] && n0 + j < H) {
          atomicAdd(a.accum + static_cast<size_t>(tok[r]) * H + n0 + j, wt[r] * ep.Down(n0 + j, acc[0][r][j]));
        }
      }
  }
}

// ---- tensor-core variant (H and I multiples of 8) -------------------------
//
// Same grid shape as above, but a block of kMmaWarps warps owns 16 output
// columns and its warps split K: warp w takes the 64-wide K blocks w, w + 4, ...
// (so a block reads 512 contiguous bytes of each of its 16 weight rows per
// step). Each step is four mma.sync.m16n8k16 (bf16 in, f32 accumulate) per
// 8 rows of the group: weights are the A operand (16 columns x 16 k), the
// group's rows the B operand (16 k x 8 rows).
//
// Loads are 16-byte vectors: within a 64-wide K block, lane (gid, tig) loads
// elements [8 tig, 8 tig + 8) and [32 + 8 tig, 40 + 8 tig) of weight rows gid
// and gid + 8 and of input row gid — 8 words — and feeds words 2s, 2s + 1 to
// k-step s, where the mma layout expects logical k = 16 s + {2 tig, 2 tig + 1}
// and {2 tig + 8, 2 tig + 9}. That is a permutation of k applied identically to
// A and B, and a dot product does not depend on the order of k. The partial sums of the
// warps meet in shared memory; the epilogue applies silu*mul (gate/up) or the
// weighted atomicAdd (down).
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * kWarp;
constexpr int kMmaCols = 16;  // output columns per block
constexpr int kMmaK = 64;     // K per warp step

// Word i (0..7) of 16 bf16 held as two uint4; i is a compile-time constant
// in every use (unrolled loops), so this folds to a register.
__device__ __forceinline__ uint32_t Word(const uint4 (&v)[2], int i) {
  const uint4& q = v[i / 4];
  switch (i % 4) {
    case 0: return q.x;
    case 1: return q.y;
    case 2: return q.z;
    default: return q.w;
  }
}

// Loads one 64-wide K block for lane (gid, tig): 16-byte chunks at k and
// k + 32 (k = block start + 8 tig, so the 4 lanes of a row read 64 contiguous
// bytes per instruction) of weight rows gid, gid + 8 of each matrix and of the
// lane's input rows. kTail: the block reaches past K (K % 8 == 0, so a chunk is
// wholly in or out); chunks past K, and rows that are not valid, read as zero.
template <int NMAT, int NT, bool kTail>
__device__ __forceinline__ void LoadMmaBlock(const bf16_t* const (&wrow)[NMAT][2],
                                             const bf16_t* const (&xrow)[NT],
                                             const bool (&xvalid)[NT], int k, int K,
                                             uint4 (&w)[NMAT][2][2], uint4 (&xv)[NT][2]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const bool in0 = !kTail || k < K, in1 = !kTail || k + 32 < K;
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[m][h][0] = in0 ? LoadWeight16(wrow[m][h] + k) : zero;
      w[m][h][1] = in1 ? LoadWeight16(wrow[m][h] + k + 32) : zero;
    }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xv[j][0] = xvalid[j] && in0 ? __ldg(reinterpret_cast<const uint4*>(xrow[j] + k)) : zero;
    xv[j][1] = xvalid[j] && in1 ? __ldg(reinterpret_cast<const uint4*>(xrow[j] + k + 32)) : zero;
  }
}

// Long: one kernel body (tile loop, fragment loads, MMA, epilogue) kept whole for the compiler's register allocation.
template <int NT, bool kDown>
__global__ void __launch_bounds__(kMmaThreads) GroupedMmaKernel(GroupedExpertArgs a, int tiles) {
  constexpr int NMAT = kDown ? 1 : 2;  // down, or gate and up
  __shared__ float red[kMmaWarps][NMAT][NT][4][kWarp];

  const int g = static_cast<int>(blockIdx.x) / tiles;
  const int tile = static_cast<int>(blockIdx.x) - g * tiles;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int gid = lane / 4, tig = lane % 4;
  const int H = a.hidden, I = a.intermediate;
  const int N = kDown ? H : I;
  const int K = kDown ? I : H;
  const int n0 = tile * kMmaCols;
  const GroupDesc gd = a.groups[g];

  const ExpertEpilogue ep(a, a.experts + static_cast<size_t>(gd.buffer) * a.expert_stride);
  const bf16_t* base = a.experts + static_cast<size_t>(gd.buffer) * a.expert_stride +
                       (kDown ? 2 * static_cast<size_t>(I) * H : 0);
  const bf16_t* wrow[NMAT][2];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[m][h] = base + static_cast<size_t>(m) * I * H +
                   static_cast<size_t>(min(n0 + gid + 8 * h, N - 1)) * K;  // clamped; masked
  const int kblocks = (K + kMmaK - 1) / kMmaK;

  for (int p = 0; p < gd.count; p += 8 * NT) {
    const bf16_t* xrow[NT];
    bool xvalid[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = p + 8 * j + gid;
      const int row = gd.row_begin + r;
      const int t = r < gd.count ? a.token[row] : -1;
      xvalid[j] = t >= 0;
      xrow[j] = kDown ? a.act + static_cast<size_t>(xvalid[j] ? row : gd.row_begin) * I
                      : a.x + static_cast<size_t>(max(t, 0)) * H;
    }
    float acc[NMAT][NT][4];
    ZeroSums(acc);

    const int kfull = K / kMmaK;  // blocks with no element past K
#pragma unroll 2
    for (int kb = warp; kb < kblocks; kb += kMmaWarps) {
      uint4 w[NMAT][2][2];
      uint4 xv[NT][2];
      if (kb < kfull) {
        LoadMmaBlock<NMAT, NT, false>(wrow, xrow, xvalid, kb * kMmaK + tig * 8, K, w, xv);
      } else {
        LoadMmaBlock<NMAT, NT, true>(wrow, xrow, xvalid, kb * kMmaK + tig * 8, K, w, xv);
      }
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
          for (int j = 0; j < NT; ++j)
            MmaBf16(acc[m][j], Word(w[m][0], 2 * s), Word(w[m][1], 2 * s),
                    Word(w[m][0], 2 * s + 1), Word(w[m][1], 2 * s + 1), Word(xv[j], 2 * s),
                    Word(xv[j], 2 * s + 1));
    }

#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][m][j][e][lane] = acc[m][j][e];
    __syncthreads();
    // C fragment element e of lane l: column gid(l) + 8 * (e >= 2), row 2 * tig(l) + (e & 1).
    for (int item = static_cast<int>(threadIdx.x); item < NT * 4 * kWarp; item += kMmaThreads) {
      const int j = item / (4 * kWarp), e = (item / kWarp) % 4, l = item % kWarp;
      const int col = n0 + l / 4 + (e >= 2 ? 8 : 0);
      const int r = p + 8 * j + 2 * (l % 4) + (e & 1);
      if (col >= N || r >= gd.count) continue;
      const int row = gd.row_begin + r;
      const int t = a.token[row];
      if (t < 0) continue;
      float v[NMAT];
#pragma unroll
      for (int m = 0; m < NMAT; ++m) {
        v[m] = 0.f;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) v[m] += red[w][m][j][e][l];
      }
      if constexpr (kDown) {
        atomicAdd(a.accum + static_cast<size_t>(t) * H + col, a.weight[row] * ep.Down(col, v[0]));
      } else {
        a.act[static_cast<size_t>(row) * I + col] = ToBf16(ep.Act(col, v[0], v[NMAT - 1]));
      }
    }
    __syncthreads();  // `red` is rewritten by the next pass
  }
}

template <int NT, bool kDown>
cudaError_t LaunchMma(const GroupedExpertArgs& a, cudaStream_t stream) {
  const int N = kDown ? a.hidden : a.intermediate;
  const int tiles = (N + kMmaCols - 1) / kMmaCols;
  GroupedMmaKernel<NT, kDown><<<a.num_groups * tiles, kMmaThreads, 0, stream>>>(a, tiles);
  return cudaGetLastError();
}

// Rows per pass: 8, 16, 32 or 64 (the mma's n is 8 rows; fewer rows are padding).
template <bool kDown>
cudaError_t MmaByRows(const GroupedExpertArgs& a, cudaStream_t s) {
  if (a.max_count <= 8) return LaunchMma<1, kDown>(a, s);
  if (a.max_count <= 16) return LaunchMma<2, kDown>(a, s);
  if (a.max_count <= 32) return LaunchMma<4, kDown>(a, s);
  return LaunchMma<8, kDown>(a, s);
}

// Rows per pass -> columns per warp. Fewer rows leave registers for more
// columns (more weight bytes in flight per warp).
template <int M>
constexpr int ColumnsPerWarp() {
  return M <= 4 ? 4 : 2;
}

template <int M, bool kVec>
cudaError_t LaunchGateUpM(const GroupedExpertArgs& a, cudaStream_t stream) {
  constexpr int J = ColumnsPerWarp<M>();
  const int tiles = (a.intermediate + kGemvWarps * J - 1) / (kGemvWarps * J);
  GroupedGateUpKernel<M, J, kVec><<<a.num_groups * tiles, kGemvThreads, 0, stream>>>(a, tiles);
  return cudaGetLastError();
}

template <int M, bool kVec>
cudaError_t LaunchDownM(const GroupedExpertArgs& a, cudaStream_t stream) {
  constexpr int J = ColumnsPerWarp<M>();
  const int tiles = (a.hidden + kGemvWarps * J - 1) / (kGemvWarps * J);
  GroupedDownKernel<M, J, kVec><<<a.num_groups * tiles, kGemvThreads, 0, stream>>>(a, tiles);
  return cudaGetLastError();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Dispatch on rows per pass: the smallest power of two >= max_count, at most
// kGroupedRowsPerPass.
template <bool kVec>
cudaError_t GateUpByRows(const GroupedExpertArgs& a, cudaStream_t s) {
  if (a.max_count <= 1) return LaunchGateUpM<1, kVec>(a, s);
  if (a.max_count <= 2) return LaunchGateUpM<2, kVec>(a, s);
  if (a.max_count <= 4) return LaunchGateUpM<4, kVec>(a, s);
  if (a.max_count <= 8) return LaunchGateUpM<8, kVec>(a, s);
  return LaunchGateUpM<kGroupedRowsPerPass, kVec>(a, s);
}

template <bool kVec>
cudaError_t DownByRows(const GroupedExpertArgs& a, cudaStream_t s) {
  if (a.max_count <= 1) return LaunchDownM<1, kVec>(a, s);
  if (a.max_count <= 2) return LaunchDownM<2, kVec>(a, s);
  if (a.max_count <= 4) return LaunchDownM<4, kVec>(a, s);
  if (a.max_count <= 8) return LaunchDownM<8, kVec>(a, s);
  return LaunchDownM<kGroupedRowsPerPass, kVec>(a, s);
}

int ElemwiseBlocks(size_t work) {
  const size_t blocks = (work + kElemwiseThreads - 1) / kElemwiseThreads;
  return static_cast<int>(std::min<size_t>(blocks, kMaxElemwiseBlocks));
}

template <bool kVec>
__global__ void GatherRowsKernel(const bf16_t* __restrict__ x, int H,
                                 const int32_t* __restrict__ token, int n,
                                 bf16_t* __restrict__ dst) {
  constexpr int kPer = kVec ? 8 : 1;
  const int per_row = H / kPer;
  const size_t total = static_cast<size_t>(n) * per_row;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = idx / per_row;
    const int c = static_cast<int>(idx - i * per_row) * kPer;
    const int t = token[i];
    if constexpr (kVec) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (t >= 0) v = __ldg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(t) * H + c));
      *reinterpret_cast<uint4*>(dst + i * H + c) = v;
    } else {
      dst[i * H + c] = t >= 0 ? x[static_cast<size_t>(t) * H + c] : bf16_t{0};
    }
  }
}

__global__ void ActivateKernel(const float* __restrict__ gu, int n, int I, ExpertActivation activation,
                               const float* __restrict__ bias, int bias_ld, bf16_t* __restrict__ act) {
  const size_t total = static_cast<size_t>(n) * I;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = idx / I;
    const size_t j = idx - r * I;
    float g = gu[r * 2 * I + j];
    float u = gu[r * 2 * I + I + j];
    if (bias != nullptr) g += bias[j], u += bias[bias_ld + j];
    act[idx] = ToBf16(ActivateGateUp(activation, g, u));
  }
}

__global__ void ScatterAddF32Kernel(const float* __restrict__ y, const int32_t* __restrict__ token,
                                    const float* __restrict__ weight, int n, int H,
                                    const float* __restrict__ bias, float* __restrict__ accum) {
  const size_t total = static_cast<size_t>(n) * H;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = idx / H;
    const int t = token[i];
    if (t < 0) continue;
    const size_t col = idx - i * H;
    atomicAdd(accum + static_cast<size_t>(t) * H + col, weight[i] * (bias != nullptr ? y[idx] + bias[col] : y[idx]));
  }
}

__global__ void ScatterAddBf16Kernel(const bf16_t* __restrict__ partial,
                                     const int32_t* __restrict__ rows, int n, int H,
                                     float* __restrict__ accum) {
  const size_t total = static_cast<size_t>(n) * H;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = idx / H;
    const size_t col = idx - i * H;
    const float v = __uint_as_float(static_cast<uint32_t>(partial[idx]) << 16);
    atomicAdd(accum + static_cast<size_t>(rows[i]) * H + col, v);
  }
}

// kVec: n % 8 == 0 and both pointers 16-byte aligned; 8 values per step.
template <bool kVec>
__global__ void AccumToBf16Kernel(const float* __restrict__ accum, size_t n,
                                  bf16_t* __restrict__ out) {
  const size_t steps = kVec ? n / 8 : n;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < steps;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if constexpr (kVec) {
      const float4 a = reinterpret_cast<const float4*>(accum)[2 * idx];
      const float4 b = reinterpret_cast<const float4*>(accum)[2 * idx + 1];
      reinterpret_cast<uint4*>(out)[idx] =
          make_uint4(PackBf16x2(a.x, a.y), PackBf16x2(a.z, a.w), PackBf16x2(b.x, b.y),
                     PackBf16x2(b.z, b.w));
    } else {
      out[idx] = ToBf16(accum[idx]);
    }
  }
}

}  // namespace

namespace {
// Up to this many rows per group the CUDA-core kernels stream the weights
// faster than the tensor-core ones. Measured on H100 with 32 DeepSeek-V3
// experts per launch pair (weight bytes / time): CUDA cores 3.04 TB/s at 1-2
// rows, 2.72 at 4, 1.39 at 8; tensor cores 2.94 at up to 8 rows, 2.90 at 16,
// 2.65 at 32, 1.76 at 64.
constexpr int kFfmaMaxRows = 2;

// The tensor-core kernels need every row of x, act and the weights to be
// 16-byte aligned: H and I multiples of 8 and aligned bases.
bool MmaApplies(const GroupedExpertArgs& a) {
  return a.hidden % 8 == 0 && a.intermediate % 8 == 0 && a.expert_stride % 8 == 0 &&
         Aligned16(a.experts) && Aligned16(a.x) && Aligned16(a.act);
}
}  // namespace

cudaError_t LaunchGroupedGateUp(const GroupedExpertArgs& a, cudaStream_t stream) {
  if (a.num_groups <= 0 || a.max_count <= 0 || a.intermediate <= 0 || a.hidden <= 0)
    return cudaSuccess;
  if (MmaApplies(a) && a.max_count > kFfmaMaxRows) return MmaByRows<false>(a, stream);
  const bool vec = a.hidden % 8 == 0 && a.expert_stride % 8 == 0 && Aligned16(a.experts) &&
                   Aligned16(a.x);
  return vec ? GateUpByRows<true>(a, stream) : GateUpByRows<false>(a, stream);
}

cudaError_t LaunchGroupedDown(const GroupedExpertArgs& a, cudaStream_t stream) {
  if (a.num_groups <= 0 || a.max_count <= 0 || a.intermediate <= 0 || a.hidden <= 0)
    return cudaSuccess;
  if (MmaApplies(a) && a.max_count > kFfmaMaxRows) return MmaByRows<true>(a, stream);
  const bool vec = a.intermediate % 8 == 0 && a.expert_stride % 8 == 0 &&
                   Aligned16(a.experts) && Aligned16(a.act);
  return vec ? DownByRows<true>(a, stream) : DownByRows<false>(a, stream);
}

cudaError_t LaunchGatherRows(const bf16_t* x, int hidden, const int32_t* token, int n, bf16_t* dst,
                             cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return cudaSuccess;
  const bool vec = hidden % 8 == 0 && Aligned16(x) && Aligned16(dst);
  const size_t work = static_cast<size_t>(n) * (vec ? hidden / 8 : hidden);
  if (vec) {
    GatherRowsKernel<true><<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(x, hidden, token,
                                                                                  n, dst);
  } else {
    GatherRowsKernel<false><<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(
        x, hidden, token, n, dst);
  }
  return cudaGetLastError();
}

cudaError_t LaunchActivate(const float* gu, int n, int intermediate, const ExpertActivation& activation,
                           const float* bias, int bias_ld, bf16_t* act, cudaStream_t stream) {
  if (n <= 0 || intermediate <= 0) return cudaSuccess;
  const size_t work = static_cast<size_t>(n) * intermediate;
  ActivateKernel<<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(gu, n, intermediate, activation, bias,
                                                                        bias_ld, act);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddF32(const float* y, const int32_t* token, const float* weight, int n,
                                int hidden, const float* bias, float* accum, cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return cudaSuccess;
  const size_t work = static_cast<size_t>(n) * hidden;
  ScatterAddF32Kernel<<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(y, token, weight, n,
                                                                             hidden, bias, accum);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddBf16(const bf16_t* partial, const int32_t* rows, int n, int hidden,
                                 float* accum, cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return cudaSuccess;
  const size_t work = static_cast<size_t>(n) * hidden;
  ScatterAddBf16Kernel<<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(partial, rows, n,
                                                                              hidden, accum);
  return cudaGetLastError();
}

cudaError_t LaunchAccumToBf16(const float* accum, size_t n, bf16_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = n % 8 == 0 && Aligned16(accum) && Aligned16(out);
  const size_t work = vec ? n / 8 : n;
  if (vec) {
    AccumToBf16Kernel<true><<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(accum, n, out);
  } else {
    AccumToBf16Kernel<false><<<ElemwiseBlocks(work), kElemwiseThreads, 0, stream>>>(accum, n, out);
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda
