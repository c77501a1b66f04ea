// HostExpertStore: the GPU worker's host copy of the experts it may have to
// copy to the device — row-major bf16 gate [I,H], up [I,H], down [H,I] back to
// back per expert, exactly what DeviceBackend::LoadExpert reads. The memory is
// one region, registered with the backend (pinned) so copies run at full PCIe
// rate. Built once at start (in parallel); read-only afterwards, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model_source.h"
#include "gpu_worker/device_backend.h"

namespace moe {

class HostExpertStore {
 public:
  // Reads every expert of `layers` (model layer indexes; MoE layers only).
  // Refuses (ResourceExhausted, naming the bytes) when it would not fit in
  // available memory. `backend` may be null (no registration).
  static absl::StatusOr<std::unique_ptr<HostExpertStore>> Load(const ModelSource& source,
                                                              const std::vector<int>& layers,
                                                              DeviceBackend* backend, int threads = 0);
  ~HostExpertStore();
  HostExpertStore(const HostExpertStore&) = delete;
  HostExpertStore& operator=(const HostExpertStore&) = delete;

  // gate|up|down of (layer, expert), or nullptr when the layer is not held.
  const bf16_t* Find(int layer, int expert) const;
  size_t expert_elements() const { return expert_elems_; }
  uint64_t bytes() const { return bytes_; }

 private:
  HostExpertStore() = default;
  DeviceBackend* backend_ = nullptr;
  std::vector<int> layer_index_;  // model layer -> index into the region, or -1
  int num_experts_ = 0;
  size_t expert_elems_ = 0;
  bf16_t* base_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace moe
