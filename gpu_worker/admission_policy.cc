#include "gpu_worker/admission_policy.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe {
namespace {
constexpr double kIntervalSmoothing = 0.25;  // EMA weight of a new layer-interval sample
}  // namespace

double StepTimeModel::MissSeconds(int missed_experts, double missed_pairs) const {
  const double expert_s = dram_bytes_per_second > 0 ? expert_bytes / dram_bytes_per_second : 0.0;
  return missed_experts * expert_s + missed_pairs * pair_seconds;
}

double StepTimeModel::LayerSeconds(double device_s, int missed_experts, double missed_pairs,
                                   double link_busy_s) const {
  double cpu = MissSeconds(missed_experts, missed_pairs);
  if (cpu > 0 && pcie_bytes_per_second > 0 && dram_bytes_per_second > 0)
    cpu += std::clamp(link_busy_s, 0.0, cpu) * pcie_bytes_per_second / dram_bytes_per_second;
  return device_s + cpu;
}

absl::StatusOr<std::unique_ptr<AdmissionPolicy>> AdmissionPolicy::Create(const AdmissionConfig& c) {
  if (c.expert_bytes == 0) return absl::InvalidArgumentError("admission policy: expert_bytes must be > 0");
  const AdmissionCosts& k = c.costs;
  for (double v : {k.copy_s, k.copy_dram_s, k.miss_expert_s, k.miss_pair_s})
    if (!(v >= 0) || v == std::numeric_limits<double>::infinity())
      return absl::InvalidArgumentError("admission policy: costs must be finite and >= 0");
  ExpertPredictorConfig pc{c.layers, c.num_experts};
  absl::StatusOr<std::unique_ptr<ExpertPredictor>> predictor = ExpertPredictor::Create(pc);
  if (!predictor.ok()) return predictor.status();
  std::unique_ptr<AdmissionPolicy> a(new AdmissionPolicy(c));
  a->predictor_ = *std::move(predictor);
  a->pos_.assign(c.layers.back() + 1, -1);
  for (size_t i = 0; i < c.layers.size(); ++i) a->pos_[c.layers[i]] = static_cast<int>(i);
  a->interval_s_.assign(c.layers.size(), 0.0);
  a->counters_.resize(c.layers.size());

  return a;
}

absl::StatusOr<std::vector<SlotCopy>> AdmissionPolicy::OnLayer(ExpertCache& cache, int layer, int T, int k,
                                                               const int32_t* ids, double now_s,
                                                               double link_free_s) {
  MOE_RETURN_IF_ERROR(predictor_->Observe(layer, T, k, ids));
  const int n = static_cast<int>(config_.layers.size());
  const int p = pos_[layer];
  if (last_pos_ >= 0 && p == (last_pos_ + 1) % n && now_s >= last_now_s_) {
    double& iv = interval_s_[p];
    const double dt = now_s - last_now_s_;
    iv = iv > 0 ? iv + kIntervalSmoothing * (dt - iv) : dt;
    if (dt > 0) busy_share_ += kIntervalSmoothing * (std::min(1.0, last_miss_s_ / dt) - busy_share_);
  }
  // This run's misses (the cache as the run finds it).
  {
    const AdmissionCosts& c = config_.costs;
    std::vector<int> pairs(config_.num_experts, 0);
    for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i)
      if (ids[i] >= 0) ++pairs[ids[i]];
    last_miss_s_ = 0;
    for (int e = 0; e < config_.num_experts; ++e)
      if (pairs[e] > 0 && cache.ReadySlot(layer, e) < 0) last_miss_s_ += c.miss_expert_s + pairs[e] * c.miss_pair_s;
  }
  if (last_pos_ < 0 || p <= last_pos_) pass_bytes_ = 0;  // a new forward pass
  last_pos_ = p;
  last_now_s_ = now_s;

  std::vector<SlotCopy> out;
  double until = 0;
  bool known = true;
  for (int lag = 1; lag <= ExpertPredictor::kMaxLag; ++lag) {
    const int target = (p + lag) % n;
    if (interval_s_[target] <= 0) known = false;
    until += interval_s_[target];
    if (lag > 1 && target == (p + 1) % n) break;  // fewer layers than lags
    const double start_s = known ? now_s + until : std::numeric_limits<double>::infinity();
    Plan(cache, config_.layers[target], lag, now_s, start_s, &link_free_s, &out);
  }
  return out;
}

void AdmissionPolicy::Plan(ExpertCache& cache, int target, int lag, double now_s, double start_s,
                           double* link_free_s, std::vector<SlotCopy>* out) {
  const AdmissionCosts& c = config_.costs;
  const double copy_cost = c.copy_dram_s * busy_share_;
  std::vector<double> pairs;
  const std::vector<double> prob = predictor_->Predict(target, lag, &pairs);
  const int E = config_.num_experts;
  std::vector<double> value(E);
  for (int e = 0; e < E; ++e) value[e] = prob[e] * c.miss_expert_s + pairs[e] * c.miss_pair_s;

  std::vector<int> candidates;
  for (int e = 0; e < E; ++e)
    if (cache.SlotOf(target, e) < 0 && value[e] > copy_cost) candidates.push_back(e);
  if (candidates.empty()) return;
  std::sort(candidates.begin(), candidates.end(), [&](int a, int b) { return value[a] > value[b]; });
  // Victims: empty slots first, then Ready unpinned experts, least valuable first.
  struct Victim {
    int slot;
    double value;
  };
  std::vector<Victim> victims;
  const std::vector<int> held = cache.SlotExperts(target);
  for (int s = 0; s < static_cast<int>(held.size()); ++s) {
    const int e = held[s];
    if (e < 0) {
      victims.push_back({s, 0.0});
    } else if (cache.ReadySlot(target, e) == s && !cache.pinned(target, e)) {
      victims.push_back({s, value[e]});
    }
  }
  std::stable_sort(victims.begin(), victims.end(), [](const Victim& a, const Victim& b) { return a.value < b.value; });

  AdmissionCounters& counters = counters_[pos_[target]];
  size_t v = 0;
  for (int e : candidates) {
    if (v >= victims.size()) break;
    if (value[e] - victims[v].value <= copy_cost) break;  // sorted: no later pair pays either
    const double done = std::max(now_s, *link_free_s) + c.copy_s;
    if (done > start_s) break;  // would land after the layer ran
    if (config_.pass_budget_bytes > 0 && pass_bytes_ + config_.expert_bytes > config_.pass_budget_bytes) break;
    absl::StatusOr<SlotCopy> copy = cache.Replace(target, victims[v].slot, e);
    if (!copy.ok()) continue;  // cannot happen for the slots chosen above; skip defensively
    ++v;
    *link_free_s = done;
    pass_bytes_ += config_.expert_bytes;
    ++counters.copies;
    counters.bytes += config_.expert_bytes;
    out->push_back(*copy);
  }
}

}  // namespace moe
