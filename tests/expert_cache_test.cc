// ExpertCache: slot bookkeeping, LRU / LFRU eviction order, static
// assignments, counters, and the rule that a slot is used only after its copy
// completed.
#include <algorithm>

#include "gpu_worker/expert_cache.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::unique_ptr<ExpertCache> Make(CachePolicy p, int slots = 2, double half_life = 64) {
  ExpertCacheConfig c;
  c.num_layers = 2;
  c.num_experts = 8;
  c.slots_per_layer = slots;
  c.policy = p;
  c.lfru_half_life = half_life;
  absl::StatusOr<std::unique_ptr<ExpertCache>> cache = ExpertCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

// One access of `layer` by `experts` (one pair each); admits misses; completes every copy.
std::vector<SlotCopy> Step(ExpertCache& c, int layer, const std::vector<int>& experts) {
  std::vector<int> missed;
  for (int e : experts) {
    if (c.ReadySlot(layer, e) < 0) missed.push_back(e);
  }
  c.RecordAccess(layer, experts, std::vector<int>(experts.size(), 1));
  std::vector<SlotCopy> copies = c.PlanAdmissions(layer, missed, 8);
  for (const SlotCopy& k : copies) c.CompleteCopy(k);
  return copies;
}

std::vector<int> Resident(const ExpertCache& c, int layer) {
  std::vector<int> r = c.SlotExperts(layer);
  r.erase(std::remove(r.begin(), r.end(), -1), r.end());
  std::sort(r.begin(), r.end());
  return r;
}

TEST(ExpertCache, SlotIsUsedOnlyAfterItsCopyCompleted) {
  auto c = Make(CachePolicy::kLru);
  c->RecordAccess(0, {3}, {1});
  std::vector<SlotCopy> copies = c->PlanAdmissions(0, {3}, 8);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(c->ReadySlot(0, 3), -1) << "loading slot must not be used";
  EXPECT_EQ(c->SlotMap(0)[3], -1);
  const uint64_t v = c->version();
  c->CompleteCopy(copies[0]);
  EXPECT_EQ(c->ReadySlot(0, 3), copies[0].slot);
  EXPECT_GT(c->version(), v);
  // Layers are independent.
  EXPECT_EQ(c->ReadySlot(1, 3), -1);
}

TEST(ExpertCache, LruEvictsTheLeastRecentlyUsed) {
  auto c = Make(CachePolicy::kLru);
  Step(*c, 0, {1});
  Step(*c, 0, {2});
  EXPECT_EQ(Resident(*c, 0), std::vector<int>({1, 2}));
  Step(*c, 0, {1});  // 1 is now more recent than 2
  std::vector<SlotCopy> copies = Step(*c, 0, {5});
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].evicted, 2);
  EXPECT_EQ(Resident(*c, 0), std::vector<int>({1, 5}));
  // An expert used by the current access is never evicted by it.
  copies = Step(*c, 0, {1, 5, 6});
  EXPECT_TRUE(copies.empty());
}

TEST(ExpertCache, LfruKeepsFrequentExpertsAgainstOneOffs) {
  auto lru = Make(CachePolicy::kLru);
  auto lfru = Make(CachePolicy::kLfru, 2, 1000);
  for (auto* c : {lru.get(), lfru.get()}) {
    for (int i = 0; i < 10; ++i) Step(*c, 0, {1, 2});  // 1 and 2 are hot
    Step(*c, 0, {7});                                  // a one-off
  }
  EXPECT_NE(Resident(*lru, 0), std::vector<int>({1, 2})) << "LRU lets the one-off in";
  EXPECT_EQ(Resident(*lfru, 0), std::vector<int>({1, 2})) << "LFRU keeps the hot pair";
  // With decay, a new hot expert does take over eventually.
  for (int i = 0; i < 50; ++i) Step(*lfru, 0, {6});
  const std::vector<int> r = Resident(*lfru, 0);
  EXPECT_TRUE(std::find(r.begin(), r.end(), 6) != r.end());
}

TEST(ExpertCache, StaticAssignmentAndNoAdmissions) {
  auto c = Make(CachePolicy::kStatic, 3);
  absl::StatusOr<std::vector<SlotCopy>> copies = c->Assign(1, {4, 0, 6});
  ASSERT_TRUE(copies.ok());
  EXPECT_EQ(copies->size(), 3u);
  for (const SlotCopy& k : *copies) c->CompleteCopy(k);
  EXPECT_EQ(Resident(*c, 1), std::vector<int>({0, 4, 6}));
  EXPECT_TRUE(Step(*c, 1, {2}).empty()) << "static never admits on a miss";
  // Reassign: 4 stays in its slot, 0 and 6 go, 1 and 2 come.
  const int slot4 = c->ReadySlot(1, 4);
  copies = c->Assign(1, {1, 4, 2});
  ASSERT_TRUE(copies.ok());
  EXPECT_EQ(copies->size(), 2u);
  EXPECT_EQ(c->ReadySlot(1, 4), slot4);
  EXPECT_EQ(c->ReadySlot(1, 0), -1);  // evicted at once, before any copy completes
  EXPECT_EQ(c->ReadySlot(1, 1), -1);  // not ready until copied
  c->AbortCopy((*copies)[0]);
  c->CompleteCopy((*copies)[1]);
  EXPECT_EQ(Resident(*c, 1).size(), 2u);
  EXPECT_FALSE(c->Assign(1, {1, 2, 3, 5}).ok());  // more than C
  EXPECT_FALSE(c->Assign(1, {1, 1}).ok());
  EXPECT_FALSE(c->Assign(1, {9}).ok());
}

TEST(ExpertCache, CountsHitsAndMissesByPairs) {
  auto c = Make(CachePolicy::kLru);
  Step(*c, 0, {1});
  c->RecordAccess(0, {1, 2}, {5, 3});
  EXPECT_EQ(c->hits(0, 1), 5u);
  EXPECT_EQ(c->misses(0, 1), 1u);
  EXPECT_EQ(c->misses(0, 2), 3u);
  EXPECT_DOUBLE_EQ(c->HitRate(0), 5.0 / 9.0);
  EXPECT_EQ(c->HitRate(1), 0.0);
}

TEST(ExpertCache, RejectsBadConfigs) {
  ExpertCacheConfig c{2, 8, 9, CachePolicy::kLru, 64};
  EXPECT_FALSE(ExpertCache::Create(c).ok());
  c.slots_per_layer = 2;
  c.lfru_half_life = 0;
  EXPECT_FALSE(ExpertCache::Create(c).ok());
}

}  // namespace
}  // namespace moe
