// The dispatcher's start-up probes (LayerDispatcher::MeasureRates, at
// Create): the rates the planner's CostModel starts from — one expert
// copied, what one more expert adds to a device call at 1 and many rows, the
// first connected server's round trips for 1 and 2 experts and many tokens,
// and what a copy costs the CPU servers (CostModel::copy_cpu_share). Free
// functions of what they use: the backend and its temporary miss buffers,
// the host copy, the servers' transports.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "transport/transport.h"
#include "gpu_worker/cost_model.h"
#include "gpu_worker/device_backend.h"
#include "gpu_worker/host_expert_store.h"

namespace moe {

// A server the probes may send to (the first connected one is probed).
struct ProbeServer {
  std::string address;
  ExpertTransport* transport = nullptr;      // null: not connected
  const std::vector<bool>* hosts = nullptr;  // per expert: it hosts it
  int chunk_tokens = 0;                      // most tokens per batch
};

struct RateProbeSetup {
  DeviceBackend* backend = nullptr;    // initialised, with the temporary buffers below
  const HostExpertStore* host = nullptr;  // the experts copied (not null)
  int layer = 0;                       // the layer probed (the first served one)
  int num_experts = 0;
  int hidden = 0;
  int max_tokens = 0;                  // DispatcherConfig::max_tokens
  int miss_buffers = 0;                // per layer parity (DispatcherConfig::miss_buffers)
  int temp_base = 0;                   // backend buffer of the first temporary miss buffer
  int temp_buffers = 0;                // temporary miss buffers (both parities; 0: none)
  std::chrono::milliseconds deadline{30000};  // per server round trip
  std::vector<ProbeServer> servers;
};

// Fills `rates` from the probes (rates.measured once a server answered);
// an error of the backend or of the probed server.
absl::Status ProbeRates(const RateProbeSetup& p, CostModel& rates);

}  // namespace moe
