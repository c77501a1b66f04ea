#pragma once

#include <atomic>

namespace moe {

// Raises `a` to `v` when it is below (never lowers it), lock-free; `order`
// is the successful exchange's ordering.
template <typename T>
inline void AtomicMax(std::atomic<T>& a, T v, std::memory_order order = std::memory_order_seq_cst) {
  T cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, order, std::memory_order_relaxed)) {
  }
}

}  // namespace moe
