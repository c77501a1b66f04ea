#include "testing/random_data.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace moe {

std::vector<bf16_t> RandomActivations(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<bf16_t> v(n);
  for (auto& x : v) {
    float f;
    do { f = dist(rng); } while (f == 0.0f);
    x = F32ToBf16(f);
  }
  return v;
}

void RandomRouting(int n, int k, int num_experts, uint64_t seed, double zipf_s,
                   std::vector<int32_t>* ids, std::vector<float>* weights) {
  std::mt19937_64 rng(seed);
  std::vector<int> perm(num_experts);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> cdf(num_experts);
  double acc = 0;
  for (int i = 0; i < num_experts; ++i) {
    acc += zipf_s > 0 ? 1.0 / std::pow(i + 1.0, zipf_s) : 1.0;
    cdf[i] = acc;
  }
  std::uniform_real_distribution<double> u(0.0, acc);
  std::normal_distribution<float> logit(0.0f, 1.0f);
  ids->assign(size_t(n) * k, -1);
  weights->assign(size_t(n) * k, 0.0f);
  for (int t = 0; t < n; ++t) {
    int32_t* row = ids->data() + size_t(t) * k;
    for (int j = 0; j < k; ++j) {
      int e;
      do {
        e = perm[std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin()];
      } while (std::find(row, row + j, e) != row + j);
      row[j] = e;
    }
    float* w = weights->data() + size_t(t) * k;
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += (w[j] = std::exp(logit(rng)));
    for (int j = 0; j < k; ++j) w[j] /= sum;
  }
}

}  // namespace moe
