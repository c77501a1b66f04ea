// The device executor of a LayerDispatcher (a private part, see
// layer_dispatcher.h): device-planned calls — enqueued for the engine
// (capturable: CUDA graphs) or run eagerly for decode-shaped calls (Forward)
// — and the host-mapped tables the GPU reads at run time to carry out the
// planner's decisions (gpu_worker/device_plan.h): the slot map, each
// expert's route to a server, the channels to the servers (an shm server's
// device rings, a forwarder thread's for a gRPC server), the copy-instead
// table the planner publishes; and what the GPU reports back: errors, the
// routing it logged, its access counts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/shm_segment.h"
#include "gpu_worker/cache_copies.h"
#include "gpu_worker/device_plan.h"
#include "gpu_worker/dispatch_context.h"
#include "gpu_worker/server_set.h"

namespace moe {

// A gRPC server's device rings, kept by the worker: the GPU pushes requests
// into a local segment in host-mapped memory as it would into an shm
// server's, and this thread moves each to the server through its transport
// and the answer back. (An shm server works its own device rings.)
struct Forwarder {
  void* mem = nullptr;  // AllocMapped
  std::optional<shm::Segment> seg;
  std::atomic<ExpertTransport*> route{nullptr};  // null while drained or unconnected
  std::atomic<bool> stop{false};
  std::thread thread;
};

class DeviceExecutor : public SlotReaders {
 public:
  // copy_buffer_base: the backend buffers of the copy-instead of
  // device-planned calls (kMaxDeviceCopies), -1: none (no host copy).
  DeviceExecutor(DispatchContext& ctx, ServerSet& servers, int copy_buffer_base)
      : ctx_(ctx), servers_(servers), copy_buffer_base_(copy_buffer_base) {}
  // Waits for the device to finish the calls still enqueued; stops the forwarders.
  ~DeviceExecutor() override;
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  // The tables, when the backend has a device (the slot map is published from the start).
  absl::Status AllocateTables();
  // Forward's device path takes the call: a decode-shaped call in device
  // memory that fits the request slots, not being captured (see the .cc).
  bool Takes(const LayerCall& call) const;
  // A call on the device path, done when this returns: enqueued, its
  // admissions planned (by `copies`) from the routing the GPU logs while its
  // experts run — unless `host_calls` (host-path calls in flight) — and its
  // outcome timed.
  absl::Status Forward(const LayerCall& call, CallStats* stats, CacheCopies& copies, bool host_calls);
  // Enqueues a capturable call (LayerDispatcher::EnqueueCapturable); one
  // with more tokens than a request slot is refused.
  absl::Status Enqueue(const LayerCall& call, bool count_accesses);
  // A capturable call too large for the device's request slots (a prompt)
  // that is not being captured: it runs as a stream-ordered eager call on
  // the host path, where large T belongs (while capturing it cannot: Enqueue refuses it).
  bool LeavesToHost(const LayerCall& call) const;
  // The first run-time error since the last look; the GPU's access counts
  // reported, gone servers reconnected, the copy table republished, the
  // admissions of the calls logged since planned (by `copies`).
  absl::Status TakeStreamError(CacheCopies& copies);
  absl::StatusOr<CallStats> LastCall(int layer) const;
  // What the GPU added up for the engine's own calls since the last look.
  CapturedCalls TakeCapturedCalls();
  // Republishes every expert's route after server `index` was drained,
  // enabled or connected (ServerSet's route listener).
  void PublishRoute(size_t index);
  void PublishSlotMaps();
  uint64_t admissions_during_calls() const { return admissions_during_calls_; }

  // SlotReaders (cache copies).
  void PublishSlotMap(int layer) override;
  absl::StatusOr<uint64_t> CopyAfter(int layer, bool during_call) override;

 private:
  absl::Status PrepareDevicePath();
  absl::Status PublishChannel(size_t index);
  static void FillChannel(const shm::Segment& seg, uint64_t device_base, uint32_t first_slot, uint32_t slots,
                          uint32_t generation, DeviceChannel* out);
  void CollectDeviceAccesses();
  void RefreshDeviceServers();
  void PublishCopyPlan();
  void PublishCopyCount(int missed);
  void PlanDeviceAdmissions(CacheCopies& copies);
  void RecordLoggedAccesses(int layer, const int32_t* ids, int pairs);
  void ObserveOutcome(int T, int missed, bool beside_copies, double took);
  // Waits until the call of served layer `li` (compute fence `done`) logged
  // its routing (sequence other than `before`); false when the call ended
  // without a new log first.
  bool AwaitRoutingLog(size_t li, int32_t before, uint64_t done);
  absl::Status TakeLayerError(size_t served_index);
  static CallStats LoggedStats(const int32_t* log);

  DispatchContext& ctx_;
  ServerSet& servers_;
  int copy_buffer_base_;
  uint64_t admissions_during_calls_ = 0;
  // The host-mapped tables the GPU reads at run time — per served layer the
  // slot map, the routes and the error records, and the channels: one per
  // server that a call may ship to. Written by the driving thread only.
  void* mapped_ = nullptr;                      // one AllocMapped block for all of them
  DeviceChannel* channels_ = nullptr;           // [kMaxDeviceChannels] (the backend's device copy is what calls read)
  std::vector<DeviceLayerTables> tables_;       // by served index
  std::vector<int> channel_of_server_;          // server -> channel, -1: none (yet)
  std::vector<uint64_t> channel_generation_;    // server -> segment generation its channel shows
  std::vector<void*> channel_base_;             // server -> that segment's mapping (registered with the device)
  int num_channels_ = 0;
  DeviceCopyPlan* copy_plan_ = nullptr;         // copy-instead of device-planned calls (PublishCopyPlan)
  double device_copy_s_ = 0;                    // one expert copied by the SMs (ProbeDeviceCopy), 0: unknown
  bool ready_ = false;                          // PrepareDevicePath ran
  std::vector<std::unique_ptr<Forwarder>> forwarders_;
  std::vector<int> forwarder_of_server_;        // server -> forwarder, -1: none (an shm server)
  std::vector<uint32_t> counts_seen_;           // device access counts already reported
  std::vector<uint64_t> totals_seen_;           // [served index x kDeviceTotals] the GPU's call totals already taken
  std::vector<int32_t> log_seen_;               // per served layer: the routing log's last sequence planned from
  void* planned_stream_ = nullptr;              // the engine's stream of capturable calls
  // The engine enqueued capturable calls itself (graphs replay them at any
  // time): cache copies wait for its stream, never only for one layer's reader.
  bool engine_calls_ = false;
  std::vector<uint64_t> last_reader_;           // per served layer: its last eager device call's compute fence
  std::vector<int> call_experts_, call_pairs_;  // Forward's accesses (scratch)
  std::vector<int32_t> call_count_;             // [E] its pairs per expert, zero between calls
  // Per missed count, the copies the cost model (or copy mode always)
  // chose; copy_plan_->copy_count holds them, or 0 where the outcomes
  // overrule the model.
  std::vector<int> model_copies_ = std::vector<int>(kDeviceCopyTable, 0);
};

}  // namespace moe
