// bench/model/step_floor: the causal and oracle floors of a benchmark step
// equal the minimum of their model over every split of every call's uncached
// experts between the CPU and copies (a brute force over subsets), and keep
// the order the model implies (oracle <= causal, both <= any one strategy).
#include "bench/model/step_floor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace moe {
namespace {

FloorRates Rates() {
  FloorRates f;
  f.dram_Bps = 100e9;
  f.shared_Bps = 130e9;
  f.pcie_Bps = 50e9;
  f.cpu_flops = 4e12;
  f.cpu_bytes = 9.4e6;
  f.copy_bytes = 9.4e6;
  f.flops_per_row = 6.0 * 2048 * 768;
  f.num_experts = 16;
  return f;
}

// The floor's model, minimised over every subset of every call's experts
// on the CPU (not only the fewest-row ones).
double BruteForce(const std::vector<std::vector<int>>& calls, double attention_s, const FloorRates& f, bool causal) {
  auto per = [](double a, double r) { return r > 0 ? a / r : 0.0; };
  const double shared = std::max(f.shared_Bps, f.dram_Bps);
  const double first_attention = calls.empty() ? 0 : attention_s / calls.size();
  std::vector<size_t> masks(calls.size(), 0);
  double best = 1e300;
  while (true) {
    double sequential = attention_s, link = 0, dram = 0, early_copies = 0;
    for (size_t l = 0; l < calls.size(); ++l) {
      const std::vector<int>& rows = calls[l];
      double pairs = 0, cpu_rows = 0, n = 0, c = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        pairs += rows[i];
        if (masks[l] >> i & 1) n += 1, cpu_rows += rows[i];
        else c += 1;
      }
      const double cpu = std::max(per(n * f.cpu_bytes, f.dram_Bps), per(cpu_rows * f.flops_per_row, f.cpu_flops));
      const bool early = !causal || pairs >= kCertainPairsPerExpert * f.num_experts;
      if (rows.empty()) continue;
      if (early) {
        sequential += cpu;
        link += per(c * f.copy_bytes, f.pcie_Bps);
        early_copies += c;
        dram += per(n * f.cpu_bytes + c * f.copy_bytes, shared);
      } else {
        sequential += std::max({cpu, per(c * f.copy_bytes, f.pcie_Bps), per(n * f.cpu_bytes + c * f.copy_bytes, shared)});
      }
    }
    best = std::min(best, std::max({sequential, early_copies > 0 ? first_attention + link : 0.0, dram}));
    size_t l = 0;
    for (; l < calls.size(); ++l) {
      if (++masks[l] < (size_t{1} << calls[l].size())) break;
      masks[l] = 0;
    }
    if (l == calls.size()) break;
  }
  return best;
}

std::vector<std::vector<int>> RandomStep(std::mt19937& rng, int calls, int max_experts, int max_rows) {
  std::uniform_int_distribution<int> experts(0, max_experts), rows(1, max_rows);
  std::vector<std::vector<int>> step(calls);
  for (auto& c : step) {
    c.resize(experts(rng));
    for (int& r : c) r = rows(rng);
  }
  return step;
}

TEST(StepFloorTest, EqualsTheBestSplitOverEverySubset) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const FloorRates f = Rates();
    // Few rows (decode: every call causal) or many (prompt-sized calls may copy early).
    const int max_rows = trial % 3 == 0 ? 2 : trial % 3 == 1 ? 40 : 400;
    const auto step = RandomStep(rng, 1 + trial % 4, 5, max_rows);
    const double attention = 1e-4 * (1 + trial % 5);
    for (bool causal : {true, false}) {
      const double want = BruteForce(step, attention, f, causal);
      const Floor got = StepFloor(step, attention, f, causal);
      EXPECT_NEAR(got.seconds, want, 1e-12 + 1e-9 * want) << "trial " << trial << " causal " << causal;
      EXPECT_GE(got.cpu_share, 0.0);
      EXPECT_LE(got.cpu_share, 1.0 + 1e-12);
    }
  }
}

TEST(StepFloorTest, OracleNeverAboveCausalAndBothBelowSimpleStrategies) {
  std::mt19937 rng(11);
  const FloorRates f = Rates();
  for (int trial = 0; trial < 200; ++trial) {
    const auto step = RandomStep(rng, 1 + trial % 6, 8, trial % 2 ? 3 : 200);
    const double attention = 2e-4;
    const double causal = StepFloor(step, attention, f, true).seconds;
    const double oracle = StepFloor(step, attention, f, false).seconds;
    EXPECT_LE(oracle, causal * (1 + 1e-12));
    // Everything on the CPU, call after call, is one strategy the causal floor may not exceed.
    double all_cpu = attention;
    for (const auto& c : step) {
      double rows = 0;
      for (int r : c) rows += r;
      all_cpu += std::max(c.size() * f.cpu_bytes / f.dram_Bps, rows * f.flops_per_row / f.cpu_flops);
    }
    EXPECT_LE(causal, all_cpu * (1 + 1e-12));
    EXPECT_GE(oracle, attention);  // the step's own time outside the MoE is always paid
  }
}

TEST(StepFloorTest, DecodeCopiesCannotHideBehindEarlierCalls) {
  // One uncached expert per call, one row each: the link is 4x slower than
  // the CPU's DRAM read. Causally each call pays min(CPU, copy) = CPU; the
  // oracle may stream every copy across the step and split the DRAM.
  FloorRates f = Rates();
  f.pcie_Bps = 25e9;
  const std::vector<std::vector<int>> step(8, std::vector<int>{1});
  const double cpu = f.cpu_bytes / f.dram_Bps;
  EXPECT_NEAR(StepFloor(step, 0, f, true).seconds, 8 * cpu, 1e-12);
  EXPECT_LT(StepFloor(step, 0, f, false).seconds, 8 * cpu);
}

TEST(StepFloorTest, PromptSizedCallsMayCopyEarlyInTheCausalFloor) {
  const FloorRates f = Rates();
  // Every expert with 8 rows: 128 pairs over 16 experts >= 4 per expert.
  const std::vector<std::vector<int>> prompt(4, std::vector<int>(16, 8));
  EXPECT_DOUBLE_EQ(StepFloor(prompt, 1e-3, f, true).seconds, StepFloor(prompt, 1e-3, f, false).seconds);
}

TEST(StepFloorTest, NoLinkMeansEverythingOnTheCpu) {
  FloorRates f = Rates();
  f.pcie_Bps = 0;
  const std::vector<std::vector<int>> step = {{1, 2, 3}, {}, {5}};
  const Floor fl = StepFloor(step, 0, f, true);
  EXPECT_NEAR(fl.seconds, 4 * f.cpu_bytes / f.dram_Bps, 1e-12);
  EXPECT_DOUBLE_EQ(fl.cpu_share, 1.0);
}

}  // namespace
}  // namespace moe
