#include "gpu_worker/admission_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe {
namespace {
// The fixed memories of the shadows' rates (half-lives, runs of the layer);
// memory 0 is the measured residency horizon.
constexpr double kMemoryRuns[] = {16, 64};
const double kKeepMem[] = {std::exp2(-1.0 / kMemoryRuns[0]), std::exp2(-1.0 / kMemoryRuns[1])};
constexpr double kIntervalSmoothing = 0.25;  // EMA weight of a new layer-interval sample
}  // namespace

absl::StatusOr<std::unique_ptr<AdmissionPolicy>> AdmissionPolicy::Create(const AdmissionConfig& c) {
  if (c.expert_bytes == 0) return absl::InvalidArgumentError("admission policy: expert_bytes must be > 0");
  const AdmissionCosts& k = c.costs;
  for (double v : {k.copy_s, k.copy_dram_s, k.miss_expert_s, k.miss_pair_s, k.copy_call_s})
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
  a->residency_.resize(c.layers.size());
  for (Residency& r : a->residency_) {
    r.use.assign(c.num_experts, 0.0);
    r.pairs.assign(c.num_experts, 0.0);
    r.admitted.assign(c.num_experts, -1);
    r.rent.assign(c.num_experts, 0.0);
    for (int m = 0; m < kMemories; ++m) {
      r.use_mem[m].assign(c.num_experts, 0.0);
      r.pairs_mem[m].assign(c.num_experts, 0.0);
    }
    for (auto [later_runs, memory] : {std::pair{0.0, 0}, {1.0, 0}, {3.0, 0}, {8.0, 0}, {8.0, 1}, {24.0, 1}, {8.0, 2},
                                      {24.0, 2}})
      r.shadows.push_back(Shadow{later_runs, memory, std::vector<double>(c.num_experts, kNever), {}});
  }

  return a;
}

absl::StatusOr<std::vector<SlotCopy>> AdmissionPolicy::OnLayer(ExpertCache& cache, int layer, int T, int k,
                                                               const int32_t* ids, double now_s,
                                                               double link_free_s, double plan_cost_s) {
  MOE_RETURN_IF_ERROR(predictor_->Observe(layer, T, k, ids));
  const int n = static_cast<int>(config_.layers.size());
  const int p = pos_[layer];
  if (last_pos_ >= 0 && p == (last_pos_ + 1) % n && now_s >= last_now_s_) {
    double& iv = interval_s_[p];
    const double dt = now_s - last_now_s_;
    iv = iv > 0 ? iv + kIntervalSmoothing * (dt - iv) : dt;
    if (dt > 0) busy_share_ += kIntervalSmoothing * (std::min(1.0, last_miss_s_ / dt) - busy_share_);
  }
  // Until an eviction was measured, an admitted expert is expected to stay
  // as many runs as the layer has slots (one replacement per run).
  if (residency_[p].horizon <= 0) residency_[p].horizon = std::max(1, cache.config().slots_per_layer);
  ObserveUse(p, T, k, ids, now_s);  // fills scratch_pairs_ with this run's pairs per expert
  // This run's misses (the cache as the run finds it); an expert this policy
  // admitted that is gone (an assignment took its slot) gives no residency sample.
  {
    const AdmissionCosts c = Costs();
    const std::vector<int>& pairs = scratch_pairs_;
    Residency& r = residency_[p];
    last_miss_s_ = 0;
    for (int e = 0; e < config_.num_experts; ++e) {
      if (pairs[e] > 0 && cache.ReadySlot(layer, e) < 0) {
        const double miss_s = c.miss_expert_s + pairs[e] * c.miss_pair_s;
        last_miss_s_ += miss_s;
        if (cache.SlotOf(layer, e) < 0) r.rent[e] += miss_s;
      }
      if (r.admitted[e] >= 0 && cache.SlotOf(layer, e) < 0) r.admitted[e] = -1;
    }
  }
  if (last_pos_ < 0 || p <= last_pos_) pass_bytes_ = 0;  // a new forward pass
  last_pos_ = p;
  last_now_s_ = now_s;
  // Planned only once the misses could have paid for it (a bucket of one planning).
  plan_credit_s_ = std::min(plan_credit_s_ + last_miss_s_, std::max(0.0, plan_cost_s));
  if (plan_credit_s_ < plan_cost_s) {
    ++unplanned_runs_;
    return std::vector<SlotCopy>{};
  }
  plan_credit_s_ = 0;
  ++planned_runs_;

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

namespace {

// Swaps for one target layer: `victims` (expert, or -1 for an empty slot)
// least valuable first; `candidate(e)`: e may be copied in; `timing(i)`: the
// i-th copy started now lands before the target runs (1), after it (0), or
// cannot be started (-1). Replacing v by e gains the coming run's difference
// (none for e when its copy lands late; v is gone at once) plus the later
// runs': kept whole when e is the better resident, else bounded by
// `undo_cost` (>= copy_cost), what bringing v back costs (rent or buy: a swap
// for the coming run only costs the later runs no more than that). A swap is
// made when the gain beats the copy's cost. Writes (expert, victim id) pairs
// in order to `out`; `order` and `second` are scratch.
//
// The candidates are tried most valuable first (value = next + later_runs *
// rate; ties: the lower id), but not all of them need sorting — this runs at
// every layer run on the dispatcher's thread, between a decode call's
// return and the next layer (issue 21's fixed cost per layer). A swap of e
// for the current victim v needs gain > cost, and gain <= value(e) - value(v)
// while the later runs' loss is within undo_cost, else gain <= next(e) -
// next(v) - undo_cost. So once a candidate's value is within a copy of v's
// (v's value only grows), only candidates with next(e) > 2 cost can still pay:
// the candidates come off a heap until then, and those few are sorted. The
// victims, least valuable first (empty slots, key -1, before all; ties: the
// lower id), come off a heap of their own as they are taken.
// The standard normal quantile at p in (0, 1) (Acklam's rational
// approximation, relative error below 1.2e-9).
double NormalQuantile(double p) {
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                             1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01, -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                             3.754408661907416e+00};
  constexpr double kLow = 0.02425;
  if (p < kLow) {
    const double q = std::sqrt(-2 * std::log(p));
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  if (p > 1 - kLow) return -NormalQuantile(1 - p);
  const double q = p - 0.5, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

// What a swap is worth (ChooseSwaps): an expert's value (-1, an empty slot:
// 0) and the gain of replacing v by e.
struct SwapPricing {
  const std::vector<double>& next;
  const std::vector<double>& rate;
  const std::vector<double>& sd;
  double later_runs = 0, undo_cost = 0;
  int candidates = 0;  // the experts ChooseSwaps may copy in
  double mean_rate = 0;  // the layer's average rate (over all its experts)

  // A swap: the best of n candidates' noise alone reaches about sqrt(2 ln n)
  // standard errors (and the victim, the least of the residents' estimates,
  // is biased the other way): the difference must clear that.
  double SwapNoiseZ() const { return std::sqrt(2 * std::log(std::max(2.0, static_cast<double>(candidates)))); }
  // A fill of an empty slot: how far noise alone lifts the r-th best (r >= 1)
  // of the n candidates' estimates above their true rates, in standard
  // errors: the normal quantile at 1 - r / (n + 1) (the median's: 0). The
  // candidates are taken best first, so the r-th one considered carries the
  // r-th best's inflation: the first of many is discounted most, and filling
  // half the free slots of a layer from its estimates is not.
  double NoiseZ(int rank) const {
    const double q = 1.0 - static_cast<double>(rank) / (std::max(candidates, rank) + 1.0);
    return q > 0.5 ? NormalQuantile(q) : 0.0;
  }

  double Value(int e) const { return e < 0 ? 0.0 : next[e] + later_runs * rate[e]; }
  // The later runs' gain counts only beyond the rates' standard error: rates
  // estimated from a few dozen runs differ by noise, and swapping on noise
  // replaces a better expert by a worse one as often as not (the winner's
  // curse: on stationary routing every such swap is a loss).
  double Gain(int e, int v, bool in_time, int rank) const {
    const double now_gain = (in_time ? next[e] : 0.0) - (v >= 0 ? next[v] : 0.0);
    if (v < 0) {
      // Into an empty slot: e's rate, its excess over the layer's mean
      // discounted by the noise of the rank it was picked at (the mean of
      // all the layer's experts is itself well known; an expert of a layer
      // that routes evenly is worth its share of the routing, not nothing).
      const double excess = rate[e] - mean_rate;
      const double est = excess > 0 ? mean_rate + std::max(0.0, excess - NoiseZ(rank) * sd[e]) : rate[e];
      return now_gain + later_runs * est;
    }
    double later_gain = later_runs * (rate[e] - rate[v]);
    if (later_gain > 0) {
      const double noise = std::sqrt(sd[e] * sd[e] + sd[v] * sd[v]);
      later_gain = std::max(0.0, later_gain - SwapNoiseZ() * later_runs * noise);
    }
    return now_gain + (later_gain >= 0 ? later_gain : -std::min(-later_gain, undo_cost));
  }
};

// Heap order of (key, expert): the larger key first, ties the lower expert.
bool HeapLess(const std::pair<double, int>& a, const std::pair<double, int>& b) {
  return a.first != b.first ? a.first < b.first : a.second > b.second;
}

// Long: its two passes share the pricing, the victims' heap and the
// candidates' ranks; split, each would take all of them as arguments.
template <typename Candidate, typename Timing>
void ChooseSwaps(const std::vector<double>& next, const std::vector<double>& rate, const std::vector<double>& sd,
                 double later_runs, double copy_cost, double undo_cost, std::vector<AdmissionVictim>* victims,
                 Candidate candidate, Timing timing, std::vector<std::pair<double, int>>* order,
                 std::vector<std::pair<double, int>>* second, std::vector<std::pair<int, int>>* out) {
  out->clear();
  SwapPricing pricing{next, rate, sd, later_runs, undo_cost};
  for (double r : rate) pricing.mean_rate += r / static_cast<double>(rate.size());
  auto value = [&](int e) { return pricing.Value(e); };
  auto victim_after = [](const AdmissionVictim& a, const AdmissionVictim& b) {
    return a.key != b.key ? a.key > b.key : a.id > b.id;
  };
  std::make_heap(victims->begin(), victims->end(), victim_after);
  // Bounds above, with a margin for rounding.
  auto slack = [&](double a, double b) { return 1e-9 * (std::abs(a) + std::abs(b) + copy_cost); };
  const double least_next = 2 * copy_cost - slack(copy_cost, 0);
  // Taking e alone (an empty slot, in time) gains value(e). A candidate whose
  // value is within a copy of the least valuable victim's (victims' values
  // only grow as they are taken) can never be taken in the first pass: it goes
  // straight to the second pass's list if its next can pay there, and the
  // heap holds only the few that can (most of a full layer's candidates are
  // worth less than its worst resident).
  const bool bounded = !victims->empty();
  const double v0 = bounded ? value(victims->front().expert) : 0.0;
  std::vector<std::pair<double, int>>& heap = *order;
  std::vector<std::pair<double, int>>& later = *second;
  heap.clear();
  later.clear();
  for (int e = 0; e < static_cast<int>(next.size()); ++e) {
    if (!candidate(e)) continue;
    ++pricing.candidates;
    const double ve = value(e);
    if (!(ve > copy_cost)) continue;
    if (bounded && ve <= v0 + copy_cost - slack(ve, v0)) {
      if (next[e] > least_next) later.push_back({next[e], e});
    } else {
      heap.push_back({ve, e});
    }
  }
  // Tries e against the current victim; false: stop (no victim or no link time left).
  int considered = 0;  // the rank of the candidate tried (best first)
  auto consider = [&](int e) {
    if (victims->empty()) return false;
    const int when = timing(static_cast<int>(out->size()));
    if (when < 0) return false;
    if (pricing.Gain(e, victims->front().expert, when > 0, ++considered) > copy_cost) {
      out->push_back({e, victims->front().id});
      std::pop_heap(victims->begin(), victims->end(), victim_after);
      victims->pop_back();
    }
    return true;  // a later candidate may still pay
  };
  std::make_heap(heap.begin(), heap.end(), HeapLess);
  while (!heap.empty()) {
    const std::pair<double, int> top = heap.front();
    if (!victims->empty()) {
      const double vv = value(victims->front().expert);
      if (top.first <= vv + copy_cost - slack(top.first, vv)) break;
    }
    std::pop_heap(heap.begin(), heap.end(), HeapLess);
    heap.pop_back();
    if (!consider(top.second)) return;
  }
  // The rest is worth no more than a copy over its victim: it pays only for
  // the coming run, gain <= next(e) - next(v) (the later runs' part is <= 0
  // here). So it is taken in order of next, and stops at the first candidate
  // whose next is within a copy of the current victim's: no later one can pay
  // against it, and the victim changes only with a swap. (All of them, in
  // value order, were 48% of the planning: stop 25's profile.)
  heap.erase(std::remove_if(heap.begin(), heap.end(), [&](const auto& c) { return !(next[c.second] > least_next); }),
             heap.end());
  for (auto& c : heap) c.first = next[c.second];
  heap.insert(heap.end(), later.begin(), later.end());
  std::make_heap(heap.begin(), heap.end(), HeapLess);
  while (!heap.empty()) {
    const int e = heap.front().second;
    if (!victims->empty()) {
      const int v = victims->front().expert;
      const double nv = v >= 0 ? next[v] : 0.0;
      if (next[e] <= nv + copy_cost - slack(next[e], nv)) return;
    }
    std::pop_heap(heap.begin(), heap.end(), HeapLess);
    heap.pop_back();
    if (!consider(e)) return;
  }
}

}  // namespace

// Long: the shadows' decisions and the real cache's swaps price the same
// candidates with the same rates in one pass; kept together so they cannot drift.
void AdmissionPolicy::Plan(ExpertCache& cache, int target, int lag, double now_s, double start_s,
                           double* link_free_s, std::vector<SlotCopy>* out) {
  const AdmissionCosts c = Costs();
  const double copy_cost = c.copy_dram_s * busy_share_ + c.copy_call_s;
  // Undoing a swap (bringing the victim back) costs a copy when the
  // predictor foresees the victim's next use in time, else that use misses:
  // at the layer's measured recall, copy + (1 - recall) x one missed expert.
  const double undo_cost = copy_cost + (1.0 - predictor_->quality(target).recall()) * c.miss_expert_s;
  const int tp = pos_[target];
  Residency& res = residency_[tp];
  std::vector<double> pairs;
  const std::vector<double> prob = predictor_->Predict(target, lag, &pairs);
  const int E = config_.num_experts;
  // next[e]: CPU time e saves at the target's coming run; rate[e]: at each run
  // after it (the use rate over the residency horizon).
  // The shadows plan at lag 1 only (below): at lag 2 only the best one's rates are needed.
  const Shadow& leader = *std::max_element(res.shadows.begin(), res.shadows.end(),
                                           [](const Shadow& a, const Shadow& b) { return a.score < b.score; });
  std::vector<double>& next = scratch_next_;
  std::vector<double>* rates = scratch_rates_;  // [memory]: CPU time saved per later run
  std::vector<double>* sds = scratch_sd_;       // [memory]: its standard error
  next.resize(E);
  for (int m = 0; m <= kMemories; ++m) {
    if (lag != 1 && m != leader.memory) continue;
    const std::vector<double>& use = m == 0 ? res.use : res.use_mem[m - 1];
    const std::vector<double>& per_run = m == 0 ? res.pairs : res.pairs_mem[m - 1];
    // The use is an exponential average (keep k, from 0) of n runs' 0/1
    // use: its weights sum to S = 1 - k^n and their squares to
    // Q = (1-k)^2 (1 - k^2n) / (1 - k^2), so it has variance p (1 - p) Q for
    // a use probability p, estimated from use / S over S^2 / Q runs with one
    // use and one non-use added (never 0 or 1: a few runs prove nothing). The
    // pairs are taken to follow the use.
    const double keep = m == 0 ? std::exp2(-1.0 / std::max(1.0, res.horizon)) : kKeepMem[m - 1];
    const double n = static_cast<double>(res.runs);
    const double S = 1 - std::pow(keep, n), Q = (1 - keep) * (1 - keep) * (1 - std::pow(keep, 2 * n)) / (1 - keep * keep);
    const double n_eff = Q > 0 ? S * S / Q : 0.0;
    rates[m].resize(E);
    sds[m].resize(E);
    for (int e = 0; e < E; ++e) {
      rates[m][e] = use[e] * c.miss_expert_s + per_run[e] * c.miss_pair_s;
      const double per_use = use[e] > 0 ? rates[m][e] / use[e] : c.miss_expert_s;
      const double p = S > 0 ? (n_eff * use[e] / S + 1) / (n_eff + 2) : 0.5;
      sds[m][e] = per_use * std::sqrt(p * (1 - p) * Q);
    }
  }
  for (int e = 0; e < E; ++e) next[e] = prob[e] * c.miss_expert_s + pairs[e] * c.miss_pair_s;
  // A copy that lands after the target's coming run serves from the run after
  // it; one the link cannot finish within a pass (the runs after) is not
  // started — the queue would only delay copies that can land in time.
  const double end_s = start_s + PassSeconds();
  // How many later runs a swap is priced over is not known in advance: it
  // depends on how predictable the layer's routing is beyond its next run.
  // Shadows (bookkeeping-only caches of this layer, one per horizon, with
  // their own link) make the same decisions with each horizon and score the
  // CPU time their hits save less their copies' cost; the real cache follows
  // the best of them.
  const int C = cache.config().slots_per_layer;
  // The shadows plan each layer once per run, one layer ahead (half the host
  // time of planning them at every lag; their scores only rank them).
  for (Shadow& sh : res.shadows) {
    if (lag != 1) break;
    const std::vector<double>& rate = rates[sh.memory];
    std::vector<AdmissionVictim>& victims = scratch_victims_;
    victims.clear();
    for (int e : sh.held)
      if (sh.ready[e] <= now_s) victims.push_back({next[e] + sh.later_runs * rate[e], e, e});
    const size_t empty = C > static_cast<int>(sh.held.size()) ? C - sh.held.size() : 0;
    victims.insert(victims.end(), empty, AdmissionVictim{-1, -1, -1});
    double link = std::max(now_s, sh.link_free_s);
    auto timing = [&](int i) {
      const double done = link + (i + 1) * c.copy_s;
      return done > end_s ? -1 : done <= start_s ? 1 : 0;
    };
    ChooseSwaps(next, rate, sds[sh.memory], sh.later_runs, copy_cost, undo_cost, &victims,
                [&](int e) { return sh.ready[e] >= kNever; }, timing, &scratch_order_, &scratch_second_, &scratch_swaps_);
    for (const auto& [e, victim] : scratch_swaps_) {
      link += c.copy_s;
      sh.ready[e] = link;
      if (victim >= 0) {
        sh.ready[victim] = kNever;
        *std::find(sh.held.begin(), sh.held.end(), victim) = e;
      } else {
        sh.held.push_back(e);
      }
      sh.score -= copy_cost;
    }
    sh.link_free_s = link;
  }
  const Shadow& best = *std::max_element(res.shadows.begin(), res.shadows.end(),
                                         [](const Shadow& a, const Shadow& b) { return a.score < b.score; });
  const std::vector<double>& rate = rates[best.memory];
  // The real cache: victims are empty slots, then Ready unpinned experts, least valuable first.
  std::vector<int>& victim_slots = scratch_slots_;  // ascending
  victim_slots.clear();
  const std::vector<int> held = cache.SlotExperts(target);
  for (int s = 0; s < static_cast<int>(held.size()); ++s)
    if (held[s] < 0 || (cache.ReadySlot(target, held[s]) == s && !cache.pinned(target, held[s])))
      victim_slots.push_back(s);
  AdmissionCounters& counters = counters_[tp];
  auto start = [&](int slot, int e) {
    absl::StatusOr<SlotCopy> copy = cache.Replace(target, slot, e);
    if (!copy.ok()) return;  // cannot happen for the slots chosen here; skip defensively
    if (copy->evicted >= 0) Evicted(tp, copy->evicted);
    res.admitted[e] = static_cast<int64_t>(res.runs);
    res.rent[e] = 0;
    *link_free_s = std::max(now_s, *link_free_s) + c.copy_s;
    pass_bytes_ += config_.expert_bytes;
    ++counters.copies;
    counters.bytes += config_.expert_bytes;
    out->push_back(*copy);
  };
  // Pins stay in force: a pinned expert that is not resident (its assignment
  // found every slot loading) comes back first, into the least valuable slot.
  auto slot_value = [&](int s) { return held[s] < 0 ? -1.0 : next[held[s]] + best.later_runs * rate[held[s]]; };
  std::vector<AdmissionVictim>& victims = scratch_victims_;  // the slots, least valuable first (ties: the lower slot)
  victims.clear();
  for (int s : victim_slots) victims.push_back({slot_value(s), held[s], s});
  auto victim_before = [](const AdmissionVictim& a, const AdmissionVictim& b) {
    return a.key != b.key ? a.key < b.key : a.id < b.id;
  };
  size_t first = 0;
  for (int e = 0; e < E; ++e)
    if (cache.pinned(target, e) && cache.SlotOf(target, e) < 0) {
      if (first == 0) std::sort(victims.begin(), victims.end(), victim_before);  // pins are rare
      if (first >= victims.size()) break;
      start(victims[first++].id, e);
    }
  victims.erase(victims.begin(), victims.begin() + static_cast<std::ptrdiff_t>(first));
  const bool budget = config_.pass_budget_bytes > 0;
  FillByRent(cache, target, copy_cost, std::max(now_s, *link_free_s), end_s, &victims, &scratch_swaps_);
  for (const auto& [slot, e] : scratch_swaps_) start(slot, e);
  const double link = std::max(now_s, *link_free_s);
  auto timing = [&](int i) {
    const double done = link + (i + 1) * c.copy_s;
    if (budget && pass_bytes_ + (i + 1) * config_.expert_bytes > config_.pass_budget_bytes) return -1;
    return done > end_s ? -1 : done <= start_s ? 1 : 0;
  };
  ChooseSwaps(next, rate, sds[best.memory], best.later_runs, copy_cost, undo_cost, &victims,
              [&](int e) { return cache.SlotOf(target, e) < 0; }, timing, &scratch_order_, &scratch_second_, &scratch_swaps_);
  for (const auto& [e, slot] : scratch_swaps_) start(slot, e);
}

// Ski rental for the empty slots among `victims`: uncached experts whose rent
// (the CPU time their misses took while out of the cache) reached the copy's
// cost, most rent first, while the link (free at `link_s`) lands each copy
// within the pass after the target's run (by `end_s`) and the pass's byte
// budget allows. Writes (slot, expert) pairs to `fills`; their slots leave `victims`.
void AdmissionPolicy::FillByRent(const ExpertCache& cache, int target, double copy_cost, double link_s, double end_s,
                                 std::vector<AdmissionVictim>* victims, std::vector<std::pair<int, int>>* fills) {
  fills->clear();
  const std::vector<double>& rent = residency_[pos_[target]].rent;
  std::vector<std::pair<double, int>>& due = scratch_order_;
  due.clear();
  for (int e = 0; e < config_.num_experts; ++e)
    if (rent[e] > 0 && rent[e] >= copy_cost && cache.SlotOf(target, e) < 0) due.push_back({rent[e], e});
  if (due.empty()) return;
  std::sort(due.begin(), due.end(), [](const auto& a, const auto& b) { return HeapLess(b, a); });
  const double copy_s = Costs().copy_s;
  uint64_t bytes = pass_bytes_;
  size_t next = 0;
  for (auto v = victims->begin(); v != victims->end() && next < due.size();) {
    if (v->expert >= 0) {
      ++v;
      continue;
    }
    link_s += copy_s;
    bytes += config_.expert_bytes;
    if (link_s > end_s || (config_.pass_budget_bytes > 0 && bytes > config_.pass_budget_bytes)) return;
    fills->push_back({v->id, due[next++].second});
    v = victims->erase(v);
  }
}

AdmissionCosts AdmissionPolicy::Costs() const {
  const CostModel* r = config_.live_rates;
  if (r == nullptr || !r->measured) return config_.costs;
  // A copy reads the expert's bytes from host DRAM beside the CPU servers:
  // it costs them the share of their pace they lose while it runs, as
  // measured; unmeasured, all of its bytes (the CPU's per-expert time).
  const double expert_s = r->cpu.scale() * r->cpu_expert_s;
  const double copy_cpu_s = r->copy_cpu_share >= 0 ? r->CopySeconds() * r->copy_cpu_share : expert_s;
  // What a copy delays the calls beside it, as observed; until observed, its
  // own link time (a decode call waits on that link for its answers).
  const double call_s = r->overlap.learned() ? r->overlap.delay_s() : r->CopySeconds();
  return AdmissionCosts{r->CopySeconds(), copy_cpu_s, expert_s, r->cpu.scale() * r->PairSeconds(1), call_s};
}

// Seconds of one forward pass (every served layer once), from the measured
// layer intervals; infinity until every interval was measured.
double AdmissionPolicy::PassSeconds() const {
  double s = 0;
  for (double iv : interval_s_) {
    if (iv <= 0) return std::numeric_limits<double>::infinity();
    s += iv;
  }
  return s;
}

void AdmissionPolicy::Evicted(int pos, int expert) {
  Residency& r = residency_[pos];
  const int64_t since = r.admitted[expert];
  r.admitted[expert] = -1;
  if (since < 0) return;  // resident before the policy saw it (an assignment)
  const double runs = std::max(1.0, static_cast<double>(static_cast<int64_t>(r.runs) - since));
  r.horizon += kResidencySmoothing * (runs - r.horizon);
}

// Use and pair rates of a layer's run, averaged over the residency horizon.
void AdmissionPolicy::ObserveUse(int pos, int T, int k, const int32_t* ids, double now_s) {
  Residency& r = residency_[pos];
  std::vector<int>& pairs = scratch_pairs_;
  pairs.assign(config_.num_experts, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i)
    if (ids[i] >= 0) ++pairs[ids[i]];
  const double keep = std::exp2(-1.0 / std::max(1.0, r.horizon));
  // The shadows' hits at this run: the CPU time their resident experts saved.
  const AdmissionCosts c = Costs();
  for (Shadow& sh : r.shadows) {
    sh.score *= kShadowKeep;
    for (int e = 0; e < config_.num_experts; ++e)
      if (pairs[e] > 0 && sh.ready[e] <= now_s) sh.score += c.miss_expert_s + pairs[e] * c.miss_pair_s;
  }
  for (int e = 0; e < config_.num_experts; ++e) {
    r.use[e] = keep * r.use[e] + (1 - keep) * (pairs[e] > 0 ? 1.0 : 0.0);
    for (int m = 0; m < kMemories; ++m) {
      r.use_mem[m][e] = kKeepMem[m] * r.use_mem[m][e] + (1 - kKeepMem[m]) * (pairs[e] > 0 ? 1.0 : 0.0);
      r.pairs_mem[m][e] = kKeepMem[m] * r.pairs_mem[m][e] + (1 - kKeepMem[m]) * pairs[e];
    }
    r.pairs[e] = keep * r.pairs[e] + (1 - keep) * pairs[e];
  }
  ++r.runs;
}

}  // namespace moe
