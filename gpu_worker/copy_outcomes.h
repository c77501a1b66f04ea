// CopyOutcomes: the planner's check of its copy-instead decisions against
// what they led to (gpu_worker/planner.h). The cost model (cost_model.h)
// prices a copy from rates; what it cannot price — a copy's DRAM reads
// slowing the CPU servers beside it, the link's queue at that moment, the
// first copy nothing hides — shows only in the outcome. So calls are sorted
// into buckets of the same shape (how many experts the call misses, and how
// many rows each has), and per bucket the call times of the two choices are
// compared as they are observed:
//   kModel  the cost model's choice (it copies some missed experts),
//   kCpu    no copies: every missed expert to a CPU server (copy mode never).
// A bucket takes the model's choice until both have been seen
// kMinSamples times; from then on the faster on average (kCpu only when it
// is faster by kMargin: the model's choice is the default), and the other
// once in a while to keep its average current — every kExploreFirst-th
// call of the bucket, an interval that doubles each time the explored choice
// loses again (up to kExploreMax) and starts over when it beats the best's
// average (so a change of conditions is followed within kExploreMax calls
// and a few more explorations). So a bucket
// converges to never being slower than never copying, at a cost of one
// call in kExploreMax once it has.
//
// Buckets are small integers the caller derives from the call's shape
// (HostBucket, DeviceBucket). Only calls where the model copies are
// decisions: a call the model sends wholly to the CPU is both choices at once;
// and on the host path only those where the model forecasts never copying
// within kOutcomeRange (miss_plan.h) of its choice: a prompt whose CPU share
// would take several times its copies is not sampled without them.
//
// Thread-safety: none; the dispatcher thread owns it (through the Planner).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

enum class CopyChoice { kModel, kCpu };

class CopyOutcomes {
 public:
  static constexpr int kMinSamples = 3;
  static constexpr double kMargin = 0.03;
  static constexpr int kExploreFirst = 8;
  static constexpr int kExploreMax = 512;
  static constexpr double kSmoothing = 0.25;  // weight of one observation in a choice's average

  // Host-path calls: `experts` missed experts a server could take with
  // `pairs` pairs among them, bucketed by both in powers of two (few buckets:
  // each learns from more calls).
  static int HostBucket(int experts, int pairs);
  // Device-planned calls: `experts` missed experts (every row priced as one),
  // in powers of two: 0, 1, 2, 3-4, 5-8, ... (0 to 15).
  static int DeviceBucket(int experts);

  // The choice for the next call of `bucket` (advances its exploration).
  CopyChoice Choose(int bucket);
  // The choice the next call of `bucket` would get, without advancing anything
  // (the device plan's table, published before the call's bucket is known).
  CopyChoice Peek(int bucket) const;
  // A call of `bucket` made with `choice` took `seconds`. Non-positive or
  // non-finite times are ignored.
  void Observe(int bucket, CopyChoice choice, double seconds);

  // Buckets whose calls go without copies now, and calls observed.
  int vetoed_buckets() const;
  uint64_t observed() const { return observed_; }
  // "N calls observed; M of K buckets send every miss to the CPU".
  std::string Describe() const;

 private:
  struct Arm {
    double mean = 0;
    int samples = 0;
  };
  struct Bucket {
    Arm arm[2];
    int since_explore = 0;
    int explore_every = kExploreFirst;
    bool exploring = false;  // the last Choose took the other choice
  };
  CopyChoice Best(const Bucket& b) const;
  Bucket& At(int bucket);
  std::vector<Bucket> buckets_;
  uint64_t observed_ = 0;
};

}  // namespace moe
