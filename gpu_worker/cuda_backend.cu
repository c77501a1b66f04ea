// The cuda DeviceBackend (contract: device_backend.h). Host orchestration
// only; the kernels live in gpu_worker/cuda/ (declared in kernels.h: the bf16
// grouped kernels in expert_kernels.cu, the packed int8/int4/fp8 ones in
// packed_kernels.cu, the capturable call's plan in device_plan.cu).
//
// Streams. One compute stream serves every context (calls of two contexts
// interleave on it in submission order), one copy stream serves LoadExpert.
// The compute stream is a blocking stream, so work the caller put on the
// legacy default stream (e.g. activations or routing it produced there) is
// ordered before our compute work; activations or routing produced on another
// stream must be synchronized by the caller before BeginCall / RoutingToHost.
// The copy stream is non-blocking: expert loads never stall the default stream.
//
// Fences are ids from two counters (copy, compute), each backed by a ring of
// cudaEvents; a fence older than the ring is known complete (its event was
// waited for before the slot was reused). Id 0 means "no fence".
//
// Memory. One cudaMalloc holds every expert buffer, each padded to 256
// bytes. bf16 buffers hold gate [I,H], up [I,H], down [H,I] row-major (what
// the bf16 kernels and cuBLAS read): LoadExpert copies the packed bf16 expert
// into a staging buffer and LaunchUnpackExpert repacks it on the copy stream.
// int8 / int4 buffers hold the packed expert byte for byte (a copy is one
// memcpy of 1/2 or about 1/4 of the bf16 bytes) and the packed kernels read it;
// a group too big for them is dequantized into a bf16 scratch expert first
// and goes through cuBLAS. Per context: activations [max_tokens, H] bf16, the f32
// accumulator [max_tokens, H], and a pinned host staging arena with a device
// mirror for the plan/row arrays (bump-allocated per call; host bytes are
// reused only after the event of the last upload out of them completed, device
// bytes are protected by stream order). Scratch that lives only within one
// RunExperts/GatherRows/AddRows (intermediate act [rows, I], gathered rows,
// GEMM outputs) is shared by the contexts: the single compute stream
// serializes its users.
//
// RunExperts. Small groups go to two grouped launches covering all of them
// (gate/up with silu*mul into act, down with the weighted atomicAdd into the
// accumulator) that stream each expert's weights once per 64 rows (CUDA
// cores for up to 2 rows, mma.sync above; see expert_kernels.cu); bigger
// groups go to cuBLAS per group (bf16 in, f32 compute/out, tensor ops) with
// gather / silu*mul / scatter-add kernels around it, in pieces of at most
// kGemmChunkRows rows. On H100 with DeepSeek-V3 experts the grouped launches
// read weights at 2.9-3.0 TB/s up to 16 rows per expert, 2.65 at 32, 1.76 at
// 64; cuBLAS reached 1.5-1.6 TB/s at 33-128 rows. Where bf16 groups switch
// is measured at Init for the geometry (CalibrateGemmRows): five launches per
// group cost a small expert more than its GEMM (Qwen3-30B-A3B, 128 rows: 33
// us per expert through cuBLAS, 7.6 at 64 rows grouped; a 2048-token prompt's
// hit launch took 4-5 ms of host time per layer; H100 host),
// while DeepSeek-V3's experts are faster through cuBLAS from 128 rows. int8 / int4 slots take the
// same shape through cuda/packed_kernels.cu (tensor cores from 2 rows, on the
// packed bytes) up to kPackedGemmMinRows rows; mxfp4 (CUDA cores) up to a
// row count measured at Init, as bf16.
//
// Caller-visible asynchrony: BeginCall's copy of `hidden` is asynchronous when
// `hidden` is device or pinned memory, so `hidden` must stay unchanged until
// FinishCall returns.
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
namespace {

// ---- configuration (one place) -------------------------------------------
// bf16 groups with more rows than this run through cuBLAS; up to it, the
// grouped kernels (measured faster than cuBLAS up to 64 rows, see above).
// CalibrateGemmRows raises it, doubling, while the grouped kernels stay
// faster for this geometry.
constexpr int kGemmMinRows = 64;
// The same for int8 / int4 buffers: up to this the packed kernels run from
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
// mxfp4 has no tensor-core packed kernel (CUDA cores only): where its groups
// switch to dequantize + cuBLAS is measured at Init (CalibrateGemmRows) from
// this many rows up to kPackedGemmMinRows. GPT-OSS-120B (H = I = 2880), a
// 2048-token prompt: 64 rows per expert on average, where the CUDA-core
// kernel ran ~3.2 GFLOP per expert at CUDA-core rates.
constexpr int kMxfp4GemmProbeRows = 8;
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

size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

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

absl::StatusOr<DeviceMem> AllocDevice(size_t bytes, const char* what) {
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

absl::StatusOr<PinnedMem> AllocPinned(size_t bytes) {
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

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (compute_ != nullptr) cudaStreamSynchronize(compute_);
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  for (const auto& [p, bytes] : registered_) cudaHostUnregister(p);
  for (const auto& [p, bytes] : mapped_) cudaFreeHost(p);
  for (Context& c : contexts_)
    if (c.stage_event != nullptr) cudaEventDestroy(c.stage_event);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  for (cudaEvent_t e : copy_starts_)
    if (e != nullptr) cudaEventDestroy(e);
  if (engine_ready_ != nullptr) cudaEventDestroy(engine_ready_);
  if (table_stream_ != nullptr) cudaStreamDestroy(table_stream_);
  if (output_ready_ != nullptr) cudaEventDestroy(output_ready_);
  // Members (memory, fence rings) are released after this body; streams last.
  contexts_.clear();
  act_.reset();
  rows_bf16_.reset();
  gemm_f32_.reset();
  experts_.reset();
  staging_.reset();
  unpacked_.reset();
  cublas_workspace_.reset();
  if (compute_ != nullptr) cudaStreamDestroy(compute_);
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  cudaGetLastError();
}

size_t CudaBackend::free_memory_bytes() const {
  if (cudaSetDevice(device_) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return free_b;
}

absl::Status CudaBackend::Use() const {
  if (!initialized_) return absl::FailedPreconditionError("cuda backend: Init was not called");
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::TakeDeferred() {
  absl::Status st;
  swap(st, deferred_);
  return st;
}

void CudaBackend::Defer(absl::Status st) {
  deferred_.Update(st);
}

absl::Status CudaBackend::CheckConfigAndDevice(const BackendConfig& config) {
  if (initialized_) return absl::FailedPreconditionError("cuda backend: Init called twice");
  if (config.hidden <= 0 || config.intermediate <= 0 || config.num_buffers < 0 ||
      config.max_tokens < 0 || config.max_top_k <= 0 || config.contexts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: bad config (hidden ", config.hidden, ", intermediate ", config.intermediate,
        ", num_buffers ", config.num_buffers, ", max_tokens ", config.max_tokens, ", max_top_k ",
        config.max_top_k, ", contexts ", config.contexts, ")"));
  }
  int count = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  const int device = config.cuda_device >= 0 ? config.cuda_device : device_;  // -1: the creator's current GPU
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: cuda_device ",
                                                   device, " but ", count,
                                                   " device(s) visible"));
  }
  device_ = device;
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::CreateStreamsAndHandles() {
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&engine_ready_, cudaEventDisableTiming));
  MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&output_ready_, cudaEventDisableTiming));
  MOE_RETURN_IF_ERROR(copy_fences_.Init(kFenceRingSize, /*timed=*/true));
  copy_starts_.assign(kFenceRingSize, nullptr);
  for (cudaEvent_t& e : copy_starts_) MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  MOE_RETURN_IF_ERROR(compute_fences_.Init(kFenceRingSize));
  MOE_RETURN_IF_ERROR(compute_marks_.Init(kFenceRingSize, /*timed=*/true));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, compute_));
  MOE_ASSIGN_OR_RETURN(cublas_workspace_, AllocDevice(kCublasWorkspaceBytes, "cuBLAS workspace"));
  MOE_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(cublas_, cublas_workspace_.get(), kCublasWorkspaceBytes));
  return absl::OkStatus();
}

absl::Status CudaBackend::AllocateSharedScratch(size_t plan_rows) {
  const size_t H = H_, I = I_;
  MOE_RETURN_IF_ERROR(EnsurePlanRows(static_cast<int>(plan_rows)));
  chunk_rows_ = static_cast<int>(std::min<size_t>(kGemmChunkRows, plan_rows));
  MOE_ASSIGN_OR_RETURN(rows_bf16_, AllocDevice(chunk_rows_ * H * sizeof(bf16_t), "row scratch"));
  MOE_ASSIGN_OR_RETURN(gemm_f32_, AllocDevice(chunk_rows_ * std::max(2 * I, H) * sizeof(float), "GEMM scratch"));
  return absl::OkStatus();
}

// Per-context state. Staging: token + weight per plan row, a group descriptor
// per buffer, a row list; twice over so a second upload within a call rarely waits.
absl::Status CudaBackend::AllocateContexts(size_t max_tokens, size_t plan_rows) {
  const size_t H = H_;
  const size_t groups = std::max(config_.num_buffers, 64);
  const size_t stage_bytes =
      2 * RoundUp(plan_rows * (2 * sizeof(int32_t) + sizeof(float)) +
                      groups * sizeof(cuda::GroupDesc) + 4 * kStageAlign,
                  kStageAlign);
  contexts_.resize(config_.contexts);
  for (Context& c : contexts_) {
    MOE_ASSIGN_OR_RETURN(c.x, AllocDevice(max_tokens * H * sizeof(bf16_t), "activations"));
    MOE_ASSIGN_OR_RETURN(c.accum, AllocDevice(max_tokens * H * sizeof(float), "accumulator"));
    MOE_ASSIGN_OR_RETURN(c.stage_dev, AllocDevice(stage_bytes, "plan staging"));
    MOE_ASSIGN_OR_RETURN(c.stage_host, AllocPinned(stage_bytes));
    c.stage_bytes = stage_bytes;
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&c.stage_event, cudaEventDisableTiming));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Init(const BackendConfig& config) {
  MOE_RETURN_IF_ERROR(CheckConfigAndDevice(config));
  config_ = config;
  if (const char* v = std::getenv("MOE_CUDA_MAPPED_WRITE_MAX_BYTES"); v != nullptr)
    mapped_write_max_bytes_ = std::strtoull(v, nullptr, 10);
  H_ = config.hidden;
  I_ = config.intermediate;
  int uva = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, device_));
  unified_addressing_ = uva != 0;
  geometry_ = GeometryOf(config);
  gemm_min_rows_ = geometry_.quantized() ? kPackedGemmMinRows : kGemmMinRows;
  layout_.format = static_cast<int>(geometry_.format);
  layout_.group = geometry_.group;
  layout_.Kh = geometry_.Kh;
  layout_.Ki = geometry_.Ki;
  layout_.gate_up_block = geometry_.block_bytes(geometry_.Kh);
  layout_.down_block = geometry_.block_bytes(geometry_.Ki);
  layout_.gate_up_bytes = geometry_.gate_up_bytes();
  layout_.bias_offset = geometry_.gate_up_bytes() + geometry_.down_bytes();
  layout_.bias_bytes = geometry_.bias_bytes();
  slot_bytes_ = ExpertBytes(geometry_);
  MOE_RETURN_IF_ERROR(CreateStreamsAndHandles());
  if (config.num_buffers > 0) {
    if (geometry_.quantized()) {
      MOE_ASSIGN_OR_RETURN(unpacked_, AllocDevice(cuda::Bf16BiasOffset(H_, I_) + geometry_.bias_bytes(), "unpacked expert"));
    } else {
      MOE_ASSIGN_OR_RETURN(staging_, AllocDevice(geometry_.packed_bytes(), "expert staging"));
    }
  }
  const size_t max_tokens = std::max(config.max_tokens, 1);
  const size_t plan_rows = max_tokens * static_cast<size_t>(config.max_top_k);
  MOE_RETURN_IF_ERROR(AllocateSharedScratch(plan_rows));
  MOE_RETURN_IF_ERROR(AllocateContexts(max_tokens, plan_rows));
  // Expert buffers last: they take what is left.
  if (config.num_buffers > 0) {
    const size_t bytes = slot_bytes_ * static_cast<size_t>(config.num_buffers);
    MOE_ASSIGN_OR_RETURN(experts_, AllocDevice(bytes, absl::StrCat(config.num_buffers, " expert buffers").c_str()));
  }
  initialized_ = true;
  if (const char* v = std::getenv("MOE_CUDA_GEMM_MIN_ROWS"); v != nullptr) {
    gemm_min_rows_ = std::max(1, std::atoi(v));
    return absl::OkStatus();
  }
  return CalibrateGemmRows();
}

// The bf16 (and mxfp4, from kMxfp4GemmProbeRows: its grouped kernels have
// no tensor cores) rows per group up to which the grouped kernels run: a call's
// worth of experts (up to 16 buffers, whatever they hold: only the time
// counts) at 128, 256, ... rows each, up to max_tokens, through the grouped
// kernels and through cuBLAS on context 0 (median of 3 after one warm-up,
// timed on the compute stream, so the host's launch pace counts too);
// gemm_min_rows_ doubles while the grouped kernels are faster. Costs a few
// milliseconds at start.
absl::Status CudaBackend::CalibrateGemmRows() {
  const bool mxfp4 = geometry_.format == WeightFormat::kMxfp4;
  const int start = mxfp4 ? kMxfp4GemmProbeRows : kGemmMinRows;
  if ((geometry_.quantized() && !mxfp4) || config_.num_buffers <= 0 || config_.contexts <= 0 ||
      config_.max_tokens <= start)
    return absl::OkStatus();
  const int max_rows = mxfp4 ? std::min(config_.max_tokens, kPackedGemmMinRows) : config_.max_tokens;
  std::vector<bf16_t> x, y;  // the probe's tokens and output, as many rows as the size being timed
  ExpertGroups g;
  const int n = std::min({config_.num_buffers, std::max(config_.max_top_k, 1), 16});
  std::vector<int32_t> buffers(n);
  for (int i = 0; i < n; ++i) buffers[i] = i;
  cudaEvent_t ev[2] = {nullptr, nullptr};
  for (cudaEvent_t& e : ev) MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  auto time = [&](int rows, int threshold) -> absl::StatusOr<double> {
    gemm_min_rows_ = threshold;
    g = ExpertGroups{};
    for (int e = 0; e < n; ++e) {
      g.expert.push_back(e);
      g.row_begin.push_back(e * rows);
      g.count.push_back(rows);
      for (int r = 0; r < rows; ++r) g.token.push_back(r), g.weight.push_back(1.f);
    }
    g.total_rows = g.total_pairs = n * rows;
    x.resize(static_cast<size_t>(rows) * H_, F32ToBf16(0.01f));
    y.resize(x.size());
    MOE_RETURN_IF_ERROR(BeginCall(0, rows, x.data(), MemoryKind::kHost));
    std::vector<double> v;
    for (int i = 0; i < 4; ++i) {
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[0], compute_));
      MOE_RETURN_IF_ERROR(RunExperts(0, HitPlan{&g, buffers.data()}));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[1], compute_));
      MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev[1]));
      float ms = 0;
      MOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, ev[0], ev[1]));
      if (i > 0) v.push_back(ms * 1e-3);
    }
    MOE_RETURN_IF_ERROR(FinishCall(0, y.data(), MemoryKind::kHost));
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  int chosen = start;
  absl::Status st;
  std::string seen;
  for (int rows = 2 * start; rows <= max_rows && st.ok(); rows *= 2) {
    absl::StatusOr<double> grouped = time(rows, rows), cublas = time(rows, rows - 1);
    if (!grouped.ok() || !cublas.ok()) {
      st = grouped.ok() ? cublas.status() : grouped.status();
      break;
    }
    absl::StrAppend(&seen, seen.empty() ? "" : ", ", rows, " rows ", absl::SixDigits(*grouped * 1e6 / n), " / ",
                    absl::SixDigits(*cublas * 1e6 / n), " us");
    if (*grouped >= *cublas) break;
    chosen = rows;
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  // mxfp4 grouped all the way: the packed kernels up to kPackedGemmMinRows, as the other formats.
  gemm_min_rows_ = mxfp4 && chosen == max_rows ? kPackedGemmMinRows : chosen;
  if (!st.ok()) return st;
  LogInfo("cuda", WeightFormatName(geometry_.format), " expert groups of up to ", gemm_min_rows_,
          " rows run in the grouped kernels, larger ones ", mxfp4 ? "dequantized to bf16 and " : "",
          "through cuBLAS (per expert, ", n, " per launch, grouped / cuBLAS: ", seen, ")");
  return absl::OkStatus();
}

size_t CudaBackend::ExpertBytes(const ExpertGeometry& g) const {
  if (g.quantized()) return RoundUp(g.packed_bytes(), kExpertAlignElems * sizeof(bf16_t));
  if (g.biases) return RoundUp(cuda::Bf16BiasOffset(g.H, g.I) + g.bias_bytes(), kExpertAlignElems * sizeof(bf16_t));
  return RoundUp(3 * static_cast<size_t>(g.I) * g.H, kExpertAlignElems) * sizeof(bf16_t);
}

absl::Status CudaBackend::EnsurePlanRows(int rows) {
  if (rows <= plan_rows_capacity_ && act_ != nullptr) return absl::OkStatus();
  // Queued kernels may still read the old buffer.
  if (act_ != nullptr) MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  act_.reset();
  const int capacity = std::max(rows, plan_rows_capacity_);
  absl::StatusOr<DeviceMem> m =
      AllocDevice(static_cast<size_t>(capacity) * I_ * sizeof(bf16_t), "intermediate activations");
  if (!m.ok()) {
    plan_rows_capacity_ = 0;
    return m.status();
  }
  act_ = std::move(*m);
  plan_rows_capacity_ = capacity;
  return absl::OkStatus();
}

absl::Status CudaBackend::RegisterHost(void* p, size_t bytes, bool read_only) {
  // Allowed before Init (the contract: a host store may be pinned first).
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (p == nullptr || bytes == 0)
    return absl::InvalidArgumentError("cuda backend: RegisterHost of an empty range");
  const cudaError_t err = cudaHostRegister(
      p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0u));
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    return absl::AlreadyExistsError(absl::StrCat(
        "cuda backend: RegisterHost(", absl::Hex(reinterpret_cast<uintptr_t>(p)), ", ", bytes,
        "): the range overlaps memory that is already registered with CUDA"));
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    const absl::Status st = CudaStatus(err, "cudaHostRegister", __FILE__, __LINE__);
    return absl::Status(st.code(), absl::StrCat("cuda backend: RegisterHost(",
                                                absl::Hex(reinterpret_cast<uintptr_t>(p)), ", ",
                                                bytes, "): ", st.message()));
  }
  registered_[p] = bytes;
  return absl::OkStatus();
}

void CudaBackend::UnregisterHost(void* p) {
  auto it = registered_.find(p);
  if (it == registered_.end()) return;
  cudaSetDevice(device_);
  // Work still in flight may read or write the range.
  if (compute_ != nullptr) cudaStreamSynchronize(compute_);
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  registered_.erase(it);
}

void* CudaBackend::MappedForKernelWrite(void* p, size_t bytes) const {
  if (bytes == 0 || bytes > mapped_write_max_bytes_) return nullptr;
  return const_cast<void*>(MappedRange(p, bytes));
}

const void* CudaBackend::MappedRange(const void* p, size_t bytes) const {
  if (bytes == 0) return nullptr;
  // Beyond the small sizes, only inside one range registered here: a range
  // over two registrations with a gap between them passes the first/last
  // check below, and an SM read of the gap would fault.
  if (bytes > mapped_write_max_bytes_) {
    auto it = registered_.upper_bound(const_cast<void*>(p));
    if (it == registered_.begin()) return nullptr;
    --it;
    const char* begin = static_cast<const char*>(it->first);
    if (static_cast<const char*>(p) < begin || static_cast<const char*>(p) + bytes > begin + it->second) return nullptr;
  }
  cudaPointerAttributes first{}, last{};
  if (cudaPointerGetAttributes(&first, p) != cudaSuccess ||
      cudaPointerGetAttributes(&last, static_cast<const char*>(p) + bytes - 1) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  if (first.type != cudaMemoryTypeHost || last.type != cudaMemoryTypeHost ||
      first.devicePointer == nullptr || last.devicePointer == nullptr ||
      static_cast<char*>(last.devicePointer) - static_cast<char*>(first.devicePointer) !=
          static_cast<std::ptrdiff_t>(bytes - 1)) {
    return nullptr;
  }
  return first.devicePointer;
}

// ---- copy queue ----------------------------------------------------------

absl::StatusOr<uint64_t> CudaBackend::LoadExpert(int buffer, const std::byte* packed,
                                                 uint64_t after_compute) {
  MOE_RETURN_IF_ERROR(Use());
  if (buffer < 0 || buffer >= config_.num_buffers || packed == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: LoadExpert buffer ", buffer,
                                                   " of ", config_.num_buffers,
                                                   packed == nullptr ? " from null" : ""));
  }
  if (!compute_fences_.Issued(after_compute)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: LoadExpert after unknown compute fence ", after_compute));
  }
  if (cudaEvent_t e = compute_fences_.Pending(after_compute); e != nullptr)
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, e, 0));
  // After the wait: the start event completes when the copy itself starts.
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(copy_starts_[copy_fences_.next() % copy_starts_.size()], copy_));
  if (geometry_.quantized()) {
    MOE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot(buffer), packed, geometry_.packed_bytes(), cudaMemcpyHostToDevice, copy_));
  } else {
    // Stream order on copy_ keeps the next copy out of staging_ until this repack read it.
    MOE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_.get(), packed, geometry_.packed_bytes(), cudaMemcpyHostToDevice, copy_));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchUnpackExpert(static_cast<const uint8_t*>(staging_.get()), layout_, H_, I_,
                                                      buffer_ptr(buffer), copy_));
  }
  return copy_fences_.Record(copy_);
}

std::optional<double> CudaBackend::CopySeconds(uint64_t copy_fence) {
  if (!initialized_ || copy_fence == 0 || !copy_fences_.Issued(copy_fence)) return std::nullopt;
  cudaEvent_t end = copy_fences_.Pending(copy_fence);
  // Too old (its events are reused) or a fence older than the ring.
  if (end == nullptr || copy_fence + copy_fences_.size() <= copy_fences_.next()) return std::nullopt;
  if (cudaEventQuery(end) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  float ms = 0;
  if (cudaEventElapsedTime(&ms, copy_starts_[copy_fence % copy_starts_.size()], end) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  return ms * 1e-3;
}

uint64_t CudaBackend::MarkCompute() {
  if (!initialized_ || !Use().ok()) return 0;
  absl::StatusOr<uint64_t> id = compute_marks_.Record(compute_);
  if (id.ok()) return *id;
  cudaGetLastError();  // a mark only times: 0 means "not timed"
  return 0;
}

std::optional<double> CudaBackend::ComputeSeconds(uint64_t from, uint64_t to) {
  if (!initialized_ || from == 0 || from >= to || !compute_marks_.Issued(to)) return std::nullopt;
  cudaEvent_t start = compute_marks_.Pending(from), end = compute_marks_.Pending(to);
  // A mark older than the ring: its event already stands for a newer one.
  if (start == nullptr || end == nullptr || from + compute_marks_.size() <= compute_marks_.next())
    return std::nullopt;
  float ms = 0;
  if (cudaEventQuery(end) != cudaSuccess || cudaEventElapsedTime(&ms, start, end) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  return ms * 1e-3;
}

// Whether the work before event `e` (null: known complete) has finished or
// failed (non-blocking; the waits report a failure).
bool EventDone(cudaEvent_t e) {
  if (e == nullptr) return true;
  const cudaError_t err = cudaEventQuery(e);
  if (err == cudaSuccess) return true;
  cudaGetLastError();
  return err != cudaErrorNotReady;
}

bool CudaBackend::CopyDone(uint64_t copy_fence) {
  if (!initialized_ || !copy_fences_.Issued(copy_fence)) return false;
  return EventDone(copy_fences_.Pending(copy_fence));  // a failed copy is "done": WaitCopy reports the error
}

absl::Status CudaBackend::WaitCopy(uint64_t copy_fence) {
  MOE_RETURN_IF_ERROR(Use());
  if (!copy_fences_.Issued(copy_fence))
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: unknown copy fence ", copy_fence));
  if (cudaEvent_t e = copy_fences_.Pending(copy_fence); e != nullptr)
    MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e));
  return absl::OkStatus();
}

// ---- compute queue -------------------------------------------------------

void CudaBackend::ComputeWaitCopy(uint64_t copy_fence) {
  if (absl::Status st = Use(); !st.ok()) return Defer(std::move(st));
  if (!copy_fences_.Issued(copy_fence)) {
    return Defer(absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ComputeWaitCopy of unknown copy fence ", copy_fence)));
  }
  cudaEvent_t e = copy_fences_.Pending(copy_fence);
  if (e == nullptr) return;
  const cudaError_t err = cudaStreamWaitEvent(compute_, e, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();
    Defer(CudaStatus(err, "cudaStreamWaitEvent(compute, copy fence)", __FILE__, __LINE__));
    // Keep the ordering promise the slow way.
    cudaEventSynchronize(e);
    cudaGetLastError();
  }
}

uint64_t CudaBackend::RecordCompute() {
  if (absl::Status st = Use(); !st.ok()) {
    Defer(std::move(st));
    return 0;
  }
  absl::StatusOr<uint64_t> id = compute_fences_.Record(compute_);
  if (id.ok()) return *id;
  Defer(id.status());
  // No event: drain the queue so that "no fence" (0) is truthful.
  cudaStreamSynchronize(compute_);
  cudaGetLastError();
  return 0;
}

absl::Status CudaBackend::WaitCompute(uint64_t compute_fence) {
  MOE_RETURN_IF_ERROR(Use());
  if (!compute_fences_.Issued(compute_fence)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: unknown compute fence ", compute_fence));
  }
  if (cudaEvent_t e = compute_fences_.Pending(compute_fence); e != nullptr)
    MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e));
  return TakeDeferred();
}

bool CudaBackend::ComputeDone(uint64_t compute_fence) {
  if (!initialized_ || !compute_fences_.Issued(compute_fence)) return true;  // WaitCompute says why
  return EventDone(compute_fences_.Pending(compute_fence));
}

absl::StatusOr<CudaBackend::Context*> CudaBackend::ActiveContext(int ctx) {
  MOE_RETURN_IF_ERROR(Use());
  if (ctx < 0 || ctx >= static_cast<int>(contexts_.size()))
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: context ", ctx, " of ",
                                                   contexts_.size()));
  Context& c = contexts_[ctx];
  if (!c.active)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: context ", ctx, " has no call (BeginCall first)"));
  MOE_RETURN_IF_ERROR(TakeDeferred());
  return &c;
}

absl::Status CudaBackend::ResetStage(Context& c) {
  // Host bytes may be rewritten once the last copy out of them has run.
  if (c.stage_event_recorded) MOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(c.stage_event));
  c.stage_event_recorded = false;
  c.stage_used = 0;
  return absl::OkStatus();
}

absl::StatusOr<CudaBackend::Upload> CudaBackend::Reserve(Context& c, size_t bytes) {
  bytes = RoundUp(std::max<size_t>(bytes, 1), kStageAlign);
  if (c.stage_used + bytes > c.stage_bytes) {
    MOE_RETURN_IF_ERROR(ResetStage(c));
    if (bytes > c.stage_bytes) {
      // Grow. Queued kernels may still read the device arena.
      MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
      const size_t grown = RoundUp(std::max(bytes, 2 * c.stage_bytes), kStageAlign);
      c.stage_dev.reset();
      c.stage_host.reset();
      c.stage_bytes = 0;
      absl::StatusOr<DeviceMem> d = AllocDevice(grown, "plan staging");
      if (!d.ok()) return d.status();
      absl::StatusOr<PinnedMem> h = AllocPinned(grown);
      if (!h.ok()) return h.status();
      c.stage_dev = std::move(*d);
      c.stage_host = std::move(*h);
      c.stage_bytes = grown;
    }
  }
  Upload u;
  u.host = static_cast<char*>(c.stage_host.get()) + c.stage_used;
  u.dev = static_cast<char*>(c.stage_dev.get()) + c.stage_used;
  u.bytes = bytes;
  c.stage_used += bytes;
  return u;
}

absl::Status CudaBackend::UploadFromHost(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                                         const void* mapped) const {
  const bool aligned = bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (aligned && mapped != nullptr) {
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchCopyFromHost(mapped, dst, bytes, stream));
  } else {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Commit(Context& c, const Upload& u) {
  // The stage is cudaHostAlloc'ed: under unified addressing its host address is its device address.
  MOE_RETURN_IF_ERROR(
      UploadFromHost(u.dev, u.host, u.bytes, compute_, unified_addressing_ ? u.host : MappedRange(u.host, u.bytes)));
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(c.stage_event, compute_));
  c.stage_event_recorded = true;
  return absl::OkStatus();
}

absl::StatusOr<const int32_t*> CudaBackend::UploadRows(Context& c, const int32_t* rows, int n) {
  absl::StatusOr<Upload> u = Reserve(c, static_cast<size_t>(n) * sizeof(int32_t));
  if (!u.ok()) return u.status();
  std::memcpy(u->host, rows, static_cast<size_t>(n) * sizeof(int32_t));
  MOE_RETURN_IF_ERROR(Commit(c, *u));
  return reinterpret_cast<const int32_t*>(u->dev);
}

absl::Status CudaBackend::CheckRows(const Context& c, const int32_t* rows, int n,
                                    const char* what) const {
  if (n < 0 || (n > 0 && rows == nullptr))
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: ", what, ": ", n, " rows"));
  for (int i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= c.T) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: ", what, ": row ", i, " is ",
                                                     rows[i], ", call has ", c.T, " tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::BeginCall(int ctx, int T, const bf16_t* hidden, MemoryKind kind) {
  MOE_RETURN_IF_ERROR(Use());
  if (ctx < 0 || ctx >= static_cast<int>(contexts_.size()))
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: context ", ctx, " of ",
                                                   contexts_.size()));
  if (T < 0 || T > std::max(config_.max_tokens, 0) || (T > 0 && hidden == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: BeginCall with ", T,
                                                   " tokens (max_tokens ", config_.max_tokens,
                                                   hidden == nullptr ? ", null input" : "", ")"));
  }
  MOE_RETURN_IF_ERROR(TakeDeferred());
  Context& c = contexts_[ctx];
  MOE_RETURN_IF_ERROR(ResetStage(c));
  c.active = false;
  if (T > 0) {
    const size_t n = static_cast<size_t>(T) * H_;
    if (kind == MemoryKind::kHost) {  // not behind queued expert copies when the caller's memory is registered
      const size_t bytes = n * sizeof(bf16_t);
      MOE_RETURN_IF_ERROR(UploadFromHost(c.x.get(), hidden, bytes, compute_, MappedRange(hidden, bytes)));
    } else {
      MOE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(c.x.get(), hidden, n * sizeof(bf16_t), cudaMemcpyDeviceToDevice, compute_));
    }
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.accum.get(), 0, n * sizeof(float), compute_));
  }
  c.T = T;
  c.active = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::RoutingToHost(const int32_t* ids, const float* weights, int n,
                                        int32_t* host_ids, float* host_weights) {
  MOE_RETURN_IF_ERROR(Use());
  if (n < 0) return absl::InvalidArgumentError("cuda backend: RoutingToHost of negative size");
  if (n == 0) return absl::OkStatus();
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_ids, ids, static_cast<size_t>(n) * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_weights, weights,
                                           static_cast<size_t>(n) * sizeof(float),
                                           cudaMemcpyDeviceToHost, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CudaBackend::GatherRows(int ctx, const int32_t* rows, int n,
                                                 bf16_t* dst) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  MOE_RETURN_IF_ERROR(CheckRows(c, rows, n, "GatherRows"));
  if (n > 0) {
    if (dst == nullptr) return absl::InvalidArgumentError("cuda backend: GatherRows into null");
    absl::StatusOr<const int32_t*> d_rows = UploadRows(c, rows, n);
    if (!d_rows.ok()) return d_rows.status();
    const bf16_t* x = static_cast<const bf16_t*>(c.x.get());
    const size_t row_bytes = static_cast<size_t>(H_) * sizeof(bf16_t);
    if (void* mapped = MappedForKernelWrite(dst, n * row_bytes); mapped != nullptr) {
      MOE_CUDA_RETURN_IF_ERROR(
          cuda::LaunchGatherRows(x, H_, *d_rows, n, static_cast<bf16_t*>(mapped), compute_));
    } else {
      bf16_t* scratch = static_cast<bf16_t*>(rows_bf16_.get());
      for (int off = 0; off < n; off += chunk_rows_) {
        const int m = std::min(chunk_rows_, n - off);
        MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(x, H_, *d_rows + off, m, scratch, compute_));
        MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + static_cast<size_t>(off) * H_, scratch,
                                                 m * row_bytes, cudaMemcpyDeviceToHost, compute_));
      }
    }
  }
  return compute_fences_.Record(compute_);
}

absl::StatusOr<uint64_t> CudaBackend::AddRows(int ctx, const int32_t* rows, int n,
                                              const bf16_t* partial) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  MOE_RETURN_IF_ERROR(CheckRows(c, rows, n, "AddRows"));
  if (n > 0) {
    if (partial == nullptr) return absl::InvalidArgumentError("cuda backend: AddRows from null");
    absl::StatusOr<const int32_t*> d_rows = UploadRows(c, rows, n);
    if (!d_rows.ok()) return d_rows.status();
    const size_t row_bytes = static_cast<size_t>(H_) * sizeof(bf16_t);
    bf16_t* scratch = static_cast<bf16_t*>(rows_bf16_.get());
    const bf16_t* mapped = static_cast<const bf16_t*>(MappedRange(partial, n * row_bytes));
    for (int off = 0; off < n; off += chunk_rows_) {
      const int m = std::min(chunk_rows_, n - off);
      const size_t at = static_cast<size_t>(off) * H_;
      MOE_RETURN_IF_ERROR(UploadFromHost(scratch, partial + at, m * row_bytes, compute_,
                                         mapped != nullptr ? mapped + at : nullptr));
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(
          scratch, *d_rows + off, m, H_, static_cast<float*>(c.accum.get()), compute_));
    }
  }
  return compute_fences_.Record(compute_);
}

// Validates the hit plan against the call (an index out of range would fault
// on the device) and splits its groups between the grouped kernels
// (small_groups_) and cuBLAS (big_groups_); returns the largest small group.
absl::StatusOr<int> CudaBackend::SplitHitGroups(const Context& c, const HitPlan& plan) {
  const ExpertGroups& gr = *plan.groups;
  const int num_groups = gr.num_groups(), plan_rows = gr.total_rows;
  if (plan_rows < 0 || gr.row_begin.size() != gr.expert.size() || gr.count.size() != gr.expert.size() ||
      gr.token.size() < static_cast<size_t>(plan_rows) || gr.weight.size() < static_cast<size_t>(plan_rows))
    return absl::InvalidArgumentError("cuda backend: RunExperts: inconsistent plan sizes");
  small_groups_.clear();
  big_groups_.clear();
  if (num_groups == 0 || plan_rows == 0) return 0;
  if (plan.buffer == nullptr) return absl::InvalidArgumentError("cuda backend: RunExperts: plan has null arrays");
  int small_max = 0;
  for (int g = 0; g < num_groups; ++g) {
    const cuda::GroupDesc d{plan.buffer[g], gr.row_begin[g], gr.count[g], 0};
    if (d.buffer < 0 || d.buffer >= config_.num_buffers || d.row_begin < 0 || d.count < 0 ||
        d.count > plan_rows - d.row_begin) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: RunExperts: group ", g, " (buffer ", d.buffer, ", rows ", d.row_begin,
          "+", d.count, ") out of range (", config_.num_buffers, " buffers, ", plan_rows,
          " rows)"));
    }
    if (d.count == 0) continue;
    if (d.count > gemm_min_rows_) {
      big_groups_.push_back(d);
    } else {
      small_groups_.push_back(d);
      small_max = std::max(small_max, d.count);
    }
  }
  for (int r = 0; r < plan_rows; ++r) {
    if (gr.token[r] < -1 || gr.token[r] >= c.T) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: RunExperts: row ", r,
                                                     " has token ", gr.token[r], ", call has ",
                                                     c.T, " tokens"));
    }
  }
  return small_max;
}

absl::Status CudaBackend::RunExperts(int ctx, const HitPlan& plan) {
  MOE_ASSIGN_OR_RETURN(Context * cs, ActiveContext(ctx));
  Context& c = *cs;
  if (plan.groups == nullptr) return absl::OkStatus();  // no hits
  const ExpertGroups& gr = *plan.groups;
  const int plan_rows = gr.total_rows;
  MOE_ASSIGN_OR_RETURN(const int small_max, SplitHitGroups(c, plan));
  if (small_groups_.empty() && big_groups_.empty()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(EnsurePlanRows(plan_rows));

  // One upload: token [rows], weight [rows], small group descriptors.
  const size_t rows = plan_rows;
  const size_t token_off = 0;
  const size_t weight_off = RoundUp(rows * sizeof(int32_t), 16);
  const size_t groups_off = weight_off + RoundUp(rows * sizeof(float), 16);
  const size_t total = groups_off + small_groups_.size() * sizeof(cuda::GroupDesc);
  MOE_ASSIGN_OR_RETURN(const Upload u, Reserve(c, total));
  std::memcpy(u.host + token_off, gr.token.data(), rows * sizeof(int32_t));
  std::memcpy(u.host + weight_off, gr.weight.data(), rows * sizeof(float));
  if (!small_groups_.empty())
    std::memcpy(u.host + groups_off, small_groups_.data(), small_groups_.size() * sizeof(cuda::GroupDesc));
  MOE_RETURN_IF_ERROR(Commit(c, u));
  const int32_t* d_token = reinterpret_cast<const int32_t*>(u.dev + token_off);
  const float* d_weight = reinterpret_cast<const float*>(u.dev + weight_off);

  if (!small_groups_.empty()) {
    cuda::GroupedExpertArgs a;
    a.hidden = H_;
    a.intermediate = I_;
    a.groups = reinterpret_cast<const cuda::GroupDesc*>(u.dev + groups_off);
    a.num_groups = static_cast<int>(small_groups_.size());
    a.max_count = small_max;
    a.token = d_token;
    a.weight = d_weight;
    a.x = static_cast<const bf16_t*>(c.x.get());
    a.act = static_cast<bf16_t*>(act_.get());
    a.accum = static_cast<float*>(c.accum.get());
    MOE_RETURN_IF_ERROR(LaunchGroups(a, compute_));
  }
  for (const cuda::GroupDesc& g : big_groups_) {
    MOE_RETURN_IF_ERROR(RunGemmGroup(c, g, d_token, d_weight));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchGroups(cuda::GroupedExpertArgs a, cudaStream_t stream) const {
  a.activation = geometry_.activation;
  a.bias_ld = geometry_.Ki;
  a.bias_offset = !geometry_.biases ? 0 : geometry_.quantized() ? layout_.bias_offset : cuda::Bf16BiasOffset(H_, I_);
  if (geometry_.quantized()) {
    const cuda::PackedSlots p{static_cast<const uint8_t*>(experts_.get()), slot_bytes_, layout_};
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchPackedGateUp(a, p, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchPackedDown(a, p, stream));
    return absl::OkStatus();
  }
  a.experts = static_cast<const bf16_t*>(experts_.get());
  a.expert_stride = slot_bytes_ / sizeof(bf16_t);
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedGateUp(a, stream));
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedDown(a, stream));
  return absl::OkStatus();
}

// One big group through cuBLAS, in pieces of at most chunk_rows_ rows:
//   xg = x[token]                       (gather)
//   gu = xg . [gate; up]^T              (one GEMM: gate and up are adjacent)
//   act = bf16(activation(gu[:, :I] + bg, gu[:, I:] + bu))
//   y = act . down^T                    (into the same f32 scratch)
//   accum[token] += weight * (y + bd)   (scatter-add; biases when the experts have them)
// cuBLAS is column-major: a row-major [r, c] matrix is a column-major [c, r]
// one, so each product is computed transposed (C^T = B^T A^T).
absl::Status CudaBackend::RunGemmGroup(Context& c, const cuda::GroupDesc& g,
                                       const int32_t* d_token, const float* d_weight) {
  const bf16_t* gate_up = buffer_ptr(g.buffer);  // [2I, H] row-major
  if (geometry_.quantized()) {  // dequantized once for all the group's pieces
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchUnpackExpert(slot(g.buffer), layout_, H_, I_,
                                                      static_cast<bf16_t*>(unpacked_.get()), compute_));
    gate_up = static_cast<const bf16_t*>(unpacked_.get());
  }
  const bf16_t* down = gate_up + 2 * static_cast<size_t>(I_) * H_;  // [H, I] row-major
  const float* bias = geometry_.biases ? reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(gate_up) +
                                                                        cuda::Bf16BiasOffset(H_, I_))
                                       : nullptr;
  bf16_t* xg = static_cast<bf16_t*>(rows_bf16_.get());
  float* f32 = static_cast<float*>(gemm_f32_.get());
  const float one = 1.f, zero = 0.f;
  for (int off = 0; off < g.count; off += chunk_rows_) {
    const int n = std::min(chunk_rows_, g.count - off);
    const int r0 = g.row_begin + off;
    bf16_t* act = static_cast<bf16_t*>(act_.get()) + static_cast<size_t>(r0) * I_;
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(static_cast<const bf16_t*>(c.x.get()), H_,
                                                    d_token + r0, n, xg, compute_));
    // gu^T [2I, n] = [gate; up] [2I, H] . xg^T [H, n]
    MOE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I_, n, H_, &one,
                                            gate_up, CUDA_R_16BF, H_, xg, CUDA_R_16BF, H_, &zero,
                                            f32, CUDA_R_32F, 2 * I_, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
    MOE_CUDA_RETURN_IF_ERROR(
        cuda::LaunchActivate(f32, n, I_, geometry_.activation, bias, geometry_.Ki, act, compute_));
    // y^T [H, n] = down [H, I] . act^T [I, n]
    MOE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, H_, n, I_, &one,
                                            down, CUDA_R_16BF, I_, act, CUDA_R_16BF, I_, &zero,
                                            f32, CUDA_R_32F, H_, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddF32(f32, d_token + r0, d_weight + r0, n, H_,
                                                       bias != nullptr ? bias + 2 * geometry_.Ki : nullptr,
                                                       static_cast<float*>(c.accum.get()),
                                                       compute_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::FinishCall(int ctx, bf16_t* out, MemoryKind kind) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  c.active = false;
  const size_t n = static_cast<size_t>(c.T) * H_;
  if (n > 0) {
    if (out == nullptr) return absl::InvalidArgumentError("cuda backend: FinishCall into null");
    const float* accum = static_cast<const float*>(c.accum.get());
    if (kind == MemoryKind::kDevice) {
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(accum, n, out, compute_));
    } else if (void* mapped = MappedForKernelWrite(out, n * sizeof(bf16_t)); mapped != nullptr) {
      MOE_CUDA_RETURN_IF_ERROR(
          cuda::LaunchAccumToBf16(accum, n, static_cast<bf16_t*>(mapped), compute_));
    } else {
      // The activations are dead now: their storage stages the output.
      bf16_t* staging = static_cast<bf16_t*>(c.x.get());
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(accum, n, staging, compute_));
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, staging, n * sizeof(bf16_t),
                                               cudaMemcpyDeviceToHost, compute_));
    }
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return TakeDeferred();
}

absl::Status CudaBackend::WaitStream(void* stream) {
  if (stream == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(engine_ready_, static_cast<cudaStream_t>(stream)));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, engine_ready_, 0));
  return absl::OkStatus();
}

absl::Status CudaBackend::SynchronizeDevice() {
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaBackend::SignalStream(void* stream) {
  if (stream == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(output_ready_, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), output_ready_, 0));
  return absl::OkStatus();
}

absl::StatusOr<CudaBackend::DeviceSite*> CudaBackend::Site(int site) {
  auto it = sites_.find(site);
  if (it != sites_.end()) return it->second.get();
  const size_t T = DeviceMaxTokens(), rows = T * config_.max_top_k, H = H_, I = I_;
  auto p = std::make_unique<DeviceSite>();
  struct DevicePart { DeviceMem* mem; size_t bytes; const char* what; };
  for (DevicePart part : {DevicePart{&p->groups, rows * sizeof(cuda::GroupDesc), "capturable groups"},
                          DevicePart{&p->row_token, rows * 4, "capturable rows"},
                          DevicePart{&p->row_weight, rows * 4, "capturable weights"},
                          DevicePart{&p->accum, T * H * 4, "capturable accumulator"},
                          DevicePart{&p->act, rows * I * 2, "capturable act"},
                          DevicePart{&p->miss_token, kMaxDeviceChannels * T * 4, "request rows"},
                          DevicePart{&p->ships, kMaxDeviceChannels * sizeof(cuda::DeviceShip), "requests"},
                          DevicePart{&p->done, kMaxDeviceChannels * 4, "ship counters"},
                          DevicePart{&p->call_seq, 4, "call sequence"}}) {
    absl::StatusOr<DeviceMem> m = AllocDevice(part.bytes, part.what);
    if (!m.ok()) return m.status();
    *part.mem = *std::move(m);
  }
  const size_t counts_bytes = static_cast<size_t>(config_.device_sites) * config_.num_experts * 4;
  if (!access_counts_) {
    MOE_ASSIGN_OR_RETURN(access_counts_, AllocDevice(counts_bytes, "access counts"));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemset(access_counts_.get(), 0, counts_bytes));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemset(p->done.get(), 0, kMaxDeviceChannels * 4));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemset(p->call_seq.get(), 0, 4));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemset(p->ships.get(), 0, kMaxDeviceChannels * sizeof(cuda::DeviceShip)));
  if (!copies_) {  // shared by the sites: their calls are ordered on one stream
    MOE_ASSIGN_OR_RETURN(copies_, AllocDevice(kMaxDeviceCopies * sizeof(cuda::DeviceCopy), "device copies"));
    MOE_ASSIGN_OR_RETURN(copy_count_, AllocDevice(sizeof(int), "device copy count"));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemset(copy_count_.get(), 0, sizeof(int)));
    if (!geometry_.quantized()) {
      MOE_ASSIGN_OR_RETURN(copy_staging_, AllocDevice(kMaxDeviceCopies * geometry_.packed_bytes(), "copy staging"));
    }
  }
  DeviceSite* raw = p.get();
  sites_[site] = std::move(p);
  return raw;
}

absl::Status CudaBackend::EnsureTableStream() {
  if (table_stream_ == nullptr) MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&table_stream_, cudaStreamNonBlocking));
  return absl::OkStatus();
}

absl::Status CudaBackend::SetHostExperts(int site, const std::vector<const std::byte*>& experts) {
  MOE_RETURN_IF_ERROR(Use());
  if (site < 0 || site >= config_.device_sites || static_cast<int>(experts.size()) != config_.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("host experts: site ", site, ", ", experts.size(), " experts"));
  MOE_RETURN_IF_ERROR(EnsureTableStream());
  const size_t E = config_.num_experts;
  if (!host_experts_) {
    MOE_ASSIGN_OR_RETURN(host_experts_, AllocDevice(config_.device_sites * E * 8, "host expert addresses"));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(host_experts_.get(), 0, config_.device_sites * E * 8, table_stream_));
  }
  std::vector<uint64_t> addr(E);
  for (size_t e = 0; e < E; ++e) {
    addr[e] = experts[e] != nullptr ? DeviceAddress(experts[e]) : 0;
    if (addr[e] == 0)
      return absl::FailedPreconditionError(absl::StrCat("host experts: expert ", e, " of site ", site,
                                                        " is not in memory registered with the device"));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint64_t*>(host_experts_.get()) + site * E, addr.data(), E * 8,
                                           cudaMemcpyHostToDevice, table_stream_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(table_stream_));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::ProbeDeviceCopy(const std::byte* packed) {
  MOE_RETURN_IF_ERROR(Use());
  MOE_RETURN_IF_ERROR(EnsureTableStream());
  const uint64_t src = packed != nullptr ? DeviceAddress(packed) : 0;
  const size_t bytes = geometry_.packed_bytes() / 16 * 16;
  if (src == 0 || bytes == 0) return absl::FailedPreconditionError("device copy probe: expert not in registered memory");
  MOE_ASSIGN_OR_RETURN(DeviceMem dst, AllocDevice(bytes, "device copy probe"));
  cudaEvent_t ev[2] = {nullptr, nullptr};
  for (cudaEvent_t& e : ev) MOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  double best = 0;
  absl::Status st;
  for (int rep = 0; rep < 3 && st.ok(); ++rep) {
    st.Update(CudaStatus(cudaEventRecord(ev[0], table_stream_), "cudaEventRecord", __FILE__, __LINE__));
    st.Update(CudaStatus(cuda::LaunchCopyFromHost(reinterpret_cast<const void*>(src), dst.get(), bytes, table_stream_),
                         "LaunchCopyFromHost", __FILE__, __LINE__));
    st.Update(CudaStatus(cudaEventRecord(ev[1], table_stream_), "cudaEventRecord", __FILE__, __LINE__));
    float ms = 0;
    if (st.ok()) st.Update(CudaStatus(cudaEventSynchronize(ev[1]), "cudaEventSynchronize", __FILE__, __LINE__));
    if (st.ok()) st.Update(CudaStatus(cudaEventElapsedTime(&ms, ev[0], ev[1]), "cudaEventElapsedTime", __FILE__, __LINE__));
    if (st.ok() && (rep == 0 || ms * 1e-3 < best)) best = ms * 1e-3;
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  if (!st.ok()) return st;
  return best;
}

absl::Status CudaBackend::SetDeviceChannels(const DeviceChannel* channels, int n) {
  MOE_RETURN_IF_ERROR(Use());
  if (n < 0 || n > kMaxDeviceChannels) return absl::InvalidArgumentError(absl::StrCat("device channels: ", n));
  if (!channels_) {
    MOE_ASSIGN_OR_RETURN(channels_, AllocDevice(kMaxDeviceChannels * sizeof(DeviceChannel), "device channels"));
    MOE_ASSIGN_OR_RETURN(channel_state_, AllocDevice(kMaxDeviceChannels * sizeof(cuda::DeviceChannelState), "channel state"));
    MOE_RETURN_IF_ERROR(EnsureTableStream());
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(channels_.get(), 0, kMaxDeviceChannels * sizeof(DeviceChannel), table_stream_));
    MOE_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(channel_state_.get(), 0, kMaxDeviceChannels * sizeof(cuda::DeviceChannelState), table_stream_));
  }
  if (n > 0)
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(channels_.get(), channels, n * sizeof(DeviceChannel), cudaMemcpyHostToDevice,
                                             table_stream_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(table_stream_));
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaBackend::AllocMapped(size_t bytes) {
  MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* p = nullptr;
  MOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, bytes);
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, p, 0) != cudaSuccess || dev != p) {
    cudaGetLastError();
    cudaFreeHost(p);
    return absl::FailedPreconditionError(
        "cuda backend: mapped host memory has another address on the device (no unified addressing)");
  }
  mapped_[p] = bytes;
  return p;
}

void CudaBackend::FreeMapped(void* p) {
  if (mapped_.erase(p) == 0) return;
  cudaSetDevice(device_);
  cudaFreeHost(p);
}

uint64_t CudaBackend::DeviceAddress(const void* p) const {
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, const_cast<void*>(p), 0) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return reinterpret_cast<uint64_t>(dev);
}

absl::Status CudaBackend::ReadAccessCounts(std::vector<uint32_t>* counts) {
  counts->clear();
  if (!access_counts_) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  counts->resize(static_cast<size_t>(config_.device_sites) * config_.num_experts);
  // On the copy stream: never ordered behind the engine's stream (a graph
  // replay in flight may or may not be counted yet).
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts->data(), access_counts_.get(), counts->size() * 4,
                                           cudaMemcpyDeviceToHost, copy_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_));
  return absl::OkStatus();
}

bool CudaBackend::StreamCapturing(void* stream) const {
  if (stream == nullptr) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return capture != cudaStreamCaptureStatusNone;
}

// The kernels' view of one device-planned call at `site`.
cuda::DevicePlanArgs CudaBackend::PlanArgs(const DevicePlannedCall& call, DeviceSite& site) {
  cuda::DevicePlanArgs d;
  d.T = call.T;
  d.k = call.k;
  d.hidden = H_;
  d.num_experts = config_.num_experts;
  d.layer = call.layer;
  d.num_channels = call.num_channels;
  d.ids = call.ids;
  d.weights = call.weights;
  d.x = call.hidden;
  d.tables = call.tables;
  d.channels = static_cast<const DeviceChannel*>(channels_.get());
  d.channel_state = static_cast<cuda::DeviceChannelState*>(channel_state_.get());
  d.counts = call.count_accesses
                 ? static_cast<unsigned int*>(access_counts_.get()) + static_cast<size_t>(call.site) * config_.num_experts
                 : nullptr;
  d.groups = static_cast<cuda::GroupDesc*>(site.groups.get());
  d.row_token = static_cast<int32_t*>(site.row_token.get());
  d.row_weight = static_cast<float*>(site.row_weight.get());
  d.miss_token = static_cast<int32_t*>(site.miss_token.get());
  d.ships = static_cast<cuda::DeviceShip*>(site.ships.get());
  d.done = static_cast<unsigned int*>(site.done.get());
  d.call_seq = static_cast<unsigned int*>(site.call_seq.get());
  d.accum = static_cast<float*>(site.accum.get());
  d.timeout_ns = static_cast<uint64_t>(std::max<int64_t>(call.timeout.count(), 1));
  const bool copies = call.copy_plan != nullptr && host_experts_ && call.copy_buffer_base >= 0 &&
                      geometry_.packed_bytes() % 16 == 0 &&
                      call.copy_buffer_base + kMaxDeviceCopies <= config_.num_buffers;
  if (copies) {
    d.copy_table = call.copy_plan->copy_count;
    d.host_experts = static_cast<const uint64_t*>(host_experts_.get()) + static_cast<size_t>(call.site) * config_.num_experts;
    d.max_copies = kMaxDeviceCopies;
    d.copy_buffer_base = call.copy_buffer_base;
    d.packed_bytes = geometry_.packed_bytes();
    if (geometry_.quantized()) {  // the slots hold the packed bytes as they are
      d.copy_dst = slot(call.copy_buffer_base);
      d.copy_dst_stride = slot_bytes_;
    } else {
      d.copy_dst = static_cast<uint8_t*>(copy_staging_.get());
      d.copy_dst_stride = geometry_.packed_bytes();
    }
  }
  d.layout = layout_;
  d.activation = geometry_.activation;
  d.intermediate = I_;
  d.copies = static_cast<cuda::DeviceCopy*>(copies_.get());
  d.copy_count = static_cast<int*>(copy_count_.get());
  return d;
}

absl::Status CudaBackend::EnqueueDevicePlanned(const DevicePlannedCall& call) {
  MOE_RETURN_IF_ERROR(Use());
  if (call.stream == nullptr) return absl::InvalidArgumentError("cuda_stream: a capturable call needs the engine's stream");
  if (call.T < 1 || call.T > DeviceMaxTokens() || call.k < 1 || call.k > config_.max_top_k)
    return absl::InvalidArgumentError(absl::StrCat("tokens/top_k: ", call.T, " x ", call.k, " is outside [1, ",
                                                   DeviceMaxTokens(), "] x [1, ", config_.max_top_k, "]"));
  if (call.hidden == nullptr || call.ids == nullptr || call.weights == nullptr || call.out == nullptr)
    return absl::InvalidArgumentError("hidden/topk_ids/topk_weights/out: null pointer");
  if (call.site < 0 || call.site >= config_.device_sites)
    return absl::InvalidArgumentError(absl::StrCat("capturable call: site ", call.site, " outside [0, ",
                                                   config_.device_sites, ")"));
  if (call.tables.buffer_of == nullptr || call.tables.channel_of == nullptr || call.tables.errors == nullptr ||
      call.num_channels < 0 || call.num_channels > kMaxDeviceChannels || (call.num_channels > 0 && !channels_))
    return absl::InvalidArgumentError("capturable call: routing tables missing (SetDeviceChannels first)");
  cudaStream_t stream = static_cast<cudaStream_t>(call.stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone && sites_.count(call.site) == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "capturable call: layer ", call.layer, " was never run outside a capture (warm up once before capturing)"));
  MOE_ASSIGN_OR_RETURN(DeviceSite * site, Site(call.site));
  const size_t rows = static_cast<size_t>(call.T) * call.k, n = static_cast<size_t>(call.T) * H_;
  const cuda::DevicePlanArgs d = PlanArgs(call, *site);
  const bool copies = d.max_copies > 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d.accum, 0, n * sizeof(float), stream));
  // The split, then the misses shipped before the hits run.
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchDevicePlan(d, stream));
  if (copies && !geometry_.quantized())
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchUnpackExperts(d.copy_dst, d.copy_dst_stride, layout_, H_, I_,
                                                       buffer_ptr(call.copy_buffer_base), slot_bytes_ / sizeof(bf16_t),
                                                       d.copy_count, kMaxDeviceCopies, stream));
  cuda::GroupedExpertArgs a;
  a.hidden = H_;
  a.intermediate = I_;
  a.groups = d.groups;
  a.num_groups = static_cast<int>(rows);
  a.max_count = call.T;  // an expert has at most one row per token
  a.exact_groups = false;
  a.token = d.row_token;
  a.weight = d.row_weight;
  a.x = call.hidden;
  a.act = static_cast<bf16_t*>(site->act.get());
  a.accum = d.accum;
  MOE_RETURN_IF_ERROR(LaunchGroups(a, stream));
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchDeviceCombine(d, stream));
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(d.accum, n, call.out, stream));
  return absl::OkStatus();
}

bool DeviceCount(int* count, std::string* why) {
  *count = 0;
  const cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why != nullptr)
      *why = std::string(CudaStatus(err, "cudaGetDeviceCount", __FILE__, __LINE__).message());
    *count = 0;
    return false;
  }
  if (*count == 0) {
    if (why != nullptr) *why = "cudaGetDeviceCount reports no CUDA device";
    return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<DeviceBackend> MakeCudaBackend(std::string* why) {
  int count = 0;
  std::string reason;
  if (!DeviceCount(&count, &reason)) {
    if (why != nullptr) *why = reason;
    return nullptr;
  }
  // The creating thread's current GPU (Init may name another): what an
  // engine that called cudaSetDevice / torch.cuda.set_device means.
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = 0;
  }
  return std::make_unique<CudaBackend>(current);
}

bool CudaAvailable() {
  int count = 0;
  return DeviceCount(&count, nullptr);
}

}  // namespace moe
