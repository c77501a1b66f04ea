// HostExpertStore: the host copy of the experts a GPU worker may copy to its
// device, packed in one ExpertGeometry (PackExpert's layout, the GPU cache's
// precision: what DeviceBackend::LoadExpert reads). Two kinds:
//   shared  the packed stores of same-host CPU expert servers: each server
//           keeps its experts in a sealed memfd and hands it over its shm
//           socket (ShmServer, kShmStoreMagic); the worker maps it read-only
//           and registers it with the backend. Worker and server hold the
//           model once.
//   own     the worker's own copy, packed from the checkpoint (servers on
//           other hosts, or servers that do not cover the worker's layers).
// Registered with the backend (pinned) so copies run at full PCIe rate.
// Read-only after creation; thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_identity.h"
#include "model/model_source.h"
#include "expert_compute/expert_kernel.h"
#include "gpu_worker/device_backend.h"

namespace moe {

class ExpertStore;
class NumaBinding;

class HostExpertStore {
 public:
  // Own copy: reads and packs every expert of `layers` (model layer indexes;
  // MoE layers only) in `geometry`. Refuses (ResourceExhausted, naming the
  // bytes) when it would not fit in available memory. `backend` may be null
  // (no registration).
  static absl::StatusOr<std::unique_ptr<HostExpertStore>> Load(const ModelSource& source,
                                                              const std::vector<int>& layers,
                                                              const ExpertGeometry& geometry,
                                                              DeviceBackend* backend, int threads = 0);
  // Shared: maps the stores of the servers on `unix_sockets` (paths). All
  // must serve `model` (the worker's: a store of another model is never
  // mapped; ModelMismatchError, model/model_identity.h), share one geometry and
  // together hold every expert of `layers`; FailedPrecondition saying what is
  // missing otherwise (or when a server shares no store), InvalidArgument when
  // a description does not fit the model.
  static absl::StatusOr<std::unique_ptr<HostExpertStore>> Attach(const ModelSpec& spec, const ModelIdentity& model,
                                                                const std::vector<int>& layers,
                                                                const std::vector<std::string>& unix_sockets,
                                                                DeviceBackend* backend,
                                                                std::chrono::milliseconds timeout);
  // The worker's host copy: shared when `share` and the servers on
  // `unix_sockets` serve `model` (source's identity) and cover `layers` in
  // the asked precision, else its own.
  // weight_dtype: auto (shared: the servers'; own: StorageGeometry's auto),
  // bf16, int8 or int4.
  static absl::StatusOr<std::unique_ptr<HostExpertStore>> Open(const ModelSource& source, const ModelIdentity& model,
                                                              const std::vector<int>& layers,
                                                              const std::vector<std::string>& unix_sockets,
                                                              const std::string& weight_dtype, bool share,
                                                              DeviceBackend* backend);
  ~HostExpertStore();
  HostExpertStore(const HostExpertStore&) = delete;
  HostExpertStore& operator=(const HostExpertStore&) = delete;

  // The packed expert (layer, expert), or nullptr when the layer is not held.
  const std::byte* Find(int layer, int expert) const;
  const ExpertGeometry& geometry() const { return geometry_; }
  // Bytes of this worker's own copy (0 when shared).
  uint64_t bytes() const;
  bool shared() const { return !mappings_.empty(); }

 private:
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
  };
  HostExpertStore() = default;
  absl::Status Register(void* p, size_t bytes, bool read_only);

  DeviceBackend* backend_ = nullptr;
  std::vector<void*> registered_;
  ExpertGeometry geometry_;
  int num_experts_ = 0;
  std::vector<int> layer_index_;           // model layer -> index into table_ rows, or -1
  std::vector<const std::byte*> table_;    // [layer index * num_experts + expert]
  std::unique_ptr<NumaBinding> binding_;   // own copy: the store's memory binding
  std::unique_ptr<ExpertStore> own_;
  std::vector<Mapping> mappings_;          // shared: the servers' stores
};

}  // namespace moe
