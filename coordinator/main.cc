// moe-coordinator: tracks expert popularity reported by the GPU workers,
// decides which experts each worker caches (placement rounds with hysteresis
// and a copy budget), pushes versioned assignments, keeps the registry of
// workers and CPU expert servers, and serves the admin API behind moectl
// (moe.v1.CoordinatorService, moe.v1.AdminService, grpc.health.v1.Health,
// server reflection), with Prometheus metrics on --metrics-port. Callers are
// authorized by role (coordinator/role_authorizer.h): mTLS certificate names,
// the peer uid on --admin-socket, or loopback with --insecure-admin.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "coordinator/admin_socket.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_service.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/service_main.h"
#include "core/metrics_http.h"
#include "core/transport/grpc_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

int main(int argc, char** argv) {
  moe::CoordinatorPolicy policy;
  std::string listen = moe::LoopbackListen(50100), placement = moe::PlacementModeName(policy.placement), state_file;
  std::string admin_socket_path;
  double heartbeat_timeout = 5.0;
  int64_t heartbeat_interval_ms = 200, drain_seconds = 5;
  moe::FlagSet flags("moe-coordinator",
                     "[--listen ADDR] [--state-file FILE] (--insecure | --tls-cert C --tls-key K [--tls-ca CA]) [--admin-socket PATH] [flags]\n"
                     "Coordinates the GPU workers' expert caches and the CPU expert servers; moectl talks to it.");
  flags.String("listen", &listen,
               "gRPC address to listen on, host:port (loopback by default; port 0 picks a free port; a port "
               "another process holds refuses the start)");
  flags.Double("half-life-seconds", &policy.half_life_seconds,
               "popularity half-life: a (token, expert) pair this old counts half");
  flags.String("placement", &placement,
               "per-worker (each worker caches the top-C of its own traffic) or union (spread distinct experts "
               "over the workers, replicate only the hottest)");
  flags.Double("copy-budget-gbps", &policy.copy_budget_gbps,
               "PCIe GB/s one rebalance round may use per worker (budget = this x the rebalance interval); <= 0: unlimited");
  flags.Double("hysteresis-margin", &policy.hysteresis_margin,
               "a newcomer replaces a resident only if its extra expected hits exceed copy-cost-hits + margin x the "
               "resident's");
  flags.Double("copy-cost-hits", &policy.copy_cost_hits, "cost of one expert copy, in hits");
  flags.Double("replicate-share", &policy.replicate_share,
               "union placement: experts with at least this share of a layer's pairs go on every worker");
  flags.Double("rebalance-interval-seconds", &policy.rebalance_interval_seconds,
               "automatic rebalance period; <= 0: only when asked (moectl rebalance)");
  flags.Double("heartbeat-timeout-seconds", &heartbeat_timeout,
               "a worker or expert server silent this long is marked down (a server's experts go to replicas)");
  flags.Int("heartbeat-interval-ms", &heartbeat_interval_ms, "heartbeat period asked of workers and servers");
  flags.String("state-file", &state_file,
               "JSON file of admin overrides (pins, policy, drains), written atomically and reloaded at start; "
               "empty: not persisted");
  flags.Int("drain-seconds", &drain_seconds, "on SIGTERM/SIGINT, how long open calls may take to finish");
  flags.String("admin-socket", &admin_socket_path,
               "also serve on this unix socket; its callers are identified by peer uid (uid:N in the "
               "--*-identities lists), e.g. for moectl --coordinator unix:PATH without TLS");
  moe::AuthorizationPolicy authorization = moe::AuthorizationPolicy::Defaults();
  authorization.Register(flags);
  moe::ServiceFlags service_flags;
  service_flags.Register(flags);
  flags.Parse(argc, argv);
  if (absl::Status st = authorization.Finish(); !st.ok()) flags.Fail(std::string(st.message()));
  if (absl::Status s = moe::ParsePlacementMode(placement, &policy.placement); !s.ok())
    flags.Fail(absl::StrCat("--", s.message()));
  if (!(policy.half_life_seconds > 0)) flags.Fail("--half-life-seconds must be > 0");
  if (policy.hysteresis_margin < 0) flags.Fail("--hysteresis-margin must be >= 0");
  if (policy.copy_cost_hits < 0) flags.Fail("--copy-cost-hits must be >= 0");
  if (!(policy.replicate_share > 0)) flags.Fail("--replicate-share must be > 0");
  if (!(heartbeat_timeout > 0)) flags.Fail("--heartbeat-timeout-seconds must be > 0");
  if (heartbeat_interval_ms <= 0) flags.Fail("--heartbeat-interval-ms must be > 0");
  if (absl::Status st = service_flags.Validate(); !st.ok()) flags.Fail(std::string(st.message()));
  const moe::TlsOptions& tls = service_flags.tls;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));

  sigset_t term = moe::BlockTerminationSignals();

  moe::CoordinatorOptions options;
  options.policy = policy;
  options.heartbeat_timeout_seconds = heartbeat_timeout;
  options.heartbeat_interval_ms = static_cast<uint32_t>(heartbeat_interval_ms);
  options.state_file = state_file;
  options.version = MOE_VERSION;
  absl::StatusOr<std::unique_ptr<moe::Coordinator>> coordinator = moe::Coordinator::Create(options);
  if (!coordinator.ok()) flags.Fail(std::string(coordinator.status().message()), 1);

  const std::vector<uid_t> socket_uids = authorization.SocketUids();
  moe::RoleAuthorizer authorizer(authorization);
  moe::CoordinatorServiceImpl service(**coordinator, authorizer);
  moe::AdminServiceImpl admin(**coordinator, authorizer);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  builder.RegisterService(&admin);
  moe::ConfigureServerBuilder(builder, 64u << 20);
  absl::StatusOr<moe::ListeningServer> listening = moe::StartGrpcServer(builder, listen, *creds);
  if (!listening.ok()) flags.Fail(std::string(listening.status().message()), 1);
  std::unique_ptr<grpc::Server> server = std::move(listening->server);
  const std::string bound = listening->address;
  std::unique_ptr<moe::AdminSocket> admin_socket;
  if (!admin_socket_path.empty()) {
    absl::StatusOr<std::unique_ptr<moe::AdminSocket>> a =
        moe::AdminSocket::Start(admin_socket_path, socket_uids, server.get(), &authorizer);
    if (!a.ok()) flags.Fail(absl::StrCat("--admin-socket: ", a.status().message()), 1);
    admin_socket = *std::move(a);
    moe::LogInfo("coordinator", "admin socket unix:", admin_socket_path);
  }
  (*coordinator)->Start();
  moe::CoordinatorMetrics metrics(moe::Metrics(), **coordinator);
  absl::StatusOr<std::unique_ptr<moe::MetricsHttpServer>> metrics_started =
      moe::StartMetricsEndpoint("coordinator", service_flags);
  if (!metrics_started.ok()) flags.Fail(std::string(metrics_started.status().message()), 1);
  std::unique_ptr<moe::MetricsHttpServer> metrics_http = *std::move(metrics_started);
  const moe::CoordinatorPolicy& p = policy;
  moe::LogInfo("coordinator", "serving on ", bound, ": placement ", moe::PlacementModeName(p.placement),
               ", half-life ", p.half_life_seconds, " s, rebalance every ", p.rebalance_interval_seconds,
               " s, copy budget ", p.copy_budget_gbps, " GB/s, heartbeat timeout ", heartbeat_timeout, " s",
               state_file.empty() ? ", no state file" : ", state file " + state_file);
  // Line 1 is what scripts and tests wait for; line 2 (only with --metrics-port)
  // names the metrics port, the chosen one when it was 0.
  std::printf("moe-coordinator ready on %s\n", bound.c_str());
  if (metrics_http) std::printf("moe-coordinator metrics on %s:%d\n", service_flags.metrics_address.c_str(), metrics_http->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&term, &sig);
  moe::LogInfo("coordinator", "signal ", sig, ": stopping");
  metrics_http.reset();
  (*coordinator)->Stop();  // ends the assignment streams (UNAVAILABLE): workers keep their last assignment
  if (admin_socket) admin_socket->Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(drain_seconds));
  server->Wait();
  moe::LogInfo("coordinator", "stopped");
  return 0;
}
