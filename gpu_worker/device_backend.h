// DeviceBackend: where a GPU worker keeps its cached experts and computes its
// hits. Two implementations behind this one interface, created by
// MakeDeviceBackend("auto" | "cuda" | "cpu"):
//   cuda  device memory, own grouped kernels / cuBLAS, one compute stream and
//         one copy stream, events, pinned staging
//   cpu   host memory and the CPU expert kernels (AMX / AVX-512 / reference);
//         for machines without a GPU and for tests
// The dispatcher (layer_dispatcher.h), the cache bookkeeping (expert_cache.h)
// and the policies are written once against this interface.
//
// Memory model. The backend owns `num_buffers` expert buffers, each holding
// one expert (gate [I,H], up [I,H], down [H,I]) in the storage format of
// BackendConfig::format (bf16, int8 or int4: the cache's precision) and
// whatever layout its kernels read; a buffer index is all the dispatcher
// knows. Experts arrive packed (PackExpert's layout, expert_compute/expert_kernel.h),
// as the host copy holds them (the CPU server's packed store, shared, or the
// worker's own). It also owns `contexts`
// independent per-call scratch areas (inputs, f32 accumulator, plan), so two
// micro-batches can be in flight at once (dual-batch overlap).
//
// Ordering. Two queues: the copy queue (LoadExpert) and the compute queue
// (everything else). Work on one queue runs in submission order; the queues
// run concurrently and meet only through fences:
//   LoadExpert(..., after_compute)   the copy waits for compute fence `after_compute`
//   ComputeWaitCopy(copy_fence)      later compute waits for that copy
// The cpu backend executes every call synchronously (its fences are complete
// on return), which satisfies the same contract.
//
// Thread-safety: none. One thread (the dispatcher's caller) drives a backend.
// Errors are returned as Status (CUDA errors carry the call and the CUDA message).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/bf16.h"
#include "model/routing.h"
#include "expert_compute/expert_kernel.h"
#include "gpu_worker/device_plan.h"
#include "moe/types.h"

namespace moe {

struct BackendConfig {
  int hidden = 0;        // H
  int intermediate = 0;  // I (moe_intermediate_size: one expert's)
  int num_buffers = 0;   // expert buffers to allocate
  int max_tokens = 0;    // largest T of one call
  int max_top_k = 8;     // largest k of one call
  int contexts = 2;      // concurrent calls (micro-batches)
  int num_experts = 0;   // experts per layer (device-planned calls count accesses per expert)
  int device_sites = 0;  // sites (layers) of device-planned calls: 0 <= DevicePlannedCall::site < this
  int device_max_tokens = 0;  // largest T of a device-planned call (<= max_tokens; 0: max_tokens)
  // The experts' storage format (the GPU cache's precision) and, for int4,
  // the k per scale group: the buffers hold GeometryOf(config) experts.
  WeightFormat format = WeightFormat::kBf16;
  int int4_group = 0;
  // The model's expert math (ModelSpec::activation, ::expert_biases): every
  // format's buffers then end with the experts' f32 biases (ExpertGeometry).
  ExpertActivation activation;
  bool biases = false;
  // cpu backend
  int cpu_threads = 0;             // 0: every CPU this process may run on
  std::string cpu_kernel = "auto"; // amx | avx512 | reference | auto
  // cuda backend: the GPU; -1 = the calling thread's current device at Init
  // (what an engine that called cudaSetDevice / torch.cuda.set_device means)
  int cuda_device = -1;
};

// The hit work of one call: its pairs grouped by expert (GroupByExpert, each
// group starting on a multiple of the backend's hit_row_align()) and the
// expert buffer each group's expert sits in (host memory; the backend copies
// what it needs before the call returns). Group g computes
//   accum[token[r]] += weight[r] * FFN_buffer[g](x[token[r]])
// for rows r in [row_begin[g], row_begin[g] + count[g]). token[r] == -1 marks
// padding rows (skipped).
// The packed geometry of a config's experts.
inline ExpertGeometry GeometryOf(const BackendConfig& c) {
  return ExpertGeometry::For(c.hidden, c.intermediate, c.format, c.int4_group).WithExpertMath(c.activation, c.biases);
}

struct HitPlan {
  const ExpertGroups* groups = nullptr;
  const int32_t* buffer = nullptr;  // [groups->num_groups()]
};

// ---- device-planned calls (CUDA graphs and eager decode) -------------------
// A call whose whole work sits on the engine's stream, decided by the GPU at
// run time from host-mapped tables (gpu_worker/device_plan.h): the split into
// hits and misses, the misses written into the CPU servers' shared-memory
// slots and pushed on their device rings, the hits as one grouped launch
// sized for T*k groups (unused groups have count 0 and cost no weight
// reads), a bounded wait for the answers, their partial sums added, `out`
// written. No host function and no host synchronisation: it may be captured
// into a CUDA graph and replayed; each replay follows the tables as they are
// then. Nothing is decided at enqueue time except T and k.
struct DevicePlannedCall {
  int site = 0;   // scratch of one layer: calls of a site must not overlap (one stream)
  int layer = 0;  // the model layer (the requests' header)
  int T = 0, k = 0;
  const bf16_t* hidden = nullptr;  // device pointers (the engine's)
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  bf16_t* out = nullptr;
  void* stream = nullptr;          // the engine's cudaStream_t (may be capturing)
  DeviceLayerTables tables;        // host-mapped (AllocMapped)
  int num_channels = 0;            // of SetDeviceChannels' table
  std::chrono::nanoseconds timeout{0};      // the longest wait for a server's answer
  bool count_accesses = true;      // add the routed pairs to the site's counters (ReadAccessCounts)
  // Copy-instead (device_plan.h DeviceCopyPlan; null: none): up to
  // kMaxDeviceCopies missed experts copied from the host copy
  // (SetHostExperts) into buffers copy_buffer_base + j and computed there.
  const DeviceCopyPlan* copy_plan = nullptr;  // host-mapped
  int copy_buffer_base = 0;
};

// CUDA's legacy default stream, `cudaStreamLegacy` ((cudaStream_t)0x1 in
// driver_types.h), spelled here for code built without the CUDA headers. A
// capturable call given no stream runs on it, as a CUDA call given stream 0
// would (torch's current stream is 0 unless the engine set one).
inline void* LegacyDefaultStream() { return reinterpret_cast<void*>(static_cast<uintptr_t>(1)); }

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual const char* name() const = 0;  // "cuda" or "cpu"
  // Memory the hidden/output pointers of a kDevice call live in; a cpu backend
  // has none (kDevice calls are refused by the dispatcher).
  virtual bool has_device_memory() const = 0;
  // Bytes one expert buffer of geometry `g` occupies (what a cache slot
  // costs; known before Init).
  virtual size_t ExpertBytes(const ExpertGeometry& g) const = 0;
  // Bytes still free for expert buffers on this device (before Init: all of it).
  virtual size_t free_memory_bytes() const = 0;

  // Allocates buffers and scratch. Called once, before anything else below.
  virtual absl::Status Init(const BackendConfig& config) = 0;

  // Pins host memory for DMA (cudaHostRegister); the cpu backend does nothing.
  // Used for the host expert store and the shm segment of a transport, so
  // copies to and from them run at full PCIe rate with no bounce buffer.
  // `read_only`: memory mapped read-only (a server's shared expert store),
  // which the device only reads.
  virtual absl::Status RegisterHost(void* p, size_t bytes, bool read_only = false) = 0;
  virtual void UnregisterHost(void* p) = 0;

  // ---- copy queue --------------------------------------------------------
  // Starts copying one expert from host memory into `buffer`: `packed` is
  // the expert packed in the config's geometry (PackExpert; packed_bytes()
  // bytes). Formats whose buffers use another layout are repacked on the
  // device after the copy (the cuda backend's bf16 buffers are row-major).
  // The copy first waits for compute fence `after_compute` (0: no wait), so
  // a buffer still read by earlier compute is not overwritten. `packed` must
  // stay valid until the returned copy fence is done.
  virtual absl::StatusOr<uint64_t> LoadExpert(int buffer, const std::byte* packed,
                                              uint64_t after_compute) = 0;
  // True when the copy fence has completed (non-blocking).
  virtual bool CopyDone(uint64_t copy_fence) = 0;
  // Blocks until the copy fence has completed; an error if the copy failed.
  virtual absl::Status WaitCopy(uint64_t copy_fence) = 0;
  // How long the copy that `copy_fence` ends took on the copy queue itself
  // (not counting the time it queued), once it completed; nullopt while it
  // runs, or once the fence is too old to tell. What the copy cost model
  // observes: a host clock only bounds a copy that was done before it looked.
  virtual std::optional<double> CopySeconds(uint64_t copy_fence) = 0;

  // ---- compute queue (per context) ---------------------------------------
  // Makes later compute work of every context wait for `copy_fence`.
  virtual void ComputeWaitCopy(uint64_t copy_fence) = 0;
  // A fence after all compute work submitted so far.
  virtual uint64_t RecordCompute() = 0;
  virtual absl::Status WaitCompute(uint64_t compute_fence) = 0;
  // True when the compute fence has completed or failed (non-blocking;
  // WaitCompute reports the error).
  virtual bool ComputeDone(uint64_t compute_fence) = 0;
  // A timing mark on the compute queue (not a fence: nothing waits on it),
  // passed once the work submitted before it is done.
  virtual uint64_t MarkCompute() = 0;
  // How long the compute queue took for the work submitted between marks
  // `from` and `to` (from < to), once `to` passed; nullopt while it is
  // pending, or once a mark is too old to tell. What the copy path's device
  // cost observes (CostModel::ObserveCopyDevice).
  virtual std::optional<double> ComputeSeconds(uint64_t from, uint64_t to) = 0;

  // Starts a call in scratch context `ctx`: copies the T x H bf16 activations
  // (`hidden`, in `kind` memory) into the context and zeroes its f32
  // accumulator [T, H]. T may be 0.
  virtual absl::Status BeginCall(int ctx, int T, const bf16_t* hidden, MemoryKind kind) = 0;
  // Copies routing that lives in device memory to the host (ids [n], weights
  // [n]); synchronous. Host routing needs no backend call.
  virtual absl::Status RoutingToHost(const int32_t* ids, const float* weights, int n,
                                     int32_t* host_ids, float* host_weights) = 0;
  // Gathers rows rows[0..n) of the context's activations into host memory
  // `dst` ([n, H] bf16; registered or shm memory), then returns a compute
  // fence after which `dst` is complete.
  virtual absl::StatusOr<uint64_t> GatherRows(int ctx, const int32_t* rows, int n,
                                              bf16_t* dst) = 0;
  // The row alignment HitPlan groups need (GroupByExpert's row_align): the
  // cpu backend computes them with the expert kernels' row blocks as they are.
  virtual int hit_row_align() const { return 1; }
  // Enqueues the hit plan's expert FFNs, accumulating into the context's
  // accumulator. Buffers named by the plan must have been loaded (their copy
  // fences waited for by ComputeWaitCopy or WaitCopy).
  virtual absl::Status RunExperts(int ctx, const HitPlan& plan) = 0;
  // accum[rows[i]] += partial[i] for i < n; `partial` is host memory [n, H]
  // bf16 (registered or shm). Returns a compute fence after which `partial`
  // is no longer read.
  virtual absl::StatusOr<uint64_t> AddRows(int ctx, const int32_t* rows, int n,
                                           const bf16_t* partial) = 0;
  // Writes the accumulator as bf16 into `out` ([T, H], `kind` memory) and
  // waits for the context's work to finish. The call is over afterwards.
  // `out` == nullptr discards the result (an aborted call).
  virtual absl::Status FinishCall(int ctx, bf16_t* out, MemoryKind kind) = 0;

  // ---- the engine's stream (cudaStream_t passed as void*) ----------------
  // WaitStream: later compute work waits for everything enqueued on `stream`
  // so far (an event recorded there; no host wait). SignalStream: work the
  // engine enqueues on `stream` afterwards waits for all compute work
  // submitted so far. nullptr is a no-op. A backend without a device (cpu)
  // refuses a non-null stream with InvalidArgument naming cuda_stream.
  virtual absl::Status WaitStream(void* stream) {
    return stream == nullptr ? absl::OkStatus()
                             : absl::InvalidArgumentError(absl::StrCat(
                                   "cuda_stream: given to the ", name(), " backend, which has no CUDA device"));
  }
  virtual absl::Status SignalStream(void* stream) { return WaitStream(stream); }
  // Waits until the backend's GPU has finished all work enqueued on it, by
  // any stream (graph replays of capturable calls included), touching no
  // engine stream: what a dispatcher waits for when it is destroyed, as the
  // engine may have destroyed its streams already. A no-op without a device.
  virtual absl::Status SynchronizeDevice() { return absl::OkStatus(); }
  // Makes the backend's GPU the calling thread's current device and returns
  // the one it replaces (RestoreDevice gives it back); -1 and a no-op
  // without a device or when it is current already. Several sessions on
  // several GPUs can then be driven from one engine thread.
  virtual int ActivateDevice() { return -1; }
  virtual void RestoreDevice(int previous) { (void)previous; }
  // Whether `stream` is being captured into a CUDA graph (false without a device).
  virtual bool StreamCapturing(void* stream) const {
    (void)stream;
    return false;
  }

  // Enqueues a device-planned call (see DevicePlannedCall) on call.stream;
  // returns at once. The site's first call must not be captured (it
  // allocates). Only a backend with a CUDA device can: others refuse with
  // FailedPrecondition (the same call on the cuda backend works).
  virtual absl::Status EnqueueDevicePlanned(const DevicePlannedCall& call) {
    (void)call;
    return absl::FailedPreconditionError(
        absl::StrCat("capturable calls need the cuda backend (a CUDA stream to enqueue on); this is the ", name(),
                     " backend"));
  }
  // The channels device-planned calls ship to (device memory: a call reads
  // them without a PCIe round trip); replaces the table, synchronously, on a
  // stream of its own (not while a stream of the backend's device captures:
  // call it between calls). At most kMaxDeviceChannels.
  virtual absl::Status SetDeviceChannels(const DeviceChannel* channels, int n) {
    (void)channels, (void)n;
    return absl::FailedPreconditionError(absl::StrCat("the ", name(), " backend has no device"));
  }
  // Where device-planned calls of `site` find each expert of its layer in
  // the host copy (registered memory, RegisterHost), for copy-instead; a
  // synchronous upload like SetDeviceChannels. [num_experts] pointers.
  virtual absl::Status SetHostExperts(int site, const std::vector<const std::byte*>& experts) {
    (void)site, (void)experts;
    return absl::FailedPreconditionError(absl::StrCat("the ", name(), " backend has no device"));
  }
  // Seconds the device-planned call's copy of one expert takes (the SMs
  // reading `packed`, an expert of the host copy in registered memory, through
  // the mapping: not the copy engine LoadExpert uses); the fastest of 3.
  virtual absl::StatusOr<double> ProbeDeviceCopy(const std::byte* packed) {
    (void)packed;
    return absl::FailedPreconditionError(absl::StrCat("the ", name(), " backend has no device"));
  }
  // Zeroed host memory the device reads and writes at the same address
  // (the device-planned call's tables); freed with FreeMapped.
  virtual absl::StatusOr<void*> AllocMapped(size_t bytes) {
    (void)bytes;
    return absl::FailedPreconditionError(absl::StrCat("the ", name(), " backend has no device to map memory for"));
  }
  virtual void FreeMapped(void* p) { (void)p; }
  // The device address of host memory registered with RegisterHost (0: not registered).
  virtual uint64_t DeviceAddress(const void* p) const {
    (void)p;
    return 0;
  }
  // Routed pairs per expert counted by the device-planned calls of each site
  // since the first call (running totals, [device_sites * num_experts],
  // site-major); empty before any call.
  // Synchronous with the site's completed calls only: a call still on the
  // engine's stream may or may not be counted yet.
  virtual absl::Status ReadAccessCounts(std::vector<uint32_t>* counts) {
    counts->clear();
    return absl::OkStatus();
  }
  // The same for the calls themselves: per site kDeviceTotals counters
  // (device_plan.h: calls, hit / CPU / copied pairs) of the calls with
  // count_accesses, site-major; empty before any call.
  virtual absl::Status ReadCallTotals(std::vector<uint64_t>* totals) {
    totals->clear();
    return absl::OkStatus();
  }
};

// "auto": cuda when built with CUDA and a device is present, else cpu.
// Unknown names are InvalidArgument; "cuda" without a usable GPU is
// FailedPrecondition with the reason.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const std::string& name);

// Implementations; the factory is their only caller.
std::unique_ptr<DeviceBackend> MakeHostMemoryBackend();
// nullptr with *why set when CUDA is not compiled in or no device is usable.
std::unique_ptr<DeviceBackend> MakeCudaBackend(std::string* why);
// Whether a CUDA device is usable (false when built without CUDA).
bool CudaAvailable();

}  // namespace moe
