#include "core/service_main.h"

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace moe {

sigset_t BlockTerminationSignals() {
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigaddset(&term, SIGINT);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);
  return term;
}

std::string BoundAddress(const std::string& listen, int port) {
  return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
}

void ServiceFlags::Register(FlagSet& flags, const std::string& peers) {
  flags.String("tls-cert", &tls.cert_file,
               "PEM certificate chain of this process (served over gRPC/TLS" +
                   (peers.empty() ? std::string(")") : ", and presented to " + peers + ")"));
  flags.String("tls-key", &tls.key_file, "PEM private key of that certificate");
  flags.String("tls-ca", &tls.ca_file,
               peers.empty() ? "PEM CA bundle: when set, clients must present a certificate it signed (mTLS)"
                             : "PEM CA bundle: clients must present a certificate it signed (mTLS), and " + peers +
                                   " are verified with it");
  flags.Bool("insecure", &tls.insecure,
             (peers.empty() ? std::string("serve gRPC in plaintext") : "plaintext gRPC, served and to " + peers) +
                 " (only on trusted networks; TLS flags are needed otherwise)");
  flags.Int("metrics-port", &metrics_port,
            "serve Prometheus metrics on http://ADDRESS:PORT/metrics (-1 = off, 0 = a free port, printed at start)");
  flags.String("metrics-address", &metrics_address, "address the metrics endpoint binds to");
}

absl::Status ServiceFlags::Validate() const {
  if (metrics_port < -1 || metrics_port > 65535)
    return absl::InvalidArgumentError("--metrics-port must be -1 (off), 0 (a free port) or a port");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const ServiceFlags& flags) {
  if (flags.metrics_port < 0) return std::unique_ptr<MetricsHttpServer>();
  MetricsHttpServer::Options mo;
  mo.address = flags.metrics_address;
  mo.port = static_cast<int>(flags.metrics_port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> m = MetricsHttpServer::Start(mo);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat("--metrics-port: ", m.status().message()));
  LogInfo(component, "serving metrics on http://", flags.metrics_address, ":", (*m)->port(), "/metrics");
  return m;
}

}  // namespace moe
