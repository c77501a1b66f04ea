// RoutingCapacity: what one GPU worker can route (declared at registration,
// capped by the coordinator), and what a report of access counts (a
// heartbeat's or ReportStats' `counts`) demands of it, in seconds of routing.
//
// The coordinator keeps, per worker, a credit of routing seconds that grows
// with wall time up to kCountBurstSeconds; a report is accepted only when its
// demand fits the credit (which it then spends), so over any stretch of time a
// worker's counts add up to at most what it could have routed in that time
// plus one burst, whatever it claims (issue 47, defect 3). Every amount is
// handled as a double: 2^64-1 is a large number, never an overflow.
//
// Pure functions; thread-compatible.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

// The routing seconds a worker may bank: a report may carry this much of
// its capacity beyond the time since its last accepted one (a coordinator
// restart's backlog, a late heartbeat).
inline constexpr double kCountBurstSeconds = 30.0;
// Physical ceilings per worker, whatever it declares: host->GPU bytes a
// second over all its links, and link seconds a second (GPUs it may have).
inline constexpr double kMaxCopyBytesPerSecond = 1e12;
inline constexpr double kMaxLinksPerWorker = 16.0;

struct RoutingCapacity {
  double tokens_per_second = 0;  // through any one layer, all its engines together
  int top_k = 0;                 // distinct experts per token
  int num_experts = 0;
};

// What a report demands: the most routing seconds any of its fields needs,
// and which field that is (for the refusal).
struct RoutingDemand {
  double seconds = 0;
  std::string field;        // e.g. "counts[2].pairs[0]"
  double amount = 0;        // what the field claims
  double per_second = 0;    // what the capacity allows of it per second
  std::string what;         // e.g. "pairs of one expert"
};

// Checks `counts` against the model geometry and the worker's MoE layers
// (`cached`, [layer]): each layer at most once and one the worker caches,
// each expert in range and at most once per layer, equal lengths, hits <=
// pairs, predicted_used <= predicted — InvalidArgument naming the field
// otherwise — and returns the routing seconds the report demands of
// `capacity`.
absl::StatusOr<RoutingDemand> CheckCounts(const google::protobuf::RepeatedPtrField<moe::v1::LayerCounts>& counts,
                                          int num_layers, const std::vector<bool>& cached,
                                          const RoutingCapacity& capacity);

}  // namespace moe
