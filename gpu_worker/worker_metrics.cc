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
  for (int l : layers) {
    const std::string ls = std::to_string(l);
    layers_[l].hit = pairs.WithLabels({ls, "hit"});
    layers_[l].cpu = pairs.WithLabels({ls, "cpu"});
    layers_[l].copied = pairs.WithLabels({ls, "copied"});
    layers_[l].tokens = tokens.WithLabels({ls});
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
  wait_seconds_->Observe(s.wait_s);
}

}  // namespace moe
