// The few steps every server binary's main() shares (moe-expert-server,
// moe-gpu-worker, moe-coordinator): blocking termination signals so main can
// sigwait for them, the address actually bound, and the optional /metrics
// endpoint. Call from main() only.
#pragma once

#include <signal.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/metrics_http.h"

namespace moe {

// Blocks SIGTERM and SIGINT in this thread and every thread it starts later;
// main waits for them with sigwait(&set, &sig).
sigset_t BlockTerminationSignals();

// "host:port" of a listen address whose port was 0, with the port bound.
std::string BoundAddress(const std::string& listen, int port);

// --metrics-port semantics: -1 = off (returns nullptr), 0 = a free port, N = N.
// InvalidArgument naming --metrics-port for anything else; Unavailable when
// the port cannot be bound. Logs the endpoint under `component`.
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const std::string& address,
                                                                       int64_t port);

}  // namespace moe
