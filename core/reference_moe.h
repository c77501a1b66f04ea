// The reference MoE: the correctness oracle for every backend. Plain loops,
// accumulation in Acc (float for the f32 reference, double in tests):
//   out[t] = sum_j w[t,j] * Down_e(silu(Gate_e x_t) * Up_e x_t),  e = ids[t,j].
// Expert weights are read once through the ModelSource and kept. Thread-safe.
#pragma once

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "core/model_source.h"
#include "core/routing.h"

namespace moe {

class ReferenceMoe {
 public:
  explicit ReferenceMoe(const ModelSource& source) : source_(source) {}

  // Computes `n` tokens x [n,H] of MoE layer `layer`; out is [n,H].
  template <typename Acc>
  absl::Status Forward(int layer, int n, const bf16_t* x, const RoutingView& routing, Acc* out);

 private:
  absl::StatusOr<std::shared_ptr<const ExpertWeights>> Weights(int layer, int expert);

  const ModelSource& source_;
  std::mutex mu_;
  std::map<std::pair<int, int>, std::shared_ptr<const ExpertWeights>> cache_;
};

// ||a - b|| / ||b|| over n values; +inf if a holds NaN/Inf.
template <typename A, typename B>
double RelativeL2Error(const A* a, const B* b, size_t n) {
  static_assert(!std::is_same_v<A, bf16_t> && !std::is_same_v<B, bf16_t>,
                "bf16_t is raw bits: widen with Bf16ToF32 before comparing");
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den == 0 ? (num == 0 ? 0.0 : INFINITY) : std::sqrt(num / den);
}

}  // namespace moe
