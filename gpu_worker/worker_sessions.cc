// WorkerSessions (gpu_worker/worker_sessions.h).
#include "gpu_worker/worker_sessions.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

#ifdef MOE_HAVE_NCCL
#include <cuda_runtime.h>  // cudaMalloc for typed pointers

#include "gpu_worker/cuda/cuda_check.h"
#endif

namespace moe {

// A group rank's staging: its GPU, stream and device buffers for one
// micro-batch share.
struct WorkerSessions::Rank {
  int device = 0, max_tokens = 0;
#ifdef MOE_HAVE_NCCL
  cudaStream_t stream = nullptr;
  bf16_t *x = nullptr, *out = nullptr;
  int32_t* ids = nullptr;
  float* w = nullptr;

  absl::Status Allocate(int hidden, int max_top_k) {
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const size_t rows = static_cast<size_t>(std::max(max_tokens, 1));
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&x, rows * hidden * sizeof(bf16_t)));
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&out, rows * hidden * sizeof(bf16_t)));
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&ids, rows * max_top_k * sizeof(int32_t)));
    MOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&w, rows * max_top_k * sizeof(float)));
    return absl::OkStatus();
  }
  ~Rank() {
    cudaSetDevice(device);
    for (void* p : {static_cast<void*>(x), static_cast<void*>(out), static_cast<void*>(ids), static_cast<void*>(w)})
      if (p != nullptr) cudaFree(p);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Tokens [t0, t0 + n) of the micro-batch through `s` on this GPU.
  absl::Status Forward(MoeSession& s, int layer, int n, int k, int hidden, const bf16_t* x_h, const int32_t* ids_h,
                       const float* w_h, bf16_t* out_h, CallStats* stats) {
    MOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    if (n > 0) {
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x, x_h, sizeof(bf16_t) * n * hidden, cudaMemcpyHostToDevice, stream));
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids, ids_h, sizeof(int32_t) * n * k, cudaMemcpyHostToDevice, stream));
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(w, w_h, sizeof(float) * n * k, cudaMemcpyHostToDevice, stream));
    }
    MOE_RETURN_IF_ERROR(s.ForwardLayer(layer, n, k, x, ids, w, out, MemoryKind::kDevice, stats, stream));
    if (n > 0)
      MOE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(out_h, out, sizeof(bf16_t) * n * hidden, cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
#endif
};

WorkerSessions::~WorkerSessions() {
  sessions_.clear();  // each waits for its last call on its rank's stream
  ranks_.clear();
}

absl::StatusOr<std::unique_ptr<WorkerSessions>> WorkerSessions::Open(const SessionOptions& o, int gpus) {
  std::unique_ptr<WorkerSessions> w(new WorkerSessions());
  if (gpus <= 1) {
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<MoeSession> s, MoeSession::Open(o));
    w->sessions_.push_back(std::move(s));
    return w;
  }
#ifndef MOE_HAVE_NCCL
  return absl::FailedPreconditionError(absl::StrCat("gpus: ", gpus, " GPUs need NCCL, and this build has none"));
#else
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess) visible = 0;
  if (gpus > visible)
    return absl::FailedPreconditionError(absl::StrCat("gpus: ", gpus, " asked, ", visible, " CUDA GPU(s) visible"));
  if (o.group.size > 1)
    return absl::InvalidArgumentError("gpus: a multi-GPU worker is its own group (not with --tp-size)");
  if (o.device == DeviceChoice::kCpu) return absl::InvalidArgumentError("gpus: a multi-GPU worker needs the cuda device backend");
  MOE_ASSIGN_OR_RETURN(const std::string id, MoeSession::NewGroupId());
  const int per_gpu = (o.max_tokens + gpus - 1) / gpus;
  w->sessions_.resize(gpus);
  std::vector<absl::Status> opened(gpus);
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r)
    threads.emplace_back([&, r] {  // collective: the ranks open together
      SessionOptions ro = o;
      ro.device = DeviceChoice::kCuda;
      ro.cuda_device = r;
      ro.max_tokens = per_gpu;
      ro.group.rank = r;
      ro.group.size = gpus;
      ro.group.mode = GroupMode::kExpert;
      ro.group.id = id;
      absl::StatusOr<std::unique_ptr<MoeSession>> s = MoeSession::Open(ro);
      if (s.ok()) w->sessions_[r] = *std::move(s);
      else opened[r] = s.status();
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < gpus; ++r)
    if (!opened[r].ok()) return absl::Status(opened[r].code(), absl::StrCat("GPU ", r, ": ", opened[r].message()));
  for (int r = 0; r < gpus; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->device = r;
    rank->max_tokens = per_gpu;
    MOE_RETURN_IF_ERROR(rank->Allocate(w->sessions_[r]->model_info().hidden, o.max_top_k));
    w->ranks_.push_back(std::move(rank));
  }
  return w;
#endif
}

absl::Status WorkerSessions::Forward(int layer, int T, int k, const bf16_t* hidden, const int32_t* topk_ids,
                                     const float* topk_weights, bf16_t* out, CallStats* stats) {
  if (ranks_.empty())
    return primary().ForwardLayer(layer, T, k, hidden, topk_ids, topk_weights, out, MemoryKind::kHost, stats);
#ifdef MOE_HAVE_NCCL
  const int N = size(), H = primary().model_info().hidden;
  const int per = (T + N - 1) / N;
  if (per > ranks_[0]->max_tokens)
    return absl::InvalidArgumentError(absl::StrCat("T: ", T, " tokens exceed max_tokens ", ranks_[0]->max_tokens * N));
  std::vector<absl::Status> status(N);
  std::vector<CallStats> st(N);
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r)
    threads.emplace_back([&, r] {  // every rank calls, its share possibly empty
      const int t0 = std::min(T, r * per), n = std::min(T, t0 + per) - t0;
      const size_t row = static_cast<size_t>(t0);
      status[r] = ranks_[r]->Forward(*sessions_[r], layer, n, k, H, hidden + row * H, topk_ids + row * k,
                                     topk_weights + row * k, out + row * H, &st[r]);
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < N; ++r)
    if (!status[r].ok()) return status[r];
  if (stats != nullptr) {
    *stats = CallStats{};
    for (const CallStats& s : st) {
      stats->hit_pairs += s.hit_pairs;
      stats->cpu_pairs += s.cpu_pairs;
      stats->cpu_experts += s.cpu_experts;
      stats->copied_pairs += s.copied_pairs;
      stats->copied_experts += s.copied_experts;
      stats->prefetched_pairs += s.prefetched_pairs;
      stats->prefetched_experts += s.prefetched_experts;
      stats->miss_tokens += s.miss_tokens;
      stats->failovers += s.failovers;
      stats->bytes_shipped += s.bytes_shipped;
      stats->seconds = std::max(stats->seconds, s.seconds);  // the GPUs' calls run side by side
      stats->submit_seconds = std::max(stats->submit_seconds, s.submit_seconds);
      stats->wait_seconds = std::max(stats->wait_seconds, s.wait_seconds);
    }
  }
  return absl::OkStatus();
#else
  return absl::InternalError("a multi-GPU worker without NCCL");
#endif
}

absl::Status WorkerSessions::ApplyAssignment(int layer, const std::vector<int>& experts,
                                             const std::vector<int>& pinned) {
  if (size() == 1) return primary().admin().ApplyAssignment(layer, experts, pinned);
  const int N = size();
  for (int r = 0; r < N; ++r) {
    std::vector<int> mine, my_pins;
    for (int e : experts)
      if (ExpertOwner(layer, e, N) == r && static_cast<int>(mine.size()) < sessions_[r]->admin().slots_per_layer())
        mine.push_back(e);
    for (int e : pinned)
      if (std::find(mine.begin(), mine.end(), e) != mine.end()) my_pins.push_back(e);
    MOE_RETURN_IF_ERROR(sessions_[r]->admin().ApplyAssignment(layer, mine, my_pins));
  }
  return absl::OkStatus();
}

absl::Status WorkerSessions::SetServerEnabled(const std::string& address, bool enabled) {
  for (auto& s : sessions_) MOE_RETURN_IF_ERROR(s->admin().SetServerEnabled(address, enabled));
  return absl::OkStatus();
}

int WorkerSessions::PendingCopies() {
  int n = 0;
  for (auto& s : sessions_) n += s->admin().PendingCopies();
  return n;
}

uint64_t WorkerSessions::copies_started() const {
  uint64_t n = 0;
  for (const auto& s : sessions_) n += s->admin().copies_started();
  return n;
}

int WorkerSessions::slots_per_layer() const {
  int n = 0;
  for (const auto& s : sessions_) n += s->admin().slots_per_layer();
  return n;
}

std::vector<int> WorkerSessions::CachedExperts(int layer) const {
  std::vector<int> all;
  for (const auto& s : sessions_) {
    const std::vector<int> e = s->admin().CachedExperts(layer);
    all.insert(all.end(), e.begin(), e.end());
  }
  return all;
}

double WorkerSessions::HitRate(int layer) const {
  double sum = 0;
  for (const auto& s : sessions_) sum += s->admin().HitRate(layer);
  return sum / size();
}

}  // namespace moe
