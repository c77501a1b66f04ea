// Helpers shared by the test suites: temp directories, child processes of our
// real binaries, and kernel availability.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "testing/subprocess.h"
#include "core/transport/transport.h"

namespace moe::testing {

// Plaintext gRPC, asked for explicitly (the tests run on loopback).
moe::TlsOptions PlaintextTls();

// A fresh directory under /tmp, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Path of one of our built executables (e.g. "moe-expert-server").
std::string BinaryPath(const std::string& name);

// Child processes: testing/subprocess.h.
using moe::Subprocess;


// Starts moe-expert-server with `args` plus --listen `listen` (in network
// namespace `netns_fd`, -1: this one) and waits for its "ready on ADDR"
// line; returns ADDR, or "" if it did not come up.
std::string StartExpertServer(Subprocess** out, const std::vector<std::string>& args,
                              const std::string& listen = "127.0.0.1:0", int netns_fd = -1);

// One of a test's expert servers: moe-expert-server on `model` with one
// thread, serving gRPC and shared memory on socket DIR/s<index>.sock, plus
// `extra` flags; the server joins `servers`. Returns the address a worker
// uses (unix://SOCKET when `shm`, else the gRPC address; "" when it did not
// start) and the gRPC address in *grpc_address when given.
std::string StartTestServer(std::vector<std::unique_ptr<Subprocess>>& servers, const std::string& dir,
                            const std::string& model, bool shm, const std::vector<std::string>& extra = {},
                            std::string* grpc_address = nullptr);

// GET /metrics from 127.0.0.1:port over a plain socket (5 s timeouts); the
// whole HTTP response, "" if none.
std::string Scrape(int port);
// GET `path` from 127.0.0.1:port, each socket operation bounded by
// `timeout_ms`; the whole HTTP response, "" if none.
std::string HttpGet(int port, const std::string& path, int timeout_ms);

// A slow-loris client (issue 47): `n` (at most 64) TCP connections to
// 127.0.0.1:port that each send one byte of a request that never ends every
// `every`, each opened again as soon as the server closes it, for
// `how_long`. Returns how many of the first `n` the server let in (did not
// answer or close at once). Makes only system calls (no allocation), so a
// child forked from a threaded process may run it.
int SlowLoris(int port, int n, std::chrono::milliseconds every, std::chrono::milliseconds how_long);
// SlowLoris in a child process, dropped to uid 65534 when run as root (a
// second local user); returns its pid (-1 when fork fails). Its exit status is
// SlowLoris's result, 254 when it could not change its uid.
pid_t SlowLorisChild(int port, int n, std::chrono::milliseconds every, std::chrono::milliseconds how_long);

// Runs this test binary again as uid/gid 65534 (a second local user; call
// only as root) with --gtest_filter=`filter` (disabled tests allowed), this
// process's environment (LD_LIBRARY_PATH and the like) plus `extra_env`
// ("NAME=value"). Returns the child's pid (-1 when fork fails); its exit
// status is the test's, 254 when it could not change its uid.
pid_t RunThisTestAsOtherUser(const std::string& filter, const std::vector<std::string>& extra_env);

// A free loopback TCP port below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), for a listener that a test kills
// and restarts on the same port: a port from bind(0) lies in the ephemeral
// range, where any outgoing connection (ctest runs tests in parallel; the
// agents keep redialling the dead address) may take it as its source port
// and make the restart's bind fail. 0 (= let the kernel pick) when the range
// leaves no room below it.
int ReservablePort();

// A hostile same-host neighbour (issue 25), for soak tests. Each part runs
// until Stop() or destruction and counts what it did.
//  - ServeUnsealedSegments(path): listens on an shm socket path (one a
//    killed server left, say) and answers every hello with a memfd that is
//    not sealed, then shrinks it to 0 bytes: a client that mapped it would
//    die of SIGBUS on its next access (defect 1).
//  - HoldShmSlots(path, n): a child process — dropped to uid 65534 when run
//    as root — opens n connections to the socket and keeps them silent,
//    opening new ones as the server closes them (defect 5).
class HostileNeighbour {
 public:
  HostileNeighbour() = default;
  ~HostileNeighbour() { Stop(); }
  HostileNeighbour(const HostileNeighbour&) = delete;
  HostileNeighbour& operator=(const HostileNeighbour&) = delete;

  // False (and nothing started) when the path cannot be listened on.
  bool ServeUnsealedSegments(const std::string& path);
  // Stops serving and removes the socket file (so a real server can bind it).
  void StopServing();
  int segments_handed_out() const { return handed_out_.load(); }

  // False when the child cannot be started.
  bool HoldShmSlots(const std::vector<std::string>& paths, int connections_each);
  bool holds_as_other_uid() const { return other_uid_; }

  void Stop();

 private:
  std::string path_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<int> handed_out_{0};
  std::thread server_;
  pid_t holder_ = -1;
  bool other_uid_ = false;
};

}  // namespace moe::testing
