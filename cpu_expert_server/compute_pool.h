// ComputePool: a fixed set of compute threads, each pinned to one PU of the
// server's NUMA node, that run one parallel region at a time.
//
// Run(fn) calls fn(thread_index, num_threads) on every pool thread and returns
// when all have finished; inside fn, Barrier() separates phases. Run() is
// serialised internally (concurrent callers queue), so exactly one region runs
// at a time and uses every core. Threads spin briefly after a region (so
// back-to-back decode requests start within microseconds) and then sleep on a
// futex. No allocation per Run.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_expert_server/numa_binding.h"

namespace moe {

class ComputePool {
 public:
  using Task = std::function<void(int thread, int num_threads)>;

  // Starts one thread per binding.cpus() entry, each pinned to its PU.
  // `binding` must outlive the pool.
  explicit ComputePool(const NumaBinding& binding);
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  void Run(const Task& task);
  // Waits until every pool thread of the current region has reached it.
  void Barrier();

 private:
  void Worker(int index, const NumaBinding& binding);

  std::vector<std::thread> threads_;
  std::mutex run_mu_;
  const Task* task_ = nullptr;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  // Sense-reversing barrier.
  std::atomic<int> barrier_count_{0};
  std::atomic<uint32_t> barrier_sense_{0};
};

}  // namespace moe
