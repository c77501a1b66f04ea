// The gRPC faces of the Coordinator: moe.v1.CoordinatorService (workers and
// expert servers) and moe.v1.AdminService (moectl). Thin: check the caller's
// role (RoleAuthorizer: worker for worker calls, server for server calls,
// admin for every AdminService mutation; status, popularity and policy reads
// are open to any caller that reaches the listener), decode, call the
// Coordinator, map absl::Status 1:1 to grpc::Status. gRPC calls them from many
// threads at once; that is safe (the Coordinator is thread-safe).
#pragma once

#include "coordinator/coordinator.h"
#include "coordinator/role_authorizer.h"
#include "moe/v1/coordinator.grpc.pb.h"

namespace moe {

class CoordinatorServiceImpl final : public moe::v1::CoordinatorService::Service {
 public:
  CoordinatorServiceImpl(Coordinator& coordinator, const RoleAuthorizer& auth) : c_(coordinator), auth_(auth) {}

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const moe::v1::RegisterWorkerRequest* req,
                              moe::v1::RegisterWorkerResponse* resp) override;
  grpc::Status RegisterExpertServer(grpc::ServerContext* ctx, const moe::v1::RegisterExpertServerRequest* req,
                                    moe::v1::RegisterExpertServerResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const moe::v1::HeartbeatRequest* req,
                         moe::v1::HeartbeatResponse* resp) override;
  grpc::Status ReportStats(grpc::ServerContext* ctx, const moe::v1::ReportStatsRequest* req,
                           moe::v1::ReportStatsResponse* resp) override;
  // A full snapshot, then a delta whenever the worker's version moves; ends
  // when the client goes away, the session is superseded (FAILED_PRECONDITION)
  // or the coordinator stops (UNAVAILABLE).
  grpc::Status WatchAssignments(grpc::ServerContext* ctx, const moe::v1::WatchAssignmentsRequest* req,
                                grpc::ServerWriter<moe::v1::CacheAssignment>* writer) override;

 private:
  Coordinator& c_;
  const RoleAuthorizer& auth_;
};

class AdminServiceImpl final : public moe::v1::AdminService::Service {
 public:
  AdminServiceImpl(Coordinator& coordinator, const RoleAuthorizer& auth) : c_(coordinator), auth_(auth) {}

  grpc::Status GetStatus(grpc::ServerContext*, const moe::v1::StatusRequest*, moe::v1::StatusResponse* resp) override;
  grpc::Status GetPopularity(grpc::ServerContext*, const moe::v1::PopularityRequest* req,
                             moe::v1::PopularityResponse* resp) override;
  grpc::Status Rebalance(grpc::ServerContext* ctx, const moe::v1::RebalanceRequest* req,
                         moe::v1::RebalanceResponse* resp) override;
  grpc::Status PinExperts(grpc::ServerContext* ctx, const moe::v1::PinRequest* req, moe::v1::PinResponse* resp) override;
  grpc::Status UnpinExperts(grpc::ServerContext* ctx, const moe::v1::PinRequest* req, moe::v1::PinResponse* resp) override;
  grpc::Status GetPolicy(grpc::ServerContext*, const moe::v1::GetPolicyRequest*,
                         moe::v1::PolicyParameters* resp) override;
  grpc::Status SetPolicy(grpc::ServerContext* ctx, const moe::v1::SetPolicyRequest* req,
                         moe::v1::PolicyParameters* resp) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const moe::v1::DrainRequest* req, moe::v1::DrainResponse* resp) override;

 private:
  Coordinator& c_;
  const RoleAuthorizer& auth_;
};

}  // namespace moe
