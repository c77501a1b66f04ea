// The AMX tile loops alone, as a ceiling for the CPU kernels: the 2x2
// blocking of kernel_amx.cc (two A tiles, two B tiles, four accumulators per
// 32-k block), with its operands in L1 or streamed from L2, run by the first
// `threads` threads of a pool at once. Only on CPUs with AMX-BF16
// (CpuFeatures::HasAmxBf16); what the kernels' per-expert TFLOP/s compare to.
#pragma once

#include <string>
#include <vector>

#include "expert_compute/compute_pool.h"

namespace moe {

struct AmxPeak {
  std::string operands;  // where the tiles come from
  int threads = 0;
  double tflops = 0;  // median of the runs, all threads together
  double min_tflops = 0, max_tflops = 0;
  int runs = 0;
};

// Every operand placement at 1 thread, half and all of the pool's threads;
// each run lasts about `seconds`. `int8` (CPUs with AMX-INT8): also the
// AMX-INT8 loop with single int8 activation rows, its int32 sums kept in the
// tiles or scaled per token and block of K (TOPS, comparable with bf16's
// TFLOP/s per token: both instructions take 16 rows).
std::vector<AmxPeak> MeasureAmxPeaks(ComputePool& pool, double seconds, bool int8);

}  // namespace moe
