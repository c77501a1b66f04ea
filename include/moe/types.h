// moe/types.h — the small value types of the public C++ API (moe/engine.h),
// also used by the internals that produce them. A leaf: includes nothing of
// this project, so any layer may include it.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

// Activations and outputs are bf16, carried as their raw 16 bits.
using bf16_t = std::uint16_t;

// Where a call's tensors live: host memory, or the GPU's memory (cuda backend).
enum class MemoryKind { kHost, kDevice };

// A session's choices (SessionOptions); their names — as the C ABI's JSON,
// the flags and the logs spell them — are Name() / Parse*() in moe/engine.h.
// The device backend: cuda if a GPU is usable, else cpu (kAuto), or as named.
enum class DeviceChoice { kAuto, kCuda, kCpu };
// The cache policy: static (placed from outside), lru, lfru, or predictive
// (cost-model admissions with cross-layer prefetch inside the placement).
enum class CachePolicy { kStatic, kLru, kLfru, kPredictive };
// Uncached experts: kAuto copies one to the GPU when the measured rates say
// it pays, kNever sends every miss to the CPU (except failover), kAlways
// copies every miss (the plain "LRU offload" baseline).
enum class CopyMode { kAuto, kNever, kAlways };
// The precision of the host copy and the GPU cache: kAuto (the same-host
// servers' when shared, else the checkpoint's class: fp8 -> fp8 (exact),
// int4 -> int4, mxfp4 -> mxfp4, else bf16), or as named. kFp8 and kInt4 keep an fp8 / int4
// checkpoint's own codes and block / group scales (int4 groups of 32, Kimi-K2's, or multiples of
// 64); others are quantized per channel and 128 columns.
enum class WeightDtype { kAuto, kBf16, kInt8, kInt4, kFp8, kMxfp4 };

// TLS for gRPC connections (expert servers at host:port, the coordinator).
struct TlsOptions {
  std::string cert_file, key_file, ca_file;  // PEM; cert+key for mTLS, ca to verify the peer
  bool insecure = false;                     // plaintext; must be asked for explicitly
  std::string server_name_override;          // TLS name to verify instead of the host
};

// One layer's activity as it happens (each field a delta since the last
// report): copies into the cache's slots and their bytes, the predictive
// policy's prediction score (experts predicted for a run, of them used), and
// where a call's uncached pairs went — CPU expert servers, or copied to the
// device — with the host->device link time of the copies (cache and call).
struct LayerActivity {
  uint64_t cache_copies = 0, copy_bytes = 0;
  uint64_t predicted = 0, predicted_used = 0;
  uint64_t cpu_pairs = 0, copied_pairs = 0;
  uint64_t prefetched_pairs = 0;  // of copied_pairs: copied during the previous layer's call (a prompt's prefetch)
  double link_seconds = 0;
};

// A session's place in a group of `size` GPUs (ranks) that together hold one
// expert cache: each rank caches and computes only the (token, expert) pairs
// of the experts it owns (ExpertOwner) — hits from its cache, misses on the
// CPU servers — so the ranks' caches hold disjoint experts, one cache of their
// summed memory. Two modes:
//   kTensor (tensor parallelism): every rank sees every token of the layer,
//     returns its partial sum, and the engine's own all-reduce of the layer
//     output adds them; no communication beyond that all-reduce.
//   kExpert (expert / data parallelism): every rank has its own tokens; the
//     session ships each token to the ranks that own one of its experts and
//     adds their partial sums back (NCCL send/recv within the layer call), so
//     each call returns the whole MoE output of this rank's tokens. Every rank
//     must call every layer (a call with T = 0 too), in the same order. The
//     communicator is made at Open from `id` (MoeSession::NewGroupId on one
//     rank, handed to the others by the engine's own means, e.g.
//     torch.distributed.broadcast_object_list); all ranks open together.
//     A peer that does not answer by the session's deadline leaves the group:
//     this rank then computes its own tokens alone (its cache, the CPU
//     servers), never a wrong output.
enum class GroupMode { kTensor, kExpert };
struct ParallelGroup {
  int rank = 0;  // in [0, size)
  int size = 1;  // 1: no group (every expert is this session's)
  GroupMode mode = GroupMode::kTensor;
  std::string id;  // kExpert: the communicator's id (MoeSession::NewGroupId), the same on every rank
};
inline ParallelGroup TensorParallel(int rank, int size) {
  ParallelGroup g;
  g.rank = rank;
  g.size = size;
  return g;
}

// The rank of a group of `size` that owns `expert` in model layer `layer`:
// experts dealt round-robin, shifted by the layer so that no rank owns the
// same ids (and so the same hot spots of a skewed router) in every layer.
inline int ExpertOwner(int layer, int expert, int size) {
  return size <= 1 ? 0 : static_cast<int>((static_cast<long long>(expert) + layer) % size);
}

// What one layer call did (optional out-parameter of the forward calls).
// The one stats record: the C ABI's moe_call_stats, the Python CallStats and
// the worker proto's LayerCallStats carry these fields under these names
// (Style.CallStatsAlike checks it).
struct CallStats {
  int hit_pairs = 0;          // pairs computed from the GPU cache
  int cpu_pairs = 0;          // pairs computed by CPU expert servers
  int cpu_experts = 0;        // distinct experts sent to CPU expert servers
  int copied_pairs = 0;       // pairs computed on the device after a copy (incl. failover)
  int copied_experts = 0;     // distinct experts copied for this call
  int prefetched_pairs = 0;   // of copied_pairs, those of experts copied during the previous layer's call
  int prefetched_experts = 0;
  int miss_tokens = 0;        // tokens shipped (summed over servers)
  int failovers = 0;          // batches moved to another server or to copy
  uint64_t bytes_shipped = 0; // activations + routing sent, partials received
  double seconds = 0;         // host time of the call (an async call: its submit and its Wait)
  double submit_seconds = 0;  // of which: in Submit (host path)
  double wait_seconds = 0;    // of which: waiting for the misses' answers
};

// What a session's forward calls did since it opened (MoeSession::totals;
// the C ABI's moe_totals): the calls, the failed ones, and the sums of
// their CallStats and host seconds (in the call, plus the submit of an async
// call's Wait). Capturable calls (graph replays included) are counted
// when TakeStreamError collects them from the GPU: calls and their hit / CPU
// / copied pairs (no host seconds, miss tokens or bytes: the GPU ships those
// itself); one above a request slot runs eagerly and is counted as it returns.
struct SessionTotals {
  uint64_t calls = 0, failed_calls = 0;
  uint64_t hit_pairs = 0, cpu_pairs = 0, copied_pairs = 0, miss_tokens = 0, failovers = 0, bytes_shipped = 0;
  double seconds = 0;
};

}  // namespace moe
