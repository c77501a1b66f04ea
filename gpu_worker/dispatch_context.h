// What every part of a LayerDispatcher (gpu_worker/layer_dispatcher.h)
// reads — the model, the backend, the host copy, the config, the cache and
// the served layers, fixed at Create — and the one Planner they all consult,
// plus the helpers their files share. A private header: only the
// dispatcher's parts include it (server_set, cache_copies, host_executor,
// device_executor, layer_dispatcher); it is not installed.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "model/moe_batch.h"
#include "model/routing.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

struct DispatchContext {
  ModelSpec spec;
  DeviceBackend* backend = nullptr;
  const HostExpertStore* host = nullptr;  // null: no copy-instead, no admissions, no copy fallback
  DispatcherConfig config;                // checked at Create; group and transport settled there
  std::unique_ptr<ExpertCache> cache;
  std::vector<int> layers;       // the served MoE layers
  std::vector<int> layer_index;  // model layer -> served index, or -1
  Planner planner;               // the split, copy-instead and admissions, their rates and the link queue
  uint64_t copy_bytes = 0;       // bytes one expert copy moves (the host copy's packed expert)
  int capturable_max_tokens = 0;  // most tokens of one device-planned call (one shm request slot per server)

  bool Serves(int layer) const { return layer >= 0 && layer < spec.num_layers && layer_index[layer] >= 0; }
  // This rank's expert of `layer` (always, outside a group).
  bool Owns(int layer, int expert) const {
    return config.group.size <= 1 || ExpertOwner(layer, expert, config.group.size) == config.group.rank;
  }
  int slots_per_layer() const { return cache->config().slots_per_layer; }
  // The backend buffer of a cache slot (slots come first, layer by layer).
  int SlotBuffer(int layer, int slot) const { return layer_index[layer] * slots_per_layer() + slot; }
};

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A server this call cannot use: down, late, cancelled — or one that is up
// but not usable as it is (FailedPrecondition: a shared-memory segment that
// fails the worker's checks after a reconnect, e.g. one another process
// serves on the server's socket; a server holding another slice). Each is
// failed over like a server that went away, never returned to the caller
// while another holder, a copy or the host copy can take the batch.
inline bool IsServerFailure(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) || absl::IsCancelled(st) ||
         absl::IsAborted(st) || absl::IsFailedPrecondition(st);
}

// The batch a server computes for a sent batch whose tokens were gathered into `tokens`.
inline MoeBatch GatheredBatch(int layer, const ServerBatch& b, const bf16_t* tokens) {
  return MoeBatch{layer, b.n, tokens, RoutingView{b.n, b.k, b.ids.data(), b.weights.data()}};
}

}  // namespace moe
