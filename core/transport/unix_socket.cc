#include "core/transport/unix_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe::unix_socket {

namespace {
absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is empty or too long"));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}
}  // namespace

absl::StatusOr<int> Listen(const std::string& path, mode_t mode) {
  absl::StatusOr<sockaddr_un> addr = Address(path);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
  // Create the socket file with no permissions for others from the start.
  const mode_t old = umask(0177);
  const int rc = bind(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  umask(old);
  if (rc != 0) {
    close(fd);
    return Errno(absl::StrCat("bind ", path));
  }
  if (chmod(path.c_str(), mode) != 0 || listen(fd, 64) != 0) {
    close(fd);
    return Errno(absl::StrCat("listen ", path));
  }
  return fd;
}

absl::StatusOr<int> Connect(const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = Address(path);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    absl::Status st = Errno(absl::StrCat("connect ", path));
    close(fd);
    return st;
  }
  return fd;
}

absl::StatusOr<uid_t> PeerUid(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED");
  return cred.uid;
}

absl::Status Send(int sock, const void* data, size_t len, int fd) {
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  if (n != static_cast<ssize_t>(len)) return Errno("sendmsg");
  return absl::OkStatus();
}

absl::Status Receive(int sock, void* data, size_t len, int* fd, int timeout_ms) {
  if (fd != nullptr) *fd = -1;
  pollfd p{sock, POLLIN, 0};
  const int r = poll(&p, 1, timeout_ms);
  if (r == 0) return absl::DeadlineExceededError("no answer on the unix socket");
  if (r < 0) return Errno("poll");
  iovec iov{data, len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(sock, &msg, MSG_WAITALL | MSG_CMSG_CLOEXEC);
  if (n != static_cast<ssize_t>(len)) {
    return n == 0 ? absl::UnavailableError("peer closed the unix socket") : Errno("recvmsg");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && fd != nullptr) {
      std::memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
  }
  return absl::OkStatus();
}

bool PeerClosed(int sock) {
  pollfd p{sock, POLLRDHUP, 0};
  const int r = poll(&p, 1, 0);
  return r < 0 || (r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0);
}

}  // namespace moe::unix_socket
