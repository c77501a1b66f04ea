// ExpertParallel: the token exchange of an expert-parallel group
// (moe/types.h ParallelGroup, mode kExpert) over NCCL, around this rank's
// LayerDispatcher, which computes only the experts this rank owns
// (ExpertOwner; DispatcherConfig::group).
//
// One layer call of a rank with T tokens, on the engine's stream:
//   1. the call is checked (bad input takes part with no tokens);
//   2. the head: every rank sends every peer its token count and its first
//      kInlineTokens (8) tokens' rows, ids and weights (fixed sizes), and
//      brings its own routing and the peers' heads to the host — one wait;
//      every rank then sees every rank's count, and all take the same way:
//   3a. decode-sized (no rank has more than 8 tokens): the heads carried
//      every token. Each peer's block is checked as its rank checked it (a
//      bad one is not computed); the dispatcher computes this rank's share
//      of every block (its cache's hits, the CPU servers' misses); each
//      block's partial sums go back to its rank with a status word; one wait;
//   3b. larger: the routing goes to the peers that own one of a token's
//      experts, once per token (not once per pair): ncclAllGather of the
//      per-peer counts, grouped ncclSend/ncclRecv of those tokens' rows, ids
//      and weights, the rank's own tokens and the received ones computed as
//      one batch, the partial sums back with a status word per message;
//   4. one kernel adds each token's own share and its peers' (f32, one
//      rounding to bf16) into `out`. A peer whose call failed makes the
//      tokens it got fail, never adds a wrong share.
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

  // Host time of the exchange's steps summed over the calls (seconds):
  // routing (a larger call's split of its tokens by peer), counts (the
  // heads, and a larger call's counts), send (checking the heads' blocks, or
  // enqueueing a larger call's tokens), compute (the dispatcher's call),
  // back (the partial sums back and the sum).
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
