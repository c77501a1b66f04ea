// cache_replay: replays a routing trace through the expert-cache policies and
// prints, for each, the hit rate (per layer on request), the modelled step
// time, the expert copies and bytes, and for `default` the prediction quality.
// The policies and the time model live in bench/replay.h:
//
//   default       what the GPU worker does by default: ExpertCache
//                 (predictive) + AdmissionPolicy + ExpertPredictor (gpu_worker/)
//   lru, lfru     the worker's ExpertCache
//   lfu           the same ExpertCache's LFRU without decay (pure pair counts)
//   coordinator   the coordinator's real Popularity + PlanPlacement, fed the
//                 counts a worker's heartbeats would carry, its assignments
//                 applied through ExpertCache::Assign (the static policy)
//   belady-prefetch  knows the future: after each layer run, Belady's
//                 resident set for that layer's next run, prefetched over the
//                 same link model (a strong heuristic, not a bound)
//   belady        the demand-admission optimum (bench/belady.h)
//   best-static   the best fixed set per layer in hindsight
//   best-static-cold  that set, each member resident only after its first
//                 use (the least an online policy that learns the set pays)
//   best-so-far   at each run the layer's most used experts of the runs
//                 before it, copies free (follow the leader: an online
//                 frequency policy's best)
//   oracle        the bound: per step, any C experts resident (free
//                 prefetch): the C largest pair counts hit, the C costliest
//                 misses are saved. Every policy's distance is printed to it,
//                 and cache_replay exits 3 naming a policy that beats it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/replay.h"
#include "coordinator/placement.h"
#include "core/flags.h"
#include "testing/routing_trace.h"

int main(int argc, char** argv) {
  std::string trace_path, cache_text = "25%",
                          policies_text = "default,lru,lfu,lfru,coordinator,best-static,best-static-cold,best-so-far,belady-prefetch,belady,oracle";
  double step_ms = 100, pcie_gbps = 55, heartbeat_ms = 200, dram_gbps = 94, shared_gbps = 130, cpu_tflops = 4.6,
         pair_us = -1;
  int64_t expert_bytes = 3ll * 7168 * 2048 * 2;  // one DeepSeek-V3 expert in bf16
  bool per_layer = false;
  moe::ReplayConfig c;
  std::string placement = moe::PlacementModeName(c.policy.placement);
  moe::FlagSet flags("cache_replay",
                     "--trace FILE [--cache C|P%] [flags]\n"
                     "Replays a routing trace (bench/README.md: ours, or recorded vLLM routing; *.xz is read with\n"
                     "liblzma) through the worker's default policy, lru, lfu, lfru, the coordinator's placement,\n"
                     "the best fixed set, Belady's prefetch and demand optimum and the oracle bound; prints hit rates and\n"
                     "modelled step times, and each policy's distance to the oracle (exit 3 if one beats it)\n"
                     "(defaults: the GPU host of shared/PERF.md).");
  flags.String("trace", &trace_path, "routing trace file (required)");
  flags.String("cache", &cache_text, "cache slots per layer: a count, or a percentage of the experts (e.g. 25%)");
  flags.String("policies", &policies_text,
               "comma list of default (the worker's default), lru, lfu, lfru, coordinator, belady, best-static "
               "(the best fixed set per layer in hindsight), best-static-cold (that set, each member only after its first use), best-so-far (each run, the most used of "
               "the runs before, copies free), belady-prefetch (future known, prefetch over the link), "
               "oracle (the bound: free prefetch of each step's best C)");
  flags.Double("step-ms", &step_ms, "device time of one trace step, all layers (attention, hits), without the CPU's\n"
              "      misses, which the model adds; the coordinator's time constants run on the modelled clock");
  flags.Double("dram-gbps", &dram_gbps, "CPU expert weight streaming rate, GB/s: a missed expert costs expert bytes / this\n"
              "      (default: oneDNN AMX on the GPU host, 94 GB/s of weights)");
  flags.Double("cpu-tflops", &cpu_tflops, "CPU bf16 rate, TFLOP/s: a missed pair costs 2 * expert params / this");
  flags.Double("pair-us", &pair_us, "CPU cost of one missed (token, expert) pair, us; < 0: from --cpu-tflops");
  flags.Int("expert-bytes", &expert_bytes, "bytes of one expert copy (default: a DeepSeek-V3 expert, bf16)");
  flags.Double("pcie-gbps", &pcie_gbps, "host->GPU copy bandwidth, GB/s (copies are serialised); 0: instant copies");
  flags.Double("shared-gbps", &shared_gbps,
               "host DRAM read by the CPU and the copy engine at once, GB/s: while a copy runs the CPU's misses\n"
               "      stream min(dram, this - pcie) (default: the GPU host, the median of moe_layer's measurements);\n"
               "      <= --dram-gbps: every byte a copy reads is taken from the CPU");
  std::string rates_path;
  flags.String("rates", &rates_path,
               "rates measured on a machine (bench/moe_layer --rates-out FILE): its DRAM and link rates and the\n"
               "      CPU time of one expert per rows, scaled to --expert-bytes, replace --dram-gbps, --pcie-gbps,\n"
               "      --shared-gbps (when the file has it) and the per-pair cost: the step model prices as moe_layer's\n"
               "      floor does");
  flags.Double("lfru-half-life", &c.lfru_half_life, "LFRU decay half-life in accesses of a layer (ExpertCache's)");
  flags.Bool("warm", &c.warm,
             "start the policies that run a cache (default, lru, lfu, lfru, coordinator, belady-prefetch) from each layer's "
             "best fixed set, as moe_layer's warm placement does, instead of an empty cache");
  flags.Double("heartbeat-ms", &heartbeat_ms, "coordinator: counts reach it once per heartbeat");
  flags.Double("half-life-seconds", &c.policy.half_life_seconds, "coordinator: popularity half-life");
  flags.Double("rebalance-interval-seconds", &c.policy.rebalance_interval_seconds, "coordinator: placement period");
  flags.Double("copy-budget-gbps", &c.policy.copy_budget_gbps, "coordinator: PCIe share of a round; <= 0 unlimited");
  flags.Double("hysteresis-margin", &c.policy.hysteresis_margin, "coordinator: relative margin");
  flags.Double("copy-cost-hits", &c.policy.copy_cost_hits, "coordinator: cost of a copy in hits");
  flags.String("placement", &placement, "coordinator: per-worker or union (one worker here: the same but replication)");
  flags.Bool("per-layer", &per_layer, "also print every layer's hit rates");
  int64_t batch = 1;
  flags.Int("batch", &batch,
            "replay the trace as this many sequences decoded together (continuous batching): step s holds the\n"
            "      trace's steps s + j * (steps / batch), j < batch; 1: as recorded");
  flags.Parse(argc, argv);
  if (trace_path.empty()) flags.Fail("--trace is required (see --help)");
  if (absl::Status s = moe::ParsePlacementMode(placement, &c.policy.placement); !s.ok())
    flags.Fail(std::string(s.message()));
  if (!(step_ms > 0)) flags.Fail("--step-ms must be > 0");
  if (expert_bytes <= 0) flags.Fail("--expert-bytes must be > 0");
  if (!(pcie_gbps >= 0)) flags.Fail("--pcie-gbps must be >= 0");
  if (!(dram_gbps > 0)) flags.Fail("--dram-gbps must be > 0");
  if (!(shared_gbps > 0)) flags.Fail("--shared-gbps must be > 0");
  if (!(cpu_tflops > 0)) flags.Fail("--cpu-tflops must be > 0");
  std::vector<std::string> policies = absl::StrSplit(policies_text, ',', absl::SkipEmpty());
  if (policies.empty()) flags.Fail("--policies: empty");
  for (const std::string& p : policies) {
    const auto& known = moe::ReplayPolicies();
    if (std::find(known.begin(), known.end(), p) == known.end())
      flags.Fail("--policies: unknown policy '" + p + "' (known: " + absl::StrJoin(known, ",") + ")");
  }

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<moe::RoutingTrace> trace = moe::ReadRoutingTrace(trace_path);
  if (!trace.ok()) flags.Fail(std::string(trace.status().message()), 1);
  if (batch != 1) {
    if (batch < 1 || batch > static_cast<int64_t>(trace->steps.size()))
      flags.Fail("--batch must be in [1, " + std::to_string(trace->steps.size()) + "] (the trace's steps)");
    trace = moe::InterleaveSequences(*trace, static_cast<int>(batch));
    if (!trace.ok()) flags.Fail(std::string(trace.status().message()), 1);
  }
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
  c.dram_bytes_per_second = dram_gbps * 1e9;
  c.shared_bytes_per_second = shared_gbps * 1e9;
  c.pair_seconds = pair_us >= 0 ? pair_us * 1e-6 : 2.0 * (double(expert_bytes) / 2.0) / (cpu_tflops * 1e12);
  if (!rates_path.empty()) {
    if (absl::Status st = moe::LoadRates(rates_path, c.expert_bytes, &c); !st.ok()) flags.Fail(std::string(st.message()));
    dram_gbps = c.dram_bytes_per_second / 1e9;
    pcie_gbps = c.pcie_bytes_per_second / 1e9;
    shared_gbps = c.shared_bytes_per_second / 1e9;
  }

  uint64_t pairs = 0;
  for (int l = 0; l < t.num_layers; ++l) pairs += t.Pairs(l);
  // Pairs of each (layer, expert)'s first step: a policy that starts empty
  // misses them unless it guesses (best-static starts with its set resident).
  uint64_t first_pairs = 0;
  {
    std::vector<bool> seen(static_cast<size_t>(t.num_layers) * t.num_experts, false);
    for (const auto& step : t.steps)
      for (int l = 0; l < t.num_layers; ++l)
        for (const moe::ExpertAccess& a : step[l])
          if (!seen[static_cast<size_t>(l) * t.num_experts + a.expert]) {
            seen[static_cast<size_t>(l) * t.num_experts + a.expert] = true;
            first_pairs += a.pairs;
          }
  }
  std::printf("trace: %s\n", t.source.c_str());
  std::printf("  %zu steps x %d layers, %d experts, top-%d, %llu pairs (%.1f per step and layer); read in %.1f s\n",
              t.steps.size(), t.num_layers, t.num_experts, t.top_k, static_cast<unsigned long long>(pairs),
              double(pairs) / t.steps.size() / t.num_layers, read_s);
  std::printf("  first uses of each layer's experts: %.1f%% of the pairs (a policy that starts empty misses them)\n",
              pairs ? 100.0 * double(first_pairs) / double(pairs) : 0.0);
  const moe::StepTimeModel model = moe::ReplayTimeModel(c);
  std::printf("cache: %d of %d experts per layer (%.0f%%); device step %g ms; copies of %.1f MB at %g GB/s, while one\n"
              "runs the CPU's misses lose %.0f%% of their pace (DRAM shared at %g GB/s);\n"
              "misses on the CPU: %.3f ms per expert (%g GB/s)",
              c.slots, t.num_experts, 100.0 * c.slots / t.num_experts, step_ms, expert_bytes / 1e6, pcie_gbps,
              100 * model.CopyCpuShare(), shared_gbps, expert_bytes / (dram_gbps * 1e9) * 1e3, dram_gbps);
  if (c.cpu_expert_curve.empty()) std::printf(", %.2f us per pair\n", c.pair_seconds * 1e6);
  if (!c.cpu_expert_curve.empty()) {
    std::printf("\n");
    std::printf("CPU per missed expert (from %s, scaled to these experts): ", rates_path.c_str());
    for (const auto& [m, sec] : c.cpu_expert_curve) std::printf("%d pairs %.3f ms; ", m, sec * 1e3);
    std::printf("at least the DRAM time above\n");
  }
  std::printf("coordinator: %s, half-life %g s, rebalance every %g s, copy budget %g GB/s, hysteresis margin %g, "
              "copy cost %g hits, heartbeat %g ms\n\n",
              moe::PlacementModeName(c.policy.placement), c.policy.half_life_seconds,
              c.policy.rebalance_interval_seconds, c.policy.copy_budget_gbps, c.policy.hysteresis_margin,
              c.policy.copy_cost_hits, heartbeat_ms);

  std::vector<moe::PolicyResult> results;
  for (const std::string& p : policies) {
    const auto s0 = std::chrono::steady_clock::now();
    absl::StatusOr<moe::PolicyResult> r = moe::Replay(t, c, p);
    if (!r.ok()) flags.Fail(std::string(r.status().message()), 1);
    r->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    results.push_back(*std::move(r));
  }
  // Distances are to the oracle, the bound (when in --policies).
  const moe::PolicyResult* ref = nullptr;
  for (const auto& r : results)
    if (r.name == "oracle") ref = &r;
  const std::string ref_name = ref ? "vs " + ref->name : "vs -";
  const double steps = static_cast<double>(t.steps.size());
  std::printf("%-12s %9s %10s %9s %9s %10s %11s %9s %7s %8s %8s\n", "policy", "hit rate", ref_name.c_str(), "step ms",
              ref_name.c_str(), "copies", "copied", "pred prec", "recall", "replay", "plan us");
  for (const auto& r : results) {
    const std::string step = r.model_seconds >= 0 ? absl::StrFormat("%.2f", 1e3 * r.model_seconds / steps) : "-";
    const std::string step_vs = r.model_seconds >= 0 && ref && ref->model_seconds > 0
                                    ? absl::StrFormat("%.2fx", r.model_seconds / ref->model_seconds)
                                    : "-";
    std::printf("%-12s %8.1f%% %10s %9s %9s %10llu %8.1f GB %9s %7s %7.2fs %8s\n", r.name.c_str(), 100 * r.Rate(),
                ref ? absl::StrFormat("%+.1f", 100 * (r.Rate() - ref->Rate())).c_str() : "-",
                step.c_str(), step_vs.c_str(), static_cast<unsigned long long>(r.copies),
                double(r.copies) * expert_bytes / 1e9,
                r.precision >= 0 ? absl::StrFormat("%.1f%%", 100 * r.precision).c_str() : "-",
                r.recall >= 0 ? absl::StrFormat("%.1f%%", 100 * r.recall).c_str() : "-", r.seconds,
                r.plan_us_per_run >= 0 ? absl::StrFormat("%.1f", r.plan_us_per_run).c_str() : "-");
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
  // A policy that beats the bound is a bug in the bound (or in the replay).
  std::vector<std::string> beaten;
  for (const auto& r : results) {
    if (ref == nullptr || &r == ref) continue;
    if (r.TotalHits() > ref->TotalHits() ||
        (r.model_seconds >= 0 && r.model_seconds < ref->model_seconds * (1 - 1e-9)))
      beaten.push_back(r.name);
  }
  if (!beaten.empty()) {
    std::fprintf(stderr, "cache_replay: %s beat%s the oracle, which bounds every policy: a bug in the bound\n",
                 absl::StrJoin(beaten, ", ").c_str(), beaten.size() == 1 ? "s" : "");
    return 3;
  }
  return 0;
}
