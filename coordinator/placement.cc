#include "coordinator/placement.h"

#include <algorithm>
#include <numeric>

namespace moe {

namespace {

bool Contains(const std::vector<int>& v, int e) { return std::find(v.begin(), v.end(), e) != v.end(); }

// The worker may cache expert e of layer l (its rank's, in a tensor-parallel group).
bool MayHold(const WorkerPlacementState& w, int l, int e) {
  return w.group.size <= 1 || ExpertOwner(l, e, w.group.size) == w.group.rank;
}

double Sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

const std::vector<int>& LayerOf(const std::vector<std::vector<int>>& per_layer, int layer) {
  static const std::vector<int> kEmpty;
  return layer < static_cast<int>(per_layer.size()) ? per_layer[layer] : kEmpty;
}

// Experts with value > 0, hottest first; ties: those in `preferred` first, then lower id.
std::vector<int> Ranked(const std::vector<double>& values, const std::vector<int>& preferred) {
  std::vector<int> order;
  for (int e = 0; e < static_cast<int>(values.size()); ++e) {
    if (values[e] > 0) order.push_back(e);
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (values[a] != values[b]) return values[a] > values[b];
    const bool pa = Contains(preferred, a), pb = Contains(preferred, b);
    if (pa != pb) return pa;
    return a < b;
  });
  return order;
}

// The worker's pins in `layer` that fit its slots (hottest first when there are too many).
std::vector<int> EffectivePins(const WorkerPlacementState& w, int layer, const std::vector<double>& values) {
  std::vector<int> pins = LayerOf(w.pinned, layer);
  std::sort(pins.begin(), pins.end());
  pins.erase(std::unique(pins.begin(), pins.end()), pins.end());
  pins.erase(std::remove_if(pins.begin(), pins.end(),
                            [&](int e) { return e < 0 || e >= static_cast<int>(values.size()) || !MayHold(w, layer, e); }),
             pins.end());
  if (static_cast<int>(pins.size()) > w.slots_per_layer) {
    std::stable_sort(pins.begin(), pins.end(), [&](int a, int b) { return values[a] > values[b]; });
    pins.resize(w.slots_per_layer);
  }
  return pins;
}

bool Caches(const WorkerPlacementState& w, int layer) {
  return layer < static_cast<int>(w.cached.size()) && w.cached[layer] && w.slots_per_layer > 0;
}

// Union mode: the target set of every worker in `layer`.
std::vector<std::vector<int>> UnionTargets(const PlacementProblem& p, int layer,
                                           const std::vector<std::vector<std::vector<int>>>& sets) {
  const int nw = static_cast<int>(p.workers.size());
  const std::vector<double>& g = p.global_popularity[layer];
  std::vector<std::vector<int>> target(nw);
  std::vector<int> room(nw, 0);
  std::vector<bool> placed(p.num_experts, false);
  for (int w = 0; w < nw; ++w) {
    const WorkerPlacementState& ws = p.workers[w];
    if (!Caches(ws, layer)) continue;
    if (ws.frozen) {
      target[w] = sets[w][layer];
    } else {
      target[w] = EffectivePins(ws, layer, g);
      room[w] = ws.slots_per_layer - static_cast<int>(target[w].size());
    }
    for (int e : target[w]) placed[e] = true;
  }
  const double total = Sum(g);
  const std::vector<int> order = Ranked(g, {});
  // The hottest go everywhere.
  for (int e : order) {
    if (!(total > 0) || g[e] / total < p.params.replicate_share) break;
    for (int w = 0; w < nw; ++w) {
      if (room[w] > 0 && !Contains(target[w], e) && MayHold(p.workers[w], layer, e)) {
        target[w].push_back(e);
        --room[w];
      }
    }
    placed[e] = true;
  }
  // The rest once each: with the worker that holds it if it has room, else
  // with the worker that has the most room.
  for (int e : order) {
    if (placed[e]) continue;
    int best = -1;
    for (int w = 0; w < nw; ++w) {
      if (room[w] > 0 && Contains(sets[w][layer], e) && MayHold(p.workers[w], layer, e)) {
        best = w;
        break;
      }
    }
    if (best < 0) {
      for (int w = 0; w < nw; ++w) {
        if (room[w] > 0 && MayHold(p.workers[w], layer, e) && (best < 0 || room[w] > room[best])) best = w;
      }
    }
    if (best < 0) continue;  // no worker with room may hold it (a group's other ranks are full)
    target[best].push_back(e);
    --room[best];
    placed[e] = true;
  }
  // Room left (more slots than hot experts): replicas of the hottest.
  for (int w = 0; w < nw; ++w) {
    for (int e : order) {
      if (room[w] == 0) break;
      if (!Contains(target[w], e) && MayHold(p.workers[w], layer, e)) {
        target[w].push_back(e);
        --room[w];
      }
    }
  }
  return target;
}

struct Candidate {
  PlannedMove move;
  int order = 0;  // position within its layer (moves of a layer are taken as a prefix)
};

// Hit rate of `sets` expected from `values` per layer of one worker; also the pair total.
void ExpectedHits(const PlacementProblem& p, int w, const std::vector<std::vector<int>>& sets, bool own_only,
                  double* hits, double* pairs) {
  *hits = 0;
  *pairs = 0;
  const WorkerPlacementState& ws = p.workers[w];
  for (int l = 0; l < p.num_layers; ++l) {
    if (!Caches(ws, l)) continue;
    const std::vector<double>* values;
    if (own_only) {
      if (l >= static_cast<int>(ws.popularity.size()) || ws.popularity[l].empty()) continue;
      values = &ws.popularity[l];
    } else {
      values = &PlacementValues(p, w, l);
    }
    *pairs += Sum(*values);
    for (int e : sets[l]) *hits += (*values)[e];
  }
}

double Coverage(const PlacementProblem& p, const std::vector<std::vector<std::vector<int>>>& sets) {
  double covered = 0, total = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    const std::vector<double>& g = p.global_popularity[l];
    std::vector<bool> held(p.num_experts, false);
    for (size_t w = 0; w < sets.size(); ++w) {
      for (int e : sets[w][l]) held[e] = true;
    }
    for (int e = 0; e < p.num_experts; ++e) {
      total += g[e];
      if (held[e]) covered += g[e];
    }
  }
  return total > 0 ? covered / total : 0.0;
}

void Rates(const PlacementProblem& p, const std::vector<std::vector<std::vector<int>>>& sets,
           std::vector<double>* per_worker, double* all) {
  double all_hits = 0, all_pairs = 0;
  per_worker->assign(p.workers.size(), 0.0);
  for (size_t w = 0; w < p.workers.size(); ++w) {
    double h, n;
    ExpectedHits(p, static_cast<int>(w), sets[w], /*own_only=*/false, &h, &n);
    (*per_worker)[w] = n > 0 ? h / n : 0.0;
    ExpectedHits(p, static_cast<int>(w), sets[w], /*own_only=*/true, &h, &n);
    all_hits += h;
    all_pairs += n;
  }
  *all = all_pairs > 0 ? all_hits / all_pairs : 0.0;
}

}  // namespace

const std::vector<double>& PlacementValues(const PlacementProblem& p, int worker, int layer) {
  const WorkerPlacementState& w = p.workers[worker];
  if (p.params.mode == PlacementMode::kPerWorker && layer < static_cast<int>(w.popularity.size()) &&
      !w.popularity[layer].empty() && Sum(w.popularity[layer]) > 0) {
    return w.popularity[layer];
  }
  return p.global_popularity[layer];
}

namespace {

// The plan before any move: every worker's resident sets, sorted, and the
// rates and coverage they give.
PlacementPlan CurrentPlacement(const PlacementProblem& p) {
  const int nw = static_cast<int>(p.workers.size());
  PlacementPlan plan;
  plan.sets.resize(nw);
  for (int w = 0; w < nw; ++w) {
    plan.sets[w].resize(p.num_layers);
    for (int l = 0; l < p.num_layers; ++l) {
      std::vector<int> s = LayerOf(p.workers[w].resident, l);
      std::sort(s.begin(), s.end());
      plan.sets[w][l] = std::move(s);
    }
  }
  plan.bytes.assign(nw, 0);
  Rates(p, plan.sets, &plan.hit_rate_before, &plan.hit_rate_before_all);
  plan.coverage_before = Coverage(p, plan.sets);
  return plan;
}

// The moves worth making in layer `l` of worker `w` against `plan.sets`, in
// the order they would be taken: pins, then newcomers by value, each
// replacing the least worth resident (or a free slot) while its extra
// expected hits beat the copy cost plus the hysteresis margin. `union_target`
// is the layer's target set for w in union mode (ignored otherwise).
void LayerCandidates(const PlacementProblem& p, const PlacementPlan& plan, int w, int l,
                     const std::vector<int>& union_target, std::vector<Candidate>* candidates, int* order) {
  const int nw = static_cast<int>(p.workers.size());
  const WorkerPlacementState& ws = p.workers[w];
  const bool union_mode = p.params.mode == PlacementMode::kUnion;
  const double margin = p.params.hysteresis_margin, cost = p.params.copy_cost_hits;
  const std::vector<double>& values = union_mode ? p.global_popularity[l] : PlacementValues(p, w, l);
  const std::vector<int>& held = plan.sets[w][l];
  const std::vector<int> pins = EffectivePins(ws, l, values);
  std::vector<int> target;
  if (union_mode) {
    target = union_target;
  } else {
    target = pins;
    for (int e : Ranked(values, held)) {
      if (static_cast<int>(target.size()) >= ws.slots_per_layer) break;
      if (!Contains(target, e) && MayHold(ws, l, e)) target.push_back(e);
    }
  }
  // A resident's worth to this worker: 0 in union mode when another worker holds it too.
  auto worth = [&](int e) {
    if (union_mode) {
      for (int o = 0; o < nw; ++o) {
        if (o != w && Contains(plan.sets[o][l], e)) return 0.0;
      }
    }
    return values[e];
  };
  std::vector<int> incoming;
  for (int e : pins) {
    if (!Contains(held, e)) incoming.push_back(e);
  }
  std::vector<int> rest;
  for (int e : target) {
    if (!Contains(held, e) && !Contains(pins, e)) rest.push_back(e);
  }
  std::sort(rest.begin(), rest.end(), [&](int a, int b) { return values[a] != values[b] ? values[a] > values[b] : a < b; });
  incoming.insert(incoming.end(), rest.begin(), rest.end());
  std::vector<int> victims;
  for (int e : held) {
    if (!Contains(target, e) && !Contains(pins, e)) victims.push_back(e);
  }
  std::vector<double> victim_worth(p.num_experts, 0.0);
  for (int e : victims) victim_worth[e] = worth(e);
  std::sort(victims.begin(), victims.end(), [&](int a, int b) {
    return victim_worth[a] != victim_worth[b] ? victim_worth[a] < victim_worth[b] : a < b;
  });
  int free_slots = ws.slots_per_layer - static_cast<int>(held.size());
  size_t next_victim = 0;
  for (int c : incoming) {
    const bool pinned = Contains(pins, c);
    int victim = -1;
    double victim_value = 0;
    if (free_slots <= 0) {
      if (next_victim >= victims.size()) break;
      victim = victims[next_victim];
      victim_value = victim_worth[victim];
    }
    if (!pinned && !(values[c] - victim_value > cost + margin * victim_value)) break;
    if (victim >= 0) {
      ++next_victim;
    } else {
      --free_slots;
    }
    candidates->push_back({PlannedMove{w, l, c, victim, values[c] - victim_value, pinned}, (*order)++});
  }
}

// Applies worker `w`'s candidates to `plan` within its copy budget: pins
// first, then by gain; a layer whose next move does not fit takes no more.
void AcceptMoves(const PlacementProblem& p, int w, std::vector<Candidate> candidates, PlacementPlan* plan) {
  const WorkerPlacementState& ws = p.workers[w];
  // Pins first, then by gain; equal gains keep their layer order, so each
  // layer's accepted moves are a prefix of its candidates.
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.move.pinned != b.move.pinned) return a.move.pinned;
    return a.move.gain > b.move.gain;
  });
  std::vector<bool> layer_closed(p.num_layers, false);
  for (const Candidate& c : candidates) {
    const PlannedMove& m = c.move;
    if (layer_closed[m.layer]) continue;
    if (!m.pinned && ws.budget_bytes != kUnlimitedBudget && plan->bytes[w] + ws.expert_bytes > ws.budget_bytes) {
      layer_closed[m.layer] = true;
      continue;
    }
    std::vector<int>& s = plan->sets[w][m.layer];
    if (m.evicted >= 0) s.erase(std::find(s.begin(), s.end(), m.evicted));
    s.push_back(m.expert);
    plan->bytes[w] += ws.expert_bytes;
    plan->moves.push_back(m);
  }
  for (auto& s : plan->sets[w]) std::sort(s.begin(), s.end());
}

}  // namespace

PlacementPlan PlanPlacement(const PlacementProblem& p) {
  const int nw = static_cast<int>(p.workers.size());
  PlacementPlan plan = CurrentPlacement(p);
  const bool union_mode = p.params.mode == PlacementMode::kUnion;
  std::vector<std::vector<std::vector<int>>> union_targets;  // [layer][worker]
  if (union_mode) {
    for (int l = 0; l < p.num_layers; ++l) union_targets.push_back(UnionTargets(p, l, plan.sets));
  }
  static const std::vector<int> kNoTarget;
  for (int w = 0; w < nw; ++w) {
    const WorkerPlacementState& ws = p.workers[w];
    if (ws.frozen) continue;
    std::vector<Candidate> candidates;
    int order = 0;
    for (int l = 0; l < p.num_layers; ++l) {
      if (!Caches(ws, l)) continue;
      LayerCandidates(p, plan, w, l, union_mode ? union_targets[l][w] : kNoTarget, &candidates, &order);
    }
    AcceptMoves(p, w, std::move(candidates), &plan);
  }
  Rates(p, plan.sets, &plan.hit_rate_after, &plan.hit_rate_after_all);
  plan.coverage_after = Coverage(p, plan.sets);
  return plan;
}

}  // namespace moe
