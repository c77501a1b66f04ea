#include "gpu_worker/cost_model.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_format.h"

namespace moe {

OnlineScale::OnlineScale(int window, int min_samples, double deadband)
    : window_(std::max(1, window)),
      min_samples_(std::clamp(min_samples, 1, std::max(1, window))),
      deadband_(std::max(0.0, deadband)) {}

void OnlineScale::Observe(double predicted, double observed, bool upper_bound) {
  if (!(predicted > 0) || !(observed > 0) || !std::isfinite(predicted) || !std::isfinite(observed)) return;
  // Bounded: one absurd sample (a clock jump, a stalled process) cannot take the
  // model anywhere a median of later samples could not bring it back from.
  const double ratio = std::clamp(observed / predicted, 1e-3, 1e3);
  if (upper_bound && ratio >= scale_) return;  // says nothing the estimate does not already allow
  if (static_cast<int>(ratios_.size()) < window_) {
    ratios_.push_back(ratio);
  } else {
    ratios_[next_] = ratio;
  }
  next_ = (next_ + 1) % window_;
  ++observations_;
  if (static_cast<int>(ratios_.size()) < min_samples_) return;
  std::vector<double> sorted = ratios_;
  const size_t mid = sorted.size() / 2;
  std::nth_element(sorted.begin(), sorted.begin() + mid, sorted.end());
  double median = sorted[mid];
  if (sorted.size() % 2 == 0) median = 0.5 * (median + *std::max_element(sorted.begin(), sorted.begin() + mid));
  const bool first = static_cast<int>(ratios_.size()) == min_samples_ && observations_ == static_cast<uint64_t>(min_samples_);
  if (first || median > scale_ * (1 + deadband_) || median < scale_ / (1 + deadband_)) scale_ = median;
}

int CopyOverlap::Shape(int tokens, int missed) {
  const auto pow2 = [](int v) {
    return v <= 0 ? 0 : std::min(15, static_cast<int>(std::bit_width(static_cast<unsigned>(v - 1))) + 1);
  };
  return 16 * pow2(tokens) + pow2(missed);
}

void CopyOverlap::Observe(int bucket, bool beside_copies, double seconds) {
  if (bucket < 0 || !(seconds > 0) || !std::isfinite(seconds)) return;
  if (static_cast<size_t>(bucket) >= buckets_.size()) buckets_.resize(bucket + 1);
  Side& side = beside_copies ? buckets_[bucket].second : buckets_[bucket].first;
  side.mean = side.samples == 0 ? seconds : side.mean + kSmoothing * (seconds - side.mean);
  ++side.samples;
  ++observed_;
  // The shapes' delays weighed by how often each was seen beside copies.
  double sum = 0, weight = 0;
  for (const auto& [without, beside] : buckets_) {
    if (without.samples < kMinSamples || beside.samples < kMinSamples) continue;
    const double w = std::min(beside.samples, 64);
    sum += w * (beside.mean - without.mean);
    weight += w;
  }
  learned_ = weight > 0;
  delay_s_ = learned_ ? std::max(0.0, sum / weight) : 0.0;
}

double CostModel::PairSeconds(double rows) const {
  const auto& c = cpu_pair_curve;
  if (c.empty()) return cpu_pair_s;
  if (rows <= c.front().first) return c.front().second;
  if (rows >= c.back().first) return c.back().second;
  size_t i = 1;
  while (c[i].first < rows) ++i;
  const double f = std::log(rows / c[i - 1].first) / std::log(double(c[i].first) / c[i - 1].first);
  return c[i - 1].second + f * (c[i].second - c[i - 1].second);
}

double CostModel::CpuPrior(int experts, int pairs) const {
  const double rows = experts > 0 ? double(pairs) / experts : pairs;
  return cpu_call_s + cpu_expert_s * experts + PairSeconds(rows) * pairs;
}

double CostModel::CpuSeconds(int experts, int pairs, bool with_call) const {
  return cpu.scale() * (CpuPrior(experts, pairs) - (with_call ? 0 : cpu_call_s));
}

double CostModel::CopySeconds() const { return copy.scale() * copy_s; }

double CostModel::DevicePrior(int rows) const { return device_fixed_s + device_row_s * rows; }

double CostModel::DeviceSeconds(int rows) const { return device.scale() * DevicePrior(rows); }

double CostModel::CopyDevicePrior(int rows) const { return copy_device_fixed_s + copy_device_row_s * rows; }

double CostModel::CopyDeviceSeconds(int rows) const { return copy_device.scale() * CopyDevicePrior(rows); }

void CostModel::ObserveCpu(int experts, int pairs, double seconds, bool upper_bound) {
  if (!measured) return;
  cpu.Observe(CpuPrior(experts, pairs), seconds, upper_bound);
  calls_without_cpu_sample = 0;
}

void CostModel::ObserveCopy(double seconds, bool upper_bound) {
  if (!measured) return;
  copy.Observe(copy_s, seconds, upper_bound);
}

void CostModel::ObserveDevice(double prior_seconds, double seconds, bool upper_bound) {
  if (!measured) return;
  device.Observe(prior_seconds, seconds, upper_bound);
}

void CostModel::ObserveCopyDevice(double prior_seconds, double seconds) {
  if (!measured) return;
  copy_device.Observe(prior_seconds, seconds, false);
}

std::string CostModel::Describe() const {
  if (!measured) return "not measured";
  std::string pairs;
  for (const auto& [rows, s] : cpu_pair_curve) absl::StrAppendFormat(&pairs, "%s%d:%.4f", pairs.empty() ? "" : " ", rows, cpu.scale() * s * 1e3);
  if (pairs.empty()) pairs = absl::StrFormat("%.4f", cpu.scale() * cpu_pair_s * 1e3);
  const std::string share =
      copy_cpu_share >= 0 ? absl::StrFormat(" (the CPU loses %.0f%% of its pace beside it)", 100 * copy_cpu_share)
                          : std::string(" (its cost to the CPU not measured)");
  return absl::StrFormat(
      "copy %.3f ms/expert%s; device %.3f ms + %.4f ms/row (hits), %.3f ms + %.4f ms/row (copied); cpu %.3f "
      "ms/call + %.3f ms/expert + ms/pair at rows per expert {%s}; online x%.3g cpu (%d samples), x%.3g copy "
      "(%d), x%.3g device (%d), x%.3g copied device (%d); a cache copy delays the calls beside it %.3f ms (%llu "
      "calls observed)",
      CopySeconds() * 1e3, share, device.scale() * device_fixed_s * 1e3, device.scale() * device_row_s * 1e3,
      copy_device.scale() * copy_device_fixed_s * 1e3, copy_device.scale() * copy_device_row_s * 1e3,
      cpu.scale() * cpu_call_s * 1e3,
      cpu.scale() * cpu_expert_s * 1e3, pairs, cpu.scale(), cpu.samples(), copy.scale(), copy.samples(),
      device.scale(), device.samples(), copy_device.scale(), copy_device.samples(), overlap.delay_s() * 1e3,
      static_cast<unsigned long long>(overlap.observed()));
}

std::vector<int> ChooseCopies(CostModel& model, std::vector<CopyCandidate> candidates, double device_busy_s,
                              double link_busy_s, CopyForecast* forecast) {
  std::vector<int> chosen;
  if (forecast != nullptr) *forecast = CopyForecast{};
  if (!model.measured || candidates.empty()) return chosen;
  // Most rows first: those gain most from the device's per-row speed.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const CopyCandidate& a, const CopyCandidate& b) { return a.rows > b.rows; });
  double cpu = model.CpuSeconds(0, 0);
  for (const CopyCandidate& c : candidates) cpu += model.CpuSeconds(1, c.rows, false);
  // The device side: copies queue on the link (behind its backlog) while the
  // compute queue runs the experts already landed, so with copies it lasts
  // max(link time, compute time) (plus the first copy, which nothing hides).
  double link = std::max(0.0, link_busy_s), compute = device_busy_s;
  auto device_side = [&](double l, double c, bool copies) {
    return copies ? std::max(l + model.CopyDeviceSeconds(1), c + model.CopySeconds()) : c;
  };
  const double all_cpu_s = std::max(cpu, compute);
  for (size_t i = 0; i < candidates.size(); ++i) {
    const CopyCandidate& c = candidates[i];
    const double cpu_e = model.CpuSeconds(1, c.rows, false) + (i + 1 == candidates.size() ? model.CpuSeconds(0, 0) : 0);
    const double dev_before = device_side(link, compute, !chosen.empty());
    const double dev_after = device_side(link + model.CopySeconds(), compute + model.CopyDeviceSeconds(c.rows), true);
    if (std::max(cpu - cpu_e, dev_after) > std::max(cpu, dev_before) - 0.25 * cpu_e) break;
    cpu -= cpu_e;
    link += model.CopySeconds();
    compute += model.CopyDeviceSeconds(c.rows);
    chosen.push_back(c.expert);
  }
  if (forecast != nullptr) *forecast = {std::max(cpu, device_side(link, compute, !chosen.empty())), all_cpu_s};
  // Exploration: a model that has not seen the CPU for a while keeps the
  // smallest expert there, so an overpriced CPU prior gets corrected.
  if (chosen.size() == candidates.size() && ++model.calls_without_cpu_sample > CostModel::kExploreAfter)
    chosen.pop_back();
  else if (chosen.size() < candidates.size())
    ++model.calls_without_cpu_sample;  // reset by ObserveCpu once the batch is timed
  return chosen;
}

}  // namespace moe
