// Network namespaces for tests that cross a real network stack (issue 45
// point 3): expert servers in namespaces of their own, joined to the test
// process by veth pairs, so their traffic is real TCP through the kernel and
// their addresses exist only inside those namespaces.
//
// Every namespace here is anonymous: held by an open fd of this process (and
// by the processes started in it), never named under /run/netns. When the
// test process dies, however it dies, its namespaces and their veth pairs go
// with it (Subprocess kills its children with PR_SET_PDEATHSIG); nothing
// outlives a run and nothing of one run is visible to another.
//
// Needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root, or a privileged container) and
// iproute2's `ip`; NetworkStackUnavailable() says why not where they lack.
// Not thread-safe: one thread builds and changes the links.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::testing {

// Moves this process into a fresh network namespace of its own (loopback
// up), so the links a test builds exist only for it. Call from main() while
// the process has one thread (every later thread inherits the namespace).
// Returns why it could not; NetworkStackUnavailable() reports it.
absl::Status EnterOwnNetworkNamespace();

// OK when this process is in a namespace of its own (EnterOwnNetworkNamespace
// succeeded), `ip` is installed and a veth pair can be made to another
// namespace; else the reason, fit for GTEST_SKIP. Checked once per process.
absl::Status NetworkStackUnavailable();

// Path of iproute2's `ip`, or "" when it is not installed.
const std::string& IpBinary();

// An anonymous network namespace (loopback up), alive while this object or a
// process started in it lives.
class NetworkNamespace {
 public:
  static absl::StatusOr<std::unique_ptr<NetworkNamespace>> Create();
  ~NetworkNamespace();
  NetworkNamespace(const NetworkNamespace&) = delete;
  NetworkNamespace& operator=(const NetworkNamespace&) = delete;

  // An fd of the namespace: Subprocess(..., netns_fd) starts a child in it;
  // setns(fd, CLONE_NEWNET) moves a thread into it.
  int fd() const { return fd_; }
  // A path naming it for `ip link set DEV netns PATH`.
  std::string path() const;
  // Runs `ip args...` inside the namespace; its stderr in the error.
  absl::Status Ip(const std::vector<std::string>& args) const;

 private:
  explicit NetworkNamespace(int fd) : fd_(fd) {}
  int fd_;
};

// Runs `ip args...` in this thread's namespace (netns_fd -1) or another;
// the error names the command and carries ip's stderr.
absl::Status RunIp(const std::vector<std::string>& args, int netns_fd = -1);

// A veth pair from this process's namespace to `peer`: /30 addresses
// 10.77.<index>.1 here and 10.77.<index>.2 there, both ends up. The peer's
// end can be set down and up again (a link that drops: the worker's side
// keeps its route and address, its packets vanish). Deleted on destruction
// (with its peer end) unless the namespace went first.
class VethLink {
 public:
  // index: 0-255, unique among this process's live links.
  static absl::StatusOr<std::unique_ptr<VethLink>> Create(const NetworkNamespace& peer, int index);
  ~VethLink();
  VethLink(const VethLink&) = delete;
  VethLink& operator=(const VethLink&) = delete;

  const std::string& local_address() const { return local_address_; }
  const std::string& peer_address() const { return peer_address_; }
  // `ip link set <peer end> down|up` inside the peer's namespace.
  absl::Status SetPeerUp(bool up);

 private:
  VethLink(const NetworkNamespace& peer, int index);
  const NetworkNamespace& peer_;
  std::string local_name_, peer_name_, local_address_, peer_address_;
};

}  // namespace moe::testing
