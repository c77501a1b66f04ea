// ExpertServerMetrics: the expert server's metric families in a
// MetricsRegistry (core/metrics.h), and the two calls that record into them:
//
//   RecordRequest — at each transport's edge (ExpertServiceImpl for gRPC,
//     ShmServer's on_request for shared memory): one answered request.
//   RecordCompute — around the batch handler shared by both transports: one
//     computed batch (tokens and pairs per layer, kernel and queue time).
//
// Both are lock-free after the first request of a status code: a handful of
// relaxed atomic adds. Every method may be called from any thread.
//
//   moe_expert_requests_total{transport,code}      counter
//   moe_expert_bytes_received_total{transport}     counter (request payload)
//   moe_expert_bytes_sent_total{transport}         counter (response payload)
//   moe_expert_request_seconds{transport}          histogram (decode to encoded)
//   moe_expert_tokens_total{layer}                 counter (computed batches)
//   moe_expert_pairs_total{layer}                  counter (token, expert) pairs
//   moe_expert_kernel_seconds                      histogram (compute time)
//   moe_expert_queue_seconds                       histogram (wait for the pool)
//   moe_expert_batches_in_flight                   gauge (waiting for or on the pool)
//   moe_expert_compute_threads                     gauge
//   moe_expert_weight_bytes                        gauge (resident packed weights)
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/metrics.h"
#include "expert_compute/moe_executor.h"

namespace moe {

class ExpertServerMetrics {
 public:
  enum class Transport { kGrpc = 0, kShm = 1 };

  // Registers the families in `registry` (idempotent) and creates the series
  // of every layer in `layers` (the hosted ones) and both transports.
  ExpertServerMetrics(MetricsRegistry& registry, const std::vector<int>& layers);

  void SetComputeThreads(int threads) { compute_threads_->Set(threads); }
  void SetWeightBytes(uint64_t bytes) { weight_bytes_->Set(static_cast<double>(bytes)); }

  // One answered request: its status, the payload bytes it carried each way
  // and the time the server spent on it.
  void RecordRequest(Transport t, absl::StatusCode code, uint64_t bytes_received, uint64_t bytes_sent,
                     uint64_t handle_ns);

  // Brackets a batch handed to the compute pool (the in-flight gauge).
  void BatchStarted() { in_flight_->Add(1); }
  void BatchFinished() { in_flight_->Add(-1); }
  // One batch computed successfully.
  void RecordCompute(int layer, int tokens, const ForwardStats& stats);

 private:
  static constexpr int kTransports = 2;
  static constexpr int kCodes = 17;  // absl::StatusCode 0..16; others count as UNKNOWN
  struct PerTransport {
    std::array<std::atomic<Counter*>, kCodes> requests{};  // filled on first use of a code
    Counter* bytes_received = nullptr;
    Counter* bytes_sent = nullptr;
    Histogram* request_seconds = nullptr;
  };
  struct PerLayer {
    Counter* tokens = nullptr;
    Counter* pairs = nullptr;
  };
  Counter* Requests(Transport t, absl::StatusCode code);
  PerLayer Layer(int layer);

  Family<Counter>& requests_;
  Family<Counter>& tokens_;
  Family<Counter>& pairs_;
  std::array<PerTransport, kTransports> transports_;
  std::vector<PerLayer> layers_;  // by layer index; null for layers not hosted
  Histogram* kernel_seconds_;
  Histogram* queue_seconds_;
  Counter* merged_;
  Gauge* in_flight_;
  Gauge* compute_threads_;
  Gauge* weight_bytes_;
};

}  // namespace moe
