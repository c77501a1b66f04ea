#include "core/model_source.h"

#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "core/synthetic_model.h"
#include "nlohmann/json.hpp"

namespace moe {

void ExpertWeights::Resize(const ModelSpec& spec) {
  const size_t n = static_cast<size_t>(spec.hidden) * spec.intermediate;
  gate.resize(n);
  up.resize(n);
  down.resize(n);
}

namespace {

absl::Status CheckExpertIndex(const ModelSpec& spec, int layer, int expert) {
  if (!spec.IsMoeLayer(layer))
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not an MoE layer"));
  if (expert < 0 || expert >= spec.num_experts)
    return absl::InvalidArgumentError(
        absl::StrCat("expert ", expert, " out of range [0, ", spec.num_experts, ")"));
  return absl::OkStatus();
}

absl::Status CheckFinite(const std::vector<bf16_t>& v, int layer, int expert, const char* what) {
  if (AllFiniteBf16(v.data(), v.size())) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("layer ", layer, " expert ", expert, " ", what, " holds NaN or Inf weights"));
}

class SyntheticSource final : public ModelSource {
 public:
  SyntheticSource(ModelSpec spec, SyntheticModelUri uri, std::string text)
      : spec_(std::move(spec)), uri_(std::move(uri)), text_(std::move(text)) {}
  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override { return absl::StrCat(text_, " (generated in memory)"); }
  absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const override {
    MOE_RETURN_IF_ERROR(CheckExpertIndex(spec_, layer, expert));
    out->Resize(spec_);
    const int H = spec_.hidden, I = spec_.intermediate;
    GenerateExpertMatrix(uri_.seed, layer, expert, Projection::kGate, I, H, out->gate.data());
    GenerateExpertMatrix(uri_.seed, layer, expert, Projection::kUp, I, H, out->up.data());
    GenerateExpertMatrix(uri_.seed, layer, expert, Projection::kDown, H, I, out->down.data());
    return absl::OkStatus();
  }

 private:
  ModelSpec spec_;
  SyntheticModelUri uri_;
  std::string text_;
};

// n values of tensor `t` from element `offset` on, as bf16 (BF16, F16, F32).
absl::Status ToBf16(const TensorInfo& t, size_t offset, size_t n, bf16_t* dst) {
  switch (t.dtype) {
    case DType::kBF16:
      std::memcpy(dst, reinterpret_cast<const bf16_t*>(t.data) + offset, n * 2);
      return absl::OkStatus();
    case DType::kF16:
      F16ToBf16(reinterpret_cast<const uint16_t*>(t.data) + offset, dst, n);
      return absl::OkStatus();
    case DType::kF32:
      F32ToBf16(reinterpret_cast<const float*>(t.data) + offset, dst, n);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(t.name, ": dtype ", DTypeName(t.dtype), " not supported (BF16, F16, F32)"));
  }
}

// Fused 3-D expert tensors of one layer (all experts in one tensor):
//   {prefix}gate_up_proj  [E, 2I, H]  (transformers' in-memory layout, rows = outputs)
//                      or [E, H, 2I]  (Llama 4 / GPT-OSS: x @ W; GPT-OSS interleaves gate/up columns)
//   {prefix}down_proj     [E, H, I]   or [E, I, H] respectively
// The orientation is read from down_proj's shape (x @ W when it is [E, I, H]
// and I != H).
struct FusedExperts {
  const TensorInfo* gate_up = nullptr;
  const TensorInfo* down = nullptr;
  bool x_times_w = false;    // [E, H, 2I] / [E, I, H]
  bool interleaved = false;  // gate = even columns, up = odd (GPT-OSS)
};

std::string FusedPrefix(ExpertNaming naming, int layer) {
  return absl::StrCat("model.layers.", layer,
                      naming == ExpertNaming::kBlockSparseMoe ? ".block_sparse_moe.experts." : ".mlp.experts.");
}

// The fused tensors of `layer`, or nullopt when it has none; InvalidArgument
// naming the tensor when their shapes do not fit the model.
absl::StatusOr<std::optional<FusedExperts>> FindFused(const Checkpoint& ckpt, const ModelSpec& spec, int layer) {
  const std::string prefix = FusedPrefix(spec.naming, layer);
  FusedExperts f;
  f.gate_up = ckpt.Find(prefix + "gate_up_proj");
  f.down = ckpt.Find(prefix + "down_proj");
  if (f.gate_up == nullptr && f.down == nullptr) return std::optional<FusedExperts>();
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  if (f.gate_up == nullptr || f.down == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(prefix, "gate_up_proj and ", prefix, "down_proj: only one present"));
  using Shape = std::vector<int64_t>;
  if (f.down->shape == Shape{E, H, I}) {
    f.x_times_w = false;
  } else if (f.down->shape == Shape{E, I, H}) {
    f.x_times_w = true;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(f.down->name, ": shape ", ShapeString(f.down->shape), ", expected [",
                                                   E, ",", H, ",", I, "] or [", E, ",", I, ",", H, "]"));
  }
  const Shape want = f.x_times_w ? Shape{E, H, 2 * I} : Shape{E, 2 * I, H};
  if (f.gate_up->shape != want)
    return absl::InvalidArgumentError(
        absl::StrCat(f.gate_up->name, ": shape ", ShapeString(f.gate_up->shape), ", expected ", ShapeString(want)));
  f.interleaved = f.x_times_w && spec.model_type.rfind("gpt_oss", 0) == 0;
  return std::optional<FusedExperts>(f);
}

class CheckpointSource final : public ModelSource {
 public:
  CheckpointSource(ModelSpec spec, std::unique_ptr<Checkpoint> ckpt, std::string dir,
                   std::map<int, FusedExperts> fused)
      : spec_(std::move(spec)), ckpt_(std::move(ckpt)), dir_(std::move(dir)), fused_(std::move(fused)) {}
  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override {
    return absl::StrCat("checkpoint ", dir_, " (", ckpt_->num_tensors(), " tensors)");
  }
  absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const override {
    MOE_RETURN_IF_ERROR(CheckExpertIndex(spec_, layer, expert));
    out->Resize(spec_);
    if (auto it = fused_.find(layer); it != fused_.end()) return ReadFused(it->second, layer, expert, out);
    const int64_t H = spec_.hidden, I = spec_.intermediate;
    struct Want { Projection p; std::vector<bf16_t>* dst; int64_t rows, cols; const char* what; };
    for (const Want& w : {Want{Projection::kGate, &out->gate, I, H, "gate"},
                          Want{Projection::kUp, &out->up, I, H, "up"},
                          Want{Projection::kDown, &out->down, H, I, "down"}}) {
      const std::string name = ExpertTensorName(spec_.naming, layer, expert, w.p);
      const TensorInfo* t = ckpt_->Find(name);
      if (t == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor ", name));
      if (t->shape != std::vector<int64_t>{w.rows, w.cols})
        return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeString(t->shape),
                                                       ", expected [", w.rows, ",", w.cols, "]"));
      MOE_RETURN_IF_ERROR(ToBf16(*t, 0, static_cast<size_t>(w.rows * w.cols), w.dst->data()));
      MOE_RETURN_IF_ERROR(CheckFinite(*w.dst, layer, expert, w.what));
    }
    return absl::OkStatus();
  }

 private:
  // Expert `expert` out of a layer's fused tensors, into gate [I,H], up [I,H], down [H,I].
  absl::Status ReadFused(const FusedExperts& f, int layer, int expert, ExpertWeights* out) const {
    const size_t H = spec_.hidden, I = spec_.intermediate, e = static_cast<size_t>(expert);
    std::vector<bf16_t> slab(2 * I * H);
    MOE_RETURN_IF_ERROR(ToBf16(*f.gate_up, e * 2 * I * H, slab.size(), slab.data()));
    if (!f.x_times_w) {  // [2I, H]: gate rows then up rows, already [I,H] each
      std::copy(slab.begin(), slab.begin() + I * H, out->gate.begin());
      std::copy(slab.begin() + I * H, slab.end(), out->up.begin());
    } else {  // [H, 2I]: transpose; gate/up columns concatenated or interleaved
      for (size_t h = 0; h < H; ++h)
        for (size_t i = 0; i < I; ++i) {
          const size_t g = f.interleaved ? 2 * i : i, u = f.interleaved ? 2 * i + 1 : I + i;
          out->gate[i * H + h] = slab[h * 2 * I + g];
          out->up[i * H + h] = slab[h * 2 * I + u];
        }
    }
    if (!f.x_times_w) {  // [H, I] as is
      MOE_RETURN_IF_ERROR(ToBf16(*f.down, e * H * I, H * I, out->down.data()));
    } else {  // [I, H] -> [H, I]
      slab.resize(I * H);
      MOE_RETURN_IF_ERROR(ToBf16(*f.down, e * I * H, I * H, slab.data()));
      for (size_t i = 0; i < I; ++i)
        for (size_t h = 0; h < H; ++h) out->down[h * I + i] = slab[i * H + h];
    }
    for (auto [v, what] : {std::pair{&out->gate, "gate"}, std::pair{&out->up, "up"}, std::pair{&out->down, "down"}})
      MOE_RETURN_IF_ERROR(CheckFinite(*v, layer, expert, what));
    return absl::OkStatus();
  }

  ModelSpec spec_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::string dir_;
  std::map<int, FusedExperts> fused_;  // layers whose experts are fused 3-D tensors
};

absl::StatusOr<std::unique_ptr<ModelSource>> OpenCheckpoint(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  if (!in) return absl::NotFoundError(absl::StrCat("model ", dir, ": no config.json"));
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": config.json is not valid JSON"));
  absl::StatusOr<ModelSpec> spec = ModelSpecFromConfig(config);
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", std::string(spec.status().message())));
  MOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  // The tensors are the truth for which layers have experts (dense layers have none).
  // Per-expert tensors, or fused 3-D ones (FusedExperts).
  std::vector<int> moe_layers;
  std::map<int, FusedExperts> fused;
  for (int l = 0; l < spec->num_layers; ++l) {
    if (ckpt->Find(ExpertTensorName(spec->naming, l, 0, Projection::kGate)) != nullptr) {
      moe_layers.push_back(l);
      continue;
    }
    absl::StatusOr<std::optional<FusedExperts>> f = FindFused(*ckpt, *spec, l);
    if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", f.status().message()));
    if (f->has_value()) {
      moe_layers.push_back(l);
      fused[l] = **f;
    }
  }
  if (moe_layers.empty())
    return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": no expert tensors named like ",
                                                   ExpertTensorName(spec->naming, 0, 0, Projection::kGate)));
  if (moe_layers != spec->moe_layers)
    LogWarning("model", "config.json implies ", spec->moe_layers.size(), " MoE layers, checkpoint has ",
               moe_layers.size(), "; using the checkpoint's");
  spec->moe_layers = std::move(moe_layers);
  return std::unique_ptr<ModelSource>(new CheckpointSource(*std::move(spec), std::move(ckpt), dir, std::move(fused)));
}

}  // namespace

std::unique_ptr<ModelSource> MakeSyntheticSource(const ModelSpec& spec, uint64_t seed) {
  SyntheticModelUri uri;
  uri.seed = seed;
  return std::make_unique<SyntheticSource>(spec, uri, absl::StrCat("synthetic ", spec.Summary(), " seed ", seed));
}

absl::StatusOr<std::unique_ptr<ModelSource>> OpenModel(const std::string& uri) {
  if (IsSyntheticUri(uri)) {
    MOE_ASSIGN_OR_RETURN(SyntheticModelUri u, ParseSyntheticUri(uri));
    MOE_ASSIGN_OR_RETURN(ModelSpec spec, u.Spec());
    return std::unique_ptr<ModelSource>(new SyntheticSource(std::move(spec), u, uri));
  }
  return OpenCheckpoint(uri);
}

}  // namespace moe
