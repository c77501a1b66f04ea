// The dispatcher's start-up probes (gpu_worker/rate_probes.h), behind
// LayerDispatcher::MeasureRates: an expert copy, the device's cost per expert
// and row, the first server's round trips and what a copy costs the CPU
// servers — the prior of the planner's CostModel.
#include "gpu_worker/rate_probes.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe {

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The start-up CPU probe: round trips per size (their median), and the
// experts one token goes to when it measures what a copy costs the CPU.
constexpr int kProbeRepeats = 9;
constexpr int kShareProbeExperts = 8;
constexpr size_t kShareCopiesQueued = 4;  // copies kept in flight beside that probe
constexpr int kShareSamples = 3;           // alternated alone / beside pairs (the median share)

// The fastest of several runs: the unloaded cost (a probe can only be slowed
// down by noise — a page fault, a descheduled thread — never sped up).
double Fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

absl::Status MeasureDeviceRates(const RateProbeSetup& setup, int rows, const std::vector<bf16_t>& x,
                                std::vector<bf16_t>& y, CostModel& rates);
absl::Status MeasureServerRates(const RateProbeSetup& setup, int rows, const std::vector<bf16_t>& x,
                                std::vector<bf16_t>& y, CostModel& rates);
// CostModel::copy_cpu_share: `probe` (a CPU round trip, seconds) alone and
// beside a stream of copies of `layer`'s experts.
absl::Status MeasureCopyCpuShare(const RateProbeSetup& setup, int layer,
                                 const std::function<absl::StatusOr<double>()>& probe, CostModel& rates);
absl::StatusOr<double> ProbeBesideCopies(const RateProbeSetup& setup, const std::vector<const std::byte*>& sources,
                                         const std::function<absl::StatusOr<double>()>& probe);

}  // namespace

// Rates: one expert copied, what one more expert adds to a device call at 1
// and many rows, and the first server's round trip for 1 and 2 experts and
// many tokens.
absl::Status ProbeRates(const RateProbeSetup& setup, CostModel& rates) {
  // The CPU probe climbs to prompt-sized batches (its throughput per row grows
  // several-fold from decode to prefill); the device probe stays at 64 rows.
  int cpu_rows = std::min(setup.max_tokens, 1024);
  for (const ProbeServer& sv : setup.servers)
    if (sv.transport != nullptr) cpu_rows = std::min(cpu_rows, std::max(1, sv.chunk_tokens));
  const int rows = std::max(cpu_rows, std::min(setup.max_tokens, 64));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(rows) * setup.hidden), y(x.size());
  for (bf16_t& v : x) v = F32ToBf16(dist(rng));
  MOE_RETURN_IF_ERROR(MeasureDeviceRates(setup, std::min(setup.max_tokens, 64), x, y, rates));
  return MeasureServerRates(setup, cpu_rows, x, y, rates);
}

namespace {

// One expert copied; then what one more expert adds to a call on the device
// at 1 and at `rows` rows: a call of n experts (the temporary buffers, each
// loaded) less a call of one, over n - 1. A call's own cost (its activations'
// transfers, launches, the host's wait) is the call's, not each copied
// expert's: priced per expert, it made a probe of one expert per call say
// 0.17 ms for a 128-row int8 expert the packed kernels compute in 0.008 ms,
// and the planner kept prompts' experts on the CPU (H100 host, Qwen3-30B-A3B).
absl::Status MeasureDeviceRates(const RateProbeSetup& setup, int rows, const std::vector<bf16_t>& x,
                                std::vector<bf16_t>& y, CostModel& rates) {
  const int layer = setup.layer;
  const int n = std::max(1, std::min(2 * setup.miss_buffers, 8));  // temporary buffers used
  std::vector<double> t;
  for (int i = 0; i < std::max(3, n); ++i) {
    const Clock::time_point t0 = Clock::now();
    MOE_ASSIGN_OR_RETURN(const uint64_t f, setup.backend->LoadExpert(setup.temp_base + i % n,
                                                                 setup.host->Find(layer, i % setup.num_experts), 0));
    MOE_RETURN_IF_ERROR(setup.backend->WaitCopy(f));
    t.push_back(Seconds(Clock::now() - t0));
  }
  rates.copy_s = Fastest(t);
  std::vector<int32_t> buffers(n);
  std::iota(buffers.begin(), buffers.end(), setup.temp_base);
  // The fastest of 5 calls of `launches` launches of `experts` experts with m
  // rows each (the same m tokens).
  auto device_time = [&](int m, int experts, int launches) -> absl::StatusOr<double> {
    ExpertGroups g;
    for (int e = 0; e < experts; ++e) {
      g.expert.push_back(e);
      g.row_begin.push_back(static_cast<int32_t>(g.token.size()));
      g.count.push_back(m);
      for (int r = 0; r < m; ++r) g.token.push_back(r), g.weight.push_back(0.5f);
      while (g.token.size() % setup.backend->hit_row_align() != 0) g.token.push_back(-1), g.weight.push_back(0.f);
    }
    g.total_rows = static_cast<int32_t>(g.token.size());
    g.total_pairs = experts * m;
    const HitPlan p{&g, buffers.data()};
    std::vector<double> v;
    for (int i = 0; i < 5; ++i) {
      const Clock::time_point t0 = Clock::now();
      MOE_RETURN_IF_ERROR(setup.backend->BeginCall(0, m, x.data(), MemoryKind::kHost));
      for (int l = 0; l < launches; ++l) MOE_RETURN_IF_ERROR(setup.backend->RunExperts(0, p));
      MOE_RETURN_IF_ERROR(setup.backend->FinishCall(0, y.data(), MemoryKind::kHost));
      v.push_back(Seconds(Clock::now() - t0));
    }
    return Fastest(v);
  };
  // Hits: one more expert in a grouped launch at m rows (with one buffer, the
  // whole call: an upper bound).
  auto per_hit = [&](int m) -> absl::StatusOr<double> {
    MOE_ASSIGN_OR_RETURN(const double one, device_time(m, 1, 1));
    if (n == 1) return one;
    MOE_ASSIGN_OR_RETURN(const double all, device_time(m, n, 1));
    return std::max(1e-7, (all - one) / (n - 1));
  };
  // Copied experts, as ComputeCopiedInBuffers launches them: what one more
  // launch of `per_launch` experts adds to a call, per expert. (Priced as
  // hits, a copied expert cost ~1 us and its device time was hidden from
  // the planner.)
  const int per_launch = std::min(n, std::max(1, setup.miss_buffers / 2));
  auto per_copied = [&](int m) -> absl::StatusOr<double> {
    MOE_ASSIGN_OR_RETURN(const double one, device_time(m, per_launch, 1));
    MOE_ASSIGN_OR_RETURN(const double two, device_time(m, per_launch, 2));
    return std::max(1e-7, (two - one) / per_launch);
  };
  CostModel& r = rates;
  MOE_ASSIGN_OR_RETURN(const double h1, per_hit(1));
  MOE_ASSIGN_OR_RETURN(const double hm, per_hit(rows));
  r.device_row_s = std::max(0.0, (hm - h1) / std::max(1, rows - 1));
  r.device_fixed_s = std::max(0.0, h1 - r.device_row_s);
  MOE_ASSIGN_OR_RETURN(const double c1, per_copied(1));
  MOE_ASSIGN_OR_RETURN(const double cm, per_copied(rows));
  r.copy_device_row_s = std::max(0.0, (cm - c1) / std::max(1, rows - 1));
  r.copy_device_fixed_s = std::max(0.0, c1 - r.copy_device_row_s);
  return absl::OkStatus();
}

// The first server that answered at start: round trips for 1 and 2 experts
// and `rows` tokens. Sets rates.measured when it could.
absl::Status MeasureServerRates(const RateProbeSetup& setup, int rows, const std::vector<bf16_t>& x,
                                std::vector<bf16_t>& y, CostModel& rates) {
  const int layer = setup.layer;
  auto connected = std::find_if(setup.servers.begin(), setup.servers.end(),
                                [](const ProbeServer& sv) { return sv.transport != nullptr; });
  if (connected == setup.servers.end()) return absl::OkStatus();
  const ProbeServer& s = *connected;
  // Probes rotate through the hosted experts so their weights come from DRAM,
  // not from the L3 cache a repeated expert would sit in.
  std::vector<int> hosted;
  for (int e = 0; e < setup.num_experts; ++e)
    if ((*s.hosts)[e]) hosted.push_back(e);
  if (hosted.empty()) return absl::OkStatus();
  size_t cursor = 0;
  // m tokens to the same `experts` distinct experts (one token row of k >= 2 ids).
  auto cpu_time = [&](int m, int experts) -> absl::StatusOr<double> {
    const int k = std::max(2, experts);
    std::vector<int32_t> ids(static_cast<size_t>(m) * k, -1), row(k, -1);
    std::vector<float> w(ids.size(), 0.5f);
    std::vector<double> v;
    for (int i = 0; i < kProbeRepeats; ++i) {
      for (int j = 0; j < experts && j < static_cast<int>(hosted.size()); ++j) row[j] = hosted[cursor++ % hosted.size()];
      for (int t = 0; t < m; ++t) std::copy(row.begin(), row.end(), ids.begin() + static_cast<size_t>(t) * k);
      const MoeBatch batch{layer, m, x.data(), RoutingView{m, k, ids.data(), w.data()}};
      const Clock::time_point t0 = Clock::now();
      std::future<absl::Status> f = s.transport->Submit(batch, y.data(), Clock::now() + setup.deadline);
      if (absl::Status st = AwaitResult(f); !st.ok())
        return absl::Status(st.code(), absl::StrCat("servers: probing ", s.address, ": ", st.message()));
      v.push_back(Seconds(Clock::now() - t0));
    }
    return Median(v);  // a probe at prompt sizes varies; the median, not the luckiest run
  };
  // One token to one and two experts, before and after the larger probes:
  // every other term is priced against these two, and a transient
  // disturbance of the shared host in one of them (a 2 ms round trip instead
  // of 0.1) once made the whole curve "2 ms per call, nothing per expert or
  // row" (H100 host); the lower of the two medians is kept.
  MOE_ASSIGN_OR_RETURN(double c11, cpu_time(1, 1));
  MOE_ASSIGN_OR_RETURN(double c12, cpu_time(1, 2));
  // Seconds per pair at 4, 16, 64, ... rows of one expert, up to `rows`.
  std::vector<std::pair<int, double>> at;
  for (int m = std::min(4, rows); m >= 2 && m <= rows; m = m * 4 > rows && m < rows ? rows : m * 4) {
    MOE_ASSIGN_OR_RETURN(const double cm, cpu_time(m, 1));
    at.push_back({m, cm});
  }
  MOE_ASSIGN_OR_RETURN(const double c11_again, cpu_time(1, 1));
  MOE_ASSIGN_OR_RETURN(const double c12_again, cpu_time(1, 2));
  c11 = std::min(c11, c11_again);
  c12 = std::min(c12, c12_again);
  rates.cpu_expert_s = std::max(0.0, c12 - c11);
  rates.cpu_pair_curve.clear();
  for (const auto& [m, cm] : at) rates.cpu_pair_curve.push_back({m, std::max(0.0, (cm - c11) / (m - 1))});
  rates.cpu_pair_s = rates.cpu_pair_curve.empty() ? 0.0 : rates.cpu_pair_curve.front().second;
  rates.cpu_call_s = std::max(0.0, c11 - rates.cpu_expert_s - rates.cpu_pair_s);
  rates.measured = true;
  return MeasureCopyCpuShare(
      setup, layer, [&] { return cpu_time(1, std::min<int>(kShareProbeExperts, hosted.size())); }, rates);
}

// What a copy costs the CPU servers (CostModel::copy_cpu_share): one token to
// several experts — their weights streamed from DRAM, as a decode's misses
// are — alone, then while the copy engine streams experts into the temporary
// buffers until it is done; the share of its pace the CPU lost is
// 1 - alone / beside. The H100 host's CPU read 57-125 GB/s beside copies of
// 33-53 GB/s where it read 75-140 alone (moe_layer, 52 runs): pricing each
// copy as all of its bytes taken from the CPU kept the
// cache's admissions from copies that paid. Needs device memory (a copy the host
// thread makes itself cannot run beside the probe) and temporary buffers.
absl::Status MeasureCopyCpuShare(const RateProbeSetup& setup, int layer,
                                 const std::function<absl::StatusOr<double>()>& probe, CostModel& rates) {
  CostModel& r = rates;
  if (!setup.backend->has_device_memory() || setup.temp_buffers == 0 || setup.host == nullptr || !(r.copy_s > 0))
    return absl::OkStatus();
  std::vector<const std::byte*> sources;
  for (int e = 0; e < setup.num_experts; ++e)
    if (const std::byte* src = setup.host->Find(layer, e); src != nullptr) sources.push_back(src);
  if (sources.empty()) return absl::OkStatus();
  // One sample: the probe alone, then beside copies. A shared host's pace
  // drifts between probes (one pair read 10% on one start and 55% on the
  // next, stop 27): the median of kShareSamples alternated pairs.
  std::vector<double> shares;
  for (int sample = 0; sample < kShareSamples; ++sample) {
    MOE_ASSIGN_OR_RETURN(const double alone, probe());
    MOE_ASSIGN_OR_RETURN(const double beside, ProbeBesideCopies(setup, sources, probe));
    if (alone > 0 && beside > 0) shares.push_back(std::clamp(1.0 - alone / beside, 0.0, 1.0));
  }
  if (!shares.empty()) r.copy_cpu_share = Median(shares);
  return absl::OkStatus();
}

// `probe` while the copy engine streams `sources` into the temporary buffers
// until it is done; its seconds.
absl::StatusOr<double> ProbeBesideCopies(const RateProbeSetup& setup, const std::vector<const std::byte*>& sources,
                                         const std::function<absl::StatusOr<double>()>& probe) {
  // A thread of its own keeps a few copies queued until the probe is done (a
  // backend whose LoadExpert waits for staging space cannot run ahead).
  const int buffers = setup.temp_buffers;
  std::atomic<bool> stop{false};
  absl::Status copied;
  std::vector<uint64_t> fences;
  std::thread copier([&] {
    for (size_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      if (i >= kShareCopiesQueued) copied = setup.backend->WaitCopy(fences[i - kShareCopiesQueued]);
      absl::StatusOr<uint64_t> f =
          copied.ok() ? setup.backend->LoadExpert(setup.temp_base + static_cast<int>(i % buffers),
                                                  sources[i % sources.size()], 0)
                      : absl::StatusOr<uint64_t>(copied);
      if (!f.ok()) {
        copied = f.status();
        return;
      }
      fences.push_back(*f);
    }
  });
  absl::StatusOr<double> beside = probe();
  stop.store(true);
  copier.join();
  if (!fences.empty()) MOE_RETURN_IF_ERROR(setup.backend->WaitCopy(fences.back()));
  MOE_RETURN_IF_ERROR(copied);
  return beside;
}

}  // namespace

}  // namespace moe
