// Planner: the GPU worker's one decision-maker for where each expert of a
// layer call is computed, per call and across calls:
//   - per call, the split (PlanMisses, miss_plan.h): hits (Ready in a cache
//     slot), misses to CPU expert servers, and copy-instead — missed experts
//     copied into temporary buffers and computed on the device when that
//     shortens the call (ChooseCopies, cost_model.h);
//   - across calls, the cache: which experts of the next layers to copy into
//     slots (admissions and prefetches, AdmissionPolicy, admission_policy.h),
//     priced over the time they stay resident;
//   - across one call, for prompts: which experts of the next layer to copy
//     into its prefetch buffers while this call finishes and the engine runs
//     the next layer's attention (ChoosePrefetch), within the time the link
//     would otherwise stand idle between two calls (observed online).
//   - routes and failover: each missed expert's server(s) — a replica by
//     layer, every slice's holder (RouteExpert, ReplicaStart) — and where a
//     batch goes when its server failed (ChooseFailover: another holder of
//     the same share, the device, or an error), over the servers' state as
//     the dispatcher's ServerSet reports it.
// A copy-instead decision is also checked against what it led to
// (CopyOutcomes): per call shape, calls where the model copied are timed
// against calls of that shape sent wholly to the CPU, and a shape whose
// copies came out slower stops copying (looking again now and then).
// Both price from one set of rates measured at start and corrected online
// (CostModel: copy time, device time per rows, CPU time per expert and per
// pair at that many rows) and one view of the host->device link: the time
// its queue drains (copies of earlier calls, this call's copies, admissions),
// which a call's copies queue behind and within which admissions must land.
// The split and the admission choice are plain functions of their inputs
// (routing, cache state, servers, link queue, rates), unit-tested without servers
// (miss_plan_test, cost_model_test, admission_policy_test); the Planner holds
// the state between calls (rates, link queue, the admission policy).
//
// Not thread-safe: the dispatcher thread owns it.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "gpu_worker/admission_policy.h"
#include "gpu_worker/copy_outcomes.h"
#include "gpu_worker/cost_model.h"
#include "gpu_worker/expert_cache.h"
#include "gpu_worker/miss_plan.h"

namespace moe {

// The experts of the next layer to prefetch during a call: a plain function.
// Candidates (candidate[e]: not cached, in the host copy) whose expected
// pairs in the next call — last_pairs[e] (that layer's last call) x scale
// (this call's pairs over that call's) — reach `least` (the fewest pairs of an
// expert this call moved over the link: one the planner would copy too),
// most-used first; at most `moved` (this call's copies: the next call's
// share of the link), `buffers`, and as many copies as fit the link's idle
// window (window_s / copy_s: a prefetch beyond it would delay the next call's
// own copies and its launch; copy_s 0, unmeasured rates: no such bound).
// Writes them to *out (the caller's scratch: no allocation once warm).
void ChoosePrefetch(const std::vector<int32_t>& last_pairs, const std::vector<bool>& candidate, double scale,
                    int32_t least, int moved, int buffers, double window_s, double copy_s, std::vector<int>* out);

// The admissions' planning since start: layer runs planned (and the host
// seconds they took), of them on the step's path (not overlapped by the call
// they followed), and runs not planned (AdmissionPolicy's planning cost).
struct PlanningStats {
  uint64_t planned = 0, on_path = 0, unplanned = 0;  // planned, unplanned: the policy's counts
  double seconds = 0;
  double cost_s = 0;  // what one planning costs the step's path, seconds (moving average of the planned runs)
};

class Planner {
 public:
  // The rates: set by the dispatcher's start-up probe, corrected by its observations.
  CostModel& rates() { return rates_; }
  const CostModel& rates() const { return rates_; }

  // What copy-instead decisions led to, per call shape: host-path calls
  // (PlanCall consults it) and device-planned calls (their copy table).
  CopyOutcomes& host_outcomes() { return host_outcomes_; }
  CopyOutcomes& device_outcomes() { return device_outcomes_; }
  const CopyOutcomes& host_outcomes() const { return host_outcomes_; }
  const CopyOutcomes& device_outcomes() const { return device_outcomes_; }

  // The predictive cache policy (the default): admissions priced with these
  // rates as they are corrected (or with `config.costs` when unmeasured).
  absl::Status EnableAdmissions(AdmissionConfig config);
  AdmissionPolicy* admission() { return admission_.get(); }
  const AdmissionPolicy* admission() const { return admission_.get(); }

  // The split of one call: `in` as the dispatcher fills it; the rates and the
  // link's backlog are the planner's.
  absl::Status PlanCall(MissPlanInput in, MissPlan* plan);
  // The admissions after a call of `layer` with this routing ([T,k] ids):
  // the copies to start now (their slots Loading in `cache`); the caller
  // queues them (CopiesQueued). The planning's own host time is measured
  // here: on the step's path unless `call_running` (planning during the
  // call) says the call had not ended when it finished; its moving average
  // is the cost the policy weighs a planning against (AdmissionPolicy).
  absl::StatusOr<std::vector<SlotCopy>> PlanAdmissions(
      ExpertCache& cache, int layer, int T, int k, const int32_t* ids,
      absl::FunctionRef<bool()> call_running = [] { return false; });
  PlanningStats planning() const;
  // `n` expert copies were queued on the link now (copy-instead, cache slots).
  void CopiesQueued(int n);
  // Seconds until the link's queue drains (0: idle), by the rates.
  double LinkBacklog() const;
  // The link's idle window between calls: OwnCopiesQueued marks when a
  // call's own copies (not a prefetch) will have landed; the next call's
  // CallStarted observes the time from then to now (0 when the link was still
  // busy). PrefetchWindow: their moving average, in seconds.
  void OwnCopiesQueued();
  void CallStarted();
  double PrefetchWindow() const { return window_s_; }

 private:
  double Now() const;
  CostModel rates_;
  CopyOutcomes host_outcomes_, device_outcomes_;
  std::unique_ptr<AdmissionPolicy> admission_;
  std::chrono::steady_clock::time_point epoch_ = std::chrono::steady_clock::now();
  double link_free_s_ = 0;  // when the copies queued so far should be done (from epoch_)
  double own_free_s_ = -1;  // OwnCopiesQueued's mark, -1: none
  double window_s_ = 0;
  PlanningStats planning_;  // on_path, seconds, cost_s (what the admission policy weighs a planning against)
};

}  // namespace moe
