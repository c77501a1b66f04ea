// WorkerServiceImpl: moe.v1.WorkerService over the worker's sessions (one, or
// one per GPU of a multi-GPU worker: gpu_worker/worker_sessions.h) — the GPU
// worker's gRPC face for engines that do not link the client library.
// Requests are validated as the expert server validates its own, with the
// same codes (INVALID_ARGUMENT naming the field, OUT_OF_RANGE over
// max_tokens) and this proto's field names (batches[i].topk_ids[t,j]); calls are
// serialised on the session (one device, one dispatcher), and a request with
// two micro-batches runs them overlapped (both submitted, then both completed)
// on one session, one after the other over a multi-GPU worker's group.
//
// With a coordinator: the agent's assignment updates are queued
// (OnAssignment, agent thread) and applied between forward passes — before the
// next call, or by Tick() when idle — as ApplyAssignment (copies, then each
// slot serves once its copy completed); the version is acknowledged
// (MarkApplied) once no copy is in flight. Route updates enable or disable
// the configured servers the coordinator knows (drained or down ones get no
// misses); addresses it never routed are left alone.
#pragma once

#include <cstdint>
#include <chrono>
#include <deque>
#include <mutex>
#include <set>
#include <string>

#include "moe/engine.h"
#include "coordinator/agent/coordinator_agent.h"
#include "gpu_worker/worker_metrics.h"
#include "gpu_worker/worker_sessions.h"
#include "moe/v1/worker.grpc.pb.h"

namespace moe {

// The session's per-call limits (SessionOptions::max_tokens / max_top_k).
struct WorkerLimits {
  int max_tokens = 1024;
  int max_top_k = 8;
};

class WorkerServiceImpl final : public moe::v1::WorkerService::Service {
 public:
  // `sessions` must outlive the service. `mu` guards every use of them (the
  // coordinator agent applies assignments under it, between calls).
  WorkerServiceImpl(WorkerSessions& sessions, std::mutex& mu, std::string policy,
                    std::vector<std::string> servers, WorkerLimits limits, WorkerMetrics* metrics = nullptr);

  // Coordinator hook-up (optional): the agent to acknowledge versions to.
  void SetAgent(CoordinatorAgent* agent) { agent_ = agent; }
  void OnAssignment(const AssignmentUpdate& update);
  // Applies queued updates when no call is running; call periodically.
  void Tick();

  grpc::Status ForwardLayer(grpc::ServerContext* ctx, const moe::v1::ForwardLayerRequest* req,
                            moe::v1::ForwardLayerResponse* resp) override;
  grpc::Status GetWorkerInfo(grpc::ServerContext* ctx, const moe::v1::WorkerInfoRequest* req,
                             moe::v1::WorkerInfo* resp) override;
  grpc::Status ApplyAssignment(grpc::ServerContext* ctx, const moe::v1::ApplyAssignmentRequest* req,
                               moe::v1::ApplyAssignmentResponse* resp) override;

 private:
  void ApplyPendingLocked();  // with mu_ held

  WorkerSessions& sessions_;
  std::mutex& mu_;
  std::string policy_;
  std::vector<std::string> servers_;
  WorkerLimits limits_;
  WorkerMetrics* metrics_;
  CoordinatorAgent* agent_ = nullptr;
  std::chrono::steady_clock::time_point rates_sent_{};  // planner rates last handed to agent_ (mu_)
  std::mutex queue_mu_;
  std::deque<AssignmentUpdate> queue_;
  uint64_t applied_version_ = 0, acked_version_ = 0;
  std::set<std::string> known_;  // configured servers the coordinator has routed at least once
};

}  // namespace moe
