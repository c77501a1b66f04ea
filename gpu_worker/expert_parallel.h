// ExpertParallel: the token exchange of an expert-parallel group
// (moe/types.h ParallelGroup, mode kExpert) over NCCL, around this rank's
// LayerDispatcher, which computes only the experts this rank owns
// (ExpertOwner; DispatcherConfig::group).
//
// One layer call of a rank with T tokens, on the engine's stream:
//   1. the routing comes to the host (T x k ids and weights, validated);
//      each token goes to every peer that owns one of its experts, once
//      (not once per pair);
//   2. ncclAllGather of the per-peer token counts (the receive sizes);
//   3. grouped ncclSend/ncclRecv of the tokens' rows, ids and weights; the
//      rank's own tokens and the received ones form one batch;
//   4. the dispatcher computes that batch (its cache's hits, the CPU
//      servers' misses) — this rank's share of every token in it;
//   5. grouped ncclSend/ncclRecv returns the peers' partial sums, with a
//      status word per message (a peer whose call failed makes the tokens it
//      got fail, never adds a wrong share);
//   6. one kernel adds each token's own share and its peers' (f32, one
//      rounding to bf16) into `out`.
// Every rank calls every layer in the same order (T = 0 included). A call
// with bad input still takes part with no tokens (its peers go on) and
// returns the error.
//
// Peer failure: the communicator is non-blocking, and every wait is bounded
// by the session's deadline. A peer that does not answer by then (its GPU or
// process gone, or hung) makes this rank abort the communicator and leave
// the group: its dispatcher owns every expert again (LeaveGroup) and the call
// is recomputed from its inputs alone — the peers' experts become misses on
// the CPU servers. Later calls run alone too. No wrong output, no wait past
// the deadline.
//
// Thread-safety: driven by the session's one thread (like the dispatcher).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/layer_dispatcher.h"
#include "moe/types.h"

namespace moe {

// A new communicator id (hex, 256 characters) for ParallelGroup::id; made on
// one rank and handed to the others by the engine.
absl::StatusOr<std::string> NewGroupId();

class ExpertParallel {
 public:
  // Collective: every rank of `group` calls it at about the same time
  // (ncclCommInitRank; bounded by `deadline`). `local` is this rank's
  // dispatcher, opened with DispatcherConfig::group = `group` and max_tokens
  // of at least size x `max_tokens`; it must outlive this object. The ranks'
  // max_tokens, max_top_k and model geometry must agree (checked here).
  static absl::StatusOr<std::unique_ptr<ExpertParallel>> Create(const ParallelGroup& group, LayerDispatcher& local,
                                                                int num_experts, int hidden, int max_tokens,
                                                                int max_top_k, std::chrono::milliseconds deadline);
  ~ExpertParallel();
  ExpertParallel(const ExpertParallel&) = delete;
  ExpertParallel& operator=(const ExpertParallel&) = delete;

  // One layer call of this rank's tokens (device memory, call.stream the
  // engine's stream or null): done when it returns, `out` the whole MoE
  // output of these tokens. Stats are the dispatcher's, for the batch it
  // computed (this rank's tokens and its peers').
  absl::Status Forward(const LayerCall& call, CallStats* stats = nullptr);

  // Host time of the exchange's steps summed over the calls (seconds): the
  // routing to the host, the counts' all-gather, enqueueing the tokens, the
  // dispatcher's call (waiting for the peers' tokens included), the partial
  // sums back and the sum.
  struct StepTimes {
    double routing = 0, counts = 0, send = 0, compute = 0, back = 0;
    int calls = 0;
  };
  const StepTimes& step_times() const;

 private:
  struct Impl;
  explicit ExpertParallel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
