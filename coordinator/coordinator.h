// Coordinator: the coordinator's state machine behind both gRPC services —
// registry, popularity, placement rounds, assignment versions, admin
// overrides (persisted in the state file) and drains — with the protocol
// types of proto/moe/v1/coordinator.proto as its inputs and outputs.
//
// Every method is thread-safe (one mutex; the work under it is small). Errors
// are absl statuses that the services map 1:1 to gRPC: INVALID_ARGUMENT
// naming the field, NOT_FOUND / FAILED_PRECONDITION for unknown or
// superseded sessions (the peer registers again), UNAVAILABLE when the state
// file cannot be written (the admin change is then not applied).
//
// Time comes from `clock` (seconds, monotonic), so tests can drive it; Tick()
// does the periodic work (expiry, drains, pins, automatic rebalance) and
// Start() runs it on a background thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "coordinator/placement.h"
#include "coordinator/policy.h"
#include "coordinator/popularity.h"
#include "coordinator/registry.h"
#include "coordinator/state_file.h"
#include "model/model_identity.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

struct CoordinatorOptions {
  CoordinatorPolicy policy;               // defaults (flags); the state file's overrides win
  double heartbeat_timeout_seconds = 5.0;
  uint32_t heartbeat_interval_ms = 200;   // suggested to peers
  // A worker or server silent this long (down since heartbeat_timeout) is
  // forgotten with its counts and metric series; > heartbeat_timeout_seconds.
  // 0: max(300, 10 x heartbeat_timeout_seconds).
  double purge_after_seconds = 0;
  // Worker registrations, and server registrations, one peer may hold
  // (process/socket_peer.h keys; with mTLS its certificate names at its address).
  int max_registrations_per_peer = 64;
  // The routing rate a worker that declares none is held to, and the most one
  // may declare (RegisterWorkerRequest.max_tokens_per_second).
  double max_worker_tokens_per_second = 1e6;
  std::string state_file;                 // "" = overrides are not persisted
  std::string version = "dev";
  std::function<double()> clock;          // default: steady clock in seconds
};

// Every index < limit and no repeats; InvalidArgument naming field[i]
// otherwise (the requests' layer and expert lists).
absl::Status CheckIndexes(const google::protobuf::RepeatedField<uint32_t>& v, uint32_t limit,
                          const std::string& field);

class Coordinator {
 public:
  // Loads the state file (a malformed one is an error naming it).
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(CoordinatorOptions options);
  ~Coordinator();

  void Start(std::chrono::milliseconds tick = std::chrono::milliseconds(100));
  // Stops the background thread and ends every WaitForAssignment (UNAVAILABLE).
  void Stop();
  void Tick();

  // ---- CoordinatorService
  // `identity`: the caller's certificate names (RoleAuthorizer::
  // CertificateIdentity), "" without mTLS. A live worker's id is taken over
  // only with its session, by a caller with the same certificate identity (a
  // restarted worker), or after its lease ran out.
  // `peer`: who the caller is for the cap on registrations per peer
  // (RoleAuthorizer::PeerIdentity). A new id beyond the cap replaces the
  // peer's longest-silent registration that is down; with all of them live
  // it is RESOURCE_EXHAUSTED naming the cap and its flag.
  absl::StatusOr<moe::v1::RegisterWorkerResponse> RegisterWorker(const moe::v1::RegisterWorkerRequest& req,
                                                                 const std::string& identity = "",
                                                                 const std::string& peer = "");
  absl::StatusOr<moe::v1::RegisterExpertServerResponse> RegisterExpertServer(
      const moe::v1::RegisterExpertServerRequest& req, const std::string& peer = "");
  // Heartbeat and ReportStats refuse counts that name a layer the worker does
  // not cache, an expert out of range or twice, or more than the worker can
  // have routed since its last accepted report (routing_capacity.h):
  // INVALID_ARGUMENT naming the field, logged once per worker, counted in
  // StatusResponse.refused_count_reports.
  absl::StatusOr<moe::v1::HeartbeatResponse> Heartbeat(const moe::v1::HeartbeatRequest& req);
  absl::Status ReportStats(const moe::v1::ReportStatsRequest& req);
  // The worker's full assignment now.
  absl::StatusOr<moe::v1::CacheAssignment> Snapshot(const std::string& worker_id, uint64_t session);
  // Waits until the worker has a version newer than `after` (returns the
  // delta) or `deadline` passes (returns nullopt). Error when the session is
  // superseded or the coordinator stops.
  absl::StatusOr<std::optional<moe::v1::CacheAssignment>> WaitForAssignment(
      const std::string& worker_id, uint64_t session, uint64_t after, std::chrono::steady_clock::time_point deadline);

  // ---- AdminService
  moe::v1::StatusResponse Status();
  absl::StatusOr<moe::v1::PopularityResponse> GetPopularity(const moe::v1::PopularityRequest& req);
  absl::StatusOr<moe::v1::RebalanceResponse> Rebalance(bool dry_run);
  absl::StatusOr<moe::v1::PinResponse> Pin(const moe::v1::PinRequest& req, bool pin);
  moe::v1::PolicyParameters GetPolicy();
  absl::StatusOr<moe::v1::PolicyParameters> SetPolicy(const moe::v1::SetPolicyRequest& req);
  absl::StatusOr<moe::v1::DrainResponse> Drain(const moe::v1::DrainRequest& req);

 private:
  explicit Coordinator(CoordinatorOptions options);
  double Now() const { return options_.clock(); }
  // Learns (or checks) the model geometry; creates the registry and popularity.
  absl::Status CheckGeometryLocked(uint32_t num_layers, uint32_t num_experts);
  // OK when `counts` are valid and fit the worker's routing credit (then spent).
  absl::Status CheckCountsLocked(WorkerEntry& w, const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts,
                                 double now);
  // OK when `peer` may hold one more worker (or server) registration, making
  // room by forgetting its longest-silent down one; ResourceExhausted otherwise.
  absl::Status MakeRoomLocked(bool worker, const std::string& peer);
  // One worker's row of Status().
  void FillWorkerStatusLocked(const std::string& id, const WorkerEntry& w, double now,
                              moe::v1::WorkerStatus* ws) const;
  void ForgetLocked(bool worker, const std::string& id);
  // Forgets the peers silent for longer than purge_after_seconds.
  void PurgeLocked(double now);
  // One coordinator serves one model: FailedPrecondition naming
  // model_identity, both identities and both models when a live (up) worker
  // or server other than `peer` itself (its earlier registration) registered
  // another model. 0 (a peer that reports none) is not checked.
  absl::Status CheckModelLocked(const ModelIdentity& model, const std::string& peer, bool peer_is_worker) const;
  void AddCountsLocked(const std::string& worker,
                       const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts, double now);
  // One placement round over the live workers. pins_only: nothing but pins moves.
  moe::v1::RebalanceResponse RebalanceLocked(bool dry_run, bool pins_only, double now);
  // The placement problem of the live workers at `now`; `ids` gets their ids
  // in the order of PlacementProblem::workers.
  PlacementProblem PlacementProblemLocked(bool pins_only, double now, std::vector<std::string>* ids) const;
  // Logs a placement round (at most one line per kRoundLogSeconds, pin rounds always).
  void LogRoundLocked(const PlacementPlan& plan, bool pins_only, uint64_t bytes, size_t updated, double now);
  bool PinsMissingLocked() const;
  std::vector<int> PinsOfLocked(const std::string& worker, int layer) const;
  // Writes `next` to the state file, then makes it the admin state.
  absl::Status CommitLocked(AdminState next);
  moe::v1::PolicyParameters PolicyProtoLocked() const;
  moe::v1::DrainResponse DrainStatusLocked(const ServerEntry& s) const;
  void LogEventsLocked(const std::vector<RegistryEvent>& events);

  CoordinatorOptions options_;
  const double started_;
  std::mutex mu_;
  std::condition_variable changed_;  // an assignment version moved, or stopping
  bool stopping_ = false;
  CoordinatorPolicy policy_;
  AdminState admin_;
  std::unique_ptr<Registry> registry_;      // once the geometry is known
  std::unique_ptr<Popularity> popularity_;
  // Per layer, decayed (policy half-life) sums of the workers' cache activity.
  struct LayerActivitySums {
    double copies = 0, bytes = 0, predicted = 0, used = 0;
    double pairs = 0, cpu = 0, copied = 0, prefetched = 0, link_s = 0;  // the split's pairs, link seconds
    double at = 0;  // time of the last decay
  };
  std::vector<LayerActivitySums> activity_;
  double last_rebalance_ = 0;
  uint64_t rebalances_ = 0;
  struct RoundCounters {
    uint64_t rounds = 0, copies = 0, bytes = 0, updates = 0;
  } unlogged_;                              // placement rounds not logged yet
  double last_round_log_ = -1e300;
  uint64_t refused_count_reports_ = 0, refused_registrations_ = 0, purged_registrations_ = 0;
  uint64_t unlogged_cap_refusals_ = 0;
  double last_cap_log_ = -1e300;

  std::mutex thread_mu_;
  std::condition_variable thread_cv_;
  bool thread_stop_ = false;
  std::thread thread_;
};

}  // namespace moe
