// ExpertActivation: how an expert combines its gate and up projections into
// the input of its down projection, one parameterized function for every
// storage format and both devices. The CPU kernels' epilogues (scalar and
// AVX-512), the CUDA kernels' and the reference MoE's all compute
// ActivateGateUp (the SIMD epilogue is its lane-wise copy in
// expert_compute/simd_avx512.h); a model names its activation in its ModelSpec
// (model/model_spec.h). Plain values; thread-safe.
//
//   kSilu           act = silu(g) * u = g / (1 + exp(-g)) * u   (DeepSeek, Qwen, Mixtral, ...)
//   kClampedSwiglu  g' = min(g, limit), u' = clamp(u, -limit, limit),
//                   act = g' * sigmoid(alpha * g') * (u' + 1)   (GPT-OSS: alpha 1.702, limit 7)
//
// g and u include the expert's gate and up biases when it has them.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace moe {

enum class ActivationKind : uint8_t { kSilu = 0, kClampedSwiglu = 1 };

struct ExpertActivation {
  ActivationKind kind = ActivationKind::kSilu;
  float alpha = 1.0f;  // kClampedSwiglu: the sigmoid's slope
  float limit = 0.0f;  // kClampedSwiglu: gate <= limit, |up| <= limit

  // GPT-OSS's constants (transformers' GptOssExperts: alpha 1.702, limit = config swiglu_limit, 7.0).
  static constexpr float kGptOssAlpha = 1.702f;
  static constexpr float kGptOssLimit = 7.0f;
  static constexpr ExpertActivation Silu() { return ExpertActivation{}; }
  static constexpr ExpertActivation ClampedSwiglu(float alpha, float limit) {
    return ExpertActivation{ActivationKind::kClampedSwiglu, alpha, limit};
  }
  // Spelled out: the CUDA files are C++17.
  constexpr bool operator==(const ExpertActivation& o) const {
    return kind == o.kind && alpha == o.alpha && limit == o.limit;
  }
  constexpr bool operator!=(const ExpertActivation& o) const { return !(*this == o); }
};

namespace activation_internal {
MOE_HOST_DEVICE inline float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}
MOE_HOST_DEVICE inline double Exp(double x) { return exp(x); }
}  // namespace activation_internal

// The activation of one (gate, up) pair, in T (float in the kernels, double
// in the reference). kSilu is exactly the expression every kernel computed
// before activations were parameterized: g / (1 + exp(-g)) * u.
template <typename T>
MOE_HOST_DEVICE inline T ActivateGateUp(const ExpertActivation& a, T g, T u) {
  if (a.kind == ActivationKind::kClampedSwiglu) {
    const T limit = static_cast<T>(a.limit);
    g = g > limit ? limit : g;  // NaN passes through, as torch.clamp
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return g / (T(1) + activation_internal::Exp(-static_cast<T>(a.alpha) * g)) * (u + T(1));
  }
  return g / (T(1) + activation_internal::Exp(-g)) * u;
}

}  // namespace moe
