// RoutingTrace: which experts every token of every decode step was routed to,
// per MoE layer — the input of the cache-policy replay (bench/cache_replay),
// the demo (moe-demo --trace) and the end-to-end benchmark (bench/moe_layer).
// Kept aggregated — per step and layer, each distinct expert with its number of
// (token, expert) pairs, which is all a cache policy counts — and per token
// (the ids each token routed to), which is what a worker's predictor sees.
//
// Files (documented in bench/README.md), optionally xz-compressed (*.xz, read
// and written through liblzma):
//  - ours: a header line {"format":"moe-routing-trace","version":1,
//    "num_layers":L,"num_experts":E,"top_k":K,...} then one line per (step,
//    layer): {"step":S,"layer":L,"topk":[[e,e,...],...]} with one list of
//    expert ids per token;
//  - recorded vLLM routing (e.g. ../shared/data/traces/mixtral-*.jsonl.xz):
//    one line per (problem, layer, token) {"problem_id","layer","experts",
//    "token_idx",...}; a step is one token of one problem across all layers.
//
// The synthetic generator draws each token's top-k experts without
// replacement from a per-layer Zipf popularity over a per-layer random order
// of the experts (each layer has its own hot set), which drifts (ranks swap
// over time) and sees bursts (an expert briefly as hot as the hottest).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

struct ExpertAccess {
  int expert = 0;
  int pairs = 0;  // (token, expert) pairs in this step
};

struct RoutingTrace {
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;
  std::string source;  // what it was read or generated from
  // steps[s][l]: distinct experts routed to in layer l at step s, ascending.
  std::vector<std::vector<std::vector<ExpertAccess>>> steps;
  // tokens[s][l]: the step's tokens' expert ids, [T, top_k] row-major, -1
  // where a token routed to fewer (T may differ between steps).
  std::vector<std::vector<std::vector<int16_t>>> tokens;

  uint64_t Pairs(int layer) const;
};

absl::StatusOr<RoutingTrace> ReadRoutingTrace(const std::string& path);

// A batch-1 trace replayed as `batch` sequences decoded together (continuous
// batching): step s holds the tokens of steps s + j * floor(S / batch) mod S,
// j < batch, in that order, and their accesses merged per expert. S steps,
// `batch` times the pairs. InvalidArgument unless 1 <= batch <= S.
absl::StatusOr<RoutingTrace> InterleaveSequences(const RoutingTrace& t, int batch);

// The `slots` experts with the most pairs in `pairs` (ties: the lower id), ascending.
std::vector<int> MostUsed(const std::vector<uint64_t>& pairs, int slots);

// The fixed set best in hindsight for `layer`: MostUsed over the whole trace.
std::vector<int> BestFixedSet(const RoutingTrace& t, int layer, int slots);

struct SyntheticTraceOptions {
  int num_layers = 8;
  int num_experts = 64;
  int top_k = 6;
  int tokens_per_step = 32;
  int steps = 4000;
  double zipf = 1.1;         // popularity of rank r is proportional to 1 / (r+1)^zipf
  int drift_every = 50;      // steps between drift events (0: no drift)
  int drift_swaps = 1;       // per layer and event: a hot rank (top quarter) swaps with a colder one
  double burst_rate = 0.002; // per step and layer: chance that a random expert bursts
  int burst_steps = 20;      // burst length
  uint64_t seed = 1;
};

// Calls `emit(step, layer, topk)` for every (step, layer) in order; topk is
// [tokens_per_step][top_k] expert ids.
void GenerateRoutingTrace(const SyntheticTraceOptions& o,
                          const std::function<void(int step, int layer, const std::vector<std::vector<int>>& topk)>& emit);
// The same trace, aggregated in memory.
RoutingTrace GenerateRoutingTrace(const SyntheticTraceOptions& o);
// Writes it in our format (xz-compressed when `path` ends in .xz).
absl::Status WriteSyntheticTrace(const SyntheticTraceOptions& o, const std::string& path);

}  // namespace moe
