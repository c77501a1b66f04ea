// MoeBatch: n tokens [n, H] bf16 and their [n, k] routing for one MoE
// layer, as a view (it owns nothing, the caller keeps the arrays alive). A
// GPU worker's layer call carries one (LayerCall), a server computes one
// (MoeExecutor::Forward) and ExpertTransport::Submit ships one; the main
// worker path fills a transport's StagingArea in place instead (no copy) and
// the server reads it back as a ValidatedRequest.
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "model/routing.h"

namespace moe {

// One of `count` parts of one batch of a client, sent as separate requests
// (over several connections at once: GrpcTransport's stripes) and computed
// together by the server (MoeExecutor). group 0: a whole batch.
struct StripeOf {
  uint64_t group = 0;
  int count = 0;
  static constexpr int kMaxCount = 64;
  bool striped() const { return group != 0 && count > 1; }
};

struct MoeBatch {
  int layer = 0;
  int n = 0;                       // tokens; routing.n must equal it (MoeExecutor::Validate checks)
  const bf16_t* tokens = nullptr;  // [n, H]
  RoutingView routing;             // [n, k] ids (-1 = unused slot) and weights
  StripeOf stripe = {};            // a stripe of a larger batch (the gRPC data path), or none
};

}  // namespace moe
