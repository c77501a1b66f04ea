#include "expert_compute/compute_pool.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>

#include "core/atomic_max.h"
#include "core/cpu_relax.h"
#include "core/log.h"

namespace moe {

namespace {
// Spins on `value` while it equals `old` for up to `spin` (or until
// *hot_until_ns, steady_clock ns, when later), then sleeps on its futex
// (counted in *sleeps).
template <typename T>
void SpinThenWait(const std::atomic<T>& value, T old, std::chrono::microseconds spin,
                  const std::atomic<int64_t>* hot_until_ns = nullptr, std::atomic<uint64_t>* sleeps = nullptr) {
  using Clock = std::chrono::steady_clock;
  const int64_t spin_until = (Clock::now() + spin).time_since_epoch().count();
  SpinYielder yielder;  // a thread sharing this PU (a server connection, the worker) runs within microseconds
  while (value.load(std::memory_order_acquire) == old) {
    const Clock::time_point t = Clock::now();
    const int64_t now = t.time_since_epoch().count();
    if (now > spin_until && (hot_until_ns == nullptr || now > hot_until_ns->load(std::memory_order_relaxed))) {
      if (sleeps != nullptr) sleeps->fetch_add(1, std::memory_order_relaxed);
      value.wait(old, std::memory_order_acquire);
    } else {
      CpuRelax();
      yielder.Tick(t);
    }
  }
}
// Inside a region (barriers, the caller waiting for the others) waits are short.
constexpr auto kBarrierSpin = std::chrono::microseconds(50);
}  // namespace

ComputePool::ComputePool(const NumaBinding& binding, std::chrono::microseconds idle_spin)
    : binding_(binding), size_(std::max<int>(1, static_cast<int>(binding.cpus().size()))), idle_spin_(idle_spin) {
  threads_.reserve(size_ - 1);
  for (int i = 1; i < size_; ++i) threads_.emplace_back([this, i] { Worker(i); });
}

ComputePool::~ComputePool() {
  stop_.store(true);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();
  for (auto& t : threads_) t.join();
}

void ComputePool::Worker(int index) {
  pthread_setname_np(pthread_self(), "moe-compute");  // per-thread CPU in top / pool_soak
  if (absl::Status st = binding_.BindCurrentThread(index); !st.ok()) LogWarning("pool", st.message());
  uint64_t seen = 0;
  for (;;) {
    SpinThenWait(epoch_, seen, idle_spin_, &hot_until_ns_, &sleeps_);
    seen = epoch_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    (*task_)(index, size_);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_ - 1) done_.notify_one();
  }
}

void ComputePool::KeepHotUntil(std::chrono::steady_clock::time_point until) {
  AtomicMax(hot_until_ns_, static_cast<int64_t>(until.time_since_epoch().count()), std::memory_order_relaxed);
}

void ComputePool::Run(const Task& task) {
  std::lock_guard<std::mutex> lock(run_mu_);
  task_ = &task;
  done_.store(0, std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();

  // The caller is thread 0, on the first PU for the duration of the region.
  cpu_set_t saved;
  const bool restore = pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
  (void)binding_.BindCurrentThread(0);
  task(0, size_);
  if (restore) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);

  int d;
  while ((d = done_.load(std::memory_order_acquire)) != size_ - 1) SpinThenWait(done_, d, kBarrierSpin);
  task_ = nullptr;
}

void ComputePool::Barrier() {
  if (size_ == 1) return;
  const uint32_t sense = barrier_sense_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_sense_.store(sense + 1, std::memory_order_release);
    barrier_sense_.notify_all();
    return;
  }
  SpinThenWait(barrier_sense_, sense, kBarrierSpin);
}

}  // namespace moe
