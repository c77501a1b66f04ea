// PlanMisses: the hit / server / copy-instead split of one layer call, with no
// server, backend or transport — hits grouped by expert with their buffers,
// misses batched per server by the experts each hosts, drained servers
// skipped, copies when no server can take an expert (or an error when the
// worker cannot copy), the copy modes and the auto thresholds, unused slots.
#include "gpu_worker/miss_plan.h"
#include "gpu_worker/planner.h"
#include "gpu_worker/expert_cache.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe {
namespace {

constexpr int kE = 8;

// A routing, a slot map and servers, owned, for one plan.
struct Case {
  int n = 0, k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<int32_t> slot_buffer = std::vector<int32_t>(kE, -1);
  std::vector<std::vector<bool>> hosts;
  std::vector<PlanServer> servers;
  CostModel cost;
  MissPlanInput in;

  Case(int n_, int k_, std::vector<int32_t> ids_) : n(n_), k(k_), ids(std::move(ids_)) {
    for (size_t i = 0; i < ids.size(); ++i) weights.push_back(0.1f * static_cast<float>(i + 1));
  }
  // A server hosting `experts` (empty: all), up or drained, batches of `chunk` tokens.
  void AddServer(std::vector<int> experts, bool up = true, int chunk = 64) {
    std::vector<bool> h(kE, experts.empty());
    for (int e : experts) h[e] = true;
    hosts.push_back(h);
    servers.push_back(PlanServer{up, nullptr, chunk, ExpertSlice{}});
  }
  MissPlanInput& Input() {
    for (size_t s = 0; s < servers.size(); ++s) servers[s].hosts = &hosts[s];
    in.layer = 3;
    in.routing = RoutingView{n, k, ids.data(), weights.data()};
    in.num_experts = kE;
    in.slot_buffer = slot_buffer.data();
    in.servers = servers.data();
    in.num_servers = static_cast<int>(servers.size());
    return in;
  }
  absl::Status Plan(MissPlan* p) { return PlanMisses(Input(), p); }
};

// The (token, weight) rows of group g, padding skipped.
std::vector<std::pair<int, float>> Rows(const ExpertGroups& g, int group) {
  std::vector<std::pair<int, float>> rows;
  for (int r = g.row_begin[group]; r < g.row_begin[group] + g.count[group]; ++r)
    if (g.token[r] >= 0) rows.emplace_back(g.token[r], g.weight[r]);
  return rows;
}

TEST(MissPlanTest, AllHitsAreGroupedByExpertWithTheirBuffers) {
  // 3 tokens x top-2 over experts 1, 4, 6 (all cached).
  Case s(3, 2, {4, 1, 1, 6, 4, 6});
  s.slot_buffer[1] = 10;
  s.slot_buffer[4] = 11;
  s.slot_buffer[6] = 12;
  s.AddServer({});
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_TRUE(p.batches.empty());
  EXPECT_TRUE(p.copy_experts.empty());
  EXPECT_TRUE(p.missed.empty());
  EXPECT_EQ(p.accessed, (std::vector<int>{1, 4, 6}));
  ASSERT_EQ(p.hits.num_groups(), 3);
  EXPECT_EQ(p.hits.expert, (std::vector<int32_t>{1, 4, 6}));
  EXPECT_EQ(p.hit_buffer, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(Rows(p.hits, 0), (std::vector<std::pair<int, float>>{{0, 0.2f}, {1, 0.3f}}));
  EXPECT_EQ(Rows(p.hits, 1), (std::vector<std::pair<int, float>>{{0, 0.1f}, {2, 0.5f}}));
  EXPECT_EQ(Rows(p.hits, 2), (std::vector<std::pair<int, float>>{{1, 0.4f}, {2, 0.6f}}));
  const HitPlan hp = p.hit_plan();
  EXPECT_EQ(hp.groups, &p.hits);
  EXPECT_EQ(hp.buffer, p.hit_buffer.data());
  EXPECT_EQ(p.hit_pairs[4], 2);
  EXPECT_EQ(p.miss_pairs[4], 0);
}

TEST(MissPlanTest, HitGroupsStartOnTheBackendsRowAlignment) {
  Case s(3, 1, {2, 2, 5});
  s.slot_buffer[2] = 0;
  s.slot_buffer[5] = 1;
  s.AddServer({});
  MissPlan p;
  s.in.hit_row_align = 16;  // e.g. the AMX kernel's row block
  ASSERT_TRUE(s.Plan(&p).ok());
  ASSERT_EQ(p.hits.num_groups(), 2);
  EXPECT_EQ(p.hits.row_begin, (std::vector<int32_t>{0, 16}));
  EXPECT_EQ(p.hits.count, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(p.hits.total_pairs, 3);
}

TEST(MissPlanTest, AllMissesGoToOneServerInItsBatches) {
  Case s(5, 2, {0, 3, 3, -1, 0, -1, 5, 0, 3, 5});
  s.AddServer({}, true, /*chunk=*/2);
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.hits.num_groups(), 0);
  EXPECT_EQ(p.missed, (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(p.cpu_experts, 3);
  ASSERT_EQ(p.batches.size(), 3u);  // 5 tokens in batches of 2
  EXPECT_EQ(p.batches[0].rows, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(p.batches[1].rows, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(p.batches[2].rows, (std::vector<int32_t>{4}));
  for (const ServerBatch& b : p.batches) {
    EXPECT_EQ(b.server, 0);
    EXPECT_EQ(b.k, 2);
  }
  // The batch routing is the call's, row for row.
  EXPECT_EQ(p.batches[0].ids, (std::vector<int32_t>{0, 3, 3, -1}));
  EXPECT_EQ(p.batches[0].weights, (std::vector<float>{0.1f, 0.2f, 0.3f, 0.0f}));
  EXPECT_EQ(p.batches[1].ids, (std::vector<int32_t>{0, -1, 5, 0}));
  EXPECT_EQ(p.batches[1].experts, 2);
  EXPECT_EQ(p.batches[1].pairs, 3);
  EXPECT_EQ(p.batches[2].ids, (std::vector<int32_t>{3, 5}));
}

TEST(MissPlanTest, ExpertsSplitAcrossServersByWhatTheyHost) {
  // Experts 0-3 on server 0, 4-7 on server 1; expert 2 is cached.
  Case s(3, 2, {1, 5, 2, 6, 7, 1});
  s.slot_buffer[2] = 9;
  s.AddServer({0, 1, 2, 3});
  s.AddServer({4, 5, 6, 7});
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  ASSERT_EQ(p.batches.size(), 2u);
  EXPECT_EQ(p.batches[0].server, 0);
  EXPECT_EQ(p.batches[0].rows, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(p.batches[0].ids, (std::vector<int32_t>{1, -1, -1, 1}));
  EXPECT_EQ(p.batches[1].server, 1);
  EXPECT_EQ(p.batches[1].rows, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(p.batches[1].ids, (std::vector<int32_t>{-1, 5, -1, 6, 7, -1}));
  ASSERT_EQ(p.hits.num_groups(), 1);
  EXPECT_EQ(Rows(p.hits, 0), (std::vector<std::pair<int, float>>{{1, 0.3f}}));
  // Both servers host everything: the layer's replica (ReplicaStart: layer 3 mod 2) takes it all, in one batch.
  Case t(2, 1, {1, 6});
  t.AddServer({});
  t.AddServer({});
  ASSERT_TRUE(t.Plan(&p).ok());
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].server, 1);
}

TEST(MissPlanTest, ADrainedServersExpertsGoToTheOtherOne) {
  Case s(2, 2, {1, 5, 5, 6});
  s.AddServer({}, /*up=*/false);
  s.AddServer({1, 5, 6});
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].server, 1);
  EXPECT_EQ(p.batches[0].pairs, 4);
  EXPECT_TRUE(p.copy_experts.empty());
}

TEST(MissPlanTest, AnExpertNoServerTakesIsCopiedOrFails) {
  // Expert 7 is hosted by no server that is up.
  Case s(2, 2, {1, 7, 7, -1});
  s.AddServer({1, 2});
  s.AddServer({7}, /*up=*/false);
  s.in.copy_mode = CopyMode::kNever;  // never: still copied, there is no other way
  s.in.can_copy = true;
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{7}));
  ASSERT_EQ(p.copies.num_groups(), 1);
  EXPECT_EQ(p.copy_group(7), 0);
  EXPECT_EQ(p.copy_group(1), -1);
  EXPECT_EQ(Rows(p.copies, 0), (std::vector<std::pair<int, float>>{{0, 0.2f}, {1, 0.3f}}));
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].ids, (std::vector<int32_t>{1, -1}));
  EXPECT_EQ(p.cpu_experts, 1);
  // Without host copies: Unavailable naming the expert and the layer.
  s.in.can_copy = false;
  const absl::Status st = s.Plan(&p);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_NE(st.message().find("expert 7 of layer 3"), absl::string_view::npos) << st;
}

// Measured rates where the CPU is slow and copies are cheap.
CostModel SlowCpuCheapCopies() {
  CostModel c;
  c.measured = true;
  c.copy_s = 1e-4;
  c.copy_device_fixed_s = 1e-5;
  c.copy_device_row_s = 1e-6;
  c.cpu_call_s = 1e-4;
  c.cpu_expert_s = 5e-3;
  c.cpu_pair_s = 1e-3;
  return c;
}

TEST(MissPlanTest, CopyModes) {
  Case s(4, 1, {2, 2, 2, 3});
  s.AddServer({});
  s.in.can_copy = true;
  MissPlan p;
  // never: everything to the server.
  s.in.copy_mode = CopyMode::kNever;
  s.in.copy_min_tokens = 1;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_TRUE(p.copy_experts.empty());
  EXPECT_EQ(p.cpu_experts, 2);
  // always: every miss copied, none shipped.
  s.in.copy_mode = CopyMode::kAlways;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{2, 3}));
  EXPECT_TRUE(p.batches.empty());
  EXPECT_EQ(p.cpu_experts, 0);
  // always without host copies: an error even with a server up.
  s.in.can_copy = false;
  EXPECT_TRUE(absl::IsUnavailable(s.Plan(&p)));
  s.in.can_copy = true;
  // auto with a token threshold: experts with at least 3 miss pairs.
  s.in.copy_mode = CopyMode::kAuto;
  s.in.copy_min_tokens = 3;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{2}));
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].rows, (std::vector<int32_t>{3}));
  // auto with neither threshold nor a measured model: nothing copied.
  s.in.copy_min_tokens = 0;
  s.in.cost = &s.cost;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_TRUE(p.copy_experts.empty());
  // auto with a model where the CPU is slow and copies are cheap: both
  // experts move to the device, the one with most rows first.
  s.cost = SlowCpuCheapCopies();
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{2, 3}));
  EXPECT_EQ(p.copies.expert, (std::vector<int32_t>{2, 3}));
  EXPECT_TRUE(p.batches.empty());
  // ... and a model where the CPU is much faster keeps both there.
  s.cost = CostModel();
  s.cost.measured = true;
  s.cost.copy_s = 1.0;
  s.cost.copy_device_fixed_s = 1.0;
  s.cost.cpu_expert_s = 1e-5;
  s.cost.cpu_pair_s = 1e-6;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_TRUE(p.copy_experts.empty());
  // auto without host copies: never copied.
  s.in.can_copy = false;
  s.in.copy_min_tokens = 1;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_TRUE(p.copy_experts.empty());
}

TEST(MissPlanTest, OutcomesOverruleTheModelsCopiesButNotForcedOnes) {
  Case s(4, 1, {2, 2, 2, 3});
  s.AddServer({0, 1, 2});  // expert 3: no server, always copied
  s.in.can_copy = true;
  s.in.copy_mode = CopyMode::kAuto;
  s.in.cost = &s.cost;
  // The model copies expert 2 too, a close call: 0.35 ms on the CPU against
  // 0.21 for its copy beside expert 3's (within kOutcomeRange).
  s.cost = SlowCpuCheapCopies();
  s.cost.cpu_expert_s = 1e-4;
  s.cost.cpu_pair_s = 5e-5;
  CopyOutcomes outcomes;
  s.in.outcomes = &outcomes;
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{3, 2}));
  const int bucket = CopyOutcomes::HostBucket(1, 3);
  EXPECT_EQ(p.outcome_bucket, bucket);
  EXPECT_EQ(p.outcome_choice, CopyChoice::kModel);
  // Calls of this shape came out faster without the copy: the CPU gets expert 2.
  for (int i = 0; i < CopyOutcomes::kMinSamples; ++i) {
    outcomes.Observe(bucket, CopyChoice::kModel, 2e-3);
    outcomes.Observe(bucket, CopyChoice::kCpu, 1e-3);
  }
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.outcome_choice, CopyChoice::kCpu);
  EXPECT_EQ(p.copy_experts, (std::vector<int>{3}));
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].rows, (std::vector<int32_t>{0, 1, 2}));
  // Where never copying is forecast far slower (SlowCpuCheapCopies: 8.1 ms
  // on the CPU against ~0.2), the outcomes are not asked however they stand:
  // a prompt's call shape is not sampled without its copies.
  s.cost = SlowCpuCheapCopies();
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.outcome_bucket, -1);
  EXPECT_EQ(p.copy_experts, (std::vector<int>{3, 2}));
  // A call the model sends wholly to the CPU is no decision.
  s.cost.cpu_expert_s = 1e-6;
  s.cost.cpu_pair_s = 1e-7;
  s.cost.copy_s = 1.0;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.outcome_bucket, -1);
}

TEST(MissPlanTest, UnusedSlotsAndShortRowsAreSkipped) {
  // k = 3 but most tokens use fewer pairs; token 2 uses none.
  Case s(4, 3, {0, -1, -1, 4, 0, -1, -1, -1, -1, -1, 4, -1});
  s.slot_buffer[0] = 3;
  s.AddServer({});
  MissPlan p;
  ASSERT_TRUE(s.Plan(&p).ok());
  EXPECT_EQ(p.accessed, (std::vector<int>{0, 4}));
  EXPECT_EQ(p.hit_pairs[0], 2);
  EXPECT_EQ(p.miss_pairs[4], 2);
  ASSERT_EQ(p.hits.num_groups(), 1);
  EXPECT_EQ(Rows(p.hits, 0), (std::vector<std::pair<int, float>>{{0, 0.1f}, {1, 0.5f}}));
  ASSERT_EQ(p.batches.size(), 1u);
  EXPECT_EQ(p.batches[0].rows, (std::vector<int32_t>{1, 3}));  // token 2 ships nothing
  EXPECT_EQ(p.batches[0].ids, (std::vector<int32_t>{4, -1, -1, -1, 4, -1}));
  EXPECT_EQ(p.batches[0].pairs, 2);
  EXPECT_EQ(p.batches[0].experts, 1);
  // An empty call plans nothing.
  Case e(0, 1, {});
  e.AddServer({});
  ASSERT_TRUE(e.Plan(&p).ok());
  EXPECT_TRUE(p.accessed.empty());
  EXPECT_TRUE(p.batches.empty());
  EXPECT_EQ(p.hits.num_groups(), 0);
}

}  // namespace

// The planner prices a call's split with its own rates and link queue: the
// same routing copies both experts on an idle link and keeps them on the CPU
// while the link is booked far beyond what the CPU takes.
TEST(PlannerTest, SplitQueuesBehindTheLinkBacklog) {
  Case s(4, 1, {2, 2, 2, 3});
  s.AddServer({});
  s.in.can_copy = true;
  s.in.copy_mode = CopyMode::kAuto;
  Planner planner;
  planner.rates() = SlowCpuCheapCopies();
  EXPECT_EQ(planner.LinkBacklog(), 0.0);
  MissPlan p;
  ASSERT_TRUE(planner.PlanCall(s.Input(), &p).ok());
  EXPECT_EQ(p.copy_experts, (std::vector<int>{2, 3}));
  planner.CopiesQueued(1000);  // 1000 copies of 0.1 ms: 0.1 s of link
  EXPECT_GT(planner.LinkBacklog(), 0.05);
  ASSERT_TRUE(planner.PlanCall(s.Input(), &p).ok());
  EXPECT_TRUE(p.copy_experts.empty());
  EXPECT_EQ(p.cpu_experts, 2);
}

// The prefetch choice: uncached candidates whose expected pairs reach the
// least-used moved expert's, most-used first, bounded by this call's copies,
// the buffers and the link's idle window.
std::vector<int> Prefetch(const std::vector<int32_t>& last, const std::vector<bool>& candidate, double scale,
                          int32_t least, int moved, int buffers, double window_s, double copy_s) {
  std::vector<int> out = {99};  // scratch from an earlier call: replaced
  ChoosePrefetch(last, candidate, scale, least, moved, buffers, window_s, copy_s, &out);
  return out;
}

TEST(PlannerTest, PrefetchTakesTheExpertsTheNextCallWillCopyWithinTheIdleWindow) {
  const std::vector<int32_t> last = {0, 10, 5, 20, 3, 8};
  std::vector<bool> candidate(last.size(), true);
  candidate[3] = false;  // cached
  EXPECT_EQ(Prefetch(last, candidate, 1.0, 5, 10, 10, 1.0, 0.25), (std::vector<int>{1, 5, 2}));
  EXPECT_EQ(Prefetch(last, candidate, 1.0, 5, 10, 10, 0.5, 0.25), (std::vector<int>{1, 5}));  // window: 2 copies
  EXPECT_EQ(Prefetch(last, candidate, 0.5, 5, 10, 10, 1.0, 0.25), (std::vector<int>{1}));  // a smaller call
  EXPECT_EQ(Prefetch(last, candidate, 1.0, 5, 1, 10, 1.0, 0.25), (std::vector<int>{1}));   // one copy moved
  EXPECT_EQ(Prefetch(last, candidate, 1.0, 5, 10, 1, 1.0, 0.25), (std::vector<int>{1}));   // one buffer
  EXPECT_TRUE(Prefetch(last, candidate, 1.0, 5, 10, 10, 0.0, 0.25).empty());              // the link never idles
  EXPECT_TRUE(Prefetch(last, candidate, 1.0, 25, 10, 10, 1.0, 0.25).empty());             // none reaches least
  EXPECT_EQ(Prefetch(last, candidate, 1.0, 5, 10, 2, 0.0, 0.0), (std::vector<int>{1, 5}));  // unmeasured: buffers
}

// The idle window: from the mark of a call's own copies landing (the link
// was idle, the rates unmeasured: now) to the next call, averaged; a call
// without a mark observes nothing.
TEST(PlannerTest, PrefetchWindowIsTheLinksIdleTimeBetweenCalls) {
  Planner p;
  EXPECT_EQ(p.PrefetchWindow(), 0.0);
  p.OwnCopiesQueued();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  p.CallStarted();
  const double w = p.PrefetchWindow();
  EXPECT_GE(w, 0.0099);
  EXPECT_LT(w, 1.0);
  p.CallStarted();
  EXPECT_EQ(p.PrefetchWindow(), w);
  p.OwnCopiesQueued();
  p.CallStarted();  // no idle time: the average halves
  EXPECT_LT(p.PrefetchWindow(), 0.6 * w);
}

// The admissions' planning is timed by the planner: a planning the call
// outlasted costs the step nothing, one that outlasted the call costs its
// host time; with misses worth next to nothing, a costly planning is then
// not repeated until they pay for it (AdmissionPolicy's bucket).
TEST(PlannerTest, PlanningCostCountsOnlyWhatOutlastsTheCall) {
  const int L = 2, E = 8, C = 2, k = 2;
  auto cache = ExpertCache::Create(ExpertCacheConfig{L, E, C, CachePolicy::kPredictive, 64});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Planner p;
  AdmissionConfig ac;
  ac.layers = {0, 1};
  ac.num_experts = E;
  ac.expert_bytes = 1000;
  ac.costs = {1e-3, 0.0, 1e-12, 0.0};  // a missed expert is worth 1 ps: no planning pays once it costs
  ASSERT_TRUE(p.EnableAdmissions(ac).ok());
  const int32_t ids[k] = {3, 5};
  auto running = [] { return true; };
  auto ended = [] { return false; };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(p.PlanAdmissions(**cache, i % L, 1, k, ids, running).ok());
  EXPECT_EQ(p.planning().planned, 4u);
  EXPECT_EQ(p.planning().on_path, 0u);
  EXPECT_EQ(p.planning().cost_s, 0.0);
  EXPECT_GT(p.planning().seconds, 0.0);
  ASSERT_TRUE(p.PlanAdmissions(**cache, 0, 1, k, ids, ended).ok());
  EXPECT_EQ(p.planning().planned, 5u);
  EXPECT_EQ(p.planning().on_path, 1u);
  EXPECT_GT(p.planning().cost_s, 0.0);
  // Now a planning costs more than the misses have saved: the next runs only observe.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(p.PlanAdmissions(**cache, (i + 1) % L, 1, k, ids, ended).ok());
  EXPECT_EQ(p.planning().planned, 5u);
  EXPECT_EQ(p.planning().unplanned, 3u);
  EXPECT_EQ(p.admission()->unplanned_runs(), 3u);
}


// Prompt-sized calls (2048 tokens, top-8 of 128 experts) with every kind of
// expert: cached (hits, rows padded to 16), copied (many miss pairs), and the
// rest on two servers hosting overlapping ranges (the first takes the shared
// ones). Planned twice into the same MissPlan with different caches: each
// plan's groups equal what grouping the routing masked per kind gives
// (GroupByExpert, the reference), and its batches each server's share of the
// routing, row for row, with their pair and expert counts.
TEST(MissPlanTest, APromptsSplitEqualsGroupingEachKindApart) {
  const int E = 128, n = 2048, k = 8, align = 16;
  std::mt19937 rng(7);
  std::vector<int32_t> ids(static_cast<size_t>(n) * k);
  std::vector<float> weights(ids.size());
  std::vector<int> experts(E);
  for (int t = 0; t < n; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    for (int j = 0; j < k; ++j) {  // skewed: low ids more often, no repeats in a token
      const int pick = j + static_cast<int>(std::min<uint32_t>(rng() % (E - j), rng() % (E - j)));
      std::swap(experts[j], experts[pick]);
      ids[static_cast<size_t>(t) * k + j] = rng() % 16 == 0 ? -1 : experts[j];
      weights[static_cast<size_t>(t) * k + j] = 0.001f * static_cast<float>(rng() % 1000 + 1);
    }
  }
  std::vector<bool> low(E, false), high(E, false);
  for (int e = 0; e < E; ++e) (e < 80 ? low : high)[e] = true;
  for (int e = 60; e < 80; ++e) high[e] = true;  // both host 60-79: the first (low) takes them
  std::vector<PlanServer> servers = {{true, &low, 700, ExpertSlice{}}, {true, &high, 700, ExpertSlice{}}};
  MissPlan p;  // reused, as the dispatcher reuses its plan
  for (auto [stride, copy_min] : {std::pair{5, 200}, std::pair{3, 150}}) {
    SCOPED_TRACE(stride);
    std::vector<int32_t> slot(E, -1);
    for (int e = 0; e < E; e += stride) slot[e] = 1000 + e;  // cached
    MissPlanInput in;
    in.routing = RoutingView{n, k, ids.data(), weights.data()};
    in.num_experts = E;
    in.slot_buffer = slot.data();
    in.servers = servers.data();
    in.num_servers = 2;
    in.hit_row_align = align;
    in.copy_mode = CopyMode::kAuto;
    in.can_copy = true;
    in.copy_min_tokens = copy_min;
    ASSERT_TRUE(PlanMisses(in, &p).ok());
    ASSERT_FALSE(p.copy_experts.empty());
    // The reference: the routing with every pair of another kind (or server) unused.
    auto kind = [&](int e) { return slot[e] >= 0 ? 0 : p.route_of[e] == 0 ? 1 : 2; };
    auto masked = [&](int want, int server) {
      std::vector<int32_t> m = ids;
      for (int32_t& e : m)
        if (e >= 0 && (kind(e) != want || (server >= 0 && (p.route_of[e] >> server & 1) == 0))) e = -1;
      return m;
    };
    auto expect_groups = [&](const ExpertGroups& got, int want, int row_align) {
      const std::vector<int32_t> m = masked(want, -1);
      ExpertGroups ref;
      GroupByExpert(RoutingView{n, k, m.data(), weights.data()}, E, row_align, &ref);
      EXPECT_EQ(got.expert, ref.expert);
      EXPECT_EQ(got.row_begin, ref.row_begin);
      EXPECT_EQ(got.count, ref.count);
      EXPECT_EQ(got.token, ref.token);
      EXPECT_EQ(got.weight, ref.weight);
      EXPECT_EQ(got.total_rows, ref.total_rows);
      EXPECT_EQ(got.total_pairs, ref.total_pairs);
    };
    expect_groups(p.hits, 0, align);
    expect_groups(p.copies, 1, 1);
    for (int g = 0; g < p.hits.num_groups(); ++g) EXPECT_EQ(p.hit_buffer[g], slot[p.hits.expert[g]]);
    // Each server's batches: its tokens in order, at most 700 per batch, the call's routing of its experts.
    for (int s = 0; s < 2; ++s) {
      const std::vector<int32_t> m = masked(2, s);
      std::vector<int32_t> rows, got_rows, got_ids;
      std::vector<float> got_w;
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < k; ++j)
          if (m[static_cast<size_t>(t) * k + j] >= 0) {
            rows.push_back(t);
            break;
          }
      ASSERT_FALSE(rows.empty()) << "server " << s << " has no CPU experts: the case does not test it";
      for (const ServerBatch& b : p.batches) {
        if (b.server != s) continue;
        EXPECT_LE(b.n, 700);
        std::vector<int32_t> distinct;
        int pairs = 0;
        for (int32_t e : b.ids)
          if (e >= 0) {
            ++pairs;
            if (std::find(distinct.begin(), distinct.end(), e) == distinct.end()) distinct.push_back(e);
          }
        EXPECT_EQ(b.pairs, pairs);
        EXPECT_EQ(b.experts, static_cast<int>(distinct.size()));
        got_rows.insert(got_rows.end(), b.rows.begin(), b.rows.end());
        got_ids.insert(got_ids.end(), b.ids.begin(), b.ids.end());
        got_w.insert(got_w.end(), b.weights.begin(), b.weights.end());
      }
      ASSERT_EQ(got_rows, rows) << "server " << s;
      for (size_t i = 0; i < rows.size(); ++i)
        for (int j = 0; j < k; ++j) {
          const size_t src = static_cast<size_t>(rows[i]) * k + j, dst = i * k + j;
          EXPECT_EQ(got_ids[dst], m[src]);
          EXPECT_EQ(got_w[dst], m[src] >= 0 ? weights[src] : 0.0f);
        }
    }
  }
}

// The failover decision (ChooseFailover), a plain function of the servers:
// another up holder of every expert of the batch and of the failed server's
// share, while the deadline allows; else the device for a whole-expert
// server that may use it; else fail.
TEST(MissPlanTest, FailoverGoesToAnotherHolderOfTheSameShareElseTheDevice) {
  const std::vector<bool> all(kE, true), low = {true, true, true, true, false, false, false, false};
  const ExpertSlice whole{}, half0{0, 2}, half1{1, 2};
  // 0 failed (whole), 1 down, 2 holds only 0-3, 3 holds all.
  std::vector<PlanServer> s = {{false, &all, 64, whole}, {false, &all, 64, whole}, {true, &low, 64, whole},
                               {true, &all, 64, whole}};
  const std::vector<int32_t> few = {1, -1, 3}, many = {1, 6};
  FailoverChoice c = ChooseFailover(s.data(), 4, 0, few, true, true);
  EXPECT_EQ(c.action, FailoverChoice::kResend);
  EXPECT_EQ(c.server, 2) << "the first up server holding every expert of the batch";
  c = ChooseFailover(s.data(), 4, 0, many, true, true);
  EXPECT_EQ(c.server, 3) << "server 2 lacks expert 6";
  // Past the deadline: no resend; the device when allowed, else fail.
  EXPECT_EQ(ChooseFailover(s.data(), 4, 0, many, false, true).action, FailoverChoice::kDevice);
  EXPECT_EQ(ChooseFailover(s.data(), 4, 0, many, false, false).action, FailoverChoice::kFail);
  // The failed server itself is never chosen, even if marked up.
  s[0].up = true;
  s[3].up = false;
  c = ChooseFailover(s.data(), 4, 0, many, true, false);
  EXPECT_EQ(c.action, FailoverChoice::kFail);
  // A slice holder: only another holder of the same slice; never the device
  // (it computes whole experts, and the other slices' partials are added).
  std::vector<PlanServer> sl = {{false, &all, 64, half0}, {true, &all, 64, half1}, {true, &all, 64, whole},
                                {true, &all, 64, half0}};
  c = ChooseFailover(sl.data(), 4, 0, few, true, true);
  EXPECT_EQ(c.action, FailoverChoice::kResend);
  EXPECT_EQ(c.server, 3);
  sl[3].up = false;
  EXPECT_EQ(ChooseFailover(sl.data(), 4, 0, few, true, true).action, FailoverChoice::kFail);
}

}  // namespace moe
