#include "coordinator/coordinator_metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

CoordinatorMetrics::CoordinatorMetrics(MetricsRegistry& r, Coordinator& coordinator)
    : coordinator_(coordinator),
      workers_(r.AddGauge("moe_coordinator_workers", "GPU workers known, by state (up, down).", {"state"})),
      servers_(r.AddGauge("moe_coordinator_servers", "CPU expert servers known, by state (up, down, draining, drained).",
                          {"state"})),
      assigned_version_(r.AddGauge("moe_coordinator_worker_assigned_version",
                                   "Newest cache assignment version issued to the worker.", {"worker"})),
      acked_version_(r.AddGauge("moe_coordinator_worker_acked_version",
                                "Newest assignment version the worker acknowledged as applied.", {"worker"})),
      worker_hit_rate_(r.AddGauge("moe_coordinator_worker_hit_rate",
                                  "Decayed share of the worker's (token, expert) pairs served from its cache.",
                                  {"worker"})),
      copies_(r.AddCounter("moe_coordinator_copies_total", "Expert copies the coordinator assigned to the worker.",
                           {"worker"})),
      copied_bytes_(r.AddCounter("moe_coordinator_copied_bytes_total", "Bytes of the expert copies assigned.",
                                 {"worker"})),
      layer_hit_rate_(r.AddGauge("moe_coordinator_layer_hit_rate",
                                 "Decayed share of a layer's pairs served from GPU caches, all workers.", {"layer"})),
      routable_experts_(r.AddGauge("moe_coordinator_layer_routable_experts",
                                   "Experts of the layer that some up, non-draining expert server hosts.", {"layer"})),
      prediction_precision_(r.AddGauge("moe_coordinator_layer_prediction_precision",
                                       "Decayed share of the experts workers predicted for the layer that its runs "
                                       "used (predictive cache policy; 0: no predictions).",
                                       {"layer"})),
      copies_per_second_(r.AddGauge("moe_coordinator_layer_copies_per_second",
                                    "Decayed rate of expert copies into the layer's cache slots, all workers.",
                                    {"layer"})),
      pcie_bytes_per_second_(r.AddGauge("moe_coordinator_layer_pcie_bytes_per_second",
                                        "Decayed rate of host->GPU bytes those copies moved.", {"layer"})),
      layer_split_(r.AddGauge("moe_coordinator_layer_pair_share",
                              "Decayed share of the layer's pairs by where workers computed them: cpu (expert "
                              "servers) or copied (to the GPU for the call); hits: moe_coordinator_layer_hit_rate.",
                              {"layer", "where"})),
      pcie_busy_share_(r.AddGauge("moe_coordinator_layer_pcie_busy_share",
                                  "Decayed host->GPU link seconds per second of the layer's copies, all workers.",
                                  {"layer"})),
      hit_rate_(r.AddGauge("moe_coordinator_hit_rate", "Decayed share of all pairs served from GPU caches.").Get()),
      rebalances_(r.AddCounter("moe_coordinator_rebalances_total", "Placement rounds run.").Get()),
      refused_count_reports_(r.AddCounter("moe_coordinator_refused_count_reports_total",
                                          "Worker heartbeats and stats reports whose access counts were refused "
                                          "(out of range, duplicated, or more than the worker could have routed).")
                                 .Get()),
      refused_registrations_(r.AddCounter("moe_coordinator_refused_registrations_total",
                                          "Registrations refused at the cap per peer (--max-registrations-per-peer).")
                                 .Get()),
      purged_registrations_(r.AddCounter("moe_coordinator_purged_registrations_total",
                                         "Worker and server registrations forgotten after their lease ran out "
                                         "(--purge-after-seconds) or to make room at a peer's cap.")
                                .Get()),
      hook_(r.AddScrapeHook([this] { Refresh(); })) {}

void CoordinatorMetrics::Refresh() {
  const moe::v1::StatusResponse st = coordinator_.Status();
  std::map<std::string, int> workers = {{"up", 0}, {"down", 0}};
  std::map<std::string, int> servers = {{"up", 0}, {"down", 0}, {"draining", 0}, {"drained", 0}};
  for (const auto& w : st.workers()) {
    ++workers[w.state()];
    assigned_version_.WithLabels({w.worker_id()})->Set(static_cast<double>(w.assigned_version()));
    acked_version_.WithLabels({w.worker_id()})->Set(static_cast<double>(w.acked_version()));
    worker_hit_rate_.WithLabels({w.worker_id()})->Set(w.hit_rate());
    // A total below the last one seen: the worker was forgotten and registered
    // again between two scrapes (its totals restarted); the counter goes on.
    uint64_t& copies = seen_copies_[w.worker_id()];
    copies_.WithLabels({w.worker_id()})->Increment(w.copies_issued() - std::min(copies, w.copies_issued()));
    copies = w.copies_issued();
    uint64_t& bytes = seen_bytes_[w.worker_id()];
    copied_bytes_.WithLabels({w.worker_id()})->Increment(w.bytes_issued() - std::min(bytes, w.bytes_issued()));
    bytes = w.bytes_issued();
  }
  // The series of workers the coordinator forgot.
  std::map<std::string, bool> listed;
  for (const auto& w : st.workers()) listed[w.worker_id()] = true;
  for (auto it = seen_copies_.begin(); it != seen_copies_.end();) {
    if (listed.count(it->first) > 0) {
      ++it;
      continue;
    }
    const std::vector<std::string> labels = {it->first};
    assigned_version_.Remove(labels);
    acked_version_.Remove(labels);
    worker_hit_rate_.Remove(labels);
    copies_.Remove(labels);
    copied_bytes_.Remove(labels);
    seen_bytes_.erase(it->first);
    it = seen_copies_.erase(it);
  }
  for (const auto& s : st.servers()) ++servers[s.state()];
  for (const auto& [state, n] : workers) workers_.WithLabels({state})->Set(n);
  for (const auto& [state, n] : servers) servers_.WithLabels({state})->Set(n);
  for (const auto& l : st.layers()) {
    const std::string layer = absl::StrCat(l.layer());
    layer_hit_rate_.WithLabels({layer})->Set(l.hit_rate());
    routable_experts_.WithLabels({layer})->Set(l.routable_experts());
    prediction_precision_.WithLabels({layer})->Set(l.prediction_precision());
    copies_per_second_.WithLabels({layer})->Set(l.copies_per_second());
    pcie_bytes_per_second_.WithLabels({layer})->Set(l.pcie_bytes_per_second());
    layer_split_.WithLabels({layer, "cpu"})->Set(l.cpu_share());
    layer_split_.WithLabels({layer, "copied"})->Set(l.copied_share());
    pcie_busy_share_.WithLabels({layer})->Set(l.pcie_busy_share());
  }
  hit_rate_->Set(st.overall_hit_rate());
  rebalances_->Increment(st.rebalances() - seen_rebalances_);
  seen_rebalances_ = st.rebalances();
  refused_count_reports_->Increment(st.refused_count_reports() - seen_refused_counts_);
  seen_refused_counts_ = st.refused_count_reports();
  refused_registrations_->Increment(st.refused_registrations() - seen_refused_registrations_);
  seen_refused_registrations_ = st.refused_registrations();
  purged_registrations_->Increment(st.purged_registrations() - seen_purged_);
  seen_purged_ = st.purged_registrations();
}

}  // namespace moe
