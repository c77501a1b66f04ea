// TcpRelay: a TCP relay of the tests' own, the latency and the stalls of a
// network path where the kernel has no netem (issue 45 point 3). It accepts
// connections on a listening address and forwards each, byte for byte, to an
// upstream address, every chunk held back by a fixed one-way delay in each
// direction. It can be told to stall: it stops reading and writing (its
// connections stay open, the peers' buffers fill, nothing is answered) until
// resumed. Its sockets live in the network namespace it is given, so a relay
// in a server's namespace is reached through that namespace's veth link.
//
// One thread of its own drives every connection (a poll loop); the public
// methods may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace moe::testing {

class TcpRelay {
 public:
  struct Options {
    int netns_fd = -1;              // the relay's sockets' namespace; -1: this thread's
    std::string listen_host = "127.0.0.1";
    int listen_port = 0;            // 0: any free port (address() says which)
    std::string upstream_host = "127.0.0.1";
    int upstream_port = 0;
    std::chrono::microseconds delay{0};  // one way, each direction
  };
  // Listening when this returns; an error names what failed.
  static absl::StatusOr<std::unique_ptr<TcpRelay>> Start(const Options& options);
  // Stops the thread and closes every connection.
  ~TcpRelay();
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  // "host:port" to connect to.
  std::string address() const;
  // Stalled: nothing is read or written until SetStalled(false).
  void SetStalled(bool stalled);
  // Bytes written to the clients (the upstream's answers) and to the
  // upstream, and connections accepted, since the start.
  uint64_t bytes_to_clients() const { return to_clients_.load(); }
  uint64_t bytes_to_upstream() const { return to_upstream_.load(); }
  int connections_accepted() const { return accepted_.load(); }

 private:
  explicit TcpRelay(const Options& o) : options_(o) {}
  void Run();
  void Wake();

  Options options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: stop, stall and resume interrupt the poll
  int port_ = 0;
  std::atomic<bool> stop_{false}, stalled_{false};
  std::atomic<uint64_t> to_clients_{0}, to_upstream_{0};
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

}  // namespace moe::testing
