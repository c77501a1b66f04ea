// AdminSocket: the coordinator's local admin listener — a unix socket whose
// callers are identified by the kernel (SO_PEERCRED), for running moectl (and
// same-host workers and servers) without TLS. Each accepted connection's
// peer uid is handed to the RoleAuthorizer, then the connection to the gRPC
// server (plaintext, AddInsecureChannelFromFd), so every call on it is
// checked against the roles' "uid:N" entries. The socket file is 0600, or
// 0666 when other uids are named (the uid check is what admits them); a live
// socket at the path is never taken over (unix_socket::Listen).
// Start/Stop from one thread; the accept thread is internal.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/role_authorizer.h"
#include "transport/unix_socket.h"
#include "grpcpp/grpcpp.h"

namespace moe {

class AdminSocket {
 public:
  // `server` and `authorizer` must outlive the AdminSocket.
  static absl::StatusOr<std::unique_ptr<AdminSocket>> Start(const std::string& path, const std::vector<uid_t>& uids,
                                                          grpc::Server* server, RoleAuthorizer* authorizer);
  ~AdminSocket();  // Stop()
  // Stops accepting and removes the socket file (while it is still ours);
  // connections already handed to gRPC end with the server.
  void Stop();

 private:
  AdminSocket(grpc::Server* server, RoleAuthorizer* authorizer) : server_(server), authorizer_(authorizer) {}
  void Accept(int sock);  // the listener's thread

  grpc::Server* server_;
  RoleAuthorizer* authorizer_;
  std::unique_ptr<unix_socket::Listener> listener_;
};

}  // namespace moe
