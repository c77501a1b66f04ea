// The reference MoE: the correctness oracle for every backend. Plain loops,
// accumulation in Acc (float for the f32 reference, double in tests):
//   out[t] = sum_j w[t,j] * (Down_e act(Gate_e x_t + bg_e, Up_e x_t + bu_e) + bd_e),  e = ids[t,j],
// act the model's ExpertActivation (core/expert_activation.h; silu(g) * u for
// most families), the biases b only where the model's experts carry them.
// Expert weights are read once through the ModelSource and kept. Thread-safe.
#pragma once

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "core/expert_activation.h"
#include "model/model_source.h"
#include "model/routing.h"

namespace moe {

inline float WeightValue(bf16_t v) { return Bf16ToF32(v); }
inline float WeightValue(float v) { return v; }

// out[h] += w * (Down act(Gate x + bg, Up x + bu) + bd)[h] for one expert with
// row-major weights of type W (bf16_t as checkpoints hold them, or float,
// e.g. what packed integer experts stand for): gate/up [I, H], down [H, I];
// biases gate/up [I], down [H], or null (none). act is scratch of I values.
template <typename Acc, typename W>
void AddExpertOutput(const W* gate, const W* up, const W* down, int H, int I, const Acc* x, Acc w, Acc* act,
                     Acc* out, const ExpertActivation& activation = ExpertActivation{}, const W* gate_bias = nullptr,
                     const W* up_bias = nullptr, const W* down_bias = nullptr) {
  for (int i = 0; i < I; ++i) {
    Acc g = 0, u = 0;
    const W* gr = gate + static_cast<size_t>(i) * H;
    const W* ur = up + static_cast<size_t>(i) * H;
    for (int h = 0; h < H; ++h) {
      g += static_cast<Acc>(WeightValue(gr[h])) * x[h];
      u += static_cast<Acc>(WeightValue(ur[h])) * x[h];
    }
    if (gate_bias != nullptr) g += static_cast<Acc>(WeightValue(gate_bias[i]));
    if (up_bias != nullptr) u += static_cast<Acc>(WeightValue(up_bias[i]));
    act[i] = ActivateGateUp<Acc>(activation, g, u);
  }
  for (int h = 0; h < H; ++h) {
    const W* dr = down + static_cast<size_t>(h) * I;
    Acc y = 0;
    for (int i = 0; i < I; ++i) y += static_cast<Acc>(WeightValue(dr[i])) * act[i];
    if (down_bias != nullptr) y += static_cast<Acc>(WeightValue(down_bias[h]));
    out[h] += w * y;
  }
}

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
