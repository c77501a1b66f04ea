// ExpertServiceImpl: the gRPC face of the CPU expert server (moe.v1.ExpertService).
// Decodes and validates requests (INVALID_ARGUMENT / OUT_OF_RANGE naming the
// field), runs them on the MoeExecutor and encodes the partial outputs.
// With an ExpertServerMetrics, Forward and ForwardStream record every answered
// request (transport "grpc"). gRPC calls its methods from many threads at
// once; that is safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

#include "core/model_spec.h"
#include "cpu_expert_server/expert_metrics.h"
#include "cpu_compute/moe_executor.h"
#include "moe/v1/expert.grpc.pb.h"

namespace moe {

// Computes one decoded, shape-checked batch into out ([n, H] of out_dtype).
// The expert server passes MoeExecutor::Forward; benchmarks pass an echo.
using BatchHandler =
    std::function<absl::Status(const MoeBatch& batch, DType out_dtype, void* out, ForwardStats* stats)>;

struct ServiceLimits {
  int max_tokens_per_request = 8192;
};

// The largest gRPC message a request within `limits` can take for `spec`
// (tokens, a full [n, num_experts] routing, framing), with headroom.
uint64_t MaxMessageBytes(const ModelSpec& spec, const ServiceLimits& limits);

class ExpertServiceImpl final : public moe::v1::ExpertService::Service {
 public:
  // `metrics` (may be null: none recorded) must outlive the service.
  ExpertServiceImpl(const ModelSpec& spec, BatchHandler handler, ServiceLimits limits,
                    moe::v1::ServerInfo info, ExpertServerMetrics* metrics = nullptr);

  grpc::Status Forward(grpc::ServerContext* ctx, const moe::v1::ForwardRequest* req,
                       moe::v1::ForwardResponse* resp) override;
  grpc::Status ForwardStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<moe::v1::ForwardStreamResponse, moe::v1::ForwardRequest>* stream) override;
  grpc::Status GetInfo(grpc::ServerContext* ctx, const moe::v1::GetInfoRequest* req,
                       moe::v1::ServerInfo* resp) override;

  // Starts draining: open streams finish the request they are computing and
  // then end with UNAVAILABLE ("draining"), idle ones end at once. Unary calls
  // in flight complete. Call before grpc::Server::Shutdown.
  void Drain();

  // The whole request path without gRPC: decode, validate, compute, encode.
  // Records no metrics.
  absl::Status Handle(const moe::v1::ForwardRequest& req, moe::v1::ForwardResponse* resp);

 private:
  // Handle, recorded in metrics_ (when set).
  absl::Status HandleAndRecord(const moe::v1::ForwardRequest& req, moe::v1::ForwardResponse* resp);

  const ModelSpec& spec_;
  BatchHandler handler_;
  ServiceLimits limits_;
  moe::v1::ServerInfo info_;
  ExpertServerMetrics* metrics_;
  std::mutex streams_mu_;
  bool draining_ = false;
  std::map<grpc::ServerContext*, bool> streams_;  // open streams -> idle (blocked in Read)
};

}  // namespace moe
