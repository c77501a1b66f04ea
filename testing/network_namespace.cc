#include "testing/network_namespace.h"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "testing/subprocess.h"

namespace moe::testing {
namespace {

absl::Status& EnterStatus() {
  static absl::Status s = absl::FailedPreconditionError("EnterOwnNetworkNamespace() was not called from main()");
  return s;
}

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Sets the loopback device of this thread's namespace up (a fresh namespace
// has it down) without needing `ip`.
absl::Status LoopbackUp() {
  const int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return absl::InternalError(Errno("socket"));
  ifreq r{};
  std::strncpy(r.ifr_name, "lo", IFNAMSIZ - 1);
  bool ok = ioctl(s, SIOCGIFFLAGS, &r) == 0;
  r.ifr_flags |= IFF_UP;
  ok = ok && ioctl(s, SIOCSIFFLAGS, &r) == 0;
  const std::string why = ok ? "" : Errno("setting lo up");
  close(s);
  return ok ? absl::OkStatus() : absl::PermissionDeniedError(why);
}

}  // namespace

absl::Status EnterOwnNetworkNamespace() {
  absl::Status& s = EnterStatus();
  std::error_code ec;
  const auto tasks = std::distance(std::filesystem::directory_iterator("/proc/self/task", ec),
                                   std::filesystem::directory_iterator());
  if (ec || tasks != 1) {
    s = absl::FailedPreconditionError("EnterOwnNetworkNamespace: the process must have one thread");
  } else if (unshare(CLONE_NEWNET) != 0) {
    s = absl::PermissionDeniedError(absl::StrCat(
        Errno("unshare(CLONE_NEWNET)"), " (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN: "
        "run as root or in a privileged container)"));
  } else {
    s = LoopbackUp();
  }
  return s;
}

const std::string& IpBinary() {
  static const std::string path = [] {
    std::string dirs = getenv("PATH") != nullptr ? getenv("PATH") : "";
    dirs += ":/usr/sbin:/sbin:/usr/bin:/bin";
    for (absl::string_view d : absl::StrSplit(dirs, ':', absl::SkipEmpty())) {
      const std::string p = absl::StrCat(d, "/ip");
      if (access(p.c_str(), X_OK) == 0) return p;
    }
    return std::string();
  }();
  return path;
}

absl::Status RunIp(const std::vector<std::string>& args, int netns_fd) {
  const std::string command = absl::StrCat("ip ", absl::StrJoin(args, " "));
  if (IpBinary().empty()) return absl::FailedPreconditionError(command + ": iproute2's ip is not installed");
  char err_path[] = "/tmp/moe-ip-XXXXXX";
  const int err_fd = mkstemp(err_path);
  if (err_fd < 0) return absl::InternalError(Errno("mkstemp"));
  close(err_fd);
  int status = -1;
  {
    Subprocess ip(IpBinary(), args, err_path, netns_fd);
    status = ip.Wait(std::chrono::seconds(10));
  }
  std::ifstream in(err_path);
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  unlink(err_path);
  while (!err.empty() && err.back() == '\n') err.pop_back();
  if (status == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      command, status == -1 ? ": no exit within 10 s" : absl::StrCat(": exit status ", status),
      err.empty() ? "" : ": ", err));
}

absl::StatusOr<std::unique_ptr<NetworkNamespace>> NetworkNamespace::Create() {
  // A short-lived thread makes the namespace and opens it; the fd keeps it
  // alive after the thread (the only task in it) ends. This thread's own
  // namespace does not change.
  int fd = -1;
  absl::Status st;
  std::thread maker([&] {
    if (unshare(CLONE_NEWNET) != 0) {
      st = absl::PermissionDeniedError(Errno("unshare(CLONE_NEWNET)"));
      return;
    }
    fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    st = fd < 0 ? absl::InternalError(Errno("open /proc/thread-self/ns/net")) : LoopbackUp();
  });
  maker.join();
  if (!st.ok()) {
    if (fd >= 0) close(fd);
    return st;
  }
  return std::unique_ptr<NetworkNamespace>(new NetworkNamespace(fd));
}

NetworkNamespace::~NetworkNamespace() { close(fd_); }

std::string NetworkNamespace::path() const { return absl::StrCat("/proc/", getpid(), "/fd/", fd_); }

absl::Status NetworkNamespace::Ip(const std::vector<std::string>& args) const { return RunIp(args, fd_); }

VethLink::VethLink(const NetworkNamespace& peer, int index)
    : peer_(peer),
      local_name_(absl::StrCat("moew", index)),
      peer_name_(absl::StrCat("moes", index)),
      local_address_(absl::StrCat("10.77.", index, ".1")),
      peer_address_(absl::StrCat("10.77.", index, ".2")) {}

absl::StatusOr<std::unique_ptr<VethLink>> VethLink::Create(const NetworkNamespace& peer, int index) {
  if (index < 0 || index > 255) return absl::InvalidArgumentError("VethLink: index must be 0-255");
  std::unique_ptr<VethLink> l(new VethLink(peer, index));
  absl::Status st = RunIp({"link", "add", l->local_name_, "type", "veth", "peer", "name", l->peer_name_});
  if (!st.ok()) {
    l->local_name_.clear();  // nothing to delete
    return st;
  }
  for (absl::Status s : {RunIp({"link", "set", l->peer_name_, "netns", peer.path()}),
                         RunIp({"addr", "add", l->local_address_ + "/30", "dev", l->local_name_}),
                         RunIp({"link", "set", l->local_name_, "up"}),
                         peer.Ip({"addr", "add", l->peer_address_ + "/30", "dev", l->peer_name_}),
                         peer.Ip({"link", "set", l->peer_name_, "up"})})
    if (!s.ok()) return s;
  return l;
}

VethLink::~VethLink() {
  if (!local_name_.empty()) (void)RunIp({"link", "del", local_name_});
}

absl::Status VethLink::SetPeerUp(bool up) { return peer_.Ip({"link", "set", peer_name_, up ? "up" : "down"}); }

absl::Status NetworkStackUnavailable() {
  static std::once_flag once;
  static absl::Status verdict;
  std::call_once(once, [] {
    if (!EnterStatus().ok()) {
      verdict = EnterStatus();
      return;
    }
    if (IpBinary().empty()) {
      verdict = absl::FailedPreconditionError("iproute2's ip is not installed (scripts/install-deps.sh installs it)");
      return;
    }
    absl::StatusOr<std::unique_ptr<NetworkNamespace>> ns = NetworkNamespace::Create();
    if (!ns.ok()) {
      verdict = ns.status();
      return;
    }
    absl::StatusOr<std::unique_ptr<VethLink>> probe = VethLink::Create(**ns, 255);
    if (!probe.ok())
      verdict = absl::FailedPreconditionError(absl::StrCat("cannot make a veth pair: ", probe.status().message()));
  });
  return verdict;
}

}  // namespace moe::testing
