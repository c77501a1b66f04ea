// Placement: which experts each GPU worker keeps in each layer's cache, given
// what it holds now and how popular every expert is. One round of the
// coordinator's rebalance, as a pure function (the coordinator and the cache
// replay call the same code).
//
//  - Target per worker and layer: the pinned experts, then the most popular
//    ones up to C slots. per-worker mode ranks by the worker's own counts
//    (the global ones while it has none); union mode ranks by the global
//    counts, gives experts with >= replicate_share of the layer's pairs to
//    every worker and spreads the rest so that the workers together hold as
//    many distinct hot experts as possible (an expert stays with the worker
//    that holds it when that worker still has room).
//  - Hysteresis: a newcomer c takes a free slot if pop(c) > copy_cost_hits,
//    or replaces the least valuable resident v not in the target only if
//    pop(c) - pop(v) > copy_cost_hits + margin * pop(v). (Union mode: a
//    resident that another worker also holds is worth 0 here.)
//  - Copy budget: per worker, the admissible copies of all its layers are
//    taken by gain, best first, while their bytes fit the budget.
//  - Pins always win: they are placed first and are not charged to the budget.
//  - A worker in a tensor-parallel group (its `group`) holds only the experts
//    its rank owns (moe/types.h ExpertOwner): pins and targets of other
//    ranks' experts are skipped, so the ranks' caches are disjoint.
//
// Pure and deterministic (ties go to the resident, then the lower expert id).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "coordinator/policy.h"
#include "moe/types.h"

namespace moe {

struct PlacementParams {
  PlacementMode mode = PlacementMode::kPerWorker;
  double hysteresis_margin = 0.25;
  double copy_cost_hits = 1.0;
  double replicate_share = 0.1;
};

inline constexpr uint64_t kUnlimitedBudget = std::numeric_limits<uint64_t>::max();

struct WorkerPlacementState {
  std::string id;
  int slots_per_layer = 0;
  ParallelGroup group;                 // holds only its rank's experts (ExpertOwner)
  uint64_t expert_bytes = 0;
  uint64_t budget_bytes = kUnlimitedBudget;  // this round; pins are not charged
  bool frozen = false;                       // holds its set this round (e.g. copies still in flight)
  std::vector<bool> cached;                  // [layer]: the worker caches this layer
  std::vector<std::vector<int>> resident;    // [layer] experts held now
  std::vector<std::vector<int>> pinned;      // [layer] experts that must be held
  std::vector<std::vector<double>> popularity;  // [layer][expert] its decayed pair counts (may be empty)
};

struct PlacementProblem {
  int num_layers = 0;
  int num_experts = 0;
  PlacementParams params;
  std::vector<WorkerPlacementState> workers;
  std::vector<std::vector<double>> global_popularity;  // [layer][expert]
};

struct PlannedMove {
  int worker = 0;   // index into PlacementProblem::workers
  int layer = 0;
  int expert = 0;   // copied in
  int evicted = -1; // -1: a free slot
  double gain = 0;  // pop(expert) - pop(evicted)
  bool pinned = false;
};

struct PlacementPlan {
  std::vector<std::vector<std::vector<int>>> sets;  // [worker][layer], ascending
  std::vector<PlannedMove> moves;
  std::vector<uint64_t> bytes;               // [worker] copied this round
  std::vector<double> hit_rate_before;       // [worker] expected from its popularity
  std::vector<double> hit_rate_after;
  double hit_rate_before_all = 0, hit_rate_after_all = 0;  // over all workers' pairs
  double coverage_before = 0, coverage_after = 0;  // global pairs resident on some worker
};

PlacementPlan PlanPlacement(const PlacementProblem& problem);

// The counts a worker's placement ranks by in `layer`: its own in per-worker
// mode (the global ones when it has none there), the global ones in union mode.
const std::vector<double>& PlacementValues(const PlacementProblem& problem, int worker, int layer);

}  // namespace moe
