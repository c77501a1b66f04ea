#include "transport/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

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
  MOE_ASSIGN_OR_RETURN(const sockaddr_un addr, Address(path));
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      close(fd);
      return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
    }
    // A server that answers there is alive: never take its socket over.
    if (absl::StatusOr<int> probe = Connect(path); probe.ok()) {
      ::close(*probe);
      close(fd);
      return absl::AlreadyExistsError(absl::StrCat("a server already listens on ", path));
    }
    if (st.st_uid != geteuid()) {
      close(fd);
      return absl::PermissionDeniedError(
          absl::StrCat(path, " is a stale socket of uid ", st.st_uid, "; not removing another user's file"));
    }
    unlink(path.c_str());  // stale: its server is gone
  }
  // Create the socket file with no permissions for others from the start; a
  // concurrent starter that wins the race makes our bind fail (EADDRINUSE).
  const mode_t old = umask(0177);
  const int rc = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  umask(old);
  if (rc != 0) {
    close(fd);
    return Errno(absl::StrCat("bind ", path));
  }
  // A backlog for a neighbour's burst of connects (64 made other clients'
  // nonblocking connect() fail with EAGAIN), short enough that a client queued
  // behind a flood of them waits ~40 ms, not the ~0.5 s of SOMAXCONN's 4096
  // (Hardening.ConnectionChurnFloodsNeitherTheLogNorOthersHandshakes).
  if (chmod(path.c_str(), mode) != 0 || listen(fd, 256) != 0) {
    absl::Status err = Errno(absl::StrCat("listen ", path));
    unlink(path.c_str());
    close(fd);
    return err;
  }
  return fd;
}

absl::StatusOr<SocketFileId> FileId(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return Errno(absl::StrCat("stat ", path));
  return SocketFileId{st.st_dev, st.st_ino};
}

void UnlinkIfOwn(const std::string& path, const SocketFileId& id) {
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && st.st_dev == id.dev && st.st_ino == id.ino) unlink(path.c_str());
}

absl::StatusOr<int> Connect(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(const sockaddr_un addr, Address(path));
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  // A full backlog (another client's burst of connects) is EAGAIN: retried
  // for up to a second, as the server drains it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if ((errno == EAGAIN || errno == EINTR) && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
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
  // One deadline for the whole message: a peer that sends part of it and
  // stalls must not hold the caller longer than a silent one.
  // A negative timeout waits without limit (the peer's close still ends it).
  const bool forever = timeout_ms < 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(forever ? 0 : timeout_ms);
  size_t got = 0;
  while (got < len) {
    const auto left =
        forever ? -1
                : std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())
                      .count();
    if (!forever && left <= 0)
      return absl::DeadlineExceededError(
          absl::StrCat("no complete answer on the unix socket within ", timeout_ms, " ms (", got, " of ", len, " bytes)"));
    pollfd p{sock, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r == 0) continue;
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("poll");
    }
    iovec iov{static_cast<char*>(data) + got, len - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n == 0) return absl::UnavailableError("peer closed the unix socket");
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return Errno("recvmsg");
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int received = -1;
        std::memcpy(&received, CMSG_DATA(c), sizeof(int));
        if (fd != nullptr && *fd < 0) {
          *fd = received;
        } else {
          ::close(received);  // unasked-for or a second fd: do not leak it
        }
      }
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status CheckResizeSealed(int fd, uint64_t bytes, const std::string& what) {
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the memfd is not sealed against resizing (F_SEAL_SHRINK and F_SEAL_GROW); the peer could shrink it "
              "under the mapping"));
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat(what, ": fstat: ", std::strerror(errno)));
  if (static_cast<uint64_t>(st.st_size) < bytes)
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", bytes, " bytes announced, the memfd holds ", static_cast<uint64_t>(st.st_size)));
  return absl::OkStatus();
}

bool PeerClosed(int sock) {
  pollfd p{sock, POLLRDHUP, 0};
  const int r = poll(&p, 1, 0);
  return r < 0 || (r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0);
}

bool PeerClosedProbe::Closed() {
  if (closed_) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_) return false;
  next_ = now + every_;
  closed_ = PeerClosed(sock_);
  return closed_;
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Start(const std::string& path, mode_t mode,
                                                         std::function<void(int fd)> on_accept, int extra_flags) {
  std::unique_ptr<Listener> l(new Listener());
  l->path_ = path;
  l->on_accept_ = std::move(on_accept);
  l->flags_ = SOCK_CLOEXEC | extra_flags;
  MOE_ASSIGN_OR_RETURN(l->listen_fd_, Listen(path, mode));
  // On failure ~Listener closes the socket (and leaves a file it cannot identify).
  MOE_ASSIGN_OR_RETURN(l->file_, FileId(path));
  if (pipe2(l->wake_fd_, O_CLOEXEC) != 0) return Errno("pipe2");
  l->acceptor_ = std::thread([p = l.get()] { p->AcceptLoop(); });
  return l;
}

Listener::~Listener() { Stop(); }

void Listener::Stop() {
  if (stop_.exchange(true)) return;
  if (wake_fd_[1] >= 0) (void)!write(wake_fd_[1], "x", 1);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    if (file_.ino != 0) UnlinkIfOwn(path_, file_);
  }
  for (int fd : wake_fd_) {
    if (fd >= 0) close(fd);
  }
}

void Listener::AcceptLoop() {
  while (!stop_.load()) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) break;
    if (stop_.load()) break;
    if (!(p[0].revents & POLLIN)) continue;
    const int sock = accept4(listen_fd_, nullptr, nullptr, flags_);
    if (sock >= 0) on_accept_(sock);
  }
}

}  // namespace moe::unix_socket
