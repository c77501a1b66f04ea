// Tensor-parallel groups (issue 26 point 1): one session per rank, every rank
// given the same tokens and routing; each returns the partial sum of the
// pairs of the experts its rank owns, so the ranks' outputs summed (what the
// engine's all-reduce does) equal the reference MoE, and their caches hold
// disjoint experts (one cache of their summed size). Real expert servers,
// the engine API (MoeSession), the cpu backend and — where a GPU is — the cuda
// backend with host and device memory (the device path skips other ranks'
// pairs on the GPU). Plus the pure pieces: ExpertOwner, placement per rank.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/placement.h"
#include "model/model_source.h"
#include "model/reference_moe.h"
#include "gpu_worker/device_backend.h"
#include "gtest/gtest.h"
#include "moe/engine.h"
#include "tests/device_call.h"
#include "tests/test_support.h"

namespace moe {
namespace {

const char kModel[] = "synthetic:demo:layers=2:seed=33";  // H=512, I=256, 32 experts, top-4
constexpr int kH = 512, kE = 32, kK = 4;

TEST(ExpertOwner, EveryExpertHasExactlyOneOwnerAndTheSharesAreEven) {
  for (int size : {1, 2, 3, 8}) {
    for (int layer : {0, 1, 7}) {
      std::vector<int> per_rank(size, 0);
      for (int e = 0; e < kE; ++e) {
        const int r = ExpertOwner(layer, e, size);
        ASSERT_GE(r, 0);
        ASSERT_LT(r, size);
        ++per_rank[r];
      }
      const auto [lo, hi] = std::minmax_element(per_rank.begin(), per_rank.end());
      EXPECT_LE(*hi - *lo, 1) << size << " ranks";
    }
  }
  // Shifted by the layer: rank 0 does not own expert 0 in every layer.
  EXPECT_NE(ExpertOwner(0, 0, 2), ExpertOwner(1, 0, 2));
}

// The coordinator places each rank's own experts only: the hottest of its
// share, disjoint from the other rank's, pins of other ranks' experts skipped.
TEST(Placement, RanksOfAGroupGetDisjointSetsOfTheirOwnExperts) {
  for (PlacementMode mode : {PlacementMode::kPerWorker, PlacementMode::kUnion}) {
    PlacementProblem p;
    p.num_layers = 2;
    p.num_experts = kE;
    p.params.mode = mode;
    p.global_popularity.assign(2, std::vector<double>(kE, 0.0));
    for (int l = 0; l < 2; ++l)
      for (int e = 0; e < kE; ++e) p.global_popularity[l][e] = 1000.0 / (1 + e);  // expert 0 hottest
    for (int r = 0; r < 2; ++r) {
      WorkerPlacementState w;
      w.id = "rank" + std::to_string(r);
      w.slots_per_layer = 4;
      w.group = TensorParallel(r, 2);
      w.cached = {true, true};
      w.resident.assign(2, {});
      w.pinned = {{0, 1}, {}};  // expert 1 of layer 0 is rank 1's
      p.workers.push_back(w);
    }
    const PlacementPlan plan = PlanPlacement(p);
    for (int l = 0; l < 2; ++l) {
      std::set<int> seen;
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(plan.sets[r][l].size(), 4u);
        for (int e : plan.sets[r][l]) {
          EXPECT_EQ(ExpertOwner(l, e, 2), r) << "layer " << l << " expert " << e;
          EXPECT_TRUE(seen.insert(e).second) << "expert " << e << " on both ranks";
        }
      }
      EXPECT_EQ(seen.size(), 8u);  // 8 distinct experts: the union of two caches of 4
      // Each rank holds the hottest of its share.
      for (int r = 0; r < 2; ++r) {
        std::vector<int> want;
        for (int e = 0; e < kE && want.size() < 4; ++e)
          if (ExpertOwner(l, e, 2) == r) want.push_back(e);
        EXPECT_EQ(plan.sets[r][l], want) << "rank " << r << " layer " << l;
      }
    }
  }
}

struct Batch {
  int T = 0;
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

// Routing skewed toward low ids (a hot set larger than one rank's cache).
Batch SkewedBatch(int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1), pw(0.1f, 1);
  Batch b{T, std::vector<bf16_t>(static_cast<size_t>(T) * kH), std::vector<int32_t>(T * kK), std::vector<float>(T * kK)};
  for (bf16_t& v : b.x) v = F32ToBf16(u(rng));
  std::geometric_distribution<int> g(0.12);
  for (int t = 0; t < T; ++t) {
    std::set<int> chosen;
    while (static_cast<int>(chosen.size()) < kK) chosen.insert(std::min(g(rng), kE - 1));
    int j = 0;
    for (int e : chosen) {
      b.ids[t * kK + j] = e;
      b.w[t * kK + j] = pw(rng);
      ++j;
    }
  }
  return b;
}

// Parameter: (device backend, memory kind of the calls).
class TensorParallelTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (!MakeDeviceBackend(backend()).ok()) GTEST_SKIP() << backend() << " backend unavailable";
    if (device_memory() && backend() != "cuda") GTEST_SKIP() << "device memory needs the cuda backend";
    const std::string sock = dir_.path() + "/s.sock";
    Subprocess* s = nullptr;
    const std::string addr = testing::StartExpertServer(
        &s, {std::string("--model=") + kModel, "--threads=1", "--shm-socket=" + sock});
    server_.reset(s);
    ASSERT_FALSE(addr.empty());
    address_ = "unix://" + sock;
    source_ = *OpenModel(kModel);
    reference_ = std::make_unique<ReferenceMoe>(*source_);
  }
  const std::string& backend() const { return std::get<0>(GetParam()); }
  bool device_memory() const { return std::get<1>(GetParam()) == "device"; }

  std::unique_ptr<MoeSession> Open(ParallelGroup group, int cache, const std::string& policy) {
    SessionOptions o;
    o.model = kModel;
    o.servers = {address_};
    o.device = *ParseDeviceChoice(backend());
    o.cache_experts_per_layer = cache;
    o.policy = *ParseCachePolicy(policy);
    o.max_tokens = 64;
    o.max_top_k = kK;
    o.cpu_threads = 1;
    o.group = group;
    absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // One layer call on `s`; the output as f32.
  std::vector<float> Forward(MoeSession& s, int layer, const Batch& b, CallStats* st) {
    std::vector<bf16_t> out(b.x.size(), F32ToBf16(123.0f));
    if (!device_memory()) {
      absl::Status r = s.ForwardLayer(layer, b.T, kK, b.x.data(), b.ids.data(), b.w.data(), out.data(),
                                      MemoryKind::kHost, st);
      EXPECT_TRUE(r.ok()) << r;
    } else {
#ifdef MOE_HAVE_CUDA
      testing::DeviceCall dev(b.x, b.ids, b.w);
      EXPECT_TRUE(dev.ok());
      absl::Status r =
          s.ForwardLayer(layer, b.T, kK, dev.x(), dev.ids(), dev.weights(), dev.out(), MemoryKind::kDevice, st);
      EXPECT_TRUE(r.ok()) << r;
      out = dev.Output();
#endif
    }
    std::vector<float> f(out.size());
    for (size_t i = 0; i < out.size(); ++i) f[i] = Bf16ToF32(out[i]);
    return f;
  }

  double Error(int layer, const Batch& b, const std::vector<float>& got) {
    std::vector<double> ref(got.size());
    EXPECT_TRUE(reference_->Forward<double>(layer, b.T, b.x.data(), RoutingView{b.T, kK, b.ids.data(), b.w.data()},
                                            ref.data()).ok());
    return RelativeL2Error(got.data(), ref.data(), ref.size());
  }

  testing::TempDir dir_;
  std::unique_ptr<Subprocess> server_;
  std::string address_;
  std::unique_ptr<ModelSource> source_;
  std::unique_ptr<ReferenceMoe> reference_;
};

TEST_P(TensorParallelTest, RanksPartialSumsAddUpToTheLayerAndTheirCachesAreDisjoint) {
  constexpr int kRanks = 2, kCache = 4;
  std::vector<std::unique_ptr<MoeSession>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(Open(TensorParallel(r, kRanks), kCache, "lru"));
    ASSERT_NE(ranks.back(), nullptr);
  }
  for (int step = 0; step < 12; ++step) {
    for (int layer : {0, 1}) {
      const Batch b = SkewedBatch(step % 3 == 0 ? 1 : 16, 1000 * step + layer);
      std::vector<float> sum(b.x.size(), 0.0f);
      int pairs = 0;
      for (int r = 0; r < kRanks; ++r) {
        CallStats st;
        const std::vector<float> part = Forward(*ranks[r], layer, b, &st);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];  // the engine's all-reduce
        int owned = 0;
        for (int e : b.ids) owned += e >= 0 && ExpertOwner(layer, e, kRanks) == r;
        EXPECT_EQ(st.hit_pairs + st.cpu_pairs + st.copied_pairs, owned) << "rank " << r;
        pairs += st.hit_pairs + st.cpu_pairs + st.copied_pairs;
      }
      EXPECT_EQ(pairs, b.T * kK);  // every pair computed exactly once
      EXPECT_LE(Error(layer, b, sum), 1e-2) << "step " << step << " layer " << layer;
    }
    for (auto& r : ranks) ASSERT_TRUE(r->admin().FlushCopies().ok());
  }
  // One cache of the ranks' summed size: each rank's experts are its own.
  for (int layer : {0, 1}) {
    std::set<int> all;
    size_t cached = 0;
    for (int r = 0; r < kRanks; ++r)
      for (int e : ranks[r]->admin().CachedExperts(layer)) {
        EXPECT_EQ(ExpertOwner(layer, e, kRanks), r) << "layer " << layer << " expert " << e;
        all.insert(e);
        ++cached;
      }
    EXPECT_EQ(all.size(), cached);
    EXPECT_GT(cached, static_cast<size_t>(kCache));  // more distinct experts than one rank's cache
  }
  // Placement pushed from outside may not give a rank another rank's expert.
  const int foreign = ExpertOwner(0, 0, kRanks) == 0 ? 1 : 0;  // an expert of layer 0 rank 0 does not own
  absl::Status s = ranks[0]->admin().ApplyAssignment(0, {foreign});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("belongs to rank"), std::string::npos) << s;
}

TEST(TensorParallelOptions, BadGroupsAreRefusedNamingTheField) {
  for (ParallelGroup g : {TensorParallel(2, 2), TensorParallel(-1, 2), TensorParallel(0, 0),
                                TensorParallel(0, kE + 1)}) {
    SessionOptions o;
    o.model = kModel;
    o.device = DeviceChoice::kCpu;
    o.servers = {"unix:///nonexistent.sock"};
    o.group = g;
    absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    EXPECT_NE(s.status().message().find("group (rank, size; mode tensor)"), std::string::npos) << s.status();
  }
}

// Expert parallelism needs the cuda backend (and NCCL): elsewhere Open
// refuses it naming the group, before any communicator is made.
TEST(ExpertParallelOptions, RefusedWithoutTheCudaBackendNamingTheGroup) {
  SessionOptions o;
  o.model = kModel;
  o.device = DeviceChoice::kCpu;
  o.servers = {"unix:///nonexistent.sock"};
  o.group.rank = 0;
  o.group.size = 2;
  o.group.mode = GroupMode::kExpert;
  o.group.id = std::string(256, '0');
  absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("group"), std::string::npos) << s.status();
}

INSTANTIATE_TEST_SUITE_P(Backends, TensorParallelTest,
                         ::testing::Combine(::testing::Values("cpu", "cuda"), ::testing::Values("host", "device")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace
}  // namespace moe
