// moe/engine.h — the C++ API an inference engine uses: MoeSession.
//
// Only what an engine needs: this header, moe/types.h and absl::Status. The
// session's cache, dispatcher, cost model and transports stay behind it
// (gpu_worker/); the C ABI over the same session is moe/moe.h (libmoe.so).
// CMake: find_package(moe_expert_service) and link moe::engine.
//
// An inference engine opens one session per GPU (per model replica): it names
// the model, the CPU expert servers, the device backend and the cache size.
// Then, for every MoE layer of every forward pass, it hands over the layer's
// input and router output and gets the exact MoE output back:
//
//   moe::SessionOptions o;
//   o.model = "/models/qwen3-30b-a3b";                 // or "synthetic:qwen3-30b-a3b"
//   o.servers = {"unix:///run/moe/expert-0.sock"};     // same host: shared memory
//   o.cache_experts_per_layer = 32;
//   auto session = moe::MoeSession::Open(o);           // StatusOr<unique_ptr<MoeSession>>
//   (*session)->ForwardLayer(layer, T, k, hidden, topk_ids, topk_weights, out);
//
// Several GPUs, one cache: one session per rank with SessionOptions::group.
// Tensor parallelism: each returns its share and the engine's all-reduce of
// the layer output adds them (examples/transformers_tp.py). Expert
// parallelism: each rank its own tokens; the sessions exchange them over NCCL
// within the call (moe/types.h ParallelGroup).
//
// Tensors: hidden [T,H] bf16, topk_ids [T,k] int32 (-1 = unused slot),
// topk_weights [T,k] f32 (applied as given: renormalise them first if your
// model does), out [T,H] bf16 = sum_j w[t,j] * FFN_{ids[t,j]}(hidden[t]).
// Pointers are host memory, or device memory when `kind` is kDevice (cuda
// backend only).
//
// Stream order: `cuda_stream` (a cudaStream_t, or nullptr) is the engine's
// stream. The call's device work is ordered after what the engine enqueued on
// it before the call, and the engine's later work on it sees the output; the
// cuda backend does this with events (no cudaDeviceSynchronize, no host sync
// of the engine's stream). The cpu backend refuses a stream. Close a session
// before destroying a stream its calls used: closing waits for the session's
// last device-planned call on it.
//
// Asynchronous use (dual-batch overlap): ForwardLayerAsync starts a call and
// returns at once; Wait finishes it. Up to SessionOptions::contexts calls may
// be in flight, so an engine can run micro-batch B's attention while A's
// misses are computed on the CPU:
//   auto a = s->ForwardLayerAsync(l, A...);  run attention(B);
//   auto b = s->ForwardLayerAsync(l, B...);  s->Wait(*a);  s->Wait(*b);
// The input buffers must stay valid until the call's Wait returned.
//
// Errors are absl::Status: InvalidArgument naming the field (bad ids, NaN
// weights, sizes), Unavailable when no server (and no device copy) can take a
// layer's misses, DeadlineExceeded. A failed call never leaves a wrong output.
//
// Thread-safety: a session is driven by one thread at a time (like a CUDA
// stream); use one session per engine thread/GPU.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moe/types.h"

namespace moe {

// The model's MoE geometry, as the session read it from the checkpoint.
struct ModelInfo {
  std::string model_type;       // config.json "model_type", or the synthetic preset's
  int num_layers = 0;           // decoder layers, dense ones included
  std::vector<int> moe_layers;  // ascending; layers with routed experts
  int num_experts = 0;          // routed experts per MoE layer
  int top_k = 0;
  int hidden = 0;               // H
  int intermediate = 0;         // I, per expert
  std::string weight_dtype;     // the checkpoint's expert weights, as safetensors names it: BF16, F16, F32
  uint64_t expert_bytes = 0;    // what one expert copy moves: packed in the host copy's format (bf16, int8,
                                // int4 or fp8; bf16 without a host copy), the coordinator's copy budget counts it
  uint64_t identity = 0;        // the experts' content identity (a digest of the checkpoint's stored expert
                                // bytes, or of a synthetic model's definition); every expert server must
                                // report the same one (ServerInfo.model_identity), or the session refuses it
  std::string expert_math;      // what each expert computes (model/model_spec.h ExpertMathName): "silu", or
                                // "clamped_swiglu(alpha=1.702, limit=7)+bias" (GPT-OSS); every expert server
                                // must compute the same (ServerInfo.model.expert_math), or the session refuses it
  std::string routing;          // how the family's router weighs its experts: "softmax_topk", or "topk_softmax"
                                // (GPT-OSS: top-k logits, softmax over those k); what the engine computes
};

// The names of the SessionOptions choices (auto | cuda | cpu; static | lru |
// lfru | predictive; auto | never | always; auto | bf16 | int8 | int4 | fp8;
// tensor | expert), and their parsing: InvalidArgument naming `field` and the
// accepted names.
const char* Name(DeviceChoice v);
const char* Name(CachePolicy v);
const char* Name(CopyMode v);
const char* Name(WeightDtype v);
const char* Name(GroupMode v);
absl::StatusOr<DeviceChoice> ParseDeviceChoice(const std::string& name, const std::string& field = "device");
absl::StatusOr<CachePolicy> ParseCachePolicy(const std::string& name, const std::string& field = "policy");
absl::StatusOr<CopyMode> ParseCopyMode(const std::string& name, const std::string& field = "copy_mode");
absl::StatusOr<WeightDtype> ParseWeightDtype(const std::string& name, const std::string& field = "weight_dtype");
absl::StatusOr<GroupMode> ParseGroupMode(const std::string& name, const std::string& field = "group.mode");

struct SessionOptions {
  std::string model;                   // checkpoint directory, FILE.gguf or synthetic:PRESET[:layers=N][:seed=S]
  std::vector<std::string> servers;    // "unix:///path.sock" or "host:port", optional "#experts=0-63"
  DeviceChoice device = DeviceChoice::kAuto;
  // cuda: the GPU; -1 (default) = the opening thread's current device (after
  // the engine's cudaSetDevice / torch.cuda.set_device). Calls make it
  // current for their duration and give the caller's back.
  int cuda_device = -1;
  int cache_experts_per_layer = 0;     // C; or derive it from cache_gib
  double cache_gib = 0;                // in [0, 1048576]; beside it: buffers for copied experts (2 x 4-16
                                       // experts and 16 for the device path) and for a prompt's prefetch
                                       // (2 x 1 GiB; fewer, or none, when the cache fills the device)
  CachePolicy policy = CachePolicy::kPredictive;
  CopyMode copy_mode = CopyMode::kAuto;
  int max_tokens = 1024;               // largest T of one call, in [1, 65536]
  int max_top_k = 8;                   // in [1, 1024]
  int contexts = 2;                    // calls in flight (micro-batches), in [1, 64]
  std::vector<int> layers;             // MoE layers this session serves (empty: all)
  bool host_copy = true;               // keep a host copy of the experts (copy-instead, failover)
  // At Open, fill the cache's empty slots with each layer's first experts
  // (copied before Open returns; 4.6 GB took 0.10 s on the H200 host): hits from the
  // first call, then the policy replaces them by use. Not under static.
  bool fill_cache = true;
  WeightDtype weight_dtype = WeightDtype::kAuto;  // the host copy's and the GPU cache's
  // Map the same-host (unix://) servers' packed stores read-only instead of
  // keeping an own copy, when they cover the served layers (one host copy).
  bool share_host_copy = true;
  TlsOptions tls;                      // for host:port servers
  int grpc_streams = 8;                // ForwardStreams per host:port server (a connection each; a batch on the first idle one, a large one striped over all)
  std::chrono::milliseconds deadline{30000};
  // A server silent this long on one batch has failed: the batch goes to
  // another holder of its experts (or the device) within `deadline`, and the
  // server gets batches again only once it has answered a probe (a silent
  // server costs this wait once, not once per retry).
  std::chrono::milliseconds server_deadline{10000};
  int cpu_threads = 0;                 // cpu backend compute threads (0: all)
  // A group of `group.size` GPUs holding one cache (moe/types.h
  // ParallelGroup), one session per rank; each rank caches and computes only
  // the experts ExpertOwner gives it, so the ranks' caches add up to one.
  // kTensor (tensor parallelism): give every rank the same tokens and
  // routing and sum the ranks' outputs (the engine's own all-reduce): each
  // call's `out` is this rank's partial sum. kExpert (expert / data
  // parallelism): each rank its own tokens; `group.id` from NewGroupId; the
  // ranks open together, every rank calls ForwardLayer for every layer (T = 0
  // too) with device memory, and `out` is the whole output of its tokens.
  // max_tokens is one rank's call; the async and capturable calls are
  // refused in this mode.
  ParallelGroup group;
  // Called once per (layer, expert) a call routes pairs to: `pairs` of them,
  // all hits or all misses (e.g. a coordinator agent's access counts).
  std::function<void(int layer, int expert, int pairs, bool hit)> on_access;
  // Activity per layer (moe/types.h LayerActivity): cache copies started,
  // prediction scores, the split of each call's uncached pairs between the
  // CPU servers and copies, and the link time its copies take.
  std::function<void(int layer, const LayerActivity& activity)> on_activity;
};

class MoeSession {
  struct Rep;

 public:
  static absl::StatusOr<std::unique_ptr<MoeSession>> Open(const SessionOptions& options);
  ~MoeSession();
  MoeSession(const MoeSession&) = delete;
  MoeSession& operator=(const MoeSession&) = delete;

  // A new expert-parallel group id (ParallelGroup::id, 256 hex characters):
  // made on one rank, handed to the others by the engine (NCCL's unique id).
  // FailedPrecondition in a build without NCCL.
  static absl::StatusOr<std::string> NewGroupId();

  // The oracle every backend is checked against, for an engine's own tests:
  // the reference MoE (plain loops, f32 accumulate) over the weights of
  // `model` (SessionOptions::model's syntax); host memory, `out` [T,H] f32.
  // Slow (small checks); the last model opened is kept (thread-safe).
  static absl::Status ReferenceForward(const std::string& model, int layer, int T, int k, const bf16_t* hidden,
                                       const int32_t* topk_ids, const float* topk_weights, float* out);

  const ModelInfo& model_info() const;
  // The options the session was opened with.
  const SessionOptions& options() const;
  // The MoE layers this session serves, ascending (SessionOptions::layers,
  // or every MoE layer of the model).
  const std::vector<int>& served_layers() const;
  // The forward calls' totals since Open (moe/types.h SessionTotals).
  SessionTotals totals() const;
  const char* device() const;  // "cuda" or "cpu"

  // One layer call, done when this returns. Device pointers on the cuda
  // backend with a decode-shaped call (T * k at most the layer's experts,
  // T within one request slot: 256 tokens by default) run the capturable
  // call's device path, uncaptured (see ForwardLayerCapturable); everything
  // else splits on the host.
  absl::Status ForwardLayer(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                            const float* topk_weights, bf16_t* out,
                            MemoryKind kind = MemoryKind::kHost, CallStats* stats = nullptr,
                            void* cuda_stream = nullptr);

  // A started call; pass it to Wait exactly once.
  struct Pending {
    int ticket = -1;
  };
  absl::StatusOr<Pending> ForwardLayerAsync(int layer, int T, int k, const bf16_t* hidden,
                                            const int32_t* topk_ids, const float* topk_weights,
                                            bf16_t* out, MemoryKind kind = MemoryKind::kHost,
                                            void* cuda_stream = nullptr);
  absl::Status Wait(Pending call, CallStats* stats = nullptr);

  // CUDA-graph-capturable call (cuda backend, device pointers; nullptr
  // `cuda_stream` = the legacy default stream): enqueued on `cuda_stream`,
  // returns at once; the GPU splits hits from misses, ships the misses to
  // the servers through shared memory and adds their answers with no host
  // step (docs/engine-api.md, "Capturable calls"). The placement, drains and
  // reconnects are read when the graph runs, not when it was captured. Warm
  // up each layer once outside a capture (the first call allocates); calls of
  // one layer must not overlap. Misses go to the servers, except those the
  // planner's copy-instead table picks and those no server may take: the
  // device copies them from the host copy and computes them itself, at most
  // 16 experts a call (place experts for good with admin().ApplyAssignment).
  // T above one request slot (256 tokens by default) runs as a
  // stream-ordered eager call outside a capture and is refused inside one.
  // Run-time errors (bad routing, no server for an expert the device cannot
  // take, a server's error) poison the affected tokens with NaN and are
  // returned by TakeStreamError; a request nobody answers (silent past the
  // deadline, a draining server, a gRPC server missing its server_deadline)
  // is computed on the device from the host copy (logged).
  absl::Status ForwardLayerCapturable(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                                      const float* topk_weights, bf16_t* out, void* cuda_stream);
  // The first run-time error of capturable calls since the last call; also
  // reports the routed pairs the GPU counted since then to on_access and the
  // cache (call it every few steps: it is how graph decode reaches the
  // coordinator), adds the capturable calls the GPU ran to totals(), and
  // reconnects a server that went away. Not while this
  // session's stream is being captured (it then reports errors only).
  absl::Status TakeStreamError();

  // The operator's side of the session — placement pushed from outside,
  // drains, and what the cache looks like — apart from the forward calls an
  // engine makes. Same threading rule as the session (between calls).
  class Admin {
   public:
    // Cache placement pushed from outside (coordinator or operator): between
    // calls. `pinned` (a subset of `experts`) are never evicted by the
    // worker's own admissions (predictive policy).
    absl::Status ApplyAssignment(int layer, const std::vector<int>& experts, const std::vector<int>& pinned = {});
    absl::Status FlushCopies();
    int PendingCopies();
    uint64_t copies_started() const;
    // Stop / resume sending misses to one expert server (drain, server down).
    absl::Status SetServerEnabled(const std::string& address, bool enabled);

    // The cache as it is now: experts in `layer`'s slots, the layer's hit rate
    // so far, slots per layer; and the planner's learned rates in words (the
    // copy-vs-compute model, what a cache copy delays the calls beside it, and
    // the call shapes whose copies their outcomes overruled).
    std::vector<int> CachedExperts(int layer) const;
    double HitRate(int layer) const;
    int slots_per_layer() const;
    std::string DescribeCostModel() const;
    std::string Describe() const;
    // The planner's learned rates as numbers, by name (the worker exports
    // them as moe_worker_planner_rate{rate=NAME} and reports them to the
    // coordinator, whose `moectl status` shows them): copy_seconds (one
    // expert host -> device), cpu_call_seconds and cpu_expert_seconds (a CPU
    // server's cost per call and per missed expert), device_row_seconds (one
    // hit row), copy_delay_seconds (what a cache copy adds to the calls beside
    // it), copy_calls_observed, vetoed_call_shapes (call shapes whose copies
    // their outcomes overruled), and measured (1 once the start-up probes ran).
    std::map<std::string, double> PlannerRates() const;

   private:
    friend class MoeSession;
    explicit Admin(Rep* rep) : rep_(rep) {}
    Rep* rep_;
  };
  Admin& admin() { return admin_; }
  const Admin& admin() const { return admin_; }

 private:
  explicit MoeSession(std::unique_ptr<Rep> rep);
  absl::Status RefuseInExpertParallel(const char* method) const;
  std::unique_ptr<Rep> rep_;
  Admin admin_;
};

}  // namespace moe
