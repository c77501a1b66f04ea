// Subprocess: a child process running one of our binaries, used by the
// multi-process tests, the benchmarks and the demo driver. Its stdout is a
// pipe the parent reads lines from; stderr is inherited. The child gets
// SIGKILL when the parent dies (PR_SET_PDEATHSIG) and on destruction if it is
// still running. Not thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace moe {

class Subprocess {
 public:
  // stderr_path: where the child's stderr goes (appended); "" = inherited.
  // netns_fd: a network namespace (an open /proc/.../ns/net) the child joins
  // before exec; -1 = this thread's (testing/network_namespace.h).
  Subprocess(const std::string& binary, const std::vector<std::string>& args,
             const std::string& stderr_path = "", int netns_fd = -1);
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

// For drivers (the demo, benchmarks), which stop on the first failure: one
// of our binaries, in `bin_dir` when given, else beside this executable, else
// in ../`subdir` of it (the build tree). Not found: prints "<program>: cannot
// find NAME (build it, or pass --bin-dir)" and exits 1.
std::string RequireOurBinary(const std::string& program, const std::string& name, const std::string& subdir,
                             const std::string& bin_dir);

// Starts `bin` with `args` (stderr to `log`) into *p and waits for its
// "ready on ADDR" line (every server of ours prints one first); returns ADDR.
// None within `timeout` (a large model loads for minutes): prints "<program>: BIN did not start; its log:" and
// the log's tail, and exits 1.
std::string RequireReady(const std::string& program, std::unique_ptr<Subprocess>* p, const std::string& bin,
                         const std::vector<std::string>& args, const std::string& log,
                         std::chrono::milliseconds timeout = std::chrono::minutes(5));

}  // namespace moe
