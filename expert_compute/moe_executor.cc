#include "expert_compute/moe_executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/atomic_max.h"
#include "core/cpu_relax.h"
#include "core/status_macros.h"

namespace moe {

namespace {
// Activation groups (16 columns each) per gate/up work unit, when there are
// enough units to keep every thread busy; else one group per unit.
constexpr int kGroupsPerUnit = 4;
// Rows of one expert per gate/up unit: large prefill groups are also split by
// rows so a single hot expert still spreads over every thread (a multiple of 32,
// the AMX kernel's two row blocks).
constexpr int kRowsPerUnit = 128;
// Down units per thread the planner aims at, and the most output groups (of
// 32 columns) one down unit takes (PlanUnits).
constexpr int kDownUnitsPerThread = 8;
constexpr int kMaxDownGroupsPerUnit = 8;
// Rows per gather (and act quantization) claim: up to kGatherRows, fewer when
// that would leave threads without about kClaimsPerThread claims (at 16 rows
// a claim of 16 left one thread quantizing every row while 15 waited: 22% of a
// DeepSeek-V3 int8 expert's call). At most kCombineTokens tokens per combine
// claim, likewise.
constexpr int kGatherRows = 16;
constexpr int kClaimsPerThread = 4;
constexpr int kCombineTokens = 4;
constexpr int kCombineMinColumns = 256;
// How long a Forward() caller whose request waits spins before it sleeps.
constexpr uint64_t kWaitSpinNs = 200'000;

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

MoeExecutor::Buffer::~Buffer() { std::free(p_); }

void MoeExecutor::Buffer::Release() {
  std::free(p_);
  p_ = nullptr;
  cap_ = 0;
}

void* MoeExecutor::Buffer::Reserve(size_t bytes) {
  if (bytes <= cap_) return p_;
  std::free(p_);
  cap_ = 0;
  // Grow with slack so a slightly larger batch does not reallocate.
  const size_t cap = ((bytes + bytes / 4) + 4095) / 4096 * 4096;
  p_ = std::aligned_alloc(64, cap);
  if (p_ != nullptr) cap_ = cap;
  return p_;
}

MoeExecutor::MoeExecutor(const PackedExperts& store, const ExpertKernel& kernel, ComputePool& pool, bool merge)
    : store_(store),
      kernel_(kernel),
      pool_(pool),
      merge_(merge),
      cursors_(size_t(kPhases) * pool.size()),
      round_expert_(store.num_experts(), 0),
      expert_stamp_(store.num_experts(), 0) {}

absl::Status MoeExecutor::Validate(const MoeBatch& b) const {
  if (!store_.HostsLayer(b.layer))
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", b.layer, " is not an MoE layer hosted by this server"));
  if (b.n < 0) return absl::InvalidArgumentError("tokens: negative token count");
  if (b.routing.n != b.n)
    return absl::InvalidArgumentError(
        absl::StrCat("expert_ids: ", b.routing.n, " rows for ", b.n, " tokens"));
  if (b.n > 0 && b.routing.k <= 0)
    return absl::InvalidArgumentError("expert_ids: need at least one column (k >= 1)");
  return ValidateRouting(b.routing, store_.num_experts(),
                         [this](int e) { return store_.HostsExpert(e); });
}

namespace {
absl::Status CheckOutputDType(DType out_dtype) {
  if (out_dtype != DType::kBF16 && out_dtype != DType::kF32)
    return absl::InvalidArgumentError("output_dtype: must be BF16 or F32");
  return absl::OkStatus();
}

// Groups as Run needs them: consistent arrays, each group on an aligned row
// and clear of the next one's (the kernels write up to a whole row block),
// row tokens in [-1, n).
absl::Status CheckGroups(const ExpertGroups& gr, int n, int align) {
  const size_t ng = gr.expert.size();
  if (gr.row_begin.size() != ng || gr.count.size() != ng || gr.total_rows < 0 ||
      gr.token.size() < static_cast<size_t>(gr.total_rows) || gr.weight.size() < static_cast<size_t>(gr.total_rows))
    return absl::InvalidArgumentError("groups: inconsistent array sizes");
  int64_t free_row = 0;
  for (size_t g = 0; g < ng; ++g) {
    const int64_t begin = gr.row_begin[g], count = gr.count[g];
    if (begin < free_row || begin % align != 0 || count < 0 || begin + count > gr.total_rows)
      return absl::InvalidArgumentError(absl::StrCat("groups: group ", g, " (rows ", begin, "+", count,
                                                     ") overlaps, is misaligned (", align,
                                                     ") or exceeds ", gr.total_rows, " rows"));
    free_row = begin + (count + align - 1) / align * align;
  }
  for (int32_t r = 0; r < gr.total_rows; ++r)
    if (gr.token[r] < -1 || gr.token[r] >= n)
      return absl::InvalidArgumentError(absl::StrCat("groups: row ", r, " has token ", gr.token[r], " of ", n));
  return absl::OkStatus();
}
}  // namespace

absl::Status MoeExecutor::Forward(const MoeBatch& b, DType out_dtype, void* out, ForwardStats* stats) {
  MOE_RETURN_IF_ERROR(Validate(b));
  MOE_RETURN_IF_ERROR(CheckOutputDType(out_dtype));
  Job job{&b, out_dtype, out, stats, NowNs(), absl::OkStatus()};
  std::unique_lock<std::mutex> q(q_mu_);
  // A peer: a request of the layer whose region waits or runs, sharing its
  // experts. Too late to merge when the region runs already: had it not
  // waited, would a wait have caught this one?
  if (merge_ && b.layer == round_layer_ && job.t_queue - round_start_ns_ <= kMaxMergeWindowNs && SharesExperts(job)) {
    LayerPeer& lp = PeerOf(b.layer);
    // The lag waited for: the largest recent one (up at once, down by an
    // eighth per peer), so one quick peer does not cut the next wait short.
    const uint64_t lag = job.t_queue - round_start_ns_;
    peer_lag_ns_ = std::max(lag, peer_lag_ns_ - peer_lag_ns_ / 8);
    lp.peer = true;
    if (!round_waiting_) {
      job.late = true;
      ++merge_stats_.late_peers;
      if (!round_waited_) wait_score_ = NextWaitScore(wait_score_, lag <= MergeWindowNs(lag, lp.region_ns));
    }
  }
  pending_.push_back(&job);
  arrivals_.fetch_add(1, std::memory_order_release);
  while (!job.done.load(std::memory_order_acquire)) {
    if (!combining_) {  // this caller runs the regions until its own request is done
      combining_ = true;
      while (!job.done.load(std::memory_order_acquire)) RunRound(q);
      combining_ = false;
      q.unlock();
      q_cv_.notify_all();  // a waiter whose request is left takes the role over
      return job.status;
    }
    // Regions of decode requests end within microseconds: spin first (giving
    // the CPU to a thread with work every SpinYielder period), then sleep.
    q.unlock();
    const uint64_t spin_until = NowNs() + kWaitSpinNs;
    SpinYielder yielder;
    while (!job.done.load(std::memory_order_acquire) && combining_.load(std::memory_order_relaxed)) {
      const auto now = std::chrono::steady_clock::now();
      if (uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count()) > spin_until)
        break;
      CpuRelax();
      yielder.Tick(now);
    }
    q.lock();
    q_cv_.wait(q, [&] { return job.done.load(std::memory_order_acquire) || !combining_; });
  }
  return job.status;
}

void MoeExecutor::TakeMergeable(const Job* first, int* tokens) {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Job* j = pending_[i];
    const bool same = j->batch->layer == first->batch->layer && j->out_dtype == first->out_dtype;
    // At most stripe.count of them: a client repeating a group gets no larger region.
    const bool sibling = same && j != first && first->batch->stripe.striped() &&
                         j->batch->stripe.group == first->batch->stripe.group &&
                         StripesInRound(first) < first->batch->stripe.count;
    const bool merge = j == first || sibling ||
                       (merge_ && same && *tokens + j->batch->n <= kMergeTokens && SharesExperts(*j));
    if (merge) {
      if (merge_) AddExperts(*j);
      round_jobs_.push_back(j);
      *tokens += j->batch->n;
    } else {
      pending_[kept++] = j;
    }
  }
  pending_.resize(kept);
}

void MoeExecutor::WaitForPeer(std::unique_lock<std::mutex>& q, const Job* first, int* tokens) {
  const uint64_t deadline = round_start_ns_ + MergeWindowNs(peer_lag_ns_, PeerOf(round_layer_).region_ns);
  ++merge_stats_.windows;
  round_waiting_ = round_waited_ = true;
  uint64_t seen = arrivals_.load(std::memory_order_acquire);
  q.unlock();
  SpinYielder yielder;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const bool late =
        uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count()) >= deadline;
    const uint64_t a = arrivals_.load(std::memory_order_acquire);
    if (a != seen || late) {
      q.lock();
      TakeMergeable(first, tokens);
      if (round_jobs_.size() > 1 || late) break;
      seen = a;
      q.unlock();
    }
    CpuRelax();
    yielder.Tick(now);
  }
  round_waiting_ = false;
  const bool met = round_jobs_.size() > 1;
  if (met) ++merge_stats_.windows_filled;
  merge_stats_.wait_ns += NowNs() - round_start_ns_;
  wait_score_ = NextWaitScore(wait_score_, met);
}

int MoeExecutor::StripesInRound(const Job* first) const {
  return static_cast<int>(std::count_if(round_jobs_.begin(), round_jobs_.end(), [&](const Job* j) {
    return j->batch->stripe.group == first->batch->stripe.group;
  }));
}

void MoeExecutor::WaitForStripes(std::unique_lock<std::mutex>& q, const Job* first, int* tokens) {
  const uint64_t deadline = NowNs() + kMaxStripeWaitNs;
  uint64_t seen = arrivals_.load(std::memory_order_acquire);
  round_waiting_ = true;  // a request arriving meanwhile is no late peer: the region has not started
  while (StripesInRound(first) < first->batch->stripe.count) {
    q.unlock();
    SpinYielder yielder;
    bool late = false;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      late = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count()) >= deadline;
      if (late || arrivals_.load(std::memory_order_acquire) != seen) break;
      CpuRelax();
      yielder.Tick(now);
    }
    q.lock();
    seen = arrivals_.load(std::memory_order_acquire);
    TakeMergeable(first, tokens);
    if (late) break;
  }
  round_waiting_ = false;
}

void MoeExecutor::RunRound(std::unique_lock<std::mutex>& q) {
  Job* const first = pending_.front();
  round_layer_ = first->batch->layer;
  round_start_ns_ = std::max(first->t_queue, NowNs());
  round_waited_ = false;
  round_jobs_.clear();
  if (merge_) std::fill(round_expert_.begin(), round_expert_.end(), 0);
  int tokens = 0;
  TakeMergeable(first, &tokens);
  if (first->batch->stripe.striped()) WaitForStripes(q, first, &tokens);
  // Alone, with a peer expected and waits paying: wait for its request of
  // this layer. (A late peer's own region waits for nobody: the request it
  // came after is done.)
  if (merge_ && round_jobs_.size() == 1 && !first->late && PeerOf(round_layer_).peer &&
      wait_score_ >= kWaitScoreOne / 2 && tokens < kMergeTokens)
    WaitForPeer(q, first, &tokens);
  if (merge_ && !first->late) PeerOf(round_layer_).peer = round_jobs_.size() > 1;
  ++merge_stats_.regions;
  if (round_jobs_.size() > 1) {
    ++merge_stats_.merged_regions;
    merge_stats_.merged_requests += round_jobs_.size();
  }
  q.unlock();
  ForwardStats rs;
  absl::Status st;
  const uint64_t t_start = NowNs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    st = RunJobs(round_jobs_, &rs);
  }
  const uint64_t t_end = NowNs();
  q.lock();
  if (merge_) PeerOf(round_layer_).region_ns = t_end - t_start;
  round_layer_ = -1;
  rs.merged_requests = static_cast<int>(round_jobs_.size());
  for (Job* j : round_jobs_) {
    if (j->stats != nullptr) {
      *j->stats = rs;
      j->stats->queue_ns = t_start - j->t_queue;
      if (round_jobs_.size() > 1) {  // its own pairs (the region's experts and times are shared)
        const RoutingView& r = j->batch->routing;
        j->stats->pairs = static_cast<int>(std::count_if(r.ids, r.ids + size_t(r.n) * r.k, [](int32_t e) { return e >= 0; }));
      }
    }
    j->status = st;
    j->done.store(true, std::memory_order_release);  // j may be gone after this
  }
  round_jobs_.clear();
  q_cv_.notify_all();
}

absl::Status MoeExecutor::RunJobs(const std::vector<Job*>& jobs, ForwardStats* stats) {
  const uint64_t t_start = NowNs();
  const Job& j0 = *jobs[0];
  const int layer = j0.batch->layer;
  if (jobs.size() == 1) {
    GroupByExpert(j0.batch->routing, store_.num_experts(), row_align(), &groups_);
    return RunLocked(layer, j0.batch->n, TokenIo{j0.batch->tokens, j0.out}, groups_, nullptr, j0.out_dtype, stats,
                     t_start, t_start);
  }
  // One routing [n, max k] over every request's tokens (unused slots -1) and
  // a pointer per token to its request's row in and out.
  int n = 0, k = 0;
  for (const Job* j : jobs) {
    n += j->batch->n;
    k = std::max(k, j->batch->routing.k);
  }
  const size_t H = store_.geometry().H, elem = j0.out_dtype == DType::kBF16 ? 2 : 4;
  merge_ids_.assign(size_t(n) * k, -1);
  merge_weights_.assign(size_t(n) * k, 0.0f);
  merge_in_.resize(n);
  merge_out_.resize(n);
  int t = 0;
  for (const Job* j : jobs) {
    const RoutingView& r = j->batch->routing;
    for (int i = 0; i < j->batch->n; ++i, ++t) {
      std::copy_n(r.ids + size_t(i) * r.k, r.k, merge_ids_.data() + size_t(t) * k);
      std::copy_n(r.weights + size_t(i) * r.k, r.k, merge_weights_.data() + size_t(t) * k);
      merge_in_[t] = j->batch->tokens + size_t(i) * H;
      merge_out_[t] = static_cast<std::byte*>(j->out) + size_t(i) * H * elem;
    }
  }
  GroupByExpert(RoutingView{n, k, merge_ids_.data(), merge_weights_.data()}, store_.num_experts(), row_align(),
                &groups_);
  return RunLocked(layer, n, TokenIo{nullptr, nullptr, merge_in_.data(), merge_out_.data()}, groups_, nullptr,
                   j0.out_dtype, stats, t_start, t_start);
}

bool MoeExecutor::SharesExperts(const Job& j) {
  if (++stamp_ == 0) {
    std::fill(expert_stamp_.begin(), expert_stamp_.end(), 0);
    stamp_ = 1;
  }
  const RoutingView& r = j.batch->routing;
  int distinct = 0, shared = 0;
  for (size_t i = 0, n = size_t(r.n) * r.k; i < n; ++i) {
    const int e = r.ids[i];  // validated: -1 or a hosted expert
    if (e < 0 || expert_stamp_[e] == stamp_) continue;
    expert_stamp_[e] = stamp_;
    ++distinct;
    shared += round_expert_[e];
  }
  return 2 * shared >= distinct;
}

void MoeExecutor::AddExperts(const Job& j) {
  const RoutingView& r = j.batch->routing;
  for (size_t i = 0, n = size_t(r.n) * r.k; i < n; ++i)
    if (r.ids[i] >= 0) round_expert_[r.ids[i]] = 1;
}

MoeExecutor::LayerPeer& MoeExecutor::PeerOf(int layer) {
  if (static_cast<size_t>(layer) >= layer_peer_.size()) layer_peer_.resize(static_cast<size_t>(layer) + 1);
  return layer_peer_[layer];
}

uint64_t MergeWindowNs(uint64_t lag_ns, uint64_t region_ns) {
  const uint64_t bound = region_ns == 0 ? MoeExecutor::kDefaultMergeWindowNs : region_ns / 4 * 3;
  return std::min({lag_ns + lag_ns / 2 + 10'000, bound, MoeExecutor::kMaxMergeWindowNs});
}

uint32_t NextWaitScore(uint32_t score, bool met) {
  return score - score / 4 + (met ? kWaitScoreOne / 4 : 0);
}

MergeStats MoeExecutor::merge_stats() const {
  std::lock_guard<std::mutex> q(q_mu_);
  return merge_stats_;
}

int MoeExecutor::waiting_requests() const {
  std::lock_guard<std::mutex> q(q_mu_);
  return static_cast<int>(pending_.size());
}

absl::Status MoeExecutor::Run(int layer, int n, const bf16_t* tokens, const ExpertGroups& groups,
                              const int32_t* store_expert, DType out_dtype, void* out, ForwardStats* stats) {
  MOE_RETURN_IF_ERROR(CheckOutputDType(out_dtype));
  if (n < 0) return absl::InvalidArgumentError("tokens: negative token count");
  MOE_RETURN_IF_ERROR(CheckGroups(groups, n, row_align()));
  const uint64_t t_queue = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  return RunLocked(layer, n, TokenIo{tokens, out}, groups, store_expert, out_dtype, stats, t_queue, NowNs());
}

// Work units, several per thread, which a thread takes from its own range
// first and then from the others' (RunLocked): the cores of one host run at
// different speeds under AMX (measured on the AMX host: in one call, threads
// finished 3 to 11 of 96 equal gate/up units, and a fixed split of the down
// projection, one column chunk per thread, ended 0.6-1.5 ms after it began),
// so no fixed split of a phase ends when the average thread does.
//  - gate/up: a whole weight panel (kGroupsPerUnit activation groups) against
//    at most kRowsPerUnit rows of one expert;
//  - down: `down_groups` output groups of at most kRowsPerUnit rows of one
//    expert, sized for about kDownUnitsPerThread units per thread. Each row
//    has its own output row (ExpertKernel::Down), so units never write the
//    same memory.
void MoeExecutor::PlanUnits(const ExpertGroups& groups) {
  const ExpertGeometry& g = store_.geometry();
  const int ngroups = groups.num_groups();
  units_.clear();
  down_units_.clear();
  const int T = pool_.size();
  int64_t row_chunks = 0;
  for (int i = 0; i < ngroups; ++i) row_chunks += (groups.count[i] + kRowsPerUnit - 1) / kRowsPerUnit;
  const int per_unit = row_chunks * g.gate_up_groups() >= int64_t{4} * kGroupsPerUnit * T ? kGroupsPerUnit : 1;
  const int64_t want = int64_t{kDownUnitsPerThread} * T;
  const int down_groups = static_cast<int>(
      std::clamp<int64_t>(row_chunks * g.down_groups() / std::max<int64_t>(1, want), 1, kMaxDownGroupsPerUnit));
  // Per expert, row chunks in pairs, each pair's column units in order: a
  // run of consecutive units (what one thread takes first, RunLocked) shares
  // rows (A) and weights (B) both.
  constexpr int pair = 2;
  for (int i = 0; i < ngroups; ++i) {
    for (int rp = 0; rp < groups.count[i]; rp += pair * kRowsPerUnit) {
      const int rpe = std::min(groups.count[i], rp + pair * kRowsPerUnit);
      for (int c = 0; c < g.gate_up_groups(); c += per_unit)
        for (int r = rp; r < rpe; r += kRowsPerUnit)
          units_.push_back({i, c, std::min(g.gate_up_groups(), c + per_unit), r, std::min(rpe, r + kRowsPerUnit)});
      for (int c = 0; c < g.down_groups(); c += down_groups)
        for (int r = rp; r < rpe; r += kRowsPerUnit)
          down_units_.push_back({i, c, std::min(g.down_groups(), c + down_groups), r, std::min(rpe, r + kRowsPerUnit)});
    }
  }
}

// Each token's rows (CSR over row indexes) for the combine phase.
void MoeExecutor::IndexTokenRows(int n, const int32_t* token, int rows) {
  token_start_.assign(static_cast<size_t>(n) + 1, 0);
  for (int r = 0; r < rows; ++r)
    if (token[r] >= 0) ++token_start_[token[r] + 1];
  for (int t = 0; t < n; ++t) token_start_[t + 1] += token_start_[t];
  token_rows_.resize(token_start_[n]);
  fill_.assign(token_start_.begin(), token_start_.end() - 1);
  for (int r = 0; r < rows; ++r)
    if (token[r] >= 0) token_rows_[fill_[token[r]]++] = r;
}

namespace {
// out[col] = sum over `rows` of y[row * ldy + col] for col < H (a column range:
// y and out start at its first column), as bf16 or f32 (zeros for no rows);
// acc is H floats of scratch.
void SumRows(const float* y, int ldy, const int32_t* rows, int nrows, int H, DType out_dtype, void* out,
             float* acc) {
  if (nrows == 1 && out_dtype == DType::kBF16)  // one row (k = 1 here): converted straight
    return F32ToBf16(y + size_t(rows[0]) * ldy, static_cast<bf16_t*>(out), size_t(H));
  float* dst = out_dtype == DType::kF32 ? static_cast<float*>(out) : acc;
  if (nrows == 0) {
    std::memset(dst, 0, size_t(H) * 4);
  } else {
    std::memcpy(dst, y + size_t(rows[0]) * ldy, size_t(H) * 4);
    for (int j = 1; j < nrows; ++j) {
      const float* src = y + size_t(rows[j]) * ldy;
      for (int c = 0; c < H; ++c) dst[c] += src[c];
    }
  }
  if (out_dtype == DType::kBF16) F32ToBf16(acc, static_cast<bf16_t*>(out), size_t(H));
}
}  // namespace

// Long: one parallel region (gather, gate/up, down, combine) whose phases
// share the region's scratch, counters and barriers; split, each would need
// them passed in.
absl::Status MoeExecutor::RunLocked(int layer, int n, const TokenIo& io, const ExpertGroups& groups,
                                    const int32_t* store_expert, DType out_dtype, ForwardStats* stats,
                                    uint64_t t_queue, uint64_t t_start) {
  const ExpertGeometry& g = store_.geometry();
  const int H = g.H;
  const size_t elem = out_dtype == DType::kBF16 ? 2 : 4;
  auto in_row = [&](int tok) { return io.in_rows != nullptr ? io.in_rows[tok] : io.in + size_t(tok) * H; };
  auto out_row = [&](int tok) {
    return io.out_rows != nullptr ? static_cast<std::byte*>(io.out_rows[tok])
                                  : static_cast<std::byte*>(io.out) + size_t(tok) * H * elem;
  };
  const int ngroups = groups.num_groups();
  weights_.resize(ngroups);
  for (int i = 0; i < ngroups; ++i) {
    const int e = store_expert != nullptr ? store_expert[i] : groups.expert[i];
    weights_[i] = store_.Find(layer, e);
    if (weights_[i] == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("groups: group ", i, " names expert ", e, " of layer ",
                                                     layer, ", which is not loaded"));
  }
  PlanUnits(groups);

  // Rows rounded up to the row block: a caller's last group may end unpadded,
  // and the kernels read whole row blocks of x and act, so those get
  // padding rows (token -1, weight 0) in scratch of our own.
  const int align = row_align();
  const int rows = (groups.total_rows + align - 1) / align * align;
  const int32_t* token = groups.token.data();
  const float* weight = groups.weight.data();
  if (rows != groups.total_rows) {
    pad_token_.assign(groups.token.begin(), groups.token.begin() + groups.total_rows);
    pad_token_.resize(rows, -1);
    pad_weight_.assign(groups.weight.begin(), groups.weight.begin() + groups.total_rows);
    pad_weight_.resize(rows, 0.0f);
    token = pad_token_.data();
    weight = pad_weight_.data();
  }
  IndexTokenRows(n, token, rows);
  const int ldx = g.ldx(), lda = g.lda();  // row strides (expert_kernel.h)
  // Integer weights with no K padding quantize each token's row where the
  // caller holds it: the kernels read only the quantized rows, and copying
  // the bf16 rows first wrote as many bytes again into lines the previous
  // call's threads had read (measured on the AMX host: 16 threads copying 4
  // MiB take 2.2x as long when every thread has just read the destination).
  const bool quantize_in_place = g.int_activations() && g.Kh == H;
  bf16_t* x = quantize_in_place ? nullptr
                                : static_cast<bf16_t*>(x_buf_.Reserve(std::max<size_t>(1, size_t(rows) * ldx * 2)));
  bf16_t* act = static_cast<bf16_t*>(act_buf_.Reserve(std::max<size_t>(1, size_t(rows) * lda * 2)));
  // Down writes each row's weighted output into f32 rows of y, one 64-byte
  // line longer than a multiple of 128 bytes (at H = 2048, rows 8 KiB apart
  // fell into the same few cache sets); the combine phase sums each token's
  // rows into `out`.
  const int ldy = g.Hn + 16;
  float* y = static_cast<float*>(y_buf_.Reserve(std::max<size_t>(1, size_t(rows) * ldy * 4)));
  float* acc = static_cast<float*>(acc_buf_.Reserve(size_t(pool_.size()) * (g.Hn + 16) * 4));
  // Integer weights: the kernels read the rows quantized (QuantizeRows):
  // q [2 rows, ld], scale [rows], sum32 [2 rows, K/32] per input.
  struct Quantized {
    int8_t* q = nullptr;
    float* scale = nullptr;
    int32_t* sum32 = nullptr;
  } xq, aq;
  auto reserve = [&](Buffer& b, size_t K, size_t ld, Quantized* dst) {
    std::byte* p = static_cast<std::byte*>(b.Reserve(std::max<size_t>(1, rows * (2 * ld + 4 + K / 4))));
    if (p == nullptr) return;
    *dst = {reinterpret_cast<int8_t*>(p), reinterpret_cast<float*>(p + rows * 2 * ld),
            reinterpret_cast<int32_t*>(p + rows * (2 * ld + 4))};
  };
  if (g.int_activations()) {
    reserve(xq_buf_, g.Kh, ldx, &xq);
    reserve(actq_buf_, g.Ki, lda, &aq);
  }
  if ((x == nullptr && !quantize_in_place) || act == nullptr || y == nullptr || acc == nullptr ||
      (g.int_activations() && (xq.q == nullptr || aq.q == nullptr))) {
    const size_t bytes = size_t(rows) * (size_t(ldx) * 2 + size_t(lda) * 2 + size_t(ldy) * 4);
    for (Buffer* b : {&x_buf_, &act_buf_, &y_buf_, &acc_buf_, &xq_buf_, &actq_buf_}) b->Release();
    return absl::ResourceExhaustedError(absl::StrCat("tokens: the workspace for ", groups.total_rows,
                                                     " routed pairs (about ", bytes >> 20,
                                                     " MiB) could not be allocated"));
  }
  const KernelRows xin{x, xq.q, xq.scale, xq.sum32}, ain{act, aq.q, aq.scale, aq.sum32};
  auto quantize = [&](const bf16_t* src, int K, int ld, const Quantized& dst, int r0, int r1) {
    QuantizeRows(src + size_t(r0) * ld, r1 - r0, K, ld, dst.q + size_t(2 * r0) * ld, dst.scale + r0,
                 dst.sum32 + size_t(2 * r0) * (K / 32));
  };

  // Claim sizes (see kGatherRows, kCombineTokens). A phase ends when the last
  // thread reaches its barrier (ForwardStats).
  const int claim = std::clamp(rows / (kClaimsPerThread * pool_.size()), 1, kGatherRows);
  // The combine: few tokens (decode) split their columns too, in ranges of at
  // least kCombineMinColumns.
  const int col_chunks = std::clamp((kClaimsPerThread * pool_.size() + n - 1) / std::max(1, n), 1,
                                    std::max(1, H / kCombineMinColumns));
  const int col_width = ((H + col_chunks - 1) / col_chunks + 15) / 16 * 16;
  const int tok_claim = col_chunks > 1 ? 1 : std::clamp(n / (kClaimsPerThread * pool_.size()), 1, kCombineTokens);
  const int combine_units = (n + tok_claim - 1) / tok_claim * col_chunks;
  // Every phase's items are split into one contiguous range per thread; a
  // thread takes claims from its own range first, then from what is left of
  // the others'. Taking every gate/up and down unit from one shared counter
  // gave a thread units of unrelated rows and weights one after another (all
  // from L3 or other cores' caches): the 512-token layer ran 14.8 ms against
  // 11.9 with ranges (AMX host, 16 threads, Qwen3-30B-A3B bf16). The ranges of the
  // gather, gate/up, down and combine line up (thread t's rows, then units
  // of about the same rows), so a thread mostly reads what it wrote.
  enum Phase { kGather, kGateUp, kQuantize, kDown, kCombine };
  const int T = pool_.size();
  const int totals[kPhases] = {rows, static_cast<int>(units_.size()), rows, static_cast<int>(down_units_.size()),
                               combine_units};
  const int steps[kPhases] = {claim, 1, claim, 1, 1};
  for (int p = 0; p < kPhases; ++p) {
    for (int t = 0; t < T; ++t) {
      cursors_[p * T + t].next.store(int(int64_t{totals[p]} * t / T), std::memory_order_relaxed);
      cursors_[p * T + t].end = int(int64_t{totals[p]} * (t + 1) / T);
    }
  }
  // Thread t's next claim [first, second) of phase p; first = -1 when none is left.
  auto take = [&](int p, int t) -> std::pair<int, int> {
    for (int i = 0; i < T; ++i) {
      Cursor& c = cursors_[p * T + (t + i) % T];
      if (c.next.load(std::memory_order_relaxed) >= c.end) continue;
      const int u = c.next.fetch_add(steps[p], std::memory_order_relaxed);
      if (u < c.end) return {u, std::min(c.end, u + steps[p])};
    }
    return {-1, -1};
  };
  std::atomic<uint64_t> phase_end[3] = {0, 0, 0};
  auto gather_rows = [&](bf16_t* dst0, int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
      bf16_t* dst = dst0 + size_t(r - r0) * ldx;
      if (token[r] >= 0) {
        std::memcpy(dst, in_row(token[r]), size_t(H) * 2);
        std::memset(dst + H, 0, size_t(g.Kh - H) * 2);
      } else {
        std::memset(dst, 0, size_t(g.Kh) * 2);
      }
    }
  };
  auto arrive = [&](int p) { AtomicMax(phase_end[p], NowNs(), std::memory_order_relaxed); };
  pool_.Run([&](int t, int) {
    // Phase 0: gather each row's token (padding rows and columns zero).
    for (auto [r0, r1] = take(kGather, t); r0 >= 0; std::tie(r0, r1) = take(kGather, t)) {
      if (quantize_in_place) {
        for (int r = r0; r < r1; ++r) {
          if (token[r] >= 0) {
            // (one row: ldx is only the hi -> lo distance in q)
            QuantizeRows(in_row(token[r]), 1, H, ldx, xq.q + size_t(2 * r) * ldx, xq.scale + r,
                         xq.sum32 + size_t(2 * r) * (H / 32));
          } else {
            std::memset(xq.q + size_t(2 * r) * ldx, 0, size_t(2) * ldx);
            xq.scale[r] = 0;
            std::memset(xq.sum32 + size_t(2 * r) * (H / 32), 0, size_t(2) * (H / 32) * 4);
          }
        }
        continue;
      }
      gather_rows(x + size_t(r0) * ldx, r0, r1);
      if (g.int_activations()) quantize(x, g.Kh, ldx, xq, r0, r1);
    }
    arrive(0);
    pool_.Barrier();
    // Phase 1: act = activation(x W1^T + b1, x W3^T + b3) (the kernels' epilogue; SiLU for most families).
    for (int u; (u = take(kGateUp, t).first) >= 0;) {
      const Unit& un = units_[u];
      const int rb = groups.row_begin[un.group] + un.r0;
      kernel_.GateUp(g, weights_[un.group], xin.At(rb, ldx, g.Kh), un.r1 - un.r0, act + size_t(rb) * lda, un.c0,
                     un.c1);
    }
    arrive(1);
    pool_.Barrier();
    if (g.int_activations()) {  // the down projection reads act quantized per row
      for (auto [r0, r1] = take(kQuantize, t); r0 >= 0; std::tie(r0, r1) = take(kQuantize, t))
        quantize(act, g.Ki, lda, aq, r0, r1);
      pool_.Barrier();
    }
    // Phase 2: y_r = weight_r * (act_r W2^T).
    for (int u; (u = take(kDown, t).first) >= 0;) {
      const Unit& un = down_units_[u];
      const int rb = groups.row_begin[un.group] + un.r0;
      kernel_.Down(g, weights_[un.group], ain.At(rb, lda, g.Ki), un.r1 - un.r0, weight + rb, y + size_t(rb) * ldy,
                   ldy, un.c0, un.c1);
    }
    arrive(2);
    pool_.Barrier();
    // Phase 3: out_t = sum of token t's rows of y, in units of `tok_claim`
    // tokens x one of `col_chunks` column ranges.
    float* my_acc = acc + size_t(t) * (g.Hn + 16);
    for (int u; (u = take(kCombine, t).first) >= 0;) {
      const int t0 = u / col_chunks * tok_claim, c0 = u % col_chunks * col_width, c1 = std::min(H, c0 + col_width);
      for (int tok = t0, te = std::min(n, t0 + tok_claim); tok < te; ++tok)
        SumRows(y + c0, ldy, token_rows_.data() + token_start_[tok], token_start_[tok + 1] - token_start_[tok],
                c1 - c0, out_dtype, out_row(tok) + size_t(c0) * elem, my_acc);
    }
  });

  if (stats != nullptr) {
    stats->distinct_experts = ngroups;
    stats->pairs = groups.total_pairs;
    stats->queue_ns = t_start - t_queue;
    const uint64_t t_end = NowNs();
    stats->compute_ns = t_end - t_start;
    const uint64_t t_gathered = phase_end[0].load(), t_gate_up = phase_end[1].load(), t_down = phase_end[2].load();
    stats->gather_ns = t_gathered - t_start;
    stats->gate_up_ns = t_gate_up - t_gathered;
    stats->down_ns = t_down - t_gate_up;
    stats->combine_ns = t_end - t_down;
  }
  return absl::OkStatus();
}

}  // namespace moe
