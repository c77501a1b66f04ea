// The host executor of a LayerDispatcher (a private part, see
// layer_dispatcher.h): Submit / Complete. A call's routing comes to the
// host, the planner splits it (Planner::PlanCall), and this carries the plan
// out — the misses gathered and shipped to the servers, the hits, the copied
// and prefetched experts on the device, the admissions — then adds the
// servers' partial sums, failing over a batch whose server failed
// (ServerSet::FailOver decides, this carries it out).
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"
#include "gpu_worker/cache_copies.h"
#include "gpu_worker/dispatch_context.h"
#include "gpu_worker/server_set.h"

namespace moe {

// One batch sent to one server: the plan's batch and its transport state.
struct SentBatch {
  ServerBatch batch;             // batch.server: the server it is sent to (changes on failover)
  bool staged = false;
  StagingArea stage;
  size_t host_offset = 0;        // non-staged: row offset into the call's send/recv buffers
  Clock::time_point sent_at{};   // handed to the transport
  std::future<absl::Status> done;
};

// One layer call from its plan to its merge: Submit plans it (its MissPlan),
// carries the plan out (its sent batches, copies and launches), and Complete
// combines the partial sums and times the outcome. The executor keeps
// `contexts` of them and reuses their buffers; `context` is the call's
// index there, which is also the engine's ticket and the index of the
// backend's per-call buffers (DeviceBackend::BeginCall).
struct HostCall {
  int context = 0;
  bool busy = false;
  LayerCall call;
  MissPlan plan;                 // the planner's split of this call
  std::vector<bool> prefetched;  // per expert: computed from a prefetch buffer (not a cache slot)
  Clock::time_point deadline;
  // When a batch sent now to a server must be answered: `server_deadline`
  // (DispatcherConfig) from now, never past the call's deadline.
  Clock::time_point ServerDeadline(std::chrono::milliseconds server_deadline) const {
    return std::min(deadline, Clock::now() + server_deadline);
  }
  std::vector<int32_t> ids;      // host routing [T, k]
  std::vector<float> weights;
  std::vector<SentBatch> sent;
  // Per-call scratch reused across calls.
  std::vector<bf16_t> send, recv;  // non-staged transports: [max_tokens, H] each
  CallStats stats;
  std::vector<uint64_t> copy_fences;  // the call's copy-instead copies, timed at Complete
  struct CopyLaunch {
    uint64_t start, end;   // compute-queue timing marks around the launch
    double prior_s;        // CostModel::CopyDevicePrior of its experts
  };
  std::vector<CopyLaunch> copy_launches;  // the call's launches of copied experts, timed at Complete
  Clock::time_point submitted{};
  double device_prior_s = -1;  // prior device time of a hits-only call (-1: the call is not one)
  bool beside_copies = false;    // cache copies were on the link when it was submitted
};

// The backend buffers the host executor computes copied and prefetched
// experts in (after the cache's slots; LayerDispatcher sizes them).
struct HostBuffers {
  int temp_base = 0;             // the first temporary miss buffer
  int temp_buffers = 0;          // 2 x miss_buffers (the two layer parities), 0: none (no host copy)
  int prefetch_base = -1;        // the first prefetch buffer, -1: no prefetch
  int prefetch_per_parity = 0;
};

class HostExecutor {
 public:
  HostExecutor(DispatchContext& hc, ServerSet& servers, CacheCopies& copies, const HostBuffers& buffers);
  ~HostExecutor();  // waits for the calls' sent batches; unregisters their buffers
  HostExecutor(const HostExecutor&) = delete;
  HostExecutor& operator=(const HostExecutor&) = delete;

  // The `contexts` calls with their registered send/recv buffers.
  absl::Status Init();
  // Starts a call; returns its ticket. ResourceExhausted when `contexts`
  // calls are already in flight.
  absl::StatusOr<int> Submit(const LayerCall& call);
  // Finishes the call of `ticket`: its output is written when this returns OK.
  absl::Status Complete(int ticket, CallStats* stats);
  // A call is in flight (between Submit and Complete).
  bool busy() const;
  // Misses can be copied to the device for the call: a host copy and
  // temporary buffers to copy them into.
  bool can_copy_misses() const { return ctx_.host != nullptr && !temp_fence_.empty(); }
  const HostBuffers& buffers() const { return buffers_; }

 private:
  // Submit's steps until the call's work is enqueued.
  absl::StatusOr<HostCall*> FreeCall();
  absl::Status CheckCall(const LayerCall& call) const;
  absl::Status CopyRouting(const LayerCall& call, std::vector<int32_t>& ids, std::vector<float>& weights);
  absl::Status Plan(HostCall& c, const RoutingView& routing);
  absl::Status Dispatch(HostCall& c);
  void RecordAccesses(HostCall& c);
  void ReportActivity(const HostCall& c, int prefetches);
  absl::Status ShipMisses(HostCall& c);
  absl::Status Gather(HostCall& c, const std::vector<int32_t>& rows, bf16_t* dst);
  absl::Status ComputeCopies(HostCall& c);
  // The next served layer's experts copied into its prefetch buffers during
  // this call; returns how many.
  absl::StatusOr<int> StartPrefetch(HostCall& c);
  void ReleasePrefetch(int parity, bool consumed);
  absl::Status RunHits(HostCall& c);
  // One group of `groups` copied into cache buffer `buffer` and computed from it.
  absl::StatusOr<uint64_t> ComputeCopied(HostCall& c, const ExpertGroups& groups, int g, int buffer);
  // Groups `gs` of `groups` copied into the temporary buffers and computed
  // from them, several experts per launch.
  absl::Status ComputeCopiedInBuffers(HostCall& c, const ExpertGroups& groups, const std::vector<int>& gs);
  // Complete's steps: the partial sums, the failover of a failed sent batch, the outcome's timing.
  absl::Status AddPartials(HostCall& c, uint64_t* last_fence);
  absl::Status FailOver(HostCall& c, size_t index, absl::Status st, const bf16_t** partial);
  absl::Status ComputeServerBatchOnDevice(HostCall& c, const ServerBatch& batch);
  void ObserveOutcome(HostCall& c, bool ok, Clock::time_point end);
  void Abort(HostCall& c);
  void ReleaseSent(HostCall& c);

  DispatchContext& ctx_;
  ServerSet& servers_;
  CacheCopies& copies_;
  const HostBuffers buffers_;
  std::vector<HostCall> calls_;
  // Temporary miss buffers: the compute fence after which each may be
  // overwritten, and per parity the half the next launch uses.
  std::vector<uint64_t> temp_fence_;
  int temp_next_[2] = {0, 0};
  // Prefetch (StartPrefetch): per layer parity, the next served layer's
  // experts copied during a call into that parity's prefetch buffers.
  struct Prefetch {
    int layer = -1;                // the layer they are for, -1: none
    std::vector<int32_t> buffer;   // per expert: its prefetch buffer index, -1: not prefetched
    uint64_t last_fence = 0;       // the last of its copies (copies land in order)
  };
  Prefetch prefetch_[2];
  std::vector<uint64_t> prefetch_free_;          // per prefetch buffer: the compute fence after which it may be overwritten
  std::vector<std::vector<int32_t>> last_pairs_;  // [served index][expert]: pairs of the layer's last call
  std::vector<int64_t> last_total_;              // [served index]: that call's pairs
  // Scratch.
  std::vector<int32_t> slot_buffer_;      // Plan: per expert, the buffer of its Ready slot (or prefetch), or -1
  std::vector<bool> prefetch_candidate_;  // StartPrefetch: per expert, not cached and in the host copy
  std::vector<int> prefetch_order_;       // StartPrefetch: ChoosePrefetch's choice
  std::vector<int> access_pairs_;         // per accessed expert of the plan
  ExpertGroups one_group_;                // ComputeCopied's single group, ComputeCopiedInBuffers' launch
  ExpertGroups prefetch_groups_;          // RunHits: the prefetched experts' launch
  std::vector<int32_t> launch_buffers_;   // the launch's buffer per group
  std::vector<int32_t> prefetch_launch_buffers_;
  std::vector<int> copy_groups_;          // ComputeCopiedInBuffers' groups (ComputeCopies, failover)
  ExpertGroups failover_groups_;          // a failed sent batch's pairs by expert
};

}  // namespace moe
