#include "cpu_expert_server/compute_pool.h"

#include <immintrin.h>

#include <chrono>

#include "core/log.h"

namespace moe {

namespace {
// How long an idle worker spins before sleeping on the futex.
constexpr auto kSpin = std::chrono::microseconds(200);
}  // namespace

ComputePool::ComputePool(const NumaBinding& binding) {
  const int n = static_cast<int>(binding.cpus().size());
  threads_.reserve(n);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this, i, &binding] { Worker(i, binding); });
}

ComputePool::~ComputePool() {
  stop_.store(true);
  epoch_.fetch_add(1);
  epoch_.notify_all();
  for (auto& t : threads_) t.join();
}

void ComputePool::Worker(int index, const NumaBinding& binding) {
  if (absl::Status st = binding.BindCurrentThread(index); !st.ok()) LogWarning("pool", st.message());
  uint64_t seen = 0;
  const int n = size();
  for (;;) {
    // Spin, then sleep, until a new epoch is published.
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    uint64_t e;
    while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
      if (std::chrono::steady_clock::now() > spin_until) {
        epoch_.wait(seen, std::memory_order_acquire);
      } else {
        _mm_pause();
      }
    }
    seen = e;
    if (stop_.load()) return;
    (*task_)(index, n);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) done_.notify_one();
  }
}

void ComputePool::Run(const Task& task) {
  std::lock_guard<std::mutex> lock(run_mu_);
  task_ = &task;
  done_.store(0, std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();
  const int n = size();
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  int d;
  while ((d = done_.load(std::memory_order_acquire)) != n) {
    if (std::chrono::steady_clock::now() > spin_until) {
      done_.wait(d, std::memory_order_acquire);
    } else {
      _mm_pause();
    }
  }
  task_ = nullptr;
}

void ComputePool::Barrier() {
  const int n = size();
  const uint32_t sense = barrier_sense_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_sense_.store(sense + 1, std::memory_order_release);
    barrier_sense_.notify_all();
    return;
  }
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  while (barrier_sense_.load(std::memory_order_acquire) == sense) {
    if (std::chrono::steady_clock::now() > spin_until) {
      barrier_sense_.wait(sense, std::memory_order_acquire);
    } else {
      _mm_pause();
    }
  }
}

}  // namespace moe
