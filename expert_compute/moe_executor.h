// MoeExecutor: computes one MoE layer's partial output for a batch of tokens
// on the CPU — validation, grouping by expert, gather, fused gate+up+SiLU,
// down (weighted, one output row per routed pair), then each token's rows
// summed — spread over every compute thread in units, each thread taking its
// own range of them first.
//
// Forward() = Validate + GroupByExpert + Run. Run() computes pairs a caller
// already grouped (a GPU worker's cpu backend hands its hit groups as they
// are). Both may be called from any number of threads; calls validate
// concurrently and then run one at a time on the whole pool.
//
// Concurrent Forward() calls of one layer that share experts are computed
// together: the requests of several clients (the GPUs of a worker, workers
// sharing a pool) that wait for the pool at the same time are merged into
// one region, grouped by expert, so an expert two clients need is read from
// DRAM once and the region's fixed costs are paid once. A request merges
// only when at least half of its distinct experts are already in the region
// (requests of disjoint experts gain nothing from sharing a region: each
// would wait for the other's experts too, so they run one after another).
// Requests stay in arrival order: the oldest waiting request is always in
// the next region; at most kMergeTokens tokens merge, a larger request runs
// alone. A client in lockstep with another (the GPUs of a tensor- or
// expert-parallel group) is also waited for: a region that starts alone on a
// layer where, the last time, a peer's request came (merged in the region,
// or arriving while it ran) waits for it, up to MergeWindowNs: the largest
// recent lag of a peer behind the moment the pool was free, and a half, plus
// 10 us, never more than three quarters of that layer's last region (what a
// merge saves: the peer's own region after it) nor kMaxMergeWindowNs. A wait
// that sees none clears the layer's mark. Waits are also corrected by their
// outcomes: a score of recent waits (met or not; and, for regions that did
// not wait, whether a peer came within what a wait would have caught) must
// stay at half or more for regions to wait at all, so clients whose requests
// rarely meet lose little. One caller's thread at a time runs
// the regions of everybody waiting (the "combiner"), and hands that role on
// when its own request is done.
//
// The stripes of one client batch (MoeBatch::stripe: a large batch split over
// several connections by the gRPC transport) always share a region, whatever
// their tokens and with merging off too: the region of the first waits, up to
// kMaxStripeWaitNs, until all of them came, so the batch reads each expert
// once as it would have whole. A stripe whose siblings do not come in time
// runs without them.
//
// Workspaces grow
// to the largest batch seen and are reused: no allocation per token. The
// largest is the down projection's output, one f32 row of H + 16 per routed
// pair (128 MiB for a 2048-token top-8 prompt of Qwen3-30B-A3B's shape); the
// gathered bf16 rows (not kept for int8 / int4 weights whose K needs no
// padding) take about half of that. A batch whose workspace cannot be
// allocated fails with ResourceExhausted ("tokens: ...") and gives every
// workspace back; smaller batches still run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "model/moe_batch.h"
#include "model/routing.h"
#include "core/tensor.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"

namespace moe {

struct ForwardStats {
  int distinct_experts = 0;
  int pairs = 0;
  uint64_t queue_ns = 0;    // waiting for the pool
  uint64_t compute_ns = 0;
  // compute_ns by phase: gather (+ quantize), gate/up, down (+ act quantize),
  // combine (each token's rows summed into the output)
  uint64_t gather_ns = 0, gate_up_ns = 0, down_ns = 0, combine_ns = 0;
  // Forward: requests computed in the same region (1: alone); distinct
  // experts and the times are the whole region's, pairs the request's own.
  int merged_requests = 1;
};

// What Forward's request merging did (MoeExecutor::merge_stats).
struct MergeStats {
  uint64_t regions = 0;           // Forward regions run
  uint64_t merged_regions = 0;    // of them, regions of more than one request
  uint64_t merged_requests = 0;   // requests computed in a merged region
  uint64_t windows = 0;           // regions that waited for a peer's request
  uint64_t windows_filled = 0;    // of them, waits a peer's request ended
  uint64_t wait_ns = 0;           // time the regions spent waiting, in all
  uint64_t late_peers = 0;        // peers' requests that came while their layer's region ran
};

// How long a region alone on its layer waits for a peer's request: the
// peers' largest recent lag behind the moment the pool was free, and a half, plus
// 10 us; at most three quarters of the layer's last region (region_ns; 0 =
// unknown: kDefaultMergeWindowNs) and kMaxMergeWindowNs.
uint64_t MergeWindowNs(uint64_t lag_ns, uint64_t region_ns);
// The score of waits after one more outcome (kWaitScoreOne = every wait
// met): a moving average over about the last four. Regions wait only while
// the score is at least kWaitScoreOne / 2.
uint32_t NextWaitScore(uint32_t score, bool met);
constexpr uint32_t kWaitScoreOne = 1024;

class MoeExecutor {
 public:
  // merge = false: Forward() requests run one at a time, in arrival order,
  // never merged and never waiting for a peer.
  MoeExecutor(const PackedExperts& store, const ExpertKernel& kernel, ComputePool& pool, bool merge = true);

  // Checks the batch against what this server hosts (InvalidArgument naming
  // the field), without computing.
  absl::Status Validate(const MoeBatch& batch) const;

  // Validates, then writes out[t] = sum_j w[t,j] FFN_e(x_t) as [n, H] of
  // out_dtype (kBF16 or kF32). Tokens without pairs get zeros.
  absl::Status Forward(const MoeBatch& batch, DType out_dtype, void* out, ForwardStats* stats);

  // The groups' rows of `n` tokens of `layer` ([n, H] bf16 `tokens`):
  // out[t] = sum over rows r of token t of weight[r] FFN(x_t), zeros for
  // tokens without rows, as Forward writes it. The groups come from
  // GroupByExpert with row_align = row_align() (each group starts on an
  // aligned row; row tokens in [-1, n), -1 = padding); group g computes the
  // expert the store holds as (layer, store_expert[g]), or (layer,
  // groups.expert[g]) when store_expert is null. InvalidArgument when a group
  // or row is out of range, misaligned, or names an expert the store lacks.
  absl::Status Run(int layer, int n, const bf16_t* tokens, const ExpertGroups& groups,
                   const int32_t* store_expert, DType out_dtype, void* out, ForwardStats* stats);
  // The row alignment Run needs (the kernel's row block).
  int row_align() const { return kernel_.row_block(store_.geometry().format); }

  MergeStats merge_stats() const;
  // Forward() requests waiting for the next region.
  int waiting_requests() const;

  // Most tokens of requests merged into one region.
  static constexpr int kMergeTokens = 256;
  // Longest a region waits for a peer's request of its layer, and how long
  // before its layer's region time is known.
  static constexpr uint64_t kMaxMergeWindowNs = 2'000'000;
  static constexpr uint64_t kDefaultMergeWindowNs = 100'000;
  // Longest a region waits for the missing stripes of its first request's batch.
  static constexpr uint64_t kMaxStripeWaitNs = 10'000'000;

 private:
  // One Forward() request waiting for, or in, a region.
  struct Job {
    const MoeBatch* batch;
    DType out_dtype;
    void* out;
    ForwardStats* stats;
    uint64_t t_queue;
    absl::Status status;
    bool late = false;  // came while a region of its layer ran (a peer too late to merge)
    std::atomic<bool> done{false};
  };
  // Where a region's tokens come from and its rows go: one [n, H] array
  // each (Run), or a row pointer per token (Forward's merged requests).
  struct TokenIo {
    const bf16_t* in = nullptr;
    void* out = nullptr;
    const bf16_t* const* in_rows = nullptr;
    void* const* out_rows = nullptr;
  };
  // The combiner: takes the next region's jobs from pending_ (waiting for a
  // peer's where one is expected) and computes them. q_mu_ held on entry and
  // exit, released while computing.
  void RunRound(std::unique_lock<std::mutex>& q);
  // Under q_mu_: moves the pending requests that merge with `first` (same
  // layer and output dtype, sharing its region's experts, up to kMergeTokens
  // tokens in all, arrival order; `first` and its stripe siblings always) into
  // round_jobs_.
  void TakeMergeable(const Job* first, int* tokens);
  // The region of `first` alone, a peer expected on its layer: waits (q_mu_
  // released) up to MergeWindowNs for a request that merges.
  void WaitForPeer(std::unique_lock<std::mutex>& q, const Job* first, int* tokens);
  // The region of a stripe: waits (q_mu_ released) up to kMaxStripeWaitNs
  // until every stripe of its batch is in it.
  void WaitForStripes(std::unique_lock<std::mutex>& q, const Job* first, int* tokens);
  int StripesInRound(const Job* first) const;
  // Under mu_: the jobs as one region.
  absl::Status RunJobs(const std::vector<Job*>& jobs, ForwardStats* stats);
  // Under q_mu_: at least half of j's distinct experts (or none) are in the
  // current region (round_expert_); AddExperts puts j's there.
  bool SharesExperts(const Job& j);
  void AddExperts(const Job& j);

  // Work of one expert group's rows [r0, r1): gate/up activation groups or
  // down output groups [c0, c1).
  struct Unit { int group, c0, c1, r0, r1; };
  class Buffer {
   public:
    ~Buffer();
    void* Reserve(size_t bytes);  // nullptr when the allocation fails
    void Release();
   private:
    void* p_ = nullptr;
    size_t cap_ = 0;
  };

  // Under mu_: splits the groups' gate/up work into units_, down's into down_units_.
  void PlanUnits(const ExpertGroups& groups);
  // Under mu_: token_start_ / token_rows_, each token's rows (token[r], r < rows).
  void IndexTokenRows(int n, const int32_t* token, int rows);
  // Under mu_: Run's computation, the groups already checked.
  absl::Status RunLocked(int layer, int n, const TokenIo& io, const ExpertGroups& groups,
                         const int32_t* store_expert, DType out_dtype, ForwardStats* stats, uint64_t t_queue,
                         uint64_t t_start);

  const PackedExperts& store_;
  const ExpertKernel& kernel_;
  ComputePool& pool_;
  const bool merge_;
  std::mutex mu_;  // guards everything below (one batch at a time)
  ExpertGroups groups_;                     // Forward's grouping
  std::vector<const std::byte*> weights_;  // per group
  std::vector<Unit> units_, down_units_;
  struct Cursor {
    alignas(64) std::atomic<int> next{0};
    int end = 0;
  };
  static constexpr int kPhases = 5;  // gather, gate/up, act quantization, down, combine (RunLocked)
  std::vector<Cursor> cursors_;      // [phase][thread]: its range of the phase's items; sized once
  std::vector<int32_t> token_start_, token_rows_, fill_;  // IndexTokenRows
  Buffer x_buf_, act_buf_, y_buf_, acc_buf_;
  Buffer xq_buf_, actq_buf_;  // integer weights: x and act quantized per row (KernelRows)
  std::vector<int32_t> pad_token_;  // a caller's groups padded to whole row blocks
  std::vector<float> pad_weight_;
  // Forward's merged requests (under mu_): routing [n, max k], row pointers.
  std::vector<int32_t> merge_ids_;
  std::vector<float> merge_weights_;
  std::vector<const bf16_t*> merge_in_;
  std::vector<void*> merge_out_;

  // Forward's queue. Under q_mu_: pending_ (arrival order), combining_ (a
  // caller is running regions), the current region's layer (-1 between
  // regions) and when the pool was free for it, the peer estimates.
  mutable std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::vector<Job*> pending_;
  std::vector<Job*> round_jobs_;  // the combiner's current region
  std::atomic<bool> combining_{false};  // written under q_mu_; waiters poll it without
  std::atomic<uint64_t> arrivals_{0};  // jobs enqueued, ever (a waiting combiner polls it)
  int round_layer_ = -1;
  uint64_t round_start_ns_ = 0;
  bool round_waiting_ = false;  // the current region waits for a peer or its stripes now
  bool round_waited_ = false;   // it waited
  uint64_t peer_lag_ns_ = 0;  // a peer's request's lag behind the pool's being free: the largest recent
  uint32_t wait_score_ = kWaitScoreOne;  // NextWaitScore over the waits' outcomes
  struct LayerPeer {
    bool peer = false;       // a peer's request came the last time (merged or late)
    uint64_t region_ns = 0;  // the layer's last region, computing
  };
  std::vector<LayerPeer> layer_peer_;  // by layer
  std::vector<uint8_t> round_expert_;  // by expert: read by the current region
  std::vector<uint32_t> expert_stamp_;  // SharesExperts' distinct count
  uint32_t stamp_ = 0;
  // `layer`'s entry (grown on demand; layers are validated, so bounded).
  LayerPeer& PeerOf(int layer);
  MergeStats merge_stats_;
};

}  // namespace moe
