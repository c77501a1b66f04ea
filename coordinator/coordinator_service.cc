#include "coordinator/coordinator_service.h"

#include "transport/wire.h"

namespace moe {

namespace {

// Copies an OK result into the response; maps the status either way.
template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* resp) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *resp = *std::move(result);
  return grpc::Status::OK;
}

// OK, or PERMISSION_DENIED naming the role `rpc` needs and the caller.
grpc::Status Authorize(const RoleAuthorizer& auth, const grpc::ServerContext* ctx, Role role, const char* rpc) {
  return ToGrpcStatus(auth.Check(*ctx, role, rpc));
}

// How often a waiting stream looks at its context (client gone, deadline).
constexpr auto kWatchPoll = std::chrono::milliseconds(200);

}  // namespace

grpc::Status CoordinatorServiceImpl::RegisterWorker(grpc::ServerContext* ctx, const moe::v1::RegisterWorkerRequest* req,
                                                    moe::v1::RegisterWorkerResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kWorker, "RegisterWorker"); !d.ok()) return d;
  return Reply(c_.RegisterWorker(*req, RoleAuthorizer::CertificateIdentity(*ctx), auth_.PeerIdentity(*ctx)), resp);
}

grpc::Status CoordinatorServiceImpl::RegisterExpertServer(grpc::ServerContext* ctx,
                                                          const moe::v1::RegisterExpertServerRequest* req,
                                                          moe::v1::RegisterExpertServerResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kServer, "RegisterExpertServer"); !d.ok()) return d;
  return Reply(c_.RegisterExpertServer(*req, auth_.PeerIdentity(*ctx)), resp);
}

grpc::Status CoordinatorServiceImpl::Heartbeat(grpc::ServerContext* ctx, const moe::v1::HeartbeatRequest* req,
                                               moe::v1::HeartbeatResponse* resp) {
  if (!req->worker_id().empty()) {
    if (grpc::Status d = Authorize(auth_, ctx, Role::kWorker, "Heartbeat"); !d.ok()) return d;
  }
  if (!req->server_id().empty()) {
    if (grpc::Status d = Authorize(auth_, ctx, Role::kServer, "Heartbeat"); !d.ok()) return d;
  }
  return Reply(c_.Heartbeat(*req), resp);
}

grpc::Status CoordinatorServiceImpl::ReportStats(grpc::ServerContext* ctx, const moe::v1::ReportStatsRequest* req,
                                                 moe::v1::ReportStatsResponse*) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kWorker, "ReportStats"); !d.ok()) return d;
  return ToGrpcStatus(c_.ReportStats(*req));
}

grpc::Status CoordinatorServiceImpl::WatchAssignments(grpc::ServerContext* ctx,
                                                      const moe::v1::WatchAssignmentsRequest* req,
                                                      grpc::ServerWriter<moe::v1::CacheAssignment>* writer) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kWorker, "WatchAssignments"); !d.ok()) return d;
  absl::StatusOr<moe::v1::CacheAssignment> snapshot = c_.Snapshot(req->worker_id(), req->session());
  if (!snapshot.ok()) return ToGrpcStatus(snapshot.status());
  uint64_t sent = snapshot->version();
  if (!writer->Write(*snapshot)) return grpc::Status::OK;
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::optional<moe::v1::CacheAssignment>> next =
        c_.WaitForAssignment(req->worker_id(), req->session(), sent, std::chrono::steady_clock::now() + kWatchPoll);
    if (!next.ok()) return ToGrpcStatus(next.status());
    if (!next->has_value()) continue;
    sent = (*next)->version();
    if (!writer->Write(**next)) break;
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetStatus(grpc::ServerContext*, const moe::v1::StatusRequest*,
                                         moe::v1::StatusResponse* resp) {
  *resp = c_.Status();
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetPopularity(grpc::ServerContext*, const moe::v1::PopularityRequest* req,
                                             moe::v1::PopularityResponse* resp) {
  return Reply(c_.GetPopularity(*req), resp);
}

grpc::Status AdminServiceImpl::Rebalance(grpc::ServerContext* ctx, const moe::v1::RebalanceRequest* req,
                                         moe::v1::RebalanceResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kAdmin, "Rebalance"); !d.ok()) return d;
  return Reply(c_.Rebalance(req->dry_run()), resp);
}

grpc::Status AdminServiceImpl::PinExperts(grpc::ServerContext* ctx, const moe::v1::PinRequest* req,
                                          moe::v1::PinResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kAdmin, "PinExperts"); !d.ok()) return d;
  return Reply(c_.Pin(*req, /*pin=*/true), resp);
}

grpc::Status AdminServiceImpl::UnpinExperts(grpc::ServerContext* ctx, const moe::v1::PinRequest* req,
                                            moe::v1::PinResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kAdmin, "UnpinExperts"); !d.ok()) return d;
  return Reply(c_.Pin(*req, /*pin=*/false), resp);
}

grpc::Status AdminServiceImpl::GetPolicy(grpc::ServerContext*, const moe::v1::GetPolicyRequest*,
                                         moe::v1::PolicyParameters* resp) {
  *resp = c_.GetPolicy();
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetPolicy(grpc::ServerContext* ctx, const moe::v1::SetPolicyRequest* req,
                                         moe::v1::PolicyParameters* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kAdmin, "SetPolicy"); !d.ok()) return d;
  return Reply(c_.SetPolicy(*req), resp);
}

grpc::Status AdminServiceImpl::Drain(grpc::ServerContext* ctx, const moe::v1::DrainRequest* req,
                                     moe::v1::DrainResponse* resp) {
  if (grpc::Status d = Authorize(auth_, ctx, Role::kAdmin, "Drain"); !d.ok()) return d;
  return Reply(c_.Drain(*req), resp);
}

}  // namespace moe
