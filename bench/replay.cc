#include "bench/model/step_time_model.h"
#include "bench/replay.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>

#include "absl/strings/str_cat.h"
#include "bench/belady.h"
#include "coordinator/placement.h"
#include "coordinator/popularity.h"
#include "gpu_worker/admission_policy.h"
#include "gpu_worker/expert_cache.h"
#include "nlohmann/json.hpp"

namespace moe {

uint64_t PolicyResult::TotalHits() const {
  uint64_t s = 0;
  for (auto h : hits) s += h;
  return s;
}
uint64_t PolicyResult::TotalPairs() const {
  uint64_t s = 0;
  for (auto p : pairs) s += p;
  return s;
}
double PolicyResult::Rate() const { return TotalPairs() ? double(TotalHits()) / TotalPairs() : 0.0; }
double PolicyResult::LayerRate(int l) const { return pairs[l] ? double(hits[l]) / pairs[l] : 0.0; }

const std::vector<std::string>& ReplayPolicies() {
  static const std::vector<std::string> names = {"default",     "lru",         "lfu",    "lfru",
                                                 "coordinator", "belady-prefetch", "belady", "best-static",
                                                 "best-static-cold", "best-so-far", "oracle"};
  return names;
}

namespace {

// The worker's copy engine: one link, FIFO; completes copies whose time came.
class CopyQueue {
 public:
  CopyQueue(ExpertCache& cache, const ReplayConfig& c) : cache_(cache), config_(c) {}
  void Submit(const std::vector<SlotCopy>& copies, double now) {
    for (const SlotCopy& k : copies) {
      if (config_.pcie_bytes_per_second <= 0) {
        cache_.CompleteCopy(k);
        continue;
      }
      busy_until_ = std::max(busy_until_, now) + double(config_.expert_bytes) / config_.pcie_bytes_per_second;
      pending_.push_back({busy_until_, k});
    }
    count_ += copies.size();
  }
  void Advance(double now) {
    while (!pending_.empty() && pending_.front().first <= now) {
      cache_.CompleteCopy(pending_.front().second);
      pending_.pop_front();
    }
  }
  uint64_t count() const { return count_; }
  // When every copy submitted so far will have completed.
  double idle_at() const { return busy_until_; }

 private:
  ExpertCache& cache_;
  const ReplayConfig& config_;
  std::deque<std::pair<double, SlotCopy>> pending_;
  double busy_until_ = 0;
  uint64_t count_ = 0;
};

// The C experts with the most pairs in `counts` (MostUsed) as membership flags.
std::vector<bool> TopC(const std::vector<uint64_t>& counts, int slots) {
  std::vector<bool> out(counts.size(), false);
  for (int e : MostUsed(counts, slots)) out[e] = true;
  return out;
}

// Per layer, the best fixed set in hindsight (BestFixedSet) as membership flags.
std::vector<std::vector<bool>> BestSets(const RoutingTrace& t, int slots) {
  std::vector<std::vector<bool>> sets(t.num_layers, std::vector<bool>(t.num_experts, false));
  for (int l = 0; l < t.num_layers; ++l)
    for (int e : BestFixedSet(t, l, slots)) sets[l][e] = true;
  return sets;
}

// An online policy's cache: empty, or (ReplayConfig::warm) each layer's best
// fixed set Ready from the start, as a coordinator's assignment leaves it.
absl::StatusOr<std::unique_ptr<ExpertCache>> MakeCache(const RoutingTrace& t, const ReplayConfig& c,
                                                       CachePolicy kind, double half_life) {
  ExpertCacheConfig cc;
  cc.num_layers = t.num_layers;
  cc.num_experts = t.num_experts;
  cc.slots_per_layer = c.slots;
  cc.policy = kind;
  cc.lfru_half_life = half_life;
  absl::StatusOr<std::unique_ptr<ExpertCache>> cache = ExpertCache::Create(cc);
  if (!cache.ok() || !c.warm) return cache;
  for (int l = 0; l < t.num_layers; ++l) {
    absl::StatusOr<std::vector<SlotCopy>> copies = (*cache)->Assign(l, BestFixedSet(t, l, c.slots));
    if (!copies.ok()) return copies.status();
    for (const SlotCopy& copy : *copies) (*cache)->CompleteCopy(copy);
  }
  return cache;
}

// One layer's accesses against the ready slots (what the dispatcher does).
struct LayerOutcome {
  std::vector<int> experts, pairs, missed;
  std::vector<bool> hit;
};

void CountHits(const ExpertCache& cache, int layer, const std::vector<ExpertAccess>& acc, PolicyResult& r,
               LayerOutcome* o) {
  o->experts.clear();
  o->pairs.clear();
  o->missed.clear();
  o->hit.clear();
  for (const ExpertAccess& a : acc) {
    o->experts.push_back(a.expert);
    o->pairs.push_back(a.pairs);
    const bool h = cache.ReadySlot(layer, a.expert) >= 0;
    o->hit.push_back(h);
    if (h) {
      r.hits[layer] += a.pairs;
    } else {
      o->missed.push_back(a.expert);
    }
    r.pairs[layer] += a.pairs;
  }
}

// CPU seconds of one layer run's missed experts, each at its own pairs.
double CpuSeconds(const StepTimeModel& m, const LayerOutcome& o) {
  double s = 0;
  for (size_t i = 0; i < o.experts.size(); ++i)
    if (!o.hit[i]) s += m.ExpertMissSeconds(static_cast<double>(o.pairs[i]));
  return s;
}

PolicyResult NewResult(const RoutingTrace& t, const std::string& name) {
  return PolicyResult{name, std::vector<uint64_t>(t.num_layers), std::vector<uint64_t>(t.num_layers)};
}

// The layer's routing handed to the admission policy: the step's tokens with
// their expert ids, as the worker sees them; a trace without per-token ids
// gives the step's distinct experts as one row.
void Routing(const RoutingTrace& t, size_t s, int l, std::vector<int32_t>* ids, int* T, int* k) {
  ids->clear();
  if (t.top_k > 0 && s < t.tokens.size() && l < static_cast<int>(t.tokens[s].size()) && !t.tokens[s][l].empty()) {
    ids->assign(t.tokens[s][l].begin(), t.tokens[s][l].end());
    *k = t.top_k;
    *T = static_cast<int>(ids->size()) / t.top_k;
    return;
  }
  for (const ExpertAccess& a : t.steps[s][l]) ids->push_back(a.expert);
  *k = static_cast<int>(ids->size());
  *T = *k > 0 ? 1 : 0;
}

// The worker's per-call loop: at each layer run the copies completed by now
// serve, the run's hits and misses are counted, `admit` plans copies (started
// now), and the modelled clock advances by the layer's time; `step_end`
// (optional) runs after each step with the clock and the copy queue.
using AdmitFn = std::function<absl::StatusOr<std::vector<SlotCopy>>(size_t step, int layer, const LayerOutcome& o,
                                                                    double now, double link_free)>;
using StepEndFn = std::function<absl::Status(double now, CopyQueue& copies)>;
absl::Status RunOnline(const RoutingTrace& t, const ReplayConfig& c, ExpertCache& cache, const AdmitFn& admit,
                       const StepEndFn& step_end, PolicyResult& r) {
  CopyQueue copies(cache, c);
  const StepTimeModel model = ReplayTimeModel(c);
  LayerOutcome o;
  double now = 0;
  for (size_t s = 0; s < t.steps.size(); ++s) {
    for (int l = 0; l < t.num_layers; ++l) {
      copies.Advance(now);
      CountHits(cache, l, t.steps[s][l], r, &o);
      cache.RecordAccess(l, o.experts, o.pairs);
      absl::StatusOr<std::vector<SlotCopy>> planned = admit(s, l, o, now, std::max(now, copies.idle_at()));
      if (!planned.ok()) return planned.status();
      copies.Submit(*planned, now);
      now += model.LayerSecondsFromCpu(c.step_seconds / t.num_layers, CpuSeconds(model, o), copies.idle_at() - now);
    }
    if (step_end)
      if (absl::Status st = step_end(now, copies); !st.ok()) return st;
  }
  r.copies = copies.count();
  r.model_seconds = now;
  return absl::OkStatus();
}

absl::StatusOr<PolicyResult> ReplayOnline(const RoutingTrace& t, const ReplayConfig& c, const std::string& name) {
  PolicyResult r = NewResult(t, name);
  const CachePolicy kind = name == "lru" ? CachePolicy::kLru : CachePolicy::kLfru;
  absl::StatusOr<std::unique_ptr<ExpertCache>> cache = MakeCache(t, c, kind, name == "lfu" ? 1e300 : c.lfru_half_life);
  if (!cache.ok()) return cache.status();
  ExpertCache& ec = **cache;
  absl::Status st = RunOnline(
      t, c, ec,
      [&](size_t, int l, const LayerOutcome& o, double, double) -> absl::StatusOr<std::vector<SlotCopy>> {
        return ec.PlanAdmissions(l, o.missed, c.slots);
      },
      nullptr, r);
  if (!st.ok()) return st;
  return r;
}

// The worker's default: ExpertCache (predictive) + AdmissionPolicy, fed the
// routing of each layer when it runs and the clock, as the dispatcher does.
absl::StatusOr<PolicyResult> ReplayDefault(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r = NewResult(t, "default");
  absl::StatusOr<std::unique_ptr<ExpertCache>> cache = MakeCache(t, c, CachePolicy::kPredictive, c.lfru_half_life);
  if (!cache.ok()) return cache.status();
  AdmissionConfig ac;
  for (int l = 0; l < t.num_layers; ++l) ac.layers.push_back(l);
  ac.num_experts = t.num_experts;
  ac.expert_bytes = c.expert_bytes;
  ac.costs.copy_s = c.pcie_bytes_per_second > 0 ? double(c.expert_bytes) / c.pcie_bytes_per_second : 0.0;
  const StepTimeModel model = ReplayTimeModel(c);
  // A copy costs the CPU work it slows while both run: the model's share of its link time.
  ac.costs.copy_dram_s = ac.costs.copy_s * model.CopyCpuShare();
  // Linear in the pairs as the worker's admission costs are: per expert and
  // per pair, the curve's slope from 1 to 64 pairs (one expert with one pair
  // costs what the curve says).
  ac.costs.miss_pair_s = c.cpu_expert_curve.empty()
                             ? c.pair_seconds
                             : std::max(0.0, (model.ExpertMissSeconds(64) - model.ExpertMissSeconds(1)) / 63);
  ac.costs.miss_expert_s = c.cpu_expert_curve.empty() ? model.ExpertMissSeconds(0)
                                                      : std::max(0.0, model.ExpertMissSeconds(1) - ac.costs.miss_pair_s);
  absl::StatusOr<std::unique_ptr<AdmissionPolicy>> policy = AdmissionPolicy::Create(ac);
  if (!policy.ok()) return policy.status();
  ExpertCache& ec = **cache;
  std::vector<int32_t> ids;
  int T = 0, k = 0;
  double plan_s = 0;
  uint64_t runs = 0;
  absl::Status st = RunOnline(
      t, c, ec,
      [&](size_t s, int l, const LayerOutcome&, double now, double link_free) {
        Routing(t, s, l, &ids, &T, &k);
        const auto t0 = std::chrono::steady_clock::now();
        auto planned = (*policy)->OnLayer(ec, l, T, std::max(k, 1), ids.data(), now, link_free);
        plan_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ++runs;
        return planned;
      },
      nullptr, r);
  if (!st.ok()) return st;
  r.plan_us_per_run = runs > 0 ? 1e6 * plan_s / static_cast<double>(runs) : 0.0;
  PredictionQuality q;
  for (int l = 0; l < t.num_layers; ++l) {
    const PredictionQuality& ql = (*policy)->predictor().quality(l);
    q.predicted += ql.predicted;
    q.correct += ql.correct;
    q.used += ql.used;
  }
  r.precision = q.precision();
  r.recall = q.recall();
  return r;
}

absl::StatusOr<PolicyResult> ReplayCoordinator(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r = NewResult(t, "coordinator");
  absl::StatusOr<std::unique_ptr<ExpertCache>> made = MakeCache(t, c, CachePolicy::kStatic, c.lfru_half_life);
  if (!made.ok()) return made.status();
  ExpertCache& cache = **made;
  const std::string worker = "replay";
  Popularity popularity(t.num_layers, t.num_experts, c.policy.half_life_seconds);
  // Counts since the last heartbeat, [layer][expert] pairs and hits.
  std::vector<std::vector<uint64_t>> pending_pairs(t.num_layers, std::vector<uint64_t>(t.num_experts));
  std::vector<std::vector<uint64_t>> pending_hits = pending_pairs;
  const double round_seconds = c.policy.rebalance_interval_seconds > 0 ? c.policy.rebalance_interval_seconds : 1.0;
  double last_heartbeat = 0, last_rebalance = 0;
  // The worker acknowledges an assignment in the first heartbeat after its
  // copies completed; until then the coordinator leaves it alone (frozen).
  bool acked = true;
  double applied_at = 0;
  auto count = [&](size_t, int l, const LayerOutcome& o, double, double) -> absl::StatusOr<std::vector<SlotCopy>> {
    for (size_t i = 0; i < o.experts.size(); ++i) {
      pending_pairs[l][o.experts[i]] += o.pairs[i];
      if (o.hit[i]) pending_hits[l][o.experts[i]] += o.pairs[i];
    }
    return std::vector<SlotCopy>{};
  };
  auto step_end = [&](double end, CopyQueue& copies) -> absl::Status {
    if (end - last_heartbeat >= c.heartbeat_seconds) {
      for (int l = 0; l < t.num_layers; ++l) {
        for (int e = 0; e < t.num_experts; ++e) {
          if (pending_pairs[l][e] == 0) continue;
          popularity.Add(worker, l, e, double(pending_pairs[l][e]), double(pending_hits[l][e]), end);
          pending_pairs[l][e] = pending_hits[l][e] = 0;
        }
      }
      last_heartbeat = end;
      if (applied_at <= end) acked = true;
    }
    if (c.policy.rebalance_interval_seconds > 0 && end - last_rebalance >= c.policy.rebalance_interval_seconds &&
        acked) {
      last_rebalance = end;
      PlacementProblem p;
      p.num_layers = t.num_layers;
      p.num_experts = t.num_experts;
      p.params = {c.policy.placement, c.policy.hysteresis_margin, c.policy.copy_cost_hits, c.policy.replicate_share};
      WorkerPlacementState w;
      w.id = worker;
      w.slots_per_layer = c.slots;
      w.expert_bytes = c.expert_bytes;
      if (c.policy.copy_budget_gbps > 0)
        w.budget_bytes = static_cast<uint64_t>(c.policy.copy_budget_gbps * 1e9 * round_seconds);
      w.cached.assign(t.num_layers, true);
      w.pinned.resize(t.num_layers);
      for (int l = 0; l < t.num_layers; ++l) {
        std::vector<int> held = cache.SlotExperts(l);
        held.erase(std::remove(held.begin(), held.end(), -1), held.end());
        w.resident.push_back(held);
        p.global_popularity.push_back(popularity.Layer(l, end).counts);
        w.popularity.push_back(popularity.worker(worker) ? popularity.worker(worker)->Layer(l, end)
                                                         : std::vector<double>(t.num_experts, 0.0));
      }
      p.workers.push_back(std::move(w));
      const PlacementPlan plan = PlanPlacement(p);
      for (int l = 0; l < t.num_layers; ++l) {
        absl::StatusOr<std::vector<SlotCopy>> k = cache.Assign(l, plan.sets[0][l]);
        if (!k.ok()) return k.status();
        if (!k->empty()) acked = false;
        copies.Submit(*k, end);
      }
      applied_at = std::max(end, copies.idle_at());
    }
    return absl::OkStatus();
  };
  absl::Status st = RunOnline(t, c, cache, count, step_end, r);
  if (!st.ok()) return st;
  return r;
}

// belady-prefetch: knows the whole trace and prefetches under the same link
// model. A strong offline heuristic, not a bound (an online policy beat it
// in some cells of the shared traces): the bound is `oracle`.
// Right after layer l runs in step s it makes l's resident set for its next
// run (step s+1) Belady's: a non-resident expert e replaces the resident v
// whose next use lies farthest ahead, when e's next use comes sooner (ties:
// more pairs at that use). Copies start at once, one link, FIFO; an expert
// serves only once its copy landed, as for every online policy.
absl::StatusOr<PolicyResult> ReplayBeladyPrefetch(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r = NewResult(t, "belady-prefetch");
  absl::StatusOr<std::unique_ptr<ExpertCache>> made = MakeCache(t, c, CachePolicy::kPredictive, c.lfru_half_life);
  if (!made.ok()) return made.status();
  ExpertCache& cache = **made;
  const size_t S = t.steps.size();
  const int E = t.num_experts;
  // uses[l][e]: the steps that route layer l to e, ascending, with their pairs;
  // cursor[l][e]: the first of them after the step being planned.
  std::vector<std::vector<std::vector<std::pair<uint32_t, uint32_t>>>> uses(
      t.num_layers, std::vector<std::vector<std::pair<uint32_t, uint32_t>>>(E));
  for (size_t s = 0; s < S; ++s)
    for (int l = 0; l < t.num_layers; ++l)
      for (const ExpertAccess& a : t.steps[s][l])
        uses[l][a.expert].push_back({static_cast<uint32_t>(s), static_cast<uint32_t>(a.pairs)});
  std::vector<std::vector<size_t>> cursor(t.num_layers, std::vector<size_t>(E, 0));
  std::vector<uint32_t> nu(E), np(E);
  auto admit = [&](size_t s, int l, const LayerOutcome&, double, double) -> absl::StatusOr<std::vector<SlotCopy>> {
    std::vector<SlotCopy> out;
    for (int e = 0; e < E; ++e) {
      const auto& u = uses[l][e];
      size_t& i = cursor[l][e];
      while (i < u.size() && u[i].first <= s) ++i;
      nu[e] = i < u.size() ? u[i].first : static_cast<uint32_t>(S);
      np[e] = i < u.size() ? u[i].second : 0;
    }
    // Sooner is better; at the same step, more pairs.
    auto sooner = [&](int a, int b) { return nu[a] != nu[b] ? nu[a] < nu[b] : np[a] > np[b]; };
    std::vector<int> wanted;
    for (int e = 0; e < E; ++e)
      if (cache.SlotOf(l, e) < 0 && nu[e] < S) wanted.push_back(e);
    std::sort(wanted.begin(), wanted.end(), sooner);
    std::vector<int> slots;  // Ready or empty slots, the farthest next use first
    const std::vector<int> held = cache.SlotExperts(l);
    for (int sl = 0; sl < static_cast<int>(held.size()); ++sl)
      if (held[sl] < 0 || cache.ReadySlot(l, held[sl]) == sl) slots.push_back(sl);
    std::sort(slots.begin(), slots.end(), [&](int a, int b) {
      if (held[a] < 0 || held[b] < 0) return held[a] < 0 && held[b] >= 0;
      return sooner(held[b], held[a]);
    });
    size_t v = 0;
    for (int e : wanted) {
      if (v >= slots.size()) break;
      const int victim = held[slots[v]];
      if (victim >= 0 && !sooner(e, victim)) break;
      absl::StatusOr<SlotCopy> k = cache.Replace(l, slots[v++], e);
      if (!k.ok()) return k.status();
      out.push_back(*k);
    }
    return out;
  };
  absl::Status st = RunOnline(t, c, cache, admit, nullptr, r);
  if (!st.ok()) return st;
  return r;
}

PolicyResult ReplayBelady(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r = NewResult(t, "belady");
  r.model_seconds = -1;  // the flow gives totals, not per-step misses
  for (int l = 0; l < t.num_layers; ++l) {
    std::vector<std::vector<ExpertAccess>> steps;
    steps.reserve(t.steps.size());
    for (const auto& s : t.steps) steps.push_back(s[l]);
    const OfflineResult o = BeladyOptimum(steps, t.num_experts, c.slots);
    r.hits[l] = o.hits;
    r.pairs[l] = o.pairs;
    r.copies += o.copies;
  }
  return r;
}

// Offline policies that hold, at each step and layer, the experts `held`
// chooses; no copy costs. Modelled time: the device part plus the misses.
template <typename HeldFn>
PolicyResult ReplayOffline(const RoutingTrace& t, const ReplayConfig& c, const std::string& name, HeldFn held) {
  PolicyResult r = NewResult(t, name);
  const StepTimeModel model = ReplayTimeModel(c);
  std::vector<bool> resident;
  for (size_t s = 0; s < t.steps.size(); ++s) {
    for (int l = 0; l < t.num_layers; ++l) {
      held(s, l, &resident);
      double cpu_s = 0;
      for (const ExpertAccess& a : t.steps[s][l]) {
        r.pairs[l] += a.pairs;
        if (resident[a.expert]) {
          r.hits[l] += a.pairs;
        } else {
          cpu_s += model.ExpertMissSeconds(static_cast<double>(a.pairs));
        }
      }
      r.model_seconds += c.step_seconds / t.num_layers + cpu_s;
    }
  }
  return r;
}

// The oracle, a bound: per step and layer, any C experts resident (copies
// free and instant). Its hits are the C largest pair counts of the run; its
// time the device part plus every missed expert's CPU time but the C largest
// (a measured CPU curve need not grow with the pairs: the set that saves the
// most time may differ from the one that hits the most). No C-slot cache hits
// more, nor, since copies only add to a layer's time, models a shorter step.
PolicyResult ReplayOracleBound(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r = NewResult(t, "oracle");
  const StepTimeModel model = ReplayTimeModel(c);
  std::vector<uint64_t> pairs(t.num_experts);
  std::vector<double> miss_s;
  for (size_t s = 0; s < t.steps.size(); ++s) {
    for (int l = 0; l < t.num_layers; ++l) {
      std::fill(pairs.begin(), pairs.end(), 0);
      for (const ExpertAccess& a : t.steps[s][l]) pairs[a.expert] += a.pairs;
      std::vector<uint64_t> used;
      miss_s.clear();
      for (int e = 0; e < t.num_experts; ++e) {
        if (pairs[e] == 0) continue;
        used.push_back(pairs[e]);
        miss_s.push_back(model.ExpertMissSeconds(static_cast<double>(pairs[e])));
        r.pairs[l] += pairs[e];
      }
      const size_t keep = std::min<size_t>(static_cast<size_t>(c.slots), used.size());
      std::sort(used.begin(), used.end(), std::greater<>());
      std::sort(miss_s.begin(), miss_s.end(), std::greater<>());
      for (size_t i = 0; i < keep; ++i) r.hits[l] += used[i];
      double cpu_s = 0;
      for (size_t i = keep; i < miss_s.size(); ++i) cpu_s += miss_s[i];
      r.model_seconds += c.step_seconds / t.num_layers + cpu_s;
    }
  }
  return r;
}

}  // namespace

StepTimeModel ReplayTimeModel(const ReplayConfig& c) {
  StepTimeModel m;
  m.expert_bytes = static_cast<double>(c.expert_bytes);
  m.dram_bytes_per_second = c.dram_bytes_per_second;
  m.pcie_bytes_per_second = c.pcie_bytes_per_second;
  m.shared_bytes_per_second = c.shared_bytes_per_second;
  m.pair_seconds = c.pair_seconds;
  m.cpu_expert_curve = c.cpu_expert_curve;
  return m;
}

absl::Status LoadRates(const std::string& path, uint64_t expert_bytes, ReplayConfig* c) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("rates: cannot read ", path));
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat("rates: ", path, " is not a JSON object"));
  // Rates in GB/s and bytes: within a factor of a million of any real machine's.
  auto number = [&](const char* key, double lo, double hi) -> absl::StatusOr<double> {
    if (!j.contains(key) || !j[key].is_number() || !(j[key].get<double>() >= lo && j[key].get<double>() <= hi))
      return absl::InvalidArgumentError(absl::StrCat("rates: ", path, ": ", key, " must be a number in [", lo, ", ", hi, "]"));
    return j[key].get<double>();
  };
  absl::StatusOr<double> dram = number("dram_gbps", 1e-3, 1e6), pcie = number("pcie_gbps", 1e-3, 1e6),
                         bytes = number("expert_bytes", 1, 1e12);
  for (const auto* v : {&dram, &pcie, &bytes})
    if (!v->ok()) return v->status();
  absl::StatusOr<double> shared = j.contains("shared_gbps") ? number("shared_gbps", 1e-3, 1e6) : c->shared_bytes_per_second / 1e9;
  if (!shared.ok()) return shared.status();
  const auto& curve = j.contains("cpu_expert_seconds") ? j["cpu_expert_seconds"] : nlohmann::json();
  if (!curve.is_array() || curve.empty())
    return absl::InvalidArgumentError(absl::StrCat("rates: ", path, ": cpu_expert_seconds must be a non-empty array"));
  std::vector<std::pair<int, double>> points;
  for (const auto& p : curve) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number() ||
        p[0].get<int64_t>() < 1 || p[0].get<int64_t>() > 1000000 || !(p[1].get<double>() >= 0) ||
        !(p[1].get<double>() < 1e6) || (!points.empty() && p[0].get<int>() <= points.back().first))
      return absl::InvalidArgumentError(absl::StrCat(
          "rates: ", path, ": cpu_expert_seconds entries must be [rows in [1, 1000000], seconds in [0, 1e6)], rows ascending"));
    // A CPU expert's time grows with its size: the measured expert's scaled to this trace's.
    points.push_back({p[0].get<int>(), p[1].get<double>() * double(expert_bytes) / *bytes});
  }
  c->dram_bytes_per_second = *dram * 1e9;
  c->pcie_bytes_per_second = *pcie * 1e9;
  c->shared_bytes_per_second = *shared * 1e9;
  c->cpu_expert_curve = std::move(points);
  return absl::OkStatus();
}

absl::StatusOr<PolicyResult> Replay(const RoutingTrace& t, const ReplayConfig& c, const std::string& name) {
  if (c.slots < 0 || c.slots > t.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("slots: ", c.slots, " outside [0, ", t.num_experts, "]"));
  if (c.expert_bytes == 0) return absl::InvalidArgumentError("expert_bytes: must be > 0");
  if (!(c.step_seconds > 0)) return absl::InvalidArgumentError("step_seconds: must be > 0");
  if (name == "default") return ReplayDefault(t, c);
  if (name == "lru" || name == "lfu" || name == "lfru") return ReplayOnline(t, c, name);
  if (name == "coordinator") return ReplayCoordinator(t, c);
  if (name == "belady-prefetch") return ReplayBeladyPrefetch(t, c);
  if (name == "belady") return ReplayBelady(t, c);
  if (name == "best-static" || name == "best-static-cold") {
    // The best fixed set per layer in hindsight, resident from the start; or
    // (cold) each member from the step after its first use: what learning
    // the set from the trace itself costs at least (no copy is priced).
    const std::vector<std::vector<bool>> sets = BestSets(t, c.slots);
    if (name == "best-static")
      return ReplayOffline(t, c, name, [&](size_t, int l, std::vector<bool>* held) { *held = sets[l]; });
    std::vector<std::vector<bool>> seen(t.num_layers, std::vector<bool>(t.num_experts, false));
    return ReplayOffline(t, c, name, [&](size_t s, int l, std::vector<bool>* held) {
      held->assign(t.num_experts, false);
      for (int e = 0; e < t.num_experts; ++e) (*held)[e] = sets[l][e] && seen[l][e];
      for (const ExpertAccess& a : t.steps[s][l]) seen[l][a.expert] = true;  // after this run
    });
  }
  if (name == "best-so-far") {
    // At each run the layer's most used experts of the runs before it (pairs;
    // follow the leader), resident at once, no copy priced: what an online
    // frequency policy reaches at best, and what best-static gains from
    // knowing the whole trace in advance.
    std::vector<std::vector<uint64_t>> used(t.num_layers, std::vector<uint64_t>(t.num_experts, 0));
    return ReplayOffline(t, c, name, [&](size_t s, int l, std::vector<bool>* held) {
      *held = TopC(used[l], c.slots);
      for (int e = 0; e < t.num_experts; ++e) (*held)[e] = (*held)[e] && used[l][e] > 0;  // none unseen
      for (const ExpertAccess& a : t.steps[s][l]) used[l][a.expert] += a.pairs;  // after this run
    });
  }
  if (name == "oracle") return ReplayOracleBound(t, c);
  return absl::InvalidArgumentError(absl::StrCat("policy '", name, "' is unknown"));
}

}  // namespace moe
