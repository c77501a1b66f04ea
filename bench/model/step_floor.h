// StepFloor: lower bounds on one benchmark step of an MoE model whose
// uncached experts are read from host DRAM, either by the CPU expert server
// (computed there) or by the copy engine (copied to the GPU and computed
// there). bench/moe_layer checks every measured row against them; the
// derivation is in bench/README.md ("The floors").
//
// A step is a sequence of layer calls, each after its attention. For each
// call the input is the rows (routed pairs) of every expert the call did not
// find resident. Two floors from the same rates:
//   - causal: a system learns a call's routing only when its attention ran,
//     so a decode call's copies start then and end inside the call; only a
//     call whose use of (nearly) every expert is certain from what is known
//     beforehand — a prompt-sized call, at least kCertainPairsPerExpert pairs
//     per expert of the layer — may have its copies start earlier (during
//     earlier calls and their attention);
//   - oracle: every call's copies may start early (perfect knowledge of the
//     next layers' routing).
// Both ignore the GPU's own compute (a hit or a copied expert costs the
// device microseconds against the CPU's and the link's milliseconds), so
// each is a bound whatever the GPU does.
//
// Thread-safety: plain functions of their inputs.
#pragma once

#include <vector>

namespace moe {

// The rates a floor is computed with: the best this run measured (a bound
// must hold for the best the noisy host did).
struct FloorRates {
  double dram_Bps = 0;       // host DRAM read by the CPU server's threads
  double shared_Bps = 0;     // host DRAM read by those threads and the copy engine together (>= dram_Bps)
  double pcie_Bps = 0;       // host -> device copies
  double cpu_flops = 0;      // the CPU server's best compute rate (FLOP/s); 0: no compute term
  double cpu_bytes = 0;      // one expert as the CPU server reads it
  double copy_bytes = 0;     // one expert as a copy moves it
  double flops_per_row = 0;  // one row through one expert (2 * 3 * H * I)
  int num_experts = 0;       // per layer
};

// Pairs per expert of the layer from which a call's copies may start before
// its attention ran (the causal floor): with uniform routing such a call
// leaves an expert untouched with probability below e^-4 (2%).
inline constexpr double kCertainPairsPerExpert = 4;

struct Floor {
  double seconds = 0;
  double cpu_share = 0;  // of the uncached pairs, on the CPU in the best split
};

// `calls`: per layer call of the step, in order, the rows of each uncached
// expert (empty: none). `attention_s`: the step's time outside its MoE calls
// (measured). causal: the causal floor, else the oracle.
Floor StepFloor(const std::vector<std::vector<int>>& calls, double attention_s, const FloorRates& rates, bool causal);

}  // namespace moe
