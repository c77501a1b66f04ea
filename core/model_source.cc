#include "core/model_source.h"

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/safetensors.h"
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
    if (absl::Status st = CheckExpertIndex(spec_, layer, expert); !st.ok()) return st;
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

class CheckpointSource final : public ModelSource {
 public:
  CheckpointSource(ModelSpec spec, std::unique_ptr<Checkpoint> ckpt, std::string dir)
      : spec_(std::move(spec)), ckpt_(std::move(ckpt)), dir_(std::move(dir)) {}
  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override {
    return absl::StrCat("checkpoint ", dir_, " (", ckpt_->num_tensors(), " tensors)");
  }
  absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const override {
    if (absl::Status st = CheckExpertIndex(spec_, layer, expert); !st.ok()) return st;
    out->Resize(spec_);
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
      const size_t n = static_cast<size_t>(w.rows * w.cols);
      switch (t->dtype) {
        case DType::kBF16:
          std::memcpy(w.dst->data(), t->data, n * 2);
          break;
        case DType::kF16:
          F16ToBf16(reinterpret_cast<const uint16_t*>(t->data), w.dst->data(), n);
          break;
        case DType::kF32:
          F32ToBf16(reinterpret_cast<const float*>(t->data), w.dst->data(), n);
          break;
        default:
          return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", DTypeName(t->dtype),
                                                         " not supported (BF16, F16, F32)"));
      }
      if (absl::Status st = CheckFinite(*w.dst, layer, expert, w.what); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

 private:
  ModelSpec spec_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::string dir_;
};

absl::StatusOr<std::unique_ptr<ModelSource>> OpenCheckpoint(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  if (!in) return absl::NotFoundError(absl::StrCat("model ", dir, ": no config.json"));
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": config.json is not valid JSON"));
  absl::StatusOr<ModelSpec> spec = ModelSpecFromConfig(config);
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", std::string(spec.status().message())));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  // The tensors are the truth for which layers have experts (dense layers have none).
  std::vector<int> moe_layers;
  for (int l = 0; l < spec->num_layers; ++l) {
    if ((*ckpt)->Find(ExpertTensorName(spec->naming, l, 0, Projection::kGate)) != nullptr)
      moe_layers.push_back(l);
  }
  if (moe_layers.empty())
    return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": no expert tensors named like ",
                                                   ExpertTensorName(spec->naming, 0, 0, Projection::kGate)));
  if (moe_layers != spec->moe_layers)
    LogWarning("model", "config.json implies ", spec->moe_layers.size(), " MoE layers, checkpoint has ",
               moe_layers.size(), "; using the checkpoint's");
  spec->moe_layers = std::move(moe_layers);
  return std::unique_ptr<ModelSource>(new CheckpointSource(*std::move(spec), *std::move(ckpt), dir));
}

}  // namespace

std::unique_ptr<ModelSource> MakeSyntheticSource(const ModelSpec& spec, uint64_t seed) {
  SyntheticModelUri uri;
  uri.seed = seed;
  return std::make_unique<SyntheticSource>(spec, uri, absl::StrCat("synthetic ", spec.Summary(), " seed ", seed));
}

absl::StatusOr<std::unique_ptr<ModelSource>> OpenModel(const std::string& uri) {
  if (IsSyntheticUri(uri)) {
    absl::StatusOr<SyntheticModelUri> u = ParseSyntheticUri(uri);
    if (!u.ok()) return u.status();
    absl::StatusOr<ModelSpec> spec = u->Spec();
    if (!spec.ok()) return spec.status();
    return std::unique_ptr<ModelSource>(new SyntheticSource(*std::move(spec), *u, uri));
  }
  return OpenCheckpoint(uri);
}

}  // namespace moe
