// The few steps every server binary's main() shares (moe-expert-server,
// moe-gpu-worker, moe-coordinator): the TLS and metrics flags, blocking
// termination signals and waiting for one, the one gRPC server bootstrap
// (health, reflection, message limits, a listener on a port no other process
// shares), the address actually bound, the optional /metrics endpoint and the
// "ready" lines scripts wait for. Call from main() only (or from a server
// class main() owns, such as ExpertServer).
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/flags.h"
#include "process/metrics_http.h"
#include "transport/transport.h"
#include "grpcpp/grpcpp.h"

namespace moe {

// --tls-cert / --tls-key / --tls-ca / --insecure and --metrics-port /
// --metrics-address, declared once for every server binary.
struct ServiceFlags {
  TlsOptions tls;
  int64_t metrics_port = -1;  // -1 = off, 0 = a free port, N = N
  std::string metrics_address = "127.0.0.1";  // loopback unless asked

  // `peers`: who the binary also calls with the same TLS identity (e.g.
  // "expert servers"), or "" for a server that only serves.
  void Register(FlagSet& flags, const std::string& peers = "");
  // After Parse: InvalidArgument naming the flag.
  absl::Status Validate() const;
};

// The default listen address of a server binary: loopback, `port`.
std::string LoopbackListen(int port);

// A started gRPC server and the port it bound.
struct ListeningServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address;  // `listen` with the bound port

  // Stops taking calls, lets open ones finish for up to `drain` (then cancels
  // them) and waits until the server is idle.
  void Stop(std::chrono::seconds drain);
};

// What ServeGrpc serves, where, and how.
struct GrpcServeOptions {
  std::string listen;  // host:port; port 0 picks a free one
  std::shared_ptr<grpc::ServerCredentials> credentials;  // MakeServerCredentials(ServiceFlags::tls)
  uint64_t max_message_bytes = 0;  // see ConfigureServerBuilder
  std::vector<grpc::Service*> services;  // not owned; must outlive the server
};

// The gRPC bootstrap of every server binary: `services` plus
// grpc.health.v1.Health and server reflection, with the message limits of
// ConfigureServerBuilder, started by StartGrpcServer (same errors).
absl::StatusOr<ListeningServer> ServeGrpc(const GrpcServeOptions& options);

// InvalidArgument naming --listen unless `listen` is HOST:PORT (HOST a name,
// an IPv4 address or [an IPv6 one], possibly empty: every interface) with a
// decimal PORT in [0, 65535], or unix:PATH. gRPC itself takes a port above
// 65535 modulo 65536 and a missing one as 443.
absl::Status CheckListenAddress(const std::string& listen);

// Adds `listen` to `builder` with SO_REUSEPORT off (gRPC turns it on by
// default, which lets a second process bind the same port and take half the
// calls) and starts it. Unavailable with a one-line reason ("cannot listen on
// ADDR: Address already in use") when the port is taken or cannot be bound;
// CheckListenAddress's error for an address that is none.
absl::StatusOr<ListeningServer> StartGrpcServer(grpc::ServerBuilder& builder, const std::string& listen,
                                                const std::shared_ptr<grpc::ServerCredentials>& creds);

// Blocks SIGTERM and SIGINT in this thread and every thread it starts later;
// main waits for them with WaitForTerminationSignal (or sigwait(&set, &sig)).
// Call before starting any thread.
sigset_t BlockTerminationSignals();

// Waits until SIGTERM or SIGINT (blocked by BlockTerminationSignals) arrives;
// returns the signal number.
int WaitForTerminationSignal();

// "host:port" of a listen address whose port was 0, with the port bound.
std::string BoundAddress(const std::string& listen, int port);

// The /metrics endpoint the flags ask for: nullptr when --metrics-port is -1;
// Unavailable when the port cannot be bound. Logs the endpoint under `component`.
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const ServiceFlags& flags);

// Prints the lines scripts and tests wait for on stdout and flushes it:
// "BINARY ready on ADDRESS" and, when `metrics` is set, "BINARY metrics on
// METRICS-ADDRESS:PORT" (the chosen port when --metrics-port was 0).
void AnnounceReady(const std::string& binary, const std::string& address, const ServiceFlags& flags,
                   const MetricsHttpServer* metrics);

}  // namespace moe
