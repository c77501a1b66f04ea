// WorkerClient: a blocking client of a moe-gpu-worker process
// (moe.v1.WorkerService) for engines that do not link CUDA or the worker
// library: one MoE layer per call, host buffers, one or two micro-batches.
// Thread-safe (gRPC stubs are).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "transport/transport.h"
#include "moe/v1/worker.grpc.pb.h"

namespace moe {

// One micro-batch: hidden [T,H] bf16, topk_ids/topk_weights [T,k], out [T,H].
struct WorkerBatch {
  int T = 0, k = 0;
  const bf16_t* hidden = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  bf16_t* out = nullptr;
  moe::v1::LayerCallStats stats;  // filled by ForwardLayer
};

class WorkerClient {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Connect(const std::string& address, const TlsOptions& tls);
  // Reads the model's hidden size from the worker (GetWorkerInfo) on first use.
  absl::StatusOr<moe::v1::WorkerInfo> GetInfo(int timeout_ms = 10000);
  // One layer for 1 or 2 micro-batches (the worker overlaps them).
  absl::Status ForwardLayer(int layer, std::vector<WorkerBatch*> batches, int timeout_ms = 60000);
  absl::Status ApplyAssignment(int layer, const std::vector<int>& experts, int timeout_ms = 10000);

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::WorkerService::Stub> stub_;
  int hidden_ = 0;
};

}  // namespace moe
