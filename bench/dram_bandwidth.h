// The DRAM read-bandwidth probe shared by the benchmarks: every pool thread
// (pinned) sums its slice of one buffer bound to the pool's NUMA node; the
// median over several passes is the floor every bandwidth-bound figure is
// compared against.
#pragma once

#include <cstddef>
#include <string>

#include "expert_compute/compute_pool.h"
#include "expert_compute/numa_binding.h"

namespace moe {

// Memory bound to the binding's node, freed on destruction.
class NodeBuffer {
 public:
  NodeBuffer(const NumaBinding& numa, size_t bytes)
      : numa_(numa), bytes_(bytes), p_(static_cast<std::byte*>(numa.Allocate(bytes))) {}
  ~NodeBuffer() { numa_.Free(p_, bytes_); }
  NodeBuffer(const NodeBuffer&) = delete;
  NodeBuffer& operator=(const NodeBuffer&) = delete;
  std::byte* data() const { return p_; }

 private:
  const NumaBinding& numa_;
  size_t bytes_;
  std::byte* p_;
};

struct DramBandwidth {
  double gbps = 0;       // median GB/s
  double max_gbps = 0;   // the best run's (what a lower bound may assume)
  double bytes = 0;      // buffer size
  int runs = 0;
  std::string note;      // size, threads, min / max
};

// `gib` GiB (capped at a quarter of available memory); AVX-512 loads when `avx512`.
DramBandwidth MeasureDramBandwidth(const NumaBinding& numa, ComputePool& pool, double gib, bool avx512);

}  // namespace moe
