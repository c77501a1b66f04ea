#include "model/reference_moe.h"

#include <vector>

#include "core/status_macros.h"

namespace moe {

absl::StatusOr<std::shared_ptr<const ExpertWeights>> ReferenceMoe::Weights(int layer, int expert) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find({layer, expert});
    if (it != cache_.end()) return it->second;
  }
  auto w = std::make_shared<ExpertWeights>();
  MOE_RETURN_IF_ERROR(source_.ReadExpert(layer, expert, w.get()));
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.emplace(std::make_pair(layer, expert), std::move(w)).first->second;
}

template <typename Acc>
absl::Status ReferenceMoe::Forward(int layer, int n, const bf16_t* x, const RoutingView& routing,
                                   Acc* out) {
  const ModelSpec& spec = source_.spec();
  const int H = spec.hidden, I = spec.intermediate;
  std::vector<Acc> xf(H), act(I);
  for (int t = 0; t < n; ++t) {
    Acc* o = out + static_cast<size_t>(t) * H;
    for (int h = 0; h < H; ++h) o[h] = 0;
    for (int h = 0; h < H; ++h) xf[h] = Bf16ToF32(x[static_cast<size_t>(t) * H + h]);
    for (int j = 0; j < routing.k; ++j) {
      const int e = routing.ids[static_cast<size_t>(t) * routing.k + j];
      if (e < 0) continue;
      const Acc w = routing.weights[static_cast<size_t>(t) * routing.k + j];
      MOE_ASSIGN_OR_RETURN(std::shared_ptr<const ExpertWeights> ew, Weights(layer, e));
      const bool b = ew->has_biases();
      AddExpertOutput<Acc>(ew->gate.data(), ew->up.data(), ew->down.data(), H, I, xf.data(), w, act.data(), o,
                           spec.activation, b ? ew->gate_bias.data() : nullptr, b ? ew->up_bias.data() : nullptr,
                           b ? ew->down_bias.data() : nullptr);
    }
  }
  return absl::OkStatus();
}

template absl::Status ReferenceMoe::Forward<float>(int, int, const bf16_t*, const RoutingView&, float*);
template absl::Status ReferenceMoe::Forward<double>(int, int, const bf16_t*, const RoutingView&, double*);

}  // namespace moe
