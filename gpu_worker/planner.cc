#include "gpu_worker/planner.h"

#include <algorithm>

#include "core/status_macros.h"

namespace moe {

double Planner::Now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
}

absl::Status Planner::EnableAdmissions(AdmissionConfig config) {
  if (rates_.measured) config.live_rates = &rates_;  // the copy-instead decision's rates, as they are corrected online
  MOE_ASSIGN_OR_RETURN(admission_, AdmissionPolicy::Create(config));
  return absl::OkStatus();
}

absl::Status Planner::PlanCall(MissPlanInput in, MissPlan* plan) {
  in.cost = &rates_;
  in.link_busy_s = LinkBacklog();
  return PlanMisses(in, plan);
}

absl::StatusOr<std::vector<SlotCopy>> Planner::PlanAdmissions(ExpertCache& cache, int layer, int T, int k,
                                                             const int32_t* ids) {
  if (admission_ == nullptr) return std::vector<SlotCopy>{};
  const double now = Now();
  return admission_->OnLayer(cache, layer, T, k, ids, now, std::max(now, link_free_s_));
}

void Planner::CopiesQueued(int n) {
  if (n <= 0) return;
  const double copy_s = rates_.measured ? rates_.CopySeconds() : 0.0;
  link_free_s_ = std::max(Now(), link_free_s_) + copy_s * n;
}

double Planner::LinkBacklog() const { return std::max(0.0, link_free_s_ - Now()); }

}  // namespace moe
