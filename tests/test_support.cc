#include "tests/test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/time.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdlib>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cerrno>
#include <filesystem>
#include <random>

#include "core/transport/shm_server.h"
#include "core/transport/unix_socket.h"

namespace moe::testing {

moe::TlsOptions PlaintextTls() {
  moe::TlsOptions t;
  t.insecure = true;
  return t;
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/moe_test_XXXXXX";
  const char* p = mkdtemp(tmpl);
  path_ = p ? p : "/tmp";
}

TempDir::~TempDir() {
  std::error_code ec;
  if (path_ != "/tmp") std::filesystem::remove_all(path_, ec);
}

std::string BinaryPath(const std::string& name) {
  // MOE_BIN_DIR in the environment points at a folder of bundled binaries
  // (the GPU/AMX host runs the tests from such a bundle).
  if (const char* dir = getenv("MOE_BIN_DIR"); dir != nullptr && *dir != '\0')
    return std::string(dir) + "/" + name;
  for (const char* sub : {"/cpu_expert_server/", "/core/", "/client/", "/demo/", "/bench/", "/gpu_worker/", "/coordinator/"}) {
    std::string p = std::string(MOE_BIN_DIR) + sub + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return std::string(MOE_BIN_DIR) + "/" + name;
}

std::string StartExpertServer(Subprocess** out, const std::vector<std::string>& args,
                              const std::string& listen, int netns_fd) {
  std::vector<std::string> a = args;
  a.push_back("--listen=" + listen);
  bool tls = false;
  for (const auto& x : args) tls |= x.rfind("--tls-", 0) == 0;
  if (!tls) a.push_back("--insecure");
  *out = new Subprocess(BinaryPath("moe-expert-server"), a, "", netns_fd);
  const std::string line = (*out)->ReadLine(std::chrono::seconds(120));
  const std::string key = "ready on ";
  const size_t at = line.find(key);
  return at == std::string::npos ? "" : line.substr(at + key.size());
}

std::string StartTestServer(std::vector<std::unique_ptr<Subprocess>>& servers, const std::string& dir,
                            const std::string& model, bool shm, const std::vector<std::string>& extra,
                            std::string* grpc_address) {
  const std::string sock = dir + "/s" + std::to_string(servers.size()) + ".sock";
  std::vector<std::string> args = {"--model=" + model, "--threads=1", "--shm-socket=" + sock};
  args.insert(args.end(), extra.begin(), extra.end());
  Subprocess* s = nullptr;
  const std::string addr = StartExpertServer(&s, args);
  servers.emplace_back(s);
  if (grpc_address != nullptr) *grpc_address = addr;
  if (addr.empty()) return "";
  return shm ? "unix://" + sock : addr;
}

std::string Scrape(int port) { return HttpGet(port, "/metrics", 5000); }

std::string HttpGet(int port, const std::string& path, int timeout_ms) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

namespace {
// A copy of this test binary that another uid can run: the build tree may lie
// where it cannot (a checkout under /root, mode 0700, as in fresh-check's
// chroot: the re-exec failed with exit 127). The tests link only system
// libraries. Removed when this process exits.
std::string CopyOfThisBinaryForOthers() {
  static const std::string copy = [] {
    char dir[] = "/tmp/moe-other-uid-XXXXXX";
    if (mkdtemp(dir) == nullptr || chmod(dir, 0755) != 0) return std::string();
    const std::string path = std::string(dir) + "/test";
    std::error_code ec;
    std::filesystem::copy_file("/proc/self/exe", path, ec);
    if (ec || chmod(path.c_str(), 0755) != 0) return std::string();
    static const std::string to_remove = dir;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(to_remove, ignored);
    });
    return path;
  }();
  return copy;
}
}  // namespace

pid_t RunThisTestAsOtherUser(const std::string& filter, const std::vector<std::string>& extra_env) {
  const std::string copy = CopyOfThisBinaryForOthers();
  const std::string self = copy.empty() ? std::filesystem::read_symlink("/proc/self/exe").string() : copy;
  const std::string filter_arg = "--gtest_filter=" + filter;
  const char* argv[] = {self.c_str(), "--gtest_also_run_disabled_tests", filter_arg.c_str(), nullptr};
  // Everything built before fork: the child of a threaded process only makes system calls.
  std::vector<const char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (const std::string& e : extra_env) envp.push_back(e.c_str());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(254);
    execve(self.c_str(), const_cast<char* const*>(argv), const_cast<char* const*>(envp.data()));
    _exit(127);
  }
  return pid;
}

int SlowLoris(int port, int n, std::chrono::milliseconds every, std::chrono::milliseconds how_long) {
  constexpr int kMax = 64;
  n = std::min(std::max(n, 0), kMax);
  int fds[kMax];
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  auto open_one = [&a] {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  };
  auto answered_or_closed = [](int fd) {
    pollfd p{fd, POLLIN, 0};
    return fd < 0 || poll(&p, 1, 0) != 0;
  };
  for (int i = 0; i < n; ++i) fds[i] = open_one();
  usleep(100000);
  int held = 0;
  for (int i = 0; i < n; ++i) held += answered_or_closed(fds[i]) ? 0 : 1;
  static const char kHead[] = "GET /metrics HTTP/1.1\r\nX-Slow: ";
  const auto end = std::chrono::steady_clock::now() + how_long;
  for (size_t step = 0; std::chrono::steady_clock::now() < end; ++step) {
    const char byte = step < sizeof(kHead) - 1 ? kHead[step] : 'a';
    for (int i = 0; i < n; ++i) {
      if (answered_or_closed(fds[i])) {
        if (fds[i] >= 0) close(fds[i]);
        fds[i] = open_one();
      }
      if (fds[i] >= 0) (void)!send(fds[i], &byte, 1, MSG_NOSIGNAL);
    }
    usleep(static_cast<useconds_t>(every.count() * 1000));
  }
  for (int i = 0; i < n; ++i)
    if (fds[i] >= 0) close(fds[i]);
  return held;
}

pid_t SlowLorisChild(int port, int n, std::chrono::milliseconds every, std::chrono::milliseconds how_long) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(254);
  _exit(SlowLoris(port, n, every, how_long));
}

int ReservablePort() {
  int lo = 32768, hi = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768;
    std::fclose(f);
  }
  const int first = 10000, last = lo - 1;
  if (last - first < 1000) return 0;
  std::random_device rd;
  std::mt19937 rng(rd());
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = first + static_cast<int>(rng() % static_cast<unsigned>(last - first + 1));
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC binds
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && listen(fd, 1) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}


bool HostileNeighbour::ServeUnsealedSegments(const std::string& path) {
  StopServing();
  absl::StatusOr<int> fd = unix_socket::Listen(path, 0666);
  if (!fd.ok()) return false;
  path_ = path;
  listen_fd_ = *fd;
  stop_ = false;
  server_ = std::thread([this] {
    while (!stop_.load()) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      ShmHello hello{};
      int none = -1;
      if (unix_socket::Receive(c, &hello, sizeof(hello), &none, 2000).ok()) {
        const int mem = memfd_create("hostile-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (mem >= 0 && ftruncate(mem, 64 << 20) == 0) {
          ShmReply reply{};
          reply.magic = hello.magic;  // a segment or a store, whichever was asked for
          reply.segment_bytes = 64 << 20;
          if (unix_socket::Send(c, &reply, sizeof(reply), mem).ok()) ++handed_out_;
          (void)!ftruncate(mem, 0);  // shrunk under any mapping the client made
        }
        if (mem >= 0) close(mem);
      }
      close(c);
    }
  });
  return true;
}

void HostileNeighbour::StopServing() {
  stop_ = true;
  if (server_.joinable()) server_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
    unlink(path_.c_str());
  }
}

bool HostileNeighbour::HoldShmSlots(const std::vector<std::string>& paths, int connections_each) {
  other_uid_ = geteuid() == 0;
  // Everything the child needs is made before the fork: this process has
  // threads, and after fork() the child may only make system calls (a lock
  // another thread held, malloc's say, stays held there for ever).
  std::vector<sockaddr_un> addresses;
  for (const std::string& path : paths) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    addresses.push_back(a);
  }
  const size_t each = static_cast<size_t>(std::max(connections_each, 0));
  std::vector<int> held(addresses.size() * each, -1);
  holder_ = fork();
  if (holder_ < 0) return false;
  if (holder_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(3);
    for (;;) {
      for (size_t i = 0; i < held.size(); ++i) {
        if (held[i] >= 0) {  // closed by the server? then open another
          char b;
          if (recv(held[i], &b, 1, MSG_DONTWAIT) != 0 && errno == EAGAIN) continue;
          close(held[i]);
          held[i] = -1;
        }
        const sockaddr_un& a = addresses[i / each];
        const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (sock >= 0 && connect(sock, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) {
          held[i] = sock;  // silent: no hello
        } else if (sock >= 0) {
          close(sock);
        }
      }
      usleep(20000);
    }
  }
  return true;
}

void HostileNeighbour::Stop() {
  StopServing();
  if (holder_ > 0) {
    kill(holder_, SIGKILL);
    waitpid(holder_, nullptr, 0);
    holder_ = -1;
  }
}

}  // namespace moe::testing
