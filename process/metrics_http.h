// MetricsHttpServer: answers Prometheus scrapes of a MetricsRegistry
// (core/metrics.h) and health checks over HTTP/1.1.
//
//   GET /metrics (or HEAD; any query string)  200, text/plain; version=0.0.4
//   GET /healthz (or HEAD)                    200, "ok"
//   any other method on those paths           405 (Allow: GET, HEAD)
//   any other path                            404
//   a malformed request line or header        400
//   request headers over 8 KiB                431
//   a peer over its connection cap, or the    503 (best effort), closed at once
//   server at its connection limit
//
// Slow or hostile clients cannot hold it (issue 47): every connection has a
// deadline for its whole request (line and headers), counted from accept and
// not restarted by the bytes that do arrive — a client that sends one byte
// every half second is closed when `request_timeout` is up, whatever it sent —
// and a deadline for taking its response. At most `max_connections` are open
// at once and at most `max_connections_per_peer` per peer are waiting for
// their answer (process/socket_peer.h: a local user by uid, anyone else by IP
// address), so one peer never holds the others' places, and /healthz and
// /metrics stay answered while it tries. Each response ends the connection
// ("Connection: close"); a request body is never read; an answered
// connection lingers (reading and dropping what the client still sends) until
// the client closes, for at most 1 s, and gives its place to a new one when
// the server is at its limit.
//
// One thread serves every connection (poll, non-blocking sockets): a
// connection costs a descriptor, not a thread. Rendering takes the registry's
// locks only briefly; the hot path (Increment/Observe) never touches this
// server.
//
// Lifecycle: Start() binds and starts serving; the destructor closes every
// connection at once and joins the thread. port() may be called from any
// thread.
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
    // From accept to the end of the request's headers, whatever arrives meanwhile.
    std::chrono::milliseconds request_timeout{2000};
    // From the end of the request to the last byte of the response taken by the client.
    std::chrono::milliseconds response_timeout{10000};
    int max_connections = 64;          // open at once, [1, 1024]
    int max_connections_per_peer = 4;  // open at once from one peer, [1, max_connections]
  };

  // Binds address:port and starts serving `registry`, which must outlive the
  // server. InvalidArgument for a bad address, port, timeout or limit,
  // Unavailable when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Options& options,
                                                                  const MetricsRegistry& registry = Metrics());
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the chosen one when Options::port was 0).
  int port() const { return port_; }
  // Connections closed at accept because their peer was at its cap or the
  // server at its limit, since the start.
  uint64_t refused_connections() const { return refused_.load(std::memory_order_relaxed); }

 private:
  class Loop;
  MetricsHttpServer() = default;

  int port_ = 0;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor wakes the loop
  std::atomic<uint64_t> refused_{0};
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

}  // namespace moe
