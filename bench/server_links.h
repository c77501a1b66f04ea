// The expert servers a benchmark runs against and the links it reaches them
// by (issue 45 point 4: what a remote pool costs). Every server listens on
// its shared-memory socket and on gRPC; with a netns link each lives in a
// network namespace of its own, joined to the benchmark's by a veth pair
// (testing/network_namespace.h: real TCP through the kernel), reached
// straight or through a TcpRelay in its namespace that delays each direction
// (testing/tcp_relay.h; the kernel has no netem). The same server processes
// serve every link of a run, so the links' rows differ only by the path.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/bf16.h"
#include "testing/network_namespace.h"
#include "testing/subprocess.h"
#include "testing/tcp_relay.h"

namespace moe {

// How the worker reaches the servers: "shm" (their shared memory), "netns"
// (gRPC over the veth pair), "netns:US" (the same through a relay that holds
// every chunk US µs in each direction).
struct ServerLink {
  std::string name;
  bool netns = false;
  int delay_us = -1;  // netns through a relay of this one-way delay; -1: straight
};
// A comma-separated list of links; INVALID_ARGUMENT naming the bad entry.
absl::StatusOr<std::vector<ServerLink>> ParseServerLinks(absl::string_view text);

class BenchServers {
 public:
  struct Options {
    std::string binary;                  // moe-expert-server
    std::string dir;                     // where their sockets go
    int count = 1;                       // servers (e.g. slices, each with its --slice i/count in `args[i]`)
    std::vector<std::vector<std::string>> args;  // per server, beside --shm-socket, --listen and --insecure
    std::vector<ServerLink> links;       // every link a run will use (netns ones need the namespaces)
    std::chrono::milliseconds start_timeout{std::chrono::minutes(10)};
  };
  // Starts every server (in namespaces of their own when a link asks) and the
  // relays. The benchmark's process must have called
  // testing::EnterOwnNetworkNamespace() from main() first when a link is netns.
  static absl::StatusOr<std::unique_ptr<BenchServers>> Start(const Options& options);
  ~BenchServers();  // SIGTERM to every server, then waits

  // Each server's shared-memory socket path.
  const std::vector<std::string>& sockets() const { return sockets_; }
  // What the worker dials for each server over `link`: "unix://PATH" or "HOST:PORT".
  std::vector<std::string> Addresses(const ServerLink& link) const;
  size_t size() const { return servers_.size(); }

 private:
  struct Server {
    std::unique_ptr<testing::NetworkNamespace> ns;
    std::unique_ptr<testing::VethLink> link;
    std::unique_ptr<Subprocess> process;
    std::string grpc;  // its gRPC address ("ready on ...")
    std::vector<std::pair<int, std::unique_ptr<testing::TcpRelay>>> relays;  // by one-way delay
  };
  BenchServers() = default;
  std::vector<std::string> sockets_;
  std::vector<Server> servers_;
};

// The median round trip (seconds) of an empty `tokens`-token batch of `layer`
// (no expert: every id -1) to the server at `address`, over `reps` round trips after a few
// untimed ones: what a layer call pays for the path alone.
absl::StatusOr<double> EmptyRoundTrip(const std::string& address, int hidden, int layer, int tokens, int reps);

}  // namespace moe
