// The tables a GPU reads to run one MoE layer call with the host out of the
// loop (the device-planned call, LayerDispatcher::EnqueueCapturable): it
// splits the routing into hits and misses against the published slot map,
// groups the hits for the expert kernels, writes each CPU server's miss rows
// with their (expert, weight) pairs straight into that server's shared-memory
// slot, pushes the slot on the segment's device submit ring (shm_segment.h),
// computes the hits, waits for the device complete ring (bounded: a timeout
// is an error, never a hang) and adds the partial sums into the output.
//
// Plain structs (no CUDA headers): the dispatcher fills them in host-mapped
// memory (DeviceBackend::AllocMapped) and the kernels read them at run time,
// so a CUDA graph captured once follows every later placement, drain and
// reconnect. Written by the worker's driving thread between calls; a call in
// flight may see an entry old or new, never torn (4- and 8-byte stores).
#pragma once

#include <cstdint>

namespace moe {

// CPU servers one device-planned call can ship to.
inline constexpr int kMaxDeviceChannels = 8;
// Experts one device-planned call may copy to the device instead of sending
// them to a server, and the length of the planner's table of how many.
inline constexpr int kMaxDeviceCopies = 16;
inline constexpr int kDeviceCopyTable = 64;
inline constexpr int kRoutingLogHeader = 8;

// One CPU server's device rings as the GPU addresses them. base == 0: the
// channel is off (no experts route to it).
struct DeviceChannel {
  uint64_t base = 0;  // device address of the mapped segment
  uint64_t submit_ring = 0, complete_ring = 0;  // RingHeader offsets: head at +0, tail at +64, entries at +128
  uint64_t doorbell = 0;                        // offset of the request doorbell word
  uint64_t slots_offset = 0, slot_stride = 0;
  uint64_t tokens_offset = 0, ids_offset = 0, weights_offset = 0, output_offset = 0;
  uint32_t num_slots = 0;     // ring capacity (a power of two)
  uint32_t first_slot = 0;    // slots [first_slot, first_slot + device_slots) are the GPU's
  uint32_t device_slots = 0;
  uint32_t max_tokens = 0;    // rows per slot
  uint32_t max_pairs = 0;
  uint32_t generation = 0;    // changes with the segment (a reconnect)
  // The server holds rows [slice_begin, slice_end) of every expert's
  // intermediate dimension (--slice; 0, 0: whole): the fallback of an
  // unanswered request computes that share only.
  int32_t slice_begin = 0, slice_end = 0;
};

// What went wrong in a call, per writer (the split, then one per channel):
// code is an absl::StatusCode (0: none); detail the expert (split) or the
// answered slot whose message says why (channel), -1 for a timeout.
struct DeviceError {
  int32_t code = 0;
  int32_t detail = 0;
  int32_t layer = 0;
  int32_t reserved = 0;
};

// One served layer's routing tables (host-mapped, [num_experts] each).
// buffer_of's mark of an expert another rank of a tensor-parallel group
// owns: its pairs are skipped (moe/types.h ParallelGroup).
inline constexpr int32_t kNotThisRank = -2;

struct DeviceLayerTables {
  int32_t* buffer_of = nullptr;   // expert -> cache buffer of its Ready slot, -1: a miss, kNotThisRank
  // expert -> its route: a bitmask of DeviceChannel indexes (one channel, or
  // one holder of every slice: RouteExpert), 0 or -1: no server may take it
  int32_t* channel_of = nullptr;
  DeviceError* errors = nullptr;  // [1 + kMaxDeviceChannels]
  // The routing of the layer's latest call, for the admissions the worker
  // plans between steps and an eager call's stats (written by the GPU, read
  // by the host as a seqlock): [0] sequence (0 while being written), [1] T,
  // [2] k, [3] hit pairs, [4] pairs sent to servers, [5] pairs copied,
  // [6] experts copied, [7] experts sent to servers, then from
  // kRoutingLogHeader the T*k ids; calls of more than routing_log_pairs pairs
  // are not logged.
  int32_t* routing_log = nullptr;
  int32_t routing_log_pairs = 0;
};
// Per site, the engine's own device-planned calls (count_accesses: capturable
// calls and their graph replays, not the eager device path, whose CallStats
// the caller gets) added up by the GPU in device memory
// (DeviceBackend::ReadCallTotals): [0] calls, [1] hit pairs, [2] pairs sent to
// servers, [3] pairs copied.
inline constexpr int kDeviceTotals = 4;

// Copy-instead for device-planned calls: copy_count[min(m, kDeviceCopyTable
// - 1)] of a call's m missed experts (those with the most pairs; one no
// server may take first) are copied over the link and computed on the
// device, at most kMaxDeviceCopies. Host-mapped, shared by every layer;
// written by the planner from its rates.
struct DeviceCopyPlan {
  int32_t copy_count[kDeviceCopyTable] = {};
};

}  // namespace moe
