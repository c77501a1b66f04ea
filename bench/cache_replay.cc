// cache_replay: replays a routing trace through the expert-cache policies and
// prints the hit rate of each, per layer and overall, and the bytes copied:
//
//   lru, lfru     the GPU worker's ExpertCache (gpu_worker/expert_cache.h)
//   lfu           the same ExpertCache's LFRU without decay (pure pair counts)
//   coordinator   the coordinator's real Popularity + PlanPlacement, fed the
//                 counts a worker's heartbeats would carry, its assignments
//                 applied through ExpertCache::Assign (the static policy)
//   belady        the offline optimum (bench/belady.h): the ceiling
//   best-static   (on request) the best fixed set per layer in hindsight
//
// Time: one trace step = --step-ms; copies go over one PCIe link of
// --pcie-gbps, one after another, and an expert serves hits only once its copy
// completed (as on the worker); belady's copies are free and instant.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/belady.h"
#include "core/routing_trace.h"
#include "coordinator/placement.h"
#include "coordinator/policy.h"
#include "coordinator/popularity.h"
#include "core/flags.h"
#include "gpu_worker/expert_cache.h"

namespace moe {
namespace {

struct ReplayConfig {
  int slots = 0;
  double step_seconds = 0.025;
  uint64_t expert_bytes = 0;
  double pcie_bytes_per_second = 0;  // 0: copies are instant
  double lfru_half_life = 64;
  double heartbeat_seconds = 0.2;
  CoordinatorPolicy policy;
};

struct PolicyResult {
  std::string name;
  std::vector<uint64_t> hits, pairs;  // [layer]
  uint64_t copies = 0;
  double seconds = 0;  // replay wall time
  uint64_t TotalHits() const { uint64_t s = 0; for (auto h : hits) s += h; return s; }
  uint64_t TotalPairs() const { uint64_t s = 0; for (auto p : pairs) s += p; return s; }
  double Rate() const { return TotalPairs() ? double(TotalHits()) / TotalPairs() : 0.0; }
  double LayerRate(int l) const { return pairs[l] ? double(hits[l]) / pairs[l] : 0.0; }
};

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

std::unique_ptr<ExpertCache> MakeCache(const RoutingTrace& t, const ReplayConfig& c, CachePolicyKind kind,
                                       double half_life) {
  ExpertCacheConfig cc;
  cc.num_layers = t.num_layers;
  cc.num_experts = t.num_experts;
  cc.slots_per_layer = c.slots;
  cc.policy = kind;
  cc.lfru_half_life = half_life;
  absl::StatusOr<std::unique_ptr<ExpertCache>> cache = ExpertCache::Create(cc);
  if (!cache.ok()) {
    std::fprintf(stderr, "cache_replay: %s\n", std::string(cache.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(cache);
}

// Counts the step's hits against the ready slots (what the dispatcher does).
void CountHits(const ExpertCache& cache, int layer, const std::vector<ExpertAccess>& acc, PolicyResult& r,
               std::vector<int>* experts, std::vector<int>* pairs, std::vector<int>* missed,
               std::vector<bool>* hit) {
  experts->clear();
  pairs->clear();
  missed->clear();
  hit->clear();
  for (const ExpertAccess& a : acc) {
    experts->push_back(a.expert);
    pairs->push_back(a.pairs);
    const bool h = cache.ReadySlot(layer, a.expert) >= 0;
    hit->push_back(h);
    if (h) {
      r.hits[layer] += a.pairs;
    } else {
      missed->push_back(a.expert);
    }
    r.pairs[layer] += a.pairs;
  }
}

PolicyResult ReplayOnline(const RoutingTrace& t, const ReplayConfig& c, const std::string& name) {
  PolicyResult r{name, std::vector<uint64_t>(t.num_layers), std::vector<uint64_t>(t.num_layers)};
  const CachePolicyKind kind = name == "lru" ? CachePolicyKind::kLru : CachePolicyKind::kLfru;
  auto cache = MakeCache(t, c, kind, name == "lfu" ? 1e300 : c.lfru_half_life);
  CopyQueue copies(*cache, c);
  std::vector<int> experts, pairs, missed;
  std::vector<bool> hit;
  for (size_t s = 0; s < t.steps.size(); ++s) {
    const double now = s * c.step_seconds;
    copies.Advance(now);
    for (int l = 0; l < t.num_layers; ++l) {
      CountHits(*cache, l, t.steps[s][l], r, &experts, &pairs, &missed, &hit);
      cache->RecordAccess(l, experts, pairs);
      copies.Submit(cache->PlanAdmissions(l, missed, c.slots), now);
    }
  }
  r.copies = copies.count();
  return r;
}

PolicyResult ReplayCoordinator(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r{"coordinator", std::vector<uint64_t>(t.num_layers), std::vector<uint64_t>(t.num_layers)};
  auto cache = MakeCache(t, c, CachePolicyKind::kStatic, c.lfru_half_life);
  CopyQueue copies(*cache, c);
  const std::string worker = "replay";
  Popularity popularity(t.num_layers, t.num_experts, c.policy.half_life_seconds, 0.0);
  // Counts since the last heartbeat, [layer][expert] pairs and hits.
  std::vector<std::vector<uint64_t>> pending_pairs(t.num_layers, std::vector<uint64_t>(t.num_experts));
  std::vector<std::vector<uint64_t>> pending_hits = pending_pairs;
  const double round_seconds = c.policy.rebalance_interval_seconds > 0 ? c.policy.rebalance_interval_seconds : 1.0;
  double last_heartbeat = 0, last_rebalance = 0;
  // The worker acknowledges an assignment in the first heartbeat after its
  // copies completed; until then the coordinator leaves it alone (frozen).
  bool acked = true;
  double applied_at = 0;
  std::vector<int> experts, pairs, missed;
  std::vector<bool> hit;
  for (size_t s = 0; s < t.steps.size(); ++s) {
    const double now = s * c.step_seconds;
    copies.Advance(now);
    for (int l = 0; l < t.num_layers; ++l) {
      CountHits(*cache, l, t.steps[s][l], r, &experts, &pairs, &missed, &hit);
      for (size_t i = 0; i < experts.size(); ++i) {
        pending_pairs[l][experts[i]] += pairs[i];
        if (hit[i]) pending_hits[l][experts[i]] += pairs[i];
      }
    }
    const double end = (s + 1) * c.step_seconds;
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
        std::vector<int> held = cache->SlotExperts(l);
        held.erase(std::remove(held.begin(), held.end(), -1), held.end());
        w.resident.push_back(held);
        p.global_popularity.push_back(popularity.global().Layer(l, end));
        w.popularity.push_back(popularity.worker(worker) ? popularity.worker(worker)->Layer(l, end)
                                                         : std::vector<double>(t.num_experts, 0.0));
      }
      p.workers.push_back(std::move(w));
      const PlacementPlan plan = PlanPlacement(p);
      for (int l = 0; l < t.num_layers; ++l) {
        absl::StatusOr<std::vector<SlotCopy>> k = cache->Assign(l, plan.sets[0][l]);
        if (!k.ok()) {
          std::fprintf(stderr, "cache_replay: %s\n", std::string(k.status().message()).c_str());
          std::exit(1);
        }
        if (!k->empty()) acked = false;
        copies.Submit(*k, end);
      }
      applied_at = std::max(end, copies.idle_at());
    }
  }
  r.copies = copies.count();
  return r;
}

PolicyResult ReplayBelady(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r{"belady", std::vector<uint64_t>(t.num_layers), std::vector<uint64_t>(t.num_layers)};
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

// The best fixed set per layer in hindsight (the C experts with the most
// pairs over the whole trace), loaded before the first step: what a perfect
// popularity estimate of a stationary trace would reach. Offline, no copies.
PolicyResult ReplayBestStatic(const RoutingTrace& t, const ReplayConfig& c) {
  PolicyResult r{"best-static", std::vector<uint64_t>(t.num_layers), std::vector<uint64_t>(t.num_layers)};
  for (int l = 0; l < t.num_layers; ++l) {
    std::vector<uint64_t> pairs(t.num_experts, 0);
    for (const auto& s : t.steps) {
      for (const ExpertAccess& a : s[l]) pairs[a.expert] += a.pairs;
    }
    std::sort(pairs.rbegin(), pairs.rend());
    for (int e = 0; e < t.num_experts; ++e) {
      r.pairs[l] += pairs[e];
      if (e < c.slots) r.hits[l] += pairs[e];
    }
  }
  return r;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  std::string trace_path, cache_text = "25%", policies_text = "lru,lfu,lfru,coordinator,belady";
  double step_ms = 100, pcie_gbps = 55, heartbeat_ms = 200;
  int64_t expert_bytes = 3ll * 7168 * 2048 * 2;  // one DeepSeek-V3 expert in bf16
  bool per_layer = false;
  moe::ReplayConfig c;
  std::string placement = moe::PlacementModeName(c.policy.placement);
  moe::FlagSet flags("cache_replay",
                     "--trace FILE [--cache C|P%] [flags]\n"
                     "Replays a routing trace (bench/README.md: ours, or recorded vLLM routing; *.xz is read through\n"
                     "xz -dc) through lru, lfu, lfru, the coordinator's placement and Belady's offline optimum.");
  flags.String("trace", &trace_path, "routing trace file (required)");
  flags.String("cache", &cache_text, "cache slots per layer: a count, or a percentage of the experts (e.g. 25%)");
  flags.String("policies", &policies_text,
               "comma list of lru, lfu, lfru, coordinator, belady, and best-static (the best fixed set per layer in "
               "hindsight)");
  flags.Double("step-ms", &step_ms, "wall time of one trace step (a decode step of the batch, CPU misses included);\n"
              "      the coordinator's time constants (half-life, rounds, heartbeats) are measured against it");
  flags.Int("expert-bytes", &expert_bytes, "bytes of one expert copy (default: a DeepSeek-V3 expert, bf16)");
  flags.Double("pcie-gbps", &pcie_gbps, "host->GPU copy bandwidth, GB/s (copies are serialised); 0: instant copies");
  flags.Double("lfru-half-life", &c.lfru_half_life, "LFRU decay half-life in accesses of a layer (ExpertCache's)");
  flags.Double("heartbeat-ms", &heartbeat_ms, "coordinator: counts reach it once per heartbeat");
  flags.Double("half-life-seconds", &c.policy.half_life_seconds, "coordinator: popularity half-life");
  flags.Double("rebalance-interval-seconds", &c.policy.rebalance_interval_seconds, "coordinator: placement period");
  flags.Double("copy-budget-gbps", &c.policy.copy_budget_gbps, "coordinator: PCIe share of a round; <= 0 unlimited");
  flags.Double("hysteresis-margin", &c.policy.hysteresis_margin, "coordinator: relative margin");
  flags.Double("copy-cost-hits", &c.policy.copy_cost_hits, "coordinator: cost of a copy in hits");
  flags.String("placement", &placement, "coordinator: per-worker or union (one worker here: the same but replication)");
  flags.Bool("per-layer", &per_layer, "also print every layer's hit rates");
  flags.Parse(argc, argv);
  if (trace_path.empty()) flags.Fail("--trace is required (see --help)");
  if (absl::Status s = moe::ParsePlacementMode(placement, &c.policy.placement); !s.ok())
    flags.Fail(std::string(s.message()));
  if (!(step_ms > 0)) flags.Fail("--step-ms must be > 0");
  if (expert_bytes <= 0) flags.Fail("--expert-bytes must be > 0");
  std::vector<std::string> policies = absl::StrSplit(policies_text, ',', absl::SkipEmpty());
  for (const std::string& p : policies) {
    if (p != "lru" && p != "lfu" && p != "lfru" && p != "coordinator" && p != "belady" && p != "best-static")
      flags.Fail("--policies: unknown policy '" + p + "'");
  }

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<moe::RoutingTrace> trace = moe::ReadRoutingTrace(trace_path);
  if (!trace.ok()) flags.Fail(std::string(trace.status().message()), 1);
  const double read_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const moe::RoutingTrace& t = *trace;
  double v = 0;
  if (!cache_text.empty() && cache_text.back() == '%') {
    if (!absl::SimpleAtod(cache_text.substr(0, cache_text.size() - 1), &v) || v < 0 || v > 100)
      flags.Fail("--cache: bad percentage '" + cache_text + "'");
    c.slots = static_cast<int>(std::lround(v / 100.0 * t.num_experts));
  } else {
    if (!absl::SimpleAtod(cache_text, &v) || v < 0 || v > t.num_experts || v != std::floor(v))
      flags.Fail("--cache: '" + cache_text + "' is not a slot count in [0, num_experts]");
    c.slots = static_cast<int>(v);
  }
  c.step_seconds = step_ms / 1000.0;
  c.expert_bytes = static_cast<uint64_t>(expert_bytes);
  c.pcie_bytes_per_second = pcie_gbps * 1e9;
  c.heartbeat_seconds = heartbeat_ms / 1000.0;

  uint64_t pairs = 0;
  for (int l = 0; l < t.num_layers; ++l) pairs += t.Pairs(l);
  std::printf("trace: %s\n", t.source.c_str());
  std::printf("  %zu steps x %d layers, %d experts, top-%d, %llu pairs (%.1f per step and layer); read in %.1f s\n",
              t.steps.size(), t.num_layers, t.num_experts, t.top_k, static_cast<unsigned long long>(pairs),
              double(pairs) / t.steps.size() / t.num_layers, read_s);
  std::printf("cache: %d of %d experts per layer (%.0f%%); one step = %g ms; copies of %.1f MB at %g GB/s\n", c.slots,
              t.num_experts, 100.0 * c.slots / t.num_experts, step_ms, expert_bytes / 1e6, pcie_gbps);
  std::printf("coordinator: %s, half-life %g s, rebalance every %g s, copy budget %g GB/s, hysteresis margin %g, "
              "copy cost %g hits, heartbeat %g ms\n\n",
              moe::PlacementModeName(c.policy.placement), c.policy.half_life_seconds,
              c.policy.rebalance_interval_seconds, c.policy.copy_budget_gbps, c.policy.hysteresis_margin,
              c.policy.copy_cost_hits, heartbeat_ms);

  std::vector<moe::PolicyResult> results;
  for (const std::string& p : policies) {
    const auto s0 = std::chrono::steady_clock::now();
    moe::PolicyResult r = p == "coordinator"   ? moe::ReplayCoordinator(t, c)
                          : p == "belady"      ? moe::ReplayBelady(t, c)
                          : p == "best-static" ? moe::ReplayBestStatic(t, c)
                                               : moe::ReplayOnline(t, c, p);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    results.push_back(std::move(r));
  }
  const moe::PolicyResult* belady = nullptr;
  for (const auto& r : results) {
    if (r.name == "belady") belady = &r;
  }
  std::printf("%-12s %9s %10s %10s %12s %9s\n", "policy", "hit rate", "vs belady", "copies", "copied", "replay");
  for (const auto& r : results) {
    std::printf("%-12s %8.1f%% %10s %10llu %10.1f GB %8.2fs\n", r.name.c_str(), 100 * r.Rate(),
                belady ? absl::StrFormat("%+.1f", 100 * (r.Rate() - belady->Rate())).c_str() : "-",
                static_cast<unsigned long long>(r.copies), double(r.copies) * expert_bytes / 1e9, r.seconds);
  }
  if (per_layer) {
    std::printf("\nhit rate per layer (%%)\n%-6s", "layer");
    for (const auto& r : results) std::printf(" %11s", r.name.c_str());
    std::printf("\n");
    for (int l = 0; l < t.num_layers; ++l) {
      std::printf("%-6d", l);
      for (const auto& r : results) std::printf(" %11.1f", 100 * r.LayerRate(l));
      std::printf("\n");
    }
  }
  return 0;
}
