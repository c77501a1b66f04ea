// moe-coordinator: tracks expert popularity reported by the GPU workers,
// decides which experts each worker caches (placement rounds with hysteresis
// and a copy budget), pushes versioned assignments, keeps the registry of
// workers and CPU expert servers, and serves the admin API behind moectl
// (moe.v1.CoordinatorService, moe.v1.AdminService, grpc.health.v1.Health,
// server reflection), with Prometheus metrics on --metrics-port. Callers are
// authorized by role (coordinator/role_authorizer.h): mTLS certificate names,
// the peer uid on --admin-socket, or loopback with --insecure-admin.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/admin_socket.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_service.h"
#include "core/flags.h"
#include "core/log.h"
#include "core/metrics.h"
#include "process/metrics_http.h"
#include "process/service_main.h"
#include "transport/grpc_channel.h"

namespace {

struct CoordinatorFlags {
  moe::CoordinatorOptions options;
  std::string listen = moe::LoopbackListen(50100);
  std::string admin_socket;
  int64_t drain_seconds = 5;
  moe::AuthorizationPolicy authorization = moe::AuthorizationPolicy::Defaults();
  moe::ServiceFlags service;
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

// The command line as CoordinatorFlags; exits 2 with one line on a bad flag.
CoordinatorFlags ParseFlags(moe::FlagSet& flags, int argc, char** argv) {
  CoordinatorFlags f;
  moe::CoordinatorPolicy& policy = f.options.policy;
  std::string placement = moe::PlacementModeName(policy.placement);
  double heartbeat_timeout = 5.0;
  int64_t heartbeat_interval_ms = 200;
  int64_t max_registrations_per_peer = f.options.max_registrations_per_peer;
  flags.String("listen", &f.listen,
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
  flags.Double("purge-after-seconds", &f.options.purge_after_seconds,
               "a worker or expert server silent this long (down since --heartbeat-timeout-seconds) is forgotten: "
               "its registration, access counts and metric series; must exceed --heartbeat-timeout-seconds; "
               "0: the larger of 300 s and 10 x --heartbeat-timeout-seconds");
  flags.Int("max-registrations-per-peer", &max_registrations_per_peer,
            "worker ids, and server ids, one peer may hold at once (a local user by uid, a remote one by IP, with "
            "mTLS its certificate at its address); a new id beyond it replaces the peer's longest-silent down one, "
            "or, with all live, is refused RESOURCE_EXHAUSTED");
  flags.Double("max-worker-tokens-per-second", &f.options.max_worker_tokens_per_second,
               "the routing rate (tokens a second through one layer) a worker that declares none is held to, and "
               "the most one may declare: a heartbeat's access counts beyond that rate x top-k since the worker's "
               "last accepted report (plus a 30 s burst) are refused INVALID_ARGUMENT");
  flags.String("state-file", &f.options.state_file,
               "JSON file of admin overrides (pins, policy, drains), written atomically (mode 0600) and reloaded "
               "at start; a file that is a symbolic link, another uid's, or group/world writable refuses the start; "
               "empty: not persisted");
  flags.Int("drain-seconds", &f.drain_seconds, "on SIGTERM/SIGINT, how long open calls may take to finish (0..3600)");
  flags.String("admin-socket", &f.admin_socket,
               "also serve on this unix socket; its callers are identified by peer uid (uid:N in the "
               "--*-identities lists), e.g. for moectl --coordinator unix:PATH without TLS");
  f.authorization.Register(flags);
  f.service.Register(flags);
  flags.Parse(argc, argv);
  if (absl::Status st = f.authorization.Finish(); !st.ok()) flags.Fail(std::string(st.message()));
  if (absl::Status st = moe::CheckListenAddress(f.listen); !st.ok()) flags.Fail(std::string(st.message()));
  if (absl::Status s = moe::ParsePlacementMode(placement, &policy.placement); !s.ok())
    flags.Fail(absl::StrCat("--", s.message()));
  if (absl::Status st = policy.Check(); !st.ok()) flags.Fail(std::string(st.message()));
  if (f.drain_seconds < 0 || f.drain_seconds > 3600)
    flags.Fail(absl::StrCat("--drain-seconds: ", f.drain_seconds, " is outside [0, 3600]"));
  if (!(heartbeat_timeout > 0)) flags.Fail("--heartbeat-timeout-seconds must be > 0");
  if (heartbeat_interval_ms <= 0) flags.Fail("--heartbeat-interval-ms must be > 0");
  if (f.options.purge_after_seconds != 0 &&
      (!(f.options.purge_after_seconds > heartbeat_timeout) || !(f.options.purge_after_seconds <= 1e9)))
    flags.Fail(absl::StrCat("--purge-after-seconds ", f.options.purge_after_seconds,
                            " must exceed --heartbeat-timeout-seconds (", heartbeat_timeout, ") and be at most 1e9"));
  if (max_registrations_per_peer < 1 || max_registrations_per_peer > 1000000)
    flags.Fail(absl::StrCat("--max-registrations-per-peer ", max_registrations_per_peer, " is outside [1, 1000000]"));
  if (!(f.options.max_worker_tokens_per_second >= 1 && f.options.max_worker_tokens_per_second <= 1e12))
    flags.Fail(absl::StrCat("--max-worker-tokens-per-second ", f.options.max_worker_tokens_per_second,
                            " is outside [1, 1e12]"));
  f.options.max_registrations_per_peer = static_cast<int>(max_registrations_per_peer);
  if (absl::Status st = f.service.Validate(); !st.ok()) flags.Fail(std::string(st.message()));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = moe::MakeServerCredentials(f.service.tls);
  if (!creds.ok()) flags.Fail(std::string(creds.status().message()));
  f.credentials = *creds;
  f.options.heartbeat_timeout_seconds = heartbeat_timeout;
  f.options.heartbeat_interval_ms = static_cast<uint32_t>(heartbeat_interval_ms);
  f.options.version = MOE_VERSION;
  return f;
}

void LogServing(const CoordinatorFlags& f, const std::string& bound) {
  const moe::CoordinatorPolicy& p = f.options.policy;
  const std::string& state_file = f.options.state_file;
  moe::LogInfo("coordinator", "serving on ", bound, ": placement ", moe::PlacementModeName(p.placement),
               ", half-life ", p.half_life_seconds, " s, rebalance every ", p.rebalance_interval_seconds,
               " s, copy budget ", p.copy_budget_gbps, " GB/s, heartbeat timeout ",
               f.options.heartbeat_timeout_seconds, " s",
               state_file.empty() ? ", no state file" : ", state file " + state_file);
}

}  // namespace

int main(int argc, char** argv) {
  moe::FlagSet flags("moe-coordinator",
                     "[--listen ADDR] [--state-file FILE] (--insecure | --tls-cert C --tls-key K [--tls-ca CA]) [--admin-socket PATH] [flags]\n"
                     "Coordinates the GPU workers' expert caches and the CPU expert servers; moectl talks to it.");
  const CoordinatorFlags f = ParseFlags(flags, argc, argv);
  moe::BlockTerminationSignals();

  absl::StatusOr<std::unique_ptr<moe::Coordinator>> coordinator = moe::Coordinator::Create(f.options);
  if (!coordinator.ok()) flags.Fail(std::string(coordinator.status().message()), 1);
  moe::RoleAuthorizer authorizer(f.authorization);
  moe::CoordinatorServiceImpl service(**coordinator, authorizer);
  moe::AdminServiceImpl admin(**coordinator, authorizer);
  absl::StatusOr<moe::ListeningServer> grpc = moe::ServeGrpc({f.listen, f.credentials, 64u << 20, {&service, &admin}});
  if (!grpc.ok()) flags.Fail(std::string(grpc.status().message()), 1);
  std::unique_ptr<moe::AdminSocket> admin_socket;
  if (!f.admin_socket.empty()) {
    absl::StatusOr<std::unique_ptr<moe::AdminSocket>> a =
        moe::AdminSocket::Start(f.admin_socket, f.authorization.SocketUids(), grpc->server.get(), &authorizer);
    if (!a.ok()) flags.Fail(absl::StrCat("--admin-socket: ", a.status().message()), 1);
    admin_socket = *std::move(a);
    moe::LogInfo("coordinator", "admin socket unix:", f.admin_socket);
  }
  (*coordinator)->Start();
  moe::CoordinatorMetrics metrics(moe::Metrics(), **coordinator);
  absl::StatusOr<std::unique_ptr<moe::MetricsHttpServer>> metrics_http =
      moe::StartMetricsEndpoint("coordinator", f.service);
  if (!metrics_http.ok()) flags.Fail(std::string(metrics_http.status().message()), 1);
  LogServing(f, grpc->address);
  // Line 1 is what scripts and tests wait for; line 2 (only with --metrics-port)
  // names the metrics port, the chosen one when it was 0.
  moe::AnnounceReady("moe-coordinator", grpc->address, f.service, metrics_http->get());

  const int sig = moe::WaitForTerminationSignal();
  moe::LogInfo("coordinator", "signal ", sig, ": stopping");
  metrics_http->reset();
  (*coordinator)->Stop();  // ends the assignment streams (UNAVAILABLE): workers keep their last assignment
  if (admin_socket) admin_socket->Stop();
  grpc->Stop(std::chrono::seconds(f.drain_seconds));
  moe::LogInfo("coordinator", "stopped");
  return 0;
}
