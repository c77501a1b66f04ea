// WorkerSessions: the sessions one moe-gpu-worker drives — one (its GPU, or
// the cpu backend), or one per GPU of this machine as an expert-parallel
// group (moe-gpu-worker --gpus N): the GPUs' caches hold disjoint experts (one
// cache of their summed memory), each request's tokens are split across the
// GPUs, and the sessions exchange the tokens whose experts sit on a peer GPU
// over NCCL within the layer call (gpu_worker/expert_parallel.h). A GPU that
// stops answering is left at the deadline: its experts become misses on the
// CPU servers.
//
// Thread-safety: one caller at a time (the worker service holds its lock);
// a group's Forward runs the GPUs' calls on threads of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/engine.h"

namespace moe {

class WorkerSessions {
 public:
  // gpus <= 1: one session of `o`. gpus = N > 1: GPUs 0..N-1 (cuda backend),
  // one session each with o's cache size per GPU, opened together as one
  // expert-parallel group (an id made here); a micro-batch of up to
  // o.max_tokens tokens gives each GPU at most ceil(o.max_tokens / N).
  static absl::StatusOr<std::unique_ptr<WorkerSessions>> Open(const SessionOptions& o, int gpus);
  ~WorkerSessions();
  WorkerSessions(const WorkerSessions&) = delete;
  WorkerSessions& operator=(const WorkerSessions&) = delete;

  int size() const { return static_cast<int>(sessions_.size()); }
  // Rank 0's session (the only one outside a group): the model, the device,
  // the copy model; the async micro-batch calls of a single session.
  MoeSession& primary() const { return *sessions_[0]; }

  // One micro-batch in host memory, done when this returns: a group splits
  // the tokens into contiguous ranges, one per GPU; stats are summed.
  absl::Status Forward(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                       const float* topk_weights, bf16_t* out, CallStats* stats);

  // A placement for the whole worker: each GPU takes the experts of the list
  // it owns (in the list's order, up to its slots); pins likewise.
  absl::Status ApplyAssignment(int layer, const std::vector<int>& experts, const std::vector<int>& pinned = {});
  absl::Status SetServerEnabled(const std::string& address, bool enabled);
  int PendingCopies();
  uint64_t copies_started() const;
  int slots_per_layer() const;                // summed over the GPUs
  std::vector<int> CachedExperts(int layer) const;  // the union
  double HitRate(int layer) const;            // the GPUs' mean

 private:
  struct Rank;
  WorkerSessions() = default;
  std::vector<std::unique_ptr<MoeSession>> sessions_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // a group's per-GPU staging (empty outside one)
};

}  // namespace moe
