// Helpers shared by the test suites: temp directories, child processes of our
// real binaries, and kernel availability.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

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

// A child process running one of our binaries; its stdout is a pipe the test
// reads lines from, stderr goes to the test's log. Killed (SIGKILL) on
// destruction if still running.
class Subprocess {
 public:
  Subprocess(const std::string& binary, const std::vector<std::string>& args);
  ~Subprocess();
  pid_t pid() const { return pid_; }
  // Next stdout line, or "" after timeout / EOF.
  std::string ReadLine(std::chrono::milliseconds timeout);
  // Everything the child writes to stdout until it closes it (or timeout).
  std::string ReadAll(std::chrono::milliseconds timeout);
  // Sends a signal; Wait returns the exit status (as from waitpid) or -1 on timeout.
  void Signal(int sig);
  int Wait(std::chrono::milliseconds timeout);
  bool running() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buffer_;
};

// Starts moe-expert-server with `args` plus --listen 127.0.0.1:0 and waits for
// its "ready on ADDR" line; returns ADDR, or "" if it did not come up.
std::string StartExpertServer(Subprocess** out, const std::vector<std::string>& args,
                              const std::string& listen = "127.0.0.1:0");

}  // namespace moe::testing
