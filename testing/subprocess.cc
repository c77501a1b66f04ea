#include "testing/subprocess.h"

#include <filesystem>
#include <cstdlib>
#include <cstdio>

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

namespace moe {

// fork + execv rather than posix_spawn: the child must set PR_SET_PDEATHSIG
// (a test's servers never outlive it), which posix_spawn cannot. Everything
// the child touches is made before the fork — the argument vector, the
// stderr file — so between fork and exec it only makes async-signal-safe
// system calls (no allocation, no lock another thread may hold).
Subprocess::Subprocess(const std::string& binary, const std::vector<std::string>& args,
                       const std::string& stderr_path, int netns_fd) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return;
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const int err_fd =
      stderr_path.empty() ? -1 : open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
    if (getppid() != parent) _exit(127);  // the parent died before the line above
    dup2(fds[1], 1);
    if (err_fd >= 0) dup2(err_fd, 2);
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) _exit(126);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  if (err_fd >= 0) close(err_fd);
  close(fds[1]);
  out_fd_ = fds[0];
}

Subprocess::~Subprocess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
  }
  if (out_fd_ >= 0) close(out_fd_);
}

std::string Subprocess::ReadLine(std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    if (left.count() <= 0 || out_fd_ < 0) return "";
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
    char buf[4096];
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n <= 0) return "";
    buffer_.append(buf, n);
  }
}

std::string Subprocess::ReadAll(std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    if (left.count() <= 0 || out_fd_ < 0) break;
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[4096];
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n <= 0) break;
    buffer_.append(buf, n);
  }
  std::string all;
  all.swap(buffer_);
  return all;
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (pid_ > 0) {
    int st;
    const pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return st;
    }
    if (std::chrono::steady_clock::now() > end) return -1;
    usleep(10000);
  }
  return -1;
}

std::string RequireOurBinary(const std::string& program, const std::string& name, const std::string& subdir,
                             const std::string& bin_dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  if (!bin_dir.empty()) dirs.push_back(bin_dir);
  const fs::path self = fs::canonical("/proc/self/exe").parent_path();
  dirs.push_back(self);
  dirs.push_back(self / ".." / subdir);
  for (const fs::path& d : dirs)
    if (fs::exists(d / name)) return (d / name).string();
  std::fprintf(stderr, "%s: cannot find %s (build it, or pass --bin-dir)\n", program.c_str(), name.c_str());
  std::exit(1);
}

std::string RequireReady(const std::string& program, std::unique_ptr<Subprocess>* p, const std::string& bin,
                         const std::vector<std::string>& args, const std::string& log,
                         std::chrono::milliseconds timeout) {
  *p = std::make_unique<Subprocess>(bin, args, log);
  for (int i = 0; i < 4; ++i) {
    const std::string line = (*p)->ReadLine(timeout);
    const size_t at = line.find("ready on ");
    if (at != std::string::npos) return line.substr(at + 9);
    if (line.empty()) break;
  }
  std::string tail;
  if (FILE* f = std::fopen(log.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) tail.append(buf, n);
    std::fclose(f);
  }
  if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
  std::fprintf(stderr, "%s: %s did not start; its log (%s):\n%s\n", program.c_str(),
               std::filesystem::path(bin).filename().c_str(), log.c_str(), tail.c_str());
  std::exit(1);
}

}  // namespace moe
