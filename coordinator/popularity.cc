#include "coordinator/popularity.h"

#include <cmath>

namespace moe {

namespace {
// Rebase once the stored values carry a scale above 2^40: far from overflow,
// and rare (every 40 half-lives).
constexpr double kMaxExponent = 40.0;
}  // namespace

DecayedCounts::DecayedCounts(int num_layers, int num_experts, double half_life_seconds, double now)
    : num_layers_(num_layers),
      num_experts_(num_experts),
      half_life_(half_life_seconds),
      ref_(now),
      pairs_(static_cast<size_t>(num_layers) * num_experts, 0.0),
      layer_pairs_(num_layers, 0.0),
      layer_hits_(num_layers, 0.0) {}

double DecayedCounts::Scale(double now) const { return std::exp2(-(now - ref_) / half_life_); }

void DecayedCounts::Rebase(double now) {
  if ((now - ref_) / half_life_ < kMaxExponent) return;
  const double s = Scale(now);
  for (double& v : pairs_) v *= s;
  for (double& v : layer_pairs_) v *= s;
  for (double& v : layer_hits_) v *= s;
  ref_ = now;
}

void DecayedCounts::Add(int layer, int expert, double pairs, double hits, double now) {
  Rebase(now);
  const double up = 1.0 / Scale(now);
  pairs_[static_cast<size_t>(layer) * num_experts_ + expert] += pairs * up;
  layer_pairs_[layer] += pairs * up;
  layer_hits_[layer] += hits * up;
}

double DecayedCounts::Count(int layer, int expert, double now) const {
  return pairs_[static_cast<size_t>(layer) * num_experts_ + expert] * Scale(now);
}

std::vector<double> DecayedCounts::Layer(int layer, double now) const {
  const double s = Scale(now);
  std::vector<double> out(num_experts_);
  const double* row = &pairs_[static_cast<size_t>(layer) * num_experts_];
  for (int e = 0; e < num_experts_; ++e) out[e] = row[e] * s;
  return out;
}

double DecayedCounts::LayerPairs(int layer, double now) const { return layer_pairs_[layer] * Scale(now); }
double DecayedCounts::LayerHits(int layer, double now) const { return layer_hits_[layer] * Scale(now); }

void DecayedCounts::SetHalfLife(double half_life_seconds, double now) {
  const double s = Scale(now);
  for (double& v : pairs_) v *= s;
  for (double& v : layer_pairs_) v *= s;
  for (double& v : layer_hits_) v *= s;
  ref_ = now;
  half_life_ = half_life_seconds;
}

Popularity::Popularity(int num_layers, int num_experts, double half_life_seconds, double now)
    : num_layers_(num_layers),
      num_experts_(num_experts),
      half_life_(half_life_seconds),
      global_(num_layers, num_experts, half_life_seconds, now) {}

void Popularity::Add(const std::string& worker, int layer, int expert, double pairs, double hits, double now) {
  global_.Add(layer, expert, pairs, hits, now);
  auto it = workers_.find(worker);
  if (it == workers_.end())
    it = workers_.emplace(worker, DecayedCounts(num_layers_, num_experts_, half_life_, now)).first;
  it->second.Add(layer, expert, pairs, hits, now);
}

const DecayedCounts* Popularity::worker(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? nullptr : &it->second;
}

void Popularity::SetHalfLife(double half_life_seconds, double now) {
  half_life_ = half_life_seconds;
  global_.SetHalfLife(half_life_seconds, now);
  for (auto& [id, c] : workers_) c.SetHalfLife(half_life_seconds, now);
}

}  // namespace moe
