// ComputePool: runs one parallel region at a time on a fixed set of PUs of the
// server's NUMA node, one thread per PU, each pinned.
//
// Run(fn) calls fn(thread_index, num_threads) once per PU and returns when all
// calls have finished. The calling thread itself runs index 0, pinned to the
// first PU for the duration of the call (its own affinity is restored after),
// so no core is lost to a waiting caller; indexes 1..n-1 run on pool threads.
// Inside fn, Barrier() separates phases. Concurrent Run() callers queue: one
// region at a time uses every core. Idle pool threads spin briefly (so
// back-to-back decode requests start within microseconds) and then sleep on a
// futex. No allocation per Run.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "expert_compute/numa_binding.h"

namespace moe {

class ComputePool {
 public:
  using Task = std::function<void(int thread, int num_threads)>;

  // One compute thread per binding.cpus() entry. `binding` must outlive the pool.
  // Idle threads spin `idle_spin` for the next region (or through
  // KeepHotUntil's deadline) before sleeping: decode keeps the threads hot
  // between layers (the futex wake-up of every thread costs tens of
  // microseconds).
  explicit ComputePool(const NumaBinding& binding,
                       std::chrono::microseconds idle_spin = std::chrono::microseconds(50));
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  int size() const { return size_; }
  void Run(const Task& task);
  // Idle threads keep spinning (not sleeping) until at least `until`: a
  // server whose client polls for its next request (a GPU's decode layers,
  // a client in polling mode) keeps its threads hot for as long, whatever
  // idle_spin says. Extends, never shortens, the current deadline.
  void KeepHotUntil(std::chrono::steady_clock::time_point until);
  // How many times an idle thread went to sleep on its futex (a later region
  // pays its wake-up).
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }
  // Waits until every thread of the current region has reached it.
  void Barrier();

 private:
  void Worker(int index);

  const NumaBinding& binding_;
  const int size_;
  const std::chrono::microseconds idle_spin_;
  std::vector<std::thread> threads_;  // indexes 1..size_-1
  std::mutex run_mu_;
  const Task* task_ = nullptr;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> hot_until_ns_{0};  // KeepHotUntil's deadline, steady_clock ns since its epoch
  std::atomic<uint64_t> sleeps_{0};
  // Sense-reversing barrier.
  std::atomic<int> barrier_count_{0};
  std::atomic<uint32_t> barrier_sense_{0};
};

}  // namespace moe
