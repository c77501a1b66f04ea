// MoeBatch: one batch on its way through the system — n tokens [n, H] bf16
// and their [n, k] routing for one MoE layer. The one name for it everywhere:
// a transport ships it (ExpertTransport::Submit), a server computes it
// (MoeExecutor::Forward), a GPU worker's layer call carries it (LayerCall).
// A view: it owns nothing, the caller keeps the arrays alive.
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "core/routing.h"

namespace moe {

struct MoeBatch {
  int layer = 0;
  int n = 0;                       // tokens; routing.n must equal it (MoeExecutor::Validate checks)
  const bf16_t* tokens = nullptr;  // [n, H]
  RoutingView routing;             // [n, k] ids (-1 = unused slot) and weights
};

}  // namespace moe
