#include "expert_compute/expert_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "expert_compute/packed_index.h"
#include "core/status_macros.h"

namespace moe {

namespace {
size_t Stride(const ExpertGeometry& g) { return (g.packed_bytes() + 4095) / 4096 * 4096; }
std::string GiB(uint64_t b) { return absl::StrCat(static_cast<double>(b >> 20) / 1024.0, " GiB"); }
}  // namespace

absl::Status CheckWeightDtype(std::string_view weight_dtype) {
  if (weight_dtype == "auto" || weight_dtype == "bf16" || weight_dtype == "int8" || weight_dtype == "int4" ||
      weight_dtype == "fp8" || weight_dtype == "mxfp4")
    return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--weight-dtype: '", std::string(weight_dtype),
                                                 "' is not one of auto, bf16, int8, int4, fp8, mxfp4"));
}

absl::StatusOr<ExpertGeometry> StorageGeometry(const ModelSpec& spec, std::string_view weight_dtype) {
  MOE_RETURN_IF_ERROR(CheckWeightDtype(weight_dtype));
  auto at = [&](WeightFormat f, int group = 0) {
    return ExpertGeometry::For(spec.hidden, spec.intermediate, f, group).WithExpertMath(spec.activation, spec.expert_biases);
  };
  if (weight_dtype == "bf16") return at(WeightFormat::kBf16);
  if (weight_dtype == "int8") return at(WeightFormat::kInt8);
  // mxfp4: any checkpoint quantized per 32 k (an MXFP4 one's values come back exactly).
  const bool mxfp4_ckpt = spec.quant.scheme == WeightQuant::kMxfp4 ||
                          (spec.quant.scheme == WeightQuant::kGgufBlock && spec.quant.gguf_mxfp4);
  if (weight_dtype == "mxfp4" || (weight_dtype == "auto" && mxfp4_ckpt)) return at(WeightFormat::kMxfp4);
  const int ckpt_group =
      spec.quant.scheme == WeightQuant::kInt4Group && layout::Int4GroupServed(spec.quant.group_size) ? spec.quant.group_size : 0;
  if (weight_dtype == "int4") return at(WeightFormat::kInt4, ckpt_group);
  // auto on an fp8 checkpoint: its own codes and scales (exact), unless its
  // blocks are too narrow for the kernels' scale groups (then int8).
  const bool fp8_ckpt = spec.quant.scheme == WeightQuant::kFp8Block;
  if (weight_dtype == "auto" && fp8_ckpt)
    return spec.quant.block_cols % 64 == 0 ? at(WeightFormat::kFp8, spec.quant.block_cols) : at(WeightFormat::kInt8);
  if (weight_dtype == "fp8") {
    if (!fp8_ckpt) return at(WeightFormat::kFp8);
    // The checkpoint's block columns are the scale groups (the codes are kept as they are).
    if (spec.quant.block_cols % 64 != 0)
      return absl::InvalidArgumentError(absl::StrCat("--weight-dtype fp8: the checkpoint's fp8 blocks are ",
                                                     spec.quant.block_cols,
                                                     " columns wide, the kernels need a multiple of 64 (use int8)"));
    return at(WeightFormat::kFp8, spec.quant.block_cols);
  }
  // auto, other checkpoints. A GGUF's block-quantized experts: int8, Q4_K
  // included (int4's symmetric groups of >= 64 cannot hold Q4_K's asymmetric
  // sub-blocks of 32: 0.12 relative error, int8 0.8e-2).
  if (spec.quant.scheme == WeightQuant::kGgufBlock)
    return spec.quant.gguf_bits < 16 ? at(WeightFormat::kInt8) : at(WeightFormat::kBf16);
  // An int4 checkpoint: its own groups (Kimi-K2's 32, or any multiple of
  // 64); other widths as int8, which holds them to bf16 rounding
  // (re-quantizing into int4 groups of 128 was 8.2e-2 off the checkpoint's
  // values on a DeepSeek-V3-geometry layer).
  if (spec.quant.scheme == WeightQuant::kInt4Group)
    return ckpt_group > 0 ? at(WeightFormat::kInt4, ckpt_group) : at(WeightFormat::kInt8);
  return at(WeightFormat::kBf16);
}

uint64_t ExpertStore::BytesNeeded(const ExpertGeometry& g, const HostedSet& hosted) {
  return static_cast<uint64_t>(Stride(g)) * hosted.layers.size() * hosted.experts.size();
}

namespace {
// Reads expert (l, e) and packs it at dst: an fp8 checkpoint stored as fp8
// and an int4 one as int4 with their own codes and scales (an fp8 one whose
// blocks do not fit g's groups is refused; an int4 one is then packed from
// its bf16 values), anything else from its bf16 weights.
absl::Status PackOne(const ModelSource& source, const ExpertGeometry& g, int l, int e, ExpertWeights* w,
                     ExpertCodes* w8, std::byte* dst) {
  const WeightQuant scheme = source.spec().quant.scheme;
  const bool fp8 = g.format == WeightFormat::kFp8 && scheme == WeightQuant::kFp8Block;
  const bool int4 = g.format == WeightFormat::kInt4 && scheme == WeightQuant::kInt4Group;
  if (int4 || fp8) MOE_RETURN_IF_ERROR(source.ReadExpertCodes(l, e, w8));
  const absl::Status fit = int4 ? CodesFit(g, *w8) : absl::OkStatus();
  if (!fit.ok()) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      LogWarning("store", "int4 experts re-quantized from their bf16 values, not kept as the checkpoint's codes: ",
                 fit.message());
  }
  if (fp8 || (int4 && fit.ok())) {
    MOE_RETURN_IF_ERROR(PackExpertCodes(g, *w8, dst));
    if (!g.biases) return absl::OkStatus();
    MOE_RETURN_IF_ERROR(source.ReadExpert(l, e, w));  // the biases, which are not fp8
    PackBiases(g, w->gate_bias.data(), w->up_bias.data(), w->down_bias.data(), dst + g.gate_up_bytes() + g.down_bytes());
    return absl::OkStatus();
  }
  MOE_RETURN_IF_ERROR(source.ReadExpert(l, e, w));
  PackExpert(g, w->gate.data(), w->up.data(), w->down.data(), dst, w->gate_bias.data(), w->up_bias.data(),
             w->down_bias.data());
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Load(const ModelSource& source,
                                                               const ExpertGeometry& geometry, HostedSet hosted,
                                                               const NumaBinding& numa,
                                                               ComputePool& pool, bool shareable) {
  const ModelSpec& spec = source.spec();
  std::unique_ptr<ExpertStore> s(new ExpertStore());
  s->numa_ = &numa;
  if (geometry.H != spec.hidden || geometry.I != spec.intermediate || geometry.biases != spec.expert_biases ||
      geometry.activation != spec.activation)
    return absl::InvalidArgumentError(absl::StrCat("geometry: H=", geometry.H, " I=", geometry.I,
                                                   geometry.biases ? " with biases" : "", " for ", spec.Summary()));
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
  s->base_ = static_cast<std::byte*>(shareable ? numa.AllocateShared(need, &s->fd_) : numa.Allocate(need));
  if (s->base_ == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", GiB(need), ": ", std::strerror(errno)));

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
    ExpertCodes w8;
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < total;) {
      const int l = store->hosted_.layers[i / store->hosted_.experts.size()];
      const int e = store->hosted_.experts[i % store->hosted_.experts.size()];
      if (absl::Status st = PackOne(source, store->geometry_, l, e, &w, &w8, store->base_ + i * store->stride_);
          !st.ok()) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (error.ok()) error = st;
        failed.store(true);
        return;
      }
    }
  });
  if (!error.ok()) return error;
  // Readers map it read-only: no one may write, resize or reseal it from now on.
  if (s->fd_ >= 0 &&
      fcntl(s->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0)
    return absl::InternalError(absl::StrCat("sealing the shared expert store: ", std::strerror(errno)));
  return s;
}

namespace {
// The wire form of SharedStoreInfo (little-endian), then int32 layers, experts.
struct SharedStoreHeader {
  uint32_t magic, version;
  int32_t hidden, intermediate, format, group;
  uint64_t stride;
  uint32_t num_layers, num_experts;
};
constexpr uint32_t kSharedStoreMagic = 0x53454f4d;  // "MOES"
}  // namespace

std::string ExpertStore::SharedInfo() const {
  SharedStoreHeader h{kSharedStoreMagic, 1, geometry_.H, geometry_.I, static_cast<int32_t>(geometry_.format),
                      geometry_.group, stride_, static_cast<uint32_t>(hosted_.layers.size()),
                      static_cast<uint32_t>(hosted_.experts.size())};
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  for (const std::vector<int>* v : {&hosted_.layers, &hosted_.experts})
    for (int x : *v) {
      const int32_t i = x;
      out.append(reinterpret_cast<const char*>(&i), sizeof(i));
    }
  return out;
}

int64_t SharedStoreInfo::Offset(int layer, int expert) const {
  const auto l = std::lower_bound(layers.begin(), layers.end(), layer);
  const auto e = std::lower_bound(experts.begin(), experts.end(), expert);
  if (l == layers.end() || *l != layer || e == experts.end() || *e != expert) return -1;
  return static_cast<int64_t>(((l - layers.begin()) * experts.size() + (e - experts.begin())) * stride);
}

absl::StatusOr<SharedStoreInfo> ParseSharedStoreInfo(std::string_view blob, const ModelSpec& spec,
                                                     uint64_t store_bytes) {
  SharedStoreHeader h;
  if (blob.size() < sizeof(h)) return absl::InvalidArgumentError("shared store: description too short");
  std::memcpy(&h, blob.data(), sizeof(h));
  if (h.magic != kSharedStoreMagic || h.version != 1)
    return absl::InvalidArgumentError("shared store: bad magic or version");
  if (h.hidden != spec.hidden || h.intermediate != spec.intermediate)
    return absl::InvalidArgumentError(absl::StrCat("shared store: hidden/intermediate ", h.hidden, "/", h.intermediate,
                                                   ", the model has ", spec.hidden, "/", spec.intermediate));
  const bool int4 = h.format == static_cast<int>(WeightFormat::kInt4);
  const bool fp8 = h.format == static_cast<int>(WeightFormat::kFp8);
  const bool mxfp4 = h.format == static_cast<int>(WeightFormat::kMxfp4);
  if (h.format < 0 || h.format > static_cast<int>(WeightFormat::kMxfp4) || (int4 && !layout::Int4GroupServed(h.group)) ||
      (fp8 && (h.group <= 0 || h.group % 64 != 0)) || (mxfp4 && h.group != kMxfp4Block))
    return absl::InvalidArgumentError(absl::StrCat("shared store: format ", h.format, " group ", h.group));
  SharedStoreInfo info;
  info.geometry = ExpertGeometry::For(spec.hidden, spec.intermediate, static_cast<WeightFormat>(h.format), h.group)
                      .WithExpertMath(spec.activation, spec.expert_biases);
  info.stride = h.stride;
  if (h.stride < info.geometry.packed_bytes() || h.stride % 64 != 0)
    return absl::InvalidArgumentError(absl::StrCat("shared store: stride ", h.stride, " for experts of ",
                                                   info.geometry.packed_bytes(), " bytes"));
  if (blob.size() != sizeof(h) + 4ull * (uint64_t{h.num_layers} + h.num_experts))
    return absl::InvalidArgumentError("shared store: description size does not match its counts");
  const char* p = blob.data() + sizeof(h);
  auto read = [&](uint32_t n, int limit, const char* what, std::vector<int>* out) -> absl::Status {
    for (uint32_t i = 0; i < n; ++i, p += 4) {
      int32_t v;
      std::memcpy(&v, p, 4);
      if (v < 0 || v >= limit || (!out->empty() && v <= out->back()))
        return absl::InvalidArgumentError(absl::StrCat("shared store: ", what, " ", v, " out of range or order"));
      out->push_back(v);
    }
    return absl::OkStatus();
  };
  MOE_RETURN_IF_ERROR(read(h.num_layers, spec.num_layers, "layer", &info.layers));
  MOE_RETURN_IF_ERROR(read(h.num_experts, spec.num_experts, "expert", &info.experts));
  const uint64_t table = uint64_t{h.num_layers} * h.num_experts * h.stride;
  if (h.num_layers != 0 && table / h.num_layers / std::max<uint32_t>(h.num_experts, 1) != h.stride)
    return absl::InvalidArgumentError("shared store: table size overflows");
  if (table > store_bytes)
    return absl::InvalidArgumentError(absl::StrCat("shared store: table needs ", table, " bytes, the memory has ",
                                                   store_bytes));
  return info;
}

ExpertStore::~ExpertStore() {
  if (numa_ != nullptr) numa_->Free(base_, bytes_);
  if (fd_ >= 0) close(fd_);
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
