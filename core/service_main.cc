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

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpoint(const std::string& component,
                                                                       const std::string& address,
                                                                       int64_t port) {
  if (port < -1 || port > 65535)
    return absl::InvalidArgumentError("--metrics-port must be -1 (off), 0 (a free port) or a port");
  if (port < 0) return std::unique_ptr<MetricsHttpServer>();
  MetricsHttpServer::Options mo;
  mo.address = address;
  mo.port = static_cast<int>(port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> m = MetricsHttpServer::Start(mo);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat("--metrics-port: ", m.status().message()));
  LogInfo(component, "serving metrics on http://", address, ":", (*m)->port(), "/metrics");
  return m;
}

}  // namespace moe
