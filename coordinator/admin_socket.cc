#include "coordinator/admin_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "grpcpp/server_posix.h"

namespace moe {

absl::StatusOr<std::unique_ptr<AdminSocket>> AdminSocket::Start(const std::string& path, const std::vector<uid_t>& uids,
                                                               grpc::Server* server, RoleAuthorizer* authorizer) {
  const bool others = std::any_of(uids.begin(), uids.end(), [](uid_t u) { return u != getuid(); });
  std::unique_ptr<AdminSocket> s(new AdminSocket(path, server, authorizer));
  absl::StatusOr<int> fd = unix_socket::Listen(path, others ? 0666 : 0600);
  if (!fd.ok()) return fd.status();
  s->listen_fd_ = *fd;
  absl::StatusOr<unix_socket::SocketFileId> id = unix_socket::FileId(path);
  if (!id.ok()) return id.status();
  s->file_ = *id;
  if (pipe2(s->wake_fd_, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  s->acceptor_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

AdminSocket::~AdminSocket() { Stop(); }

void AdminSocket::Stop() {
  if (stop_.exchange(true)) return;
  if (wake_fd_[1] >= 0) (void)!write(wake_fd_[1], "x", 1);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    unix_socket::UnlinkIfOwn(path_, file_);
  }
  for (int fd : wake_fd_) {
    if (fd >= 0) close(fd);
  }
}

void AdminSocket::AcceptLoop() {
  while (!stop_.load()) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) break;
    if (stop_.load()) break;
    if (!(p[0].revents & POLLIN)) continue;
    const int sock = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (sock < 0) continue;
    absl::StatusOr<uid_t> uid = unix_socket::PeerUid(sock);
    if (!uid.ok()) {
      LogWarning("coordinator", "admin socket: ", uid.status().message());
      close(sock);
      continue;
    }
    // Every call on this connection is checked as "uid:N" (a uid no role
    // names gets PERMISSION_DENIED per call, with the reason).
    authorizer_->AddSocketPeer(absl::StrCat("fd:", sock), *uid);
    grpc::AddInsecureChannelFromFd(server_, sock);  // gRPC owns the fd from here
  }
}

}  // namespace moe
