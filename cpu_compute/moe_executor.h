// MoeExecutor: computes one MoE layer's partial output for a batch of tokens
// on the CPU — validation, grouping by expert, gather, fused gate+up+SiLU,
// fused down + weighted accumulation — spread over every compute thread.
//
// Forward() may be called from any number of threads; calls validate
// concurrently and then run one at a time on the whole pool. Workspaces grow
// to the largest batch seen and are reused: no allocation per token.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "core/routing.h"
#include "core/tensor.h"
#include "cpu_compute/compute_pool.h"
#include "cpu_compute/expert_kernel.h"
#include "cpu_compute/expert_store.h"

namespace moe {

struct ForwardBatch {
  int layer = 0;
  int n = 0;                        // tokens
  const bf16_t* tokens = nullptr;   // [n, H]
  RoutingView routing;              // [n, k] ids and weights
};

struct ForwardStats {
  int distinct_experts = 0;
  int pairs = 0;
  uint64_t queue_ns = 0;    // waiting for the pool
  uint64_t compute_ns = 0;
};

class MoeExecutor {
 public:
  MoeExecutor(const PackedExperts& store, const ExpertKernel& kernel, ComputePool& pool);

  // Checks the batch against what this server hosts (InvalidArgument naming
  // the field), without computing.
  absl::Status Validate(const ForwardBatch& batch) const;

  // Validates, then writes out[t] = sum_j w[t,j] FFN_e(x_t) as [n, H] of
  // out_dtype (kBF16 or kF32). Tokens without pairs get zeros.
  absl::Status Forward(const ForwardBatch& batch, DType out_dtype, void* out, ForwardStats* stats);

 private:
  // Gate/up work: activation groups [c0, c1) of rows [r0, r1) of one expert group.
  struct Unit { int group, c0, c1, r0, r1; };
  class Buffer {
   public:
    ~Buffer();
    void* Reserve(size_t bytes);
   private:
    void* p_ = nullptr;
    size_t cap_ = 0;
  };

  const PackedExperts& store_;
  const ExpertKernel& kernel_;
  ComputePool& pool_;
  std::mutex mu_;  // guards everything below (one batch at a time)
  ExpertGroups groups_;
  std::vector<const std::byte*> weights_;  // per group
  std::vector<Unit> units_;
  std::vector<int64_t> cost_;               // cumulative cost per unit
  std::vector<int> unit_bounds_;           // per thread, into units_
  Buffer x_buf_, act_buf_, out_buf_;
};

}  // namespace moe
