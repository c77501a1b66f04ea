// Helpers shared by the test suites: temp directories, child processes of our
// real binaries, and kernel availability.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "core/subprocess.h"
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

// Child processes: core/subprocess.h.
using moe::Subprocess;


// Starts moe-expert-server with `args` plus --listen 127.0.0.1:0 and waits for
// its "ready on ADDR" line; returns ADDR, or "" if it did not come up.
std::string StartExpertServer(Subprocess** out, const std::vector<std::string>& args,
                              const std::string& listen = "127.0.0.1:0");

// GET /metrics from 127.0.0.1:port over a plain socket (5 s timeouts); the
// whole HTTP response, "" if none.
std::string Scrape(int port);

// A free loopback TCP port below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), for a listener that a test kills
// and restarts on the same port: a port from bind(0) lies in the ephemeral
// range, where any outgoing connection (ctest runs tests in parallel; the
// agents keep redialling the dead address) may take it as its source port
// and make the restart's bind fail. 0 (= let the kernel pick) when the range
// leaves no room below it.
int ReservablePort();

}  // namespace moe::testing
