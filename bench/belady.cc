#include "bench/belady.h"

#include <algorithm>
#include <limits>
#include <queue>

namespace moe {

namespace {

// Residual graph for successive shortest paths with potentials.
struct Arc {
  int to;
  int rev;       // index of the reverse arc in to's list
  int cap;
  int64_t cost;
};

class MinCostFlow {
 public:
  explicit MinCostFlow(int n) : g_(n) {}
  // Returns (node, index) of the forward arc.
  std::pair<int, int> Add(int from, int to, int cap, int64_t cost) {
    g_[from].push_back({to, static_cast<int>(g_[to].size()), cap, cost});
    g_[to].push_back({from, static_cast<int>(g_[from].size()) - 1, 0, -cost});
    return {from, static_cast<int>(g_[from].size()) - 1};
  }
  const Arc& arc(std::pair<int, int> id) const { return g_[id.first][id.second]; }

  // Sends up to `flow` units from s to t along negative-cost paths only
  // (arcs go forward in node order at first, so the initial potentials come
  // from one pass over the DAG). Returns the total cost (<= 0).
  int64_t Run(int s, int t, int flow) {
    const int n = static_cast<int>(g_.size());
    constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
    std::vector<int64_t> pot(n, kInf);
    pot[s] = 0;
    for (int u = 0; u < n; ++u) {
      if (pot[u] == kInf) continue;
      for (const Arc& a : g_[u]) {
        if (a.cap > 0 && pot[u] + a.cost < pot[a.to]) pot[a.to] = pot[u] + a.cost;
      }
    }
    for (int64_t& p : pot) p = p == kInf ? 0 : p;
    int64_t total = 0;
    std::vector<int64_t> dist(n);
    std::vector<int> prev_node(n), prev_arc(n);
    while (flow > 0) {
      std::fill(dist.begin(), dist.end(), kInf);
      dist[s] = 0;
      using Item = std::pair<int64_t, int>;
      std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pq;
      pq.push({0, s});
      while (!pq.empty()) {
        auto [d, u] = pq.top();
        pq.pop();
        if (d > dist[u]) continue;
        for (int i = 0; i < static_cast<int>(g_[u].size()); ++i) {
          const Arc& a = g_[u][i];
          if (a.cap <= 0) continue;
          const int64_t nd = d + a.cost + pot[u] - pot[a.to];
          if (nd < dist[a.to]) {
            dist[a.to] = nd;
            prev_node[a.to] = u;
            prev_arc[a.to] = i;
            pq.push({nd, a.to});
          }
        }
      }
      if (dist[t] == kInf) break;
      for (int v = 0; v < n; ++v) {
        if (dist[v] < kInf) pot[v] += dist[v];
      }
      const int64_t path_cost = pot[t] - pot[s];
      if (path_cost >= 0) break;  // no further gain: the remaining slots idle
      int push = flow;
      for (int v = t; v != s; v = prev_node[v]) push = std::min(push, g_[prev_node[v]][prev_arc[v]].cap);
      for (int v = t; v != s; v = prev_node[v]) {
        Arc& a = g_[prev_node[v]][prev_arc[v]];
        a.cap -= push;
        g_[v][a.rev].cap += push;
      }
      flow -= push;
      total += path_cost * push;
    }
    return total;
  }

 private:
  std::vector<std::vector<Arc>> g_;
};

}  // namespace

OfflineResult BeladyOptimum(const std::vector<std::vector<ExpertAccess>>& steps, int num_experts, int slots) {
  OfflineResult r;
  const int n = static_cast<int>(steps.size());
  for (const auto& s : steps) {
    for (const ExpertAccess& a : s) r.pairs += a.pairs;
  }
  if (slots <= 0 || n == 0) return r;
  // Node i: the moment before step i (node n: after the last step). A slot
  // idles from i to i+1, or holds expert e from just after its access at step
  // a (node a+1) through its next access at step b (node b+1), earning b's pairs.
  MinCostFlow g(n + 1);
  for (int i = 0; i < n; ++i) g.Add(i, i + 1, slots, 0);
  struct Hold {
    int expert;
    std::pair<int, int> arc;
    int prev;  // index of the same expert's previous hold, or -1
  };
  std::vector<Hold> holds;
  std::vector<int> last_step(num_experts, -1), last_hold(num_experts, -1);
  for (int b = 0; b < n; ++b) {
    for (const ExpertAccess& acc : steps[b]) {
      const int e = acc.expert;
      if (last_step[e] >= 0) {
        holds.push_back({e, g.Add(last_step[e] + 1, b + 1, 1, -static_cast<int64_t>(acc.pairs)), last_hold[e]});
        last_hold[e] = static_cast<int>(holds.size()) - 1;
      }
      last_step[e] = b;
    }
  }
  r.hits = static_cast<uint64_t>(-g.Run(0, n, slots));
  // A kept hold right after another kept hold of the same expert needs no copy.
  for (const Hold& h : holds) {
    if (g.arc(h.arc).cap != 0) continue;
    if (h.prev < 0 || g.arc(holds[h.prev].arc).cap != 0) ++r.copies;
  }
  return r;
}

}  // namespace moe
