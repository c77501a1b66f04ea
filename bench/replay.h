// Replay of a routing trace through the expert-cache policies, with a
// modelled step time: the engine of bench/cache_replay (and its tests).
//
// Policies: lru, lfu, lfru (the worker's ExpertCache), coordinator (the
// coordinator's Popularity + PlanPlacement applied through ExpertCache::Assign),
// default (what the worker does by default: ExpertCache in `predictive` mode
// driven by gpu_worker's AdmissionPolicy + ExpertPredictor, the same code the
// dispatcher runs), belady (demand-admission optimum, bench/belady.h),
// best-static (the best fixed set per layer in hindsight), best-static-cold
// (that set, each member resident only after its first use), best-so-far (at
// each run the most used experts of the runs before, copies free),
// belady-prefetch (the future known, Belady's set for each layer's next run
// prefetched over the link: a strong heuristic, not a bound) and oracle.
//
// Time model (per step, layers in order): layer l lasts step_seconds/L (the
// device's part: attention, hit experts) plus the CPU's misses, priced as
// missed experts * expert_bytes / dram_bandwidth + missed pairs * pair_seconds,
// plus the CPU work the copy engine's DRAM reads slow while both run (the
// link's busy time overlapping the CPU work, times StepTimeModel::CopyCpuShare:
// the CPU and the copy engine share shared_bytes_per_second). Copies go
// over one link, FIFO, expert_bytes / pcie_bandwidth each, overlapped with
// compute; an expert serves hits only once its copy completed.
//
// oracle: a bound on every policy. Per step and layer any C experts are
// resident (copies free and instant): its hits are the run's C largest pair
// counts, its time the device part plus the CPU time of every missed expert
// but the C costliest. No C-slot cache can hit more pairs in any step, nor
// (copies only add time) model a shorter one; cache_replay fails, naming the
// policy, when one does.
//
// Not thread-safe; a replay is a pure function of its inputs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/model/step_time_model.h"
#include "coordinator/policy.h"
#include "testing/routing_trace.h"

namespace moe {

struct ReplayConfig {
  int slots = 0;
  double step_seconds = 0.1;          // device part of one step (all layers)
  uint64_t expert_bytes = 0;
  double pcie_bytes_per_second = 55e9;  // 0: copies are instant
  double dram_bytes_per_second = 94e9;  // CPU expert weight streaming rate
  // DRAM read by the CPU and the copy engine at once (StepTimeModel's).
  double shared_bytes_per_second = 130e9;
  double pair_seconds = 0;            // CPU cost of one (token, expert) pair
  // Measured CPU seconds of one expert at {pairs, seconds} (LoadRates): when
  // set, a missed expert with m pairs costs max(bytes / dram, the curve at m).
  std::vector<std::pair<int, double>> cpu_expert_curve;
  double lfru_half_life = 64;
  // The policies that run a cache (default, lru, lfu, lfru, coordinator and
  // belady-prefetch) start from each layer's best fixed set Ready, as
  // bench/moe_layer's warm placement does, instead of an empty cache.
  bool warm = false;
  double heartbeat_seconds = 0.2;
  CoordinatorPolicy policy;
};

struct PolicyResult {
  std::string name;
  std::vector<uint64_t> hits, pairs;  // [layer]
  uint64_t copies = 0;
  double model_seconds = 0;  // modelled time of all steps; < 0: not modelled
  double precision = -1, recall = -1;  // default: lag-1 prediction quality
  double seconds = 0;        // replay wall time
  // default: host time in AdmissionPolicy::OnLayer per layer run (the
  // worker's planning between a decode call and the next layer); < 0: none
  double plan_us_per_run = -1;
  uint64_t TotalHits() const;
  uint64_t TotalPairs() const;
  double Rate() const;
  double LayerRate(int l) const;
};

// The policy names Replay accepts.
const std::vector<std::string>& ReplayPolicies();
// Rates measured on a machine (bench/moe_layer --rates-out FILE, JSON:
// dram_gbps, pcie_gbps, expert_bytes, cpu_expert_seconds [[m, s], ...] and,
// optional, shared_gbps): sets c's DRAM, link and shared DRAM rates and its
// CPU curve, scaled from the measured expert's bytes to `expert_bytes` (a CPU
// expert's time grows with its size). A file without shared_gbps (written
// before it existed) leaves c's shared rate as it was.
// InvalidArgument naming the file and field on a bad file.
absl::Status LoadRates(const std::string& path, uint64_t expert_bytes, ReplayConfig* c);

// The step-time model a replay prices with: c's rates and expert bytes.
StepTimeModel ReplayTimeModel(const ReplayConfig& c);

// Replays `name` over `t`; InvalidArgument for an unknown name or bad config.
absl::StatusOr<PolicyResult> Replay(const RoutingTrace& t, const ReplayConfig& c, const std::string& name);

}  // namespace moe
