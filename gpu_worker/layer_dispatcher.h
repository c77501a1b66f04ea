// LayerDispatcher: one MoE layer of a GPU worker — the hit/miss split, the
// shipping of misses to CPU expert servers, the hit compute on the device,
// copy-instead-of-compute, failover, and the merge. Written once against
// DeviceBackend (cuda or cpu) and ExpertTransport (shm or gRPC).
//
// One call, T tokens with top-k routing (Submit):
//   1. routing to the host (a copy of T*k ids/weights when it lives on the
//      device: the host needs it anyway for the transport and the counters),
//      validated (InvalidArgument naming expert_ids/expert_weights);
//   2. split (Planner::PlanCall, planner.h: PlanMisses, a plain function of
//      the routing, the slot map, the servers, the rates and the link's
//      queue): a pair is a hit when its expert is Ready in a cache slot;
//   3. copy-instead-of-compute: missed experts whose tokens make copy +
//      device compute cheaper than the CPU (CostModel: rates probed at Create,
//      re-estimated online from the calls' observed times) are copied into temporary miss buffers — two sets, alternating by layer
//      parity, so the copies of layer l+1 overlap the compute of layer l — and
//      computed on the device;
//   4. the remaining misses are gathered straight into the transport's memory
//      (a shared-memory slot for shm) and submitted, per server, BEFORE the
//      hits are enqueued, so the CPU works while the device computes hits;
//   5. hits run as one grouped launch over the cached experts (then the
//      experts prefetched for this call, below, once their copies landed).
// Prefetch (prompts): a call that copied experts starts copying the next
// served layer's experts that its next call will copy too (those its last
// call routed most pairs to; at most as many as this call copied, as the
// link copies in its idle time between two calls, observed online, and as
// kAutoPrefetchBytes holds; Planner, ChoosePrefetch) into that layer's
// parity's prefetch buffers, so the link keeps
// working while this layer finishes and the next layer's attention runs; the
// next call computes them in a launch of their own after its cached hits
// (which never wait for a copy) and splits the rest as usual.
// Complete waits for the servers' partial sums, adds them, and writes the
// output. A failed server (UNAVAILABLE / DEADLINE_EXCEEDED) fails the batch
// over to another server hosting its experts, else to copy-to-device from the
// host expert store, else the call returns UNAVAILABLE. Never a wrong result,
// never a wait past the call's deadline.
//
// Dual-batch overlap: up to `contexts` calls may be in flight — Submit(A),
// Submit(B), Complete(A), Complete(B) runs B's hits while A's misses are on
// the CPU. Calls complete in any order.
//
// Cache: per MoE layer C slots (ExpertCache). predictive (the default) asks
// the planner (AdmissionPolicy) on every call which experts of the next layers to copy
// (cross-layer prediction, cost model, link timing) and takes coordinator
// assignments as deltas inside which it admits; lru/lfru admit missed experts
// after the call (copies on the copy queue, the slot used only once its copy
// completed); static takes assignments (ApplyAssignment) between calls.
//
// Thread-safety: none; one thread drives a dispatcher (and its backend).
//
// Parts: LayerDispatcher is a thin coordinator — it builds the parts at
// Create and hands each call to the executor that carries it out; every
// decision is the Planner's (planner.h), made from what the parts give it.
//   DispatchContext (gpu_worker/dispatch_context.h): the model, backend, host copy,
//     config, cache, served layers and the Planner — what every part reads;
//   ServerSet (server_set.h/.cc): connecting servers, the planner's view of
//     them, drains, the failover decision of a failed batch;
//   HostExecutor (host_executor.h/.cc): Submit / Complete — a HostCall
//     carried from the plan through its shipped batches, hits, copies and
//     prefetch to the merge of the partial sums;
//   DeviceExecutor (device_executor.h/.cc): device-planned calls (capturable,
//     and Forward's decode path) and the host-mapped tables the GPU reads;
//   CacheCopies (cache_copies.h/.cc): the admission worker — copies into cache
//     slots, assignments, hints, the admissions after each call;
//   rate_probes.h/.cc: the start-up probes behind the planner's first rates.
// Forward: DeviceExecutor::Takes(call) ? the device executor : the host
// executor; neither calls the other.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_spec.h"
#include "model/moe_batch.h"
#include "transport/transport.h"
#include "gpu_worker/admission_policy.h"
#include "gpu_worker/cost_model.h"
#include "gpu_worker/device_backend.h"
#include "gpu_worker/expert_cache.h"
#include "gpu_worker/host_expert_store.h"
#include "gpu_worker/miss_plan.h"
#include "gpu_worker/planner.h"
#include "moe/types.h"

namespace moe {

struct ExpertServerConfig {
  std::string address;       // unix:///path (shm) or host:port (gRPC)
  std::vector<int> experts;  // experts it hosts (every layer); empty = all
};

// Parses "ADDRESS" or "ADDRESS#experts=0-31,40" (ParseIndexList syntax).
absl::StatusOr<ExpertServerConfig> ParseExpertServer(const std::string& text, int num_experts);

// The hex characters of an expert-parallel group's id (ParallelGroup::id:
// NCCL's 128-byte unique id).
inline constexpr size_t kGroupIdHexChars = 256;

// InvalidArgument naming the field unless 0 <= rank < size <= num_experts
// and, for an expert-parallel group of size > 1, id is kGroupIdHexChars hex
// characters. Checked before anything else about the group (a bad rank must
// not be reported as a missing backend).
absl::Status CheckParallelGroup(const ParallelGroup& group, int num_experts);

// CopyMode (miss_plan.h): auto | never | always.

// Upper bounds of the sizing options (CheckConfig refuses values outside
// them naming the option): tokens of one call, calls in flight, GiB of cache.
inline constexpr int64_t kMaxCallTokens = 1 << 16;
inline constexpr int64_t kMaxContexts = 64;
// Temporary miss buffers per layer parity: at most this many; by default
// (miss_buffers 0) as many as this many bytes hold, 4 to 16.
inline constexpr int64_t kMaxMissBuffers = 256;
inline constexpr size_t kAutoMissBufferBytes = size_t{128} << 20;
// Prefetch buffers per layer parity (DispatcherConfig::prefetch) on a GPU:
// as many as this many bytes hold, at least miss_buffers, at most a layer's
// experts (the cpu backend: miss_buffers).
inline constexpr size_t kAutoPrefetchBytes = size_t{1} << 30;
// Forward's device path takes calls of at most this many pairs per expert of
// the layer on average (DeviceExecutor::Takes).
inline constexpr int kDevicePathPairsPerExpert = 1;
inline constexpr double kMaxCacheGib = 1 << 20;

struct DispatcherConfig {
  std::vector<int> layers;         // MoE layers served (empty: all of the model's)
  std::vector<ExpertServerConfig> servers;
  TransportOptions transport;      // hidden is set from the model
  int slots_per_layer = 0;         // C
  double cache_gib = 0;            // if > 0 and slots_per_layer == 0: C from this budget
  CachePolicy policy = CachePolicy::kPredictive;
  // predictive: PCIe bytes its admissions may start per forward pass; 0: what
  // the link completes before the target layer runs.
  uint64_t pass_budget_bytes = 0;
  double lfru_half_life = 64;
  int max_tokens = 1024;           // largest T of one call
  int max_top_k = 8;
  int contexts = 2;                // calls in flight (micro-batches)
  int admissions_per_call = 4;     // lru/lfru: copies started per call
  int miss_buffers = 0;            // temporary miss buffers per layer parity (copied experts are
                                   // computed half of them per launch while the other half loads);
                                   // 0: 4 to 16, as many as kAutoMissBufferBytes holds. The prefetch
                                   // has buffers of its own (kAutoPrefetchBytes per parity)
  CopyMode copy_mode = CopyMode::kAuto;
  bool prefetch = true;            // a call that copies experts starts copying the next layer's (StartPrefetch)
  int prefetch_buffers = 0;        // with prefetch on a GPU: its buffers per layer parity (at most a layer's
                                   // experts); 0: as many as kAutoPrefetchBytes holds, at least miss_buffers
  int copy_min_tokens = 0;         // > 0: copy experts with at least this many tokens (no model)
  bool copy_fallback = true;       // failed servers: copy the experts to the device
  // At Create, the cache's empty slots are filled with each layer's first
  // experts (this rank's), copied before Create returns: a cache buys hits
  // from the first call, and the policy replaces them by use (predictive:
  // a provisional placement, which the coordinator's first assignment
  // replaces). Not under static (placed by assignments only) or copy mode
  // always, nor without a host copy. Off here (tests start cold); on in
  // SessionOptions and the worker.
  bool fill_cache = false;
  std::chrono::milliseconds deadline{30000};  // per call
  // Per server batch: a server that has not answered one of a call's batches
  // this long after it was sent has failed (a stalled server, a link gone
  // silent), and the batch fails over (FailOver: another holder of its
  // experts, else the device) with what is left of the call's deadline.
  // Bounded by the call's deadline; must be > 0.
  std::chrono::milliseconds server_deadline{10000};
  // A failed server is skipped this long, then tried again (a failed try is
  // cheap: a dead socket or a channel in back-off fails at once).
  std::chrono::milliseconds server_retry{250};
  // Decode polling: calls of at most poll_max_tokens tokens turn on the
  // transports' polling mode (ExpertTransport::SetPolling) with this window;
  // larger calls turn it off. Off on machines with fewer than 8 hardware threads.
  std::chrono::microseconds poll_window{2000};
  int poll_max_tokens = 64;
  bool measure_rates = true;       // probe PCIe / device / CPU rates at Create (the online model's prior)
  // Forward of a decode-shaped device-memory call (at most
  // kDevicePathPairsPerExpert pairs per expert on average) that fits the
  // request slots runs on the device path (the capturable call, uncaptured);
  // false: always the host path.
  bool eager_on_device = true;
  // Tensor parallelism (moe/types.h): this worker computes, caches and
  // reports only the pairs of the experts its rank owns; a call's output is
  // its rank's partial sum.
  ParallelGroup group;
  // Device knobs passed to DeviceBackend::Init (cpu_threads, cpu_kernel,
  // cuda_device); its sizes (hidden, buffers, tokens, contexts) are set here.
  BackendConfig backend;
  // Called once per (layer, expert) a call routes pairs to: `pairs` of them,
  // all hits or all misses (e.g. CoordinatorAgent::RecordAccess). Optional.
  std::function<void(int layer, int expert, int pairs, bool hit)> on_access;
  // Activity, optional (moe/types.h LayerActivity): a copy into `layer`'s
  // slots started, the predictive policy scored its prediction of a run, or a
  // call split its uncached pairs between the servers and copies (as planned
  // at Submit: pairs a failover later moves to the device stay counted as CPU
  // pairs; CallStats has the final split).
  std::function<void(int layer, const LayerActivity& activity)> on_activity;
};

// Capturable calls counted by the GPU (LayerDispatcher::TakeCapturedCalls).
struct CapturedCalls {
  uint64_t calls = 0, hit_pairs = 0, cpu_pairs = 0, copied_pairs = 0;
};

// One layer call: the batch (T = batch.n tokens, hidden [T,H] bf16 in
// batch.tokens, routing [T,k] i32 ids (-1 = unused) and f32 weights) and out
// [T,H] bf16; all in `kind` memory.
struct LayerCall {
  MoeBatch batch;
  bf16_t* out = nullptr;
  MemoryKind kind = MemoryKind::kHost;
  std::chrono::milliseconds deadline{0};  // 0: the config's
  // The engine's cudaStream_t or nullptr: the call's device work is ordered
  // after the stream's earlier work, and the stream's later work after the
  // output (DeviceBackend::WaitStream / SignalStream).
  void* stream = nullptr;
};

// The MoE layers a worker serves: `requested` (DispatcherConfig::layers,
// SessionOptions::layers), or every MoE layer of the model when it is empty.
// The dispatcher checks them (LayerDispatcher::Create).
inline const std::vector<int>& ServedLayers(const ModelSpec& spec, const std::vector<int>& requested) {
  return requested.empty() ? spec.moe_layers : requested;
}

// The dispatcher's parts (private headers: gpu_worker/dispatch_context.h,
// gpu_worker/server_set.h, gpu_worker/device_executor.h,
// gpu_worker/cache_copies.h, gpu_worker/host_executor.h).
struct DispatchContext;
struct HostBuffers;
class ServerSet;
class DeviceExecutor;
class CacheCopies;
class HostExecutor;

class LayerDispatcher {
 public:
  // `host` may be null (no copy-instead, no admissions, no copy fallback);
  // it must outlive the dispatcher, as must `backend`. Connects the servers
  // and initialises the backend.
  static absl::StatusOr<std::unique_ptr<LayerDispatcher>> Create(const ModelSpec& spec,
                                                                 DeviceBackend& backend,
                                                                 const HostExpertStore* host,
                                                                 DispatcherConfig config);
  ~LayerDispatcher();

  // Starts a call; returns its ticket. ResourceExhausted when `contexts`
  // calls are already in flight.
  absl::StatusOr<int> Submit(const LayerCall& call);
  // Finishes the call of `ticket`: its output is written when this returns OK.
  absl::Status Complete(int ticket, CallStats* stats = nullptr);
  // One call, done when this returns. A decode-shaped call in device memory
  // on the cuda backend that fits one shared-memory request slot per server
  // runs as EnqueueCapturable's device-planned call, not captured, and waits
  // for its stream (DispatcherConfig::eager_on_device); its admissions are
  // planned from the routing the GPU logs before the experts run and their
  // copies start while the call still runs (admissions_during_calls).
  // Anything else is Submit + Complete.
  absl::Status Forward(const LayerCall& call, CallStats* stats = nullptr);

  // Capture-safe call (CUDA graphs): cuda backend, device pointers,
  // 1 <= T <= one shm slot's tokens (TransportOptions::max_tokens_per_slot),
  // call.stream (null: CUDA's legacy default stream). The whole call is
  // enqueued on call.stream and this returns at once
  // (DeviceBackend::DevicePlannedCall): at run (or graph replay) time the GPU
  // splits hits from misses with the slot map and routes as they are then
  // (host-mapped tables, gpu_worker/device_plan.h), writes each server's
  // misses into its shared-memory slot and pushes it on the segment's device
  // ring (a gRPC server's through a forwarder thread of this worker), runs the
  // hits, waits (bounded by the call's deadline) for the answers and adds
  // them. No host function, no host synchronisation. The first call of a
  // layer must not be captured (it allocates). Calls of one layer must not
  // overlap: enqueue them in order (the engine's decode stream; cache copies
  // wait for the latest stream used). The dispatcher's destructor waits for
  // the device to finish them (the engine may destroy its stream first).
  // The planner's copy-instead table (PublishCopyPlan) says how many missed
  // experts the GPU copies from the host copy and computes itself; the GPU
  // counts every routed pair and logs
  // each layer's routing, which TakeStreamError reports as the eager path
  // does (RecordAccess, on_access) and plans admissions from between steps.
  // Calls with T above a request slot run eagerly outside a capture (Forward)
  // and are refused inside one. A failure found at run time (bad
  // routing, no server, a server's error; a request nobody answered — no
  // answer by the deadline, or UNAVAILABLE / DEADLINE_EXCEEDED from a
  // draining server or a gRPC server's forwarder — only without a host copy,
  // which otherwise computes the request) writes NaN into the affected
  // tokens' output and is returned by TakeStreamError.
  // host_stats (optional): the CallStats of a call that ran eagerly on the
  // host path (above a request slot, not captured); left empty otherwise.
  absl::Status EnqueueCapturable(const LayerCall& call, bool count_accesses = true,
                                 std::optional<CallStats>* host_stats = nullptr);
  // The first run-time error of capturable calls since the last call (OK if
  // none); also reports the accesses the GPU counted since the last call. A
  // server that timed out is reconnected (or, if down, skipped) here.
  absl::Status TakeStreamError();
  // The most tokens of one capturable call.
  int CapturableMaxTokens() const;
  // The capturable calls the engine enqueued (graph replays included) that
  // the GPU ran since the last look, and their split, as the GPU added them
  // up (CapturedCalls); eager device-path calls are not among them (Forward
  // returns their CallStats).
  CapturedCalls TakeCapturedCalls();
  // The split of `layer`'s latest device-planned call as the GPU logged it
  // (hit, CPU and copied pairs; copied and CPU experts; no times), once the
  // call completed (e.g. after the engine synchronised its stream).
  // FailedPrecondition before any such call of the layer.
  absl::StatusOr<CallStats> LastDeviceCall(int layer) const;

  // Static placement: the resident set of `layer` becomes `experts`; copies
  // start now and each slot serves once its copy completed. Between calls.
  // Under the predictive policy the assignment is the long-horizon placement
  // the admissions work inside; `pinned` (a subset of `experts`, e.g. the
  // operator's pins from the coordinator) replaces the layer's pins: the
  // admissions never evict them.
  absl::Status ApplyAssignment(int layer, const std::vector<int>& experts, const std::vector<int>& pinned = {});
  // Engine hint (predictive policy): the router logits [T, num_experts] f32
  // (host memory) of `layer`'s coming call, computed by the engine on the
  // current hidden state; its top-k per token are prefetched with the hint's
  // measured precision. InvalidArgument naming router_logits on bad input;
  // FailedPrecondition under another policy.
  absl::Status HintRouterLogits(int layer, int T, int k, const float* router_logits);
  // The predictive policy (null under another one): its predictor's quality
  // and per-layer copy counters.
  const AdmissionPolicy* admission() const;

  // Waits for every cache copy in flight and makes the slots Ready.
  absl::Status FlushCopies();
  // Cache copies still in flight (completed ones are collected first).
  int PendingCopies();
  // Stops (false) or resumes (true) routing misses to the server with this
  // address (an operator drain, or a server the coordinator marked down);
  // its experts go to other servers hosting them, else to the device.
  // NotFound for an unknown address.
  absl::Status SetServerEnabled(const std::string& address, bool enabled);

  // Leaves the group (DispatcherConfig::group): every expert is this
  // rank's again — the other ranks' become misses (or admissions) here. An
  // expert-parallel rank calls it when a peer failed (ExpertParallel).
  void LeaveGroup();

  const ExpertCache& cache() const;
  const CostModel& cost_model() const;
  // The link's idle window between calls the prefetch is bounded by (Planner::PrefetchWindow), seconds.
  double prefetch_window_seconds() const;
  int slots_per_layer() const;
  const std::vector<int>& layers() const;
  uint64_t copies_started() const;
  // Eager device-path calls whose admissions were planned and started while
  // the call still ran (from the routing its plan kernel logs), not after it.
  uint64_t admissions_during_calls() const;
  // The predictive policy's planning since start (Planner::planning()).
  PlanningStats planning() const;
  // The copy-instead decisions checked against their outcomes (host path, device path).
  const CopyOutcomes& host_outcomes() const;
  const CopyOutcomes& device_outcomes() const;

 private:
  LayerDispatcher();
  // Create: the steps of Init.
  absl::Status Init();
  absl::Status CheckConfig();
  absl::Status CreateCacheAndBackend(HostBuffers* buffers, int* device_copy_base);
  void SizeMissBuffers(size_t expert_bytes, HostBuffers* buffers);
  absl::Status MeasureRates();
  absl::Status CreateAdmission();
  // A call on the host path: Submit + Complete.
  absl::Status RunOnHost(const LayerCall& call, CallStats* stats);

  // The parts, each in a file of its own (see the top comment), declared in
  // the order they are built: what they share first, destroyed last.
  std::unique_ptr<DispatchContext> ctx_;
  std::unique_ptr<ServerSet> servers_;
  std::unique_ptr<DeviceExecutor> device_;
  std::unique_ptr<CacheCopies> copies_;
  std::unique_ptr<HostExecutor> host_;
};

}  // namespace moe
