// Entry points of the cuda backend's kernels (gpu_worker/cuda/expert_kernels.cu,
// packed_kernels.cu, device_plan.cu).
// The one place device code is declared: each function is host-callable,
// enqueues its kernel(s) on `stream` and returns the launch's cudaError_t
// (cudaSuccess when there is nothing to do). None of them synchronizes.
//
// Data conventions, shared by every launcher:
//   - bf16 values are raw uint16_t (core/bf16.h); accumulation is in f32.
//   - An expert buffer holds gate [I,H], up [I,H], down [H,I], row-major bf16,
//     back to back (the layout LoadExpert copies verbatim), and, for a model
//     whose experts carry biases, their f32 biases from byte
//     Bf16BiasOffset(H, I) on, laid out as in a packed expert (gate [Ki], up
//     [Ki], down [Hn]; expert_compute/expert_kernel.h). Buffers lie
//     `expert_stride` elements apart; every buffer starts 256-byte aligned.
//   - Every expert kernel ends in the model's epilogue (ExpertEpilogue,
//     device_util.cuh): act = ActivateGateUp(activation, g + bg, u + bu)
//     (core/expert_activation.h) and down's y + bd before the routing weight.
//   - A "token" of -1 marks a padding row: it is read as zeros and never
//     written or accumulated.
//   - Any H and I are accepted. When a row length is a multiple of 8 the
//     kernels read 16-byte vectors, otherwise they fall back to element loads.
//   - `host-mapped` destinations may be device pointers of registered host
//     memory (cudaHostRegisterMapped); the kernels only store to them.
//
// Thread-safety: the launchers are stateless; stream order is the caller's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "core/expert_activation.h"
#include "gpu_worker/device_plan.h"

namespace moe::cuda {

// One expert group of a hit plan handled by the grouped (GEMV-style) kernels:
// rows [row_begin, row_begin + count) of the plan, all through expert buffer
// `buffer`. 16 bytes, so an array of them uploads as one block.
struct GroupDesc {
  int32_t buffer;
  int32_t row_begin;
  int32_t count;
  int32_t reserved;
};

// What the grouped expert kernels read and write.
struct GroupedExpertArgs {
  const bf16_t* experts = nullptr;  // buffer 0; buffer b at experts + b * expert_stride
  size_t expert_stride = 0;         // elements between buffers
  int hidden = 0;                   // H
  int intermediate = 0;             // I
  const GroupDesc* groups = nullptr;  // [num_groups], device
  int num_groups = 0;
  int max_count = 0;                // max over groups[].count (picks the rows-per-pass variant)
  const int32_t* token = nullptr;   // [plan rows], device; -1 = padding
  const float* weight = nullptr;    // [plan rows], device
  const bf16_t* x = nullptr;        // [T, H] activations of the call
  bf16_t* act = nullptr;            // [plan rows, I] intermediate, indexed by plan row
  float* accum = nullptr;           // [T, H] f32 accumulator
  // false: num_groups only bounds the groups (a device-planned call's, most
  // of them empty); the packed kernels then keep their full occupancy.
  bool exact_groups = true;
  // The experts' math: the activation, and where a buffer's (or packed
  // slot's) f32 biases start, bias_offset bytes from its start (0: the
  // experts have none): gate [bias_ld], up from bias_ld, down from 2 bias_ld.
  ExpertActivation activation;
  size_t bias_offset = 0;
  int bias_ld = 0;
};

// The byte offset of a bf16 expert buffer's biases: after its three
// matrices, 16-byte aligned.
MOE_HOST_DEVICE inline constexpr size_t Bf16BiasOffset(int hidden, int intermediate) {
  return (3 * static_cast<size_t>(hidden) * intermediate * sizeof(bf16_t) + 15) / 16 * 16;
}

// Experts in the CPU server's packed layout (expert_compute/expert_kernel.h:
// 16-channel blocks, gate and up blocks interleaved, then down's blocks; the
// byte formats (int8, int4, fp8, mxfp4) carry their scales in each block). A quantized GPU cache
// keeps its slots in this layout, byte for byte what the host copy holds, so
// a copy is one memcpy of the packed bytes. Filled from ExpertGeometry by the
// backend (kernels.h stays free of the CPU headers).
struct PackedLayout {
  int format = 0;  // WeightFormat: 0 bf16, 1 int8, 2 int4, 3 fp8, 4 mxfp4
  int group = 0;   // int4, fp8: k per scale group (a multiple of 64); mxfp4: 32
  int Kh = 0, Ki = 0;          // padded K of gate/up and of down
  size_t gate_up_block = 0;    // bytes of one gate (or up) block, K = Kh
  size_t down_block = 0;       // bytes of one down block, K = Ki
  size_t gate_up_bytes = 0;    // offset of down's first block
  size_t bias_offset = 0;      // offset of the f32 biases (ExpertGeometry::bias), when bias_bytes > 0
  size_t bias_bytes = 0;       // 0: the experts carry no biases
};

// Packed experts computed by the grouped packed kernels: slot b at
// packed + b * packed_stride bytes (256-byte aligned).
struct PackedSlots {
  const uint8_t* packed = nullptr;
  size_t packed_stride = 0;
  PackedLayout layout;
};

// Rows per pass of the CUDA-core grouped kernels (used for groups of at most
// 4 rows, and for any group when H or I is not a multiple of 8). The
// tensor-core variant takes up to 64 rows per pass. Bigger groups still work
// (the kernels loop over passes, re-reading the expert's weights each pass)
// but the backend sends them to cuBLAS.
inline constexpr int kGroupedRowsPerPass = 16;

// act[r, :] = bf16(silu(x[token[r]] . gate^T) * (x[token[r]] . up^T)) for every
// non-padding row r of every group. One launch covers all groups: the grid runs
// over (group, tile of intermediate columns); the weights are streamed once per
// pass with 16-byte loads and applied to all rows of the group — on CUDA cores
// for up to 4 rows, through mma.sync (bf16 in, f32 accumulate) above that.
cudaError_t LaunchGroupedGateUp(const GroupedExpertArgs& a, cudaStream_t stream);

// accum[token[r], :] += weight[r] * (act[r, :] . down^T) for every non-padding
// row r of every group (atomicAdd: several experts may add into one token).
cudaError_t LaunchGroupedDown(const GroupedExpertArgs& a, cudaStream_t stream);

// The grouped kernels for int8 / int4 / fp8 / mxfp4 packed experts: the same contract as
// LaunchGroupedGateUp / LaunchGroupedDown (a.experts and a.expert_stride are
// unused; `p` names the packed slots). Weights are read in their packed form
// and dequantized in registers; activations stay bf16 (not quantized); f32
// accumulation. When H and I are multiples of 8 the codes become bf16 pairs
// for mma.sync tensor cores, 8 to 64 rows per pass (one row included: at one
// row the tensor-core kernel streams the weights faster than the CUDA-core
// one: DeepSeek-V3 int4 299 vs 339 us per 32 experts on the H100);
// otherwise CUDA cores compute
// code * scale . x for up to kPackedRowsPerPass rows per pass. Bigger groups
// loop, re-reading the weights; the backend sends groups above its threshold
// (cuda_backend.cu: kPackedGemmMinRows) to cuBLAS after LaunchUnpackExpert.
inline constexpr int kPackedRowsPerPass = 8;
cudaError_t LaunchPackedGateUp(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t stream);
cudaError_t LaunchPackedDown(const GroupedExpertArgs& a, const PackedSlots& p, cudaStream_t stream);

// dst = one packed expert (any format of `layout`) as row-major bf16 gate
// [I,H], up [I,H], down [H,I] (the layout of a bf16 slot and of cuBLAS's
// operands), and its biases (layout.bias_bytes) from byte Bf16BiasOffset(H,
// I): the repack after a bf16 copy of the server's packed bytes, and the
// dequantization of an int8 / int4 slot for a big group.
cudaError_t LaunchUnpackExpert(const uint8_t* packed, const PackedLayout& layout, int hidden,
                               int intermediate, bf16_t* dst, cudaStream_t stream);
// The same for the first *count (device memory, read at run time) of
// max_count bf16 experts: expert j from packed + j * packed_stride bytes into
// dst + j * dst_stride values (the device-planned call's copies).
cudaError_t LaunchUnpackExperts(const uint8_t* packed, size_t packed_stride, const PackedLayout& layout, int hidden,
                                int intermediate, bf16_t* dst, size_t dst_stride, const int* count, int max_count,
                                cudaStream_t stream);

// dst[i, :] = x[token[i], :] for i < n (zeros where token[i] == -1); dst is
// [n, H] with row stride H, device or host-mapped memory.
cudaError_t LaunchGatherRows(const bf16_t* x, int hidden, const int32_t* token, int n,
                             bf16_t* dst, cudaStream_t stream);

// act[r, j] = bf16(ActivateGateUp(activation, gu[r, j] + bg[j], gu[r, I + j] + bu[j]))
// for r < n, j < I, where gu is the f32 [n, 2I] output of one GEMM over the
// stacked [gate; up] matrix; bias (device, may be null: no biases) holds bg
// [bias_ld] then bu.
cudaError_t LaunchActivate(const float* gu, int n, int intermediate, const ExpertActivation& activation,
                           const float* bias, int bias_ld, bf16_t* act, cudaStream_t stream);

// accum[token[i], :] += weight[i] * (y[i, :] + bias) for i < n with token[i]
// >= 0; y is f32 [n, H], bias [H] (device; null: none).
cudaError_t LaunchScatterAddF32(const float* y, const int32_t* token, const float* weight, int n,
                                int hidden, const float* bias, float* accum, cudaStream_t stream);

// accum[rows[i], :] += partial[i, :] for i < n; partial is bf16 [n, H].
cudaError_t LaunchScatterAddBf16(const bf16_t* partial, const int32_t* rows, int n, int hidden,
                                 float* accum, cudaStream_t stream);

// out[i] = bf16(accum[i]) for i < n; out may be host-mapped.
cudaError_t LaunchAccumToBf16(const float* accum, size_t n, bf16_t* out, cudaStream_t stream);

// ---- the device-planned call (gpu_worker/cuda/device_plan.cu) --------------
// One request a call ships to one channel (device scratch, per channel,
// written by the split for the ship and combine kernels): device addresses of
// its slot and of the channel's rings, its position on them, `rows` its
// tokens (0: nothing shipped).
struct DeviceShip {
  uint64_t slot;           // the slot's header
  uint64_t tokens;         // its token rows
  uint64_t output;         // its output rows
  uint64_t submit_ring, complete_ring, doorbell;  // the channel's (device addresses)
  uint64_t ids, weights;   // the request's routing rows in its slot
  uint64_t index;          // the request's position on the device rings
  int32_t rows;
  uint32_t slot_index;
  uint32_t num_slots;
  uint32_t reserved;
};

// What the GPU keeps per channel between calls (device memory, zero at
// start): requests pushed and answers seen on the channel's current segment
// (`generation`; both restart at 0 with a new one). The GPU is the device
// rings' only producer and consumer on the worker's side, so it never reads
// its own indexes back from host memory.
// An expert the split chose to compute on the device (copy-instead).
struct DeviceCopy {
  int32_t expert;
  int32_t reserved;
};

struct DeviceChannelState {
  uint64_t pushed;
  uint64_t answered;
  uint32_t generation;
  uint32_t reserved;
};

// Everything the three kernels of one call read and write. Device scratch is
// the call site's (sized for T x k); tables and channels are host-mapped.
struct DevicePlanArgs {
  int T = 0, k = 0, hidden = 0, num_experts = 0, layer = 0, num_channels = 0;
  const int32_t* ids = nullptr;      // [T, k] the engine's routing (device)
  const float* weights = nullptr;    // [T, k]
  const bf16_t* x = nullptr;         // [T, H] activations (device)
  DeviceLayerTables tables;          // the layer's slot map, routes and error records
  const DeviceChannel* channels = nullptr;  // [num_channels] (device memory: DeviceBackend::SetDeviceChannels)
  DeviceChannelState* channel_state = nullptr;  // [kMaxDeviceChannels] (device)
  unsigned int* counts = nullptr;    // [num_experts] routed pairs per expert, accumulated (device; may be null)
  unsigned long long* totals = nullptr;  // [kDeviceTotals] the site's calls and their split, accumulated (device; may be null)
  unsigned int* call_seq = nullptr;  // the site's calls (device): the routing log's sequence
  GroupDesc* groups = nullptr;       // [T*k] the hit groups (count 0 past the last)
  int32_t* row_token = nullptr;      // [T*k] token of each hit row
  float* row_weight = nullptr;       // [T*k]
  int32_t* miss_token = nullptr;     // [kMaxDeviceChannels * T] token of each request row
  DeviceShip* ships = nullptr;       // [kMaxDeviceChannels]
  unsigned int* done = nullptr;      // [kMaxDeviceChannels] zero at rest (the ship kernel resets it)
  float* accum = nullptr;            // [T, H] zeroed before LaunchDevicePlan; NaN rows on errors
  uint64_t timeout_ns = 0;           // how long LaunchDeviceCombine waits for an answer
  // Copy-instead (max_copies 0 or host_experts null: none): the table the
  // planner publishes (host-mapped [kDeviceCopyTable]: missed experts -> how
  // many of them the device computes), the layer's experts in the host copy
  // (device addresses of the registered memory, [num_experts]), where copy j
  // lands (copy_dst + j * copy_dst_stride bytes: the buffer itself, or the
  // bf16 staging unpacked into it) and its buffer (copy_buffer_base + j).
  const int32_t* copy_table = nullptr;
  const uint64_t* host_experts = nullptr;
  int max_copies = 0;
  int copy_buffer_base = 0;
  uint8_t* copy_dst = nullptr;
  size_t copy_dst_stride = 0;
  size_t packed_bytes = 0;           // one expert in the host copy
  DeviceCopy* copies = nullptr;      // [max_copies] (device)
  int* copy_count = nullptr;         // the call's copies (device)
  // The fallback of a request whose server did not answer in time: its pairs
  // computed from the host copy (host_experts) through the mapping, when
  // intermediate <= kMaxFallbackIntermediate; else its tokens are poisoned.
  PackedLayout layout;               // the host copy's packed experts (their biases: layout.bias_bytes)
  ExpertActivation activation;       // the experts' activation
  int intermediate = 0;              // I
};

inline constexpr int kMaxFallbackIntermediate = 4096;

// Shared memory the split needs (above 48 KiB the launcher opts in).
size_t DevicePlanSharedBytes(int T, int k, int num_experts, int num_channels);
// The split (one block): validates the routing (ids in [-1, E), finite
// weights; else INVALID_ARGUMENT in the split's error record and the token's
// accum row NaN), counts each routed expert, reads the slot map and the
// routes, writes the hit groups, and each channel's request (routing rows
// and header) into its next device slot; then the copy of the request's
// token rows and the push on the device submit ring (+ doorbell) per channel.
cudaError_t LaunchDevicePlan(const DevicePlanArgs& a, cudaStream_t stream);
// One expert as the device-planned call copies it (LaunchDevicePlan): `bytes`
// (a multiple of 16) from host memory `src` (its device address) into `dst`,
// by the SMs' loads through the mapping, with the same grid per expert. What
// DeviceBackend::ProbeDeviceCopy times.
cudaError_t LaunchCopyFromHost(const void* src, void* dst, size_t bytes, cudaStream_t stream);
// Waits for each shipped request's answer (at most timeout_ns), adds its
// partial sums into accum and pops the device complete ring. On a timeout
// the request's pairs are computed from the host copy instead (slowly:
// weights read over the link), and the channel's record says so (detail
// -2); without a host copy, or on the server's error code, the record gets
// the error and the request's tokens become NaN.
cudaError_t LaunchDeviceCombine(const DevicePlanArgs& a, cudaStream_t stream);

}  // namespace moe::cuda
