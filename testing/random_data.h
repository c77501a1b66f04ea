// Seeded random inputs for tests, benchmarks and the demo: activations and
// top-k routings (uniform or Zipf-skewed over experts). Never zeros.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "core/bf16.h"

namespace moe {

// n values, roughly N(0, scale^2), as bf16.
std::vector<bf16_t> RandomActivations(size_t n, uint64_t seed, float scale = 1.0f);

// n tokens x k distinct experts from [0, num_experts) — Zipf(zipf_s) over a
// seed-dependent permutation of experts when zipf_s > 0, uniform otherwise —
// with positive weights summing to 1 per token (softmax of random logits).
void RandomRouting(int n, int k, int num_experts, uint64_t seed, double zipf_s,
                   std::vector<int32_t>* ids, std::vector<float>* weights);

// Zipf routing with a drifting per-layer hot set (benchmarks' synthetic
// decode): each layer's experts in a seed-dependent order, rank r drawn with
// weight 1/(r+1)^s, k distinct experts per token with weights 0.2 + U(0, 1)
// normalized to 1; each Step() swaps ceil(drift x experts) adjacent ranks.
class ZipfRouting {
 public:
  ZipfRouting(int layers, int experts, int k, double s, double drift, uint64_t seed);
  // The c most popular experts of layer index li right now, ascending.
  std::vector<int> Hottest(int li, int c) const;
  // Every expert of layer index li, the most popular first.
  const std::vector<int>& Ranked(int li) const { return perm_[li]; }
  void Step();
  // Samples tokens from a stream of their own from now on (the popularity
  // and its drift stay the seed's): ranks or workers of one model, different
  // tokens.
  void SeedSamples(uint64_t seed) { samples_.emplace(seed); }
  // ids/weights [T, k] of T new tokens of layer index li.
  void Route(int li, int T, int32_t* ids, float* w);

 private:
  int E_, k_;
  double drift_;
  std::mt19937_64 rng_;
  std::optional<std::mt19937_64> samples_;
  std::vector<std::vector<int>> perm_;
  std::vector<double> cdf_;
};

}  // namespace moe
