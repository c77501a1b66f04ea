#include "cpu_compute/expert_store.h"

#include <atomic>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace moe {

namespace {
size_t Stride(const ExpertGeometry& g) { return (g.packed_bytes() + 4095) / 4096 * 4096; }
std::string GiB(uint64_t b) { return absl::StrCat(static_cast<double>(b >> 20) / 1024.0, " GiB"); }
}  // namespace

absl::StatusOr<ExpertGeometry> StorageGeometry(const ModelSpec& spec, std::string_view weight_dtype) {
  auto at = [&](WeightFormat f, int group = 0) { return ExpertGeometry::For(spec.hidden, spec.intermediate, f, group); };
  if (weight_dtype == "bf16") return at(WeightFormat::kBf16);
  if (weight_dtype == "int8") return at(WeightFormat::kInt8);
  const int ckpt_group = spec.quant.scheme == WeightQuant::kInt4Group && spec.quant.group_size % 64 == 0 ? spec.quant.group_size : 0;
  if (weight_dtype == "int4") return at(WeightFormat::kInt4, ckpt_group);
  if (weight_dtype == "auto") {
    switch (spec.quant.scheme) {
      case WeightQuant::kFp8Block: return at(WeightFormat::kInt8);
      case WeightQuant::kInt4Group: return at(WeightFormat::kInt4, ckpt_group);
      default: return at(WeightFormat::kBf16);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--weight-dtype: '", std::string(weight_dtype), "' is not one of auto, bf16, int8, int4"));
}

uint64_t ExpertStore::BytesNeeded(const ExpertGeometry& g, const HostedSet& hosted) {
  return static_cast<uint64_t>(Stride(g)) * hosted.layers.size() * hosted.experts.size();
}

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Load(const ModelSource& source,
                                                               const ExpertGeometry& geometry, HostedSet hosted,
                                                               const NumaBinding& numa,
                                                               ComputePool& pool) {
  const ModelSpec& spec = source.spec();
  std::unique_ptr<ExpertStore> s(new ExpertStore());
  s->numa_ = &numa;
  if (geometry.H != spec.hidden || geometry.I != spec.intermediate)
    return absl::InvalidArgumentError(absl::StrCat("geometry: H=", geometry.H, " I=", geometry.I, " for ", spec.Summary()));
  s->geometry_ = geometry;
  s->stride_ = Stride(s->geometry_);
  s->num_layers_ = spec.num_layers;
  s->num_experts_ = spec.num_experts;
  s->layer_slot_.assign(spec.num_layers, -1);
  s->expert_slot_.assign(spec.num_experts, -1);
  for (size_t i = 0; i < hosted.layers.size(); ++i) {
    const int l = hosted.layers[i];
    if (!spec.IsMoeLayer(l))
      return absl::InvalidArgumentError(absl::StrCat("--layers: layer ", l, " is not an MoE layer of ", spec.Summary()));
    s->layer_slot_[l] = static_cast<int>(i);
  }
  for (size_t i = 0; i < hosted.experts.size(); ++i) {
    const int e = hosted.experts[i];
    if (e < 0 || e >= spec.num_experts)
      return absl::InvalidArgumentError(absl::StrCat("--experts: expert ", e, " out of range [0, ", spec.num_experts, ")"));
    s->expert_slot_[e] = static_cast<int>(i);
  }
  const uint64_t need = BytesNeeded(s->geometry_, hosted);
  const uint64_t avail = AvailableMemoryBytes();
  const uint64_t node_mem = numa.num_nodes() > 1 ? numa.node_memory_bytes() : 0;
  // Keep a margin for the process itself, the page cache of a checkpoint and workspaces.
  const uint64_t margin = std::max<uint64_t>(uint64_t{1} << 30, avail / 20);
  if (avail != 0 && need + margin > avail)
    return absl::ResourceExhaustedError(absl::StrCat(
        "model does not fit in memory: the hosted experts need ", GiB(need), " (", need,
        " bytes) of packed weights plus a ", GiB(margin), " margin, but only ", GiB(avail),
        " are available; host fewer layers (--layers) or experts (--experts), or use more servers"));
  if (node_mem != 0 && need > node_mem)
    return absl::ResourceExhaustedError(absl::StrCat("hosted experts need ", GiB(need), " but NUMA node ",
                                                     numa.node(), " has ", GiB(node_mem)));
  s->bytes_ = need;
  s->hosted_ = std::move(hosted);
  s->base_ = static_cast<std::byte*>(numa.Allocate(need));
  if (s->base_ == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", GiB(need)));

  // Pack in parallel: each pool thread (pinned to the node, so pages land there)
  // takes the next expert, reads it in row-major bf16 and packs it.
  const size_t total = s->hosted_.layers.size() * s->hosted_.experts.size();
  std::atomic<size_t> next{0};
  std::mutex err_mu;
  absl::Status error;
  std::atomic<bool> failed{false};
  ExpertStore* store = s.get();
  pool.Run([&](int, int) {
    ExpertWeights w;
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < total;) {
      const int l = store->hosted_.layers[i / store->hosted_.experts.size()];
      const int e = store->hosted_.experts[i % store->hosted_.experts.size()];
      if (absl::Status st = source.ReadExpert(l, e, &w); !st.ok()) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (error.ok()) error = st;
        failed.store(true);
        return;
      }
      PackExpert(store->geometry_, w.gate.data(), w.up.data(), w.down.data(), store->base_ + i * store->stride_);
    }
  });
  if (!error.ok()) return error;
  return s;
}

ExpertStore::~ExpertStore() {
  if (numa_ != nullptr) numa_->Free(base_, bytes_);
}

const std::byte* ExpertStore::Find(int layer, int expert) const {
  if (layer < 0 || layer >= num_layers_ || expert < 0 || expert >= num_experts_) return nullptr;
  const int ls = layer_slot_[layer], es = expert_slot_[expert];
  if (ls < 0 || es < 0) return nullptr;
  return base_ + (static_cast<size_t>(ls) * hosted_.experts.size() + es) * stride_;
}

bool ExpertStore::HostsLayer(int layer) const {
  return layer >= 0 && layer < num_layers_ && layer_slot_[layer] >= 0;
}
bool ExpertStore::HostsExpert(int expert) const {
  return expert >= 0 && expert < num_experts_ && expert_slot_[expert] >= 0;
}

}  // namespace moe
