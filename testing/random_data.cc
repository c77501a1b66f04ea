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

ZipfRouting::ZipfRouting(int layers, int experts, int k, double s, double drift, uint64_t seed)
    : E_(experts), k_(k), drift_(drift), rng_(seed), perm_(layers), cdf_(experts) {
  double sum = 0;
  for (int r = 0; r < E_; ++r) cdf_[r] = (sum += 1.0 / std::pow(r + 1.0, s));
  for (double& c : cdf_) c /= sum;
  for (auto& p : perm_) {
    p.resize(E_);
    for (int e = 0; e < E_; ++e) p[e] = e;
    std::shuffle(p.begin(), p.end(), rng_);
  }
}

std::vector<int> ZipfRouting::Hottest(int li, int c) const {
  std::vector<int> v(perm_[li].begin(), perm_[li].begin() + c);
  std::sort(v.begin(), v.end());
  return v;
}

void ZipfRouting::Step() {
  std::uniform_int_distribution<int> pick(0, E_ - 2);
  const int swaps = static_cast<int>(std::ceil(drift_ * E_));
  for (auto& p : perm_)
    for (int i = 0; i < swaps; ++i) {
      const int r = pick(rng_);
      std::swap(p[r], p[r + 1]);
    }
}

void ZipfRouting::Route(int li, int T, int32_t* ids, float* w) {
  std::mt19937_64& rng = samples_ ? *samples_ : rng_;
  std::uniform_real_distribution<double> u(0, 1);
  for (int t = 0; t < T; ++t) {
    float total = 0;
    for (int j = 0; j < k_; ++j) {
      int e;
      bool dup;
      do {
        const int r = static_cast<int>(std::lower_bound(cdf_.begin(), cdf_.end(), u(rng)) - cdf_.begin());
        e = perm_[li][std::min(r, E_ - 1)];
        dup = false;
        for (int i = 0; i < j; ++i) dup |= ids[t * k_ + i] == e;
      } while (dup);
      ids[t * k_ + j] = e;
      w[t * k_ + j] = static_cast<float>(0.2 + u(rng));
      total += w[t * k_ + j];
    }
    for (int j = 0; j < k_; ++j) w[t * k_ + j] /= total;
  }
}

}  // namespace moe
