#include "tests/test_support.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

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

}  // namespace moe::testing
