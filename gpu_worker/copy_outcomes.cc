#include "gpu_worker/copy_outcomes.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_format.h"

namespace moe {
namespace {

int Log2Floor(int v) { return v <= 1 ? 0 : std::bit_width(static_cast<unsigned>(v)) - 1; }
int Index(CopyChoice c) { return c == CopyChoice::kModel ? 0 : 1; }
CopyChoice Other(CopyChoice c) { return c == CopyChoice::kModel ? CopyChoice::kCpu : CopyChoice::kModel; }

}  // namespace

int CopyOutcomes::HostBucket(int experts, int pairs) {
  experts = std::max(1, experts);
  const int rows = std::min(15, Log2Floor(std::max(1, pairs / experts)));
  return DeviceBucket(experts) * 16 + rows;
}

int CopyOutcomes::DeviceBucket(int experts) {
  if (experts <= 0) return 0;
  return std::min(15, static_cast<int>(std::bit_width(static_cast<unsigned>(experts - 1))) + 1);
}

CopyOutcomes::Bucket& CopyOutcomes::At(int bucket) {
  const size_t i = static_cast<size_t>(std::max(0, bucket));
  if (i >= buckets_.size()) buckets_.resize(i + 1);
  return buckets_[i];
}

CopyChoice CopyOutcomes::Best(const Bucket& b) const {
  const Arm &model = b.arm[0], &cpu = b.arm[1];
  return cpu.mean * (1 + kMargin) < model.mean ? CopyChoice::kCpu : CopyChoice::kModel;
}

CopyChoice CopyOutcomes::Peek(int bucket) const {
  const size_t i = static_cast<size_t>(std::max(0, bucket));
  if (i >= buckets_.size()) return CopyChoice::kModel;
  const Bucket& b = buckets_[i];
  if (b.arm[0].samples < kMinSamples || b.arm[1].samples < kMinSamples)
    return b.arm[1].samples < b.arm[0].samples ? CopyChoice::kCpu : CopyChoice::kModel;
  return b.since_explore + 1 >= b.explore_every ? Other(Best(b)) : Best(b);
}

CopyChoice CopyOutcomes::Choose(int bucket) {
  const CopyChoice c = Peek(bucket);
  Bucket& b = At(bucket);
  if (b.arm[0].samples < kMinSamples || b.arm[1].samples < kMinSamples) {
    b.exploring = false;
    return c;
  }
  b.exploring = c != Best(b);
  b.since_explore = b.exploring ? 0 : b.since_explore + 1;
  return c;
}

void CopyOutcomes::Observe(int bucket, CopyChoice choice, double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds)) return;
  Bucket& b = At(bucket);
  const bool settled = b.arm[0].samples >= kMinSamples && b.arm[1].samples >= kMinSamples;
  const CopyChoice before = Best(b);
  // The sample alone would make the explored choice the best.
  const bool won = choice == CopyChoice::kCpu ? seconds * (1 + kMargin) < b.arm[0].mean
                                              : seconds <= b.arm[1].mean * (1 + kMargin);
  Arm& a = b.arm[Index(choice)];
  a.mean = a.samples == 0 ? seconds : a.mean + kSmoothing * (seconds - a.mean);
  ++a.samples;
  ++observed_;
  if (!settled || !b.exploring || choice == before) return;
  // An exploration: the other choice won this time (look again soon, so its
  // average catches up) or lost again (look less often).
  b.explore_every = won ? kExploreFirst : std::min(kExploreMax, 2 * b.explore_every);
  b.exploring = false;
}

int CopyOutcomes::vetoed_buckets() const {
  int n = 0;
  for (const Bucket& b : buckets_)
    n += b.arm[0].samples >= kMinSamples && b.arm[1].samples >= kMinSamples && Best(b) == CopyChoice::kCpu;
  return n;
}

std::string CopyOutcomes::Describe() const {
  int seen = 0;
  for (const Bucket& b : buckets_) seen += b.arm[0].samples + b.arm[1].samples > 0;
  return absl::StrFormat("%llu copying calls observed; %d of %d call shapes send every miss to the CPU",
                         static_cast<unsigned long long>(observed_), vetoed_buckets(), seen);
}

}  // namespace moe
