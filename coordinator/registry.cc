#include "coordinator/registry.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"

namespace moe {

Registry::Registry(int num_layers, int num_experts) : num_layers_(num_layers), num_experts_(num_experts) {}

// Sessions are credentials (a live worker's id is taken only with its
// session): 64 random bits each, never 0, none derived from another.
uint64_t Registry::NewSession() {
  std::random_device rd;
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd()) | 1;
}

uint64_t Registry::RegisterWorker(const moe::v1::RegisterWorkerRequest& req, double now) {
  WorkerEntry& w = workers_[req.worker_id()];
  const uint64_t old_version = w.version;
  w.caps = req;
  w.caps.clear_current();
  w.session = NewSession();
  w.up = true;
  w.last_heartbeat = now;
  w.cached.assign(num_layers_, req.cached_layers().empty());
  for (uint32_t l : req.cached_layers()) w.cached[l] = true;
  w.sets.assign(num_layers_, {});
  w.pinned.assign(num_layers_, {});
  for (const auto& la : req.current()) {
    if (!w.cached[la.layer()]) continue;
    w.sets[la.layer()].assign(la.experts().begin(), la.experts().end());
    std::sort(w.sets[la.layer()].begin(), w.sets[la.layer()].end());
  }
  w.version = std::max(old_version, req.current_version()) + 1;
  w.acked = std::min(req.current_version(), w.version);
  w.layer_version.assign(num_layers_, w.version);
  w.routes_version = w.version;
  return w.session;
}

uint64_t Registry::RegisterServer(const moe::v1::RegisterExpertServerRequest& req, bool draining, double now) {
  auto [it, fresh] = servers_.try_emplace(req.server_id());
  ServerEntry& s = it->second;
  const bool was_routable = !fresh && Routable(s);
  const bool same_caps = !fresh && s.caps.SerializeAsString() == req.SerializeAsString();
  s.caps = req;
  s.session = NewSession();
  s.last_heartbeat = now;
  s.up = true;
  s.inflight = 0;
  // A known server keeps its drain state (it mirrors the admin state); a new
  // one under a persisted drain never got any work, so nothing to wait for.
  if (fresh) s.draining = draining;
  if (Routable(s) != was_routable || (Routable(s) && !same_caps)) RoutesChanged();
  return s.session;
}

absl::StatusOr<WorkerEntry*> Registry::Worker(const std::string& id, uint64_t session) {
  auto it = workers_.find(id);
  if (it == workers_.end())
    return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", id, "' (register first)"));
  if (it->second.session != session)
    return absl::FailedPreconditionError(
        absl::StrCat("session: ", session, " is not the current session of worker '", id, "' (register again)"));
  return &it->second;
}

absl::StatusOr<ServerEntry*> Registry::Server(const std::string& id, uint64_t session) {
  auto it = servers_.find(id);
  if (it == servers_.end())
    return absl::NotFoundError(absl::StrCat("server_id: unknown server '", id, "' (register first)"));
  if (it->second.session != session)
    return absl::FailedPreconditionError(
        absl::StrCat("session: ", session, " is not the current session of server '", id, "' (register again)"));
  return &it->second;
}

WorkerEntry* Registry::FindWorker(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

ServerEntry* Registry::FindServer(const std::string& id) {
  auto it = servers_.find(id);
  return it == servers_.end() ? nullptr : &it->second;
}

void Registry::WorkerAlive(WorkerEntry& w, double now) {
  w.last_heartbeat = now;
  w.up = true;
}

void Registry::ServerAlive(ServerEntry& s, double now) {
  s.last_heartbeat = now;
  if (!s.up) {
    s.up = true;
    if (Routable(s)) RoutesChanged();
  }
}

std::vector<RegistryEvent> Registry::Expire(double now, double timeout) {
  std::vector<RegistryEvent> events;
  for (auto& [id, w] : workers_) {
    if (w.up && now - w.last_heartbeat > timeout) {
      w.up = false;
      events.push_back({absl::StrCat("worker ", id, " missed heartbeats for ", now - w.last_heartbeat, " s: down")});
    }
  }
  bool routes_changed = false;
  for (auto& [id, s] : servers_) {
    if (s.up && now - s.last_heartbeat > timeout) {
      routes_changed |= Routable(s);
      s.up = false;
      events.push_back({absl::StrCat("server ", id, " missed heartbeats for ", now - s.last_heartbeat,
                                     " s: down, its experts go to replicas")});
    }
  }
  if (routes_changed) RoutesChanged();
  return events;
}

Registry::Purged Registry::Purge(double now, double horizon) {
  Purged purged;
  for (const auto& [id, w] : workers_)
    if (!w.up && now - w.last_heartbeat > horizon) purged.workers.push_back(id);
  for (const auto& [id, s] : servers_)
    if (!s.up && now - s.last_heartbeat > horizon) purged.servers.push_back(id);
  for (const std::string& id : purged.workers) RemoveWorker(id);
  for (const std::string& id : purged.servers) RemoveServer(id);
  return purged;
}

void Registry::RemoveWorker(const std::string& id) {
  workers_.erase(id);
  for (auto& [sid, s] : servers_) s.drain_waits.erase(id);
}

void Registry::RemoveServer(const std::string& id) {
  auto it = servers_.find(id);
  if (it == servers_.end()) return;
  const bool routable = Routable(it->second);
  servers_.erase(it);
  if (routable) RoutesChanged();
}

namespace {

template <typename Map>
int CountOf(const Map& entries, const std::string& peer) {
  int n = 0;
  for (const auto& [id, e] : entries) n += e.peer == peer ? 1 : 0;
  return n;
}

template <typename Map>
std::string LongestDownOf(const Map& entries, const std::string& peer) {
  const std::string* found = nullptr;
  double oldest = 0;
  for (const auto& [id, e] : entries) {
    if (e.peer != peer || e.up) continue;
    if (found == nullptr || e.last_heartbeat < oldest) {
      found = &id;
      oldest = e.last_heartbeat;
    }
  }
  return found == nullptr ? "" : *found;
}

}  // namespace

int Registry::WorkersOf(const std::string& peer) const { return CountOf(workers_, peer); }
int Registry::ServersOf(const std::string& peer) const { return CountOf(servers_, peer); }
std::string Registry::LongestDownWorkerOf(const std::string& peer) const { return LongestDownOf(workers_, peer); }
std::string Registry::LongestDownServerOf(const std::string& peer) const { return LongestDownOf(servers_, peer); }

std::vector<std::string> Registry::DrainPending(const ServerEntry& s) const {
  std::vector<std::string> pending;
  for (const auto& [id, version] : s.drain_waits) {
    auto it = workers_.find(id);
    if (it != workers_.end() && it->second.up && it->second.acked < version) pending.push_back(id);
  }
  return pending;
}

std::vector<RegistryEvent> Registry::UpdateDrains(double now) {
  std::vector<RegistryEvent> events;
  for (auto& [id, s] : servers_) {
    if (!s.draining || s.drained) continue;
    if (!DrainPending(s).empty()) continue;
    if (s.all_acked_at < 0) s.all_acked_at = now;
    // In-flight work counts only when reported after every worker stopped routing here.
    if (!s.up || (s.last_heartbeat > s.all_acked_at && s.inflight == 0)) {
      s.drained = true;
      events.push_back({absl::StrCat("server ", id, " drained")});
    }
  }
  return events;
}

void Registry::SetDraining(ServerEntry& s, bool draining) {
  const bool was_routable = Routable(s);
  s.draining = draining;
  s.drained = false;
  s.all_acked_at = -1;
  s.drain_waits.clear();
  if (was_routable != Routable(s)) RoutesChanged();
  if (draining) {
    for (const auto& [id, w] : workers_) s.drain_waits[id] = w.routes_version;
  }
}

void Registry::RoutesChanged() {
  for (auto& [id, w] : workers_) {
    ++w.version;
    w.routes_version = w.version;
  }
}

uint64_t Registry::Assign(WorkerEntry& w, const std::vector<std::vector<int>>& sets,
                          const std::vector<std::vector<int>>& pinned) {
  // Pins travel only for experts the set holds.
  std::vector<std::vector<int>> pins(num_layers_);
  for (int l = 0; l < num_layers_ && l < static_cast<int>(pinned.size()); ++l)
    for (int e : pinned[l])
      if (std::find(sets[l].begin(), sets[l].end(), e) != sets[l].end()) pins[l].push_back(e);
  for (auto& p : pins) std::sort(p.begin(), p.end());
  std::vector<int> changed;
  for (int l = 0; l < num_layers_; ++l) {
    if (w.cached[l] && (sets[l] != w.sets[l] || pins[l] != w.pinned[l])) changed.push_back(l);
  }
  if (changed.empty()) return 0;
  ++w.version;
  for (int l : changed) {
    w.sets[l] = sets[l];
    w.pinned[l] = pins[l];
    w.layer_version[l] = w.version;
  }
  return w.version;
}

moe::v1::CacheAssignment Registry::Snapshot(const WorkerEntry& w) const {
  moe::v1::CacheAssignment a;
  a.set_version(w.version);
  a.set_full(true);
  for (int l = 0; l < num_layers_; ++l) {
    if (!w.cached[l]) continue;
    moe::v1::LayerAssignment* la = a.add_layers();
    la->set_layer(l);
    for (int e : w.sets[l]) la->add_experts(e);
    for (int e : w.pinned[l]) la->add_pinned(e);
  }
  a.set_routes_changed(true);
  for (auto& r : Routes()) *a.add_routes() = std::move(r);
  return a;
}

moe::v1::CacheAssignment Registry::Delta(const WorkerEntry& w, uint64_t after) const {
  moe::v1::CacheAssignment a;
  a.set_version(w.version);
  a.set_base_version(after);
  if (w.version <= after) return a;
  for (int l = 0; l < num_layers_; ++l) {
    if (!w.cached[l] || w.layer_version[l] <= after) continue;
    moe::v1::LayerAssignment* la = a.add_layers();
    la->set_layer(l);
    for (int e : w.sets[l]) la->add_experts(e);
    for (int e : w.pinned[l]) la->add_pinned(e);
  }
  if (w.routes_version > after) {
    a.set_routes_changed(true);
    for (auto& r : Routes()) *a.add_routes() = std::move(r);
  }
  return a;
}

std::vector<moe::v1::ExpertServerRoute> Registry::Routes() const {
  std::vector<moe::v1::ExpertServerRoute> routes;
  for (const auto& [id, s] : servers_) {
    if (!Routable(s)) continue;
    moe::v1::ExpertServerRoute r;
    r.set_server_id(id);
    r.set_address(s.caps.address());
    r.set_shm_socket(s.caps.shm_socket());
    r.set_hostname(s.caps.hostname());
    r.set_numa_node(s.caps.numa_node());
    *r.mutable_hosted_layers() = s.caps.hosted_layers();
    *r.mutable_hosted_experts() = s.caps.hosted_experts();
    routes.push_back(std::move(r));
  }
  return routes;
}

int Registry::RoutableExperts(int layer) const {
  // An expert is routable when an up server holds it whole, or up servers
  // hold every slice of it for one slice count (a worker needs all of them).
  std::vector<bool> served(num_experts_, false);
  std::map<uint32_t, std::vector<std::vector<bool>>> slices;  // count -> [slice][expert]
  for (const auto& [id, s] : servers_) {
    if (!Routable(s)) continue;
    const auto& layers = s.caps.hosted_layers();
    if (!layers.empty() && std::find(layers.begin(), layers.end(), static_cast<uint32_t>(layer)) == layers.end())
      continue;
    const uint32_t count = std::max(1u, s.caps.slice_count());
    std::vector<bool>* holds = &served;
    if (count > 1) {
      auto& by_slice = slices[count];
      by_slice.resize(count, std::vector<bool>(num_experts_, false));
      if (s.caps.slice_index() >= count) continue;
      holds = &by_slice[s.caps.slice_index()];
    }
    const auto& hosted = s.caps.hosted_experts();
    if (hosted.empty()) std::fill(holds->begin(), holds->end(), true);
    for (uint32_t e : hosted)
      if (e < holds->size()) (*holds)[e] = true;
  }
  for (const auto& [count, by_slice] : slices)
    for (int e = 0; e < num_experts_; ++e) {
      bool all = true;
      for (const std::vector<bool>& slice : by_slice) all = all && slice[e];
      if (all) served[e] = true;
    }
  return static_cast<int>(std::count(served.begin(), served.end(), true));
}

}  // namespace moe
