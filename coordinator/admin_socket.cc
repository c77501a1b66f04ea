#include "coordinator/admin_socket.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "grpcpp/server_posix.h"

namespace moe {

absl::StatusOr<std::unique_ptr<AdminSocket>> AdminSocket::Start(const std::string& path, const std::vector<uid_t>& uids,
                                                               grpc::Server* server, RoleAuthorizer* authorizer) {
  const bool others = std::any_of(uids.begin(), uids.end(), [](uid_t u) { return u != getuid(); });
  std::unique_ptr<AdminSocket> s(new AdminSocket(server, authorizer));
  MOE_ASSIGN_OR_RETURN(s->listener_, unix_socket::Listener::Start(
                                         path, others ? 0666 : 0600, [p = s.get()](int sock) { p->Accept(sock); },
                                         SOCK_NONBLOCK));
  return s;
}

AdminSocket::~AdminSocket() { Stop(); }

void AdminSocket::Stop() {
  if (listener_) listener_->Stop();
}

void AdminSocket::Accept(int sock) {
  absl::StatusOr<uid_t> uid = unix_socket::PeerUid(sock);
  if (!uid.ok()) {
    LogWarning("coordinator", "admin socket: ", uid.status().message());
    close(sock);
    return;
  }
  // Every call on this connection is checked as "uid:N" (a uid no role
  // names gets PERMISSION_DENIED per call, with the reason).
  authorizer_->AddSocketPeer(absl::StrCat("fd:", sock), *uid);
  grpc::AddInsecureChannelFromFd(server_, sock);  // gRPC owns the fd from here
}

}  // namespace moe
