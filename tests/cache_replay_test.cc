// The cache replay's offline optimum (bench/belady.h) on hand-checkable
// traces and against an exhaustive search, and the trace reader/generator.
#include <fstream>
#include <iterator>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "bench/belady.h"
#include "bench/model/step_time_model.h"
#include "bench/replay.h"
#include "testing/routing_trace.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace moe {
namespace {

using Steps = std::vector<std::vector<ExpertAccess>>;

Steps Unit(const std::vector<std::vector<int>>& ids) {
  Steps s;
  for (const auto& step : ids) {
    s.emplace_back();
    for (int e : step) s.back().push_back({e, 1});
  }
  return s;
}

TEST(Belady, HandCheckedUnitTraces) {
  // One slot, A B A B A: keep A (A's reuses are the hits), 2 hits.
  OfflineResult r = BeladyOptimum(Unit({{0}, {1}, {0}, {1}, {0}}), 2, 1);
  EXPECT_EQ(r.hits, 2u);
  EXPECT_EQ(r.pairs, 5u);
  EXPECT_EQ(r.copies, 1u);
  // Two slots, classic MIN example a b c a b d a: evict the one needed furthest ahead.
  // a b (cold), c: bypass (c never reused); a hit, b hit, d bypass, a hit -> 3 hits.
  r = BeladyOptimum(Unit({{0}, {1}, {2}, {0}, {1}, {3}, {0}}), 4, 2);
  EXPECT_EQ(r.hits, 3u);
  EXPECT_EQ(r.copies, 2u);
  // A step touching both experts with one slot: at most one of them per later step.
  r = BeladyOptimum(Unit({{0, 1}, {0, 1}, {0, 1}}), 2, 1);
  EXPECT_EQ(r.hits, 2u);
  // No slots, no hits; enough slots, every reuse hits.
  EXPECT_EQ(BeladyOptimum(Unit({{0}, {0}}), 1, 0).hits, 0u);
  EXPECT_EQ(BeladyOptimum(Unit({{0, 1}, {1, 0}, {0}, {1}}), 2, 2).hits, 4u);
}

TEST(Belady, WeightsFavourTheHeavierReuse) {
  // One slot. A and B both reappear at step 2: A with 1 pair, B with 5.
  Steps s = {{{0, 1}, {1, 1}}, {{0, 1}, {1, 5}}};
  EXPECT_EQ(BeladyOptimum(s, 2, 1).hits, 5u);
  // MIN's rule (furthest next use) would keep B here and lose 10 pairs of A.
  s = {{{0, 1}, {1, 1}}, {{1, 1}}, {{0, 10}}};
  EXPECT_EQ(BeladyOptimum(s, 2, 1).hits, 10u);
}

// Exact optimum by dynamic programming over cache states (tiny sizes only).
uint64_t Exhaustive(const Steps& steps, int num_experts, int slots) {
  std::map<uint32_t, uint64_t> best = {{0u, 0u}};
  for (const auto& step : steps) {
    uint32_t touched = 0;
    std::map<uint32_t, uint64_t> next;
    for (const ExpertAccess& a : step) touched |= 1u << a.expert;
    for (auto [state, value] : best) {
      uint64_t v = value;
      for (const ExpertAccess& a : step) v += (state >> a.expert & 1u) ? a.pairs : 0;
      // Next state: any subset of (state | touched) with at most `slots` experts.
      const uint32_t pool = state | touched;
      for (uint32_t sub = pool;; sub = (sub - 1) & pool) {
        if (__builtin_popcount(sub) <= slots) next[sub] = std::max(next[sub], v);
        if (sub == 0) break;
      }
    }
    best.swap(next);
  }
  uint64_t out = 0;
  for (auto [s, v] : best) out = std::max(out, v);
  (void)num_experts;
  return out;
}

TEST(Belady, MatchesExhaustiveSearchOnRandomSmallTraces) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int experts = 2 + static_cast<int>(rng() % 4), slots = 1 + static_cast<int>(rng() % 3);
    const int n = 1 + static_cast<int>(rng() % 9);
    Steps steps(n);
    for (auto& step : steps) {
      for (int e = 0; e < experts; ++e) {
        if (rng() % 2) step.push_back({e, 1 + static_cast<int>(rng() % 5)});
      }
    }
    ASSERT_EQ(BeladyOptimum(steps, experts, slots).hits, Exhaustive(steps, experts, slots))
        << "trial " << trial << " experts " << experts << " slots " << slots;
  }
}

TEST(RoutingTrace, SyntheticRoundTripAndRecordedFormat) {
  testing::TempDir dir;
  SyntheticTraceOptions o;
  o.num_layers = 3;
  o.num_experts = 16;
  o.top_k = 2;
  o.tokens_per_step = 5;
  o.steps = 40;
  const std::string path = dir.path() + "/t.jsonl";
  ASSERT_TRUE(WriteSyntheticTrace(o, path).ok());
  absl::StatusOr<RoutingTrace> t = ReadRoutingTrace(path);
  ASSERT_TRUE(t.ok()) << t.status();
  const RoutingTrace mem = GenerateRoutingTrace(o);
  ASSERT_EQ(t->steps.size(), 40u);
  EXPECT_EQ(t->num_layers, 3);
  EXPECT_EQ(t->num_experts, 16);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(t->Pairs(l), 40u * 5 * 2);
  for (size_t s = 0; s < mem.steps.size(); ++s) {
    for (int l = 0; l < 3; ++l) {
      ASSERT_EQ(t->steps[s][l].size(), mem.steps[s][l].size());
      for (size_t i = 0; i < mem.steps[s][l].size(); ++i) {
        EXPECT_EQ(t->steps[s][l][i].expert, mem.steps[s][l][i].expert);
        EXPECT_EQ(t->steps[s][l][i].pairs, mem.steps[s][l][i].pairs);
      }
      // Per token too: 5 tokens x top-2, the same ids as generated.
      ASSERT_EQ(t->tokens[s][l].size(), 10u);
      EXPECT_EQ(t->tokens[s][l], mem.tokens[s][l]);
    }
  }
  // Compressed (liblzma): the same trace back; a damaged stream is an error.
  const std::string xz = dir.path() + "/t.jsonl.xz";
  ASSERT_TRUE(WriteSyntheticTrace(o, xz).ok());
  absl::StatusOr<RoutingTrace> tx = ReadRoutingTrace(xz);
  ASSERT_TRUE(tx.ok()) << tx.status();
  ASSERT_EQ(tx->steps.size(), t->steps.size());
  for (size_t s = 0; s < mem.steps.size(); ++s)
    for (int l = 0; l < 3; ++l) EXPECT_EQ(tx->tokens[s][l], mem.tokens[s][l]);
  {
    std::string bytes;
    {
      std::ifstream in(xz, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    ASSERT_GT(bytes.size(), 64u);
    bytes[bytes.size() / 2] ^= 0x5a;
    std::ofstream(xz, std::ios::binary) << bytes;
    EXPECT_FALSE(ReadRoutingTrace(xz).ok());
  }
  // Recorded vLLM routing: one record per (problem, layer, token).
  const std::string rec = dir.path() + "/r.jsonl";
  std::ofstream(rec) << "{\"problem_id\":1,\"layer\":0,\"experts\":[3,1],\"token_idx\":0}\n"
                        "{\"problem_id\":0,\"layer\":1,\"experts\":[2,2],\"token_idx\":1}\n"
                        "{\"problem_id\":0,\"layer\":0,\"experts\":[7,1],\"token_idx\":0}\n";
  t = ReadRoutingTrace(rec);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->num_layers, 2);
  EXPECT_EQ(t->num_experts, 8);
  ASSERT_EQ(t->steps.size(), 3u);  // (0,0), (0,1), (1,0)
  EXPECT_EQ(t->steps[0][0].size(), 2u);
  EXPECT_EQ(t->steps[1][1][0].pairs, 2);
  EXPECT_EQ(t->steps[2][0][0].expert, 1);
  EXPECT_EQ(t->tokens[0][0], (std::vector<int16_t>{7, 1}));  // one token, its ids in order
  EXPECT_TRUE(t->tokens[0][1].empty());                     // no record for layer 1 at (0, 0)
  std::ofstream(rec) << "{\"nonsense\": 1}\n";
  EXPECT_FALSE(ReadRoutingTrace(rec).ok());
  EXPECT_FALSE(ReadRoutingTrace(dir.path() + "/missing.jsonl").ok());
}

// A batch-1 trace as sequences decoded together: step s holds the steps
// s + j * (S / batch), their tokens in that order and their accesses merged.
TEST(RoutingTrace, InterleavedSequencesMergeStepsAStrideApart) {
  RoutingTrace t;
  t.num_layers = 1;
  t.num_experts = 4;
  t.top_k = 2;
  const std::vector<std::vector<int16_t>> ids = {{0, 1}, {1, 2}, {3, 0}, {2, 3}, {0, 1}};
  for (const auto& row : ids) {
    t.steps.push_back({{{std::min(row[0], row[1]), 1}, {std::max(row[0], row[1]), 1}}});
    t.tokens.push_back({row});
  }
  absl::StatusOr<RoutingTrace> b = InterleaveSequences(t, 2);  // stride 5 / 2 = 2
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->steps.size(), 5u);
  EXPECT_EQ(b->Pairs(0), 2 * t.Pairs(0));
  // Step 1: steps 1 and 3, tokens {1,2} then {2,3}; expert 2 twice.
  EXPECT_EQ(b->tokens[1][0], (std::vector<int16_t>{1, 2, 2, 3}));
  ASSERT_EQ(b->steps[1][0].size(), 3u);
  EXPECT_EQ(b->steps[1][0][0].expert, 1);
  EXPECT_EQ(b->steps[1][0][1].expert, 2);
  EXPECT_EQ(b->steps[1][0][1].pairs, 2);
  EXPECT_EQ(b->steps[1][0][2].expert, 3);
  // Step 4 wraps: steps 4 and 1.
  EXPECT_EQ(b->tokens[4][0], (std::vector<int16_t>{0, 1, 1, 2}));
  // Batch 1 is the trace itself; out of range is refused, naming the field.
  absl::StatusOr<RoutingTrace> one = InterleaveSequences(t, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->tokens, t.tokens);
  for (int bad : {0, 6}) {
    absl::StatusOr<RoutingTrace> r = InterleaveSequences(t, bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("batch"), std::string::npos) << r.status();
  }
}

// The oracle bounds every policy: on random drifting traces (several seeds,
// batch sizes, cache sizes, copy speeds, CPU curves that do and do not grow
// with the pairs) no policy hits more pairs than it, nor models a shorter run
// of the trace.
TEST(Replay, OracleBoundsEveryPolicyOnRandomTraces) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 6; ++trial) {
    SyntheticTraceOptions o;
    o.num_layers = 2 + static_cast<int>(rng() % 3);
    o.num_experts = 8 + static_cast<int>(rng() % 9);
    o.top_k = 1 + static_cast<int>(rng() % 3);
    o.tokens_per_step = 1 + static_cast<int>(rng() % 6);
    o.steps = 120;
    o.drift_every = 10 + static_cast<int>(rng() % 30);
    o.burst_rate = 0.05;
    o.seed = rng();
    const RoutingTrace t = GenerateRoutingTrace(o);
    ReplayConfig c;
    c.slots = 1 + static_cast<int>(rng() % (o.num_experts / 2));
    c.expert_bytes = 1u << 20;
    c.step_seconds = 1e-3 * (1 + rng() % 50);
    c.pcie_bytes_per_second = (trial % 3 == 0) ? 0.0 : 1e9 * (1 + rng() % 60);
    c.dram_bytes_per_second = 94e9;
    c.pair_seconds = 1e-6;
    if (trial % 2 == 1)  // measured curves are noisy: 3 pairs cost less than 2 here
      c.cpu_expert_curve = {{1, 40e-6}, {2, 90e-6}, {3, 50e-6}, {8, 120e-6}};
    absl::StatusOr<PolicyResult> ceiling = Replay(t, c, "oracle");
    ASSERT_TRUE(ceiling.ok()) << ceiling.status();
    for (const std::string& name : ReplayPolicies()) {
      absl::StatusOr<PolicyResult> r = Replay(t, c, name);
      ASSERT_TRUE(r.ok()) << name << ": " << r.status();
      EXPECT_EQ(r->TotalPairs(), ceiling->TotalPairs()) << name;
      EXPECT_LE(r->TotalHits(), ceiling->TotalHits()) << name << " trial " << trial;
      if (r->model_seconds >= 0) {
        EXPECT_GE(r->model_seconds, ceiling->model_seconds * (1 - 1e-12)) << name;
      }
    }
  }
  EXPECT_EQ(Replay(GenerateRoutingTrace({}), ReplayConfig{}, "fifo").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Recorded routing (../shared/data/traces): the worker's default beats every
// baseline by hit rate and modelled step time at 25% cache, 100 ms steps.
TEST(Replay, DefaultBeatsBaselinesOnRecordedOlmoeTrace) {
  const std::string path = std::string(MOE_SOURCE_DIR) + "/../shared/data/traces/olmoe-1b-7b-decode.jsonl.xz";
  if (!std::ifstream(path).good()) GTEST_SKIP() << "trace not found: " << path;
  absl::StatusOr<RoutingTrace> t = ReadRoutingTrace(path);
  ASSERT_TRUE(t.ok()) << t.status();
  ReplayConfig c;
  c.slots = t->num_experts / 4;
  c.expert_bytes = 12582912;
  c.step_seconds = 0.1;
  c.pair_seconds = 2.0 * (c.expert_bytes / 2.0) / 4.6e12;
  absl::StatusOr<PolicyResult> def = Replay(*t, c, "default");
  ASSERT_TRUE(def.ok()) << def.status();
  for (const std::string name : {"lru", "lfu", "lfru", "coordinator", "best-static"}) {
    absl::StatusOr<PolicyResult> r = Replay(*t, c, name);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GE(def->Rate(), r->Rate()) << name;
    EXPECT_LE(def->model_seconds, r->model_seconds) << name;
  }
}

// best-static-cold holds the same set as best-static, each member only after
// the step that first used it: on a trace whose steps use experts 0, 1, 0, 1,
// ... (one slot) best-static holds 0 from the start; cold misses step 0 too.
// One layer of 4 experts, one pair per step, of `experts` in order; replayed
// with one slot.
RoutingTrace OneLayerTrace(const std::vector<int>& experts) {
  RoutingTrace t;
  t.num_layers = 1;
  t.num_experts = 4;
  t.top_k = 1;
  for (int e : experts) t.steps.push_back({{ExpertAccess{e, 1}}});
  return t;
}
ReplayConfig OneSlot() {
  ReplayConfig c;
  c.slots = 1;
  c.expert_bytes = 1000;
  return c;
}

TEST(Replay, BestStaticColdMissesEachMembersFirstUse) {
  const RoutingTrace t = OneLayerTrace({0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});  // expert 0: 6 uses, expert 1: 5
  const ReplayConfig c = OneSlot();
  absl::StatusOr<PolicyResult> hot = Replay(t, c, "best-static"), cold = Replay(t, c, "best-static-cold");
  ASSERT_TRUE(hot.ok() && cold.ok());
  EXPECT_EQ(hot->TotalHits(), 6u);
  EXPECT_EQ(cold->TotalHits(), 5u);  // step 0 is expert 0's first use
  EXPECT_EQ(cold->TotalPairs(), 11u);
  EXPECT_GT(cold->model_seconds, hot->model_seconds);
}

// best-so-far holds, at each run, the most used experts of the runs before it
// (ties: the lower id; nothing never used). One slot, uses 0 0 1 1 1 1 0:
// nothing at run 0, then 0 (hit at run 1), 0 still at runs 2-4 (1's count
// catches up with 0's 2 only after run 3, and the tie keeps 0), then 1 (hit
// at run 5; run 6 misses): 2 hits where best-static ({1}) has 4.
TEST(Replay, BestSoFarFollowsTheCountsOfTheRunsBefore) {
  const RoutingTrace t = OneLayerTrace({0, 0, 1, 1, 1, 1, 0});
  const ReplayConfig c = OneSlot();
  absl::StatusOr<PolicyResult> so_far = Replay(t, c, "best-so-far"), hindsight = Replay(t, c, "best-static");
  ASSERT_TRUE(so_far.ok() && hindsight.ok());
  EXPECT_EQ(so_far->TotalHits(), 2u);
  EXPECT_EQ(hindsight->TotalHits(), 4u);
  EXPECT_EQ(so_far->TotalPairs(), 7u);
}

// --warm: the policies that run a cache start from each layer's best fixed
// set, Ready. One slot, expert 0 used at every step: cold, lru and the
// default miss its first use (and the default may not have it at step 1
// either); warm, every pair hits from the first step. The trace is not
// changed, and the offline policies ignore the flag.
TEST(Replay, WarmStartsFromTheBestFixedSet) {
  RoutingTrace t;
  t.num_layers = 2;
  t.num_experts = 4;
  t.top_k = 1;
  for (int s = 0; s < 6; ++s) t.steps.push_back({{ExpertAccess{0, 1}}, {ExpertAccess{3, 1}}});
  ReplayConfig c;
  c.slots = 1;
  c.expert_bytes = 1000;
  for (const char* name : {"lru", "lfru", "default", "coordinator", "belady-prefetch"}) {
    c.warm = false;
    absl::StatusOr<PolicyResult> cold = Replay(t, c, name);
    c.warm = true;
    absl::StatusOr<PolicyResult> warm = Replay(t, c, name);
    ASSERT_TRUE(cold.ok() && warm.ok()) << name;
    EXPECT_LT(cold->TotalHits(), 12u) << name;
    EXPECT_EQ(warm->TotalHits(), 12u) << name;
    EXPECT_EQ(warm->TotalPairs(), 12u) << name;
  }
  c.warm = true;
  EXPECT_EQ(Replay(t, c, "best-static-cold")->TotalHits(), 10u);
}

// Rates measured by moe_layer drive the step model: the CPU curve is scaled to
// the trace's expert size, a missed expert costs at least its DRAM time, and a
// bad file is refused naming the field.
TEST(Replay, RatesFileDrivesTheStepModel) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/rates.json";
  std::ofstream(path) << R"({"dram_gbps": 100, "pcie_gbps": 50, "expert_bytes": 1000000,)"
                      << R"( "cpu_expert_seconds": [[1, 0.0001], [64, 0.001]]})";
  ReplayConfig c;
  ASSERT_TRUE(LoadRates(path, 2000000, &c).ok());
  EXPECT_DOUBLE_EQ(c.dram_bytes_per_second, 100e9);
  EXPECT_DOUBLE_EQ(c.pcie_bytes_per_second, 50e9);
  ASSERT_EQ(c.cpu_expert_curve.size(), 2u);
  EXPECT_DOUBLE_EQ(c.cpu_expert_curve[1].second, 0.002);  // twice the bytes, twice the time
  // A trace whose every step misses one expert with 64 pairs (no cache): each
  // layer run costs the device part plus the curve's 2 ms.
  RoutingTrace t;
  t.num_layers = 1;
  t.num_experts = 4;
  t.top_k = 1;
  t.steps.assign(10, {{ExpertAccess{1, 64}}});
  c.slots = 0;
  c.expert_bytes = 2000000;
  c.step_seconds = 0.01;
  absl::StatusOr<PolicyResult> r = Replay(t, c, "best-static");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->model_seconds, 10 * (0.01 + 0.002), 1e-9);
  std::ofstream(path) << R"({"dram_gbps": 100, "expert_bytes": 1000000, "cpu_expert_seconds": [[1, 0.0001]]})";
  absl::Status bad = LoadRates(path, 1, &c);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("pcie_gbps"), std::string::npos) << bad;
  std::ofstream(path) << R"({"dram_gbps": 1, "pcie_gbps": 1, "expert_bytes": 1, "cpu_expert_seconds": [[4, 1], [2, 1]]})";
  EXPECT_FALSE(LoadRates(path, 1, &c).ok());
  // The shared DRAM rate: read when the file has it, left as it was when not.
  std::ofstream(path) << R"({"dram_gbps": 100, "pcie_gbps": 50, "shared_gbps": 120, "expert_bytes": 1,)"
                      << R"( "cpu_expert_seconds": [[1, 0.001]]})";
  ASSERT_TRUE(LoadRates(path, 1, &c).ok());
  EXPECT_DOUBLE_EQ(c.shared_bytes_per_second, 120e9);
  std::ofstream(path) << R"({"dram_gbps": 100, "pcie_gbps": 50, "shared_gbps": -3, "expert_bytes": 1,)"
                      << R"( "cpu_expert_seconds": [[1, 0.001]]})";
  bad = LoadRates(path, 1, &c);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("shared_gbps"), std::string::npos) << bad;
}

// While the link copies, the CPU's misses stream min(dram, shared - pcie):
// they lose (dram + pcie - shared) / dram of their pace, between nothing
// (DRAM serves both in full) and pcie / dram (every byte of the copy taken
// from the CPU, the bound without a measurement).
TEST(StepTimeModel, CopiesSlowTheCpuOnlyBeyondTheSharedDramRate) {
  StepTimeModel m;
  m.dram_bytes_per_second = 100e9;
  m.pcie_bytes_per_second = 50e9;
  const double device = 0.001, cpu = 0.004;
  m.shared_bytes_per_second = 100e9;  // no headroom: the copy's bytes all come from the CPU
  EXPECT_DOUBLE_EQ(m.CopyCpuShare(), 0.5);
  EXPECT_DOUBLE_EQ(m.LayerSecondsFromCpu(device, cpu, 0.002), device + cpu + 0.002 * 0.5);
  EXPECT_DOUBLE_EQ(m.LayerSecondsFromCpu(device, cpu, 0.010), device + cpu + cpu * 0.5);  // overlap <= the CPU work
  m.shared_bytes_per_second = 80e9;  // below the CPU alone: the same bound
  EXPECT_DOUBLE_EQ(m.CopyCpuShare(), 0.5);
  m.shared_bytes_per_second = 125e9;
  EXPECT_DOUBLE_EQ(m.CopyCpuShare(), 0.25);
  EXPECT_DOUBLE_EQ(m.LayerSecondsFromCpu(device, cpu, 0.002), device + cpu + 0.002 * 0.25);
  m.shared_bytes_per_second = 200e9;  // room for both
  EXPECT_DOUBLE_EQ(m.CopyCpuShare(), 0.0);
  EXPECT_DOUBLE_EQ(m.LayerSecondsFromCpu(device, cpu, 0.002), device + cpu);
  EXPECT_DOUBLE_EQ(m.LayerSecondsFromCpu(device, 0, 0.002), device);  // no CPU work, nothing lost
  m.pcie_bytes_per_second = 0;  // instant copies
  EXPECT_DOUBLE_EQ(m.CopyCpuShare(), 0.0);
}

// The replay prices copies with the same share: LRU on a trace that misses
// every run (a new expert each run, one slot, so every run starts a copy) is
// charged less CPU time the more DRAM the CPU and the copy engine share.
TEST(Replay, SharedDramRateSetsWhatCopiesCostTheCpu) {
  RoutingTrace t;
  t.num_layers = 1;
  t.num_experts = 20;
  t.top_k = 1;
  for (int s = 0; s < 20; ++s) t.steps.push_back({{ExpertAccess{s, 1}}});
  ReplayConfig c;
  c.slots = 1;
  c.expert_bytes = 100000000;
  c.dram_bytes_per_second = 100e9;
  double last = 0;
  c.pcie_bytes_per_second = 50e9;
  c.step_seconds = 0.0005;
  for (double shared : {100e9, 125e9, 150e9}) {
    c.shared_bytes_per_second = shared;
    absl::StatusOr<PolicyResult> r = Replay(t, c, "lru");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->TotalHits(), 0u);
    // 20 runs: the device part and one missed expert's DRAM time each, plus the share of the overlap.
    const double floor = 20 * (c.step_seconds + 0.001);
    EXPECT_GE(r->model_seconds, floor - 1e-12);
    if (shared >= 150e9) {
      EXPECT_NEAR(r->model_seconds, floor, 1e-12);
    }
    if (last > 0) {
      EXPECT_LT(r->model_seconds, last);
    }
    last = r->model_seconds;
  }
}

}  // namespace
}  // namespace moe
