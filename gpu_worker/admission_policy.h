// AdmissionPolicy: the GPU worker's default cache policy ("predictive") —
// which experts to copy into the cache, when, and what to evict, decided per
// layer run from the cost model and an ExpertPredictor. The dispatcher calls
// it after each layer's routing is known; cache_replay drives the same code.
//
// On each run of layer l it predicts the next served layers l+1 and l+2 (in
// run order; after the last layer the first of the next pass) and, for each,
// swaps a resident expert v for a non-resident e only when
//   value(e) - value(v) > the copy's cost,
// where value(x) = P(x used at that run) * miss_expert_s + E[pairs of x] *
// miss_pair_s is the CPU time x saves at that run when resident (later runs
// are decided again, one layer ahead, with fresher routing). The copy's cost is
// the host DRAM time its transfer takes from the CPU expert kernels
// (copy_dram_s) times the measured share of time the CPU is busy with misses
// (a copy while the CPU idles costs it nothing). A copy is started only if the link (one, FIFO, copy_s per
// expert) finishes it before the target layer is expected to run — layer
// intervals are measured online from the calls' clock — and only within the
// per-pass PCIe byte budget. Pinned experts (coordinator / operator) are
// never evicted and coordinator assignments (ExpertCache::Assign) stay the
// long-horizon placement the admissions start from.
//
// Not thread-safe: the dispatcher thread (or the replay) owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/expert_cache.h"
#include "gpu_worker/expert_predictor.h"

namespace moe {

// The step-time model of a layer run shared by cache_replay and moe-demo: the
// device part plus the CPU's misses — a missed expert streams its bytes from
// host DRAM, a missed pair costs pair_seconds — plus the host DRAM the copy
// engine takes from that CPU work while both run (the link's busy time
// overlapping it, times pcie / dram bandwidth). Defaults: the GPU host
// (shared/PERF.md: oneDNN AMX streams 94 GB/s of weights, PCIe 55 GB/s).
struct StepTimeModel {
  double expert_bytes = 0;
  double dram_bytes_per_second = 94e9;
  double pcie_bytes_per_second = 55e9;  // 0: copies instant (no contention)
  double pair_seconds = 0;
  // CPU time of these misses, without contention.
  double MissSeconds(int missed_experts, double missed_pairs) const;
  // One layer run: `device_s` plus the misses, with the link busy for
  // `link_busy_s` from the run's start.
  double LayerSeconds(double device_s, int missed_experts, double missed_pairs, double link_busy_s) const;
};

// Seconds, from the worker's measured CostModel or the replay's flags.
struct AdmissionCosts {
  double copy_s = 0;         // one expert over the host->device link
  double copy_dram_s = 0;    // host DRAM time one copy's reads take from the CPU
  double miss_expert_s = 0;  // CPU: one missed expert (its weights streamed from DRAM)
  double miss_pair_s = 0;    // CPU: one missed (token, expert) pair
};

struct AdmissionConfig {
  std::vector<int> layers;  // served MoE layers, ascending
  int num_experts = 0;
  uint64_t expert_bytes = 0;
  AdmissionCosts costs;
  // PCIe bytes the admissions may start per forward pass (all layers);
  // 0: only what the link completes in time bounds them.
  uint64_t pass_budget_bytes = 0;
};

// Per served layer, since start.
struct AdmissionCounters {
  uint64_t copies = 0;
  uint64_t bytes = 0;
};

class AdmissionPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<AdmissionPolicy>> Create(const AdmissionConfig& config);

  // Layer `layer` runs now with this routing ([T,k], -1 = unused). `now_s`
  // and `link_free_s` (when the copy engine will have finished everything
  // started so far) are on the caller's clock, in seconds. Returns the copies
  // to start now, in order (their slots are Loading in `cache`).
  absl::StatusOr<std::vector<SlotCopy>> OnLayer(ExpertCache& cache, int layer, int T, int k, const int32_t* ids,
                                                double now_s, double link_free_s);

  ExpertPredictor& predictor() { return *predictor_; }
  const ExpertPredictor& predictor() const { return *predictor_; }
  const AdmissionCounters& counters(int layer) const { return counters_[pos_[layer]]; }
  const AdmissionConfig& config() const { return config_; }

 private:
  explicit AdmissionPolicy(const AdmissionConfig& c) : config_(c) {}
  void Plan(ExpertCache& cache, int target, int lag, double now_s, double start_s, double* link_free_s,
            std::vector<SlotCopy>* out);

  AdmissionConfig config_;
  std::unique_ptr<ExpertPredictor> predictor_;
  std::vector<int> pos_;            // model layer -> served position
  std::vector<double> interval_s_;  // [pos]: measured time from the previous layer's run to this one's
  std::vector<AdmissionCounters> counters_;
  double last_now_s_ = -1;
  double last_miss_s_ = 0;    // CPU miss time of the previous layer run
  double busy_share_ = 1;     // measured share of time the CPU computes misses (starts pessimistic)
  int last_pos_ = -1;
  uint64_t pass_bytes_ = 0;
};

}  // namespace moe
