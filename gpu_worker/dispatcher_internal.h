// The LayerDispatcher's internals (gpu_worker/layer_dispatcher.h): its
// servers, calls in flight and their sent batches, the forwarders of
// capturable calls, LayerDispatcher::Impl, and the small helpers its files
// share. A private header: only the dispatcher's own .cc files include it
// (layer_dispatcher.cc, server_failover.cc, cache_copies.cc, host_executor.cc,
// device_executor.cc); it is not installed.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "model/moe_batch.h"
#include "model/routing.h"
#include "transport/shm_segment.h"
#include "transport/transport.h"
#include "gpu_worker/device_plan.h"
#include "gpu_worker/layer_dispatcher.h"
#include "gpu_worker/miss_plan.h"

namespace moe {

// Helpers more than one of the dispatcher's files uses.
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

// ---------------------------------------------------------------------------
// Internals: servers, calls in flight, their sent batches.

// How often a failed server's transport is asked whether it is connected again.
inline constexpr std::chrono::milliseconds kReconnectPoll{20};

struct Server {
  ExpertServerConfig config;
  std::unique_ptr<ExpertTransport> transport;
  std::vector<bool> hosts;        // per expert
  ExpertSlice slice;               // its share of each expert (the transport's, once connected)
  Clock::time_point down_until{};  // skipped until then after a failure
  bool enabled = true;             // false: drained / marked down by the coordinator
  bool registered = false;         // HostMapping registered with the backend
  bool device_dead = false;        // capturable calls: gone and not reconnected (RefreshDeviceServers)
  bool failing = false;            // failed over since its last answer (logged once per change)
  bool silent = false;             // its last failure was a server deadline: probed before calls resume
  int chunk_tokens = 0;            // most tokens per staged batch
  std::chrono::microseconds polling{0};  // the window last given to SetPolling
  // Capturable calls whose requests to it the GPU computed from the host
  // copy (nobody answered): warned at most once a second, the rest counted.
  Clock::time_point recompute_warned{};
  uint64_t recompute_unwarned = 0;
};

// One batch sent to one server: the plan's batch and its transport state.
struct SentBatch {
  ServerBatch batch;             // batch.server: the server it is sent to (changes on failover)
  bool staged = false;
  StagingArea stage;
  size_t host_offset = 0;        // non-staged: row offset into the context's send/recv buffers
  Clock::time_point sent_at{};   // handed to the transport
  std::future<absl::Status> done;
};

// One layer call from its plan to its merge: Submit plans it (its MissPlan),
// the host executor carries the plan out (its sent batches, copies and
// launches), and Complete combines the partial sums and times the outcome.
// The dispatcher keeps `contexts` of them and reuses their buffers; `context`
// is the call's index there, which is also the engine's ticket and the index
// of the backend's per-call buffers (DeviceBackend::BeginCall).
struct InFlightCall {
  int context = 0;
  bool busy = false;
  LayerCall call;
  MissPlan plan;                 // Submit's split of this call
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

struct LayerDispatcher::Impl {
  std::vector<Server> servers;
  std::vector<InFlightCall> contexts;
  // Pending cache copies (lru/lfru admissions and static assignments).
  struct PendingCopy {
    SlotCopy copy;
    uint64_t fence;
    Clock::time_point start;  // enqueued on the copy queue
  };
  std::vector<PendingCopy> pending;
  // Temporary miss buffers: [parity][i] -> backend buffer, with the compute
  // fence after which it may be overwritten.
  int temp_base = 0;
  std::vector<uint64_t> temp_fence;
  int temp_next[2] = {0, 0};
  // Prefetch (StartPrefetch): per layer parity, the next served layer's
  // experts copied during a call into that parity's prefetch buffers, which
  // follow the temporary ones (prefetch_per_parity each; none without a host
  // copy).
  struct Prefetch {
    int layer = -1;                // the layer they are for, -1: none
    std::vector<int32_t> buffer;   // per expert: its prefetch buffer index, -1: not prefetched
    uint64_t last_fence = 0;       // the last of its copies (copies land in order)
  };
  Prefetch prefetch[2];
  int prefetch_base = -1;               // backend buffer of prefetch buffer 0, -1: no prefetch
  int prefetch_per_parity = 0;
  std::vector<uint64_t> prefetch_free;  // per prefetch buffer: the compute fence after which it may be overwritten
  std::vector<std::vector<int32_t>> last_pairs;  // [served index][expert]: pairs of the layer's last host-path call
  std::vector<int64_t> last_total;               // [served index]: that call's pairs
  std::vector<bool> prefetched_now;              // per expert: computed from a prefetch in the call being planned
  std::vector<bool> prefetch_candidate;          // StartPrefetch: per expert, not cached and in the host copy
  std::vector<int> prefetch_order;               // StartPrefetch: ChoosePrefetch's choice (scratch)
  ExpertGroups prefetch_groups;                  // RunHits: the prefetched experts' launch
  std::vector<int32_t> prefetch_launch_buffers;  // its buffer per group
  // Split scratch: the inputs of the plan of the call being submitted.
  std::vector<int32_t> slot_buffer;     // per expert: the buffer of its Ready slot, or -1
  std::vector<float> masked_logits;     // HintRouterLogits in a group: other ranks' experts out
  std::vector<PlanServer> plan_servers;
  std::vector<int> access_pairs;        // per accessed expert of the plan
  ExpertGroups one_group;               // ComputeCopied's single group, ComputeCopiedInBuffers' launch
  std::vector<int32_t> launch_buffers;  // ComputeCopiedInBuffers: the launch's buffer per group
  std::vector<int> copy_groups;         // ComputeCopiedInBuffers' groups (ComputeCopies, failover)
  ExpertGroups failover_groups;         // a failed sent batch's pairs by expert

  // Device-planned calls (EnqueueCapturable): the host-mapped tables the
  // GPU reads at run time (gpu_worker/device_plan.h) — per served layer the
  // slot map, the routes and the error records, and the channels: one per
  // server that a call may ship to (an shm server's own device rings, or a
  // Forwarder's for a gRPC server). Written by the driving thread only.
  void* mapped = nullptr;                      // one AllocMapped block for all of them
  DeviceChannel* channels = nullptr;           // [kMaxDeviceChannels] (the backend's device copy is what calls read)
  std::vector<DeviceLayerTables> device_tables;  // by served index
  std::vector<int> channel_of_server;          // server -> channel, -1: none (yet)
  std::vector<uint64_t> channel_generation;    // server -> segment generation its channel shows
  std::vector<void*> channel_base;             // server -> that segment's mapping (registered with the device)
  int num_channels = 0;
  DeviceCopyPlan* copy_plan = nullptr;         // copy-instead of capturable calls (PublishCopyPlan)
  int copy_buffer_base = -1;                   // their kMaxDeviceCopies buffers, -1: none (no host copy)
  double device_copy_s = 0;                    // one expert copied by the SMs (ProbeDeviceCopy), 0: unknown
  bool device_ready = false;                   // PrepareDevicePath ran
  std::vector<std::unique_ptr<Forwarder>> forwarders;
  std::vector<int> forwarder_of_server;        // server -> forwarder, -1: none (an shm server)
  std::vector<uint32_t> counts_seen;           // device access counts already reported
  std::vector<int32_t> log_seen;               // per served layer: the routing log's last sequence planned from
  void* planned_stream = nullptr;              // the engine's stream of capturable calls
  // The engine enqueued capturable calls itself (graphs replay them at any
  // time): cache copies wait for its stream, never only for one layer's reader.
  bool engine_calls = false;
  std::vector<uint64_t> last_reader;           // per served layer: its last eager device call's compute fence
  int capturable_max_tokens = 0;               // CapturableMaxTokens, fixed at Create
  std::vector<int> call_experts, call_pairs;   // ForwardOnDevice's accesses (scratch)
  // PublishCopyPlan: per missed count, the copies the cost model (or copy
  // mode always) chose; copy_plan->copy_count holds them, or 0 where the
  // outcomes overrule the model.
  std::vector<int> model_copies = std::vector<int>(kDeviceCopyTable, 0);
  std::vector<int32_t> call_count;             // [E] its pairs per expert, zero between calls
};

}  // namespace moe
