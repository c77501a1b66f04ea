// The cuda DeviceBackend (contract: device_backend.h). Host orchestration
// only; the kernels live in gpu_worker/cuda/ (declared in kernels.h: the bf16
// grouped kernels in expert_kernels.cu, the packed int8/int4/fp8 ones in
// packed_kernels.cu, the capturable call's plan in device_plan.cu). Its files:
// this one (the design, Init, memory, expert copies, fences, staging, the
// factory), cuda_backend_calls.cu (the host path's calls and RunExperts),
// cuda_backend_planned.cu (device-planned calls), over the class in
// gpu_worker/cuda/cuda_backend_impl.h.
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
// while DeepSeek-V3's experts are faster through cuBLAS from 128 rows. int8 / int4 / fp8 / mxfp4
// slots take the same shape through cuda/packed_kernels.cu (tensor cores, on
// the packed bytes) up to kPackedGemmMinRows rows.
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

#include "gpu_worker/cuda/cuda_backend_impl.h"

namespace moe {
namespace cuda_backend_impl {

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

// The bf16 rows per group up to which the grouped kernels run: a call's
// worth of experts (up to 16 buffers, whatever they hold: only the time
// counts) at 128, 256, ... rows each, up to max_tokens, through the grouped
// kernels and through cuBLAS on context 0 (median of 3 after one warm-up,
// timed on the compute stream, so the host's launch pace counts too);
// gemm_min_rows_ doubles while the grouped kernels are faster. Costs a few
// milliseconds at start.
absl::Status CudaBackend::CalibrateGemmRows() {
  if (geometry_.quantized() || config_.num_buffers <= 0 || config_.contexts <= 0 || config_.max_tokens <= kGemmMinRows)
    return absl::OkStatus();
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
  int chosen = kGemmMinRows;
  absl::Status st;
  std::string seen;
  for (int rows = 2 * kGemmMinRows; rows <= config_.max_tokens && st.ok(); rows *= 2) {
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
  gemm_min_rows_ = chosen;
  if (!st.ok()) return st;
  LogInfo("cuda", WeightFormatName(geometry_.format), " expert groups of up to ", gemm_min_rows_,
          " rows run in the grouped kernels, larger ones through cuBLAS (per expert, ", n,
          " per launch, grouped / cuBLAS: ", seen, ")");
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

}  // namespace cuda_backend_impl

using cuda_backend_impl::CudaBackend;
using cuda_backend_impl::DeviceCount;

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
