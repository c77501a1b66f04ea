#include "cpu_compute/moe_executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/atomic_max.h"
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
// Below this many rows per expert on average, the down phase takes output
// columns in kDownChunksFewRows chunks per thread, else one (RunLocked).
constexpr int kDownFewRowsPerExpert = 32;
constexpr int kDownChunksFewRows = 3;

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// [lo, hi) of `count` items for thread t of n: contiguous and balanced.
inline std::pair<int, int> Split(int count, int t, int n) {
  return {static_cast<int>(int64_t{count} * t / n), static_cast<int>(int64_t{count} * (t + 1) / n)};
}
}  // namespace

MoeExecutor::Buffer::~Buffer() { std::free(p_); }

void* MoeExecutor::Buffer::Reserve(size_t bytes) {
  if (bytes <= cap_) return p_;
  std::free(p_);
  // Grow with slack so a slightly larger batch does not reallocate.
  cap_ = ((bytes + bytes / 4) + 4095) / 4096 * 4096;
  p_ = std::aligned_alloc(64, cap_);
  return p_;
}

MoeExecutor::MoeExecutor(const PackedExperts& store, const ExpertKernel& kernel, ComputePool& pool)
    : store_(store), kernel_(kernel), pool_(pool) {}

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
  const uint64_t t_queue = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t t_start = NowNs();
  GroupByExpert(b.routing, store_.num_experts(), row_align(), &groups_);
  return RunLocked(b.layer, b.n, b.tokens, groups_, nullptr, out_dtype, out, stats, t_queue, t_start);
}

absl::Status MoeExecutor::Run(int layer, int n, const bf16_t* tokens, const ExpertGroups& groups,
                              const int32_t* store_expert, DType out_dtype, void* out, ForwardStats* stats) {
  MOE_RETURN_IF_ERROR(CheckOutputDType(out_dtype));
  if (n < 0) return absl::InvalidArgumentError("tokens: negative token count");
  MOE_RETURN_IF_ERROR(CheckGroups(groups, n, row_align()));
  const uint64_t t_queue = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  return RunLocked(layer, n, tokens, groups, store_expert, out_dtype, out, stats, t_queue, NowNs());
}

// Gate/up work units, each a whole weight panel (kGroupsPerUnit activation
// groups) against at most kRowsPerUnit rows of one expert. Threads take them
// in turn (RunLocked): cores of one host run at different speeds under AMX
// (measured: a fixed, equal split left the fastest thread idle 25% of the
// phase), so a static split by estimated cost waits for the slowest.
void MoeExecutor::PlanUnits(const ExpertGroups& groups) {
  const ExpertGeometry& g = store_.geometry();
  const int ngroups = groups.num_groups();
  units_.clear();
  const int T = pool_.size();
  int64_t row_chunks = 0;
  for (int i = 0; i < ngroups; ++i) row_chunks += (groups.count[i] + kRowsPerUnit - 1) / kRowsPerUnit;
  const int per_unit = row_chunks * g.gate_up_groups() >= int64_t{4} * kGroupsPerUnit * T ? kGroupsPerUnit : 1;
  for (int i = 0; i < ngroups; ++i) {
    for (int r = 0; r < groups.count[i]; r += kRowsPerUnit) {
      const int re = std::min(groups.count[i], r + kRowsPerUnit);
      for (int c = 0; c < g.gate_up_groups(); c += per_unit) {
        const int ce = std::min(g.gate_up_groups(), c + per_unit);
        units_.push_back({i, c, ce, r, re});
      }
    }
  }
}

// Long: one parallel region (gather, gate/up, down) whose three phases share
// the region's scratch and barriers; split, each would need them passed in.
absl::Status MoeExecutor::RunLocked(int layer, int n, const bf16_t* tokens, const ExpertGroups& groups,
                                    const int32_t* store_expert, DType out_dtype, void* out,
                                    ForwardStats* stats, uint64_t t_queue, uint64_t t_start) {
  const ExpertGeometry& g = store_.geometry();
  const int H = g.H;
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
  // and the kernels read whole row blocks of token/weight, so those get
  // padding rows (token -1, weight 0) in scratch of our own.
  const int align = row_align();
  const size_t rows = static_cast<size_t>((groups.total_rows + align - 1) / align * align);
  const int32_t* token = groups.token.data();
  const float* weight = groups.weight.data();
  if (rows != static_cast<size_t>(groups.total_rows)) {
    pad_token_.assign(groups.token.begin(), groups.token.begin() + groups.total_rows);
    pad_token_.resize(rows, -1);
    pad_weight_.assign(groups.weight.begin(), groups.weight.begin() + groups.total_rows);
    pad_weight_.resize(rows, 0.0f);
    token = pad_token_.data();
    weight = pad_weight_.data();
  }
  const int ldx = g.ldx(), lda = g.lda();  // row strides (expert_kernel.h)
  bf16_t* x = static_cast<bf16_t*>(x_buf_.Reserve(std::max<size_t>(1, rows * ldx * 2)));
  bf16_t* act = static_cast<bf16_t*>(act_buf_.Reserve(std::max<size_t>(1, rows * lda * 2)));
  // Outputs accumulate in f32 rows of our own, one 64-byte line longer than
  // a multiple of 128 bytes: at ldo = H = 2048 every token's slice of a
  // column chunk fell into the same few cache sets (8 KiB apart). (Measured
  // with the other changes of bench/RESULTS.md stop 20, not alone; the down
  // phase's excess over gate/up's rate remains.) Each chunk is copied out
  // (converted to bf16, or as f32) at the end.
  const int ldo = g.Hn + 16;
  float* out32 = static_cast<float*>(out_buf_.Reserve(std::max<size_t>(1, size_t(n) * ldo * 4)));
  // Integer weights: the kernels read the rows quantized (QuantizeRows):
  // q [2 rows, ld], scale [rows], sum64 [2 rows, K/64] per input.
  struct Quantized {
    int8_t* q = nullptr;
    float* scale = nullptr;
    int32_t* sum64 = nullptr;
  } xq, aq;
  auto reserve = [&](Buffer& b, size_t K, size_t ld, Quantized* dst) {
    std::byte* p = static_cast<std::byte*>(b.Reserve(std::max<size_t>(1, rows * (2 * ld + 4 + K / 8))));
    *dst = {reinterpret_cast<int8_t*>(p), reinterpret_cast<float*>(p + rows * 2 * ld),
            reinterpret_cast<int32_t*>(p + rows * (2 * ld + 4))};
  };
  if (g.int_activations()) {
    reserve(xq_buf_, g.Kh, ldx, &xq);
    reserve(actq_buf_, g.Ki, lda, &aq);
  }
  const KernelRows xin{x, xq.q, xq.scale, xq.sum64}, ain{act, aq.q, aq.scale, aq.sum64};
  auto quantize = [&](const bf16_t* src, int K, int ld, const Quantized& dst, int r0, int r1) {
    if (!g.int_activations() || r0 >= r1) return;
    QuantizeRows(src + size_t(r0) * ld, r1 - r0, K, ld, dst.q + size_t(2 * r0) * ld, dst.scale + r0,
                 dst.sum64 + size_t(2 * r0) * (K / 64));
  };

  // Work taken in turn: gate/up units, then down column chunks, each chunk
  // reading every expert's act rows once. Few rows per expert (decode): the
  // weights dominate and finer chunks balance the cores better (measured:
  // 3 per thread 8-25% faster than 1 at 8 tokens x top-8); many rows: act
  // dominates and one chunk per thread reads it least (3 per thread: 5-10%
  // slower at 1024 rows).
  std::atomic<int> next_unit{0}, next_down{0};
  const bool few_rows = groups.total_rows < kDownFewRowsPerExpert * std::max(1, ngroups);
  const int down_chunk = std::max(1, g.down_groups() / ((few_rows ? kDownChunksFewRows : 1) * pool_.size()));
  // Phase ends: the last thread's arrival at the barrier (ForwardStats).
  std::atomic<uint64_t> phase_end[2] = {0, 0};
  auto arrive = [&](int p) { AtomicMax(phase_end[p], NowNs(), std::memory_order_relaxed); };
  pool_.Run([&](int t, int nt) {
    // Phase 0: gather each row's token (padding rows and columns zero).
    auto [r0, r1] = Split(static_cast<int>(rows), t, nt);
    for (int r = r0; r < r1; ++r) {
      bf16_t* dst = x + static_cast<size_t>(r) * ldx;
      const int32_t tok = token[r];
      if (tok >= 0) {
        std::memcpy(dst, tokens + static_cast<size_t>(tok) * H, size_t(H) * 2);
        std::memset(dst + H, 0, size_t(g.Kh - H) * 2);
      } else {
        std::memset(dst, 0, size_t(g.Kh) * 2);
      }
    }
    quantize(x, g.Kh, ldx, xq, r0, r1);
    arrive(0);
    pool_.Barrier();
    // Phase 1: act = silu(x W1^T) * (x W3^T), per (expert, column block),
    // units taken in turn.
    for (int u; (u = next_unit.fetch_add(1, std::memory_order_relaxed)) < static_cast<int>(units_.size());) {
      const Unit& un = units_[u];
      const int rb = groups.row_begin[un.group] + un.r0;
      kernel_.GateUp(g, weights_[un.group], xin.At(rb, ldx, g.Kh), un.r1 - un.r0, act + size_t(rb) * lda, un.c0,
                     un.c1);
    }
    arrive(1);
    pool_.Barrier();
    if (g.int_activations()) {  // the down projection reads act quantized per row
      quantize(act, g.Ki, lda, aq, r0, r1);
      pool_.Barrier();
    }
    // Phase 2: a thread takes output column chunks [32*c0, 32*c1) of every
    // token in turn: zeroes them, adds every expert's weighted down
    // projection, converts. A chunk is a column range nobody else writes.
    for (int c0; (c0 = next_down.fetch_add(down_chunk, std::memory_order_relaxed)) < g.down_groups();) {
      const int c1 = std::min(g.down_groups(), c0 + down_chunk);
      const int col0 = 32 * c0, col1 = std::min(H, 32 * c1);
      for (int tok = 0; tok < n; ++tok) {
        std::memset(out32 + size_t(tok) * ldo + col0, 0, size_t(col1 - col0) * 4);
      }
      for (int i = 0; i < ngroups; ++i) {
        const int rb = groups.row_begin[i];
        kernel_.DownAccumulate(g, weights_[i], ain.At(rb, lda, g.Ki), groups.count[i], token + rb, weight + rb,
                               out32, ldo, c0, c1);
      }
      for (int tok = 0; tok < n; ++tok) {
        const float* src = out32 + size_t(tok) * ldo + col0;
        if (out_dtype == DType::kBF16) {
          F32ToBf16(src, static_cast<bf16_t*>(out) + size_t(tok) * H + col0, size_t(col1 - col0));
        } else {
          std::memcpy(static_cast<float*>(out) + size_t(tok) * H + col0, src, size_t(col1 - col0) * 4);
        }
      }
    }
  });

  if (stats != nullptr) {
    stats->distinct_experts = ngroups;
    stats->pairs = groups.total_pairs;
    stats->queue_ns = t_start - t_queue;
    const uint64_t t_end = NowNs();
    stats->compute_ns = t_end - t_start;
    const uint64_t t_gathered = phase_end[0].load(), t_gate_up = phase_end[1].load();
    stats->gather_ns = t_gathered - t_start;
    stats->gate_up_ns = t_gate_up - t_gathered;
    stats->down_ns = t_end - t_gate_up;
  }
  return absl::OkStatus();
}

}  // namespace moe
