// CostModel: the planner's rates (gpu_worker/planner.h) — how long a CPU
// expert server takes for a batch (per call, per expert, and per pair at that
// many rows per expert), how long one expert takes to copy host -> device, and
// how long the device takes to compute one expert's rows — used by the
// copy-instead-of-compute decision (ChooseCopies, here) and by the cache
// admissions (AdmissionPolicy, through AdmissionConfig::live_rates).
//
// The rates probed at start-up are only a prior: a probe runs once, on a cold
// server, and one bad sample mispriced a CPU expert 15x on the GPU host (and
// made the worker copy most misses over PCIe). Each rate therefore carries an
// OnlineScale: the running median of observed / predicted over the last
// calls the dispatcher timed, which multiplies the prior. A median ignores a
// stray slow call (a page fault, a descheduled thread); an observation that
// only bounds the time from above (the result was already there when the
// caller looked) counts only when it says the estimate is too high.
//
// Thread-safety: none; the one thread that drives a dispatcher owns its model.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe {

// Running median of observed/predicted ratios over a window of the most recent
// observations. scale() is 1 until `min_samples` observations arrived, then
// the median — but it moves only when the median left a dead band of
// +-`deadband` around it: decisions near a threshold do not flip with noise.
class OnlineScale {
 public:
  explicit OnlineScale(int window = 63, int min_samples = 3, double deadband = 0.15);
  // One timed operation the model predicted at `predicted` seconds took
  // `observed` seconds. `upper_bound`: the operation finished at some unknown
  // time before `observed` — used only when it is below the current estimate.
  // Non-positive or non-finite values are ignored.
  void Observe(double predicted, double observed, bool upper_bound = false);
  double scale() const { return scale_; }
  int samples() const { return static_cast<int>(ratios_.size()); }
  uint64_t observations() const { return observations_; }  // accepted, ever

 private:
  int window_, min_samples_;
  double deadband_;
  std::vector<double> ratios_;  // ring of the last `window_` ratios
  size_t next_ = 0;
  double scale_ = 1.0;
  uint64_t observations_ = 0;
};

// What a cache copy costs the layer calls it overlaps, as observed: per call
// shape (Shape: the call's tokens and missed experts, in powers of two) the
// average call time with cache copies on the link and without; the delay is
// their difference, averaged over the shapes seen both ways. A decode call
// waits on the link for its servers' answers (read through mapped host
// memory) and its own copies, so a copy beside it can cost the call far more
// than its DRAM reads take from the CPU (GPU host, Kimi-Linear at one token:
// calls beside copies ran 0.3 ms longer, about one expert's copy).
class CopyOverlap {
 public:
  static constexpr int kMinSamples = 4;
  static constexpr double kSmoothing = 0.125;
  // The shape of a call of `tokens` tokens missing `missed` experts: a prompt
  // and a decode call never share one.
  static int Shape(int tokens, int missed);
  // A call of shape `bucket` took `seconds`, with cache copies beside it or not.
  void Observe(int bucket, bool beside_copies, double seconds);
  // The delay one call beside copies takes, seconds (0 until a shape was seen
  // both ways kMinSamples times; never negative).
  double delay_s() const { return delay_s_; }
  // Some shape was seen both ways kMinSamples times (delay_s is a measurement).
  bool learned() const { return learned_; }
  uint64_t observed() const { return observed_; }

 private:
  struct Side {
    double mean = 0;
    int samples = 0;
  };
  std::vector<std::pair<Side, Side>> buckets_;  // {without, beside}
  double delay_s_ = 0;
  bool learned_ = false;
  uint64_t observed_ = 0;
};

struct CostModel {
  // Prior rates (seconds), measured at start-up.
  double copy_s = 0;          // one expert host -> device
  double device_fixed_s = 0;  // device compute of one more expert in a grouped launch (the
  double device_row_s = 0;    // hits): fixed + per row
  // Device compute of one copied expert as the copy path launches them
  // (miss_buffers / 2 per launch, several times fewer experts than a hit
  // launch holds): fixed + per row.
  double copy_device_fixed_s = 0, copy_device_row_s = 0;
  double cpu_call_s = 0;      // CPU server: per call, per expert, per (token, expert) pair
  double cpu_expert_s = 0;
  double cpu_pair_s = 0;      // per pair when cpu_pair_curve is empty
  // Per pair at {rows of one expert, seconds}, rows ascending: a CPU kernel
  // streams an expert's weights once per call, so its time per row falls
  // several-fold from decode to prefill (AMX tiles fill up). Interpolated in
  // log(rows); held flat beyond the ends.
  std::vector<std::pair<int, double>> cpu_pair_curve;
  // What a copy costs the CPU servers: the share of their pace they lose
  // while the link copies (its DRAM reads beside theirs), measured at start
  // (one token to several experts, alone and beside a stream of copies);
  // < 0: not measured, a copy priced as if every byte it reads were taken
  // from the CPU (one expert's CPU time: the bound).
  double copy_cpu_share = -1;
  bool measured = false;
  // Online corrections of the priors.
  OnlineScale cpu, copy, device, copy_device;
  // What a cache copy costs the calls beside it (the admissions' price of a copy).
  CopyOverlap overlap;
  // Calls whose decision had CPU-eligible misses since the last CPU
  // observation; past kExploreAfter, ChooseCopies keeps one expert on the CPU
  // so a prior that overprices the CPU cannot starve its own correction.
  int calls_without_cpu_sample = 0;
  static constexpr int kExploreAfter = 8;

  // Predictions with the online corrections applied.
  double CpuSeconds(int experts, int pairs, bool with_call = true) const;
  // CPU seconds per pair when an expert has `rows` rows (the prior, uncorrected).
  double PairSeconds(double rows) const;
  double CopySeconds() const;
  double DeviceSeconds(int rows) const;
  // A copied expert's device compute at `rows` rows (copy_device_*).
  double CopyDeviceSeconds(int rows) const;
  // The prior alone (what an observation is compared with).
  double CpuPrior(int experts, int pairs) const;
  double DevicePrior(int rows) const;
  double CopyDevicePrior(int rows) const;

  // Records a timed CPU batch (`experts` distinct experts, `pairs` pairs).
  void ObserveCpu(int experts, int pairs, double seconds, bool upper_bound);
  // One expert copy host -> device.
  void ObserveCopy(double seconds, bool upper_bound);
  // Device work of a call predicted from its rows per expert.
  void ObserveDevice(double prior_seconds, double seconds, bool upper_bound);
  // One launch of copied experts, timed on the compute queue, against its
  // prior (the sum of CopyDevicePrior over its experts).
  void ObserveCopyDevice(double prior_seconds, double seconds);

  std::string Describe() const;
};

// One CPU-eligible missed expert of a call: `rows` tokens routed to it.
struct CopyCandidate {
  int expert = -1;
  int rows = 0;
};

// The copy-instead-of-compute decision for one call: which candidates to copy
// to the device and compute there. `device_busy_s` is the device time already
// planned for the call (hits, forced copies). Moves the candidates with most
// rows to the device while that shortens max(CPU time, device time) by a clear
// margin (a quarter of the expert's CPU time: the rates are estimates, and a
// wrong copy costs PCIe and DRAM bandwidth). Never copies them all when the
// model is due a CPU observation (CostModel::kExploreAfter) and updates that
// counter. Returns the experts to copy; empty when !model.measured.
// `link_busy_s`: the copy queue's backlog when the call starts (cache copies
// of earlier calls), which the call's copies queue behind. `forecast`
// (optional) gets the call's predicted time with the chosen copies and with
// every candidate on the CPU.
struct CopyForecast {
  double chosen_s = 0;   // max(CPU time, device time) with the chosen experts copied
  double all_cpu_s = 0;  // the same with none copied
};
std::vector<int> ChooseCopies(CostModel& model, std::vector<CopyCandidate> candidates, double device_busy_s,
                              double link_busy_s = 0, CopyForecast* forecast = nullptr);

}  // namespace moe
