// The few steps every server binary's main() shares (moe-expert-server,
// moe-gpu-worker, moe-coordinator): the TLS and metrics flags, blocking
// termination signals so main can sigwait for them, the address actually
// bound, and the optional /metrics endpoint. Call from main() only.
#pragma once

#include <signal.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/flags.h"
#include "core/metrics_http.h"
#include "core/transport/transport.h"

namespace moe {

// --tls-cert / --tls-key / --tls-ca / --insecure and --metrics-port /
// --metrics-address, declared once for every server binary.
struct ServiceFlags {
  TlsOptions tls;
  int64_t metrics_port = -1;  // -1 = off, 0 = a free port, N = N
  std::string metrics_address = "0.0.0.0";

  // `peers`: who the binary also calls with the same TLS identity (e.g.
  // "expert servers"), or "" for a server that only serves.
  void Register(FlagSet& flags, const std::string& peers = "");
  // After Parse: InvalidArgument naming the flag.
  absl::Status Validate() const;
};

// Blocks SIGTERM and SIGINT in this thread and every thread it starts later;
// main waits for them with sigwait(&set, &sig).
sigset_t BlockTerminationSignals();

// "host:port" of a listen address whose port was 0, with the port bound.
std::string BoundAddress(const std::string& listen, int port);

// The /metrics endpoint the flags ask for: nullptr when --metrics-port is -1;
// Unavailable when the port cannot be bound. Logs the endpoint under `component`.
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const ServiceFlags& flags);

}  // namespace moe
