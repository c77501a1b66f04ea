#include "gpu_worker/worker_metrics.h"

#include <string>

namespace moe {

WorkerMetrics::WorkerMetrics(MetricsRegistry& r, const std::vector<int>& layers, int num_layers)
    : layers_(num_layers) {
  auto& pairs = r.AddCounter("moe_worker_pairs_total",
                             "(token, expert) pairs by layer and where they were computed: hit (GPU cache), "
                             "cpu (expert server), copied (copied to the GPU for this call)",
                             {"layer", "result"});
  auto& tokens = r.AddCounter("moe_worker_tokens_total", "tokens per MoE layer", {"layer"});
  auto& cache_copies = r.AddCounter("moe_worker_layer_cache_copies_total", "expert copies into the layer's cache slots",
                                    {"layer"});
  auto& copy_bytes = r.AddCounter("moe_worker_layer_pcie_bytes_total", "bytes copied host->GPU into the layer's slots",
                                  {"layer"});
  auto& predicted = r.AddCounter("moe_worker_layer_predicted_experts_total",
                                 "experts the predictive policy predicted for the layer's runs, by whether the run "
                                 "used them (precision = used / all)",
                                 {"layer", "result"});
  auto& link_us = r.AddCounter("moe_worker_layer_pcie_busy_microseconds_total",
                               "host->GPU link time of the layer's copies (cache slots and copy-instead), from the "
                               "online copy time; its rate is the link's busy share",
                               {"layer"});
  for (int l : layers) {
    const std::string ls = std::to_string(l);
    layers_[l].hit = pairs.WithLabels({ls, "hit"});
    layers_[l].cpu = pairs.WithLabels({ls, "cpu"});
    layers_[l].copied = pairs.WithLabels({ls, "copied"});
    layers_[l].tokens = tokens.WithLabels({ls});
    layers_[l].cache_copies = cache_copies.WithLabels({ls});
    layers_[l].copy_bytes = copy_bytes.WithLabels({ls});
    layers_[l].predicted = predicted.WithLabels({ls, "all"});
    layers_[l].predicted_used = predicted.WithLabels({ls, "used"});
    layers_[l].link_us = link_us.WithLabels({ls});
  }
  miss_tokens_ = r.AddCounter("moe_worker_miss_tokens_total", "tokens shipped to CPU expert servers").Get();
  bytes_ = r.AddCounter("moe_worker_bytes_shipped_total",
                        "activation, routing and partial-output bytes exchanged with expert servers").Get();
  failovers_ = r.AddCounter("moe_worker_failovers_total",
                            "miss batches moved to another server or to the GPU after a server failure").Get();
  calls_ = r.AddCounter("moe_worker_layer_calls_total", "ForwardLayer calls (per micro-batch)").Get();
  call_seconds_ = r.AddHistogram("moe_worker_layer_seconds", "time of one MoE layer call (submit to output)").Get();
  wait_seconds_ = r.AddHistogram("moe_worker_miss_wait_seconds",
                                 "time a call waited for expert servers' partial sums (transport + CPU kernels)").Get();
  version_ = r.AddGauge("moe_worker_assignment_version", "coordinator assignment version applied").Get();
  copies_ = r.AddGauge("moe_worker_cache_copies", "expert copies into cache slots started since start").Get();
  planner_rates_ = &r.AddGauge("moe_worker_planner_rate",
                               "the planner's learned rates (seconds; counts for *_observed and *_shapes)", {"rate"});
}

void WorkerMetrics::SetPlannerRates(const std::map<std::string, double>& rates) {
  for (const auto& [name, value] : rates) planner_rates_->WithLabels({name})->Set(value);
}

void WorkerMetrics::RecordCall(int layer, int tokens, const CallStats& s, double seconds) {
  if (layer >= 0 && layer < static_cast<int>(layers_.size()) && layers_[layer].hit != nullptr) {
    layers_[layer].hit->Increment(s.hit_pairs);
    layers_[layer].cpu->Increment(s.cpu_pairs);
    layers_[layer].copied->Increment(s.copied_pairs);
    layers_[layer].tokens->Increment(static_cast<uint64_t>(tokens));
  }
  miss_tokens_->Increment(s.miss_tokens);
  bytes_->Increment(s.bytes_shipped);
  failovers_->Increment(s.failovers);
  calls_->Increment();
  call_seconds_->Observe(seconds);
  wait_seconds_->Observe(s.wait_seconds);
}

void WorkerMetrics::RecordActivity(int layer, const LayerActivity& a) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || layers_[layer].hit == nullptr) return;
  layers_[layer].cache_copies->Increment(a.cache_copies);
  layers_[layer].copy_bytes->Increment(a.copy_bytes);
  layers_[layer].predicted->Increment(a.predicted);
  layers_[layer].predicted_used->Increment(a.predicted_used);
  if (a.link_seconds > 0) layers_[layer].link_us->Increment(static_cast<uint64_t>(a.link_seconds * 1e6 + 0.5));
}

}  // namespace moe
