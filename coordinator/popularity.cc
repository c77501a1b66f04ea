#include "coordinator/popularity.h"

#include <algorithm>
#include <cmath>
#include <utility>

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

Popularity::Popularity(int num_layers, int num_experts, double half_life_seconds)
    : num_layers_(num_layers), num_experts_(num_experts), half_life_(half_life_seconds) {}

void Popularity::Add(const std::string& worker, int layer, int expert, double pairs, double hits, double now) {
  auto it = workers_.find(worker);
  if (it == workers_.end())
    it = workers_.emplace(worker, DecayedCounts(num_layers_, num_experts_, half_life_, now)).first;
  it->second.Add(layer, expert, pairs, hits, now);
}

void Popularity::Remove(const std::string& worker) { workers_.erase(worker); }

const DecayedCounts* Popularity::worker(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? nullptr : &it->second;
}

Popularity::Combined Popularity::Layer(int layer, double now) const {
  Combined out;
  out.counts.assign(num_experts_, 0.0);
  std::vector<std::pair<const DecayedCounts*, double>> reporting;  // (counts, layer pairs)
  for (const auto& [id, c] : workers_) {
    const double pairs = c.LayerPairs(layer, now);
    if (pairs > 0) reporting.emplace_back(&c, pairs);
  }
  if (reporting.empty()) return out;
  std::vector<double> totals;
  for (const auto& r : reporting) totals.push_back(r.second);
  std::nth_element(totals.begin(), totals.begin() + (totals.size() - 1) / 2, totals.end());
  const double median = totals[(totals.size() - 1) / 2];  // the lower median
  // Each worker's weight, then one scale for all: the combination keeps the
  // workers' total pairs (thresholds in hits, copy_cost_hits, mean what they
  // did), only how that total splits over the experts and into hits is weighted.
  double total = 0, weighted = 0;
  for (const auto& r : reporting) {
    total += r.second;
    weighted += std::min(r.second, median);
  }
  const double scale = total / weighted;
  for (const auto& [c, pairs] : reporting) {
    const double weight = scale * (pairs > median ? median / pairs : 1.0);
    const std::vector<double> counts = c->Layer(layer, now);
    for (int e = 0; e < num_experts_; ++e) out.counts[e] += weight * counts[e];
    out.hits += weight * c->LayerHits(layer, now);
  }
  out.pairs = total;
  return out;
}

void Popularity::SetHalfLife(double half_life_seconds, double now) {
  half_life_ = half_life_seconds;
  for (auto& [id, c] : workers_) c.SetHalfLife(half_life_seconds, now);
}

}  // namespace moe
