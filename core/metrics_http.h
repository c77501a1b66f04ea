// MetricsHttpServer: a minimal HTTP/1.1 server that answers Prometheus
// scrapes of a MetricsRegistry (core/metrics.h).
//
//   GET /metrics (or HEAD; any query string)  200, text/plain; version=0.0.4
//   another method on /metrics                405
//   any other path                            404
//   a malformed request line or header        400  (431 past 8 KiB of header)
//
// One thread runs a poll(2) loop over the listening socket and every open
// connection, all non-blocking: a slow or silent client never holds up
// another one, and each connection is closed when it has been open for
// `client_timeout` (answered or not). Each response ends the connection
// ("Connection: close"). The process is never blocked: rendering takes the
// registry's locks only briefly and the thread serves nothing else.
//
// Lifecycle: Start() binds and starts the thread; the destructor stops it,
// closes every connection and joins. port() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "core/metrics.h"

namespace moe {

class MetricsHttpServer {
 public:
  struct Options {
    std::string address = "0.0.0.0";  // numeric IPv4/IPv6 address or host name to bind
    int port = 0;                      // 0: the kernel picks a free port (see port())
    std::chrono::milliseconds client_timeout{5000};  // longest a connection stays open
    int max_connections = 16;          // more wait in the listen backlog
  };

  // Binds address:port and starts serving `registry`, which must outlive the
  // server. InvalidArgument for a bad address or port, Unavailable when the
  // port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Options& options,
                                                                  const MetricsRegistry& registry = Metrics());
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the chosen one when Options::port was 0).
  int port() const { return port_; }

 private:
  struct Connection;
  MetricsHttpServer(const Options& options, const MetricsRegistry& registry);
  void Loop();
  // Reads what the connection has; sets its response once the request is complete.
  void ReadRequest(Connection& c);
  std::string Respond(const std::string& request_head) const;

  const Options options_;
  const MetricsRegistry& registry_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor wakes the loop
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace moe
