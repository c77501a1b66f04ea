// WorkerMetrics: the GPU worker's Prometheus series (core/metrics.h) — pairs
// per layer by where they were computed (hit / cpu / copied), miss tokens,
// bytes shipped, layer-call and miss-wait latency histograms, failovers, the
// applied assignment version and cache copies, and the planner's learned
// rates. Recording is lock-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/metrics.h"
#include "gpu_worker/layer_dispatcher.h"

namespace moe {

class WorkerMetrics {
 public:
  // `layers`: the model layers the worker serves (one series each).
  WorkerMetrics(MetricsRegistry& registry, const std::vector<int>& layers, int num_layers);
  void RecordCall(int layer, int tokens, const CallStats& stats, double seconds);
  void SetAssignmentVersion(uint64_t v) { version_->Set(static_cast<double>(v)); }
  void SetCopies(uint64_t copies) { copies_->Set(static_cast<double>(copies)); }
  // Copies into `layer`'s cache slots and their bytes; experts predicted for
  // its runs and of them used (predictive policy).
  void RecordActivity(int layer, const LayerActivity& a);
  // The planner's learned rates (MoeSession::Admin::PlannerRates), as
  // moe_worker_planner_rate{rate=NAME}.
  void SetPlannerRates(const std::map<std::string, double>& rates);

 private:
  struct Layer {
    Counter *hit = nullptr, *cpu = nullptr, *copied = nullptr, *tokens = nullptr;
    Counter *cache_copies = nullptr, *copy_bytes = nullptr, *predicted = nullptr, *predicted_used = nullptr;
    Counter* link_us = nullptr;
  };
  std::vector<Layer> layers_;  // by model layer index
  Counter *miss_tokens_, *bytes_, *failovers_, *calls_;
  Histogram *call_seconds_, *wait_seconds_;
  Gauge *version_, *copies_;
  Family<Gauge>* planner_rates_;
};

}  // namespace moe
