// MissPlan: the split of one layer call's routing (the per-call half of the
// planner, gpu_worker/planner.h), decided before anything
// runs — which pairs are hits (their expert is Ready in a cache slot), which
// missed experts are copied to the device and computed there instead
// (copy-instead-of-compute), and which go to which CPU expert server, in
// batches the server's transport takes. PlanMisses is a plain function of its
// inputs: no server, backend, cache or transport is touched (the cost model's
// exploration counter and the outcomes' exploration schedule are the state it
// updates, through ChooseCopies and CopyOutcomes::Choose), so
// the dispatcher's decisions are testable on their own (miss_plan_test.cc).
//
// Thread-safety: none; a MissPlan is scratch of one caller, reused across
// calls so steady-state plans do not reallocate.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "model/model_spec.h"
#include "model/routing.h"
#include "gpu_worker/copy_outcomes.h"
#include "gpu_worker/cost_model.h"
#include "gpu_worker/device_backend.h"

namespace moe {

// (Uncached experts: moe/types.h CopyMode.)

// One expert server as the plan sees it.
struct PlanServer {
  bool up = false;                           // enabled, connected and not waiting out a failure
  const std::vector<bool>* hosts = nullptr;  // per expert: hosted (null: none)
  int chunk_tokens = 1;                      // most tokens of one batch (>= 1)
  ExpertSlice slice;                         // the share of each expert it computes (--slice)
};

// Servers one plan can address (routes are bitmasks of server indexes).
inline constexpr int kMaxPlanServers = 64;

// The servers a missed expert's pairs go to, as a bitmask of indexes into
// `servers`, 0 when none can take it: searching from server `start` on (and
// round to the ones before it), the first up server hosting it, alone when it
// holds whole experts; when it holds slice i/n, the first up holder of every
// slice j/n of the expert together (their partial outputs add up to the
// expert's), or, when a slice has no up holder, the search goes on past it.
// num_servers <= kMaxPlanServers, 0 <= start < num_servers. Pure.
uint64_t RouteExpert(const PlanServer* servers, int num_servers, int expert, int start = 0);

// Where RouteExpert's search starts for a call of `layer` among
// `num_servers`: layer mod num_servers. Replicas (servers hosting the same
// experts) share a pool's load by layer — each takes its share of every
// worker's layers — rather than the first replica taking it all and the
// others only its failures. A call's misses still go to one server when it
// holds them all (one request, not one per replica), and every worker and
// every rank of a group (in one process or several) sends a layer to the
// same server, which computes concurrent requests of it in one pass. Pure.
int ReplicaStart(int layer, int num_servers);

// Where a batch goes when its server `failed` failed (a plain function of
// the servers as they are now; `servers[failed]` itself is never chosen):
// kResend to the first other server that is up and holds the same share of
// every expert of the batch (a slice holder only stands in for its slice),
// while `in_time` (the call's deadline allows); else kDevice — computed from
// the host copy — when the failed server computes whole experts and
// `device_can`; else kFail.
struct FailoverChoice {
  enum Action { kResend, kDevice, kFail } action = kFail;
  int server = -1;  // kResend: the server to send it to
};
FailoverChoice ChooseFailover(const PlanServer* servers, int num_servers, int failed, const std::vector<int32_t>& ids,
                              bool in_time, bool device_can);

struct MissPlanInput {
  int layer = 0;                         // for error messages and the replica a miss goes to (ReplicaStart)
  RoutingView routing;                   // validated (ValidateRouting), host memory
  int num_experts = 0;
  const int32_t* slot_buffer = nullptr;  // [num_experts] backend buffer of the expert's Ready slot, -1: not cached
  const PlanServer* servers = nullptr;   // [num_servers], in preference order
  int num_servers = 0;
  int hit_row_align = 1;                 // DeviceBackend::hit_row_align()
  // Copy-instead-of-compute.
  CopyMode copy_mode = CopyMode::kNever;
  bool can_copy = false;        // the worker holds host copies and temporary device buffers
  int copy_min_tokens = 0;      // auto: > 0 copies experts with at least this many miss pairs (no model)
  CostModel* cost = nullptr;    // auto, copy_min_tokens == 0: ChooseCopies on it (null or unmeasured: none)
  double link_busy_s = 0;       // the copy queue's backlog now (cache copies of earlier calls)
  // With `cost`: the outcomes of earlier calls of the same shape, which may
  // send this call's misses to the servers although the model would copy
  // some (CopyOutcomes::Choose), when the model rates never copying within
  // kOutcomeRange of its own choice. Null: the model decides alone.
  CopyOutcomes* outcomes = nullptr;
};

// How much slower than the model's choice never copying may be forecast and
// still be tried (CopyOutcomes samples both choices of a call shape, then
// explores the loser now and then): the outcomes correct what the rates
// cannot price (a copy's DRAM reads beside the CPU's, the link's queue, the
// first copy), tens of percent (the rates themselves are corrected online),
// not a forecast twice off; a sample of the loser costs at most 2 calls.
// Without this bound prompts paid for the samples: with the H200 host's
// rates a DeepSeek-V3 layer with every expert missed forecasts 0.12 s with
// copies and 2.8 s without at 8192 tokens (0.10 / 0.65 s at 2048), and each
// call shape sent its first 3 calls and its explorations wholly to the CPU.
inline constexpr double kOutcomeRange = 2.0;

// The misses one server computes: one batch of at most its chunk_tokens
// tokens, routed [n, k] like the call, -1 where a pair is not this server's.
struct ServerBatch {
  int server = -1;               // index into MissPlanInput::servers
  int n = 0, k = 0;
  std::vector<int32_t> rows;     // [n] the call's token of each batch row
  std::vector<int32_t> ids;      // [n, k]
  std::vector<float> weights;    // [n, k]
  int experts = 0, pairs = 0;    // distinct experts and pairs (the cost model's inputs)
};

struct MissPlan {
  ExpertGroups hits;                    // hit pairs by expert (row_align = hit_row_align)
  std::vector<int32_t> hit_buffer;      // per hit group: the buffer of its slot
  std::vector<int> copy_experts;        // experts computed on the device from host copies, in decision order
  ExpertGroups copies;                  // their pairs by expert (row_align 1)
  std::vector<ServerBatch> batches;     // server misses: by server (input order), then token order
  std::vector<int> accessed;            // experts with pairs, ascending
  std::vector<int> missed;              // of them those without a Ready slot
  std::vector<int32_t> hit_pairs, miss_pairs;  // per expert
  int cpu_experts = 0;                  // missed experts sent to a server
  // The copy-instead decision this call made (the caller times the call and
  // reports it: CopyOutcomes::Observe): its bucket, -1 when the model copied
  // nothing a server could have taken (no decision), and the choice taken.
  int outcome_bucket = -1;
  CopyChoice outcome_choice = CopyChoice::kModel;

  // The hit groups as the device computes them.
  HitPlan hit_plan() const { return HitPlan{&hits, hit_buffer.data()}; }
  // The group of a copied expert in `copies`, or -1.
  int copy_group(int expert) const;

  // Scratch, reused across calls (no allocation per decode call once warm).
  std::vector<uint64_t> route_of;     // per expert: RouteExpert, 0 when copied
  std::vector<uint64_t> token_servers;  // per token: the servers its CPU pairs go to (bitmask)
  std::vector<int> optional_copies;   // missed experts a server could take
  std::vector<int32_t> server_rows;   // one server's tokens
  std::vector<uint64_t> expert_mark;
  uint64_t mark_epoch = 0;
};

// Fills *plan. A missed expert goes to its route (RouteExpert); it is
// copied instead when no server is up for it, when copy_mode is kAlways, or
// (kAuto) when it has copy_min_tokens miss pairs or ChooseCopies picks it
// and `outcomes` (when given, and never copying is forecast within
// kOutcomeRange of the model's choice) keeps the model's choice for the
// call's shape.
// Unavailable naming the expert and layer when it would have to be copied and
// !can_copy.
absl::Status PlanMisses(const MissPlanInput& in, MissPlan* plan);

}  // namespace moe
