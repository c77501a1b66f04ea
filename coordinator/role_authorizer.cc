#include "coordinator/role_authorizer.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "process/socket_peer.h"
#include "core/status_macros.h"

namespace moe {

namespace {

constexpr absl::string_view kUidPrefix = "uid:";
// gRPC names the calls of a channel added from a file descriptor "fd:N".
constexpr absl::string_view kFdPeerPrefix = "fd:";

bool IsLoopbackPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]") ||
         absl::StartsWith(peer, "ipv6:[::ffff:127.");
}

absl::Status ParseList(const std::string& text, const char* flag, std::vector<std::string>* out) {
  if (text.empty()) return absl::OkStatus();  // keep the default
  out->clear();
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const std::string entry(absl::StripAsciiWhitespace(item));
    if (absl::StartsWith(entry, kUidPrefix)) {
      uint32_t uid = 0;
      if (!absl::SimpleAtoi(entry.substr(kUidPrefix.size()), &uid))
        return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", entry, "' is not uid:N"));
    }
    out->push_back(entry);
  }
  if (out->empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": empty list"));
  return absl::OkStatus();
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin: return "admin";
    case Role::kWorker: return "worker";
    case Role::kServer: return "server";
  }
  return "unknown";
}

AuthorizationPolicy AuthorizationPolicy::Defaults() {
  AuthorizationPolicy p;
  const std::string self = absl::StrCat(kUidPrefix, getuid());
  p.admin = {self};
  p.server = {self};
  p.worker = {"*"};
  return p;
}

void AuthorizationPolicy::Register(FlagSet& flags) {
  auto join = [](const std::vector<std::string>& v) { return absl::StrJoin(v, ","); };
  flags.String("admin-identities", &admin_text_,
               "who holds the admin role (moectl pin/unpin/policy/rebalance/drain): comma list of certificate "
               "names (CN or SAN), uid:N (peer uid on --admin-socket) or * (anyone); default " + join(admin));
  flags.String("worker-identities", &worker_text_,
               "who holds the worker role (register, heartbeat, stats, assignments); default " + join(worker));
  flags.String("server-identities", &server_text_,
               "who holds the server role (expert-server registration and heartbeats); default " + join(server));
  flags.Bool("insecure-admin", &insecure_admin,
             "plaintext callers from loopback hold every role (demo and tests on one machine; never with other "
             "users on the host)");
}

absl::Status AuthorizationPolicy::Finish() {
  MOE_RETURN_IF_ERROR(ParseList(admin_text_, "admin-identities", &admin));
  MOE_RETURN_IF_ERROR(ParseList(worker_text_, "worker-identities", &worker));
  return ParseList(server_text_, "server-identities", &server);
}

std::vector<uid_t> AuthorizationPolicy::SocketUids() const {
  std::vector<uid_t> uids;
  for (const auto* list : {&admin, &worker, &server}) {
    for (const std::string& e : *list) {
      uint32_t uid = 0;
      if (absl::StartsWith(e, kUidPrefix) && absl::SimpleAtoi(e.substr(kUidPrefix.size()), &uid)) uids.push_back(uid);
    }
  }
  return uids;
}

void RoleAuthorizer::AddSocketPeer(const std::string& peer, uid_t uid) {
  std::lock_guard<std::mutex> lock(mu_);
  socket_peers_[peer] = uid;  // an fd number reused by a later connection is overwritten here first
}

const std::vector<std::string>& RoleAuthorizer::Allowed(Role role) const {
  switch (role) {
    case Role::kAdmin: return policy_.admin;
    case Role::kWorker: return policy_.worker;
    case Role::kServer: return policy_.server;
  }
  return policy_.admin;
}

std::string RoleAuthorizer::CertificateIdentity(const grpc::ServerContext& ctx) {
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  std::vector<std::string> names;
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME})
    for (const grpc::string_ref& v : auth->FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
  return absl::StrJoin(names, ",");
}

std::string RoleAuthorizer::PeerIdentity(const grpc::ServerContext& ctx) const {
  const std::string peer = ctx.peer();
  if (absl::StartsWith(peer, kFdPeerPrefix)) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = socket_peers_.find(peer);
    return it == socket_peers_.end() ? "" : absl::StrCat(kUidPrefix, it->second);
  }
  const std::string address = PeerKeyOfGrpcPeer(peer);
  const std::string certificate = CertificateIdentity(ctx);
  if (certificate.empty()) return address;
  return absl::StrCat("cert:", certificate, "@", address);
}

absl::Status RoleAuthorizer::Check(const grpc::ServerContext& ctx, Role role, absl::string_view rpc) const {
  const std::vector<std::string>& allowed = Allowed(role);
  const bool anyone = std::find(allowed.begin(), allowed.end(), "*") != allowed.end();
  const std::string peer = ctx.peer();
  std::vector<std::string> names;  // what the transport proves about the caller
  std::string who;
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
      for (const grpc::string_ref& v : auth->FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
    }
    who = absl::StrCat("certificate names [", absl::StrJoin(names, ", "), "]");
  } else if (absl::StartsWith(peer, kFdPeerPrefix)) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = socket_peers_.find(peer);
    if (it != socket_peers_.end()) names.push_back(absl::StrCat(kUidPrefix, it->second));
    who = it != socket_peers_.end() ? absl::StrCat("uid ", it->second, " on the admin socket") : "an unknown socket peer";
  } else {
    if (policy_.insecure_admin && IsLoopbackPeer(peer)) return absl::OkStatus();
    who = absl::StrCat("unauthenticated ", peer);
  }
  if (anyone) return absl::OkStatus();
  for (const std::string& n : names) {
    if (std::find(allowed.begin(), allowed.end(), n) != allowed.end()) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat("the ", RoleName(role), " role is required for ", rpc, "; ", who,
                                                  " is not in --", RoleName(role), "-identities"));
}

}  // namespace moe
