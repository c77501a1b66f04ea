// Seeded random inputs for tests, benchmarks and the demo: activations and
// top-k routings (uniform or Zipf-skewed over experts). Never zeros.
#pragma once

#include <cstdint>
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

}  // namespace moe
