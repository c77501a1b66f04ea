// The device-planned call's kernels (contracts in kernels.h, tables in
// gpu_worker/device_plan.h): the split of the routing into hit groups and
// per-server miss requests, the requests written into the servers'
// shared-memory slots and pushed on their device rings, and the bounded wait
// for the answers with their partial sums added into the accumulator.
//
// Host memory (the slot map and routes, the segments) is read with
// cache-volatile loads (__ldcv: fetched again every time; the host or the
// server changes it between and during calls) and written with plain stores
// ordered by __threadfence_system() before the store that publishes them (a
// ring's tail), as the server's acquire load of that tail expects. A read of
// host memory is a PCIe round trip (~1-2 us): the split issues the slot map
// and route reads of all pairs at once, and nothing else it reads lives
// there (the channels and the GPU's own ring indexes are in device memory).
#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "gpu_worker/cuda/device_util.cuh"
#include "gpu_worker/cuda/kernels.h"

namespace moe::cuda {
namespace {

constexpr int kPlanThreads = 512;    // one block splits the call
constexpr int kShipBlocksPerChannel = 8;
constexpr int kCopyBlocksPerExpert = 64;
constexpr int kShipThreads = 256;
// absl::StatusCode values the kernels report (status.h is host-only).
constexpr int kInvalidArgument = 3, kDeadlineExceeded = 4, kResourceExhausted = 8, kUnavailable = 14;

// RingHeader (transport/shm_segment.h): head at +0, tail at +64, entries at +128.
__device__ __forceinline__ volatile uint64_t* RingHead(uint64_t ring) { return reinterpret_cast<volatile uint64_t*>(ring); }
__device__ __forceinline__ volatile uint64_t* RingTail(uint64_t ring) { return reinterpret_cast<volatile uint64_t*>(ring + 64); }
__device__ __forceinline__ volatile uint32_t* RingEntries(uint64_t ring) {
  return reinterpret_cast<volatile uint32_t*>(ring + 128);
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// SlotHeader (shm_segment.h): request_id u64, layer, n_tokens, k u32, status_code i32, message_len u32.
struct SlotHeaderView {
  uint64_t request_id;
  uint32_t layer, n_tokens, k;
  int32_t status_code;
  uint32_t message_len;
};

// In-place exclusive prefix sum of data[0, n) in shared memory; returns the
// total. Every thread of the block must call it (it synchronizes).
__device__ int BlockExclusiveScan(int* data, int n, int* warp_sums, int* carry) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (threadIdx.x == 0) *carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int v = i < n ? data[i] : 0;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += y;
      }
      if (lane < nwarps) warp_sums[lane] = s;
    }
    __syncthreads();
    const int c = *carry;
    if (i < n) data[i] = c + (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
    __syncthreads();
    if (threadIdx.x == 0) *carry = c + warp_sums[nwarps - 1];
    __syncthreads();
  }
  return *carry;
}

// The first error of the block wins (code 0: none yet).
__device__ __forceinline__ void Fail(int* err_code, int* err_detail, int code, int detail) {
  if (atomicCAS(err_code, 0, code) == 0) *err_detail = detail;
}

// accum[t, :] = NaN: a token whose result cannot be complete is never silently wrong.
__device__ void Poison(float* accum, int t, int H, int from, int step) {
  for (int h = from; h < H; h += step) accum[static_cast<size_t>(t) * H + h] = __int_as_float(0x7fc00000);
}

// The split's working state: per-expert and per-pair arrays in dynamic
// shared memory (DevicePlanSharedBytes), the rest in static shared memory.
struct PlanState {
  int* cnt;    // [E] pairs per expert computed on the device (hits and copies)
  int* first;  // [E] first such pair
  int* begin;  // [E] first plan row of the expert's group
  int* fill;   // [E] rows placed so far; then the rank of a missed expert
  int* mcnt;   // [E] pairs per expert missed (for the CPU or a copy)
  int* kind;   // [P] buffer (>= 0: on the device), -1 to a server, -2 skipped
  int* ch;     // [P] route of a pair sent to a server (a bitmask of channels)
  int* scan;   // [P] scratch of the prefix sums
  int* scan2;  // [P]
  int* row;    // [C * T] token needs channel c -> its row in c's request
  int* warp_sums;  // [32]
  int* carry;
  int* err_code;
  int* err_detail;
  int* rows;       // [kMaxDeviceChannels] rows of each channel's request (< 0: failed)
  int* missed;     // distinct missed experts
  int* unroutable; // of them, those no server may take
  int* stats;      // [5] hit, server and copied pairs; copied and server experts (the routing log's)
  uint64_t* tail;  // [kMaxDeviceChannels] the request's ring index
  uint64_t* base;  // [kMaxDeviceChannels]
  DeviceChannel* chan;  // [kMaxDeviceChannels]
  int* copy_table;      // [kDeviceCopyTable]
};

// Zeroes the per-expert state and the hit groups; copies the channels and
// the GPU's ring indexes (a new segment starts them at 0) and the copy table.
__device__ void PlanInit(const DevicePlanArgs& a, PlanState& s) {
  const int tid = threadIdx.x, nt = blockDim.x, E = a.num_experts, C = a.num_channels;
  if (tid == 0) *s.err_code = *s.err_detail = *s.missed = *s.unroutable = 0;
  if (tid < 5) s.stats[tid] = 0;
  for (int e = tid; e < E; e += nt) {
    s.cnt[e] = s.fill[e] = s.mcnt[e] = 0;
    s.first[e] = INT_MAX;
  }
  for (int i = tid; i < C * a.T; i += nt) s.row[i] = 0;
  for (int g = tid; g < a.T * a.k; g += nt) a.groups[g] = GroupDesc{0, 0, 0, 0};
  for (int i = tid; i < kDeviceCopyTable; i += nt) s.copy_table[i] = a.copy_table != nullptr ? __ldcv(a.copy_table + i) : 0;
  if (tid < C) {
    s.chan[tid] = a.channels[tid];
    s.rows[tid] = 0;
    s.base[tid] = s.chan[tid].base;
    DeviceChannelState& st = a.channel_state[tid];
    if (st.generation != s.chan[tid].generation) {  // a new segment: its rings start at 0
      st.generation = s.chan[tid].generation;
      st.pushed = st.answered = 0;
    }
    s.tail[tid] = st.pushed;
  }
  __syncthreads();
}

// A route every channel of which is on (channel_of: a bitmask, <= 0 none).
__device__ bool Routable(int route, const PlanState& s, int C) {
  if (route <= 0 || route >= (1 << C)) return false;
  for (int c = 0; c < C; ++c)
    if ((route >> c & 1) && s.base[c] == 0) return false;
  return true;
}

// Each pair: on the device (its expert has a Ready slot), missed, or skipped
// (-1 ids; bad ids and weights poison the token). Counts every routed pair.
__device__ void ClassifyPairs(const DevicePlanArgs& a, PlanState& s) {
  const int P = a.T * a.k, E = a.num_experts;
  const bool log = a.tables.routing_log != nullptr && P <= a.tables.routing_log_pairs;
  if (log && threadIdx.x == 0) {
    a.tables.routing_log[0] = 0;  // being written
    __threadfence_system();
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = a.ids[p], t = p / a.k;
    const float w = a.weights[p];
    s.kind[p] = -2;
    if (log && (e == -1 || e < -1 || e >= E)) a.tables.routing_log[kRoutingLogHeader + p] = -1;
    if (e == -1) continue;  // no expert for this pair
    if (e < -1 || e >= E || !isfinite(w)) {
      Fail(s.err_code, s.err_detail, kInvalidArgument, e);
      Poison(a.accum, t, a.hidden, 0, 1);
      continue;
    }
    const int b = __ldcv(a.tables.buffer_of + e);
    const int c = __ldcv(a.tables.channel_of + e);  // issued with the slot map's read: one round trip
    if (b == kNotThisRank) {  // another rank of the group computes this pair
      if (log) a.tables.routing_log[kRoutingLogHeader + p] = -1;
      continue;
    }
    if (a.counts != nullptr) atomicAdd(a.counts + e, 1u);
    if (log) a.tables.routing_log[kRoutingLogHeader + p] = e;
    s.ch[p] = c;
    if (b >= 0) {
      s.kind[p] = b;
      atomicAdd(s.cnt + e, 1);
      atomicMin(s.first + e, p);
      atomicAdd(s.stats + 0, 1);  // hit pairs
    } else {
      s.kind[p] = -1;
      if (atomicAdd(s.mcnt + e, 1) == 0) atomicAdd(s.missed, 1);
      s.begin[e] = !Routable(c, s, a.num_channels);  // no server may take it (ChooseCopies)
    }
  }
  __syncthreads();
}

// Copy-instead: the planner's table says how many of the call's missed
// experts the device computes (copied from the host copy over the link while
// the servers work); those with the most pairs (then the lowest id) go, and
// an expert no server may take goes first. The rest go to their channel, or
// poison their token when there is none.
__device__ void ChooseCopies(const DevicePlanArgs& a, PlanState& s) {
  const int P = a.T * a.k, E = a.num_experts, C = a.num_channels;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (s.mcnt[e] > 0 && s.begin[e]) atomicAdd(s.unroutable, 1);
  __syncthreads();
  const int M = *s.missed;
  // The planner's count, and at least the experts no server may take (the
  // device is their failover).
  int n = max(s.copy_table[min(M, kDeviceCopyTable - 1)], *s.unroutable);
  n = a.host_experts != nullptr ? min(min(n, M), a.max_copies) : 0;
  // Rank of each missed expert: unroutable ones first, then by pairs, then id.
  auto key = [&](int x) {  // larger first
    return (static_cast<long long>(s.begin[x]) << 40) | (static_cast<long long>(s.mcnt[x]) << 20) | (E - x);
  };
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (s.mcnt[e] == 0) continue;
    const long long mine = key(e);
    int rank = 0;
    for (int x = 0; x < E; ++x) rank += s.mcnt[x] > 0 && key(x) > mine;
    s.fill[e] = rank;
    if (rank < n) a.copies[rank] = DeviceCopy{e, 0};
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    if (s.kind[p] != -1) continue;
    const int e = a.ids[p], t = p / a.k, rank = s.fill[e];
    if (rank < n) {  // computed on the device from a copy
      s.kind[p] = a.copy_buffer_base + rank;
      atomicAdd(s.cnt + e, 1);
      atomicMin(s.first + e, p);
      atomicAdd(s.stats + 2, 1);  // copied pairs
      continue;
    }
    const int route = s.ch[p];
    if (!Routable(route, s, C)) {
      Fail(s.err_code, s.err_detail, kUnavailable, e);
      Poison(a.accum, t, a.hidden, 0, 1);
      s.kind[p] = -2;
      continue;
    }
    for (int c = 0; c < C; ++c)  // every slice holder computes its share of the pair
      if (route >> c & 1) s.row[c * a.T + t] = 1;
    atomicAdd(s.stats + 1, 1);  // pairs sent to servers
  }
  if (threadIdx.x == 0) {
    *a.copy_count = n;
    s.stats[3] = n;
    s.stats[4] = M - n;  // experts sent to servers (or, with no route, poisoned)
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) s.fill[e] = 0;
  __syncthreads();
}

// The device's pairs (hits and copies): one group per expert, in order of
// first appearance, each group's rows with their tokens and weights.
__device__ void GroupOnDevice(const DevicePlanArgs& a, PlanState& s) {
  const int P = a.T * a.k;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const bool leader = s.kind[p] >= 0 && s.first[a.ids[p]] == p;
    s.scan[p] = leader ? 1 : 0;
    s.scan2[p] = leader ? s.cnt[a.ids[p]] : 0;
  }
  __syncthreads();
  BlockExclusiveScan(s.scan, P, s.warp_sums, s.carry);
  BlockExclusiveScan(s.scan2, P, s.warp_sums, s.carry);
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    if (s.kind[p] < 0) continue;
    const int e = a.ids[p];
    if (s.first[e] != p) continue;
    s.begin[e] = s.scan2[p];
    a.groups[s.scan[p]] = GroupDesc{s.kind[p], s.scan2[p], s.cnt[e], 0};
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    if (s.kind[p] < 0) continue;
    const int e = a.ids[p];
    const int row = s.begin[e] + atomicAdd(s.fill + e, 1);
    a.row_token[row] = p / a.k;
    a.row_weight[row] = a.weights[p];
  }
}

// Per channel, the tokens with a pair for it (in token order) become its
// request: routing rows (-1 where a pair is not the channel's) and header
// written into its next device slot; DeviceShip for the ship and combine
// kernels. A request that cannot go (too big, or every device slot still
// held by unanswered requests) poisons its tokens.
__device__ void BuildRequests(const DevicePlanArgs& a, PlanState& s) {
  const int tid = threadIdx.x, nt = blockDim.x, T = a.T, k = a.k, C = a.num_channels;
  for (int c = 0; c < C; ++c) {
    const int n = BlockExclusiveScan(s.row + c * T, T, s.warp_sums, s.carry);
    if (tid == 0) s.rows[c] = n;
  }
  __syncthreads();
  if (tid < C && s.rows[tid] > 0) {
    const DeviceChannel& ch = s.chan[tid];
    int code = 0;
    if (s.rows[tid] > static_cast<int>(ch.max_tokens) || k > static_cast<int>(ch.max_pairs)) {
      code = kResourceExhausted;  // the worker keeps capturable calls within a slot
    } else if (ch.device_slots == 0 || s.tail[tid] - a.channel_state[tid].answered >= ch.device_slots) {
      code = kUnavailable;  // earlier requests still unanswered hold every slot: the server stopped answering
    }
    if (code != 0) {
      Fail(s.err_code, s.err_detail, code, -1 - tid);
      s.rows[tid] = -s.rows[tid];  // poisoned below
    }
  }
  __syncthreads();
  for (int c = 0; c < C; ++c) {
    const int n = s.rows[c];
    if (n == 0) continue;
    const int* row = s.row + c * T;
    for (int t = tid; t < T; t += nt) {
      const int next = t + 1 < T ? row[t + 1] : (n > 0 ? n : -n);
      if (next == row[t]) continue;  // token t has no pair for c
      if (n < 0) {
        Poison(a.accum, t, a.hidden, 0, 1);
      } else {
        a.miss_token[c * T + row[t]] = t;
      }
    }
  }
  __syncthreads();
  for (int c = 0; c < C; ++c) {
    const int n = s.rows[c];
    if (n <= 0) continue;
    const DeviceChannel& ch = s.chan[c];
    const uint64_t index = s.tail[c];
    const uint32_t slot = ch.first_slot + static_cast<uint32_t>(index % ch.device_slots);
    const uint64_t sbase = s.base[c] + ch.slots_offset + static_cast<uint64_t>(slot) * ch.slot_stride;
    int32_t* ids = reinterpret_cast<int32_t*>(sbase + ch.ids_offset);
    float* weights = reinterpret_cast<float*>(sbase + ch.weights_offset);
    for (int i = tid; i < n * k; i += nt) {
      const int t = a.miss_token[c * T + i / k], p = t * k + i % k;
      const bool mine = s.kind[p] == -1 && (s.ch[p] >> c & 1);
      ids[i] = mine ? a.ids[p] : -1;
      weights[i] = mine ? a.weights[p] : 0.f;
    }
    if (tid == 0) {
      volatile SlotHeaderView* h = reinterpret_cast<volatile SlotHeaderView*>(sbase);
      h->request_id = index + 1;
      h->layer = static_cast<uint32_t>(a.layer);
      h->n_tokens = static_cast<uint32_t>(n);
      h->k = static_cast<uint32_t>(k);
      h->status_code = 0;
      h->message_len = 0;
      DeviceShip ship;
      ship.slot = sbase;
      ship.tokens = sbase + ch.tokens_offset;
      ship.output = sbase + ch.output_offset;
      ship.submit_ring = s.base[c] + ch.submit_ring;
      ship.complete_ring = s.base[c] + ch.complete_ring;
      ship.doorbell = s.base[c] + ch.doorbell;
      ship.ids = sbase + ch.ids_offset;
      ship.weights = sbase + ch.weights_offset;
      ship.index = index;
      ship.rows = n;
      ship.slot_index = slot;
      ship.num_slots = ch.num_slots;
      a.ships[c] = ship;
      a.channel_state[c].pushed = index + 1;
    }
  }
  if (tid < kMaxDeviceChannels && (tid >= C || s.rows[tid] <= 0)) a.ships[tid].rows = 0;
  __threadfence_system();  // the requests' rows and headers before the ship kernel publishes them
  __syncthreads();
}

__global__ void __launch_bounds__(kPlanThreads) DevicePlanKernel(DevicePlanArgs a) {
  extern __shared__ int smem[];
  const int P = a.T * a.k, E = a.num_experts;
  __shared__ int warp_sums[32], carry, err_code, err_detail, missed, unroutable, rows[kMaxDeviceChannels], stats[5];
  __shared__ int copy_table[kDeviceCopyTable];
  __shared__ uint64_t tail[kMaxDeviceChannels], base[kMaxDeviceChannels];
  __shared__ DeviceChannel chan[kMaxDeviceChannels];
  PlanState s;
  s.cnt = smem;
  s.first = s.cnt + E;
  s.begin = s.first + E;
  s.fill = s.begin + E;
  s.mcnt = s.fill + E;
  s.kind = s.mcnt + E;
  s.ch = s.kind + P;
  s.scan = s.ch + P;
  s.scan2 = s.scan + P;
  s.row = s.scan2 + P;
  s.warp_sums = warp_sums;
  s.carry = &carry;
  s.err_code = &err_code;
  s.err_detail = &err_detail;
  s.rows = rows;
  s.missed = &missed;
  s.unroutable = &unroutable;
  s.stats = stats;
  s.tail = tail;
  s.base = base;
  s.chan = chan;
  s.copy_table = copy_table;
  PlanInit(a, s);
  ClassifyPairs(a, s);
  ChooseCopies(a, s);
  GroupOnDevice(a, s);
  BuildRequests(a, s);
  if (threadIdx.x == 0 && a.tables.routing_log != nullptr && P <= a.tables.routing_log_pairs) {
    int32_t* log = a.tables.routing_log;
    log[1] = a.T;
    log[2] = a.k;
    for (int i = 0; i < 5; ++i) log[3 + i] = stats[i];
    __threadfence_system();
    log[0] = static_cast<int32_t>(atomicAdd(a.call_seq, 1u) % 0x7fffffffu) + 1;  // never 0
  }
  if (threadIdx.x == 0 && a.totals != nullptr) {  // device memory: no round trip over the link
    atomicAdd(a.totals, 1ull);
    for (int i = 0; i < 3; ++i) atomicAdd(a.totals + 1 + i, static_cast<unsigned long long>(stats[i]));
  }
  if (threadIdx.x == 0 && err_code != 0) {
    DeviceError* out = a.tables.errors;  // the split's record
    out->detail = err_detail;
    out->layer = a.layer;
    __threadfence_system();
    out->code = err_code;
  }
}

// The experts ChooseCopies picked, from the host copy over the link into
// their device buffers (packed formats) or the staging they are unpacked
// from (bf16): 16-byte loads through the mapping, many in flight per SM.
// One block's share (blockIdx.y of gridDim.y) of copying n 16-byte words.
__device__ void CopyFromHost(const uint4* src, uint4* dst, size_t n) {
  constexpr int kUnroll = 4;
  const size_t step = static_cast<size_t>(gridDim.y) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * step < n; i += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcv(src + i + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * step] = v[u];
  }
  for (; i < n; i += step) dst[i] = __ldcv(src + i);
}

__global__ void __launch_bounds__(kShipThreads) DeviceCopyKernel(DevicePlanArgs a) {
  const int j = blockIdx.x;
  if (j >= *a.copy_count) return;
  CopyFromHost(reinterpret_cast<const uint4*>(a.host_experts[a.copies[j].expert]),
               reinterpret_cast<uint4*>(a.copy_dst + j * a.copy_dst_stride), a.packed_bytes / 16);
}

__global__ void __launch_bounds__(kShipThreads) CopyFromHostKernel(const uint4* src, uint4* dst, size_t n) {
  CopyFromHost(src, dst, n);
}

// Copies each request's token rows into its slot, then the channel's last
// block publishes the slot on the device submit ring and rings the doorbell.
__global__ void __launch_bounds__(kShipThreads) DeviceShipKernel(DevicePlanArgs a) {
  const int c = blockIdx.x;
  const DeviceShip ship = a.ships[c];
  if (ship.rows <= 0) return;  // uniform per channel: every block of it returns
  const int H = a.hidden;
  bf16_t* dst = reinterpret_cast<bf16_t*>(ship.tokens);
  const bool vec = H % 8 == 0;
  for (int r = blockIdx.y; r < ship.rows; r += gridDim.y) {
    const bf16_t* src = a.x + static_cast<size_t>(a.miss_token[c * a.T + r]) * H;
    bf16_t* d = dst + static_cast<size_t>(r) * H;
    if (vec) {
      for (int i = threadIdx.x; i < H / 8; i += blockDim.x)
        reinterpret_cast<uint4*>(d)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
    } else {
      for (int i = threadIdx.x; i < H; i += blockDim.x) d[i] = src[i];
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(a.done + c, 1u) != gridDim.y - 1) return;
  a.done[c] = 0;  // the last block of the channel: publish
  __threadfence_system();
  RingEntries(ship.submit_ring)[ship.index & (ship.num_slots - 1)] = ship.slot_index;
  __threadfence_system();
  *RingTail(ship.submit_ring) = ship.index + 1;
  __threadfence_system();
  // The doorbell word changes so a server spinning on it looks at the rings
  // (it cannot wake a sleeping one: the server naps while the device rings
  // are in use). Any new value will do: no read back over PCIe.
  *reinterpret_cast<volatile uint32_t*>(ship.doorbell) = static_cast<uint32_t>(ship.index) * 2654435761u + 1u;
}

// accum[t] += w * FFN(x[t]) for the expert packed at `packed` in host memory
// (registered, read through the mapping), rows [i0, i1) of its intermediate
// dimension (a server's slice; 0, I: whole): the fallback when a server did
// not answer. One block per pair; every thread of the block calls it.
template <int kFmt>
__device__ void ExpertFromHost(const DevicePlanArgs& a, const uint8_t* packed, int t, float w, int i0, int i1,
                               float* act) {
  const int H = a.hidden;
  const PackedLayout& l = a.layout;
  const bf16_t* x = a.x + static_cast<size_t>(t) * H;
  // The expert's biases (a slice's request adds the down bias in slice 0 only, as the servers do).
  const float* bias = l.bias_bytes != 0 ? reinterpret_cast<const float*>(packed + l.bias_offset) : nullptr;
  for (int n = i0 + threadIdx.x; n < i1; n += blockDim.x) {
    const uint8_t* gate = packed + static_cast<size_t>(2 * (n / 16)) * l.gate_up_block;
    const uint8_t* up = gate + l.gate_up_block;
    float g = 0.f, u = 0.f;
    for (int k = 0; k < H; k += 8) {  // a padded block holds every group of 8
      float vg[8], vu[8];
      PackedValues8<kFmt>(gate, l.Kh, l.group, n % 16, k, vg);
      PackedValues8<kFmt>(up, l.Kh, l.group, n % 16, k, vu);
      for (int i = 0; i < 8 && k + i < H; ++i) {
        const float xv = __uint_as_float(static_cast<uint32_t>(x[k + i]) << 16);
        g = fmaf(vg[i], xv, g);
        u = fmaf(vu[i], xv, u);
      }
    }
    if (bias != nullptr) g += bias[n], u += bias[l.Ki + n];
    const float s = ActivateGateUp(a.activation, g, u);
    act[n - i0] = __uint_as_float(static_cast<uint32_t>(ToBf16(s)) << 16);  // bf16, as the expert kernels keep it
  }
  __syncthreads();
  for (int n = threadIdx.x; n < H; n += blockDim.x) {
    const uint8_t* down = packed + l.gate_up_bytes + static_cast<size_t>(n / 16) * l.down_block;
    float y = 0.f;
    for (int k = i0; k < i1; k += 8) {  // slices start at multiples of 64
      float v[8];
      PackedValues8<kFmt>(down, l.Ki, l.group, n % 16, k, v);
      for (int i = 0; i < 8 && k + i < i1; ++i) y = fmaf(v[i], act[k - i0 + i], y);
    }
    if (bias != nullptr && i0 == 0) y += bias[2 * l.Ki + n];
    atomicAdd(a.accum + static_cast<size_t>(t) * H + n, w * y);
  }
  __syncthreads();
}

// The pairs of channel c's request computed from the host copy, rows split
// over the channel's blocks (the fallback of a request nobody answered).
__device__ void RecomputeRequest(const DevicePlanArgs& a, const DeviceShip& ship, int c, float* act) {
  const DeviceChannel& ch = a.channels[c];
  const bool sliced = ch.slice_end > ch.slice_begin;
  const int i0 = sliced ? ch.slice_begin : 0, i1 = sliced ? min(ch.slice_end, a.intermediate) : a.intermediate;
  for (int r = blockIdx.y; r < ship.rows; r += gridDim.y) {
    const int t = a.miss_token[c * a.T + r];
    for (int j = 0; j < a.k; ++j) {
      const int e = __ldcv(reinterpret_cast<const int*>(ship.ids) + r * a.k + j);
      const float w = __ldcv(reinterpret_cast<const float*>(ship.weights) + r * a.k + j);
      if (e < 0 || e >= a.num_experts) continue;
      const uint8_t* packed = reinterpret_cast<const uint8_t*>(a.host_experts[e]);
      switch (a.layout.format) {
        case kFmtInt8: ExpertFromHost<kFmtInt8>(a, packed, t, w, i0, i1, act); break;
        case kFmtInt4: ExpertFromHost<kFmtInt4>(a, packed, t, w, i0, i1, act); break;
        case kFmtFp8: ExpertFromHost<kFmtFp8>(a, packed, t, w, i0, i1, act); break;
        default: ExpertFromHost<kFmtBf16>(a, packed, t, w, i0, i1, act); break;
      }
    }
  }
}

// Waits (bounded) for each request's answer and adds its rows into accum.
// A request nobody answered — the wait timed out, or the answer is
// UNAVAILABLE / DEADLINE_EXCEEDED (a draining server, a forwarder whose gRPC
// server missed its deadline or is down) — is computed here from the host
// copy when the call has one (detail -2: right, and slow); other errors, and
// no host copy, make the request's tokens NaN, and the channel's error record
// says why.
__global__ void __launch_bounds__(kShipThreads) DeviceCombineKernel(DevicePlanArgs a) {
  const int c = blockIdx.x;
  const DeviceShip ship = a.ships[c];
  if (ship.rows <= 0) return;
  const int H = a.hidden;
  __shared__ int state;  // 0 answered OK, else the error code
  __shared__ float act[kMaxFallbackIntermediate];  // the fallback's intermediate row
  const bool fallback = a.host_experts != nullptr && a.intermediate <= kMaxFallbackIntermediate;
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    state = 0;
    while (*RingTail(ship.complete_ring) <= ship.index) {
      if (GlobalTimerNs() - start > a.timeout_ns) {
        state = kDeadlineExceeded;
        break;
      }
      __nanosleep(100);
    }
    __threadfence_system();
    const bool answered = state == 0;
    if (answered) {
      const int status = __ldcv(reinterpret_cast<const int*>(ship.slot + 20));  // SlotHeader::status_code
      if (status != 0) state = status > 0 && status <= 16 ? status : kUnavailable;
      if (blockIdx.y == 0) {
        *RingHead(ship.complete_ring) = ship.index + 1;  // ours: the GPU is the only consumer
        a.channel_state[c].answered = ship.index + 1;
      }
    }
    if (state != 0 && blockIdx.y == 0) {
      DeviceError* out = a.tables.errors + 1 + c;
      out->detail = (state == kDeadlineExceeded || state == kUnavailable) && fallback ? -2
                    : !answered                                                      ? -1
                                                                                     : static_cast<int32_t>(ship.slot_index);
      out->layer = a.layer;
      __threadfence_system();
      out->code = state;
    }
  }
  __syncthreads();
  if ((state == kDeadlineExceeded || state == kUnavailable) && fallback) {
    RecomputeRequest(a, ship, c, act);
    return;
  }
  const bf16_t* out = reinterpret_cast<const bf16_t*>(ship.output);
  for (int r = blockIdx.y; r < ship.rows; r += gridDim.y) {
    const int t = a.miss_token[c * a.T + r];
    if (state != 0) {
      Poison(a.accum, t, H, threadIdx.x, blockDim.x);
      continue;
    }
    float* acc = a.accum + static_cast<size_t>(t) * H;
    const bf16_t* y = out + static_cast<size_t>(r) * H;
    if (H % 8 == 0) {
      for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
        const uint4 v = __ldcv(reinterpret_cast<const uint4*>(y) + i);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          atomicAdd(acc + 8 * i + 2 * j, BfLo(w[j]));
          atomicAdd(acc + 8 * i + 2 * j + 1, BfHi(w[j]));
        }
      }
    } else {
      for (int h = threadIdx.x; h < H; h += blockDim.x)
        atomicAdd(acc + h, __uint_as_float(static_cast<uint32_t>(__ldcv(reinterpret_cast<const unsigned short*>(y + h))) << 16));
    }
  }
}

}  // namespace

size_t DevicePlanSharedBytes(int T, int k, int num_experts, int num_channels) {
  return sizeof(int) * (5 * static_cast<size_t>(num_experts) + 4 * static_cast<size_t>(T) * k +
                        static_cast<size_t>(num_channels) * T);
}

cudaError_t LaunchDevicePlan(const DevicePlanArgs& a, cudaStream_t stream) {
  if (a.T <= 0 || a.k <= 0) return cudaSuccess;
  const size_t smem = DevicePlanSharedBytes(a.T, a.k, a.num_experts, a.num_channels);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(DevicePlanKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  DevicePlanKernel<<<1, kPlanThreads, smem, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (a.num_channels > 0) {
    DeviceShipKernel<<<dim3(a.num_channels, kShipBlocksPerChannel), kShipThreads, 0, stream>>>(a);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (a.max_copies > 0 && a.host_experts != nullptr) {
    DeviceCopyKernel<<<dim3(a.max_copies, kCopyBlocksPerExpert), kShipThreads, 0, stream>>>(a);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t LaunchCopyFromHost(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  if (bytes % 16 != 0) return cudaErrorInvalidValue;
  CopyFromHostKernel<<<dim3(1, kCopyBlocksPerExpert), kShipThreads, 0, stream>>>(static_cast<const uint4*>(src),
                                                                                static_cast<uint4*>(dst), bytes / 16);
  return cudaGetLastError();
}

cudaError_t LaunchDeviceCombine(const DevicePlanArgs& a, cudaStream_t stream) {
  if (a.T <= 0 || a.k <= 0 || a.num_channels == 0) return cudaSuccess;
  DeviceCombineKernel<<<dim3(a.num_channels, kShipBlocksPerChannel), kShipThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace moe::cuda
