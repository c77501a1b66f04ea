// Expert popularity: per (layer, expert), the number of (token, expert) pairs
// routed to it, exponentially decayed with a half-life (a pair seen h seconds
// ago counts 1/2, 2h ago 1/4, ...), kept per worker and combined across
// workers (each weighing at most as much as the median worker); also the
// decayed pairs and hits per layer, for hit rates. Time is passed in
// explicitly (seconds on any monotonic clock) so tests and the cache replay
// can drive it.
//
// Adding is O(1): values are stored scaled by 2^((t - t_ref)/h) and scaled
// back when read; the reference time moves forward now and then to keep the
// scale bounded. Not thread-safe (the Coordinator guards it).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace moe {

class DecayedCounts {
 public:
  DecayedCounts(int num_layers, int num_experts, double half_life_seconds, double now);

  // `pairs` pairs of (layer, expert) at time `now`, `hits` of them cache hits.
  void Add(int layer, int expert, double pairs, double hits, double now);
  double Count(int layer, int expert, double now) const;
  // Every expert's count in `layer`, [num_experts].
  std::vector<double> Layer(int layer, double now) const;
  double LayerPairs(int layer, double now) const;
  double LayerHits(int layer, double now) const;
  // Re-expresses the counts at `now`, then decays with the new half-life.
  void SetHalfLife(double half_life_seconds, double now);

  int num_layers() const { return num_layers_; }
  int num_experts() const { return num_experts_; }

 private:
  double Scale(double now) const;      // 2^(-(now - ref)/h): stored -> current
  void Rebase(double now);             // moves ref to now when the scale gets large

  int num_layers_, num_experts_;
  double half_life_;
  double ref_;
  std::vector<double> pairs_;          // [layer * num_experts + expert], scaled
  std::vector<double> layer_pairs_, layer_hits_;  // [layer], scaled
};

// Per-worker counts, and their combination across workers. The combination
// (what union placement, the fallback of per-worker placement, `moectl
// popularity` and the layer hit rates read) weighs no worker beyond the
// median worker: per layer, a worker whose decayed pairs exceed the lower
// median of the workers' pairs there is scaled down to it, and the result is
// scaled back to the workers' total pairs. How the total splits over the
// experts (and into hits) is then no more one worker's than the median
// worker's, however much it reports: with two workers, a half (issue 47: a
// rogue's counts no longer steer placement or the hit rates); the total itself
// stays the sum of the reports (which the coordinator bounds per worker,
// routing_capacity.h). A worker that is removed (purged) leaves the
// combination.
class Popularity {
 public:
  Popularity(int num_layers, int num_experts, double half_life_seconds);

  // Counts of one worker's report.
  void Add(const std::string& worker, int layer, int expert, double pairs, double hits, double now);
  // Forgets the worker's counts.
  void Remove(const std::string& worker);
  // nullptr if the worker never reported (or was removed).
  const DecayedCounts* worker(const std::string& worker) const;

  // One layer of the combination at `now`: the experts' counts [num_experts]
  // (summing to `pairs`, the workers' total), and the hits among them.
  struct Combined {
    std::vector<double> counts;
    double pairs = 0, hits = 0;
  };
  Combined Layer(int layer, double now) const;

  void SetHalfLife(double half_life_seconds, double now);
  double half_life() const { return half_life_; }
  size_t num_workers() const { return workers_.size(); }

 private:
  int num_layers_, num_experts_;
  double half_life_;
  std::map<std::string, DecayedCounts> workers_;
};

}  // namespace moe
