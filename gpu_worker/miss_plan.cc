#include "gpu_worker/miss_plan.h"

#include <algorithm>
#include <bit>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe {

namespace {

// Pairs per expert, hit or missed, and the accessed / missed expert lists.
void CountPairs(const MissPlanInput& in, MissPlan* p) {
  const int E = in.num_experts;
  p->hit_pairs.assign(E, 0);
  p->miss_pairs.assign(E, 0);
  for (size_t i = 0, n = static_cast<size_t>(in.routing.n) * in.routing.k; i < n; ++i) {
    const int e = in.routing.ids[i];
    if (e < 0) continue;
    if (in.slot_buffer[e] >= 0) ++p->hit_pairs[e];
    else ++p->miss_pairs[e];
  }
  p->accessed.clear();
  p->missed.clear();
  for (int e = 0; e < E; ++e) {
    if (p->hit_pairs[e] + p->miss_pairs[e] == 0) continue;
    p->accessed.push_back(e);
    if (p->miss_pairs[e] > 0) p->missed.push_back(e);
  }
}

// Server choice and the copy-instead decision for the missed experts:
// route_of[e] is the route of a missed expert, 0 for the copied ones.
absl::Status ChooseServersAndCopies(const MissPlanInput& in, MissPlan* p) {
  std::vector<uint64_t>& route_of = p->route_of;
  route_of.assign(in.num_experts, 0);
  const int start = ReplicaStart(in.layer, in.num_servers);
  for (int e : p->missed) route_of[e] = RouteExpert(in.servers, in.num_servers, e, start);
  std::vector<int>& copy = p->copy_experts;
  copy.clear();
  std::vector<int>& optional = p->optional_copies;
  optional.clear();
  p->outcome_bucket = -1;
  p->outcome_choice = CopyChoice::kModel;
  for (int e : p->missed) {
    if (route_of[e] == 0 || in.copy_mode == CopyMode::kAlways) {
      if (!in.can_copy)
        return absl::UnavailableError(absl::StrCat("servers: no expert server is up for expert ", e, " of layer ",
                                                   in.layer, " and the worker cannot copy it to the device"));
      copy.push_back(e);
    } else {
      optional.push_back(e);
    }
  }
  if (in.can_copy && in.copy_mode == CopyMode::kAuto && !optional.empty()) {
    if (in.copy_min_tokens > 0) {
      for (int e : optional)
        if (p->miss_pairs[e] >= in.copy_min_tokens) copy.push_back(e);
    } else if (in.cost != nullptr && in.cost->measured) {
      // Balance max(CPU time, copy + device time) with the online rates.
      const CostModel& cost = *in.cost;
      double dev = 0;
      for (int e : p->accessed)
        if (p->hit_pairs[e] > 0) dev += cost.DeviceSeconds(p->hit_pairs[e]);
      for (int e : copy) dev += std::max(cost.CopySeconds(), cost.CopyDeviceSeconds(p->miss_pairs[e]));
      std::vector<CopyCandidate> candidates;
      candidates.reserve(optional.size());
      for (int e : optional) candidates.push_back({e, p->miss_pairs[e]});
      int pairs = 0;
      for (int e : optional) pairs += p->miss_pairs[e];
      CopyForecast forecast;
      std::vector<int> chosen = ChooseCopies(*in.cost, std::move(candidates), dev, in.link_busy_s, &forecast);
      // The outcomes of earlier calls of this shape may overrule the model
      // where never copying is a close call (kOutcomeRange).
      if (!chosen.empty() && in.outcomes != nullptr && forecast.all_cpu_s <= kOutcomeRange * forecast.chosen_s) {
        p->outcome_bucket = CopyOutcomes::HostBucket(static_cast<int>(optional.size()), pairs);
        p->outcome_choice = in.outcomes->Choose(p->outcome_bucket);
        if (p->outcome_choice == CopyChoice::kCpu) chosen.clear();
      }
      copy.insert(copy.end(), chosen.begin(), chosen.end());
    }
  }
  for (int e : copy) route_of[e] = 0;
  p->cpu_experts = 0;
  for (int e : p->missed) p->cpu_experts += route_of[e] != 0;
  return absl::OkStatus();
}

// Lays out groups for the experts that `take` (ascending), each padded to
// row_align rows, and sets next[e] to each one's first row (padding rows:
// token -1, weight 0). The pairs are written by GroupAndBatch.
template <typename Take>
void LayOutGroups(const MissPlan& p, Take take, int row_align, ExpertGroups* g, std::vector<int32_t>* next) {
  g->expert.clear();
  g->row_begin.clear();
  g->count.clear();
  int32_t rows = 0, pairs = 0;
  for (int e : p.accessed) {
    if (!take(e)) continue;
    const int32_t c = p.hit_pairs[e] + p.miss_pairs[e];
    (*next)[e] = rows;
    g->expert.push_back(e);
    g->row_begin.push_back(rows);
    g->count.push_back(c);
    rows += (c + row_align - 1) / row_align * row_align;
    pairs += c;
  }
  g->total_rows = rows;
  g->total_pairs = pairs;
  g->token.assign(rows, -1);
  g->weight.assign(rows, 0.0f);
}

// One pass over the routing: each hit pair into its expert's hit group, each
// copied one into its copy group (tokens ascending within a group), and per
// token the servers its CPU pairs go to; then per server, the tokens with a
// pair of its experts, in batches of at most chunk_tokens tokens.
void GroupAndBatch(const MissPlanInput& in, MissPlan* p) {
  const RoutingView& r = in.routing;
  const int k = r.k;
  std::vector<int32_t>& next_hit = p->hits.scratch;
  std::vector<int32_t>& next_copy = p->copies.scratch;
  next_hit.assign(in.num_experts, 0);
  next_copy.assign(in.num_experts, 0);
  LayOutGroups(*p, [&](int e) { return in.slot_buffer[e] >= 0; }, in.hit_row_align, &p->hits, &next_hit);
  LayOutGroups(*p, [&](int e) { return in.slot_buffer[e] < 0 && p->route_of[e] == 0; }, 1, &p->copies, &next_copy);
  std::vector<uint64_t>& servers_of = p->token_servers;
  servers_of.assign(r.n, 0);
  for (int t = 0; t < r.n; ++t) {
    uint64_t mask = 0;
    for (int j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(t) * k + j;
      const int e = r.ids[i];
      if (e < 0) continue;
      ExpertGroups* g = nullptr;
      int32_t* row = nullptr;
      if (in.slot_buffer[e] >= 0) {
        g = &p->hits;
        row = &next_hit[e];
      } else if (p->route_of[e] == 0) {
        g = &p->copies;
        row = &next_copy[e];
      } else {
        mask |= p->route_of[e];
        continue;
      }
      g->token[*row] = t;
      g->weight[*row] = r.weights[i];
      ++*row;
    }
    servers_of[t] = mask;
  }
  p->expert_mark.resize(in.num_experts, 0);
  p->batches.clear();
  std::vector<int32_t>& rows = p->server_rows;
  for (int s = 0; s < in.num_servers; ++s) {
    auto mine = [&](int e) { return e >= 0 && in.slot_buffer[e] < 0 && (p->route_of[e] >> s & 1) != 0; };
    rows.clear();
    for (int t = 0; t < r.n; ++t)
      if (servers_of[t] >> s & 1) rows.push_back(t);
    const size_t chunk = static_cast<size_t>(std::max(1, in.servers[s].chunk_tokens));
    for (size_t begin = 0; begin < rows.size(); begin += chunk) {
      const int n = static_cast<int>(std::min(chunk, rows.size() - begin));
      ServerBatch& b = p->batches.emplace_back();
      b.server = s;
      b.n = n;
      b.k = k;
      b.rows.assign(rows.begin() + begin, rows.begin() + begin + n);
      b.ids.assign(static_cast<size_t>(n) * k, -1);
      b.weights.assign(b.ids.size(), 0.0f);
      const uint64_t epoch = ++p->mark_epoch;
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < k; ++j) {
          const size_t src = static_cast<size_t>(b.rows[i]) * k + j;
          const int e = r.ids[src];
          if (!mine(e)) continue;
          b.ids[static_cast<size_t>(i) * k + j] = e;
          b.weights[static_cast<size_t>(i) * k + j] = r.weights[src];
          ++b.pairs;
          if (p->expert_mark[e] != epoch) {
            p->expert_mark[e] = epoch;
            ++b.experts;
          }
        }
    }
  }
}

}  // namespace

uint64_t RouteExpert(const PlanServer* servers, int num_servers, int expert, int start) {
  const auto holds = [&](int s) {
    const PlanServer& sv = servers[s];
    return sv.up && sv.hosts != nullptr && (*sv.hosts)[expert];
  };
  const auto at = [&](int i) { return (start + i) % num_servers; };  // the i-th server of the search
  for (int i = 0; i < num_servers; ++i) {
    const int s = at(i);
    if (!holds(s)) continue;
    const ExpertSlice first = servers[s].slice;
    if (first.whole()) return uint64_t{1} << s;
    uint64_t route = 0;
    for (int j = 0; j < first.count; ++j) {
      for (int q = i; q < num_servers; ++q)  // servers searched before were not up or do not host it
        if (const int t = at(q); holds(t) && servers[t].slice == ExpertSlice{j, first.count}) {
          route |= uint64_t{1} << t;
          break;
        }
    }
    if (std::popcount(route) == first.count) return route;
  }
  return 0;
}

FailoverChoice ChooseFailover(const PlanServer* servers, int num_servers, int failed, const std::vector<int32_t>& ids,
                              bool in_time, bool device_can) {
  FailoverChoice c;
  for (int s = 0; s < num_servers && in_time; ++s) {
    const PlanServer& sv = servers[s];
    if (s == failed || !sv.up || sv.hosts == nullptr || !(sv.slice == servers[failed].slice)) continue;
    bool all = true;
    for (int32_t e : ids) all = all && (e < 0 || (*sv.hosts)[e]);
    if (!all) continue;
    c.action = FailoverChoice::kResend;
    c.server = s;
    return c;
  }
  if (servers[failed].slice.whole() && device_can) c.action = FailoverChoice::kDevice;
  return c;
}

int ReplicaStart(int layer, int num_servers) {
  return num_servers <= 1 ? 0 : static_cast<int>(static_cast<uint32_t>(layer) % static_cast<uint32_t>(num_servers));
}

int MissPlan::copy_group(int expert) const {
  auto it = std::lower_bound(copies.expert.begin(), copies.expert.end(), expert);
  return it != copies.expert.end() && *it == expert ? static_cast<int>(it - copies.expert.begin()) : -1;
}

absl::Status PlanMisses(const MissPlanInput& in, MissPlan* p) {
  CountPairs(in, p);
  MOE_RETURN_IF_ERROR(ChooseServersAndCopies(in, p));
  GroupAndBatch(in, p);
  p->hit_buffer.resize(p->hits.num_groups());
  for (int g = 0; g < p->hits.num_groups(); ++g) p->hit_buffer[g] = in.slot_buffer[p->hits.expert[g]];
  return absl::OkStatus();
}

}  // namespace moe
