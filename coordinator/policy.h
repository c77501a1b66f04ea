// CoordinatorPolicy: the parameters of popularity tracking and placement that
// an operator may tune at run time (moectl policy set KEY=VALUE) and that
// persist in the state file as overrides of the command-line defaults. One
// table of keys serves the flags, the admin RPC and the state file.
// A plain value; not synchronised (the Coordinator guards its copy).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moe {

enum class PlacementMode {
  kPerWorker,  // each worker caches the top-C of its own traffic
  kUnion,      // spread distinct experts over the workers, replicate only the hottest
};

// "per-worker" or "union"; InvalidArgument otherwise.
absl::Status ParsePlacementMode(const std::string& text, PlacementMode* out);
const char* PlacementModeName(PlacementMode mode);

struct CoordinatorPolicy {
  // Popularity: exponentially decayed pair counts with this half-life.
  double half_life_seconds = 1.0;
  PlacementMode placement = PlacementMode::kPerWorker;
  // PCIe bandwidth one rebalance round may use per worker: the round's copy
  // budget is this times the rebalance interval. <= 0: unlimited.
  double copy_budget_gbps = 8.0;
  // A newcomer c replaces a resident v only if
  //   pop(c) - pop(v) > copy_cost_hits + hysteresis_margin * pop(v)
  // with pop() the decayed pair counts (the hits expected over the next
  // half-life or so): its extra hits must exceed the copy cost by a margin.
  double hysteresis_margin = 0.25;
  double copy_cost_hits = 1.0;
  // Union placement: experts with at least this share of a layer's pairs are
  // replicated on every worker; the rest are spread so the union covers more.
  double replicate_share = 0.1;
  // Automatic rebalance period; <= 0: rebalance only when asked (moectl).
  double rebalance_interval_seconds = 0.5;

  // InvalidArgument naming the first parameter outside its range, by its key
  // and its flag (half_life_seconds [0.01, 86400] s, hysteresis_margin
  // [0, 1e6], copy_cost_hits [0, 1e12], replicate_share (0, 1],
  // rebalance_interval_seconds <= 0 (off) or [0.01, 86400] s).
  absl::Status Check() const;
  // Sets one parameter from text; InvalidArgument naming the key on an
  // unknown key or a bad value (the policy is unchanged then).
  absl::Status Set(const std::string& key, const std::string& value);
  // Every key with its current value as text (parseable by Set).
  std::map<std::string, std::string> ToMap() const;
  static const std::vector<std::string>& Keys();
};

}  // namespace moe
