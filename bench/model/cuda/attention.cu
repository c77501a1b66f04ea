// The cuda implementation of AttentionStep (gpu_worker/attention.h).
//
// Per Run, on the step's own stream:
//   RmsNormKernel        a = bf16(RMSNorm(h; g1))                       one block per token
//   cuBLAS GemmEx        qkv = Wqkv a          bf16 in, f32 out, f32 compute
//   RopeAppendKernel     RoPE on q (in place) and k; k, v -> bf16 KV cache at pos[t]
//   DecodeAttentionKernel o = softmax(q K / sqrt(hd)) V, bf16          one block per (token, kv
//   head,
//                        split of the positions); CombineSplitsKernel merges splits
//   cuBLAS GemmEx        y = Wo o
//   ResidualNormKernel   h = bf16(h + y); x = bf16(RMSNorm(h; g2))     one block per token
//   cuBLAS GemmEx        logits = Wr x
//   RouterTopKKernel     top-k of softmax(logits), renormalised         one warp per token
// then cudaStreamSynchronize. The weights are generated on the host by
// GenerateAttentionLayerWeights (the same numbers the cpu implementation
// uses) and uploaded once; the RoPE table is RopeTable's, uploaded once;
// PrefillCache writes PrefillKvValue on the device.
//
// KV cache layout: [layer][seq slot][kv head][position][head_dim] bf16, so a
// (token, kv head) reads one contiguous [max_seq, head_dim] run.
//
// Speed (H100, one qwen3-30b-a3b layer, context 1025, steady state, Run
// including its final synchronize; attention_test prints these): T=1 about
// 95 us, T=16 about 135 us, T=64 about 265 us. At small T the ~11 launches
// and the synchronize dominate (a CUDA graph per (T, split plan) would cut
// them); at T=64 the attention kernel takes about 200 us, bound by CUDA-core
// instruction issue, where tensor-core (mma) score and p V products would be
// the next step.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/model/attention.h"
#include "gpu_worker/cuda/device_util.cuh"
#include "bench/model/attention_weights.h"
#include "gpu_worker/cuda/cuda_check.h"

namespace moe {
namespace {

using cuda::ToBf16;

constexpr int kNormThreads = 256;  // RmsNormKernel, ResidualNormKernel, RopeAppendKernel
constexpr int kAttentionThreads =
    256;                            // DecodeAttentionKernel: threads per (token, kv head, split)
constexpr int kAttentionTile = 64;  // DecodeAttentionKernel: positions per shared-memory tile

__device__ __forceinline__ float LoadBf16(const bf16_t* p, size_t i) {
  return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, <= 1024); every
// thread gets the result. `scratch` holds 32 floats of shared memory.
__device__ float BlockSum(float v, float* scratch) {
  v = WarpSum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f;
  v = WarpSum(v);
  __syncthreads();  // scratch may be reused
  return v;
}

// out[t] = bf16(in[t] / rms(in[t]) * g), rows of H. Grid: T blocks.
__global__ void RmsNormKernel(const bf16_t* in, const bf16_t* g, int H, float eps, bf16_t* out) {
  __shared__ float scratch[32];
  const bf16_t* x = in + static_cast<size_t>(blockIdx.x) * H;
  bf16_t* y = out + static_cast<size_t>(blockIdx.x) * H;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = LoadBf16(x, i);
    ss += v * v;
  }
  ss = BlockSum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    y[i] = ToBf16(LoadBf16(x, i) * inv * LoadBf16(g, i));
}

// RoPE (rotate-half, table `rope` [max_seq, hd/2, 2] of cos, sin) on the q
// heads of qkv row t in place and on its k heads; k and v go to the layer's
// KV cache at pos[t]. Grid: T blocks.
__global__ void RopeAppendKernel(float* qkv, int qkv_n, const float* rope, const int32_t* pos,
                                 int num_heads, int num_kv_heads, int hd, int max_seq,
                                 bf16_t* k_cache, bf16_t* v_cache) {
  const int t = blockIdx.x, p = pos[t], half = hd / 2;
  float* row = qkv + static_cast<size_t>(t) * qkv_n;
  const float* rot = rope + static_cast<size_t>(p) * half * 2;
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
    const int head = j / half, i = j % half;
    float* x = row + static_cast<size_t>(head) * hd;  // k heads follow the q heads
    const float cs = rot[2 * i], sn = rot[2 * i + 1];
    const float x1 = x[i], x2 = x[i + half];
    const float r1 = x1 * cs - x2 * sn, r2 = x2 * cs + x1 * sn;
    if (head < num_heads) {
      x[i] = r1;
      x[i + half] = r2;
    } else {
      const int kvh = head - num_heads;
      bf16_t* dst = k_cache + ((static_cast<size_t>(t) * num_kv_heads + kvh) * max_seq + p) * hd;
      dst[i] = ToBf16(r1);
      dst[i + half] = ToBf16(r2);
    }
  }
  const float* v = row + static_cast<size_t>(num_heads + num_kv_heads) * hd;
  for (int j = threadIdx.x; j < num_kv_heads * hd; j += blockDim.x) {
    const int kvh = j / hd, d = j % hd;
    v_cache[((static_cast<size_t>(t) * num_kv_heads + kvh) * max_seq + p) * hd + d] = ToBf16(v[j]);
  }
}

// Where a split of DecodeAttentionKernel leaves its result when a (token,
// head) is split over several blocks: its running max m, sum l and the
// unnormalised accumulator acc[head_dim], merged by CombineSplitsKernel.
struct SplitPartials {
  float* m = nullptr;    // [T, num_heads, splits]
  float* l = nullptr;    // [T, num_heads, splits]
  float* acc = nullptr;  // [T, num_heads, splits, head_dim]
};

// DecodeAttentionKernel's limits and shared-memory layout. Rows of K, V and
// q are padded to hd8 = head_dim rounded up to 8 (zeros), so every thread
// works on whole 16-byte chunks of 8 values.
constexpr int kMaxGroup = 32;                                    // query heads per kv head
constexpr int kScoreSlots = kAttentionThreads / kAttentionTile;  // head slots in the score phase

struct AttentionLayout {
  int hd8 = 0;       // head_dim rounded up to 8
  int k_stride = 0;  // words per K row in shared memory (hd8 / 2, padded against bank conflicts)
  size_t bytes = 0;  // dynamic shared memory

  __host__ __device__ AttentionLayout(int group, int hd) {
    hd8 = (hd + 7) / 8 * 8;
    // 16-byte reads of 8 consecutive rows hit distinct banks when the row
    // stride is an odd number of 16-byte units.
    k_stride = hd8 / 2 + ((hd8 / 8) % 2 == 0 ? 4 : 0);
    bytes = sizeof(float) * floats(group) +
            sizeof(uint32_t) * kAttentionTile * (static_cast<size_t>(k_stride) + hd8 / 2);
  }
  // Floats before the K tile: q [group][hd8], scores [group][tile], m, l,
  // correction [group], rounded up to 16 bytes.
  __host__ __device__ size_t floats(int group) const {
    return (static_cast<size_t>(group) * (hd8 + kAttentionTile + 3) + 3) / 4 * 4;
  }
  // Head slots of the p V phase: 8-dim chunks x head slots cover the block.
  __host__ __device__ int out_slots() const { return kAttentionThreads / (hd8 / 8); }
};

// DecodeAttentionKernel's kHeads for a group: enough heads per thread for
// both phases, a power of two.
int AttentionHeadsPerThread(int group, int hd) {
  const AttentionLayout layout(group, hd);
  const int need = std::max((group + kScoreSlots - 1) / kScoreSlots,
                            (group + layout.out_slots() - 1) / layout.out_slots());
  int heads = 1;
  while (heads < need) heads *= 2;
  return heads;
}
static_assert(kMaxGroup / kScoreSlots <= 8, "LaunchDecodeAttention instantiates kHeads <= 8");

// The float of the low / high bf16 of a packed pair.
__device__ __forceinline__ float LowBf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float HighBf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Attention of token t = blockIdx.x for the `group` query heads sharing kv
// head g = blockIdx.y, over positions [z * chunk, min((z + 1) * chunk,
// pos[t] + 1)) of split z = blockIdx.z:
//   o[t, head] = softmax_p(q_head . K_p * scale) V_p
// written as bf16 to `o` when gridDim.z == 1, else as partials.
// The positions go through shared memory in tiles of kAttentionTile rows;
// each tile's K and V rows are read from the cache once for all heads of the
// group (GQA). Per tile:
//   scores   thread (row r = tid % tile, heads tid / tile + kScoreSlots j):
//            one 16-byte K read feeds 8 multiply-adds for each of its heads
//   softmax  one warp per head: running max m, sum l, and the factor that
//            rescales the earlier tiles' sums (online softmax)
//   o += p V thread (8-dim chunk, heads): one 16-byte V read feeds 8
//            multiply-adds per head; accumulators stay in registers
// kHeads (1, 2, 4 or 8) bounds the heads one thread handles in each phase;
// see AttentionHeadsPerThread.
// Long: one kernel whose phases (scores, softmax, weighted sum) share the
// block's registers and shared memory; split into functions it would spill them.
template <int kHeads>
__global__ void __launch_bounds__(kAttentionThreads)
    DecodeAttentionKernel(const float* qkv, int qkv_n, const bf16_t* k_cache, const bf16_t* v_cache,
                          const int32_t* pos, int num_heads, int num_kv_heads, int hd, int max_seq,
                          float scale, int chunk, bf16_t* o, SplitPartials partials) {
  extern __shared__ __align__(16) float smem[];
  const int group = num_heads / num_kv_heads;
  const AttentionLayout layout(group, hd);
  const int hd8 = layout.hd8, k_stride = layout.k_stride, words = hd / 2, words8 = hd8 / 2;
  const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kWarps = kAttentionThreads / 32;
  float* q_s = smem;                          // [group][hd8], pre-scaled
  float* p_s = q_s + group * hd8;             // [group][tile]
  float* m_s = p_s + group * kAttentionTile;  // [group]
  float* l_s = m_s + group;                   // [group]
  float* c_s = l_s + group;                   // [group]
  // K, V tiles start 16-byte aligned: round the float count up to 4.
  uint32_t* k_s = reinterpret_cast<uint32_t*>(smem + layout.floats(group));
  uint32_t* v_s = k_s + kAttentionTile * k_stride;  // [tile][words8]

  const float* q = qkv + static_cast<size_t>(t) * qkv_n + static_cast<size_t>(kvh) * group * hd;
  for (int i = tid; i < group * hd8; i += kAttentionThreads) {
    const int g = i / hd8, d = i % hd8;
    q_s[i] = d < hd ? q[g * hd + d] * scale : 0.0f;
  }
  for (int g = tid; g < group; g += kAttentionThreads) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.0f;
  }
  // The p V phase's share of this thread: 8-dim chunk `oc` of heads
  // oh + out_slots * j (threads past out_slots * chunks idle there).
  constexpr int kMaxScoreHeads = kHeads, kMaxOutHeads = kHeads;
  const int chunks = hd8 / 8, out_slots = layout.out_slots();
  const int oc = tid % chunks, oh = tid / chunks;
  float acc[kMaxOutHeads][8];
#pragma unroll
  for (int j = 0; j < kMaxOutHeads; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;

  const size_t base = (static_cast<size_t>(t) * num_kv_heads + kvh) * max_seq * hd;
  const uint32_t* K = reinterpret_cast<const uint32_t*>(k_cache + base);
  const uint32_t* V = reinterpret_cast<const uint32_t*>(v_cache + base);
  const int begin = split * chunk, end = min(pos[t] + 1, begin + chunk);

  for (int p0 = begin; p0 < end; p0 += kAttentionTile) {
    const int rows = min(kAttentionTile, end - p0);
    __syncthreads();  // the previous tile's K, V and p are no longer read
    // Copy the tile's rows; each thread keeps one column (a 16-byte chunk
    // when head_dim % 8 == 0, else a word) and steps over rows, so the loop
    // has no division and its loads are independent.
    if (hd == hd8) {
      const int cpr = hd8 / 8, c = tid % cpr, rstep = kAttentionThreads / cpr;
      const uint4* K4 = reinterpret_cast<const uint4*>(K);
      const uint4* V4 = reinterpret_cast<const uint4*>(V);
#pragma unroll 4
      for (int r = tid / cpr; r < kAttentionTile && tid < rstep * cpr; r += rstep) {
        const size_t at = static_cast<size_t>(p0 + r) * cpr + c;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        reinterpret_cast<uint4*>(k_s + r * k_stride)[c] = r < rows ? K4[at] : zero;
        reinterpret_cast<uint4*>(v_s + r * words8)[c] = r < rows ? V4[at] : zero;
      }
    } else {
      const int w = tid % words8, rstep = kAttentionThreads / words8;
#pragma unroll 4
      for (int r = tid / words8; r < kAttentionTile && tid < rstep * words8; r += rstep) {
        const bool in = r < rows && w < words;
        const size_t at = static_cast<size_t>(p0 + r) * words + w;
        k_s[r * k_stride + w] = in ? K[at] : 0u;
        v_s[r * words8 + w] = in ? V[at] : 0u;
      }
    }
    __syncthreads();

    // Scores of row r for heads sh + kScoreSlots * j; rows past the end are -inf.
    {
      const int r = tid % kAttentionTile, sh = tid / kAttentionTile;
      float s[kMaxScoreHeads];
#pragma unroll
      for (int j = 0; j < kMaxScoreHeads; ++j) s[j] = 0.0f;
      const uint4* kr = reinterpret_cast<const uint4*>(k_s + r * k_stride);
      for (int c = 0; c < chunks; ++c) {
        const uint4 kw = kr[c];
        const float k[8] = {LowBf16(kw.x), HighBf16(kw.x), LowBf16(kw.y), HighBf16(kw.y),
                            LowBf16(kw.z), HighBf16(kw.z), LowBf16(kw.w), HighBf16(kw.w)};
#pragma unroll
        for (int j = 0; j < kMaxScoreHeads; ++j) {
          const int g = sh + kScoreSlots * j;
          if (g < group) {
            const float4* qg = reinterpret_cast<const float4*>(q_s + g * hd8 + c * 8);
            const float4 a = qg[0], b = qg[1];
            s[j] += a.x * k[0] + a.y * k[1] + a.z * k[2] + a.w * k[3] + b.x * k[4] + b.y * k[5] +
                    b.z * k[6] + b.w * k[7];
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kMaxScoreHeads; ++j) {
        const int g = sh + kScoreSlots * j;
        if (g < group) p_s[g * kAttentionTile + r] = r < rows ? s[j] : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax per head; row 0 of the tile is valid, so m_new is finite.
    for (int g = warp; g < group; g += kWarps) {
      float* pg = p_s + g * kAttentionTile;
      float mx = -INFINITY;
      for (int r = lane; r < kAttentionTile; r += 32) mx = fmaxf(mx, pg[r]);
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = m_s[g], m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int r = lane; r < kAttentionTile; r += 32) {
        const float e = expf(pg[r] - m_new);  // 0 for rows past the end
        pg[r] = e;
        sum += e;
      }
      sum = WarpSum(sum);
      __syncwarp();  // every lane has read m_s[g] before lane 0 overwrites it
      if (lane == 0) {
        const float correction = expf(m_old - m_new);  // 0 on the first tile
        c_s[g] = correction;
        l_s[g] = l_s[g] * correction + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // acc[j] = acc[j] * correction + sum_r p[g, r] V[r, chunk oc], g = oh + out_slots * j.
    if (oh < out_slots) {
#pragma unroll
      for (int j = 0; j < kMaxOutHeads; ++j) {
        const int g = oh + out_slots * j;
        if (g < group) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] *= c_s[g];
        }
      }
      for (int r = 0; r < rows; ++r) {
        const uint4 vw = reinterpret_cast<const uint4*>(v_s + r * words8)[oc];
        const float v[8] = {LowBf16(vw.x), HighBf16(vw.x), LowBf16(vw.y), HighBf16(vw.y),
                            LowBf16(vw.z), HighBf16(vw.z), LowBf16(vw.w), HighBf16(vw.w)};
#pragma unroll
        for (int j = 0; j < kMaxOutHeads; ++j) {
          const int g = oh + out_slots * j;
          if (g < group) {
            const float p = p_s[g * kAttentionTile + r];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j][e] += p * v[e];
          }
        }
      }
    }
  }
  __syncthreads();
  // An empty split (a token with a shorter context than the longest) leaves
  // m = -inf, l = 0, acc = 0, which the combine weighs by exp(-inf) = 0.
  // Split 0 always holds position 0, so with one split l > 0.
  const size_t head0 = static_cast<size_t>(t) * num_heads + static_cast<size_t>(kvh) * group;
  if (splits > 1) {
    for (int g = tid; g < group; g += kAttentionThreads) {
      partials.m[(head0 + g) * splits + split] = m_s[g];
      partials.l[(head0 + g) * splits + split] = l_s[g];
    }
  }
  if (oh >= out_slots) return;
#pragma unroll
  for (int j = 0; j < kMaxOutHeads; ++j) {
    const int g = oh + out_slots * j;
    if (g >= group) continue;
    for (int e = 0; e < 8; ++e) {
      const int d = oc * 8 + e;
      if (d >= hd) break;
      if (splits == 1) {
        o[(head0 + g) * hd + d] = ToBf16(acc[j][e] / l_s[g]);
      } else {
        partials.acc[((head0 + g) * splits + split) * hd + d] = acc[j][e];
      }
    }
  }
}

// o[t, head] = the merge of the `splits` partials of (t = blockIdx.x, head =
// blockIdx.y). Split 0 is never empty, so the merged max is finite.
__global__ void CombineSplitsKernel(SplitPartials partials, int num_heads, int hd, int splits,
                                    bf16_t* o) {
  const size_t th = static_cast<size_t>(blockIdx.x) * num_heads + blockIdx.y;
  const float* m = partials.m + th * splits;
  const float* l = partials.l + th * splits;
  float m_all = m[0];
  for (int z = 1; z < splits; ++z) m_all = fmaxf(m_all, m[z]);
  float l_all = 0.0f;
  for (int z = 0; z < splits; ++z) l_all += l[z] * expf(m[z] - m_all);
  const float* acc = partials.acc + th * splits * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z)
      sum += acc[static_cast<size_t>(z) * hd + d] * expf(m[z] - m_all);
    o[th * hd + d] = ToBf16(sum / l_all);
  }
}

// How DecodeAttentionKernel splits a call's positions: few (token, kv head)
// pairs would leave most SMs idle, so each pair's positions are cut into
// `splits` chunks of `chunk` positions (a multiple of the tile), one block
// each, for about two blocks per SM.
constexpr int kMaxSplits = 32;

struct SplitPlan {
  int splits = 1;
  int chunk = 0;
};

SplitPlan PlanSplits(int pairs, int max_positions, int num_sms) {
  const int want = (2 * num_sms + pairs - 1) / pairs;
  const int tiles = (max_positions + kAttentionTile - 1) / kAttentionTile;
  const int splits = std::max(1, std::min({want, tiles, kMaxSplits}));
  SplitPlan plan;
  plan.chunk = (tiles + splits - 1) / splits * kAttentionTile;
  plan.splits = (max_positions + plan.chunk - 1) / plan.chunk;
  return plan;
}

// Partial slots ((token, head, split) triples) a SplitPlan can need with
// max_batch tokens: pairs * splits < pairs + 2 * num_sms for pairs = T *
// num_kv_heads, times `group` heads per pair.
size_t MaxSplitSlots(int max_batch, int num_heads, int num_kv_heads, int num_sms) {
  const size_t group = static_cast<size_t>(num_heads / num_kv_heads);
  return group * (static_cast<size_t>(max_batch) * num_kv_heads + 2 * static_cast<size_t>(num_sms));
}

// Launches DecodeAttentionKernel (and CombineSplitsKernel when split).
cudaError_t LaunchDecodeAttention(int T, int num_heads, const float* qkv, int qkv_n,
                                  const bf16_t* k_cache, const bf16_t* v_cache, const int32_t* pos,
                                  int num_kv_heads, int hd, int max_seq, float scale,
                                  const SplitPlan& plan, const SplitPartials& partials, bf16_t* o,
                                  cudaStream_t stream) {
  const int group = num_heads / num_kv_heads;
  const size_t smem = AttentionLayout(group, hd).bytes;
  const dim3 grid(T, num_kv_heads, plan.splits);
#define MOE_LAUNCH_DECODE_ATTENTION(HEADS)                                                        \
  DecodeAttentionKernel<HEADS><<<grid, kAttentionThreads, smem, stream>>>(                        \
      qkv, qkv_n, k_cache, v_cache, pos, num_heads, num_kv_heads, hd, max_seq, scale, plan.chunk, \
      o, partials)
  switch (AttentionHeadsPerThread(group, hd)) {
    case 1:
      MOE_LAUNCH_DECODE_ATTENTION(1);
      break;
    case 2:
      MOE_LAUNCH_DECODE_ATTENTION(2);
      break;
    case 4:
      MOE_LAUNCH_DECODE_ATTENTION(4);
      break;
    default:
      MOE_LAUNCH_DECODE_ATTENTION(8);
      break;
  }
#undef MOE_LAUNCH_DECODE_ATTENTION
  if (plan.splits > 1) {
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    CombineSplitsKernel<<<dim3(T, num_heads), 128, 0, stream>>>(partials, num_heads, hd,
                                                                plan.splits, o);
  }
  return cudaGetLastError();
}

// h[t] = bf16(h[t] + y[t]); x[t] = bf16(RMSNorm(h[t]) * g) from the stored
// bf16 h. Each thread re-reads only the elements it wrote. Grid: T blocks.
__global__ void ResidualNormKernel(bf16_t* h, const float* y, const bf16_t* g, int H, float eps,
                                   bf16_t* x) {
  __shared__ float scratch[32];
  bf16_t* ht = h + static_cast<size_t>(blockIdx.x) * H;
  const float* yt = y + static_cast<size_t>(blockIdx.x) * H;
  bf16_t* xt = x + static_cast<size_t>(blockIdx.x) * H;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const bf16_t stored = ToBf16(LoadBf16(ht, i) + yt[i]);
    ht[i] = stored;
    const float v = LoadBf16(&stored, 0);
    ss += v * v;
  }
  ss = BlockSum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    xt[i] = ToBf16(LoadBf16(ht, i) * inv * LoadBf16(g, i));
}

// RouterTopK's rule (attention_weights.h) for token t = blockIdx.x: one warp,
// logits staged in shared memory ([E] f32, then [E] taken flags).
__global__ void RouterTopKKernel(const float* logits, int E, int k, int32_t* ids, float* weights) {
  extern __shared__ float s_logits[];
  unsigned char* taken = reinterpret_cast<unsigned char*>(s_logits + E);
  __shared__ int s_chosen[32];
  const int t = blockIdx.x, lane = threadIdx.x;
  for (int e = lane; e < E; e += 32) {
    s_logits[e] = logits[static_cast<size_t>(t) * E + e];
    taken[e] = 0;
  }
  __syncwarp();
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY;
    int best_id = -1;
    for (int e = lane; e < E; e += 32) {  // ascending e: strict > keeps the lower id
      if (!taken[e] && (best_id < 0 || s_logits[e] > best)) {
        best = s_logits[e];
        best_id = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (other_id >= 0 && (best_id < 0 || other > best || (other == best && other_id < best_id))) {
        best = other;
        best_id = other_id;
      }
    }
    if (lane == 0) {
      s_chosen[j] = best_id;
      taken[best_id] = 1;
    }
    __syncwarp();
  }
  if (lane == 0) {
    const float top = s_logits[s_chosen[0]];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += expf(s_logits[s_chosen[j]] - top);
    for (int j = 0; j < k; ++j) {
      ids[static_cast<size_t>(t) * k + j] = s_chosen[j];
      weights[static_cast<size_t>(t) * k + j] = expf(s_logits[s_chosen[j]] - top) / sum;
    }
  }
}

// K/V cache positions [0, len) of slots [0, T) of every layer = PrefillKvValue.
__global__ void PrefillKernel(bf16_t* k_cache, bf16_t* v_cache, uint64_t seed, int num_layers,
                              int T, int num_kv_heads, int max_batch, int max_seq, int hd,
                              int len) {
  const size_t total = static_cast<size_t>(num_layers) * T * num_kv_heads * len * hd;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    size_t r = i;
    const int d = static_cast<int>(r % hd);
    r /= hd;
    const int p = static_cast<int>(r % len);
    r /= len;
    const int kvh = static_cast<int>(r % num_kv_heads);
    r /= num_kv_heads;
    const int t = static_cast<int>(r % T);
    r /= T;
    const int l = static_cast<int>(r);
    const size_t at =
        (((static_cast<size_t>(l) * max_batch + t) * num_kv_heads + kvh) * max_seq + p) * hd + d;
    k_cache[at] = ToBf16(PrefillKvValue(seed, l, 0, t, kvh, p, d));
    v_cache[at] = ToBf16(PrefillKvValue(seed, l, 1, t, kvh, p, d));
  }
}

class CudaAttentionStep final : public AttentionStep {
 public:
  explicit CudaAttentionStep(const AttentionConfig& c) : AttentionStep(c) {}

  ~CudaAttentionStep() override {
    // Best effort: errors while tearing down have nobody to report to.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* p : allocations_) cudaFree(p);
    if (pos_host_ != nullptr) cudaFreeHost(pos_host_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "cuda"; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }

  // Everything fallible of construction: stream, cuBLAS, weights, cache, scratch.
  absl::Status Init() {
    const AttentionConfig& c = config();
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(c.cuda_device));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
    MOE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));

    const size_t H = c.hidden, B = c.max_batch;
    const int threads = std::max(1u, std::thread::hardware_concurrency());
    layers_.resize(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l) {
      const AttentionLayerWeights w = GenerateAttentionLayerWeights(c, l, threads);
      LayerWeights& d = layers_[l];
      if (absl::Status st = Upload(w.attn_norm, &d.attn_norm); !st.ok()) return st;
      if (absl::Status st = Upload(w.wqkv, &d.wqkv); !st.ok()) return st;
      if (absl::Status st = Upload(w.wo, &d.wo); !st.ok()) return st;
      if (absl::Status st = Upload(w.moe_norm, &d.moe_norm); !st.ok()) return st;
      if (absl::Status st = Upload(w.router, &d.router); !st.ok()) return st;
    }
    const std::vector<float> rope = RopeTable(c);
    if (absl::Status st = Upload(rope, &rope_); !st.ok()) return st;

    const size_t kv_elems = static_cast<size_t>(c.num_layers) * B * c.max_seq * c.kv_dim();
    if (absl::Status st = Allocate(kv_elems, &k_cache_); !st.ok()) return st;
    if (absl::Status st = Allocate(kv_elems, &v_cache_); !st.ok()) return st;
    if (absl::Status st = Allocate(B * H, &a_); !st.ok()) return st;
    if (absl::Status st = Allocate(B * (c.q_dim() + 2 * c.kv_dim()), &qkv_); !st.ok()) return st;
    if (absl::Status st = Allocate(B * c.q_dim(), &o_); !st.ok()) return st;
    if (absl::Status st = Allocate(B * H, &y_); !st.ok()) return st;
    if (absl::Status st = Allocate(B * c.num_experts, &logits_); !st.ok()) return st;
    MOE_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, c.cuda_device));
    const size_t slots = MaxSplitSlots(c.max_batch, c.num_heads, c.num_kv_heads, num_sms_);
    // The attention kernel handles up to kMaxGroup query heads per kv head;
    // its shared memory grows with the group and head_dim.
    if (c.num_heads / c.num_kv_heads > kMaxGroup)
      return absl::InvalidArgumentError(absl::StrCat(
          "attention: the cuda backend supports num_heads / num_kv_heads <= ", kMaxGroup, ", not ",
          c.num_heads / c.num_kv_heads));
    const size_t smem = AttentionLayout(c.num_heads / c.num_kv_heads, c.head_dim).bytes;
    int smem_optin = 0;
    MOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
        &smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c.cuda_device));
    if (smem > static_cast<size_t>(smem_optin))
      return absl::InvalidArgumentError(
          absl::StrCat("attention: num_heads / num_kv_heads = ", c.num_heads / c.num_kv_heads,
                       " with head_dim ", c.head_dim, " needs ", smem,
                       " bytes of shared memory per block; the device has ", smem_optin));
    for (const void* kernel : {reinterpret_cast<const void*>(&DecodeAttentionKernel<1>),
                               reinterpret_cast<const void*>(&DecodeAttentionKernel<2>),
                               reinterpret_cast<const void*>(&DecodeAttentionKernel<4>),
                               reinterpret_cast<const void*>(&DecodeAttentionKernel<8>)}) {
      MOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    if (absl::Status st = Allocate(slots, &partials_.m); !st.ok()) return st;
    if (absl::Status st = Allocate(slots, &partials_.l); !st.ok()) return st;
    if (absl::Status st = Allocate(slots * c.head_dim, &partials_.acc); !st.ok()) return st;
    if (absl::Status st = Allocate(B, &pos_); !st.ok()) return st;
    MOE_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&pos_host_), B * sizeof(int32_t)));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 protected:
  absl::Status DoPrefillCache(int T, int len) override {
    const AttentionConfig& c = config();
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(c.cuda_device));
    const size_t total = static_cast<size_t>(c.num_layers) * T * c.num_kv_heads * len * c.head_dim;
    const int blocks = static_cast<int>(std::min<size_t>((total + 255) / 256, 8192));
    PrefillKernel<<<blocks, 256, 0, stream_>>>(k_cache_, v_cache_, c.seed, c.num_layers, T,
                                               c.num_kv_heads, c.max_batch, c.max_seq, c.head_dim,
                                               len);
    MOE_CUDA_RETURN_IF_LAUNCH_ERROR();
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status DoRun(int layer, int T, const int32_t* pos, bf16_t* h, bf16_t* moe_in,
                     int32_t* topk_ids, float* topk_weights) override {
    const AttentionConfig& c = config();
    const LayerWeights& w = layers_[layer];
    const int H = c.hidden, hd = c.head_dim;
    const int qkv_n = c.q_dim() + 2 * c.kv_dim();
    const size_t layer_kv = static_cast<size_t>(layer) * c.max_batch * c.max_seq * c.kv_dim();
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(c.cuda_device));

    std::memcpy(pos_host_, pos, static_cast<size_t>(T) * sizeof(int32_t));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pos_, pos_host_,
                                             static_cast<size_t>(T) * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream_));

    RmsNormKernel<<<T, kNormThreads, 0, stream_>>>(h, w.attn_norm, H, c.rms_eps, a_);
    MOE_CUDA_RETURN_IF_LAUNCH_ERROR();
    if (absl::Status st = Gemm(w.wqkv, qkv_n, H, a_, T, qkv_); !st.ok()) return st;
    RopeAppendKernel<<<T, kNormThreads, 0, stream_>>>(qkv_, qkv_n, rope_, pos_, c.num_heads,
                                                      c.num_kv_heads, hd, c.max_seq,
                                                      k_cache_ + layer_kv, v_cache_ + layer_kv);
    MOE_CUDA_RETURN_IF_LAUNCH_ERROR();
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    const int max_positions = *std::max_element(pos, pos + T) + 1;
    const SplitPlan plan = PlanSplits(T * c.num_kv_heads, max_positions, num_sms_);
    MOE_CUDA_RETURN_IF_ERROR(LaunchDecodeAttention(T, c.num_heads, qkv_, qkv_n, k_cache_ + layer_kv,
                                                   v_cache_ + layer_kv, pos_, c.num_kv_heads, hd,
                                                   c.max_seq, scale, plan, partials_, o_, stream_));
    if (absl::Status st = Gemm(w.wo, H, c.q_dim(), o_, T, y_); !st.ok()) return st;
    ResidualNormKernel<<<T, kNormThreads, 0, stream_>>>(h, y_, w.moe_norm, H, c.rms_eps, moe_in);
    MOE_CUDA_RETURN_IF_LAUNCH_ERROR();
    if (absl::Status st = Gemm(w.router, c.num_experts, H, moe_in, T, logits_); !st.ok()) return st;
    const size_t topk_smem = static_cast<size_t>(c.num_experts) * (sizeof(float) + 1);
    RouterTopKKernel<<<T, 32, topk_smem, stream_>>>(logits_, c.num_experts, c.top_k, topk_ids,
                                                    topk_weights);
    MOE_CUDA_RETURN_IF_LAUNCH_ERROR();
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  struct LayerWeights {
    bf16_t* attn_norm = nullptr;
    bf16_t* wqkv = nullptr;
    bf16_t* wo = nullptr;
    bf16_t* moe_norm = nullptr;
    bf16_t* router = nullptr;
  };

  // y[T, N] (f32) = x[T, K] (bf16) W[N, K]^T (bf16), row-major, f32 compute.
  // cuBLAS is column-major: y^T [N, T] = op(W)[N, K] x^T [K, T] with W read
  // transposed (its row-major [N, K] is a column-major [K, N]).
  absl::Status Gemm(const bf16_t* W, int N, int K, const bf16_t* x, int T, float* y) {
    const float alpha = 1.0f, beta = 0.0f;
    MOE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &alpha, W,
                                            CUDA_R_16BF, K, x, CUDA_R_16BF, K, &beta, y, CUDA_R_32F,
                                            N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  // Every allocation starts zeroed: the KV cache must (unwritten positions
  // read as zeros), and for scratch it keeps compute-sanitizer's initcheck
  // from flagging reads of buffers that cuBLAS's kernels wrote.
  template <typename T>
  absl::Status Allocate(size_t n, T** out) {
    void* p = nullptr;
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    allocations_.push_back(p);
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
    *out = static_cast<T*>(p);
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status Upload(const std::vector<T>& host, T** out) {
    if (absl::Status st = Allocate(host.size(), out); !st.ok()) return st;
    // On stream_, after Allocate's memset; synchronous, as `host` may go away.
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(*out, host.data(), host.size() * sizeof(T),
                                             cudaMemcpyHostToDevice, stream_));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::vector<void*> allocations_;  // freed on destruction
  std::vector<LayerWeights> layers_;
  float* rope_ = nullptr;      // [max_seq, hd/2, 2]
  bf16_t* k_cache_ = nullptr;  // [layer][seq][kv head][pos][hd]
  bf16_t* v_cache_ = nullptr;
  // Scratch of one call, max_batch rows each.
  bf16_t* a_ = nullptr;      // [B, H]
  float* qkv_ = nullptr;     // [B, q_dim + 2 kv_dim]
  bf16_t* o_ = nullptr;      // [B, q_dim]
  float* y_ = nullptr;       // [B, H]
  float* logits_ = nullptr;  // [B, E]
  SplitPartials partials_;   // MaxSplitSlots(B, ...) slots
  int num_sms_ = 1;
  int32_t* pos_ = nullptr;       // [B]
  int32_t* pos_host_ = nullptr;  // [B] pinned staging of pos
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionStep>> MakeCudaAttentionStep(
    const AttentionConfig& config) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return absl::FailedPreconditionError(
        absl::StrCat("attention: cuda backend unavailable: no usable GPU (cudaGetDeviceCount: ",
                     err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")"));
  }
  if (config.cuda_device < 0 || config.cuda_device >= count)
    return absl::FailedPreconditionError(absl::StrCat(
        "attention: cuda_device = ", config.cuda_device, " but ", count, " device(s) are visible"));
  auto step = std::make_unique<CudaAttentionStep>(config);
  if (absl::Status st = step->Init(); !st.ok()) return st;
  return std::unique_ptr<AttentionStep>(std::move(step));
}

}  // namespace moe
