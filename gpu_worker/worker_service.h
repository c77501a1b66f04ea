// WorkerServiceImpl: moe.v1.WorkerService over one MoeSession — the GPU
// worker's gRPC face for engines that do not link the client library.
// Requests are validated (INVALID_ARGUMENT naming the field); calls are
// serialised on the session (one device, one dispatcher), and a request with
// two micro-batches runs them overlapped (both submitted, then both completed).
#pragma once

#include <mutex>

#include "client/moe_session.h"
#include "moe/v1/worker.grpc.pb.h"

namespace moe {

class WorkerServiceImpl final : public moe::v1::WorkerService::Service {
 public:
  // `session` must outlive the service. `mu` guards every use of the session
  // (the coordinator agent applies assignments under it, between calls).
  WorkerServiceImpl(MoeSession& session, std::mutex& mu, std::string policy,
                    std::vector<std::string> servers);

  grpc::Status ForwardLayer(grpc::ServerContext* ctx, const moe::v1::ForwardLayerRequest* req,
                            moe::v1::ForwardLayerResponse* resp) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const moe::v1::WorkerInfoRequest* req,
                             moe::v1::WorkerInfo* resp) override;
  grpc::Status ApplyAssignment(grpc::ServerContext* ctx, const moe::v1::ApplyAssignmentRequest* req,
                               moe::v1::ApplyAssignmentResponse* resp) override;

 private:
  MoeSession& session_;
  std::mutex& mu_;
  std::string policy_;
  std::vector<std::string> servers_;
};

}  // namespace moe
