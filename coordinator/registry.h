// Registry: the GPU workers and CPU expert servers the coordinator knows, with
// their capabilities, sessions, liveness (heartbeats), the assignment issued
// to each worker (per-layer sets, versions, acknowledgements) and the routing
// table (servers that are up and not draining) that goes out with the
// assignments, plus the drain protocol:
//
//   Drain(s): s leaves the routing table at once; every worker gets a new
//   version without it. s is drained when every live worker acknowledged that
//   version and s then reported no in-flight requests (or is down).
//
// Versions are per worker and only grow, also across re-registrations (a
// worker reports the version it holds and gets a higher one). Not
// thread-safe: the Coordinator serialises every call.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

struct WorkerEntry {
  moe::v1::RegisterWorkerRequest caps;  // as registered, without `current`
  uint64_t session = 0;
  std::string identity;                  // the registering caller's certificate names ("" without mTLS)
  std::string peer;                      // who holds the registration (its cap counts it)
  bool up = true;
  double last_heartbeat = 0;
  uint64_t version = 0;                  // newest assignment issued
  uint64_t acked = 0;                    // newest version the worker applied
  std::vector<bool> cached;              // [layer]
  std::vector<std::vector<int>> sets;    // [layer] ascending
  std::vector<std::vector<int>> pinned;  // [layer] ascending subset of sets (operator pins)
  std::vector<uint64_t> layer_version;   // [layer] version that last changed its set
  uint64_t routes_version = 0;           // version that last changed the routes
  uint64_t copies_issued = 0, bytes_issued = 0;
  std::map<std::string, double> planner_rates;  // its last heartbeat's
  // Its counts: the routing seconds it may still report (routing_capacity.h),
  // as of credit_at; whether a refusal of its counts was logged.
  double count_credit = 0, credit_at = 0;
  bool count_refusal_logged = false;
};

struct ServerEntry {
  moe::v1::RegisterExpertServerRequest caps;
  uint64_t session = 0;
  std::string peer;                      // who holds the registration (its cap counts it)
  bool up = true;
  double last_heartbeat = 0;
  uint32_t inflight = 0;
  bool draining = false;                 // an admin drain is in force
  bool drained = false;
  std::map<std::string, uint64_t> drain_waits;  // worker -> version without this server
  double all_acked_at = -1;              // when the last waiting worker acknowledged
};

// What changed in Expire / UpdateDrains, for the log.
struct RegistryEvent {
  std::string what;
};

class Registry {
 public:
  Registry(int num_layers, int num_experts);

  // (Re)registers; the request was validated. Returns the new session. A
  // worker's sets become its reported `current` ones, at a fresh version.
  uint64_t RegisterWorker(const moe::v1::RegisterWorkerRequest& req, double now);
  uint64_t RegisterServer(const moe::v1::RegisterExpertServerRequest& req, bool draining, double now);

  // NotFound (unknown id) or FailedPrecondition (an older session): register again.
  absl::StatusOr<WorkerEntry*> Worker(const std::string& id, uint64_t session);
  absl::StatusOr<ServerEntry*> Server(const std::string& id, uint64_t session);
  WorkerEntry* FindWorker(const std::string& id);
  ServerEntry* FindServer(const std::string& id);
  const std::map<std::string, WorkerEntry>& workers() const { return workers_; }
  const std::map<std::string, ServerEntry>& servers() const { return servers_; }

  // A heartbeat arrived: the peer is up (again).
  void WorkerAlive(WorkerEntry& w, double now);
  void ServerAlive(ServerEntry& s, double now);

  // Marks peers silent for longer than `timeout` down; returns what changed.
  std::vector<RegistryEvent> Expire(double now, double timeout);
  // Forgets the workers and servers that are down and were silent for longer
  // than `horizon` (their lease ran out long ago); returns their ids.
  struct Purged {
    std::vector<std::string> workers, servers;
  };
  Purged Purge(double now, double horizon);
  void RemoveWorker(const std::string& id);
  void RemoveServer(const std::string& id);

  // Registrations `peer` holds; and of those down, the one silent longest
  // ("" when none is down).
  int WorkersOf(const std::string& peer) const;
  int ServersOf(const std::string& peer) const;
  std::string LongestDownWorkerOf(const std::string& peer) const;
  std::string LongestDownServerOf(const std::string& peer) const;
  // Advances drains; returns the servers that became drained.
  std::vector<RegistryEvent> UpdateDrains(double now);
  // Starts or cancels a drain (the server must exist).
  void SetDraining(ServerEntry& s, bool draining);
  // Workers that still route to a draining server.
  std::vector<std::string> DrainPending(const ServerEntry& s) const;

  // Issues new sets to a worker: bumps its version once if any layer changed.
  // Returns the new version, or 0 when nothing changed.
  // `pinned` ([layer], ascending; empty = none) travels with the sets; a
  // change of pins alone is a change of the layer.
  uint64_t Assign(WorkerEntry& w, const std::vector<std::vector<int>>& sets,
                  const std::vector<std::vector<int>>& pinned = {});

  // Snapshot of a worker's assignment (full); delta since `after` (layers and
  // routes changed after it). The delta is empty when w.version <= after.
  moe::v1::CacheAssignment Snapshot(const WorkerEntry& w) const;
  moe::v1::CacheAssignment Delta(const WorkerEntry& w, uint64_t after) const;

  std::vector<moe::v1::ExpertServerRoute> Routes() const;
  // Experts of `layer` hosted by some routable server.
  int RoutableExperts(int layer) const;

  int num_layers() const { return num_layers_; }
  int num_experts() const { return num_experts_; }

 private:
  static bool Routable(const ServerEntry& s) { return s.up && !s.draining; }
  // The routing table changed: every worker gets a new version carrying it.
  void RoutesChanged();

  int num_layers_, num_experts_;
  std::map<std::string, WorkerEntry> workers_;
  std::map<std::string, ServerEntry> servers_;
  static uint64_t NewSession();  // random: a restarted coordinator's never match old ones, none guessable
};

}  // namespace moe
