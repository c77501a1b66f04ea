#include "tests/test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

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
  for (const char* sub : {"/cpu_expert_server/", "/core/", "/client/", "/bench/", "/gpu_worker/", "/coordinator/"}) {
    std::string p = std::string(MOE_BIN_DIR) + sub + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return std::string(MOE_BIN_DIR) + "/" + name;
}

std::string StartExpertServer(Subprocess** out, const std::vector<std::string>& args,
                              const std::string& listen) {
  std::vector<std::string> a = args;
  a.push_back("--listen=" + listen);
  bool tls = false;
  for (const auto& x : args) tls |= x.rfind("--tls-", 0) == 0;
  if (!tls) a.push_back("--insecure");
  *out = new Subprocess(BinaryPath("moe-expert-server"), a);
  const std::string line = (*out)->ReadLine(std::chrono::seconds(120));
  const std::string key = "ready on ";
  const size_t at = line.find(key);
  return at == std::string::npos ? "" : line.substr(at + key.size());
}

std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
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

}  // namespace moe::testing
