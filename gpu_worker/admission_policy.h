// AdmissionPolicy: the GPU worker's default cache policy ("predictive"), the
// across-calls half of the planner (gpu_worker/planner.h) — which experts to
// copy into the cache, when, and what to evict, decided per layer run from the
// planner's rates and an ExpertPredictor. The planner calls it after each
// layer's routing is known; cache_replay drives the same code.
//
// On each run of layer l it predicts the next served layers l+1 and l+2 (in
// run order; after the last layer the first of the next pass) and, for each,
// swaps a resident expert v for a non-resident e when what the swap gains
// beats the copy's cost. The gain counts the CPU time e saves while resident,
// not only at the target's coming run:
//   next(x)  = P(x used at the coming run) * miss_expert_s + E[pairs] * miss_pair_s
//   rate(x)  = the same per later run, from x's use and pair rates averaged
//              over the measured residency of the layer's admissions
//   gain     = next(e) - next(v) [next(e) counts only if the copy lands before
//              the run] + H * (rate(e) - rate(v)), where a negative later part
//              is bounded by what bringing v back costs (a swap for the coming
//              run only, rent or buy): a copy when the predictor foresees v's
//              next use in time, else that use misses — copy + (1 - recall) x
//              one missed expert, recall the layer's measured lag-1 recall.
// H, the later runs a swap is priced over, depends on how predictable a layer
// is beyond its next run; it is not a constant: per layer, shadow caches
// (bookkeeping only, each with its own link) make the same decisions with H
// = 0, 1, 3 and 8 over rates averaged over the horizon, and H = 8 and 24
// over rates averaged over 16 and over 64 runs (a hot set that drifts
// slowly, or is stable), and keep a decayed score of the CPU time their hits
// saved less their copies' cost; the real cache uses the best shadow's H and
// rates. A positive later part counts only beyond the noise of the two rates
// (their standard errors, from how many runs the averages hold, times
// sqrt(2 ln E): what the best of E candidates' noise alone reaches), so a
// swap is not made on estimation noise (on stationary routing every such
// swap trades a better expert for a worse one). An empty
// slot is filled whenever an uncached expert pays for its copy over the
// priced horizon, or (ski rental: how long the session runs is not known)
// once the CPU time its misses took since it was last out of the cache — the
// rent paid — reaches the copy's cost: a free slot must not stay empty
// because no horizon the policy prices covers a copy's price on evenly routed
// layers (a cold cache under transformers' backend kept 0 hits over 100
// decode steps of a Qwen3-30B-A3B geometry: the copy's cost, its link time
// until a copy is observed, exceeded 24 runs of a 1-in-16 expert's misses).
// Buying when the rent paid equals the price is within 2x of the best
// decision in hindsight, whatever the session's length. The copy's
// cost is the CPU expert kernels' time its DRAM reads take (copy_dram_s: with
// live rates, the link time times the share of their pace the CPU servers
// were measured to lose beside copies, CostModel::copy_cpu_share) times the
// measured share of time the CPU is busy with misses (a copy while the CPU
// idles costs it nothing), plus the delay a copy was observed to add to the
// calls it overlaps (copy_call_s: live rates, CostModel::overlap; until it is
// observed, the copy's own link time). The link is one FIFO of
// copy_s per expert; a copy is started only if it completes within one pass
// after the target's coming run (a copy that lands during later runs is fine;
// one the link cannot finish by then would only delay timelier ones), and
// only within the per-pass PCIe byte budget. Layer intervals are measured
// online from the calls' clock. Pinned experts (coordinator / operator) are
// never evicted and coordinator assignments (ExpertCache::Assign) stay the
// long-horizon placement the admissions start from.
//
// Planning is itself a cost: host time on the step's path when it outlasts
// the layer call it overlaps (on a 16-core Xeon beside busy expert servers,
// 200-250 us per run at 256 experts, more than a whole decode call at 95%
// hits). A run is planned only when the CPU time the runs' misses took
// since the last planning (the most any admission could have saved) covers
// what one planning costs on the path (`plan_cost_s`, measured by the
// caller); a run not planned still observes its routing (predictor, use
// rates, shadows' hits). With plan_cost_s 0 every run plans.
//
// Not thread-safe: the dispatcher thread (or the replay) owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/cost_model.h"
#include "gpu_worker/expert_cache.h"
#include "gpu_worker/expert_predictor.h"

namespace moe {

// Seconds, from the worker's measured CostModel or the replay's flags.
struct AdmissionCosts {
  double copy_s = 0;         // one expert over the host->device link
  double copy_dram_s = 0;    // CPU time one copy's DRAM reads take from the misses while both run
  double miss_expert_s = 0;  // CPU: one missed expert (its weights streamed from DRAM)
  double miss_pair_s = 0;    // CPU: one missed (token, expert) pair
  double copy_call_s = 0;    // what one copy delays the layer calls it overlaps (observed: CopyOverlap)
};

// A resident expert (or an empty slot: expert -1, key -1) a swap may evict,
// valued `key`; `id` names it to the caller (expert or slot) and breaks ties.
struct AdmissionVictim {
  double key = 0;
  int expert = -1;
  int id = -1;
};

struct AdmissionConfig {
  std::vector<int> layers;  // served MoE layers, ascending
  int num_experts = 0;
  uint64_t expert_bytes = 0;
  AdmissionCosts costs;
  // The worker's measured rates (the copy-instead decision's, online
  // corrections included): when set and measured, the costs above are
  // re-read from it at every layer run, so admissions and copy-instead price
  // with the same, current rates. Must outlive the policy.
  const CostModel* live_rates = nullptr;
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
  // started so far) are on the caller's clock, in seconds; `plan_cost_s`:
  // what one planning costs the step (see above; 0: plan every run).
  // Returns the copies to start now, in order (their slots are Loading in
  // `cache`); none when this run is not planned.
  absl::StatusOr<std::vector<SlotCopy>> OnLayer(ExpertCache& cache, int layer, int T, int k, const int32_t* ids,
                                                double now_s, double link_free_s, double plan_cost_s = 0);
  // Layer runs planned, and not planned (their misses did not yet cover a planning), since start.
  uint64_t planned_runs() const { return planned_runs_; }
  uint64_t unplanned_runs() const { return unplanned_runs_; }

  ExpertPredictor& predictor() { return *predictor_; }
  const ExpertPredictor& predictor() const { return *predictor_; }
  const AdmissionCounters& counters(int layer) const { return counters_[pos_[layer]]; }
  const AdmissionConfig& config() const { return config_; }
  // The costs it prices with now: config().costs, or the live rates.
  AdmissionCosts Costs() const;

 private:
  explicit AdmissionPolicy(const AdmissionConfig& c) : config_(c) {}
  // A bookkeeping-only copy of one layer's cache run with one pricing horizon.
  struct Shadow {
    double later_runs = 0;      // later runs a swap is priced over
    int memory = 0;             // its rates: 0 over the residency horizon, 1 over 16 runs, 2 over 64
    std::vector<double> ready;  // per expert: when its copy lands, kNever: not held
    std::vector<int> held;      // the experts it holds (ready < kNever), in no order
    double link_free_s = 0;
    double score = 0;           // decayed CPU time saved by hits less copy costs
  };
  static constexpr double kNever = 1e300;
  static constexpr int kMemories = 2;  // fixed rate memories beside the horizon (16 and 64 runs)
  static constexpr double kShadowKeep = 0.985;  // per run of the layer: a half-life of ~46 runs
  // What the policy knows of how long an admitted expert stays and how often
  // each expert of a layer is used over that time.
  struct Residency {
    std::vector<Shadow> shadows;
    double horizon = 0;            // runs of the layer an admitted expert stays (EMA over evictions)
    std::vector<double> use;       // per expert: share of runs that use it, averaged over the horizon
    std::vector<double> pairs;     // per expert: pairs per run, likewise
    std::vector<double> use_mem[kMemories], pairs_mem[kMemories];  // the same over 16 and 64 runs (half-lives)
    std::vector<int64_t> admitted; // per expert: `runs` when this policy admitted it, -1: not by it
    std::vector<double> rent;      // per expert: CPU time its misses took since it last left (or never was in) the cache
    uint64_t runs = 0;
  };
  static constexpr double kResidencySmoothing = 0.125;  // EMA weight of one eviction's residency

  void Plan(ExpertCache& cache, int target, int lag, double now_s, double start_s, double* link_free_s,
            std::vector<SlotCopy>* out);
  double PassSeconds() const;
  void Evicted(int pos, int expert);
  void FillByRent(const ExpertCache& cache, int target, double copy_cost, double link_s, double end_s,
                  std::vector<AdmissionVictim>* victims, std::vector<std::pair<int, int>>* fills);
  void ObserveUse(int pos, int T, int k, const int32_t* ids, double now_s);

  AdmissionConfig config_;
  std::unique_ptr<ExpertPredictor> predictor_;
  std::vector<int> pos_;            // model layer -> served position
  std::vector<double> interval_s_;  // [pos]: measured time from the previous layer's run to this one's
  std::vector<AdmissionCounters> counters_;
  std::vector<Residency> residency_;  // [pos]
  std::vector<int> scratch_pairs_;                 // ObserveUse: this run's pairs per expert
  std::vector<double> scratch_next_, scratch_rates_[kMemories + 1], scratch_sd_[kMemories + 1];  // Plan's values, reused
  std::vector<std::pair<double, int>> scratch_order_, scratch_second_;  // ChooseSwaps' candidates
  std::vector<std::pair<int, int>> scratch_swaps_;                  // and its swaps
  std::vector<AdmissionVictim> scratch_victims_;                    // and its victims
  std::vector<int> scratch_slots_;
  double last_now_s_ = -1;
  double last_miss_s_ = 0;    // CPU miss time of the previous layer run
  double busy_share_ = 1;     // measured share of time the CPU computes misses (starts pessimistic)
  double plan_credit_s_ = 0;  // misses' CPU time since the last planning, at most one planning's cost
  uint64_t planned_runs_ = 0, unplanned_runs_ = 0;
  int last_pos_ = -1;
  uint64_t pass_bytes_ = 0;
};

}  // namespace moe
