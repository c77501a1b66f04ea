#include "gpu_worker/planner.h"

#include <algorithm>

#include "core/status_macros.h"

namespace moe {
namespace {
constexpr double kPlanCostSmoothing = 0.125;  // EMA weight of one planned run's cost on the path
}  // namespace

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
  in.outcomes = &host_outcomes_;
  in.link_busy_s = LinkBacklog();
  return PlanMisses(in, plan);
}

absl::StatusOr<std::vector<SlotCopy>> Planner::PlanAdmissions(ExpertCache& cache, int layer, int T, int k,
                                                             const int32_t* ids,
                                                             absl::FunctionRef<bool()> call_running) {
  if (admission_ == nullptr) return std::vector<SlotCopy>{};
  const double now = Now();
  const uint64_t planned = admission_->planned_runs();
  absl::StatusOr<std::vector<SlotCopy>> copies =
      admission_->OnLayer(cache, layer, T, k, ids, now, std::max(now, link_free_s_), planning_.cost_s);
  if (!copies.ok()) return copies;
  if (admission_->planned_runs() > planned) {
    const double took = Now() - now;
    const bool overlapped = call_running();
    planning_.cost_s += kPlanCostSmoothing * ((overlapped ? 0.0 : took) - planning_.cost_s);
    planning_.on_path += !overlapped;
    planning_.seconds += took;
  }
  return copies;
}

PlanningStats Planner::planning() const {
  PlanningStats s = planning_;
  if (admission_ != nullptr) {
    s.planned = admission_->planned_runs();
    s.unplanned = admission_->unplanned_runs();
  }
  return s;
}

void Planner::CopiesQueued(int n) {
  if (n <= 0) return;
  const double copy_s = rates_.measured ? rates_.CopySeconds() : 0.0;
  link_free_s_ = std::max(Now(), link_free_s_) + copy_s * n;
}

double Planner::LinkBacklog() const { return std::max(0.0, link_free_s_ - Now()); }

void Planner::OwnCopiesQueued() { own_free_s_ = std::max(Now(), link_free_s_); }

void Planner::CallStarted() {
  if (own_free_s_ < 0) return;
  const double idle = std::max(0.0, Now() - own_free_s_);
  window_s_ = 0.5 * window_s_ + 0.5 * idle;
  own_free_s_ = -1;
}

void ChoosePrefetch(const std::vector<int32_t>& last_pairs, const std::vector<bool>& candidate, double scale,
                    int32_t least, int moved, int buffers, double window_s, double copy_s, std::vector<int>* out) {
  std::vector<int>& order = *out;
  order.clear();
  for (size_t e = 0; e < last_pairs.size(); ++e)
    if (candidate[e] && last_pairs[e] > 0 && last_pairs[e] * scale >= least) order.push_back(static_cast<int>(e));
  const double fit = copy_s > 0 ? std::floor(window_s / copy_s) : static_cast<double>(buffers);
  const int n = static_cast<int>(std::min<double>({static_cast<double>(moved), static_cast<double>(buffers),
                                                   static_cast<double>(order.size()), fit}));
  if (n <= 0) {
    order.clear();
    return;
  }
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](int a, int b) { return last_pairs[a] != last_pairs[b] ? last_pairs[a] > last_pairs[b] : a < b; });
  order.resize(n);
}

}  // namespace moe
