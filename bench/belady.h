// Belady's optimum for one layer's expert cache, offline: the most (token,
// expert) pairs a cache of C slots can serve when it knows the whole future
// — the ceiling the replay compares real policies against.
//
// Model (the worker's): the cache is fixed during a step; after the step,
// any expert the step routed to may be admitted (its weights just went to the
// CPU anyway: demand admission, like Belady's MIN) and any resident evicted;
// a miss need not be admitted (bypass). With one pair per access this is
// exactly MIN with bypass (evict the expert needed furthest in the future);
// with several pairs per access (batches) MIN's rule is no longer optimal,
// so the optimum is computed exactly as a min-cost flow: keeping an expert
// from one of its steps to its next earns that next step's pairs and holds a
// slot in between; C units of flow (the slots) choose the most valuable
// non-overlapping holds (k-colourable interval selection).
#pragma once

#include <cstdint>
#include <vector>

#include "testing/routing_trace.h"

namespace moe {

struct OfflineResult {
  uint64_t hits = 0;    // pairs served from the cache
  uint64_t pairs = 0;   // all pairs
  uint64_t copies = 0;  // admissions (each one copy of an expert)
};

// steps[s]: the layer's accesses at step s (distinct experts).
OfflineResult BeladyOptimum(const std::vector<std::vector<ExpertAccess>>& steps, int num_experts, int slots);

}  // namespace moe
