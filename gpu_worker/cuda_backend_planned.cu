// CudaBackend (gpu_worker/cuda/cuda_backend_impl.h; design: cuda_backend.cu):
// device-planned calls — per-site buffers, the host copy's experts for
// copy-instead, the channels, host-mapped memory, access counts — and
// EnqueueDevicePlanned, which launches the plan kernel, the shipping, the
// grouped hits and the combine on the engine's stream.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"

namespace moe {
namespace cuda_backend_impl {

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
    const size_t totals_bytes = static_cast<size_t>(config_.device_sites) * kDeviceTotals * 8;
    MOE_ASSIGN_OR_RETURN(call_totals_, AllocDevice(totals_bytes, "call totals"));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemset(call_totals_.get(), 0, totals_bytes));
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

absl::Status CudaBackend::ReadCallTotals(std::vector<uint64_t>* totals) {
  totals->clear();
  if (!call_totals_) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  totals->resize(static_cast<size_t>(config_.device_sites) * kDeviceTotals);
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(totals->data(), call_totals_.get(), totals->size() * 8,
                                           cudaMemcpyDeviceToHost, copy_));  // as ReadAccessCounts
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_));
  return absl::OkStatus();
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
  d.totals = call.count_accesses
                 ? static_cast<unsigned long long*>(call_totals_.get()) + static_cast<size_t>(call.site) * kDeviceTotals
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

}  // namespace cuda_backend_impl
}  // namespace moe
