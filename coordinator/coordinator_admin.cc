// Coordinator's admin and status surface (coordinator.h): Status, the
// popularity view, rebalance, pins, the policy and drains. The registration,
// heartbeat and placement rounds are in coordinator.cc.
#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/coordinator.h"
#include "core/log.h"
#include "model/model_spec.h"
#include "core/status_macros.h"

namespace moe {

namespace {

std::string ServerState(const ServerEntry& s) {
  if (s.draining) return s.drained ? "drained" : "draining";
  return s.up ? "up" : "down";
}

}  // namespace

moe::v1::PolicyParameters Coordinator::PolicyProtoLocked() const {
  moe::v1::PolicyParameters p;
  p.set_half_life_seconds(policy_.half_life_seconds);
  p.set_placement(PlacementModeName(policy_.placement));
  p.set_copy_budget_gbps(policy_.copy_budget_gbps);
  p.set_hysteresis_margin(policy_.hysteresis_margin);
  p.set_copy_cost_hits(policy_.copy_cost_hits);
  p.set_replicate_share(policy_.replicate_share);
  p.set_rebalance_interval_seconds(policy_.rebalance_interval_seconds);
  return p;
}

void Coordinator::FillWorkerStatusLocked(const std::string& id, const WorkerEntry& w, double now,
                                         moe::v1::WorkerStatus* ws) const {
  ws->set_worker_id(id);
  ws->set_state(w.up ? "up" : "down");
  ws->set_address(w.caps.address());
  ws->set_hostname(w.caps.hostname());
  ws->set_slots_per_layer(w.caps.slots_per_layer());
  ws->set_tp_rank(w.caps.tp_rank());
  ws->set_tp_size(w.caps.tp_size());
  ws->set_cached_layers(static_cast<uint32_t>(std::count(w.cached.begin(), w.cached.end(), true)));
  ws->set_expert_bytes(w.caps.expert_bytes());
  ws->set_gpu_memory_bytes(w.caps.gpu_memory_bytes());
  ws->set_assigned_version(w.version);
  ws->set_acked_version(w.acked);
  ws->set_seconds_since_heartbeat(now - w.last_heartbeat);
  ws->set_copies_issued(w.copies_issued);
  ws->set_bytes_issued(w.bytes_issued);
  ws->mutable_planner_rates()->insert(w.planner_rates.begin(), w.planner_rates.end());
  if (const DecayedCounts* own = popularity_->worker(id); own != nullptr) {
    double hits = 0, pairs = 0;
    for (int l = 0; l < registry_->num_layers(); ++l) {
      hits += own->LayerHits(l, now);
      pairs += own->LayerPairs(l, now);
    }
    ws->set_hit_rate(pairs > 0 ? hits / pairs : 0.0);
  }
}

moe::v1::StatusResponse Coordinator::Status() {
  std::lock_guard<std::mutex> lock(mu_);
  const double now = Now();
  moe::v1::StatusResponse r;
  r.set_version(options_.version);
  r.set_uptime_seconds(now - started_);
  *r.mutable_policy() = PolicyProtoLocked();
  r.set_rebalances(rebalances_);
  r.set_refused_count_reports(refused_count_reports_);
  r.set_refused_registrations(refused_registrations_);
  r.set_purged_registrations(purged_registrations_);
  if (registry_ == nullptr) return r;
  r.set_num_layers(registry_->num_layers());
  r.set_num_experts(registry_->num_experts());
  // One model (CheckModelLocked): any live peer that reported it names it.
  for (const auto& [id, s] : registry_->servers())
    if (s.up && s.caps.model_identity() != 0 && r.model_identity().empty())
      r.set_model_identity(ModelIdentity{s.caps.model_identity(), s.caps.model_path()}.ToString());
  for (const auto& [id, w] : registry_->workers())
    if (w.up && w.caps.model_identity() != 0 && r.model_identity().empty())
      r.set_model_identity(ModelIdentity{w.caps.model_identity(), w.caps.model_path()}.ToString());
  for (const auto& [id, s] : registry_->servers())
    if (s.up && !s.caps.model_type().empty() && r.model_type().empty()) {
      r.set_model_type(s.caps.model_type());
      r.set_expert_math(s.caps.expert_math());
      r.set_routing(s.caps.routing());
    }
  for (const auto& [id, w] : registry_->workers()) FillWorkerStatusLocked(id, w, now, r.add_workers());
  for (const auto& [id, s] : registry_->servers()) {
    moe::v1::ServerStatus* ss = r.add_servers();
    ss->set_server_id(id);
    ss->set_state(ServerState(s));
    ss->set_address(s.caps.address());
    ss->set_shm_socket(s.caps.shm_socket());
    ss->set_hostname(s.caps.hostname());
    ss->set_weight_format(s.caps.weight_format());
    ss->set_numa_node(s.caps.numa_node());
    ss->set_hosted_layers(s.caps.hosted_layers().empty() ? registry_->num_layers() : s.caps.hosted_layers_size());
    ss->set_hosted_experts(s.caps.hosted_experts().empty() ? registry_->num_experts() : s.caps.hosted_experts_size());
    ss->set_slice_index(s.caps.slice_index());
    ss->set_slice_count(s.caps.slice_count());
    ss->set_inflight_requests(s.inflight);
    ss->set_seconds_since_heartbeat(now - s.last_heartbeat);
  }
  double hits = 0, pairs = 0;
  for (int l = 0; l < registry_->num_layers(); ++l) {
    moe::v1::LayerStatus* ls = r.add_layers();
    const Popularity::Combined combined = popularity_->Layer(l, now);
    const double h = combined.hits, n = combined.pairs;
    ls->set_layer(l);
    ls->set_hit_rate(n > 0 ? h / n : 0.0);
    ls->set_pairs(n);
    ls->set_routable_experts(registry_->RoutableExperts(l));
    if (static_cast<size_t>(l) < activity_.size()) {
      // A decayed sum of a steady rate r tends to r * half-life / ln 2.
      const LayerActivitySums& a = activity_[l];
      const double keep = std::exp2(-(now - a.at) / policy_.half_life_seconds);
      const double per_second = keep * std::log(2.0) / policy_.half_life_seconds;
      ls->set_prediction_precision(a.predicted > 0 ? a.used / a.predicted : 0.0);
      ls->set_copies_per_second(a.copies * per_second);
      ls->set_pcie_bytes_per_second(a.bytes * per_second);
      ls->set_cpu_share(a.pairs > 0 ? a.cpu / a.pairs : 0.0);
      ls->set_copied_share(a.pairs > 0 ? a.copied / a.pairs : 0.0);
      ls->set_prefetched_share(a.pairs > 0 ? a.prefetched / a.pairs : 0.0);
      ls->set_pcie_busy_share(a.link_s * per_second);
    }
    hits += h;
    pairs += n;
  }
  r.set_overall_hit_rate(pairs > 0 ? hits / pairs : 0.0);
  return r;
}

absl::StatusOr<moe::v1::PopularityResponse> Coordinator::GetPopularity(const moe::v1::PopularityRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registry_ == nullptr) return absl::FailedPreconditionError("no worker or server has registered yet");
  const uint32_t nl = registry_->num_layers(), ne = registry_->num_experts();
  if (req.layer() >= nl)
    return absl::InvalidArgumentError(absl::StrCat("layer: ", req.layer(), " out of range [0, ", nl, ")"));
  const double now = Now();
  std::vector<double> counts(ne, 0.0);
  if (!req.worker_id().empty()) {
    if (registry_->FindWorker(req.worker_id()) == nullptr)
      return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", req.worker_id(), "'"));
    if (const DecayedCounts* own = popularity_->worker(req.worker_id()); own != nullptr)
      counts = own->Layer(req.layer(), now);
  } else {
    counts = popularity_->Layer(req.layer(), now).counts;
  }
  double total = 0;
  for (double c : counts) total += c;
  std::vector<int> order(ne);
  for (uint32_t e = 0; e < ne; ++e) order[e] = static_cast<int>(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return counts[a] > counts[b]; });
  if (req.top() > 0 && req.top() < ne) order.resize(req.top());
  std::set<int> pinned;
  for (const auto& [key, experts] : admin_.pins) {
    if (key.second == static_cast<int>(req.layer()) && (req.worker_id().empty() || key.first.empty() || key.first == req.worker_id()))
      pinned.insert(experts.begin(), experts.end());
  }
  moe::v1::PopularityResponse r;
  r.set_layer(req.layer());
  r.set_total(total);
  r.set_half_life_seconds(policy_.half_life_seconds);
  for (int e : order) {
    moe::v1::ExpertPopularity* ep = r.add_experts();
    ep->set_expert(e);
    ep->set_count(counts[e]);
    ep->set_share(total > 0 ? counts[e] / total : 0.0);
    ep->set_pinned(pinned.count(e) > 0);
    for (const auto& [id, w] : registry_->workers()) {
      const auto& s = w.sets[req.layer()];
      if (std::binary_search(s.begin(), s.end(), e)) ep->add_resident_on(id);
    }
  }
  return r;
}

absl::StatusOr<moe::v1::RebalanceResponse> Coordinator::Rebalance(bool dry_run) {
  moe::v1::RebalanceResponse r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (registry_ == nullptr) return absl::FailedPreconditionError("no worker has registered yet");
    const double now = Now();
    r = RebalanceLocked(dry_run, /*pins_only=*/false, now);
    if (!dry_run) last_rebalance_ = now;
  }
  changed_.notify_all();
  return r;
}

absl::StatusOr<moe::v1::PinResponse> Coordinator::Pin(const moe::v1::PinRequest& req, bool pin) {
  moe::v1::PinResponse r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (registry_ == nullptr)
      return absl::FailedPreconditionError("model geometry unknown: no worker or server has registered yet");
    const uint32_t nl = registry_->num_layers(), ne = registry_->num_experts();
    if (req.layer() >= nl)
      return absl::InvalidArgumentError(absl::StrCat("layer: ", req.layer(), " out of range [0, ", nl, ")"));
    // A layer without experts (e.g. DeepSeek's first dense layers) is cached by
    // no worker and hosted by no server: pinning there would be a silent no-op.
    bool moe_layer = false;
    for (const auto& [id, w] : registry_->workers()) moe_layer |= req.layer() < w.cached.size() && w.cached[req.layer()];
    for (const auto& [id, sv] : registry_->servers()) {
      const auto& hosted = sv.caps.hosted_layers();
      moe_layer |= hosted.empty() || std::find(hosted.begin(), hosted.end(), req.layer()) != hosted.end();
    }
    if (!moe_layer)
      return absl::InvalidArgumentError(absl::StrCat("layer: ", req.layer(),
                                                     " is not an MoE layer of any registered worker or server"));
    if (req.experts().empty()) return absl::InvalidArgumentError("experts: must not be empty");
    MOE_RETURN_IF_ERROR(CheckIndexes(req.experts(), ne, "experts"));
    if (!req.worker_id().empty() && registry_->FindWorker(req.worker_id()) == nullptr)
      return absl::NotFoundError(absl::StrCat("worker_id: unknown worker '", req.worker_id(), "'"));
    AdminState next = admin_;
    std::set<int>& set = next.pins[{req.worker_id(), static_cast<int>(req.layer())}];
    for (uint32_t e : req.experts()) {
      if (pin) {
        set.insert(static_cast<int>(e));
      } else {
        set.erase(static_cast<int>(e));
      }
    }
    if (set.empty()) next.pins.erase({req.worker_id(), static_cast<int>(req.layer())});
    if (pin) {
      for (const auto& [id, w] : registry_->workers()) {
        if (!req.worker_id().empty() && id != req.worker_id()) continue;
        std::set<int> all;
        for (const std::string& who : {std::string(), id}) {
          auto it = next.pins.find({who, static_cast<int>(req.layer())});
          if (it != next.pins.end()) all.insert(it->second.begin(), it->second.end());
        }
        if (all.size() > w.caps.slots_per_layer())
          return absl::InvalidArgumentError(absl::StrCat("experts: ", all.size(), " experts pinned in layer ",
                                                         req.layer(), " exceed the ", w.caps.slots_per_layer(),
                                                         " slots of worker ", id));
      }
    }
    MOE_RETURN_IF_ERROR(CommitLocked(std::move(next)));
    std::string list;
    for (uint32_t e : req.experts()) absl::StrAppend(&list, list.empty() ? "" : ",", e);
    LogInfo("coordinator", pin ? "pin" : "unpin", " layer ", req.layer(), " experts ", list, " on ",
            req.worker_id().empty() ? "every worker" : req.worker_id());
    // A pin places its experts now; either way the workers learn the new pin
    // set (an unpinned expert becomes evictable by their admissions).
    RebalanceLocked(/*dry_run=*/false, /*pins_only=*/true, Now());
    for (const auto& [key, experts] : admin_.pins) {
      moe::v1::Pin* p = r.add_pins();
      p->set_worker_id(key.first);
      p->set_layer(key.second);
      for (int e : experts) p->add_experts(e);
    }
  }
  changed_.notify_all();
  return r;
}

moe::v1::PolicyParameters Coordinator::GetPolicy() {
  std::lock_guard<std::mutex> lock(mu_);
  return PolicyProtoLocked();
}

absl::StatusOr<moe::v1::PolicyParameters> Coordinator::SetPolicy(const moe::v1::SetPolicyRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req.values().empty()) return absl::InvalidArgumentError("values: nothing to set (KEY=VALUE)");
  CoordinatorPolicy next_policy = policy_;
  AdminState next = admin_;
  for (const auto& [key, value] : req.values()) {
    MOE_RETURN_IF_ERROR(next_policy.Set(key, value));
  }
  const std::map<std::string, std::string> text = next_policy.ToMap();
  for (const auto& [key, value] : req.values()) next.policy[key] = text.at(key);
  MOE_RETURN_IF_ERROR(CommitLocked(std::move(next)));
  if (popularity_ != nullptr && next_policy.half_life_seconds != policy_.half_life_seconds)
    popularity_->SetHalfLife(next_policy.half_life_seconds, Now());
  policy_ = next_policy;
  for (const auto& [key, value] : req.values()) LogInfo("coordinator", "policy ", key, "=", text.at(key));
  return PolicyProtoLocked();
}

moe::v1::DrainResponse Coordinator::DrainStatusLocked(const ServerEntry& s) const {
  moe::v1::DrainResponse r;
  r.set_server_id(s.caps.server_id());
  r.set_state(ServerState(s));
  r.set_inflight_requests(s.inflight);
  if (s.draining && !s.drained) {
    for (const std::string& w : registry_->DrainPending(s)) r.add_workers_pending(w);
  }
  return r;
}

absl::StatusOr<moe::v1::DrainResponse> Coordinator::Drain(const moe::v1::DrainRequest& req) {
  moe::v1::DrainResponse r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (req.server_id().empty()) return absl::InvalidArgumentError("server_id: must not be empty");
    ServerEntry* s = registry_ == nullptr ? nullptr : registry_->FindServer(req.server_id());
    if (s == nullptr && req.cancel() && admin_.drains.count(req.server_id()) > 0) {
      // A drained server that was forgotten (silent past --purge-after-seconds):
      // lifting its persisted drain needs no registration.
      AdminState next = admin_;
      next.drains.erase(req.server_id());
      MOE_RETURN_IF_ERROR(CommitLocked(std::move(next)));
      LogInfo("coordinator", "undrain ", req.server_id(), ": not registered now; routed again once it registers");
      r.set_server_id(req.server_id());
      r.set_state("down");
      return r;
    }
    if (s == nullptr) return absl::NotFoundError(absl::StrCat("server_id: unknown server '", req.server_id(), "'"));
    const bool draining = !req.cancel();
    if (s->draining != draining) {
      AdminState next = admin_;
      if (draining) {
        next.drains.insert(req.server_id());
      } else {
        next.drains.erase(req.server_id());
      }
      MOE_RETURN_IF_ERROR(CommitLocked(std::move(next)));
      registry_->SetDraining(*s, draining);
      LogInfo("coordinator", draining ? "drain " : "undrain ", req.server_id(),
              draining ? ": no longer routed; waiting for workers and in-flight work" : ": routed again");
      LogEventsLocked(registry_->UpdateDrains(Now()));
    }
    r = DrainStatusLocked(*s);
  }
  changed_.notify_all();
  return r;
}

}  // namespace moe
