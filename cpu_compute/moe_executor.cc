#include "cpu_compute/moe_executor.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

namespace {
// Activation groups (16 columns each) per gate/up work unit, when there are
// enough units to keep every thread busy; else one group per unit.
constexpr int kGroupsPerUnit = 4;
// Rows of one expert per gate/up unit: large prefill groups are also split by
// rows so a single hot expert still spreads over every thread (a multiple of 32,
// the AMX kernel's two row blocks).
constexpr int kRowsPerUnit = 128;

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

absl::Status MoeExecutor::Validate(const ForwardBatch& b) const {
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

absl::Status MoeExecutor::Forward(const ForwardBatch& b, DType out_dtype, void* out,
                                  ForwardStats* stats) {
  if (absl::Status st = Validate(b); !st.ok()) return st;
  if (out_dtype != DType::kBF16 && out_dtype != DType::kF32)
    return absl::InvalidArgumentError("output_dtype: must be BF16 or F32");
  const ExpertGeometry& g = store_.geometry();
  const int H = g.H;
  const uint64_t t_queue = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t t_start = NowNs();

  GroupByExpert(b.routing, store_.num_experts(), kernel_.row_block(), &groups_);
  const int ngroups = groups_.num_groups();
  weights_.resize(ngroups);
  for (int i = 0; i < ngroups; ++i) weights_[i] = store_.Find(b.layer, groups_.expert[i]);

  // Gate/up work units, split over threads by estimated cost (weights streamed
  // plus rows computed), contiguous so each thread streams whole panels.
  units_.clear();
  std::vector<int64_t>& cost = cost_;
  cost.clear();
  int64_t total_cost = 0;
  const int T = pool_.size();
  int64_t row_chunks = 0;
  for (int i = 0; i < ngroups; ++i) row_chunks += (groups_.count[i] + kRowsPerUnit - 1) / kRowsPerUnit;
  const int per_unit = row_chunks * g.gate_up_groups() >= int64_t{4} * kGroupsPerUnit * T ? kGroupsPerUnit : 1;
  for (int i = 0; i < ngroups; ++i) {
    for (int r = 0; r < groups_.count[i]; r += kRowsPerUnit) {
      const int re = std::min(groups_.count[i], r + kRowsPerUnit);
      const int m = (re - r + kernel_.row_block() - 1) / kernel_.row_block() * kernel_.row_block();
      for (int c = 0; c < g.gate_up_groups(); c += per_unit) {
        const int ce = std::min(g.gate_up_groups(), c + per_unit);
        units_.push_back({i, c, ce, r, re});
        total_cost += int64_t{ce - c} * (16 + m);
        cost.push_back(total_cost);
      }
    }
  }
  unit_bounds_.assign(T + 1, 0);
  for (int t = 1, u = 0; t <= T; ++t) {
    const int64_t limit = total_cost * t / T;
    while (u < static_cast<int>(units_.size()) && cost[u] <= limit) ++u;
    unit_bounds_[t] = t == T ? static_cast<int>(units_.size()) : u;
  }

  const size_t rows = static_cast<size_t>(groups_.total_rows);
  bf16_t* x = static_cast<bf16_t*>(x_buf_.Reserve(std::max<size_t>(1, rows * g.Kh * 2)));
  bf16_t* act = static_cast<bf16_t*>(act_buf_.Reserve(std::max<size_t>(1, rows * g.Ki * 2)));
  float* out32 = out_dtype == DType::kF32
                     ? static_cast<float*>(out)
                     : static_cast<float*>(out_buf_.Reserve(std::max<size_t>(1, size_t(b.n) * H * 4)));
  const int n = b.n;

  pool_.Run([&](int t, int nt) {
    // Phase 0: gather each row's token (padding rows and columns zero).
    auto [r0, r1] = Split(static_cast<int>(rows), t, nt);
    for (int r = r0; r < r1; ++r) {
      bf16_t* dst = x + static_cast<size_t>(r) * g.Kh;
      const int32_t tok = groups_.token[r];
      if (tok >= 0) {
        std::memcpy(dst, b.tokens + static_cast<size_t>(tok) * H, size_t(H) * 2);
        std::memset(dst + H, 0, size_t(g.Kh - H) * 2);
      } else {
        std::memset(dst, 0, size_t(g.Kh) * 2);
      }
    }
    pool_.Barrier();
    // Phase 1: act = silu(x W1^T) * (x W3^T), per (expert, column block).
    for (int u = unit_bounds_[t]; u < unit_bounds_[t + 1]; ++u) {
      const Unit& un = units_[u];
      const size_t rb = size_t(groups_.row_begin[un.group]) + un.r0;
      kernel_.GateUp(g, weights_[un.group], x + rb * g.Kh, un.r1 - un.r0, act + rb * g.Ki, un.c0, un.c1);
    }
    pool_.Barrier();
    // Phase 2: each thread owns output columns [32*c0, 32*c1) of every token:
    // zero them, add every expert's weighted down projection, convert.
    auto [c0, c1] = Split(g.down_groups(), t, nt);
    if (c0 == c1) return;
    const int col0 = 32 * c0, col1 = std::min(H, 32 * c1);
    for (int tok = 0; tok < n; ++tok) {
      std::memset(out32 + size_t(tok) * H + col0, 0, size_t(col1 - col0) * 4);
    }
    for (int i = 0; i < ngroups; ++i) {
      const int rb = groups_.row_begin[i];
      kernel_.DownAccumulate(g, weights_[i], act + size_t(rb) * g.Ki, groups_.count[i], groups_.token.data() + rb,
                             groups_.weight.data() + rb, out32, H, c0, c1);
    }
    if (out_dtype == DType::kBF16) {
      bf16_t* o = static_cast<bf16_t*>(out);
      for (int tok = 0; tok < n; ++tok) {
        F32ToBf16(out32 + size_t(tok) * H + col0, o + size_t(tok) * H + col0, size_t(col1 - col0));
      }
    }
  });

  if (stats != nullptr) {
    stats->distinct_experts = ngroups;
    stats->pairs = groups_.total_pairs;
    stats->queue_ns = t_start - t_queue;
    stats->compute_ns = NowNs() - t_start;
  }
  return absl::OkStatus();
}

}  // namespace moe
