#include "bench/model/step_time_model.h"

#include <algorithm>

namespace moe {

double StepTimeModel::MissSeconds(int missed_experts, double missed_pairs) const {
  if (missed_experts <= 0) return 0;
  if (!cpu_expert_curve.empty()) return missed_experts * ExpertMissSeconds(missed_pairs / missed_experts);
  const double expert_s = dram_bytes_per_second > 0 ? expert_bytes / dram_bytes_per_second : 0.0;
  return missed_experts * expert_s + missed_pairs * pair_seconds;
}

double CurveAt(const std::vector<std::pair<int, double>>& c, double x) {
  if (c.empty()) return 0;
  if (x <= c.front().first) return c.front().second;
  if (x >= c.back().first) return c.back().second * x / c.back().first;
  size_t i = 1;
  while (c[i].first < x) ++i;
  return c[i - 1].second + (c[i].second - c[i - 1].second) * (x - c[i - 1].first) / (c[i].first - c[i - 1].first);
}

double StepTimeModel::ExpertMissSeconds(double pairs) const {
  const double stream_s = dram_bytes_per_second > 0 ? expert_bytes / dram_bytes_per_second : 0.0;
  if (cpu_expert_curve.empty()) return stream_s + pairs * pair_seconds;
  return std::max(stream_s, CurveAt(cpu_expert_curve, pairs));
}

double StepTimeModel::LayerSeconds(double device_s, int missed_experts, double missed_pairs,
                                   double link_busy_s) const {
  return LayerSecondsFromCpu(device_s, MissSeconds(missed_experts, missed_pairs), link_busy_s);
}

double StepTimeModel::CopyCpuShare() const {
  if (!(pcie_bytes_per_second > 0) || !(dram_bytes_per_second > 0)) return 0;
  const double all = pcie_bytes_per_second / dram_bytes_per_second;  // every byte of the copy taken from the CPU
  const double shared = std::max(shared_bytes_per_second, dram_bytes_per_second);
  return std::clamp((dram_bytes_per_second + pcie_bytes_per_second - shared) / dram_bytes_per_second, 0.0, all);
}

double StepTimeModel::LayerSecondsFromCpu(double device_s, double cpu, double link_busy_s) const {
  if (cpu > 0) cpu += std::clamp(link_busy_s, 0.0, cpu) * CopyCpuShare();
  return device_s + cpu;
}

}  // namespace moe
