// The dispatcher's cost model without a server: the online estimator
// (OnlineScale), the copy-instead-of-compute decision (ChooseCopies) and its
// check against outcomes (CopyOutcomes).
#include "gpu_worker/cost_model.h"
#include "gpu_worker/copy_outcomes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace moe {
namespace {

TEST(OnlineScaleTest, StaysAtOneUntilEnoughSamples) {
  OnlineScale s(31, 3, 0.1);
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  s.Observe(1.0, 0.5);
  s.Observe(1.0, 0.5);
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  s.Observe(1.0, 0.5);
  EXPECT_DOUBLE_EQ(s.scale(), 0.5);
}

TEST(OnlineScaleTest, MedianIgnoresOutliers) {
  OnlineScale s(31, 3, 0.1);
  for (int i = 0; i < 10; ++i) s.Observe(2e-3, 2e-4);  // truth: 10x faster than predicted
  s.Observe(2e-3, 0.5);                                 // a descheduled thread
  s.Observe(2e-3, 1e-9);                                // a bogus clock reading
  EXPECT_NEAR(s.scale(), 0.1, 1e-9);
}

TEST(OnlineScaleTest, EvenWindowTakesTheMiddlePair) {
  OnlineScale s(4, 1);
  for (double r : {1.0, 2.0, 3.0, 4.0}) s.Observe(1.0, r);
  EXPECT_DOUBLE_EQ(s.scale(), 2.5);
}

TEST(OnlineScaleTest, ForgetsObservationsOutsideTheWindow) {
  OnlineScale s(9, 3);
  for (int i = 0; i < 9; ++i) s.Observe(1.0, 1.0);
  for (int i = 0; i < 9; ++i) s.Observe(1.0, 0.2);
  EXPECT_NEAR(s.scale(), 0.2, 1e-12);
  EXPECT_EQ(s.samples(), 9);
  for (int i = 0; i < 5; ++i) s.Observe(1.0, 3.0);  // the rate changed again: a majority moves it
  EXPECT_NEAR(s.scale(), 3.0, 1e-12);
}

TEST(OnlineScaleTest, UpperBoundsOnlyPullDown) {
  OnlineScale s(31, 1);
  s.Observe(1.0, 2.0);  // exact: the estimate doubles
  EXPECT_DOUBLE_EQ(s.scale(), 2.0);
  s.Observe(1.0, 5.0, /*upper_bound=*/true);  // "at most 5x": no news
  EXPECT_DOUBLE_EQ(s.scale(), 2.0);
  EXPECT_EQ(s.samples(), 1);
  s.Observe(1.0, 0.5, /*upper_bound=*/true);  // "at most 0.5x": the estimate was too high
  s.Observe(1.0, 0.5, /*upper_bound=*/true);
  EXPECT_DOUBLE_EQ(s.scale(), 0.5);
}

TEST(OnlineScaleTest, DeadBandHoldsSmallMovesOnly) {
  OnlineScale s(5, 1, 0.15);
  s.Observe(1.0, 1.0);
  for (int i = 0; i < 5; ++i) s.Observe(1.0, 1.1);  // within 15%: held
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  for (int i = 0; i < 5; ++i) s.Observe(1.0, 1.3);  // beyond: follows
  EXPECT_DOUBLE_EQ(s.scale(), 1.3);
}

TEST(OnlineScaleTest, IgnoresNonsense) {
  OnlineScale s(31, 1);
  s.Observe(0, 1.0);
  s.Observe(1.0, 0);
  s.Observe(-1.0, 1.0);
  s.Observe(1.0, std::numeric_limits<double>::quiet_NaN());
  s.Observe(std::numeric_limits<double>::infinity(), 1.0);
  EXPECT_EQ(s.samples(), 0);
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  s.Observe(1.0, 1e9);  // clamped
  EXPECT_LE(s.scale(), 1e3);
}

// The GPU host's mispriced start-up probe (issue 14): "cpu 0.000 ms/call +
// 1.740 ms/expert", about 15x the truth, with a 0.4 ms expert copy.
CostModel MispricedPrior() {
  CostModel m;
  m.measured = true;
  m.copy_s = 0.4e-3;
  m.device_fixed_s = m.copy_device_fixed_s = 20e-6;
  m.device_row_s = m.copy_device_row_s = 1e-6;
  m.cpu_call_s = 0;
  m.cpu_expert_s = 1.74e-3;
  m.cpu_pair_s = 2e-6;
  return m;
}
constexpr double kTrueCpuExpert = 0.116e-3;

std::vector<CopyCandidate> OneToken(int experts) {
  std::vector<CopyCandidate> c;
  for (int e = 0; e < experts; ++e) c.push_back({e * 3, 1});
  return c;
}

// A copied expert's device time is the copy path's (launches of a few
// experts), not a hit's (one more expert in a big launch): when it outlasts
// the CPU's, copying stops paying, and the launches' timings correct it.
TEST(ChooseCopiesTest, CopiedExpertsArePricedAtTheCopyPathsDeviceRate) {
  CostModel m = MispricedPrior();  // CPU 1.74 ms an expert, copies 0.4 ms, copied compute 84 us
  std::vector<CopyCandidate> c;
  for (int e = 0; e < 8; ++e) c.push_back({e, 64});
  EXPECT_GE(ChooseCopies(m, c, 0).size(), 6u);  // a cheap copy path: the copies pay
  m.copy_device_fixed_s = 3e-3;                  // each copied expert costs 3 ms on the device
  m.copy_device_row_s = 1e-6;
  EXPECT_NEAR(m.CopyDeviceSeconds(64), 3.064e-3, 1e-9);
  const size_t slow = ChooseCopies(m, c, 0).size();
  EXPECT_LE(slow, 3u);
  // Launches timed at a tenth of the prior: the copies pay again.
  for (int i = 0; i < 5; ++i) m.ObserveCopyDevice(2 * m.CopyDevicePrior(64), 0.2 * m.CopyDevicePrior(64));
  EXPECT_NEAR(m.copy_device.scale(), 0.1, 1e-9);
  EXPECT_GT(ChooseCopies(m, c, 0).size(), slow);
}

// The forecast beside the choice (what MissPlan's outcome gate compares):
// every candidate on the CPU is the CPU's whole time (the device's when
// longer); the choice's is no longer than that, and equal when nothing moves.
TEST(ChooseCopiesTest, ForecastsTheCallWithAndWithoutItsCopies) {
  CostModel m = MispricedPrior();  // CPU 1.74 ms an expert at 64 rows, copies 0.4 ms
  std::vector<CopyCandidate> c;
  for (int e = 0; e < 8; ++e) c.push_back({e, 64});
  double cpu = m.CpuSeconds(0, 0);
  for (const CopyCandidate& x : c) cpu += m.CpuSeconds(1, x.rows, false);
  CopyForecast f;
  const std::vector<int> chosen = ChooseCopies(m, c, 1e-4, 0, &f);
  ASSERT_GE(chosen.size(), 6u);
  EXPECT_NEAR(f.all_cpu_s, cpu, 1e-12);
  EXPECT_LT(f.chosen_s, 0.5 * f.all_cpu_s);
  EXPECT_GE(f.chosen_s, chosen.size() * m.CopySeconds());  // the link carries every copy
  // The device already busier than the whole CPU share: nothing moves.
  EXPECT_TRUE(ChooseCopies(m, c, 10 * cpu, 0, &f).empty());
  EXPECT_NEAR(f.all_cpu_s, 10 * cpu, 1e-12);
  EXPECT_NEAR(f.chosen_s, f.all_cpu_s, 1e-12);
}

TEST(ChooseCopiesTest, NothingWithoutMeasuredRates) {
  CostModel m;
  EXPECT_TRUE(ChooseCopies(m, OneToken(8), 0).empty());
}

TEST(ChooseCopiesTest, OnlineCpuTimesStopCopyingAtOneToken) {
  CostModel m = MispricedPrior();
  // The prior alone copies most of the misses (what the GPU host saw)...
  const std::vector<int> before = ChooseCopies(m, OneToken(8), 0);
  EXPECT_GE(before.size(), 6u);
  EXPECT_LT(before.size(), 8u);
  // ...the CPU batches it still sends are timed at the truth...
  const int cpu_experts = 8 - static_cast<int>(before.size());
  for (int call = 0; call < 3; ++call)
    m.ObserveCpu(cpu_experts, cpu_experts, cpu_experts * kTrueCpuExpert, /*upper_bound=*/false);
  // ...and from then on most misses stay on the CPU, which is faster than a
  // copy: at most the one or two a copy running beside the CPU takes off its
  // critical path (8 x 0.116 ms on the CPU vs 0.4 ms per copy).
  EXPECT_NEAR(m.CpuSeconds(1, 1, false), kTrueCpuExpert, 0.01e-3);
  const std::vector<int> after = ChooseCopies(m, OneToken(8), 0);
  EXPECT_LE(after.size(), 2u);
  const double step = std::max(m.CpuSeconds(8 - static_cast<int>(after.size()), 8 - static_cast<int>(after.size())),
                               after.size() * m.CopySeconds());
  EXPECT_LE(step, m.CpuSeconds(8, 8));  // never worse than all on the CPU, by the model
  for (int call = 0; call < 50; ++call) EXPECT_EQ(ChooseCopies(m, OneToken(8), 0), after) << call;
}

TEST(ChooseCopiesTest, OneTokenWithAFastCpuCopiesNothing) {
  CostModel m = MispricedPrior();
  m.cpu_expert_s = 0.03e-3;  // the CPU reads an expert 13x faster than PCIe copies it
  EXPECT_TRUE(ChooseCopies(m, OneToken(8), 0).empty());
}

TEST(ChooseCopiesTest, NeverCopiesEverythingForeverAtOneToken) {
  // A prior so wrong that the greedy balance copies every miss: no CPU batch,
  // so no observation to correct it — unless the model explores.
  CostModel m = MispricedPrior();
  m.cpu_expert_s = 20e-3;
  int all_copied = 0, kept_on_cpu = 0;
  for (int call = 0; call < 40; ++call) {
    const std::vector<int> chosen = ChooseCopies(m, OneToken(8), 0);
    if (chosen.size() == 8) {
      ++all_copied;
    } else {
      ++kept_on_cpu;
      // The batch the dispatcher sends is timed: here at the truth.
      const int n = 8 - static_cast<int>(chosen.size());
      m.ObserveCpu(n, n, n * kTrueCpuExpert, false);
    }
  }
  EXPECT_LE(all_copied, 3 * CostModel::kExploreAfter);
  EXPECT_GE(kept_on_cpu, 3);
  // Corrected: the CPU is faster than a copy at one token; at most a copy that
  // runs beside it (as above), never every miss.
  EXPECT_LE(ChooseCopies(m, OneToken(8), 0).size(), 2u);
}

TEST(ChooseCopiesTest, CopiesTheExpertsWithManyRowsAtLargeBatches) {
  CostModel m = MispricedPrior();
  m.cpu_expert_s = kTrueCpuExpert;
  m.cpu_pair_s = 40e-6;  // prefill-like: the CPU is compute bound per pair
  std::vector<CopyCandidate> c = {{5, 1}, {9, 400}, {11, 2}, {17, 300}};
  const std::vector<int> chosen = ChooseCopies(m, c, 0);
  ASSERT_EQ(chosen.size(), 2u);
  EXPECT_EQ(chosen[0], 9);   // most rows first
  EXPECT_EQ(chosen[1], 17);
}

TEST(ChooseCopiesTest, BusyDeviceKeepsMissesOnTheCpu) {
  CostModel m = MispricedPrior();
  m.cpu_expert_s = kTrueCpuExpert;
  m.cpu_pair_s = 40e-6;
  std::vector<CopyCandidate> c = {{9, 400}};
  EXPECT_EQ(ChooseCopies(m, c, 0).size(), 1u);
  EXPECT_TRUE(ChooseCopies(m, c, 1.0).empty());  // a second of hits already queued
}

// A copy queue already busy (cache copies of earlier calls) delays the call's
// copies: with a backlog longer than the CPU would take, nothing is copied.
TEST(ChooseCopiesTest, LinkBacklogKeepsMissesOnTheCpu) {
  CostModel m = MispricedPrior();
  m.cpu_expert_s = kTrueCpuExpert;
  m.cpu_pair_s = 40e-6;
  std::vector<CopyCandidate> c = {{9, 400}, {17, 300}};
  EXPECT_EQ(ChooseCopies(m, c, 0, 0).size(), 2u);
  EXPECT_TRUE(ChooseCopies(m, c, 0, 1.0).empty());  // a second of copies queued
}

// Noisy timings (+-30%, and 5% of calls stalled 20x) around a fixed truth
// whose decision sits near the copy threshold: once the estimate settled, the
// decision for the same routing keeps (the estimator's dead band keeps it from
// flapping with the noise): at most two changes in 500 calls, for any seed.
TEST(ChooseCopiesTest, DecisionsAreStableUnderNoise) {
  const std::vector<CopyCandidate> routing = {{1, 1}, {2, 1}, {3, 2}, {4, 1}, {5, 1}, {6, 3}, {7, 1}, {8, 1}};
  for (unsigned seed = 1; seed <= 8; ++seed) {
    CostModel m = MispricedPrior();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> jitter(0.7, 1.3);
    std::uniform_int_distribution<int> stall(0, 19);
    std::vector<int> previous;
    int changes = 0;
    size_t most_copied = 0;
    for (int call = 0; call < 600; ++call) {
      const std::vector<int> chosen = ChooseCopies(m, routing, 0);
      if (call > 100) {  // settled: the 63-call window turned over
        changes += chosen != previous;
        most_copied = std::max(most_copied, chosen.size());
      }
      previous = chosen;
      int experts = 0, pairs = 0;
      for (const CopyCandidate& c : routing)
        if (std::find(chosen.begin(), chosen.end(), c.expert) == chosen.end()) {
          ++experts;
          pairs += c.rows;
        }
      if (experts == 0) continue;
      double t = (experts * kTrueCpuExpert + pairs * 2e-6) * jitter(rng);
      if (stall(rng) == 0) t *= 20;
      m.ObserveCpu(experts, pairs, t, false);
    }
    EXPECT_LE(changes, 2) << "seed " << seed;
    EXPECT_LE(most_copied, 2u) << "seed " << seed;  // at decode sizes the CPU keeps most misses
  }
}

TEST(CostModelTest, ObservationsNeedAPrior) {
  CostModel m;
  m.ObserveCpu(1, 1, 1e-3, false);
  m.ObserveCopy(1e-3, false);
  m.ObserveDevice(1e-3, 1e-3, false);
  m.ObserveCopyDevice(1e-3, 1e-3);
  EXPECT_EQ(m.cpu.samples() + m.copy.samples() + m.device.samples() + m.copy_device.samples(), 0);
  EXPECT_EQ(m.Describe(), "not measured");
}

TEST(CostModelTest, DescribeShowsTheCorrectedRates) {
  CostModel m = MispricedPrior();
  for (int i = 0; i < 3; ++i) m.ObserveCpu(4, 4, 4 * kTrueCpuExpert, false);
  const std::string d = m.Describe();
  EXPECT_NE(d.find("0.11"), std::string::npos) << d;  // ~0.116 ms/expert
  EXPECT_NE(d.find("3 samples"), std::string::npos) << d;
}

// Simulated calls of one shape whose two choices take `model_s` / `cpu_s`
// seconds (+-2% noise); returns how many of `calls` took each choice.
struct Taken {
  int model = 0, cpu = 0;
};
Taken RunOutcomes(CopyOutcomes& o, int bucket, int calls, double model_s, double cpu_s, std::mt19937& rng) {
  std::uniform_real_distribution<double> noise(0.98, 1.02);
  Taken t;
  for (int i = 0; i < calls; ++i) {
    const CopyChoice c = o.Choose(bucket);
    (c == CopyChoice::kModel ? t.model : t.cpu) += 1;
    o.Observe(bucket, c, (c == CopyChoice::kModel ? model_s : cpu_s) * noise(rng));
  }
  return t;
}

TEST(CopyOutcomesTest, CopiesThatLoseStopAndAreTriedLessAndLessOften) {
  std::mt19937 rng(1);
  CopyOutcomes o;
  const int b = CopyOutcomes::DeviceBucket(2);
  // Copying costs 7.6 ms where the CPU takes 3.7 (a Mixtral expert at one token).
  const Taken first = RunOutcomes(o, b, 20, 7.6e-3, 3.7e-3, rng);
  EXPECT_GE(first.cpu, 14);
  EXPECT_EQ(o.vetoed_buckets(), 1);
  const Taken later = RunOutcomes(o, b, 2000, 7.6e-3, 3.7e-3, rng);
  EXPECT_LE(later.model, 10) << "explorations back off 8, 16, ... 512 calls apart";
  EXPECT_GE(later.model, 3) << "but never stop";
  EXPECT_NE(o.Describe().find("1 of 1 call shapes"), std::string::npos) << o.Describe();
}

TEST(CopyOutcomesTest, CopiesThatWinAreKept) {
  std::mt19937 rng(2);
  CopyOutcomes o;
  const int b = CopyOutcomes::HostBucket(12, 12 * 256);
  const Taken t = RunOutcomes(o, b, 2000, 20e-3, 31e-3, rng);
  EXPECT_GE(t.model, 1985);
  EXPECT_EQ(o.vetoed_buckets(), 0);
}

TEST(CopyOutcomesTest, WithinTheMarginTheModelDecides) {
  std::mt19937 rng(3);
  CopyOutcomes o;
  const Taken t = RunOutcomes(o, 5, 1000, 1.01e-3, 1.0e-3, rng);
  EXPECT_GE(t.model, 950);
}

TEST(CopyOutcomesTest, FollowsAChangeBackWithinTheLongestInterval) {
  std::mt19937 rng(4);
  CopyOutcomes o;
  RunOutcomes(o, 7, 3000, 2e-3, 1e-3, rng);  // copies lose for a long time: explorations far apart
  ASSERT_EQ(o.Peek(7), CopyChoice::kCpu);
  // Then the link frees up: copies win. Within one longest interval (and the
  // few explorations the average needs) the bucket copies again.
  const Taken t = RunOutcomes(o, 7, 2 * CopyOutcomes::kExploreMax, 0.5e-3, 1e-3, rng);
  EXPECT_EQ(o.Peek(7), CopyChoice::kModel);
  EXPECT_GE(t.model, 16);
}

TEST(CopyOutcomesTest, BucketsAreIndependentAndPeekMatchesChoose) {
  std::mt19937 rng(5);
  CopyOutcomes o;
  const int b1 = CopyOutcomes::DeviceBucket(1), b3 = CopyOutcomes::DeviceBucket(3);
  ASSERT_NE(b1, b3);
  EXPECT_EQ(b3, CopyOutcomes::DeviceBucket(4));
  RunOutcomes(o, b1, 100, 2e-3, 1e-3, rng);
  RunOutcomes(o, b3, 100, 1e-3, 2e-3, rng);
  for (int i = 0; i < 300; ++i)
    for (int b : {b1, b3}) {
      const CopyChoice peek = o.Peek(b);
      const CopyChoice c = o.Choose(b);
      ASSERT_EQ(peek, c);
      o.Observe(b, c, (c == CopyChoice::kModel) == (b == b1) ? 2e-3 : 1e-3);
    }
  EXPECT_EQ(o.vetoed_buckets(), 1);  // b1's copies lose, b3's win
  EXPECT_EQ(o.Peek(CopyOutcomes::DeviceBucket(9)), CopyChoice::kModel);  // unseen: the model
  EXPECT_EQ(CopyOutcomes::DeviceBucket(1 << 20), 15);
  EXPECT_NE(CopyOutcomes::HostBucket(4, 4), CopyOutcomes::HostBucket(4, 64));
  EXPECT_NE(CopyOutcomes::HostBucket(4, 64), CopyOutcomes::HostBucket(8, 128));
  o.Observe(1, CopyChoice::kModel, -1);  // ignored
  o.Observe(1, CopyChoice::kModel, std::numeric_limits<double>::quiet_NaN());
}

TEST(CopyOverlapTest, TheDelayIsTheDifferenceOfTheShapesSeenBothWays) {
  CopyOverlap o;
  EXPECT_EQ(o.delay_s(), 0.0);
  for (int i = 0; i < CopyOverlap::kMinSamples; ++i) {
    o.Observe(1, false, 1e-3);
    o.Observe(1, true, 1.3e-3);
    o.Observe(4, false, 5e-3);  // seen without copies only: no weight
  }
  EXPECT_NEAR(o.delay_s(), 0.3e-3, 1e-12);
  for (int i = 0; i < CopyOverlap::kMinSamples; ++i) {
    o.Observe(3, false, 2e-3);
    o.Observe(3, true, 2.1e-3);
  }
  EXPECT_NEAR(o.delay_s(), 0.2e-3, 1e-12);  // both shapes, weighed alike
  CopyOverlap faster;  // calls beside copies that came out faster: no negative price
  for (int i = 0; i < CopyOverlap::kMinSamples; ++i) {
    faster.Observe(2, false, 2e-3);
    faster.Observe(2, true, 1e-3);
  }
  EXPECT_EQ(faster.delay_s(), 0.0);
  faster.Observe(-1, true, 1.0);
  faster.Observe(2, true, std::numeric_limits<double>::infinity());
  EXPECT_EQ(faster.observed(), 2u * CopyOverlap::kMinSamples);
  // Shapes: a decode call and a prompt missing as many experts never share one.
  EXPECT_NE(CopyOverlap::Shape(1, 4), CopyOverlap::Shape(2048, 4));
  EXPECT_EQ(CopyOverlap::Shape(3, 5), CopyOverlap::Shape(4, 8));
  EXPECT_NE(CopyOverlap::Shape(4, 8), CopyOverlap::Shape(4, 9));
}

}  // namespace
}  // namespace moe
