// CoordinatorMetrics: the coordinator's Prometheus series (core/metrics.h),
// refreshed from Coordinator::Status() at every scrape: workers and servers by
// state, per-worker assignment versions, hit rates and copies, per-layer hit
// rate and routable experts, placement rounds, refused count reports and
// registrations, purged registrations. A worker's series go when the
// coordinator forgets it (--purge-after-seconds), so they are bounded by the
// registrations it holds. Construct once; the scrape hook is removed on
// destruction (the Coordinator must outlive it).
#pragma once

#include <map>
#include <string>

#include "coordinator/coordinator.h"
#include "core/metrics.h"

namespace moe {

class CoordinatorMetrics {
 public:
  CoordinatorMetrics(MetricsRegistry& registry, Coordinator& coordinator);

 private:
  void Refresh();

  Coordinator& coordinator_;
  Family<Gauge>& workers_;
  Family<Gauge>& servers_;
  Family<Gauge>& assigned_version_;
  Family<Gauge>& acked_version_;
  Family<Gauge>& worker_hit_rate_;
  Family<Counter>& copies_;
  Family<Counter>& copied_bytes_;
  Family<Gauge>& layer_hit_rate_;
  Family<Gauge>& routable_experts_;
  Family<Gauge>& prediction_precision_;
  Family<Gauge>& copies_per_second_;
  Family<Gauge>& pcie_bytes_per_second_;
  Family<Gauge>& layer_split_;       // share of the layer's pairs by where they were computed
  Family<Gauge>& pcie_busy_share_;
  Gauge* hit_rate_;
  Counter* rebalances_;
  Counter* refused_count_reports_;
  Counter* refused_registrations_;
  Counter* purged_registrations_;
  // Last totals seen, to turn Status()'s running totals into counter increments.
  std::map<std::string, uint64_t> seen_copies_, seen_bytes_;
  uint64_t seen_rebalances_ = 0, seen_refused_counts_ = 0, seen_refused_registrations_ = 0, seen_purged_ = 0;
  MetricsRegistry::Hook hook_;  // last: removed first
};

}  // namespace moe
