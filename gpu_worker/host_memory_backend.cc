// HostMemoryBackend, the cpu DeviceBackend (--device cpu): expert buffers in host memory, in the packed layout
// the host copy already holds (a copy is a memcpy) and computed by the same MoeExecutor + ExpertKernel the CPU
// expert server runs. Every call executes synchronously, so every fence it
// returns is already complete.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/cpu_features.h"
#include "expert_compute/expert_kernel.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/moe_executor.h"
#include "expert_compute/numa_binding.h"
#include "gpu_worker/device_backend.h"

namespace moe {
namespace {

// The backend's buffers seen as one "layer 0" whose expert ids are buffer indexes.
class BufferSet : public PackedExperts {
 public:
  ~BufferSet() override { std::free(base_); }
  absl::Status Allocate(const ExpertGeometry& g, int n) {
    geometry_ = g;
    stride_ = Stride(g);
    count_ = n;
    const size_t bytes = std::max<size_t>(stride_ * static_cast<size_t>(n), 64);
    base_ = static_cast<std::byte*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    if (base_ == nullptr)
      return absl::ResourceExhaustedError(absl::StrCat("cpu backend: cannot allocate ", bytes,
                                                       " bytes for ", n, " expert buffers"));
    // Resident from the start, as device memory is: no first-touch page
    // faults in a call, and a buffer first used late (the copy-instead
    // buffers) does not show up as growth of a long-running worker.
    std::memset(base_, 0, bytes);
    loaded_.assign(n, false);
    return absl::OkStatus();
  }
  static size_t Stride(const ExpertGeometry& g) { return (g.packed_bytes() + 63) / 64 * 64; }
  std::byte* Buffer(int b) { return base_ + stride_ * b; }
  void MarkLoaded(int b) { loaded_[b] = true; }
  size_t stride() const { return stride_; }

  const ExpertGeometry& geometry() const override { return geometry_; }
  const std::byte* Find(int layer, int expert) const override {
    return layer == 0 && expert >= 0 && expert < count_ && loaded_[expert] ? base_ + stride_ * expert
                                                                           : nullptr;
  }
  bool HostsLayer(int layer) const override { return layer == 0; }
  bool HostsExpert(int expert) const override {
    return expert >= 0 && expert < count_ && loaded_[expert];
  }
  int num_experts() const override { return count_; }

 private:
  ExpertGeometry geometry_;
  std::byte* base_ = nullptr;
  size_t stride_ = 0;
  int count_ = 0;
  std::vector<bool> loaded_;
};

class HostMemoryBackend final : public DeviceBackend {
 public:
  const char* name() const override { return "cpu"; }
  bool has_device_memory() const override { return false; }
  size_t ExpertBytes(const ExpertGeometry& g) const override { return BufferSet::Stride(g); }
  size_t free_memory_bytes() const override { return AvailableMemoryBytes(); }
  int hit_row_align() const override { return executor_ ? executor_->row_align() : 1; }

  absl::Status Init(const BackendConfig& c) override {
    if (c.hidden <= 0 || c.intermediate <= 0)
      return absl::InvalidArgumentError("hidden/intermediate: must be positive");
    if (c.num_buffers < 0 || c.max_tokens < 0 || c.max_top_k <= 0 || c.contexts <= 0)
      return absl::InvalidArgumentError("backend config: negative sizes");
    config_ = c;
    MOE_ASSIGN_OR_RETURN(kernel_, MakeExpertKernel(c.cpu_kernel, CpuFeatures::Get(), c.format));
    MOE_RETURN_IF_ERROR(buffers_.Allocate(GeometryOf(c), c.num_buffers));
    MOE_ASSIGN_OR_RETURN(binding_, NumaBinding::Create("auto", c.cpu_threads, false, 0, 1, "cpu_threads (--cpu-threads)"));
    pool_ = std::make_unique<ComputePool>(*binding_);
    executor_ = std::make_unique<MoeExecutor>(buffers_, *kernel_, *pool_);
    contexts_.resize(c.contexts);
    for (Context& ctx : contexts_) {
      ctx.x.resize(static_cast<size_t>(c.max_tokens) * c.hidden);
      ctx.accum.resize(static_cast<size_t>(c.max_tokens) * c.hidden);
      ctx.partial.resize(static_cast<size_t>(c.max_tokens) * c.hidden);
    }
    return absl::OkStatus();
  }

  absl::Status RegisterHost(void*, size_t, bool) override { return absl::OkStatus(); }
  void UnregisterHost(void*) override {}

  absl::StatusOr<uint64_t> LoadExpert(int buffer, const std::byte* packed, uint64_t) override {
    if (buffer < 0 || buffer >= config_.num_buffers || packed == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("buffer: ", buffer, packed == nullptr ? " from null" : " out of range"));
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(buffers_.Buffer(buffer), packed, buffers_.geometry().packed_bytes());
    buffers_.MarkLoaded(buffer);
    const uint64_t fence = ++copy_fence_;
    copy_times_[fence % copy_times_.size()] = {
        fence, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
    return fence;
  }
  bool CopyDone(uint64_t) override { return true; }
  absl::Status WaitCopy(uint64_t) override { return absl::OkStatus(); }
  std::optional<double> CopySeconds(uint64_t fence) override {
    const auto& [f, seconds] = copy_times_[fence % copy_times_.size()];
    if (fence == 0 || f != fence) return std::nullopt;
    return seconds;
  }
  void ComputeWaitCopy(uint64_t) override {}
  uint64_t RecordCompute() override { return ++compute_fence_; }
  absl::Status WaitCompute(uint64_t) override { return absl::OkStatus(); }
  bool ComputeDone(uint64_t) override { return true; }
  // Compute is synchronous here: the time between two marks is the work's.
  uint64_t MarkCompute() override {
    const uint64_t id = ++mark_;
    marks_[id % marks_.size()] = {id, std::chrono::steady_clock::now()};
    return id;
  }
  std::optional<double> ComputeSeconds(uint64_t from, uint64_t to) override {
    const auto& [f0, t0] = marks_[from % marks_.size()];
    const auto& [f1, t1] = marks_[to % marks_.size()];
    if (from == 0 || from >= to || f0 != from || f1 != to) return std::nullopt;
    return std::chrono::duration<double>(t1 - t0).count();
  }

  absl::Status BeginCall(int c, int T, const bf16_t* hidden, MemoryKind kind) override {
    MOE_RETURN_IF_ERROR(CheckCall(c, T));
    if (kind != MemoryKind::kHost)
      return absl::InvalidArgumentError("hidden: the cpu backend has no device memory");
    Context& ctx = contexts_[c];
    ctx.T = T;
    const size_t n = static_cast<size_t>(T) * config_.hidden;
    if (n) std::memcpy(ctx.x.data(), hidden, n * sizeof(bf16_t));
    std::fill_n(ctx.accum.begin(), n, 0.0f);
    return absl::OkStatus();
  }

  absl::Status RoutingToHost(const int32_t*, const float*, int, int32_t*, float*) override {
    return absl::InvalidArgumentError("expert_ids: the cpu backend has no device memory");
  }

  absl::StatusOr<uint64_t> GatherRows(int c, const int32_t* rows, int n, bf16_t* dst) override {
    const Context& ctx = contexts_[c];
    const int H = config_.hidden;
    for (int i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= ctx.T)
        return absl::InvalidArgumentError(absl::StrCat("rows[", i, "]: ", rows[i], " out of range"));
      std::memcpy(dst + static_cast<size_t>(i) * H, ctx.x.data() + static_cast<size_t>(rows[i]) * H,
                  H * sizeof(bf16_t));
    }
    return ++compute_fence_;
  }

  absl::Status RunExperts(int c, const HitPlan& plan) override {
    Context& ctx = contexts_[c];
    if (plan.groups == nullptr || plan.groups->num_groups() == 0 || ctx.T == 0) return absl::OkStatus();
    if (plan.buffer == nullptr) return absl::InvalidArgumentError("cpu backend: RunExperts: plan has no buffers");
    // The groups as they are; the buffers are the experts of "layer 0".
    ForwardStats stats;
    MOE_RETURN_IF_ERROR(executor_->Run(0, ctx.T, ctx.x.data(), *plan.groups, plan.buffer, DType::kF32,
                                       ctx.partial.data(), &stats));
    const size_t n = static_cast<size_t>(ctx.T) * config_.hidden;
    for (size_t i = 0; i < n; ++i) ctx.accum[i] += ctx.partial[i];
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> AddRows(int c, const int32_t* rows, int n, const bf16_t* partial) override {
    Context& ctx = contexts_[c];
    const int H = config_.hidden;
    for (int i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= ctx.T)
        return absl::InvalidArgumentError(absl::StrCat("rows[", i, "]: ", rows[i], " out of range"));
      float* acc = ctx.accum.data() + static_cast<size_t>(rows[i]) * H;
      const bf16_t* p = partial + static_cast<size_t>(i) * H;
      for (int h = 0; h < H; ++h) acc[h] += Bf16ToF32(p[h]);
    }
    return ++compute_fence_;
  }

  absl::Status FinishCall(int c, bf16_t* out, MemoryKind kind) override {
    if (kind != MemoryKind::kHost)
      return absl::InvalidArgumentError("out: the cpu backend has no device memory");
    Context& ctx = contexts_[c];
    const size_t n = static_cast<size_t>(ctx.T) * config_.hidden;
    if (out != nullptr)
      for (size_t i = 0; i < n; ++i) out[i] = F32ToBf16(ctx.accum[i]);
    ctx.T = 0;
    return absl::OkStatus();
  }

 private:
  struct Context {
    int T = 0;
    std::vector<bf16_t> x;
    std::vector<float> accum, partial;
  };
  absl::Status CheckCall(int c, int T) const {
    if (c < 0 || c >= static_cast<int>(contexts_.size()))
      return absl::InvalidArgumentError(absl::StrCat("context: ", c, " out of range"));
    if (T < 0 || T > config_.max_tokens)
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: ", T, " tokens, the backend was sized for ", config_.max_tokens));
    return absl::OkStatus();
  }

  BackendConfig config_;
  BufferSet buffers_;
  std::unique_ptr<ExpertKernel> kernel_;
  std::unique_ptr<NumaBinding> binding_;
  std::unique_ptr<ComputePool> pool_;
  std::unique_ptr<MoeExecutor> executor_;
  std::vector<Context> contexts_;
  uint64_t copy_fence_ = 0, compute_fence_ = 0;
  std::array<std::pair<uint64_t, double>, 64> copy_times_{};  // fence % 64 -> (fence, seconds)
  uint64_t mark_ = 0;
  std::array<std::pair<uint64_t, std::chrono::steady_clock::time_point>, 64> marks_{};  // id % 64 -> (id, when)
};

}  // namespace

std::unique_ptr<DeviceBackend> MakeHostMemoryBackend() { return std::make_unique<HostMemoryBackend>(); }

}  // namespace moe
