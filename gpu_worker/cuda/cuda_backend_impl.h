// The cuda DeviceBackend's class and the helpers its files share (a private
// header: gpu_worker/cuda_backend.cu has the design and Init, memory, copies
// and fences; cuda_backend_calls.cu the host path's calls, RunExperts and the
// GEMM groups; cuda_backend_planned.cu the device-planned calls and their
// host-mapped tables). Not installed.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/bf16.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu_worker/cuda/cuda_check.h"
#include "gpu_worker/cuda/kernels.h"
#include "gpu_worker/device_backend.h"

namespace moe {
namespace cuda_backend_impl {

// ---- configuration (one place) -------------------------------------------
// bf16 groups with more rows than this run through cuBLAS; up to it, the
// grouped kernels (measured faster than cuBLAS up to 64 rows, see above).
// CalibrateGemmRows raises it, doubling, while the grouped kernels stay
// faster for this geometry.
constexpr int kGemmMinRows = 64;
// The same for packed buffers (int8, int4, fp8, mxfp4): up to this the packed kernels run from
// the packed bytes on tensor cores (64 rows per pass, re-reading the packed
// weights each pass); above it a group is dequantized into bf16 once and
// goes to cuBLAS. Measured (bench/gpu_experts, H200, 32 experts): at 128 rows
// the packed path took 1959 / 2472 us
// (DeepSeek-V3 int8 / int4) against 4500 / 3193 through cuBLAS, and 261 /
// 328 against 1302 / 1279 (Qwen3-30B-A3B); at 256 rows 3948 / 4904 against
// 5032 / 3718 and 494 / 636 against 1316 / 1303. Four passes keep int8 ahead
// on both shapes; int4 loses up to a third on DeepSeek-V3 at 192-256 rows
// there and wins 2-3x on Qwen3-30B-A3B.
constexpr int kPackedGemmMinRows = 256;
// Rows of one cuBLAS piece; bounds the GEMM scratch to
// kGemmChunkRows * (H * 2 + max(2I, H) * 4) bytes.
constexpr int kGemmChunkRows = 2048;
// Fences per ring (copy and compute each). Reusing a slot waits for the
// fence it held, so this many fences may be outstanding without a stall.
constexpr int kFenceRingSize = 1024;
// Host outputs up to this size that live in registered memory are written by
// the kernel through the mapping; bigger ones (or unregistered memory) go
// through device scratch and one DMA copy. The environment variable
// MOE_CUDA_MAPPED_WRITE_MAX_BYTES overrides it (read at Init; for tuning).
constexpr size_t kMappedWriteMaxBytes = size_t{1} << 20;
// cuBLAS workspace (the size NVIDIA recommends for Hopper).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Expert buffers start at multiples of this many bf16 values (256 bytes).
constexpr size_t kExpertAlignElems = 128;
// Staging sub-allocations are aligned to this.
constexpr size_t kStageAlign = 256;

inline size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// A ring of events backing monotonically increasing fence ids.
class FenceRing {
 public:
  FenceRing() = default;
  FenceRing(const FenceRing&) = delete;
  FenceRing& operator=(const FenceRing&) = delete;
  ~FenceRing() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }

  // `timed`: the events also time (CopySeconds), else cudaEventDisableTiming.
  absl::Status Init(int size, bool timed = false) {
    events_.resize(size, nullptr);
    for (cudaEvent_t& e : events_)
      MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming));
    return absl::OkStatus();
  }

  // The id the next Record returns.
  uint64_t next() const { return next_; }
  size_t size() const { return events_.size(); }

  // A new fence after all work submitted to `stream` so far.
  absl::StatusOr<uint64_t> Record(cudaStream_t stream) {
    const uint64_t id = next_;
    cudaEvent_t e = events_[id % events_.size()];
    // The slot held fence id - size; make sure it is complete before it is
    // forgotten (ids that old are reported complete from now on).
    if (id > events_.size()) MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e));
    MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, stream));
    ++next_;
    return id;
  }

  // Whether `id` names a fence handed out so far (0 counts: "no fence").
  bool Issued(uint64_t id) const { return id < next_; }

  // The event of a fence that may still be pending; nullptr when it is known
  // complete (id 0, or older than the ring). Requires Issued(id).
  cudaEvent_t Pending(uint64_t id) const {
    if (id == 0 || id + events_.size() < next_) return nullptr;
    return events_[id % events_.size()];
  }

 private:
  std::vector<cudaEvent_t> events_;
  uint64_t next_ = 1;
};

// cudaMalloc'd / cudaHostAlloc'd storage freed on destruction.
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using DeviceMem = std::unique_ptr<void, DeviceFree>;
using PinnedMem = std::unique_ptr<void, HostFree>;

inline absl::StatusOr<DeviceMem> AllocDevice(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    cudaGetLastError();
    const absl::Status st = CudaStatus(err, "cudaMalloc", __FILE__, __LINE__);
    return absl::Status(st.code(), absl::StrCat("cuda: allocating ", what, " (", bytes,
                                                " bytes, ", free_b, " free): ", st.message()));
  }
  return DeviceMem(p);
}

inline absl::StatusOr<PinnedMem> AllocPinned(size_t bytes) {
  void* p = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
  return PinnedMem(p);
}

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  bool has_device_memory() const override { return true; }
  // 0 before Init (the geometry is not known yet).
  size_t ExpertBytes(const ExpertGeometry& g) const override;
  size_t free_memory_bytes() const override;

  absl::Status Init(const BackendConfig& config) override;
  absl::Status RegisterHost(void* p, size_t bytes, bool read_only) override;
  void UnregisterHost(void* p) override;

  absl::StatusOr<uint64_t> LoadExpert(int buffer, const std::byte* packed,
                                      uint64_t after_compute) override;
  bool CopyDone(uint64_t copy_fence) override;
  absl::Status WaitCopy(uint64_t copy_fence) override;
  std::optional<double> CopySeconds(uint64_t copy_fence) override;
  uint64_t MarkCompute() override;
  std::optional<double> ComputeSeconds(uint64_t from, uint64_t to) override;

  void ComputeWaitCopy(uint64_t copy_fence) override;
  uint64_t RecordCompute() override;
  absl::Status WaitCompute(uint64_t compute_fence) override;
  bool ComputeDone(uint64_t compute_fence) override;

  absl::Status BeginCall(int ctx, int T, const bf16_t* hidden, MemoryKind kind) override;
  absl::Status RoutingToHost(const int32_t* ids, const float* weights, int n, int32_t* host_ids,
                             float* host_weights) override;
  absl::StatusOr<uint64_t> GatherRows(int ctx, const int32_t* rows, int n, bf16_t* dst) override;
  absl::Status RunExperts(int ctx, const HitPlan& plan) override;
  absl::StatusOr<uint64_t> AddRows(int ctx, const int32_t* rows, int n,
                                   const bf16_t* partial) override;
  absl::Status FinishCall(int ctx, bf16_t* out, MemoryKind kind) override;
  absl::Status WaitStream(void* stream) override;
  absl::Status SynchronizeDevice() override;
  absl::Status SignalStream(void* stream) override;
  absl::Status EnqueueDevicePlanned(const DevicePlannedCall& call) override;
  absl::StatusOr<void*> AllocMapped(size_t bytes) override;
  absl::Status SetDeviceChannels(const DeviceChannel* channels, int n) override;
  absl::Status SetHostExperts(int site, const std::vector<const std::byte*>& experts) override;
  absl::StatusOr<double> ProbeDeviceCopy(const std::byte* packed) override;
  void FreeMapped(void* p) override;
  uint64_t DeviceAddress(const void* p) const override;
  absl::Status ReadAccessCounts(std::vector<uint32_t>* counts) override;
  absl::Status ReadCallTotals(std::vector<uint64_t>* totals) override;
  bool StreamCapturing(void* stream) const override;
  int ActivateDevice() override {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current == device_) return -1;
    cudaSetDevice(device_);
    return current;
  }
  void RestoreDevice(int previous) override {
    if (previous >= 0) cudaSetDevice(previous);
  }

 private:
  // Device scratch of one device-planned call site (a layer), sized for
  // device_max_tokens x max_top_k; allocated by the site's first call, which
  // must not be captured (cudaMalloc is not capture-safe).
  struct DeviceSite {
    DeviceMem groups, row_token, row_weight, accum, act, miss_token, ships, done, call_seq;
  };
  DeviceMem access_counts_;  // [device_sites, num_experts], from the first site on
  DeviceMem call_totals_;    // [device_sites, kDeviceTotals] (device_plan.h), with access_counts_
  DeviceMem channels_, channel_state_;  // [kMaxDeviceChannels] DeviceChannel, DeviceChannelState
  cudaStream_t table_stream_ = nullptr;  // SetDeviceChannels' uploads
  DeviceMem host_experts_;               // [device_sites, num_experts] device addresses (SetHostExperts)
  DeviceMem copies_, copy_count_;        // [kMaxDeviceCopies] DeviceCopy, the call's count
  DeviceMem copy_staging_;               // bf16: [kMaxDeviceCopies] packed experts, unpacked into their buffers
  absl::Status EnsureTableStream();
  absl::StatusOr<DeviceSite*> Site(int site);
  int DeviceMaxTokens() const {
    return config_.device_max_tokens > 0 ? std::min(config_.device_max_tokens, config_.max_tokens) : config_.max_tokens;
  }
  cuda::DevicePlanArgs PlanArgs(const DevicePlannedCall& call, DeviceSite& site);
  struct Context {
    DeviceMem x;      // [max_tokens, H] bf16 activations (also FinishCall's output staging)
    DeviceMem accum;  // [max_tokens, H] f32
    PinnedMem stage_host;
    DeviceMem stage_dev;
    size_t stage_bytes = 0;
    size_t stage_used = 0;
    cudaEvent_t stage_event = nullptr;  // after the last upload out of stage_host
    bool stage_event_recorded = false;
    int T = 0;
    bool active = false;
  };

  // An upload reserved in a context's staging arena: fill `host`, then Commit.
  struct Upload {
    char* host = nullptr;
    char* dev = nullptr;
    size_t bytes = 0;
  };

  absl::Status Use() const;  // makes device_ current; errors before Init
  absl::StatusOr<Context*> ActiveContext(int ctx);
  absl::Status TakeDeferred();
  void Defer(absl::Status st);

  absl::StatusOr<Upload> Reserve(Context& c, size_t bytes);
  absl::Status Commit(Context& c, const Upload& u);
  absl::Status ResetStage(Context& c);
  // Uploads n int32 values; returns their device copy.
  absl::StatusOr<const int32_t*> UploadRows(Context& c, const int32_t* rows, int n);
  absl::Status CheckRows(const Context& c, const int32_t* rows, int n, const char* what) const;

  absl::Status EnsurePlanRows(int rows);
  // Init's steps, in order: the config and the device; streams, events,
  // fences and cuBLAS; the scratch all contexts share; each context's state.
  absl::Status CheckConfigAndDevice(const BackendConfig& config);
  absl::Status CreateStreamsAndHandles();
  absl::Status CalibrateGemmRows();
  absl::Status AllocateSharedScratch(size_t plan_rows);
  absl::Status AllocateContexts(size_t max_tokens, size_t plan_rows);
  absl::StatusOr<int> SplitHitGroups(const Context& c, const HitPlan& plan);
  absl::Status RunGemmGroup(Context& c, const cuda::GroupDesc& g, const int32_t* d_token,
                            const float* d_weight);
  // The grouped launches (gate/up, then down) for `a`'s groups, in the
  // buffers' format.
  absl::Status LaunchGroups(cuda::GroupedExpertArgs a, cudaStream_t stream) const;
  // Device pointer through which a kernel may write [p, p + bytes) of host
  // memory, or nullptr (not registered/mapped, or too big to be worth it).
  void* MappedForKernelWrite(void* p, size_t bytes) const;
  // The device address of host memory [p, p + bytes) when it is pinned and
  // mapped as one range, else nullptr; above mapped_write_max_bytes_ only
  // within one range registered through RegisterHost.
  const void* MappedRange(const void* p, size_t bytes) const;
  // A host-to-device upload on `stream` that does not queue on the copy
  // engine: SMs read mapped pinned memory (16-byte units) — behind a layer's
  // expert copies a DMA upload of a call's rows or partial sums waited for
  // all of them (H100 host). `mapped`: src's device address
  // (MappedRange, resolved once by the caller), or nullptr for unmapped
  // memory; unmapped or unaligned: a DMA copy.
  absl::Status UploadFromHost(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                              const void* mapped) const;

  uint8_t* slot(int b) const { return static_cast<uint8_t*>(experts_.get()) + static_cast<size_t>(b) * slot_bytes_; }
  // A bf16 buffer (row-major).
  bf16_t* buffer_ptr(int b) const { return reinterpret_cast<bf16_t*>(slot(b)); }

  int device_;
  bool initialized_ = false;
  BackendConfig config_;
  int H_ = 0, I_ = 0;
  ExpertGeometry geometry_;   // the buffers' storage format
  cuda::PackedLayout layout_;  // geometry_ for the kernels
  size_t slot_bytes_ = 0;     // bytes between buffers (ExpertBytes)
  DeviceMem staging_;         // bf16: one packed expert, repacked into its buffer
  DeviceMem unpacked_;        // int8 / int4: one expert as row-major bf16, for cuBLAS

  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_ = nullptr;
  // Joins with the engine's stream: recorded there and waited for by compute_
  // (WaitStream), recorded on compute_ and waited for there (SignalStream).
  // One event each suffices: a wait binds to the record that precedes it.
  cudaEvent_t engine_ready_ = nullptr;
  cudaEvent_t output_ready_ = nullptr;
  FenceRing copy_fences_;                 // timed: each ends a copy
  std::vector<cudaEvent_t> copy_starts_;  // [fence % ring size]: recorded right before the copy
  FenceRing compute_fences_;
  FenceRing compute_marks_;  // timed: MarkCompute (the fences stay untimed, cheaper to wait on)
  cublasHandle_t cublas_ = nullptr;
  DeviceMem cublas_workspace_;

  DeviceMem experts_;
  std::vector<Context> contexts_;

  // Shared scratch (single compute stream).
  int plan_rows_capacity_ = 0;
  DeviceMem act_;        // [plan_rows_capacity_, I] bf16
  int chunk_rows_ = 0;
  DeviceMem rows_bf16_;  // [chunk_rows_, H] bf16: gathered rows, AddRows partials, GatherRows staging
  DeviceMem gemm_f32_;   // [chunk_rows_, max(2I, H)] f32: gate|up GEMM output, then down output

  // Host-side plan scratch, reused across calls.
  std::vector<cuda::GroupDesc> small_groups_;
  std::vector<cuda::GroupDesc> big_groups_;

  std::map<void*, size_t> registered_;
  size_t mapped_write_max_bytes_ = kMappedWriteMaxBytes;
  int gemm_min_rows_ = kGemmMinRows;  // MOE_CUDA_GEMM_MIN_ROWS overrides it (read at Init; for tuning)
  bool unified_addressing_ = false;  // host pinned memory is read by kernels at its host address
  absl::Status deferred_;  // error of a void-returning call, reported by the next call

  std::map<int, std::unique_ptr<DeviceSite>> sites_;
  std::map<void*, size_t> mapped_;  // AllocMapped
};



// Whether the work before event `e` (null: known complete) has finished or
// failed (non-blocking; the waits report a failure).
inline bool EventDone(cudaEvent_t e) {
  if (e == nullptr) return true;
  const cudaError_t err = cudaEventQuery(e);
  if (err == cudaSuccess) return true;
  cudaGetLastError();
  return err != cudaErrorNotReady;
}

}  // namespace cuda_backend_impl
}  // namespace moe
