// MetricsHttpServer: answers Prometheus scrapes of a MetricsRegistry
// (core/metrics.h) over HTTP/1.1, served by cpp-httplib (Debian's
// libcpp-httplib-dev).
//
//   GET /metrics (or HEAD; any query string)  200, text/plain; version=0.0.4
//   POST/PUT/PATCH/DELETE/OPTIONS on /metrics 405 (Allow: GET, HEAD)
//   any other path                            404
//   a malformed request line or header        400 (as the library judges it)
//
// `threads` connections are served at once; more wait in the listen backlog.
// A connection that sends nothing is closed after `client_timeout` rounded up
// to whole seconds (the library counts its idle timeout in seconds); a
// request whose bytes stop coming for `client_timeout` is dropped. Each
// response ends the connection ("Connection: close"). Rendering takes the
// registry's locks only briefly; the hot path (Increment/Observe) never
// touches this server.
//
// Lifecycle: Start() binds and starts serving; the destructor stops it and
// joins its threads, waiting at most the idle timeout for a connection that
// is open and silent. port() may be called from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "core/metrics.h"

namespace httplib {
class Server;
}

namespace moe {

class MetricsHttpServer {
 public:
  struct Options {
    std::string address = "0.0.0.0";  // numeric IPv4/IPv6 address or host name to bind
    int port = 0;                      // 0: the kernel picks a free port (see port())
    std::chrono::milliseconds client_timeout{2000};  // see the header comment
    int threads = 2;                   // connections served at once
  };

  // Binds address:port and starts serving `registry`, which must outlive the
  // server. InvalidArgument for a bad address, port or thread count,
  // Unavailable when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const Options& options,
                                                                  const MetricsRegistry& registry = Metrics());
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the chosen one when Options::port was 0).
  int port() const { return port_; }

 private:
  MetricsHttpServer();

  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace moe
