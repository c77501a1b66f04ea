#include "bench/model/step_floor.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <utility>

namespace moe {
namespace {

// One call's split: its uncached experts' rows ascending (the CPU takes the
// fewest-row ones: for a given number of CPU experts that minimises its
// compute, and a copy costs the same whatever its rows).
struct Call {
  std::vector<int> rows;
  std::vector<double> prefix;  // rows of the n fewest-row experts
  double pairs = 0;
  int n = 0;  // on the CPU (the greedy walk's position)
  bool early = false;  // its copies may start before its attention
};

}  // namespace

Floor StepFloor(const std::vector<std::vector<int>>& calls, double attention_s, const FloorRates& f, bool causal) {
  const auto per = [](double amount, double rate) { return rate > 0 ? amount / rate : 0.0; };
  const double shared_Bps = std::max(f.shared_Bps, f.dram_Bps);
  std::vector<Call> split(calls.size());
  double pairs = 0;
  for (size_t l = 0; l < calls.size(); ++l) {
    Call& c = split[l];
    c.rows = calls[l];
    std::sort(c.rows.begin(), c.rows.end());
    c.prefix.assign(1, 0.0);
    for (int r : c.rows) c.prefix.push_back(c.prefix.back() + r);
    c.pairs = c.prefix.back();
    pairs += c.pairs;
    c.early = !causal || c.pairs >= kCertainPairsPerExpert * f.num_experts;
  }
  // A call's CPU time with its n fewest-row experts on the CPU: their bytes
  // at the DRAM rate, their rows at the compute rate (convex in n).
  auto cpu = [&](const Call& c, int n) {
    return std::max(per(n * f.cpu_bytes, f.dram_Bps), per(c.prefix[n] * f.flops_per_row, f.cpu_flops));
  };
  auto copies = [&](const Call& c, int n) { return static_cast<double>(c.rows.size()) - n; };
  // Calls whose copies start only after their attention: each ends when its
  // CPU share, its copies and the DRAM both read are done; the best n alone.
  double fixed = attention_s, fixed_cpu_pairs = 0;
  for (const Call& c : split) {
    if (c.early || c.rows.empty()) continue;
    const int all = static_cast<int>(c.rows.size());
    double best = -1, best_pairs = 0;
    for (int n = f.pcie_Bps > 0 ? 0 : all; n <= all; ++n) {  // no link: everything on the CPU
      const double t = std::max({cpu(c, n), per(copies(c, n) * f.copy_bytes, f.pcie_Bps),
                                 per(n * f.cpu_bytes + copies(c, n) * f.copy_bytes, shared_Bps)});
      if (best < 0 || t < best) best = t, best_pairs = c.prefix[n];
    }
    fixed += best;
    fixed_cpu_pairs += best_pairs;
  }
  // Calls whose copies may start early share the link and the DRAM over the
  // step: walk from everything copied to everything on the CPU, each next CPU
  // expert the one that lengthens the sum of the calls' CPU times the least
  // (exact for convex per-call terms), and keep the best max of the three.
  using Step = std::pair<double, size_t>;  // added seconds, call
  std::priority_queue<Step, std::vector<Step>, std::greater<Step>> next;
  double cpu_sum = 0, copied = 0, on_cpu = 0, early_cpu_pairs = 0;
  const double first_attention = calls.empty() ? 0 : attention_s / static_cast<double>(calls.size());
  for (size_t l = 0; l < split.size(); ++l) {
    const Call& c = split[l];
    if (!c.early || c.rows.empty()) continue;
    copied += static_cast<double>(c.rows.size());
    next.push({cpu(c, 1) - cpu(c, 0), l});
  }
  auto bound = [&] {
    if (copied > 0 && f.pcie_Bps <= 0) return 1e30;  // no link: copies are impossible
    const double link = copied > 0 ? first_attention + per(copied * f.copy_bytes, f.pcie_Bps) : 0;
    const double dram = per(on_cpu * f.cpu_bytes + copied * f.copy_bytes, shared_Bps);
    return std::max({fixed + cpu_sum, link, dram});
  };
  Floor best{bound(), 0};
  double best_early_pairs = 0;
  while (!next.empty()) {
    const auto [added, l] = next.top();
    next.pop();
    Call& c = split[l];
    cpu_sum += added;
    ++on_cpu;
    --copied;
    early_cpu_pairs += c.rows[c.n];
    ++c.n;
    if (c.n < static_cast<int>(c.rows.size())) next.push({cpu(c, c.n + 1) - cpu(c, c.n), l});
    if (const double b = bound(); b < best.seconds) best.seconds = b, best_early_pairs = early_cpu_pairs;
  }
  best.cpu_share = pairs > 0 ? (fixed_cpu_pairs + best_early_pairs) / pairs : 0;
  return best;
}

}  // namespace moe
