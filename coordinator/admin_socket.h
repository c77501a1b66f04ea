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

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/role_authorizer.h"
#include "core/transport/unix_socket.h"
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
  AdminSocket(std::string path, grpc::Server* server, RoleAuthorizer* authorizer)
      : path_(std::move(path)), server_(server), authorizer_(authorizer) {}
  void AcceptLoop();

  std::string path_;
  grpc::Server* server_;
  RoleAuthorizer* authorizer_;
  int listen_fd_ = -1;
  int wake_fd_[2] = {-1, -1};
  unix_socket::SocketFileId file_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

}  // namespace moe
