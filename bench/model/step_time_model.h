// StepTimeModel: the modelled time of a layer run, shared by bench/cache_replay
// and moe-demo (a benchmark's model of the GPU host, not the worker's rates:
// those are gpu_worker/cost_model.h). Thread-safety: plain values.
#pragma once

#include <utility>
#include <vector>

namespace moe {

// The value at `x` of a curve of {x, value} points (x ascending): linear
// between points, the first value below the first point, proportional to x
// beyond the last (a CPU expert's time per rows, as probed); 0 when empty.
double CurveAt(const std::vector<std::pair<int, double>>& curve, double x);

// The step-time model of a layer run shared by cache_replay and moe-demo: the
// device part plus the CPU's misses — a missed expert streams its bytes from
// host DRAM, a missed pair costs pair_seconds — plus the CPU work lost to the
// copy engine's DRAM reads while both run: the link's busy time overlapping
// that work, times CopyCpuShare(). Host DRAM serves the CPU and the copy
// engine together at shared_bytes_per_second (moe_layer measures it as the
// floor's shared rate), so the CPU beside a copy streams min(dram, shared -
// pcie) and loses only what the two ask beyond it. Defaults: the GPU host
// (shared/PERF.md: oneDNN AMX streams 94 GB/s of weights, PCIe 55 GB/s; the
// CPU and the copy engine at once 130 GB/s, about the median of moe_layer's
// measurements there, 95-169 GB/s over the runs on record, bench/RESULTS.md
// stop 23).
struct StepTimeModel {
  double expert_bytes = 0;
  double dram_bytes_per_second = 94e9;
  double pcie_bytes_per_second = 55e9;  // 0: copies instant (no contention)
  // DRAM read by the CPU and the copy engine at once; <= dram: a copy takes
  // all its bytes from the CPU (the bound without a measurement).
  double shared_bytes_per_second = 130e9;
  double pair_seconds = 0;
  // Measured CPU seconds of one missed expert at {pairs, seconds} points
  // (pairs ascending, interpolated linearly, proportional to the pairs beyond
  // the last point; bench/moe_layer --rates-out): when set, a missed expert
  // with m pairs costs max(expert_bytes / dram, the curve at m) instead of
  // expert_bytes / dram + m * pair_seconds.
  std::vector<std::pair<int, double>> cpu_expert_curve;
  // CPU time of these misses, without contention.
  double MissSeconds(int missed_experts, double missed_pairs) const;
  // CPU time of one missed expert with `pairs` pairs.
  double ExpertMissSeconds(double pairs) const;
  // One layer run: `device_s` plus the misses, with the link busy for
  // `link_busy_s` from the run's start.
  double LayerSeconds(double device_s, int missed_experts, double missed_pairs, double link_busy_s) const;
  // The same from the misses' CPU seconds.
  double LayerSecondsFromCpu(double device_s, double cpu_s, double link_busy_s) const;
  // The share of its time the CPU's miss work loses while the link copies:
  // (dram + pcie - shared) / dram, within [0, pcie / dram]; 0 without copies.
  double CopyCpuShare() const;
};

}  // namespace moe
