#include "coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/routing_capacity.h"
#include "model/model_spec.h"
#include "core/log.h"
#include "core/status_macros.h"

namespace moe {

namespace {

constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxExperts = 65536;
constexpr size_t kMaxIdLength = 256;
constexpr size_t kMaxModelPathLength = 4096;  // PATH_MAX

absl::Status CheckId(const std::string& id, const char* field) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (id.size() > kMaxIdLength)
    return absl::InvalidArgumentError(absl::StrCat(field, ": longer than ", kMaxIdLength, " characters"));
  return absl::OkStatus();
}

absl::Status CheckModelPath(const std::string& path) {
  if (path.size() > kMaxModelPathLength)
    return absl::InvalidArgumentError(absl::StrCat("model_path: longer than ", kMaxModelPathLength, " characters"));
  return absl::OkStatus();
}

absl::Status CheckGeometryFields(uint32_t num_layers, uint32_t num_experts) {
  if (num_layers == 0 || num_layers > kMaxLayers)
    return absl::InvalidArgumentError(absl::StrCat("num_layers: ", num_layers, " not in [1, ", kMaxLayers, "]"));
  if (num_experts == 0 || num_experts > kMaxExperts)
    return absl::InvalidArgumentError(absl::StrCat("num_experts: ", num_experts, " not in [1, ", kMaxExperts, "]"));
  return absl::OkStatus();
}

// host:port as workers dial it: a DNS name or IPv4 address (letters, digits,
// '-', '.', no empty label) or a bracketed IPv6 address, and a port in
// [1, 65535]. InvalidArgument naming `field` otherwise.
absl::Status CheckHostPort(const std::string& addr, const char* field) {
  auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": '", addr, "' is not host:port (", why, ")"));
  };
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad("no host or no port");
  const std::string host = addr.substr(0, colon), port = addr.substr(colon + 1);
  int p = 0;
  if (port.empty() || port.size() > 5 || !absl::SimpleAtoi(port, &p) || p < 1 || p > 65535 ||
      port.find_first_not_of("0123456789") != std::string::npos)
    return bad("port must be 1..65535");
  if (host.front() == '[') {
    if (host.back() != ']' || host.size() < 4 || host.find_first_not_of("0123456789abcdefABCDEF:.", 1) != host.size() - 1)
      return bad("bad IPv6 address");
    return absl::OkStatus();
  }
  if (host.size() > 253 || host.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.") !=
                               std::string::npos)
    return bad("host has characters a name or address cannot have");
  if (host.front() == '.' || host.back() == '.' || host.find("..") != std::string::npos) return bad("empty host label");
  return absl::OkStatus();
}

constexpr double kRoundLogSeconds = 10.0;
constexpr double kCapLogSeconds = 10.0;  // at most one line this often about registrations over the cap

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

absl::Status CheckIndexes(const google::protobuf::RepeatedField<uint32_t>& v, uint32_t limit,
                          const std::string& field) {
  std::vector<bool> seen(limit, false);
  for (int i = 0; i < v.size(); ++i) {
    if (v[i] >= limit)
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: ", v[i], " out of range [0, ", limit, ")"));
    if (seen[v[i]]) return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: ", v[i], " listed twice"));
    seen[v[i]] = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(CoordinatorOptions options) {
  if (!options.clock) options.clock = SteadySeconds;
  if (!(options.heartbeat_timeout_seconds > 0))
    return absl::InvalidArgumentError("heartbeat_timeout_seconds must be > 0");
  if (options.purge_after_seconds == 0)
    options.purge_after_seconds = std::max(300.0, 10 * options.heartbeat_timeout_seconds);
  if (!(options.purge_after_seconds > options.heartbeat_timeout_seconds))
    return absl::InvalidArgumentError(absl::StrCat("purge_after_seconds: ", options.purge_after_seconds,
                                                   " must exceed heartbeat_timeout_seconds ",
                                                   options.heartbeat_timeout_seconds));
  if (options.max_registrations_per_peer < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("max_registrations_per_peer: ", options.max_registrations_per_peer, " must be >= 1"));
  if (!(options.max_worker_tokens_per_second >= 1 && options.max_worker_tokens_per_second <= 1e12))
    return absl::InvalidArgumentError(absl::StrCat("max_worker_tokens_per_second: ",
                                                   options.max_worker_tokens_per_second, " is outside [1, 1e12]"));
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options)));
  if (!c->options_.state_file.empty()) {
    MOE_ASSIGN_OR_RETURN(c->admin_, LoadAdminState(c->options_.state_file));
    for (const auto& [key, value] : c->admin_.policy) {
      absl::Status s = c->policy_.Set(key, value);
      if (!s.ok())
        return absl::DataLossError(absl::StrCat("state file '", c->options_.state_file, "': policy ", s.message()));
      LogInfo("coordinator", "policy ", key, "=", value, " (override from the state file)");
    }
    size_t pins = 0;
    for (const auto& [key, experts] : c->admin_.pins) pins += experts.size();
    LogInfo("coordinator", "state file ", c->options_.state_file, ": ", pins, " pinned experts, ",
            c->admin_.policy.size(), " policy overrides, ", c->admin_.drains.size(), " drains");
  }
  if (c->admin_.num_layers > 0) {
    c->registry_ = std::make_unique<Registry>(c->admin_.num_layers, c->admin_.num_experts);
    c->popularity_ = std::make_unique<Popularity>(c->admin_.num_layers, c->admin_.num_experts,
                                                  c->policy_.half_life_seconds);
  }
  return c;
}

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)), started_(options_.clock()), policy_(options_.policy) {
  last_rebalance_ = started_;
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Start(std::chrono::milliseconds tick) {
  thread_ = std::thread([this, tick] {
    std::unique_lock<std::mutex> lock(thread_mu_);
    while (!thread_stop_) {
      thread_cv_.wait_for(lock, tick, [this] { return thread_stop_; });
      if (thread_stop_) break;
      lock.unlock();
      Tick();
      lock.lock();
    }
  });
}

void Coordinator::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  {
    std::lock_guard<std::mutex> lock(thread_mu_);
    thread_stop_ = true;
  }
  thread_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Coordinator::LogEventsLocked(const std::vector<RegistryEvent>& events) {
  for (const RegistryEvent& e : events) LogInfo("coordinator", e.what);
}

absl::Status Coordinator::CheckGeometryLocked(uint32_t num_layers, uint32_t num_experts) {
  if (registry_ != nullptr) {
    if (static_cast<int>(num_layers) != registry_->num_layers())
      return absl::FailedPreconditionError(absl::StrCat("num_layers: ", num_layers, " differs from the model's ",
                                                        registry_->num_layers(), " (set by the first registration)"));
    if (static_cast<int>(num_experts) != registry_->num_experts())
      return absl::FailedPreconditionError(absl::StrCat("num_experts: ", num_experts, " differs from the model's ",
                                                        registry_->num_experts(), " (set by the first registration)"));
    return absl::OkStatus();
  }
  registry_ = std::make_unique<Registry>(num_layers, num_experts);
  popularity_ = std::make_unique<Popularity>(num_layers, num_experts, policy_.half_life_seconds);
  LogInfo("coordinator", "model geometry: ", num_layers, " layers x ", num_experts, " experts");
  AdminState next = admin_;
  next.num_layers = static_cast<int>(num_layers);
  next.num_experts = static_cast<int>(num_experts);
  absl::Status s = CommitLocked(std::move(next));
  if (!s.ok()) LogWarning("coordinator", "cannot persist the model geometry: ", s.message());
  return absl::OkStatus();
}

absl::Status Coordinator::CheckModelLocked(const ModelIdentity& model, const std::string& peer,
                                          bool peer_is_worker) const {
  if (model.digest == 0) return absl::OkStatus();
  auto refuse = [&](const char* kind, const std::string& id, const auto& caps) {
    const ModelIdentity live{caps.model_identity(), caps.model_path()};
    return absl::FailedPreconditionError(absl::StrCat(
        "model_identity: ", peer_is_worker ? "worker '" : "expert server '", peer, "' serves ", model.ToString(),
        ", the live ", kind, " '", id, "' serves ", live.ToString(),
        "; one coordinator serves one model (another registers once no live worker or server holds this one)"));
  };
  for (const auto& [id, w] : registry_->workers())
    if (w.up && !(peer_is_worker && id == peer) && w.caps.model_identity() != 0 &&
        w.caps.model_identity() != model.digest)
      return refuse("worker", id, w.caps);
  for (const auto& [id, s] : registry_->servers())
    if (s.up && !(!peer_is_worker && id == peer) && s.caps.model_identity() != 0 &&
        s.caps.model_identity() != model.digest)
      return refuse("expert server", id, s.caps);
  return absl::OkStatus();
}

absl::Status Coordinator::CommitLocked(AdminState next) {
  if (!options_.state_file.empty()) {
    absl::Status s = SaveAdminState(options_.state_file, next);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("state file not written, change not applied: ", s.message()));
  }
  admin_ = std::move(next);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- registry

absl::StatusOr<moe::v1::RegisterWorkerResponse> Coordinator::RegisterWorker(const moe::v1::RegisterWorkerRequest& req,
                                                                          const std::string& identity,
                                                                          const std::string& peer) {
  MOE_RETURN_IF_ERROR(CheckId(req.worker_id(), "worker_id"));
  if (static_cast<double>(req.max_tokens_per_second()) > options_.max_worker_tokens_per_second)
    return absl::InvalidArgumentError(absl::StrCat("max_tokens_per_second: ", req.max_tokens_per_second(),
                                                   " exceeds the coordinator's --max-worker-tokens-per-second ",
                                                   options_.max_worker_tokens_per_second));
  if (req.top_k() > req.num_experts())
    return absl::InvalidArgumentError(absl::StrCat("top_k: ", req.top_k(), " exceeds num_experts ", req.num_experts()));
  MOE_RETURN_IF_ERROR(CheckModelPath(req.model_path()));
  MOE_RETURN_IF_ERROR(CheckGeometryFields(req.num_layers(), req.num_experts()));
  if (req.slots_per_layer() > req.num_experts())
    return absl::InvalidArgumentError(absl::StrCat("slots_per_layer: ", req.slots_per_layer(), " exceeds num_experts ",
                                                   req.num_experts()));
  MOE_RETURN_IF_ERROR(CheckIndexes(req.cached_layers(), req.num_layers(), "cached_layers"));
  if (req.tp_size() > req.num_experts())
    return absl::InvalidArgumentError(absl::StrCat("tp_size: ", req.tp_size(), " exceeds num_experts ", req.num_experts()));
  if (req.tp_rank() >= std::max(1u, req.tp_size()))
    return absl::InvalidArgumentError(absl::StrCat("tp_rank: ", req.tp_rank(), " out of range [0, ",
                                                   std::max(1u, req.tp_size()), ")"));
  std::vector<bool> seen_layer(req.num_layers(), false);
  for (int i = 0; i < req.current_size(); ++i) {
    const auto& la = req.current(i);
    const std::string field = absl::StrCat("current[", i, "]");
    if (la.layer() >= req.num_layers())
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".layer: ", la.layer(), " out of range [0, ", req.num_layers(), ")"));
    if (seen_layer[la.layer()]) return absl::InvalidArgumentError(absl::StrCat(field, ".layer: ", la.layer(), " listed twice"));
    seen_layer[la.layer()] = true;
    MOE_RETURN_IF_ERROR(CheckIndexes(la.experts(), req.num_experts(), field + ".experts"));
    if (static_cast<uint32_t>(la.experts_size()) > req.slots_per_layer())
      return absl::InvalidArgumentError(absl::StrCat(field, ".experts: ", la.experts_size(), " experts for ",
                                                     req.slots_per_layer(), " slots"));
  }
  moe::v1::RegisterWorkerResponse resp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_RETURN_IF_ERROR(CheckGeometryLocked(req.num_layers(), req.num_experts()));
    MOE_RETURN_IF_ERROR(CheckModelLocked(ModelIdentity{req.model_identity(), req.model_path()}, req.worker_id(), true));
    const WorkerEntry* held = registry_->FindWorker(req.worker_id());
    const bool known = held != nullptr;
    // A live worker's id is its own: taking it over needs its session (its
    // re-registration), its certificate (with mTLS: the same identity, e.g.
    // the worker restarted and lost its session), or waiting for its lease
    // to run out.
    const bool same_certificate = !identity.empty() && held != nullptr && identity == held->identity;
    if (held != nullptr && held->up && Now() - held->last_heartbeat < options_.heartbeat_timeout_seconds &&
        req.session() != held->session && !same_certificate)
      return absl::AlreadyExistsError(absl::StrCat(
          "worker_id: '", req.worker_id(), "' is held by a live worker (heard from ",
          absl::StrFormat("%.1f", Now() - held->last_heartbeat), " s ago); re-register with its session, or after ",
          options_.heartbeat_timeout_seconds, " s of silence"));
    if (held == nullptr || held->peer != peer) MOE_RETURN_IF_ERROR(MakeRoomLocked(/*worker=*/true, peer));
    resp.set_session(registry_->RegisterWorker(req, Now()));
    WorkerEntry& w = *registry_->FindWorker(req.worker_id());
    w.identity = identity;
    w.peer = peer;
    if (!known) {
      w.count_credit = kCountBurstSeconds;  // a new id starts with one burst; a known one keeps what it has
      w.credit_at = Now();
    }
    // The operator's pins the worker still holds stay pinned in the snapshot
    // it resumes from (after a coordinator restart, say): a snapshot without
    // them would unpin them on the worker until the next placement round, and
    // its admissions could evict them meanwhile.
    for (int l = 0; l < static_cast<int>(w.sets.size()); ++l) {
      for (int e : PinsOfLocked(req.worker_id(), l))
        if (std::binary_search(w.sets[l].begin(), w.sets[l].end(), e)) w.pinned[l].push_back(e);
      std::sort(w.pinned[l].begin(), w.pinned[l].end());
    }
    LogInfo("coordinator", known ? "worker re-registered: " : "worker registered: ", req.worker_id(), " (",
            req.slots_per_layer(), " slots x ", req.cached_layers().empty() ? req.num_layers() : req.cached_layers_size(),
            " layers, ", req.expert_bytes(), " bytes/expert, holding version ", req.current_version(),
            "), snapshot version ", w.version);
  }
  changed_.notify_all();
  resp.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  resp.set_heartbeat_timeout_ms(static_cast<uint32_t>(options_.heartbeat_timeout_seconds * 1000));
  return resp;
}

absl::StatusOr<moe::v1::RegisterExpertServerResponse> Coordinator::RegisterExpertServer(
    const moe::v1::RegisterExpertServerRequest& req, const std::string& peer) {
  MOE_RETURN_IF_ERROR(CheckId(req.server_id(), "server_id"));
  if (req.address().empty()) return absl::InvalidArgumentError("address: must not be empty (host:port)");
  MOE_RETURN_IF_ERROR(CheckHostPort(req.address(), "address"));
  MOE_RETURN_IF_ERROR(CheckModelPath(req.model_path()));
  MOE_RETURN_IF_ERROR(CheckGeometryFields(req.num_layers(), req.num_experts()));
  MOE_RETURN_IF_ERROR(CheckIndexes(req.hosted_layers(), req.num_layers(), "hosted_layers"));
  MOE_RETURN_IF_ERROR(CheckIndexes(req.hosted_experts(), req.num_experts(), "hosted_experts"));
  if (req.slice_count() > static_cast<uint32_t>(kMaxSlices) || req.slice_index() >= std::max(1u, req.slice_count()))
    return absl::InvalidArgumentError(absl::StrCat("slice_index/slice_count: ", req.slice_index(), "/",
                                                   req.slice_count(), " is not i/n with i < n <= ", kMaxSlices));
  moe::v1::RegisterExpertServerResponse resp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_RETURN_IF_ERROR(CheckGeometryLocked(req.num_layers(), req.num_experts()));
    MOE_RETURN_IF_ERROR(
        CheckModelLocked(ModelIdentity{req.model_identity(), req.model_path()}, req.server_id(), false));
    const bool draining = admin_.drains.count(req.server_id()) > 0;
    const ServerEntry* held = registry_->FindServer(req.server_id());
    if (held == nullptr || held->peer != peer) MOE_RETURN_IF_ERROR(MakeRoomLocked(/*worker=*/false, peer));
    resp.set_session(registry_->RegisterServer(req, draining, Now()));
    registry_->FindServer(req.server_id())->peer = peer;
    resp.set_draining(draining);
    LogInfo("coordinator", "expert server registered: ", req.server_id(), " at ", req.address(),
            req.shm_socket().empty() ? "" : " + unix://", req.shm_socket(), " (",
            req.hosted_layers().empty() ? "all" : absl::StrCat(req.hosted_layers_size()), " layers, ",
            req.hosted_experts().empty() ? "all" : absl::StrCat(req.hosted_experts_size()), " experts, NUMA node ",
            req.numa_node(), ")",
            draining ? ", draining (admin drain in force)" : "");
  }
  changed_.notify_all();
  resp.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  resp.set_heartbeat_timeout_ms(static_cast<uint32_t>(options_.heartbeat_timeout_seconds * 1000));
  return resp;
}

absl::Status Coordinator::MakeRoomLocked(bool worker, const std::string& peer) {
  const int cap = options_.max_registrations_per_peer;
  const int held = worker ? registry_->WorkersOf(peer) : registry_->ServersOf(peer);
  if (held < cap) return absl::OkStatus();
  // At the cap: the peer's longest-silent registration that is down makes
  // room (a restarted worker under a new id); with all of them live, refused.
  const std::string down = worker ? registry_->LongestDownWorkerOf(peer) : registry_->LongestDownServerOf(peer);
  if (!down.empty()) {
    LogInfo("coordinator", worker ? "worker " : "server ", down, " (down) forgotten: ",
            peer.empty() ? "its peer" : peer, " registers another at its cap of ", cap);
    ForgetLocked(worker, down);
    return absl::OkStatus();
  }
  ++refused_registrations_;
  const double now = Now();
  ++unlogged_cap_refusals_;
  if (now - last_cap_log_ >= kCapLogSeconds) {
    LogWarning("coordinator", "refused ", unlogged_cap_refusals_, " registration(s) over the cap of ", cap,
               " per peer (--max-registrations-per-peer); the last from ", peer.empty() ? "an unknown peer" : peer);
    unlogged_cap_refusals_ = 0;
    last_cap_log_ = now;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      worker ? "worker_id" : "server_id", ": ", peer.empty() ? "this peer" : peer, " already holds ", held, " live ",
      worker ? "worker" : "expert-server", " registrations, the cap (--max-registrations-per-peer ", cap,
      "); one must stop heartbeating for --heartbeat-timeout-seconds (", options_.heartbeat_timeout_seconds,
      ") before another id registers"));
}

void Coordinator::ForgetLocked(bool worker, const std::string& id) {
  ++purged_registrations_;
  if (worker) {
    registry_->RemoveWorker(id);
    popularity_->Remove(id);
  } else {
    registry_->RemoveServer(id);
  }
}

absl::Status Coordinator::CheckCountsLocked(WorkerEntry& w,
                                            const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts,
                                            double now) {
  RoutingCapacity capacity;
  capacity.num_experts = registry_->num_experts();
  capacity.tokens_per_second = w.caps.max_tokens_per_second() > 0
                                   ? static_cast<double>(w.caps.max_tokens_per_second())
                                   : options_.max_worker_tokens_per_second;
  capacity.top_k = w.caps.top_k() > 0 ? static_cast<int>(w.caps.top_k()) : capacity.num_experts;
  absl::StatusOr<RoutingDemand> demand = CheckCounts(counts, registry_->num_layers(), w.cached, capacity);
  // The credit the worker has now: what it had, plus the time since, up to a burst.
  const double credit = std::min(kCountBurstSeconds, w.count_credit + std::max(0.0, now - w.credit_at));
  absl::Status refusal;
  if (!demand.ok()) {
    refusal = demand.status();
  } else if (demand->seconds > credit) {
    refusal = absl::InvalidArgumentError(absl::StrFormat(
        "%s: %.6g %s exceed what worker '%s' could have routed since its last accepted report: %.3g s (its "
        "credit, at most a %.0f s burst) at %.6g a second (max_tokens_per_second %.6g, top_k %d; the rate is at "
        "most --max-worker-tokens-per-second)",
        demand->field, demand->amount, demand->what, w.caps.worker_id(), credit, kCountBurstSeconds,
        demand->per_second, capacity.tokens_per_second, capacity.top_k));
  }
  if (!refusal.ok()) {
    ++refused_count_reports_;
    if (!w.count_refusal_logged) {
      LogWarning("coordinator", "refused the counts of worker ", w.caps.worker_id(), " (logged once per worker; ",
                 "moe_coordinator_refused_count_reports_total counts them all): ", refusal.message());
      w.count_refusal_logged = true;
    }
    return refusal;
  }
  w.count_credit = credit - demand->seconds;
  w.credit_at = now;
  return absl::OkStatus();
}

void Coordinator::AddCountsLocked(const std::string& worker,
                                  const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts,
                                  double now) {
  for (const auto& c : counts) {
    for (int j = 0; j < c.experts_size(); ++j) {
      popularity_->Add(worker, c.layer(), c.experts(j), static_cast<double>(c.pairs(j)),
                       c.hits_size() ? static_cast<double>(c.hits(j)) : 0.0, now);
    }
    double pairs = 0;
    for (uint64_t p : c.pairs()) pairs += static_cast<double>(p);
    if (c.cache_copies() || c.copy_bytes() || c.predicted() || pairs > 0 || c.link_microseconds()) {
      if (activity_.size() < static_cast<size_t>(registry_->num_layers())) activity_.resize(registry_->num_layers());
      LayerActivitySums& a = activity_[c.layer()];
      const double keep = std::exp2(-(now - a.at) / policy_.half_life_seconds);
      a.copies = a.copies * keep + static_cast<double>(c.cache_copies());
      a.bytes = a.bytes * keep + static_cast<double>(c.copy_bytes());
      a.predicted = a.predicted * keep + static_cast<double>(c.predicted());
      a.used = a.used * keep + static_cast<double>(std::min(c.predicted_used(), c.predicted()));
      // The split: a report's CPU and copied pairs never count for more than its pairs.
      const double cpu = std::min(static_cast<double>(c.cpu_pairs()), pairs);
      a.pairs = a.pairs * keep + pairs;
      a.cpu = a.cpu * keep + cpu;
      const double copied = std::min(static_cast<double>(c.copied_pairs()), pairs - cpu);
      a.copied = a.copied * keep + copied;
      a.prefetched = a.prefetched * keep + std::min(static_cast<double>(c.prefetched_pairs()), copied);
      a.link_s = a.link_s * keep + static_cast<double>(c.link_microseconds()) * 1e-6;
      a.at = now;
    }
  }
}

absl::StatusOr<moe::v1::HeartbeatResponse> Coordinator::Heartbeat(const moe::v1::HeartbeatRequest& req) {
  if (req.worker_id().empty() == req.server_id().empty())
    return absl::InvalidArgumentError("worker_id, server_id: exactly one must be set");
  moe::v1::HeartbeatResponse resp;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const double now = Now();
    if (!req.worker_id().empty()) {
      if (registry_ == nullptr) return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", req.worker_id(), "' (register first)"));
      MOE_ASSIGN_OR_RETURN(WorkerEntry* const w, registry_->Worker(req.worker_id(), req.session()));
      MOE_RETURN_IF_ERROR(CheckCountsLocked(*w, req.counts(), now));
      // A report, not an input to any decision: bounded, and kept as given.
      if (req.planner_rates_size() > 32)
        return absl::InvalidArgumentError(absl::StrCat("planner_rates: ", req.planner_rates_size(), " entries (at most 32)"));
      for (const auto& [name, value] : req.planner_rates())
        if (name.empty() || name.size() > 64 || !std::isfinite(value))
          return absl::InvalidArgumentError(absl::StrCat("planner_rates: entry '", name.substr(0, 64),
                                                         "' (names of 1-64 characters, finite values)"));
      if (!w->up) LogInfo("coordinator", "worker ", req.worker_id(), " is back");
      registry_->WorkerAlive(*w, now);
      if (req.applied_version() > w->acked && req.applied_version() <= w->version)
        w->acked = req.applied_version();
      AddCountsLocked(req.worker_id(), req.counts(), now);
      if (!req.planner_rates().empty())
        w->planner_rates = std::map<std::string, double>(req.planner_rates().begin(), req.planner_rates().end());
      resp.set_latest_version(w->version);
    } else {
      if (!req.counts().empty()) return absl::InvalidArgumentError("counts: only workers report counts");
      if (registry_ == nullptr) return absl::NotFoundError(absl::StrCat("server_id: unknown server '", req.server_id(), "' (register first)"));
      MOE_ASSIGN_OR_RETURN(ServerEntry* const s, registry_->Server(req.server_id(), req.session()));
      if (!s->up) LogInfo("coordinator", "server ", req.server_id(), " is back");
      registry_->ServerAlive(*s, now);
      s->inflight = req.inflight_requests();
      resp.set_draining(s->draining);
      resp.set_drained(s->drained);
    }
  }
  changed_.notify_all();
  return resp;
}

absl::Status Coordinator::ReportStats(const moe::v1::ReportStatsRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registry_ == nullptr)
    return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", req.worker_id(), "' (register first)"));
  MOE_ASSIGN_OR_RETURN(WorkerEntry* const w, registry_->Worker(req.worker_id(), req.session()));
  const double now = Now();
  MOE_RETURN_IF_ERROR(CheckCountsLocked(*w, req.counts(), now));
  AddCountsLocked(req.worker_id(), req.counts(), now);
  return absl::OkStatus();
}

absl::StatusOr<moe::v1::CacheAssignment> Coordinator::Snapshot(const std::string& worker_id, uint64_t session) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return absl::UnavailableError("coordinator shutting down");
  if (registry_ == nullptr)
    return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", worker_id, "' (register first)"));
  MOE_ASSIGN_OR_RETURN(WorkerEntry* const w, registry_->Worker(worker_id, session));
  return registry_->Snapshot(*w);
}

absl::StatusOr<std::optional<moe::v1::CacheAssignment>> Coordinator::WaitForAssignment(
    const std::string& worker_id, uint64_t session, uint64_t after, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopping_) return absl::UnavailableError("coordinator shutting down");
    MOE_ASSIGN_OR_RETURN(WorkerEntry* const w, registry_->Worker(worker_id, session));
    if (w->version > after) return std::optional<moe::v1::CacheAssignment>(registry_->Delta(*w, after));
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) return std::nullopt;
  }
}

// ---------------------------------------------------------------- placement

std::vector<int> Coordinator::PinsOfLocked(const std::string& worker, int layer) const {
  std::set<int> out;
  for (const std::string& who : {std::string(), worker}) {
    auto it = admin_.pins.find({who, layer});
    if (it != admin_.pins.end()) out.insert(it->second.begin(), it->second.end());
  }
  return {out.begin(), out.end()};
}

bool Coordinator::PinsMissingLocked() const {
  if (registry_ == nullptr || admin_.pins.empty()) return false;
  for (const auto& [id, w] : registry_->workers()) {
    if (!w.up || w.acked < w.version) continue;
    for (const auto& [key, experts] : admin_.pins) {
      if (!key.first.empty() && key.first != id) continue;
      const int l = key.second;
      if (l >= registry_->num_layers() || !w.cached[l]) continue;
      int held = 0;
      for (int e : experts) held += std::binary_search(w.sets[l].begin(), w.sets[l].end(), e) ? 1 : 0;
      if (held < std::min<int>(experts.size(), w.caps.slots_per_layer())) return true;
    }
  }
  return false;
}

PlacementProblem Coordinator::PlacementProblemLocked(bool pins_only, double now, std::vector<std::string>* ids) const {
  const int nl = registry_->num_layers();
  PlacementProblem p;
  p.num_layers = nl;
  p.num_experts = registry_->num_experts();
  p.params.mode = policy_.placement;
  p.params.hysteresis_margin = policy_.hysteresis_margin;
  p.params.copy_cost_hits = policy_.copy_cost_hits;
  p.params.replicate_share = policy_.replicate_share;
  for (int l = 0; l < nl; ++l) p.global_popularity.push_back(popularity_->Layer(l, now).counts);
  const double round_seconds = policy_.rebalance_interval_seconds > 0 ? policy_.rebalance_interval_seconds : 1.0;
  for (const auto& [id, w] : registry_->workers()) {
    if (!w.up) continue;
    ids->push_back(id);
    WorkerPlacementState s;
    s.id = id;
    s.slots_per_layer = static_cast<int>(w.caps.slots_per_layer());
    s.group = TensorParallel(static_cast<int>(w.caps.tp_rank()), std::max(1, static_cast<int>(w.caps.tp_size())));
    s.expert_bytes = w.caps.expert_bytes();
    if (pins_only) {
      s.budget_bytes = 0;
    } else if (policy_.copy_budget_gbps > 0) {
      s.budget_bytes = static_cast<uint64_t>(policy_.copy_budget_gbps * 1e9 * round_seconds);
    }
    s.frozen = w.acked < w.version;
    s.cached = w.cached;
    s.resident = w.sets;
    s.pinned.resize(nl);
    for (int l = 0; l < nl; ++l) s.pinned[l] = PinsOfLocked(id, l);
    if (const DecayedCounts* own = popularity_->worker(id); own != nullptr) {
      for (int l = 0; l < nl; ++l) s.popularity.push_back(own->Layer(l, now));
    }
    p.workers.push_back(std::move(s));
  }
  return p;
}

moe::v1::RebalanceResponse Coordinator::RebalanceLocked(bool dry_run, bool pins_only, double now) {
  moe::v1::RebalanceResponse resp;
  resp.set_dry_run(dry_run);
  if (registry_ == nullptr) return resp;
  std::vector<std::string> ids;
  const PlacementProblem p = PlacementProblemLocked(pins_only, now, &ids);
  const PlacementPlan plan = PlanPlacement(p);
  for (const PlannedMove& m : plan.moves) {
    moe::v1::PlannedCopy* c = resp.add_copies();
    c->set_worker_id(ids[m.worker]);
    c->set_layer(m.layer);
    c->set_expert(m.expert);
    c->set_evicted(m.evicted);
    c->set_gain(m.gain);
    c->set_pinned(m.pinned);
  }
  resp.set_hit_rate_before(plan.hit_rate_before_all);
  resp.set_hit_rate_after(plan.hit_rate_after_all);
  resp.set_union_coverage_before(plan.coverage_before);
  resp.set_union_coverage_after(plan.coverage_after);
  uint64_t total_bytes = 0;
  size_t updated = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    moe::v1::WorkerPlan* wp = resp.add_workers();
    wp->set_worker_id(ids[i]);
    wp->set_bytes(plan.bytes[i]);
    wp->set_budget_bytes(p.workers[i].budget_bytes == kUnlimitedBudget ? 0 : p.workers[i].budget_bytes);
    wp->set_hit_rate_before(plan.hit_rate_before[i]);
    wp->set_hit_rate_after(plan.hit_rate_after[i]);
    wp->set_skipped(p.workers[i].frozen);
    total_bytes += plan.bytes[i];
    if (dry_run || p.workers[i].frozen) continue;
    WorkerEntry& w = *registry_->FindWorker(ids[i]);
    const uint64_t v = registry_->Assign(w, plan.sets[i], p.workers[i].pinned);
    if (v == 0) continue;
    wp->set_version(v);
    ++updated;
    for (const PlannedMove& m : plan.moves) w.copies_issued += m.worker == static_cast<int>(i) ? 1 : 0;
    w.bytes_issued += plan.bytes[i];
  }
  if (!dry_run) {
    if (!pins_only) ++rebalances_;
    LogRoundLocked(plan, pins_only, total_bytes, updated, now);
  }
  return resp;
}

void Coordinator::LogRoundLocked(const PlacementPlan& plan, bool pins_only, uint64_t bytes, size_t updated,
                                 double now) {
  // Rounds run several times a second: one log line per kRoundLogSeconds at most.
  unlogged_.rounds += pins_only ? 0 : 1;
  unlogged_.copies += plan.moves.size();
  unlogged_.bytes += bytes;
  unlogged_.updates += updated;
  if (unlogged_.copies > 0 && (pins_only || now - last_round_log_ >= kRoundLogSeconds)) {
    LogInfo("coordinator", pins_only ? "pins placed; " : "", "placement: ", unlogged_.copies, " copies (",
            unlogged_.bytes, " bytes) in ", unlogged_.updates, " assignments over ", unlogged_.rounds,
            " rounds; last: expected hit rate ", plan.hit_rate_before_all, " -> ", plan.hit_rate_after_all,
            ", union coverage ", plan.coverage_before, " -> ", plan.coverage_after);
    unlogged_ = {};
    last_round_log_ = now;
  }
}

void Coordinator::Tick() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (registry_ == nullptr || stopping_) return;
    const double now = Now();
    LogEventsLocked(registry_->Expire(now, options_.heartbeat_timeout_seconds));
    PurgeLocked(now);
    LogEventsLocked(registry_->UpdateDrains(now));
    if (PinsMissingLocked()) RebalanceLocked(/*dry_run=*/false, /*pins_only=*/true, now);
    if (policy_.rebalance_interval_seconds > 0 && now - last_rebalance_ >= policy_.rebalance_interval_seconds) {
      RebalanceLocked(/*dry_run=*/false, /*pins_only=*/false, now);
      last_rebalance_ = now;
    }
  }
  changed_.notify_all();
}

void Coordinator::PurgeLocked(double now) {
  const Registry::Purged purged = registry_->Purge(now, options_.purge_after_seconds);
  for (const std::string& id : purged.workers) popularity_->Remove(id);
  const size_t n = purged.workers.size() + purged.servers.size();
  if (n == 0) return;
  purged_registrations_ += n;
  std::string ids;
  size_t listed = 0;
  for (const auto* list : {&purged.workers, &purged.servers})
    for (const std::string& id : *list)
      if (listed++ < 5) absl::StrAppend(&ids, ids.empty() ? "" : ", ", id);
  LogInfo("coordinator", "forgot ", purged.workers.size(), " worker(s) and ", purged.servers.size(),
          " server(s) silent for over ", options_.purge_after_seconds, " s (--purge-after-seconds): ", ids,
          n > 5 ? ", ..." : "");
}

// ---------------------------------------------------------------- admin

}  // namespace moe
