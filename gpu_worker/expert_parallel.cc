// ExpertParallel (gpu_worker/expert_parallel.h): the token exchange of an
// expert-parallel group, NCCL send/recv around this rank's dispatcher.
#include "gpu_worker/expert_parallel.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "model/routing.h"
#include "core/status_macros.h"
#include "gpu_worker/cuda/cuda_check.h"
#include "gpu_worker/cuda/kernels.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::UnavailableError(absl::StrCat("expert-parallel group: ", what, ": ", ncclGetErrorString(r)));
}

#define MOE_NCCL_RETURN_IF_ERROR(expr)                                     \
  do {                                                                     \
    const ncclResult_t moe_nccl_r_ = (expr);                               \
    if (moe_nccl_r_ != ncclSuccess && moe_nccl_r_ != ncclInProgress)       \
      return NcclError(moe_nccl_r_, #expr);                                \
  } while (0)

// CUDA memory of n T's (device, or pinned host), freed with the owner.
template <typename T, cudaError_t (*kAlloc)(void**, size_t), cudaError_t (*kFree)(void*)>
struct CudaArray {
  T* p = nullptr;
  ~CudaArray() {
    if (p != nullptr) kFree(p);
  }
  absl::Status Alloc(size_t n) {
    void* raw = nullptr;
    MOE_CUDA_RETURN_IF_ERROR(kAlloc(&raw, std::max<size_t>(n, 1) * sizeof(T)));
    p = static_cast<T*>(raw);
    return absl::OkStatus();
  }
};
cudaError_t MallocPinned(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
template <typename T>
using DeviceArray = CudaArray<T, cudaMalloc, cudaFree>;
template <typename T>
using PinnedArray = CudaArray<T, MallocPinned, cudaFreeHost>;

// Tokens a call sends to every peer with its head: when no rank's call has
// more (decode), the heads carry every token and the call needs no other
// exchange before its compute — one wait on the host instead of three.
constexpr int kInlineTokens = 8;

// What the ranks must agree on, compared at Create.
struct Shape {
  int32_t num_experts, hidden, max_tokens, max_top_k;
};

}  // namespace

absl::StatusOr<std::string> NewGroupId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  return absl::BytesToHexString(absl::string_view(id.internal, sizeof(id.internal)));
}

struct ExpertParallel::Impl {
  ParallelGroup group;
  LayerDispatcher* local = nullptr;
  int E = 0, H = 0, max_tokens = 0, kc = 0;  // kc: ids per token in the exchanged batch (max_top_k)
  int ki = 0;  // tokens every call sends inline with its head (kInlineTokens, at most max_tokens)
  std::chrono::milliseconds deadline{0};
  ncclComm_t comm = nullptr;
  bool in_group = false;
  cudaEvent_t done = nullptr;
  StepTimes times;
  Clock::time_point mark;  // the end of the call's last timed step
  // Adds the time since `mark` to `into` and moves `mark` on.
  void Lap(double& into) {
    const Clock::time_point now = Clock::now();
    into += std::chrono::duration<double>(now - mark).count();
    mark = now;
  }

  // Sized for the worst case at Create: a token goes to every peer at most
  // once, and every peer sends at most max_tokens.
  DeviceArray<bf16_t> send_x, batch_x, batch_out, returned;
  DeviceArray<int32_t> batch_ids, send_ids, send_token, own_rows, counts, all_counts, status_out, status_in;
  DeviceArray<float> batch_w, send_w, accum;
  PinnedArray<int32_t> h_ids, h_send_ids, h_send_token, h_counts, h_all_counts, h_status_in;
  PinnedArray<int32_t> h_status_out;
  PinnedArray<float> h_w, h_send_w;
  PinnedArray<int32_t> h_head_ids;  // the heads' routing, [S blocks of ki tokens, kc]
  PinnedArray<float> h_head_w;
  // Per call, per peer: tokens sent and received, and where they start.
  std::vector<int> sent, recv, send_at, recv_at;

  ~Impl() {
    if (comm != nullptr) {
      if (in_group) {
        ncclCommFinalize(comm);
        ncclResult_t st = ncclInProgress;
        const Clock::time_point end = Clock::now() + std::chrono::seconds(5);
        while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress && Clock::now() < end)
          std::this_thread::yield();
        if (st == ncclSuccess) ncclCommDestroy(comm);
        else ncclCommAbort(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (done != nullptr) cudaEventDestroy(done);
  }

  // Waits until the communicator's issued operations are enqueued (a
  // non-blocking communicator returns ncclInProgress first).
  absl::Status Settle(Clock::time_point end, const char* what) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      MOE_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &st));
      if (st == ncclSuccess) return absl::OkStatus();
      if (st != ncclInProgress) return NcclError(st, what);
      if (Clock::now() >= end)
        return absl::DeadlineExceededError(absl::StrCat("expert-parallel group: ", what, ": no peer by the deadline"));
      std::this_thread::yield();
    }
  }

  // Waits for the stream's work up to `done`, the peers' messages included,
  // bounded by `end`; a communicator error ends the wait at once.
  absl::Status WaitDone(cudaStream_t stream, Clock::time_point end, const char* what) {
    MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, stream));
    int spins = 0;
    for (;;) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return CudaStatus(q, what, __FILE__, __LINE__);
      ncclResult_t st = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress)
        return NcclError(st, what);
      if (Clock::now() >= end)
        return absl::DeadlineExceededError(absl::StrCat("expert-parallel group: ", what, ": no peer by the deadline"));
      if (++spins < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  absl::Status Allocate() {
    const size_t S = group.size, T = max_tokens, peers = S - 1;
    const size_t batch = T * S, send = T * peers;
    MOE_RETURN_IF_ERROR(send_x.Alloc(send * H));
    MOE_RETURN_IF_ERROR(send_ids.Alloc(send * kc));
    MOE_RETURN_IF_ERROR(send_w.Alloc(send * kc));
    MOE_RETURN_IF_ERROR(send_token.Alloc(send));
    MOE_RETURN_IF_ERROR(returned.Alloc(send * H));
    MOE_RETURN_IF_ERROR(batch_x.Alloc(batch * H));
    MOE_RETURN_IF_ERROR(batch_ids.Alloc(batch * kc));
    MOE_RETURN_IF_ERROR(batch_w.Alloc(batch * kc));
    MOE_RETURN_IF_ERROR(batch_out.Alloc(batch * H));
    MOE_RETURN_IF_ERROR(own_rows.Alloc(T));
    MOE_RETURN_IF_ERROR(accum.Alloc(T * H));
    MOE_RETURN_IF_ERROR(counts.Alloc(S));
    MOE_RETURN_IF_ERROR(all_counts.Alloc(S * S));
    MOE_RETURN_IF_ERROR(status_out.Alloc(S));
    MOE_RETURN_IF_ERROR(status_in.Alloc(S));
    MOE_RETURN_IF_ERROR(h_ids.Alloc(T * kc));
    MOE_RETURN_IF_ERROR(h_w.Alloc(T * kc));
    MOE_RETURN_IF_ERROR(h_send_ids.Alloc(send * kc));
    MOE_RETURN_IF_ERROR(h_send_w.Alloc(send * kc));
    MOE_RETURN_IF_ERROR(h_send_token.Alloc(send));
    MOE_RETURN_IF_ERROR(h_counts.Alloc(S));
    MOE_RETURN_IF_ERROR(h_all_counts.Alloc(S * S));
    MOE_RETURN_IF_ERROR(h_status_out.Alloc(S));
    MOE_RETURN_IF_ERROR(h_status_in.Alloc(S));
    MOE_RETURN_IF_ERROR(h_head_ids.Alloc(S * ki * kc));
    MOE_RETURN_IF_ERROR(h_head_w.Alloc(S * ki * kc));
    std::vector<int32_t> iota(T);  // own_rows: token t's partial is row t of the batch
    for (size_t t = 0; t < T; ++t) iota[t] = static_cast<int32_t>(t);
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(own_rows.p, iota.data(), T * sizeof(int32_t), cudaMemcpyHostToDevice));
    MOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    return absl::OkStatus();
  }

  // One call: the head (checks, every rank's count and first ki tokens),
  // then Small (every rank's tokens came with the heads) or Large (the
  // counts, then the tokens each peer needs); Finish: the statuses and out.
  // `input` is this rank's bad input or a failed compute (its peers go on).
  absl::Status Exchange(const LayerCall& call, CallStats* stats, absl::Status& input);
  absl::Status Small(const LayerCall& call, CallStats* stats, int T, cudaStream_t stream, Clock::time_point end,
                     absl::Status& input);
  absl::Status Large(const LayerCall& call, CallStats* stats, int T, cudaStream_t stream, Clock::time_point end,
                     absl::Status& input);
  absl::Status Finish(const LayerCall& call, int T, const absl::Status& computed, cudaStream_t stream,
                      absl::Status& input);
  absl::Status Alone(const LayerCall& call, CallStats* stats, const absl::Status& why);
};

ExpertParallel::ExpertParallel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertParallel::~ExpertParallel() = default;
const ExpertParallel::StepTimes& ExpertParallel::step_times() const { return impl_->times; }

absl::StatusOr<std::unique_ptr<ExpertParallel>> ExpertParallel::Create(const ParallelGroup& group,
                                                                       LayerDispatcher& local, int num_experts,
                                                                       int hidden, int max_tokens, int max_top_k,
                                                                       std::chrono::milliseconds deadline) {
  if (group.mode != GroupMode::kExpert || group.size < 2)
    return absl::InvalidArgumentError("group: an expert-parallel group needs mode kExpert and size >= 2");
  static_assert(2 * sizeof(ncclUniqueId::internal) == kGroupIdHexChars);
  MOE_RETURN_IF_ERROR(CheckParallelGroup(group, num_experts));
  auto m = std::make_unique<Impl>();
  m->group = group;
  m->local = &local;
  m->E = num_experts;
  m->H = hidden;
  m->max_tokens = max_tokens;
  m->kc = max_top_k;
  m->ki = std::min(kInlineTokens, max_tokens);
  m->deadline = deadline;
  MOE_RETURN_IF_ERROR(m->Allocate());
  const std::string raw = absl::HexStringToBytes(group.id);
  ncclUniqueId id;
  std::memcpy(id.internal, raw.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait is ours, bounded by the deadline
  MOE_NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&m->comm, group.size, id, group.rank, &config));
  const Clock::time_point end = Clock::now() + deadline;
  MOE_RETURN_IF_ERROR(m->Settle(end, "ncclCommInitRank (every rank opens its session)"));
  m->in_group = true;
  // The ranks agree on the geometry and the call sizes (the buffers' and the
  // batches' strides), or no rank opens.
  const Shape mine{num_experts, hidden, max_tokens, max_top_k};
  DeviceArray<Shape> d_shapes;
  MOE_RETURN_IF_ERROR(d_shapes.Alloc(group.size));
  std::vector<Shape> shapes(group.size);
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_shapes.p + group.rank, &mine, sizeof(Shape), cudaMemcpyHostToDevice));
  MOE_NCCL_RETURN_IF_ERROR(ncclAllGather(d_shapes.p + group.rank, d_shapes.p, sizeof(Shape), ncclUint8, m->comm,
                                         cudaStreamLegacy));
  MOE_RETURN_IF_ERROR(m->Settle(end, "ncclAllGather"));
  MOE_RETURN_IF_ERROR(m->WaitDone(cudaStreamLegacy, end, "ncclAllGather"));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(shapes.data(), d_shapes.p, shapes.size() * sizeof(Shape), cudaMemcpyDeviceToHost));
  for (int r = 0; r < group.size; ++r)
    if (std::memcmp(&shapes[r], &mine, sizeof(Shape)) != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          "group: rank ", r, " opened with experts ", shapes[r].num_experts, ", hidden ", shapes[r].hidden,
          ", max_tokens ", shapes[r].max_tokens, ", max_top_k ", shapes[r].max_top_k, "; rank ", group.rank,
          " with ", num_experts, ", ", hidden, ", ", max_tokens, ", ", max_top_k, " (they must agree)"));
  return std::unique_ptr<ExpertParallel>(new ExpertParallel(std::move(m)));
}

absl::Status ExpertParallel::Forward(const LayerCall& call, CallStats* stats) {
  Impl& m = *impl_;
  if (!m.in_group) return m.local->Forward(call, stats);
  absl::Status input;  // this rank's bad input: it takes part with no tokens and returns this
  absl::Status st = m.Exchange(call, stats, input);
  if (st.ok()) return input;
  // A peer (or the communicator) failed: leave the group and compute alone.
  return m.Alone(call, stats, st);
}

absl::Status ExpertParallel::Impl::Alone(const LayerCall& call, CallStats* stats, const absl::Status& why) {
  LogWarning("worker", "expert-parallel rank ", group.rank, " of ", group.size, " leaves the group (", why.message(),
             "): its peers' experts become misses on the CPU servers");
  ncclCommAbort(comm);
  comm = nullptr;
  in_group = false;
  local->LeaveGroup();
  return local->Forward(call, stats);
}

// Long: the head's steps (the checks, the inline tokens out, the host's view of every rank's), then one of two ways on.
absl::Status ExpertParallel::Impl::Exchange(const LayerCall& call, CallStats* stats, absl::Status& input) {
  const int S = group.size, me = group.rank;
  const Clock::time_point end = Clock::now() + (call.deadline.count() > 0 ? call.deadline : deadline);
  cudaStream_t stream = call.stream != nullptr ? static_cast<cudaStream_t>(call.stream) : cudaStreamLegacy;
  const int k = call.batch.routing.k;
  int T = call.batch.n;
  mark = Clock::now();
  ++times.calls;
  // 1. This rank's call checked: bad input takes part with no tokens.
  if (call.kind != MemoryKind::kDevice) input = absl::InvalidArgumentError("kind: expert-parallel calls take device memory");
  else if (T < 0 || T > max_tokens)
    input = absl::InvalidArgumentError(absl::StrCat("T: ", T, " is outside [0, ", max_tokens, "] (max_tokens)"));
  else if (T > 0 && (k < 1 || k > kc))
    input = absl::InvalidArgumentError(absl::StrCat("k: ", k, " is outside [1, ", kc, "] (max_top_k)"));
  else if (T > 0 && (call.batch.tokens == nullptr || call.batch.routing.ids == nullptr ||
                     call.batch.routing.weights == nullptr || call.out == nullptr))
    input = absl::InvalidArgumentError("hidden, topk_ids, topk_weights, out: must not be null");
  if (!input.ok()) T = 0;
  // 2. The head, every call: this rank's token count and its first ki
  // tokens (rows, ids and weights at stride kc, padding -1 / 0) to every
  // peer, into block `rank` of the batch; the routing of this rank's call
  // and every block come to the host, one wait for all of it.
  const int inl = std::min(T, ki);
  h_counts.p[0] = T;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts.p, h_counts.p, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  int32_t* own_ids = batch_ids.p + size_t(me) * ki * kc;
  float* own_w = batch_w.p + size_t(me) * ki * kc;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own_ids, 0xff, sizeof(int32_t) * ki * kc, stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own_w, 0, sizeof(float) * ki * kc, stream));
  if (inl < ki)  // padding rows: zeros, never read (no pairs), never garbage
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(batch_x.p + (size_t(me) * ki + inl) * H, 0, sizeof(bf16_t) * (ki - inl) * H,
                                             stream));
  if (inl > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(batch_x.p + size_t(me) * ki * H, call.batch.tokens,
                                             sizeof(bf16_t) * inl * H, cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(own_ids, sizeof(int32_t) * kc, call.batch.routing.ids, sizeof(int32_t) * k,
                                               sizeof(int32_t) * k, inl, cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(own_w, sizeof(float) * kc, call.batch.routing.weights, sizeof(float) * k,
                                               sizeof(float) * k, inl, cudaMemcpyDeviceToDevice, stream));
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int s = 0; s < S; ++s) {
    if (s == me) continue;
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(counts.p, 1, ncclInt32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(batch_x.p + size_t(me) * ki * H, size_t(ki) * H, ncclBfloat16, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(own_ids, size_t(ki) * kc, ncclInt32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(own_w, size_t(ki) * kc, ncclFloat32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(all_counts.p + s, 1, ncclInt32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_x.p + size_t(s) * ki * H, size_t(ki) * H, ncclBfloat16, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_ids.p + size_t(s) * ki * kc, size_t(ki) * kc, ncclInt32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_w.p + size_t(s) * ki * kc, size_t(ki) * kc, ncclFloat32, s, comm, stream));
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  MOE_RETURN_IF_ERROR(Settle(end, "the heads' send/recv"));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_all_counts.p, all_counts.p, sizeof(int32_t) * S, cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_head_ids.p, batch_ids.p, sizeof(int32_t) * S * ki * kc,
                                           cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_head_w.p, batch_w.p, sizeof(float) * S * ki * kc, cudaMemcpyDeviceToHost,
                                           stream));
  if (T > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_ids.p, call.batch.routing.ids, sizeof(int32_t) * T * k,
                                             cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_w.p, call.batch.routing.weights, sizeof(float) * T * k,
                                             cudaMemcpyDeviceToHost, stream));
  }
  MOE_RETURN_IF_ERROR(WaitDone(stream, end, "the heads"));
  // Every rank decides Small or Large from the same counts: the heads' (its
  // own as sent, before its routing is checked).
  h_all_counts.p[me] = T;
  bool small = true;
  for (int s = 0; s < S; ++s) {
    if (h_all_counts.p[s] < 0 || h_all_counts.p[s] > max_tokens)
      return absl::InternalError(absl::StrCat("expert-parallel group: rank ", s, " sends ", h_all_counts.p[s], " tokens"));
    small = small && h_all_counts.p[s] <= ki;
  }
  if (T > 0) {
    input = ValidateRouting(RoutingView{T, k, h_ids.p, h_w.p}, E, {}, "topk_ids", "topk_weights");
    if (!input.ok()) T = 0;
  }
  Lap(times.counts);
  if (small) return Small(call, stats, T, stream, end, input);
  return Large(call, stats, T, stream, end, input);
}

// Long: steps 3-6 of a decode-sized call (the heads carried every token), each a few lines.
absl::Status ExpertParallel::Impl::Small(const LayerCall& call, CallStats* stats, int T, cudaStream_t stream,
                                         Clock::time_point end, absl::Status& input) {
  const int S = group.size, me = group.rank;
  // 3. Every block's routing checked on the host as its rank checked its
  // own: a block that fails (its rank's input is bad) or this rank's own
  // when it did, is not computed (ids -1).
  int live = 0;  // blocks with tokens to compute
  for (int s = 0; s < S; ++s) {
    const int n = h_all_counts.p[s];
    const size_t at = size_t(s) * ki * kc;
    if ((s == me && T == 0) ||
        (s != me && !ValidateRouting(RoutingView{n, kc, h_head_ids.p + at, h_head_w.p + at}, E, {}).ok()))
      MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(batch_ids.p + at, 0xff, sizeof(int32_t) * ki * kc, stream));
    else
      live += n > 0;
  }
  // 4. This rank's share of every block (the padding rows have no pairs).
  Lap(times.send);
  LayerCall batch;
  batch.batch = MoeBatch{call.batch.layer, S * ki, batch_x.p, RoutingView{S * ki, kc, batch_ids.p, batch_w.p}};
  batch.out = batch_out.p;
  batch.kind = MemoryKind::kDevice;
  batch.deadline = std::max(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()));
  batch.stream = stream;
  const absl::Status computed = live > 0 ? local->Forward(batch, stats) : absl::OkStatus();
  Lap(times.compute);
  const int32_t code = static_cast<int32_t>(computed.code());
  for (int s = 0; s < S; ++s) h_status_out.p[s] = code, h_status_in.p[s] = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(status_out.p, h_status_out.p, sizeof(int32_t) * S, cudaMemcpyHostToDevice, stream));
  // 5. Each peer's block back to it, this rank's from every peer (peer
  // index p: the ranks but this one, in order).
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int s = 0, p = 0; s < S; ++s) {
    if (s == me) continue;
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(batch_out.p + size_t(s) * ki * H, size_t(ki) * H, ncclBfloat16, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclSend(status_out.p + s, 1, ncclInt32, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(returned.p + size_t(p) * ki * H, size_t(ki) * H, ncclBfloat16, s, comm, stream));
    MOE_NCCL_RETURN_IF_ERROR(ncclRecv(status_in.p + s, 1, ncclInt32, s, comm, stream));
    ++p;
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  MOE_RETURN_IF_ERROR(Settle(end, "the partial sums' send/recv"));
  // 6. out = own share + the peers' shares (f32, one rounding).
  if (T > 0 && computed.ok()) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(accum.p, 0, sizeof(float) * T * H, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(batch_out.p + size_t(me) * ki * H, own_rows.p, T, H, accum.p, stream));
    for (int p = 0; p < S - 1; ++p)
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(returned.p + size_t(p) * ki * H, own_rows.p, T, H, accum.p, stream));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_status_in.p, status_in.p, sizeof(int32_t) * S, cudaMemcpyDeviceToHost, stream));
  MOE_RETURN_IF_ERROR(WaitDone(stream, end, "the partial sums"));
  Lap(times.back);
  sent.assign(S, T);  // every peer computed this rank's tokens: its status counts
  sent[me] = 0;
  return Finish(call, T, computed, stream, input);
}

// Long: steps 3-6 of a larger call (the counts first, then only the tokens each peer needs), each a few lines.
absl::Status ExpertParallel::Impl::Large(const LayerCall& call, CallStats* stats, int T, cudaStream_t stream,
                                         Clock::time_point end, absl::Status& input) {
  const int S = group.size, me = group.rank;
  const int k = call.batch.routing.k;
  // Each token to every peer owning one of its experts; ids and weights
  // re-strided to kc (padding -1 / 0).
  sent.assign(S, 0);
  int n_send = 0;
  for (int s = 0; s < S; ++s) {
    if (s == me) continue;
    for (int t = 0; t < T; ++t) {
      bool needs = false;
      for (int j = 0; j < k && !needs; ++j) {
        const int e = h_ids.p[t * k + j];
        needs = e >= 0 && ExpertOwner(call.batch.layer, e, S) == s;
      }
      if (!needs) continue;
      h_send_token.p[n_send] = t;
      for (int j = 0; j < kc; ++j) {
        h_send_ids.p[n_send * kc + j] = j < k ? h_ids.p[t * k + j] : -1;
        h_send_w.p[n_send * kc + j] = j < k ? h_w.p[t * k + j] : 0.f;
      }
      ++n_send, ++sent[s];
    }
  }
  // The own tokens lead the batch (same stride kc); their ids reuse h_ids'
  // tail-free layout only when k == kc, else they are re-strided in place
  // from the back (kc >= k, so no row is overwritten before it is read).
  for (int t = T - 1; t >= 0 && k != kc; --t)
    for (int j = kc - 1; j >= 0; --j) {
      h_ids.p[t * kc + j] = j < k ? h_ids.p[t * k + j] : -1;
      h_w.p[t * kc + j] = j < k ? h_w.p[t * k + j] : 0.f;
    }

  Lap(times.routing);
  // 3b. The counts: all_counts[s * S + r] tokens go from s to r.
  for (int s = 0; s < S; ++s) h_counts.p[s] = sent[s];
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts.p, h_counts.p, sizeof(int32_t) * S, cudaMemcpyHostToDevice, stream));
  MOE_NCCL_RETURN_IF_ERROR(ncclAllGather(counts.p, all_counts.p, S, ncclInt32, comm, stream));
  MOE_RETURN_IF_ERROR(Settle(end, "ncclAllGather of the counts"));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_all_counts.p, all_counts.p, sizeof(int32_t) * S * S,
                                           cudaMemcpyDeviceToHost, stream));
  MOE_RETURN_IF_ERROR(WaitDone(stream, end, "the token counts"));
  recv.assign(S, 0);
  send_at.assign(S, 0);
  recv_at.assign(S, 0);
  int R = 0;
  for (int s = 0, so = 0; s < S; ++s) {
    recv[s] = s == me ? 0 : h_all_counts.p[s * S + me];
    if (recv[s] < 0 || recv[s] > max_tokens)
      return absl::InternalError(absl::StrCat("expert-parallel group: rank ", s, " sends ", recv[s], " tokens"));
    send_at[s] = so, so += sent[s];
    recv_at[s] = T + R, R += recv[s];
  }

  Lap(times.counts);
  // 3. The tokens out, the peers' in; the batch is [own T | received R].
  if (T > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(batch_x.p, call.batch.tokens, sizeof(bf16_t) * T * H,
                                             cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(batch_ids.p, h_ids.p, sizeof(int32_t) * T * kc, cudaMemcpyHostToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(batch_w.p, h_w.p, sizeof(float) * T * kc, cudaMemcpyHostToDevice, stream));
  }
  if (n_send > 0) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_token.p, h_send_token.p, sizeof(int32_t) * n_send,
                                             cudaMemcpyHostToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_ids.p, h_send_ids.p, sizeof(int32_t) * n_send * kc,
                                             cudaMemcpyHostToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send_w.p, h_send_w.p, sizeof(float) * n_send * kc,
                                             cudaMemcpyHostToDevice, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(call.batch.tokens, H, send_token.p, n_send, send_x.p, stream));
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int s = 0; s < S; ++s) {
    if (sent[s] > 0) {
      const size_t a = send_at[s];
      MOE_NCCL_RETURN_IF_ERROR(ncclSend(send_x.p + a * H, size_t(sent[s]) * H, ncclBfloat16, s, comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclSend(send_ids.p + a * kc, size_t(sent[s]) * kc, ncclInt32, s, comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclSend(send_w.p + a * kc, size_t(sent[s]) * kc, ncclFloat32, s, comm, stream));
    }
    if (recv[s] > 0) {
      const size_t a = recv_at[s];
      MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_x.p + a * H, size_t(recv[s]) * H, ncclBfloat16, s, comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_ids.p + a * kc, size_t(recv[s]) * kc, ncclInt32, s, comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclRecv(batch_w.p + a * kc, size_t(recv[s]) * kc, ncclFloat32, s, comm, stream));
    }
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  MOE_RETURN_IF_ERROR(Settle(end, "the tokens' send/recv"));

  // 4. This rank's share of the batch (the dispatcher skips the pairs of
  // experts it does not own). Its failure is told to the peers that sent
  // tokens: they fail those tokens rather than add a missing share.
  Lap(times.send);
  absl::Status computed;
  if (T + R > 0) {
    LayerCall batch;
    batch.batch = MoeBatch{call.batch.layer, T + R, batch_x.p, RoutingView{T + R, kc, batch_ids.p, batch_w.p}};
    batch.out = batch_out.p;
    batch.kind = MemoryKind::kDevice;
    batch.deadline = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    batch.stream = stream;
    if (batch.deadline.count() <= 0) batch.deadline = std::chrono::milliseconds(1);
    computed = local->Forward(batch, stats);
  }
  Lap(times.compute);
  const int32_t code = static_cast<int32_t>(computed.code());
  for (int s = 0; s < S; ++s) h_status_out.p[s] = code, h_status_in.p[s] = 0;
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(status_out.p, h_status_out.p, sizeof(int32_t) * S, cudaMemcpyHostToDevice, stream));

  // 5. The partial sums back, each with its status word.
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (int s = 0; s < S; ++s) {
    if (recv[s] > 0) {
      MOE_NCCL_RETURN_IF_ERROR(ncclSend(batch_out.p + size_t(recv_at[s]) * H, size_t(recv[s]) * H, ncclBfloat16, s,
                                        comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclSend(status_out.p + s, 1, ncclInt32, s, comm, stream));
    }
    if (sent[s] > 0) {
      MOE_NCCL_RETURN_IF_ERROR(ncclRecv(returned.p + size_t(send_at[s]) * H, size_t(sent[s]) * H, ncclBfloat16, s,
                                        comm, stream));
      MOE_NCCL_RETURN_IF_ERROR(ncclRecv(status_in.p + s, 1, ncclInt32, s, comm, stream));
    }
  }
  MOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  MOE_RETURN_IF_ERROR(Settle(end, "the partial sums' send/recv"));

  // 6. out = own share + the peers' shares (f32, one rounding).
  if (T > 0 && computed.ok()) {
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(accum.p, 0, sizeof(float) * T * H, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(batch_out.p, own_rows.p, T, H, accum.p, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(returned.p, send_token.p, n_send, H, accum.p, stream));
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_status_in.p, status_in.p, sizeof(int32_t) * S, cudaMemcpyDeviceToHost, stream));
  MOE_RETURN_IF_ERROR(WaitDone(stream, end, "the partial sums"));
  Lap(times.back);
  return Finish(call, T, computed, stream, input);
}

absl::Status ExpertParallel::Impl::Finish(const LayerCall& call, int T, const absl::Status& computed,
                                          cudaStream_t stream, absl::Status& input) {
  if (!computed.ok()) {
    input = computed;
    return absl::OkStatus();
  }
  for (int s = 0; s < group.size; ++s)
    if (sent[s] > 0 && h_status_in.p[s] != 0) {
      input = absl::Status(static_cast<absl::StatusCode>(h_status_in.p[s]),
                           absl::StrCat("expert-parallel group: rank ", s, " could not compute its experts of layer ",
                                        call.batch.layer, " for this rank's tokens (its log says why)"));
      return absl::OkStatus();
    }
  if (T > 0) MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(accum.p, static_cast<size_t>(T) * H, call.out, stream));
  return absl::OkStatus();
}

}  // namespace moe
