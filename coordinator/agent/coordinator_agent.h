// The coordinator's agents, embedded in the processes it coordinates:
//
// CoordinatorAgent (GPU worker): registers the worker, watches its cache
// assignment (a full snapshot, then versioned deltas) and hands each update to
// the worker, heartbeats every interval with the version the worker applied
// (the acknowledgement) and the per-(layer, expert) access counts recorded
// since the previous heartbeat. When the coordinator is away it retries with
// exponential back-off and the worker keeps serving on its last assignment;
// when the coordinator is back the agent registers again, reporting what the
// worker holds, and receives a fresh snapshot (resync). Counts recorded
// meanwhile are kept and sent then; counts the coordinator refuses (e.g.
// more than the worker's declared capacity could have routed, issue 47) are
// dropped, logged once, and the session goes on.
//
// ExpertServerAgent (CPU expert server): registers what the server hosts and
// heartbeats with its in-flight request count; tells the server whether an
// admin drain is in force and whether it has completed.
//
// Lifecycle: Start() (never blocks on the coordinator; it may be down) ->
// use -> destroy (stops the background threads; no callback runs after the
// destructor returns). Thread-safety: every public method may be called from
// any thread; RecordAccess is lock-free.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_identity.h"
#include "transport/transport.h"
#include "moe/types.h"

namespace moe {

struct AgentOptions {
  // 0: the interval the coordinator asks for at registration.
  std::chrono::milliseconds heartbeat_interval{0};
  std::chrono::milliseconds rpc_timeout{2000};
  // Back-off between attempts while the coordinator is unreachable.
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{2000};
};

struct WorkerRegistration {
  std::string worker_id;          // unique, stable across restarts (e.g. "host:gpu0")
  std::string address;            // where the worker serves engines (informational)
  std::string hostname;           // default: gethostname()
  int num_layers = 0;             // model layers; layer indexes are model layer indexes
  int num_experts = 0;
  int slots_per_layer = 0;        // cache slots C per cached layer
  uint64_t expert_bytes = 0;      // bytes one expert copy moves (the copy budget is in bytes)
  uint64_t gpu_memory_bytes = 0;
  int numa_node = -1;
  std::vector<int> cached_layers; // MoE layers with a cache; empty = every layer
  ParallelGroup group;      // caches only its rank's experts (moe/types.h)
  // What it can route (the coordinator bounds its counts by it): tokens a
  // second through one layer, 0 = the coordinator's default; experts per
  // token (e.g. --max-top-k), 0 = unknown.
  uint64_t max_tokens_per_second = 0;
  int top_k = 0;
  ModelIdentity model;      // its model (model/model_identity.h); the coordinator refuses another live model's
};

// A layer's new resident set (the whole set, ascending).
struct LayerAssignment {
  int layer = 0;
  std::vector<int> experts;
  std::vector<int> pinned;  // subset of experts the worker's admissions never evict
};

// A CPU expert server the worker may send misses to.
struct ServerRoute {
  std::string server_id, address, shm_socket, hostname;
  int numa_node = -1;
  std::vector<int> hosted_layers;   // empty = every layer
  std::vector<int> hosted_experts;  // empty = every expert
};

struct AssignmentUpdate {
  uint64_t version = 0;
  // Snapshot: `layers` lists every cached layer (first message of a session,
  // also after a reconnect). Otherwise only the layers that changed.
  bool full = false;
  std::vector<LayerAssignment> layers;
  bool routes_changed = false;      // true in a snapshot
  std::vector<ServerRoute> routes;  // routable servers (up, not draining), when routes_changed
};

class CoordinatorAgent {
 public:
  // Called on the agent's thread, in version order; keep it short (queue the
  // update for the dispatcher, which applies it between forward passes and
  // then calls MarkApplied(update.version)).
  using AssignmentCallback = std::function<void(const AssignmentUpdate& update)>;

  // InvalidArgument for a bad registration or TLS options.
  static absl::StatusOr<std::unique_ptr<CoordinatorAgent>> Start(const std::string& coordinator_address,
                                                                 const TlsOptions& tls,
                                                                 const WorkerRegistration& registration,
                                                                 AssignmentCallback on_assignment,
                                                                 AgentOptions options = {});
  ~CoordinatorAgent();

  // `pairs` (token, expert) pairs of (layer, expert) in one forward pass, all
  // hits or all misses. Out-of-range indexes are ignored. Lock-free.
  void RecordAccess(int layer, int expert, uint64_t pairs, bool hit);
  // Activity of `layer` (cache copies and bytes, experts predicted and used,
  // pairs sent to the CPU and copied, link time), reported with the next
  // heartbeat. Lock-free.
  void RecordLayerActivity(int layer, const LayerActivity& activity);
  // The worker finished applying `version` (copies done, slot map swapped).
  // Sent as the acknowledgement in the next heartbeat.
  void MarkApplied(uint64_t version);
  // The worker's planner rates (MoeSession::Admin::PlannerRates), sent with
  // every heartbeat from now on.
  void SetPlannerRates(std::map<std::string, double> rates);

  bool connected() const;            // registered, with a live assignment stream
  uint64_t received_version() const; // newest version handed to the callback
  uint64_t applied_version() const;
  int sessions() const;              // successful registrations so far (1 + reconnects)
  std::vector<ServerRoute> routes() const;  // latest routing table

  class Impl;

 private:
  explicit CoordinatorAgent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct ExpertServerRegistration {
  std::string server_id;          // unique, stable (e.g. "host:numa0")
  std::string address;            // gRPC host:port workers reach it at
  std::string shm_socket;         // "" = no shared-memory endpoint
  std::string hostname;           // default: gethostname()
  int numa_node = -1;
  int num_layers = 0;
  int num_experts = 0;
  std::vector<int> hosted_layers;   // empty = every layer
  std::vector<int> hosted_experts;  // empty = every expert
  uint64_t weight_bytes = 0;
  std::string kernel;
  ExpertSlice slice;                // --slice
  ModelIdentity model;              // its model (model/model_identity.h); the coordinator refuses another live model's;
                                    // its expert math and routing are shown to operators
  std::string model_type;           // its model's family (ModelSpec::model_type), for operators
  std::string weight_format;        // the stored experts' format (bf16, int8, int4, fp8), for operators
};

class ExpertServerAgent {
 public:
  // inflight(): requests the server is computing or has queued, sampled at each heartbeat.
  static absl::StatusOr<std::unique_ptr<ExpertServerAgent>> Start(const std::string& coordinator_address,
                                                                  const TlsOptions& tls,
                                                                  const ExpertServerRegistration& registration,
                                                                  std::function<uint32_t()> inflight,
                                                                  AgentOptions options = {});
  ~ExpertServerAgent();

  bool connected() const;
  bool draining() const;  // an admin drain is in force: workers stop sending here
  bool drained() const;   // ... and every worker stopped and nothing was in flight
  int sessions() const;

  class Impl;

 private:
  explicit ExpertServerAgent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
