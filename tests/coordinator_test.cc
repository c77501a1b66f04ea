// The coordinator's parts in one process: popularity decay, placement (top-C,
// hysteresis, copy budget, pins, union mode), the state file (round trip,
// atomic replace), and the Coordinator state machine on a fake clock
// (assignments and versions, validation naming the field, heartbeat expiry,
// the drain protocol, persistence across a restart).
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <thread>

#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/placement.h"
#include "coordinator/popularity.h"
#include "coordinator/state_file.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace moe {
namespace {

// ---------------------------------------------------------------- popularity

TEST(Popularity, CountsHalveEveryHalfLife) {
  DecayedCounts c(2, 4, /*half_life_seconds=*/10.0, /*now=*/100.0);
  c.Add(1, 2, 8, 6, 100.0);
  EXPECT_DOUBLE_EQ(c.Count(1, 2, 100.0), 8.0);
  EXPECT_NEAR(c.Count(1, 2, 110.0), 4.0, 1e-12);
  EXPECT_NEAR(c.Count(1, 2, 120.0), 2.0, 1e-12);
  EXPECT_NEAR(c.LayerHits(1, 110.0), 3.0, 1e-12);
  EXPECT_NEAR(c.LayerPairs(1, 110.0), 4.0, 1e-12);
  c.Add(1, 2, 4, 0, 110.0);  // 4 (decayed) + 4
  EXPECT_NEAR(c.Count(1, 2, 110.0), 8.0, 1e-12);
  EXPECT_EQ(c.Count(0, 2, 110.0), 0.0);
  EXPECT_EQ(c.Layer(1, 110.0), (std::vector<double>{0, 0, 8, 0}));
}

TEST(Popularity, StaysExactOverManyHalfLives) {
  DecayedCounts c(1, 2, 1.0, 0.0);
  c.Add(0, 0, 1, 0, 0.0);
  // Far beyond the re-basing point: old counts vanish, new ones are exact.
  for (double t = 1; t <= 5000; t += 1) c.Add(0, 1, 1, 0, t);
  EXPECT_LT(c.Count(0, 0, 5000.0), 1e-300);
  // Steady state of one pair per second with a 1 s half-life: sum of 2^-k = 2.
  EXPECT_NEAR(c.Count(0, 1, 5000.0), 2.0, 1e-9);
  EXPECT_TRUE(std::isfinite(c.LayerPairs(0, 5000.0)));
}

TEST(Popularity, CombinedAndPerWorkerAndHalfLifeChange) {
  Popularity p(1, 3, 10.0);
  p.Add("w1", 0, 0, 10, 0, 0.0);
  p.Add("w2", 0, 0, 30, 0, 0.0);
  p.Add("w2", 0, 2, 5, 0, 0.0);
  EXPECT_DOUBLE_EQ(p.worker("w1")->Count(0, 0, 0.0), 10.0);
  EXPECT_DOUBLE_EQ(p.worker("w2")->Count(0, 2, 0.0), 5.0);
  EXPECT_EQ(p.worker("w3"), nullptr);
  // w2 (35 pairs) weighs as much as the median worker, w1 (10): scaled by
  // 10/35; then everything by 45/20, back to the 45 pairs reported.
  Popularity::Combined c = p.Layer(0, 0.0);
  const double e0 = (10 + 30 * 10.0 / 35) * 45 / 20;
  EXPECT_NEAR(c.counts[0], e0, 1e-9);
  EXPECT_NEAR(c.counts[2], 5 * 10.0 / 35 * 45 / 20, 1e-9);
  EXPECT_NEAR(c.pairs, 45.0, 1e-9);
  EXPECT_NEAR(c.counts[0] + c.counts[2], c.pairs, 1e-9);
  // The counts as of now are kept; from now on they decay with the new half-life.
  p.SetHalfLife(1.0, 10.0);
  EXPECT_NEAR(p.Layer(0, 10.0).counts[0], e0 / 2, 1e-9);
  EXPECT_NEAR(p.Layer(0, 11.0).counts[0], e0 / 4, 1e-9);
  EXPECT_NEAR(p.worker("w1")->Count(0, 0, 11.0), 2.5, 1e-9);
  // A removed worker leaves the combination.
  p.Remove("w2");
  EXPECT_EQ(p.worker("w2"), nullptr);
  EXPECT_NEAR(p.Layer(0, 11.0).counts[0], 2.5, 1e-9);
  EXPECT_EQ(p.Layer(0, 11.0).counts[2], 0.0);
}

// Issue 47, defect 3: however much one worker reports, it weighs at most as
// much as the median worker in the combination that union placement, the
// global popularity and the layer hit rates read.
TEST(Popularity, NoWorkerWeighsMoreThanTheMedianWorker) {
  Popularity p(1, 8, 10.0);
  for (int w = 0; w < 3; ++w) p.Add("honest" + std::to_string(w), 0, w, 100, 80, 0.0);
  p.Add("rogue", 0, 7, 1.8e19, 0, 0.0);
  Popularity::Combined c = p.Layer(0, 0.0);
  EXPECT_NEAR(c.counts[7] / c.pairs, 0.25, 1e-9) << "one of four workers: a quarter";
  EXPECT_NEAR(c.hits / c.pairs, 0.6, 1e-9) << "the hit rate is the honest 0.8 diluted by a quarter, not 0";
  for (int w = 0; w < 2; ++w) p.Remove("honest" + std::to_string(w));
  c = p.Layer(0, 0.0);
  EXPECT_NEAR(c.counts[7] / c.pairs, 0.5, 1e-9) << "with two workers, as heavy as the other one";
}

// ---------------------------------------------------------------- placement

PlacementProblem OneWorker(int layers, int experts, int slots, const std::vector<std::vector<double>>& pop) {
  PlacementProblem p;
  p.num_layers = layers;
  p.num_experts = experts;
  p.params.hysteresis_margin = 0.25;
  p.params.copy_cost_hits = 1.0;
  WorkerPlacementState w;
  w.id = "w";
  w.slots_per_layer = slots;
  w.expert_bytes = 100;
  w.cached.assign(layers, true);
  w.resident.resize(layers);
  w.pinned.resize(layers);
  w.popularity = pop;
  p.workers.push_back(w);
  p.global_popularity = pop;
  return p;
}

TEST(Placement, FillsFreeSlotsWithTheTopC) {
  PlacementProblem p = OneWorker(1, 5, 2, {{5, 1, 9, 3, 0}});
  PlacementPlan plan = PlanPlacement(p);
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{0, 2}));
  ASSERT_EQ(plan.moves.size(), 2u);
  EXPECT_EQ(plan.moves[0].evicted, -1);
  EXPECT_EQ(plan.bytes[0], 200u);
  EXPECT_NEAR(plan.hit_rate_before[0], 0.0, 1e-12);
  EXPECT_NEAR(plan.hit_rate_after[0], 14.0 / 18.0, 1e-12);
  // Nothing popular enough to pay for a copy: the slot stays free.
  p = OneWorker(1, 3, 2, {{0.5, 0, 0}});
  EXPECT_TRUE(PlanPlacement(p).moves.empty());
}

TEST(Placement, HysteresisKeepsResidentsUnlessTheGainBeatsCostAndMargin) {
  // Resident {0, 1}; expert 2 is a bit hotter than 1 but not by the margin.
  PlacementProblem p = OneWorker(1, 4, 2, {{100, 40, 50, 0}});
  p.workers[0].resident = {{0, 1}};
  PlacementPlan plan = PlanPlacement(p);
  EXPECT_TRUE(plan.moves.empty()) << "50 < 40 * 1.25 + 1";
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{0, 1}));
  // Just past it: 51.5 > 40 * 1.25 + 1 = 51.
  p.workers[0].popularity = p.global_popularity = {{100, 40, 51.5, 0}};
  plan = PlanPlacement(p);
  ASSERT_EQ(plan.moves.size(), 1u);
  EXPECT_EQ(plan.moves[0].expert, 2);
  EXPECT_EQ(plan.moves[0].evicted, 1);
  EXPECT_DOUBLE_EQ(plan.moves[0].gain, 11.5);
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{0, 2}));
  // Without margin and cost, any hotter expert wins.
  p.params.hysteresis_margin = 0;
  p.params.copy_cost_hits = 0;
  p.workers[0].popularity = p.global_popularity = {{100, 40, 40.5, 0}};
  EXPECT_EQ(PlanPlacement(p).sets[0][0], (std::vector<int>{0, 2}));
}

TEST(Placement, CopyBudgetTakesTheBestGainsAcrossLayers) {
  // Two layers, each with two newcomers worth copying; budget for 3 copies.
  PlacementProblem p = OneWorker(2, 6, 2, {{0, 0, 90, 80, 0, 0}, {0, 0, 0, 0, 100, 10}});
  p.workers[0].resident = {{0, 1}, {0, 1}};
  p.workers[0].budget_bytes = 300;
  PlacementPlan plan = PlanPlacement(p);
  ASSERT_EQ(plan.moves.size(), 3u);
  EXPECT_EQ(plan.bytes[0], 300u);
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{2, 3}));
  // Layer 1's second newcomer (gain 10) is the one left out.
  EXPECT_EQ(plan.sets[0][1].size(), 2u);
  EXPECT_TRUE(std::count(plan.sets[0][1].begin(), plan.sets[0][1].end(), 4));
  EXPECT_FALSE(std::count(plan.sets[0][1].begin(), plan.sets[0][1].end(), 5));
  // A budget below one copy moves nothing.
  p.workers[0].budget_bytes = 99;
  EXPECT_TRUE(PlanPlacement(p).moves.empty());
}

TEST(Placement, PinsAlwaysWinEvenWithoutBudgetOrPopularity) {
  PlacementProblem p = OneWorker(1, 5, 2, {{100, 90, 0, 0, 50}});
  p.workers[0].resident = {{0, 1}};
  p.workers[0].pinned = {{3}};
  p.workers[0].budget_bytes = 0;
  PlacementPlan plan = PlanPlacement(p);
  ASSERT_EQ(plan.moves.size(), 1u);
  EXPECT_TRUE(plan.moves[0].pinned);
  EXPECT_EQ(plan.moves[0].evicted, 1) << "the least popular resident makes room";
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{0, 3}));
  // A pinned resident is never evicted, however cold.
  p.workers[0].resident = {{0, 3}};
  p.workers[0].budget_bytes = kUnlimitedBudget;
  p.workers[0].popularity = p.global_popularity = {{100, 90, 0, 0, 500}};
  plan = PlanPlacement(p);
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{3, 4}));
}

TEST(Placement, FrozenWorkersAndUncachedLayersDoNotMove) {
  PlacementProblem p = OneWorker(2, 4, 1, {{0, 10, 0, 0}, {0, 0, 10, 0}});
  p.workers[0].frozen = true;
  EXPECT_TRUE(PlanPlacement(p).moves.empty());
  p.workers[0].frozen = false;
  p.workers[0].cached = {false, true};
  PlacementPlan plan = PlanPlacement(p);
  EXPECT_TRUE(plan.sets[0][0].empty());
  EXPECT_EQ(plan.sets[0][1], (std::vector<int>{2}));
}

PlacementProblem TwoWorkers(PlacementMode mode, double replicate_share) {
  PlacementProblem p = OneWorker(1, 4, 2, {{40, 30, 20, 10}});
  p.params.mode = mode;
  p.params.replicate_share = replicate_share;
  p.workers.push_back(p.workers[0]);
  p.workers[1].id = "w2";
  return p;
}

TEST(Placement, UnionModeSpreadsExpertsSoTheWorkersCoverMore) {
  PlacementPlan per_worker = PlanPlacement(TwoWorkers(PlacementMode::kPerWorker, 1.0));
  EXPECT_EQ(per_worker.sets[0][0], (std::vector<int>{0, 1}));
  EXPECT_EQ(per_worker.sets[1][0], (std::vector<int>{0, 1}));
  EXPECT_NEAR(per_worker.coverage_after, 0.7, 1e-12);

  PlacementPlan spread = PlanPlacement(TwoWorkers(PlacementMode::kUnion, 1.0));
  std::vector<int> all = spread.sets[0][0];
  all.insert(all.end(), spread.sets[1][0].begin(), spread.sets[1][0].end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_NEAR(spread.coverage_after, 1.0, 1e-12);

  // The hottest (40% of the pairs >= 35%) is replicated; the rest spread.
  PlacementPlan replicated = PlanPlacement(TwoWorkers(PlacementMode::kUnion, 0.35));
  EXPECT_TRUE(std::count(replicated.sets[0][0].begin(), replicated.sets[0][0].end(), 0));
  EXPECT_TRUE(std::count(replicated.sets[1][0].begin(), replicated.sets[1][0].end(), 0));
  EXPECT_NEAR(replicated.coverage_after, 0.9, 1e-12);
}

TEST(Placement, UnionModeKeepsExpertsWhereTheyAre) {
  PlacementProblem p = TwoWorkers(PlacementMode::kUnion, 1.0);
  p.workers[0].resident = {{1, 2}};
  p.workers[1].resident = {{0, 3}};
  PlacementPlan plan = PlanPlacement(p);
  EXPECT_TRUE(plan.moves.empty()) << "already a full cover: nothing to copy";
  // A duplicate is worth nothing in union mode: it yields its slot to an uncovered expert.
  p.workers[0].resident = {{0, 1}};
  p.workers[1].resident = {{0, 2}};
  plan = PlanPlacement(p);
  ASSERT_EQ(plan.moves.size(), 1u);
  EXPECT_EQ(plan.moves[0].expert, 3);
  EXPECT_EQ(plan.moves[0].evicted, 0);
  EXPECT_NEAR(plan.coverage_after, 1.0, 1e-12);
}

TEST(Placement, PerWorkerModeRanksByTheWorkersOwnTraffic) {
  PlacementProblem p = TwoWorkers(PlacementMode::kPerWorker, 1.0);
  p.workers[0].popularity = {{0, 0, 50, 60}};
  p.workers[1].popularity = {};  // no counts yet: the global ones
  PlacementPlan plan = PlanPlacement(p);
  EXPECT_EQ(plan.sets[0][0], (std::vector<int>{2, 3}));
  EXPECT_EQ(plan.sets[1][0], (std::vector<int>{0, 1}));
}

// ---------------------------------------------------------------- state file

TEST(StateFile, RoundTripAndMissingFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  absl::StatusOr<AdminState> empty = LoadAdminState(path);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->pins.empty());
  AdminState s;
  s.num_layers = 4;
  s.num_experts = 8;
  s.pins[{"", 1}] = {2, 5};
  s.pins[{"w1", 3}] = {7};
  s.policy["half_life_seconds"] = "20";
  s.drains = {"s1"};
  ASSERT_TRUE(SaveAdminState(path, s).ok());
  absl::StatusOr<AdminState> back = LoadAdminState(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->num_layers, 4);
  EXPECT_EQ(back->num_experts, 8);
  EXPECT_EQ(back->pins, s.pins);
  EXPECT_EQ(back->policy, s.policy);
  EXPECT_EQ(back->drains, s.drains);
}

TEST(StateFile, MalformedFileIsAnErrorNamingIt) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  std::ofstream(path) << "{\"format\": \"moe-coordinator-state\", \"version\": 1, \"pins\": [{\"layer\": -1}]}";
  absl::StatusOr<AdminState> s = LoadAdminState(path);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(path), std::string::npos) << s.status();
  std::ofstream(path) << "not json";
  EXPECT_FALSE(LoadAdminState(path).ok());
}

// A state file another user could have planted or can still change is not
// loaded (its pins, drains and policy would bypass the admin role): a
// group- or world-writable file, a symbolic link (not followed), another
// uid's file; each refused with a reason naming the file.
TEST(StateFile, FilesOtherUsersCouldWriteAreRefused) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  AdminState s;
  s.drains = {"s1"};
  ASSERT_TRUE(SaveAdminState(path, s).ok());
  ASSERT_TRUE(LoadAdminState(path).ok());
  ASSERT_EQ(chmod(path.c_str(), 0666), 0);
  absl::StatusOr<AdminState> writable = LoadAdminState(path);
  EXPECT_EQ(writable.status().code(), absl::StatusCode::kFailedPrecondition) << writable.status();
  EXPECT_NE(writable.status().message().find("mode 0666"), std::string::npos) << writable.status();
  EXPECT_NE(writable.status().message().find(path), std::string::npos) << writable.status();
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  const std::string link = dir.path() + "/link.json";
  ASSERT_EQ(symlink(path.c_str(), link.c_str()), 0);
  absl::StatusOr<AdminState> linked = LoadAdminState(link);
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition) << linked.status();
  EXPECT_NE(linked.status().message().find("symbolic link"), std::string::npos) << linked.status();
  // A FIFO is refused at once (an open() waiting for a writer hung the start).
  const std::string fifo = dir.path() + "/fifo.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto loaded = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> fifo_status = loaded->get_future();
  std::thread([fifo, loaded] { loaded->set_value(LoadAdminState(fifo).status()); }).detach();
  ASSERT_EQ(fifo_status.wait_for(std::chrono::seconds(5)), std::future_status::ready) << "loading a FIFO hangs";
  const absl::Status fifo_st = fifo_status.get();
  EXPECT_EQ(fifo_st.code(), absl::StatusCode::kFailedPrecondition) << fifo_st;
  EXPECT_NE(fifo_st.message().find("not a regular file"), std::string::npos) << fifo_st;
  if (geteuid() == 0) {  // only root can give the file to another uid
    ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
    absl::StatusOr<AdminState> foreign = LoadAdminState(path);
    EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition) << foreign.status();
    EXPECT_NE(foreign.status().message().find("owned by uid 65534"), std::string::npos) << foreign.status();
  }
}

TEST(StateFile, ReplaceIsAtomicForConcurrentReaders) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  const std::string a(200000, 'a'), b(300000, 'b');
  ASSERT_TRUE(WriteFileAtomically(path, a).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, torn{0};
  std::thread reader([&] {
    while (!stop.load()) {
      std::ifstream in(path);
      std::stringstream ss;
      ss << in.rdbuf();
      if (ss.str() != a && ss.str() != b) ++torn;
      ++reads;
    }
  });
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(WriteFileAtomically(path, i % 2 ? a : b).ok());
  while (reads.load() < 50) std::this_thread::yield();
  stop = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0) << "a reader saw a partly written file";
  // No temporaries left behind; a file in a missing directory fails cleanly.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  EXPECT_FALSE(WriteFileAtomically(dir.path() + "/missing/state.json", a).ok());
}

// ---------------------------------------------------------------- the Coordinator, in process

class CoordinatorCore : public ::testing::Test {
 protected:
  std::unique_ptr<Coordinator> Make(const std::string& state_file = "",
                                    const std::function<void(CoordinatorOptions&)>& tweak = nullptr) {
    CoordinatorOptions o;
    o.policy.rebalance_interval_seconds = 1.0;
    o.policy.half_life_seconds = 10.0;
    o.policy.copy_budget_gbps = 0;  // unlimited
    o.heartbeat_timeout_seconds = 3.0;
    o.state_file = state_file;
    if (tweak) tweak(o);
    o.clock = [this] { return now_; };
    absl::StatusOr<std::unique_ptr<Coordinator>> c = Coordinator::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  static moe::v1::RegisterWorkerRequest Worker(const std::string& id) {
    moe::v1::RegisterWorkerRequest r;
    r.set_worker_id(id);
    r.set_num_layers(2);
    r.set_num_experts(8);
    r.set_slots_per_layer(2);
    r.set_expert_bytes(1000);
    return r;
  }
  static moe::v1::HeartbeatRequest Beat(const std::string& id, uint64_t session, uint64_t applied) {
    moe::v1::HeartbeatRequest h;
    h.set_worker_id(id);
    h.set_session(session);
    h.set_applied_version(applied);
    return h;
  }
  static void Count(moe::v1::HeartbeatRequest& h, int layer, std::vector<std::pair<int, int>> counts) {
    moe::v1::LayerCounts* c = h.add_counts();
    c->set_layer(layer);
    for (auto [e, n] : counts) {
      c->add_experts(e);
      c->add_pairs(n);
      c->add_hits(0);
    }
  }
  double now_ = 1000.0;
};

std::vector<int> Experts(const moe::v1::CacheAssignment& a, int layer) {
  for (const auto& l : a.layers()) {
    if (static_cast<int>(l.layer()) == layer) return std::vector<int>(l.experts().begin(), l.experts().end());
  }
  return {};
}

std::vector<int> Pinned(const moe::v1::CacheAssignment& a, int layer) {
  for (const auto& l : a.layers()) {
    if (static_cast<int>(l.layer()) == layer) return std::vector<int>(l.pinned().begin(), l.pinned().end());
  }
  return {};
}

// Workers' per-layer cache activity (copies, bytes, prediction scores) shows
// in the status as decayed rates and a precision; bad counts are refused.
TEST_F(CoordinatorCore, StatusShowsPerLayerCacheActivity) {
  auto c = Make();
  absl::StatusOr<moe::v1::RegisterWorkerResponse> reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{5, 10}});
  hb.mutable_counts(0)->set_cache_copies(4);
  hb.mutable_counts(0)->set_copy_bytes(4000);
  hb.mutable_counts(0)->set_predicted(10);
  hb.mutable_counts(0)->set_predicted_used(7);
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  moe::v1::StatusResponse st = c->Status();
  ASSERT_EQ(st.layers_size(), 2);
  EXPECT_DOUBLE_EQ(st.layers(1).prediction_precision(), 0.7);
  EXPECT_GT(st.layers(1).copies_per_second(), 0.0);
  EXPECT_DOUBLE_EQ(st.layers(1).pcie_bytes_per_second(), 1000.0 * st.layers(1).copies_per_second());
  EXPECT_EQ(st.layers(0).copies_per_second(), 0.0);
  EXPECT_EQ(st.layers(0).prediction_precision(), 0.0);
  // The rate decays when nothing more comes.
  const double before = st.layers(1).copies_per_second();
  now_ += 10;
  EXPECT_LT(c->Status().layers(1).copies_per_second(), before * 0.75);
  auto bad = Beat("w1", reg->session(), 0);
  Count(bad, 0, {{1, 1}});
  bad.mutable_counts(0)->set_predicted(1);
  bad.mutable_counts(0)->set_predicted_used(2);
  absl::Status s = c->Heartbeat(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("counts[0].predicted_used"), std::string::npos) << s;
}

// The planner's split per layer: of the pairs workers report, the shares the
// CPU servers computed and that were copied to the GPU (of which prefetched),
// and the link's busy share; a report claiming more CPU, copied or prefetched
// pairs than it can have counts as what it can have.
TEST_F(CoordinatorCore, StatusShowsThePlannersSplitPerLayer) {
  auto c = Make();
  absl::StatusOr<moe::v1::RegisterWorkerResponse> reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{5, 6}, {6, 4}});  // 10 pairs, no hits
  hb.mutable_counts(0)->set_cpu_pairs(6);
  hb.mutable_counts(0)->set_copied_pairs(4);
  hb.mutable_counts(0)->set_prefetched_pairs(3);
  hb.mutable_counts(0)->set_link_microseconds(2000000);
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  moe::v1::StatusResponse st = c->Status();
  ASSERT_EQ(st.layers_size(), 2);
  EXPECT_DOUBLE_EQ(st.layers(1).cpu_share(), 0.6);
  EXPECT_DOUBLE_EQ(st.layers(1).copied_share(), 0.4);
  EXPECT_DOUBLE_EQ(st.layers(1).prefetched_share(), 0.3);
  EXPECT_EQ(st.layers(1).hit_rate(), 0.0);
  EXPECT_GT(st.layers(1).pcie_busy_share(), 0.0);
  EXPECT_EQ(st.layers(0).cpu_share(), 0.0);
  EXPECT_EQ(st.layers(0).pcie_busy_share(), 0.0);
  auto over = Beat("w1", reg->session(), 0);
  Count(over, 0, {{1, 2}});
  over.mutable_counts(0)->set_cpu_pairs(50);
  over.mutable_counts(0)->set_copied_pairs(50);
  over.mutable_counts(0)->set_prefetched_pairs(50);
  ASSERT_TRUE(c->Heartbeat(over).ok());
  st = c->Status();
  EXPECT_DOUBLE_EQ(st.layers(0).cpu_share(), 1.0);
  EXPECT_DOUBLE_EQ(st.layers(0).copied_share(), 0.0);
  EXPECT_DOUBLE_EQ(st.layers(0).prefetched_share(), 0.0);
}

TEST_F(CoordinatorCore, SnapshotThenDeltaTowardTheHotExperts) {
  auto c = Make();
  absl::StatusOr<moe::v1::RegisterWorkerResponse> reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok()) << reg.status();
  absl::StatusOr<moe::v1::CacheAssignment> snap = c->Snapshot("w1", reg->session());
  ASSERT_TRUE(snap.ok());
  EXPECT_TRUE(snap->full());
  EXPECT_EQ(snap->layers_size(), 2);
  const uint64_t v1 = snap->version();
  auto hb = Beat("w1", reg->session(), v1);
  Count(hb, 1, {{5, 100}, {6, 80}, {1, 3}});
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  now_ += 1.5;
  c->Tick();
  auto delta = c->WaitForAssignment("w1", reg->session(), v1, std::chrono::steady_clock::now());
  ASSERT_TRUE(delta.ok());
  ASSERT_TRUE(delta->has_value());
  EXPECT_FALSE((*delta)->full());
  EXPECT_EQ((*delta)->base_version(), v1);
  ASSERT_EQ((*delta)->layers_size(), 1) << "only the changed layer";
  EXPECT_EQ(Experts(**delta, 1), (std::vector<int>{5, 6}));
  // Not acknowledged yet: the next round leaves the worker alone.
  const uint64_t v2 = (*delta)->version();
  auto hb2 = Beat("w1", reg->session(), v1);
  Count(hb2, 0, {{3, 50}});
  ASSERT_TRUE(c->Heartbeat(hb2).ok());
  absl::StatusOr<moe::v1::RebalanceResponse> skipped = c->Rebalance(false);
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->workers(0).skipped());
  EXPECT_TRUE(skipped->copies().empty());
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), v2)).ok());
  // Dry run: the plan, nothing issued.
  absl::StatusOr<moe::v1::RebalanceResponse> dry = c->Rebalance(true);
  ASSERT_TRUE(dry.ok());
  ASSERT_EQ(dry->copies_size(), 1);
  EXPECT_EQ(dry->copies(0).expert(), 3u);
  EXPECT_GT(dry->hit_rate_after(), dry->hit_rate_before());
  EXPECT_EQ(c->Status().workers(0).assigned_version(), v2);
  absl::StatusOr<moe::v1::RebalanceResponse> real = c->Rebalance(false);
  ASSERT_TRUE(real.ok());
  EXPECT_EQ(real->workers(0).version(), v2 + 1);
}

TEST_F(CoordinatorCore, BadInputIsInvalidArgumentNamingTheField) {
  auto c = Make();
  auto expect_invalid = [](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  };
  auto r = Worker("");
  expect_invalid(c->RegisterWorker(r).status(), "worker_id");
  r = Worker("w1");
  r.set_slots_per_layer(9);
  expect_invalid(c->RegisterWorker(r).status(), "slots_per_layer");
  r = Worker("w1");
  r.add_current()->set_layer(5);
  expect_invalid(c->RegisterWorker(r).status(), "current[0].layer");
  r = Worker("w1");
  auto* cur = r.add_current();
  cur->set_layer(0);
  cur->add_experts(1);
  cur->add_experts(1);
  expect_invalid(c->RegisterWorker(r).status(), "current[0].experts[1]");
  absl::StatusOr<moe::v1::RegisterWorkerResponse> reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  // The model geometry is fixed by the first registration.
  r = Worker("w2");
  r.set_num_experts(16);
  EXPECT_EQ(c->RegisterWorker(r).status().code(), absl::StatusCode::kFailedPrecondition);
  auto hb = Beat("w1", reg->session(), 0);
  Count(hb, 0, {{8, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].experts[0]");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 2, {{1, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].layer");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 0, {{1, 1}});
  hb.mutable_counts(0)->set_hits(0, 2);
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].hits[0]");
  EXPECT_EQ(c->Heartbeat(Beat("nobody", 1, 0)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Heartbeat(Beat("w1", reg->session() + 1, 0)).status().code(), absl::StatusCode::kFailedPrecondition);
  moe::v1::PinRequest pin;
  pin.set_layer(0);
  pin.add_experts(8);
  expect_invalid(c->Pin(pin, true).status(), "experts[0]");
  pin.set_layer(2);
  expect_invalid(c->Pin(pin, true).status(), "layer");
  pin.set_layer(0);
  pin.clear_experts();
  pin.add_experts(1);
  pin.add_experts(2);
  pin.add_experts(3);
  expect_invalid(c->Pin(pin, true).status(), "experts");  // 3 pins for 2 slots
  moe::v1::SetPolicyRequest sp;
  (*sp.mutable_values())["half_life_seconds"] = "-1";
  expect_invalid(c->SetPolicy(sp).status(), "half_life_seconds");
  sp.clear_values();
  (*sp.mutable_values())["rebalance_interval_seconds"] = "1e-300";  // a rebalance every loop
  expect_invalid(c->SetPolicy(sp).status(), "rebalance_interval_seconds (--rebalance-interval-seconds): 1e-300");
  (*sp.mutable_values())["rebalance_interval_seconds"] = "0";  // off: valid
  EXPECT_TRUE(c->SetPolicy(sp).ok());
  moe::v1::PopularityRequest pr;
  pr.set_layer(7);
  expect_invalid(c->GetPopularity(pr).status(), "layer");
}

moe::v1::RegisterExpertServerRequest Server(const std::string& id) {
  moe::v1::RegisterExpertServerRequest r;
  r.set_server_id(id);
  r.set_address(id + ":50051");
  r.set_num_layers(2);
  r.set_num_experts(8);
  return r;
}

// Sliced servers (--slice): an expert is routable only while every slice of
// it is up; status shows each server's slice and each worker's group.
TEST_F(CoordinatorCore, SlicedExpertsAreRoutableOnlyWithEverySliceUp) {
  auto c = Make();
  auto reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  auto half0 = Server("h0"), half1 = Server("h1");
  half0.set_slice_count(2);
  half1.set_slice_index(1);
  half1.set_slice_count(2);
  ASSERT_TRUE(c->RegisterExpertServer(half0).ok());
  moe::v1::StatusResponse st = c->Status();
  ASSERT_GT(st.layers_size(), 0);
  EXPECT_EQ(st.layers(0).routable_experts(), 0u) << "slice 1 of 2 missing";
  ASSERT_TRUE(c->RegisterExpertServer(half1).ok());
  st = c->Status();
  EXPECT_EQ(st.layers(0).routable_experts(), 8u);
  for (const auto& s : st.servers()) {
    EXPECT_EQ(s.slice_count(), 2u);
    EXPECT_EQ(s.slice_index(), s.server_id() == "h1" ? 1u : 0u);
  }
  auto bad = Server("h2");
  bad.set_slice_index(2);
  bad.set_slice_count(2);
  absl::Status refused = c->RegisterExpertServer(bad).status();
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_NE(refused.message().find("slice_index"), std::string::npos) << refused;
  auto rank = Worker("w2");
  rank.set_tp_rank(1);
  rank.set_tp_size(2);
  ASSERT_TRUE(c->RegisterWorker(rank).ok());
  const moe::v1::StatusResponse after = c->Status();
  int ranks = 0;
  for (const auto& w : after.workers()) {
    if (w.worker_id() != "w2") continue;
    EXPECT_EQ(w.tp_rank(), 1u);
    EXPECT_EQ(w.tp_size(), 2u);
    ++ranks;
  }
  EXPECT_EQ(ranks, 1);
}

TEST_F(CoordinatorCore, SilentPeersGoDownAndLeaveTheRoutes) {
  auto c = Make();
  auto reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  auto s1 = c->RegisterExpertServer(Server("s1"));
  auto s2 = c->RegisterExpertServer(Server("s2"));
  ASSERT_TRUE(s1.ok() && s2.ok());
  auto snap = c->Snapshot("w1", reg->session());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->routes_size(), 2);
  // s1 keeps beating, s2 and the worker fall silent.
  now_ += 2.0;
  moe::v1::HeartbeatRequest h;
  h.set_server_id("s1");
  h.set_session(s1->session());
  ASSERT_TRUE(c->Heartbeat(h).ok());
  now_ += 2.0;
  c->Tick();
  moe::v1::StatusResponse st = c->Status();
  EXPECT_EQ(st.workers(0).state(), "down");
  EXPECT_EQ(st.servers(0).state(), "up");
  EXPECT_EQ(st.servers(1).state(), "down");
  auto delta = c->WaitForAssignment("w1", reg->session(), snap->version(), std::chrono::steady_clock::now());
  ASSERT_TRUE(delta.ok() && delta->has_value());
  EXPECT_TRUE((*delta)->routes_changed());
  ASSERT_EQ((*delta)->routes_size(), 1) << "s2's experts go to the replica";
  EXPECT_EQ((*delta)->routes(0).server_id(), "s1");
  // A heartbeat brings the worker back.
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), 0)).ok());
  EXPECT_EQ(c->Status().workers(0).state(), "up");
}

TEST_F(CoordinatorCore, DrainWaitsForWorkersAndInFlightWork) {
  auto c = Make();
  auto reg = c->RegisterWorker(Worker("w1"));
  auto s1 = c->RegisterExpertServer(Server("s1"));
  ASSERT_TRUE(reg.ok() && s1.ok());
  const uint64_t v = c->Snapshot("w1", reg->session())->version();
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), v)).ok());
  moe::v1::DrainRequest d;
  d.set_server_id("s1");
  absl::StatusOr<moe::v1::DrainResponse> r = c->Drain(d);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->state(), "draining");
  ASSERT_EQ(r->workers_pending_size(), 1);
  EXPECT_EQ(r->workers_pending(0), "w1");
  // The worker acknowledges the version without s1, but s1 still has work in flight.
  auto delta = c->WaitForAssignment("w1", reg->session(), v, std::chrono::steady_clock::now());
  ASSERT_TRUE(delta.ok() && delta->has_value());
  EXPECT_EQ((*delta)->routes_size(), 0);
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), (*delta)->version())).ok());
  c->Tick();
  now_ += 0.1;
  moe::v1::HeartbeatRequest h;
  h.set_server_id("s1");
  h.set_session(s1->session());
  h.set_inflight_requests(3);
  absl::StatusOr<moe::v1::HeartbeatResponse> hr = c->Heartbeat(h);
  ASSERT_TRUE(hr.ok());
  EXPECT_TRUE(hr->draining());
  c->Tick();
  EXPECT_EQ(c->Drain(d)->state(), "draining");
  h.set_inflight_requests(0);
  now_ += 0.1;
  ASSERT_TRUE(c->Heartbeat(h).ok());
  c->Tick();
  EXPECT_EQ(c->Drain(d)->state(), "drained");
  EXPECT_TRUE(c->Heartbeat(h)->drained());
  // Undrain: routed again.
  d.set_cancel(true);
  EXPECT_EQ(c->Drain(d)->state(), "up");
  d.set_server_id("nope");
  EXPECT_EQ(c->Drain(d).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorCore, PinsPolicyAndDrainsSurviveARestart) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  {
    auto c = Make(path);
    auto reg = c->RegisterWorker(Worker("w1"));
    ASSERT_TRUE(reg.ok());
    ASSERT_TRUE(c->RegisterExpertServer(Server("s1")).ok());
    moe::v1::PinRequest pin;
    pin.set_layer(1);
    pin.add_experts(4);
    ASSERT_TRUE(c->Pin(pin, true).ok());
    moe::v1::SetPolicyRequest sp;
    (*sp.mutable_values())["placement"] = "union";
    (*sp.mutable_values())["half_life_seconds"] = "30";
    ASSERT_TRUE(c->SetPolicy(sp).ok());
    moe::v1::DrainRequest d;
    d.set_server_id("s1");
    ASSERT_TRUE(c->Drain(d).ok());
  }
  auto c = Make(path);
  EXPECT_EQ(c->GetPolicy().placement(), "union");
  EXPECT_EQ(c->GetPolicy().half_life_seconds(), 30);
  moe::v1::PopularityRequest pr;
  pr.set_layer(1);
  absl::StatusOr<moe::v1::PopularityResponse> pop = c->GetPopularity(pr);
  ASSERT_TRUE(pop.ok()) << "geometry persisted: " << pop.status();
  bool pinned = false;
  for (const auto& e : pop->experts()) pinned |= e.expert() == 4 && e.pinned();
  EXPECT_TRUE(pinned);
  // The drained server comes back drained; a new worker gets the pin in its first round.
  absl::StatusOr<moe::v1::RegisterExpertServerResponse> s = c->RegisterExpertServer(Server("s1"));
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->draining());
  auto reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  auto snap = c->Snapshot("w1", reg->session());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->routes_size(), 0) << "a drained server is not routed to";
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), snap->version())).ok());
  c->Tick();  // pins are placed as soon as the worker acknowledged its snapshot
  auto a = c->WaitForAssignment("w1", reg->session(), snap->version(), std::chrono::steady_clock::now());
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ(Experts(**a, 1), (std::vector<int>{4}));
  EXPECT_EQ(Pinned(**a, 1), (std::vector<int>{4})) << "pins travel with the assignment";
  // Unpinning changes only the pins: the worker gets the layer again, unpinned.
  const uint64_t v = (**a).version();
  ASSERT_TRUE(c->Heartbeat(Beat("w1", reg->session(), v)).ok());
  moe::v1::PinRequest unpin;
  unpin.set_layer(1);
  unpin.add_experts(4);
  ASSERT_TRUE(c->Pin(unpin, false).ok());
  auto b = c->WaitForAssignment("w1", reg->session(), v, std::chrono::steady_clock::now());
  ASSERT_TRUE(b.ok() && b->has_value());
  EXPECT_EQ(Experts(**b, 1), (std::vector<int>{4}));
  EXPECT_TRUE(Pinned(**b, 1).empty());
}

// A worker that resumes (after a coordinator restart) holding a pinned expert
// gets a snapshot that keeps it pinned: without the pin its admissions could
// evict the expert before the next placement round pinned it again (this was
// SystemTest.CoordinatorRestartKeepsOverridesAndWorkersKeepServing's flake).
TEST_F(CoordinatorCore, ResumingWorkerKeepsItsPinsInTheSnapshot) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/state.json";
  {
    auto c = Make(path);
    ASSERT_TRUE(c->RegisterWorker(Worker("w1")).ok());
    moe::v1::PinRequest pin;
    pin.set_layer(1);
    pin.add_experts(4);
    ASSERT_TRUE(c->Pin(pin, true).ok());
  }
  auto c = Make(path);  // restarted with the state file
  auto r = Worker("w1");
  r.set_current_version(7);
  auto* cur = r.add_current();
  cur->set_layer(1);
  cur->add_experts(4);
  cur->add_experts(6);
  auto reg = c->RegisterWorker(r);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto snap = c->Snapshot("w1", reg->session());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(Experts(*snap, 1), (std::vector<int>{4, 6}));
  EXPECT_EQ(Pinned(*snap, 1), (std::vector<int>{4}));
  EXPECT_TRUE(Pinned(*snap, 0).empty());
}

// Issue 25: a server address workers could not dial is refused at
// registration, naming the field, instead of being routed to.
TEST_F(CoordinatorCore, MalformedServerAddressesAreRefused) {
  auto c = Make();
  for (const char* bad : {"127.0*0.1:2", "host", ":50051", "host:", "host:0", "host:65536", "host:5x", "a..b:1",
                          "[::1:1", "ho st:1", "-:"}) {
    auto s = Server("s1");
    s.set_address(bad);
    const absl::Status st = c->RegisterExpertServer(s).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << st;
    EXPECT_NE(st.message().find("address"), std::string::npos) << st;
  }
  for (const char* good : {"127.0.0.1:50051", "expert-0.moe.svc:1", "[::1]:8080", "localhost:65535"}) {
    auto s = Server("s1");
    s.set_address(good);
    EXPECT_TRUE(c->RegisterExpertServer(s).ok()) << good;
  }
}

// Issue 25, defect 4: nobody takes over a live worker's id — not without its
// session (its own re-registration), and not before its lease runs out —
// so nobody can report (poison popularity) in its name.
TEST_F(CoordinatorCore, ALiveWorkerIdIsTakenOnlyWithItsSessionOrAfterItsLease) {
  auto c = Make();
  auto reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  auto impostor = Worker("w1");
  absl::Status st = c->RegisterWorker(impostor).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists) << st;
  EXPECT_NE(st.message().find("worker_id"), std::string::npos) << st;
  impostor.set_session(reg->session() + 2);  // a guess next to the real one
  EXPECT_EQ(c->RegisterWorker(impostor).status().code(), absl::StatusCode::kAlreadyExists);
  // The real session still reports; the impostor's attempts changed nothing.
  moe::v1::ReportStatsRequest rs;
  rs.set_worker_id("w1");
  rs.set_session(reg->session());
  EXPECT_TRUE(c->ReportStats(rs).ok());
  // The worker itself re-registers with its session.
  auto again = Worker("w1");
  again.set_session(reg->session());
  auto reg2 = c->RegisterWorker(again);
  ASSERT_TRUE(reg2.ok()) << reg2.status();
  EXPECT_NE(reg2->session(), reg->session() + 1) << "sessions are random, not a sequence";
  // After its lease runs out (no heartbeat), the id is free again.
  now_ += 6;  // past heartbeat_timeout_seconds (5)
  EXPECT_TRUE(c->RegisterWorker(Worker("w1")).ok());
}

// With mTLS the worker's certificate is its credential too: a restarted
// worker (no session any more) with the same certificate identity takes its
// id back at once; a caller with another certificate, or none, does not.
TEST_F(CoordinatorCore, ALiveWorkerIdIsTakenBackByTheSameCertificateOnly) {
  auto c = Make();
  auto reg = c->RegisterWorker(Worker("w1"), "worker-1,worker-1.moe.svc");
  ASSERT_TRUE(reg.ok());
  EXPECT_EQ(c->RegisterWorker(Worker("w1"), "worker-2").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c->RegisterWorker(Worker("w1"), "").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c->RegisterWorker(Worker("w1"), "worker-1").status().code(), absl::StatusCode::kAlreadyExists)
      << "one name of the certificate is not the certificate";
  auto back = c->RegisterWorker(Worker("w1"), "worker-1,worker-1.moe.svc");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_NE(back->session(), reg->session());
  // The old session no longer reports for the id.
  moe::v1::ReportStatsRequest rs;
  rs.set_worker_id("w1");
  rs.set_session(reg->session());
  EXPECT_FALSE(c->ReportStats(rs).ok());
}

TEST_F(CoordinatorCore, ReRegistrationKeepsVersionsGrowingAndResumesFromWhatTheWorkerHolds) {
  auto c = Make();
  auto r = Worker("w1");
  r.set_current_version(41);
  auto* cur = r.add_current();
  cur->set_layer(0);
  cur->add_experts(6);
  cur->add_experts(2);
  auto reg = c->RegisterWorker(r);
  ASSERT_TRUE(reg.ok());
  auto snap = c->Snapshot("w1", reg->session());
  ASSERT_TRUE(snap.ok());
  EXPECT_GT(snap->version(), 41u);
  EXPECT_EQ(Experts(*snap, 0), (std::vector<int>{2, 6}));
  // The old session's stream ends when the worker registers again (with its session: its lease is live).
  auto again = Worker("w1");
  again.set_session(reg->session());
  auto reg2 = c->RegisterWorker(again);
  ASSERT_TRUE(reg2.ok());
  EXPECT_EQ(c->WaitForAssignment("w1", reg->session(), 0, std::chrono::steady_clock::now()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_GT(c->Snapshot("w1", reg2->session())->version(), snap->version());
}

// ---------------------------------------------------------------- issue 47: a bounded coordinator

// Defect 3: access counts are checked against the geometry, the worker's MoE
// layers and what it could have routed since its last accepted report (its
// declared rate x top-k, a 30 s burst); a refusal names the field and is
// counted, and nothing of the report is kept.
TEST_F(CoordinatorCore, CountsBeyondWhatTheWorkerCouldRouteAreRefusedNamingTheField) {
  auto c = Make();
  auto expect_invalid = [](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  };
  auto r = Worker("w1");
  r.set_max_tokens_per_second(1000);
  r.set_top_k(2);
  r.add_cached_layers(1);  // layer 0 is dense
  auto reg = c->RegisterWorker(r);
  ASSERT_TRUE(reg.ok()) << reg.status();
  moe::v1::HeartbeatRequest hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1}});
  hb.mutable_counts(0)->set_pairs(0, std::numeric_limits<uint64_t>::max());
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].pairs[0]");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 0, {{3, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].layer: 0 is not an MoE layer");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1}, {5, 1}, {3, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].experts[2]: 3 listed twice");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1}});
  Count(hb, 1, {{4, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[1].layer: 1 listed twice");
  for (const char* field : {"cache_copies", "link_microseconds", "copy_bytes", "cpu_pairs"}) {
    hb = Beat("w1", reg->session(), 0);
    Count(hb, 1, {{3, 1}});
    auto* lc = hb.mutable_counts(0);
    const uint64_t huge = std::numeric_limits<uint64_t>::max();
    if (std::string(field) == "cache_copies") lc->set_cache_copies(huge);
    if (std::string(field) == "link_microseconds") lc->set_link_microseconds(huge);
    if (std::string(field) == "copy_bytes") lc->set_copy_bytes(huge);
    if (std::string(field) == "cpu_pairs") lc->set_cpu_pairs(huge);
    expect_invalid(c->Heartbeat(hb).status(), field);
  }
  moe::v1::ReportStatsRequest rs;
  rs.set_worker_id("w1");
  rs.set_session(reg->session());
  auto* rc = rs.add_counts();
  rc->set_layer(1);
  rc->add_experts(2);
  rc->add_pairs(std::numeric_limits<uint64_t>::max());
  expect_invalid(c->ReportStats(rs), "counts[0].pairs[0]");
  moe::v1::StatusResponse st = c->Status();
  EXPECT_EQ(st.refused_count_reports(), 9u);
  EXPECT_EQ(st.layers(1).pairs(), 0.0) << "nothing of a refused report is kept";
  EXPECT_EQ(st.layers(1).copies_per_second(), 0.0);
  // Within the credit: a fresh worker may report one 30 s burst at once...
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 30000}, {4, 30000}});  // 1000 tokens/s x 30 s per expert, x top_k 2 in the layer
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  // ...then nothing more until time passes...
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].pairs[0]");
  // ...and then what that time allows: 1000 tokens a second, 2 experts each.
  now_ += 1.0;
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1000}, {4, 1000}, {5, 1}});
  expect_invalid(c->Heartbeat(hb).status(), "counts[0].pairs:");
  hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{3, 1000}, {4, 1000}});
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  EXPECT_EQ(c->Status().refused_count_reports(), 11u);
  // Declaring more than the coordinator allows, or a top_k beyond the experts, is refused.
  r = Worker("w2");
  r.set_max_tokens_per_second(2000000);
  expect_invalid(c->RegisterWorker(r).status(), "max_tokens_per_second");
  r = Worker("w2");
  r.set_top_k(9);
  expect_invalid(c->RegisterWorker(r).status(), "top_k");
}

// Defect 3: under union placement one worker's counts (however large) do
// not steer the others' caches: they weigh as much as the median worker's.
TEST_F(CoordinatorCore, UnionPlacementIsNotSteeredByOneWorkersCounts) {
  auto c = Make("", [](CoordinatorOptions& o) {
    o.policy.placement = PlacementMode::kUnion;
    o.policy.replicate_share = 0.4;
  });
  std::map<std::string, uint64_t> session, version;
  for (const std::string id : {"a", "b", "rogue"}) {
    auto r = Worker(id);
    if (id == "rogue") {
      auto* cur = r.add_current();
      cur->set_layer(1);
      cur->add_experts(0);
    }
    auto reg = c->RegisterWorker(r);
    ASSERT_TRUE(reg.ok()) << reg.status();
    session[id] = reg->session();
    version[id] = c->Snapshot(id, reg->session())->version();
  }
  for (const std::string id : {"a", "b"}) {
    auto hb = Beat(id, session[id], version[id]);
    Count(hb, 1, {{4, 40}, {5, 30}, {6, 20}, {7, 10}});
    ASSERT_TRUE(c->Heartbeat(hb).ok());
  }
  auto hb = Beat("rogue", session["rogue"], version["rogue"]);
  Count(hb, 1, {{0, 30000000}});  // all the credit a default worker has: 1e6 tokens/s x 30 s
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  ASSERT_TRUE(c->Rebalance(false).ok());
  for (const std::string id : {"a", "b"}) {
    auto snap = c->Snapshot(id, session[id]);
    ASSERT_TRUE(snap.ok());
    const std::vector<int> set = Experts(*snap, 1);
    EXPECT_EQ(std::count(set.begin(), set.end(), 0), 0) << id << " was given the rogue's expert";
    EXPECT_EQ(set.size(), 2u) << id;
  }
  // The popularity it shows: the rogue's expert at a third of the layer, not all of it.
  moe::v1::PopularityRequest pr;
  pr.set_layer(1);
  auto pop = c->GetPopularity(pr);
  ASSERT_TRUE(pop.ok());
  ASSERT_GT(pop->experts_size(), 0);
  EXPECT_EQ(pop->experts(0).expert(), 0u);
  EXPECT_NEAR(pop->experts(0).share(), 1.0 / 3, 1e-9);
}

// Defect 2: a peer holds at most --max-registrations-per-peer ids (workers,
// and servers); beyond that a new id replaces the peer's longest-silent down
// one, or is refused RESOURCE_EXHAUSTED naming the cap and its flag. Other
// peers, and re-registrations of ids the peer holds, are not affected.
TEST_F(CoordinatorCore, RegistrationsPerPeerAreCappedAndDownOnesMakeRoom) {
  auto c = Make("", [](CoordinatorOptions& o) { o.max_registrations_per_peer = 3; });
  std::map<std::string, uint64_t> session;
  for (const std::string id : {"a", "b", "c"}) {
    auto reg = c->RegisterWorker(Worker(id), "", "uid:1000");
    ASSERT_TRUE(reg.ok()) << reg.status();
    session[id] = reg->session();
  }
  absl::Status refused = c->RegisterWorker(Worker("d"), "", "uid:1000").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max-registrations-per-peer 3"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("uid:1000"), std::string::npos) << refused;
  EXPECT_TRUE(c->RegisterWorker(Worker("e"), "", "uid:1001").ok()) << "another peer has its own cap";
  auto again = Worker("a");
  again.set_session(session["a"]);
  auto a = c->RegisterWorker(again, "", "uid:1000");
  ASSERT_TRUE(a.ok()) << "an id the peer holds registers again: " << a.status();
  // Servers: the same cap, counted apart.
  for (const std::string id : {"s1", "s2", "s3"})
    ASSERT_TRUE(c->RegisterExpertServer(Server(id), "uid:1000").ok());
  EXPECT_EQ(c->RegisterExpertServer(Server("s4"), "uid:1000").status().code(), absl::StatusCode::kResourceExhausted);
  // b and c fall silent (down after the 3 s timeout); a keeps beating.
  now_ += 2;
  ASSERT_TRUE(c->Heartbeat(Beat("a", a->session(), 0)).ok());
  now_ += 2;
  c->Tick();
  auto d = c->RegisterWorker(Worker("d"), "", "uid:1000");
  ASSERT_TRUE(d.ok()) << d.status();
  moe::v1::StatusResponse st = c->Status();
  std::vector<std::string> ids;
  for (const auto& w : st.workers()) ids.push_back(w.worker_id());
  EXPECT_EQ(ids, (std::vector<std::string>{"a", "c", "d", "e"})) << "b (down, silent as long as c, first) made room";
  EXPECT_EQ(st.refused_registrations(), 2u);
  EXPECT_EQ(st.purged_registrations(), 1u);
}

// Leases run out: a peer silent for --purge-after-seconds is forgotten with
// its counts and its metric series; a persisted drain of a forgotten server
// can still be lifted; a forgotten worker registers afresh.
TEST_F(CoordinatorCore, SilentPeersAreForgottenWithTheirCountsAndSeries) {
  auto c = Make("", [](CoordinatorOptions& o) { o.purge_after_seconds = 10; });
  MetricsRegistry registry;
  CoordinatorMetrics metrics(registry, *c);
  auto reg = c->RegisterWorker(Worker("w1"));
  ASSERT_TRUE(reg.ok());
  auto hb = Beat("w1", reg->session(), 0);
  Count(hb, 1, {{5, 10}});
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  ASSERT_TRUE(c->RegisterExpertServer(Server("s1")).ok());
  moe::v1::DrainRequest d;
  d.set_server_id("s1");
  ASSERT_TRUE(c->Drain(d).ok());
  EXPECT_NE(registry.Render().find("worker=\"w1\""), std::string::npos);
  now_ += 5;  // down (3 s), not yet forgotten
  c->Tick();
  ASSERT_EQ(c->Status().workers_size(), 1);
  EXPECT_EQ(c->Status().workers(0).state(), "down");
  now_ += 6;  // 11 s of silence
  c->Tick();
  moe::v1::StatusResponse st = c->Status();
  EXPECT_EQ(st.workers_size(), 0);
  EXPECT_EQ(st.servers_size(), 0);
  EXPECT_EQ(st.purged_registrations(), 2u);
  EXPECT_EQ(st.layers(1).pairs(), 0.0) << "its counts went with it";
  const std::string text = registry.Render();
  EXPECT_EQ(text.find("worker=\"w1\""), std::string::npos) << text;
  EXPECT_NE(text.find("moe_coordinator_purged_registrations_total 2\n"), std::string::npos) << text;
  EXPECT_EQ(c->Heartbeat(Beat("w1", reg->session(), 0)).status().code(), absl::StatusCode::kNotFound);
  d.set_cancel(true);
  auto undrained = c->Drain(d);
  ASSERT_TRUE(undrained.ok()) << undrained.status();
  EXPECT_EQ(undrained->state(), "down");
  EXPECT_TRUE(c->RegisterWorker(Worker("w1")).ok());
}

}  // namespace
}  // namespace moe
