#include "expert_server/expert_metrics.h"

#include <algorithm>
#include <string>

namespace moe {

namespace {

const char* TransportName(ExpertServerMetrics::Transport t) {
  return t == ExpertServerMetrics::Transport::kGrpc ? "grpc" : "shm";
}

}  // namespace

ExpertServerMetrics::ExpertServerMetrics(MetricsRegistry& r, const std::vector<int>& layers)
    : requests_(r.AddCounter("moe_expert_requests_total", "Forward requests answered, by transport and status code.",
                             {"transport", "code"})),
      tokens_(r.AddCounter("moe_expert_tokens_total", "Tokens computed, by MoE layer.", {"layer"})),
      pairs_(r.AddCounter("moe_expert_pairs_total", "(token, expert) pairs computed, by MoE layer.", {"layer"})) {
  Family<Counter>& received = r.AddCounter(
      "moe_expert_bytes_received_total", "Request payload bytes (tokens and routing) received, by transport.",
      {"transport"});
  Family<Counter>& sent =
      r.AddCounter("moe_expert_bytes_sent_total", "Response payload bytes (outputs) sent, by transport.", {"transport"});
  Family<Histogram>& request_seconds = r.AddHistogram(
      "moe_expert_request_seconds",
      "Time the server spent on a request, from decoding it to its encoded response, by transport.", {"transport"});
  for (Transport t : {Transport::kGrpc, Transport::kShm}) {
    PerTransport& p = transports_[static_cast<int>(t)];
    p.bytes_received = received.WithLabels({TransportName(t)});
    p.bytes_sent = sent.WithLabels({TransportName(t)});
    p.request_seconds = request_seconds.WithLabels({TransportName(t)});
  }
  int max_layer = -1;
  for (int l : layers) max_layer = std::max(max_layer, l);
  layers_.resize(static_cast<size_t>(max_layer + 1));
  for (int l : layers) {
    if (l < 0) continue;
    layers_[l].tokens = tokens_.WithLabels({std::to_string(l)});
    layers_[l].pairs = pairs_.WithLabels({std::to_string(l)});
  }
  kernel_seconds_ = r.AddHistogram("moe_expert_kernel_seconds", "Compute time of a batch on the pool.").Get();
  queue_seconds_ =
      r.AddHistogram("moe_expert_queue_seconds", "Time a batch waited for the compute pool before it ran.").Get();
  merged_ = r.AddCounter("moe_expert_merged_requests_total",
                         "Requests computed in one region with other requests of their layer (several clients' "
                         "requests batched per expert).")
                .Get();
  in_flight_ =
      r.AddGauge("moe_expert_batches_in_flight", "Batches waiting for or running on the compute pool.").Get();
  compute_threads_ = r.AddGauge("moe_expert_compute_threads", "Threads of the compute pool.").Get();
  weight_bytes_ = r.AddGauge("moe_expert_weight_bytes", "Bytes of packed expert weights resident in memory.").Get();
}

Counter* ExpertServerMetrics::Requests(Transport t, absl::StatusCode code) {
  int c = static_cast<int>(code);
  if (c < 0 || c >= kCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
  std::atomic<Counter*>& slot = transports_[static_cast<int>(t)].requests[c];
  Counter* counter = slot.load(std::memory_order_acquire);
  if (counter == nullptr) {
    // First request with this code: look the series up (a lock; WithLabels
    // returns the same series to every racer).
    counter = requests_.WithLabels({TransportName(t), absl::StatusCodeToString(static_cast<absl::StatusCode>(c))});
    slot.store(counter, std::memory_order_release);
  }
  return counter;
}

void ExpertServerMetrics::RecordRequest(Transport t, absl::StatusCode code, uint64_t bytes_received,
                                        uint64_t bytes_sent, uint64_t handle_ns) {
  PerTransport& p = transports_[static_cast<int>(t)];
  Requests(t, code)->Increment();
  p.bytes_received->Increment(bytes_received);
  if (bytes_sent > 0) p.bytes_sent->Increment(bytes_sent);
  p.request_seconds->ObserveNanos(handle_ns);
}

ExpertServerMetrics::PerLayer ExpertServerMetrics::Layer(int layer) {
  if (layer >= 0 && static_cast<size_t>(layer) < layers_.size() && layers_[layer].tokens != nullptr)
    return layers_[layer];
  // Not a hosted layer (cannot happen for a computed batch): the slow path.
  return PerLayer{tokens_.WithLabels({std::to_string(layer)}), pairs_.WithLabels({std::to_string(layer)})};
}

void ExpertServerMetrics::RecordCompute(int layer, int tokens, const ForwardStats& stats) {
  const PerLayer l = Layer(layer);
  l.tokens->Increment(static_cast<uint64_t>(tokens));
  l.pairs->Increment(static_cast<uint64_t>(stats.pairs));
  kernel_seconds_->ObserveNanos(stats.compute_ns);
  queue_seconds_->ObserveNanos(stats.queue_ns);
  if (stats.merged_requests > 1) merged_->Increment();
}

}  // namespace moe
