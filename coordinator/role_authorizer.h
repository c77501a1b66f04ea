// RoleAuthorizer: who may call which coordinator RPC. Every caller holds zero
// or more of three roles — admin (moectl's mutations: pin, unpin, policy,
// rebalance, drain), worker (RegisterWorker, worker heartbeats, ReportStats,
// WatchAssignments) and server (RegisterExpertServer, server heartbeats) —
// decided from what the transport proves about it:
//   - a verified client certificate (mTLS): its subject common name and every
//     subject alternative name, matched against the role's allow-list;
//   - a connection on the admin unix socket (AdminSocket): "uid:N", N being
//     the peer uid the kernel reported (SO_PEERCRED);
//   - a plaintext TCP caller on loopback, only when started with
//     --insecure-admin: every role;
//   - anything else is anonymous and matches only "*".
// Denials are PERMISSION_DENIED naming the role, the RPC and the caller.
// Thread-safe: Check runs on gRPC's threads, AddSocketPeer on the admin
// socket's accept thread.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/flags.h"
#include "grpcpp/grpcpp.h"

namespace moe {

enum class Role { kAdmin, kWorker, kServer };
const char* RoleName(Role role);

struct AuthorizationPolicy {
  // Allowed identities per role, each a certificate name (CN or SAN, exact),
  // "uid:N" (a peer uid on the admin socket) or "*" (any caller that reaches
  // a listener, authenticated or not).
  std::vector<std::string> admin, worker, server;
  // Plaintext callers from loopback (127.0.0.0/8, ::1) hold every role.
  bool insecure_admin = false;

  // Defaults: admin and server only for this process's own uid on the admin
  // socket, worker for anyone who reaches the coordinator.
  static AuthorizationPolicy Defaults();
  // --admin-identities / --worker-identities / --server-identities (comma
  // lists; empty keeps the default) and --insecure-admin.
  void Register(FlagSet& flags);
  // After Parse: splits the lists; InvalidArgument naming a bad entry.
  absl::Status Finish();
  // The uids named by "uid:N" entries of any role (who may open the admin socket's file).
  std::vector<uid_t> SocketUids() const;

 private:
  std::string admin_text_, worker_text_, server_text_;
};

class RoleAuthorizer {
 public:
  explicit RoleAuthorizer(AuthorizationPolicy policy) : policy_(std::move(policy)) {}

  // A connection the admin socket accepted and handed to gRPC as `peer`
  // (the string ServerContext::peer() reports for its calls), from `uid`.
  void AddSocketPeer(const std::string& peer, uid_t uid);
  // OK when the caller of `rpc` holds `role`.
  absl::Status Check(const grpc::ServerContext& ctx, Role role, absl::string_view rpc) const;
  // What the transport proves about the caller: its certificate names (CN,
  // then SANs, joined by ","), "" for a caller without a verified certificate.
  static std::string CertificateIdentity(const grpc::ServerContext& ctx);
  // Who the caller is, as the key of a per-peer limit (the coordinator's cap
  // on registrations): "uid:N" on the admin socket; with a verified
  // certificate, its names at its address ("cert:NAMES@ip:ADDR", so one
  // certificate shared by the pods of a deployment is one peer per pod;
  // "@uid:N" on loopback);
  // otherwise process/socket_peer.h's key (a loopback caller's uid, anyone
  // else's address).
  std::string PeerIdentity(const grpc::ServerContext& ctx) const;

 private:
  const std::vector<std::string>& Allowed(Role role) const;

  AuthorizationPolicy policy_;
  mutable std::mutex mu_;
  std::map<std::string, uid_t> socket_peers_;
};

}  // namespace moe
