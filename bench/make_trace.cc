// make_trace: writes a synthetic routing trace (format in bench/README.md) for
// cache_replay: per-layer Zipf popularity over per-layer hot sets, drift and
// bursts (bench/routing_trace.h says how).
#include <cstdio>

#include "testing/routing_trace.h"
#include "core/flags.h"

int main(int argc, char** argv) {
  moe::SyntheticTraceOptions o;
  std::string out;
  int64_t layers = o.num_layers, experts = o.num_experts, top_k = o.top_k, tokens = o.tokens_per_step,
          steps = o.steps, drift_every = o.drift_every, drift_swaps = o.drift_swaps, burst_steps = o.burst_steps,
          seed = static_cast<int64_t>(o.seed);
  moe::FlagSet flags("make_trace", "--out FILE[.xz] [flags]\nWrites a synthetic routing trace for cache_replay.");
  flags.String("out", &out, "output file; *.xz is compressed through xz (required)");
  flags.Int("layers", &layers, "MoE layers");
  flags.Int("experts", &experts, "routed experts per layer");
  flags.Int("top-k", &top_k, "experts per token");
  flags.Int("tokens", &tokens, "tokens per step (the decode batch)");
  flags.Int("steps", &steps, "decode steps");
  flags.Double("zipf", &o.zipf, "skew: the expert of rank r gets weight 1/(r+1)^zipf");
  flags.Int("drift-every", &drift_every, "steps between drift events (0: the hot sets never move)");
  flags.Int("drift-swaps", &drift_swaps, "per layer and drift event, swaps of a hot rank (top quarter) with a colder one");
  flags.Double("burst-rate", &o.burst_rate, "per step and layer, chance that a random expert bursts to the top weight");
  flags.Int("burst-steps", &burst_steps, "length of a burst in steps");
  flags.Int("seed", &seed, "random seed");
  flags.Parse(argc, argv);
  if (out.empty()) flags.Fail("--out is required (see --help)");
  if (layers <= 0 || experts <= 0 || top_k <= 0 || top_k > experts || tokens <= 0 || steps <= 0)
    flags.Fail("need layers, experts, tokens, steps > 0 and 0 < top-k <= experts");
  if (drift_every < 0 || drift_swaps < 0 || burst_steps < 0 || o.zipf < 0 || o.burst_rate < 0)
    flags.Fail("drift, burst and zipf parameters must be >= 0");
  o.num_layers = static_cast<int>(layers);
  o.num_experts = static_cast<int>(experts);
  o.top_k = static_cast<int>(top_k);
  o.tokens_per_step = static_cast<int>(tokens);
  o.steps = static_cast<int>(steps);
  o.drift_every = static_cast<int>(drift_every);
  o.drift_swaps = static_cast<int>(drift_swaps);
  o.burst_steps = static_cast<int>(burst_steps);
  o.seed = static_cast<uint64_t>(seed);
  if (absl::Status s = moe::WriteSyntheticTrace(o, out); !s.ok()) flags.Fail(std::string(s.message()), 1);
  std::printf("wrote %s: %d steps x %d layers x %d tokens, %d experts, top-%d\n", out.c_str(), o.steps, o.num_layers,
              o.tokens_per_step, o.num_experts, o.top_k);
  return 0;
}
