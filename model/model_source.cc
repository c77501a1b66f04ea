#include "model/model_source.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/gguf.h"
#include "model/gguf_model.h"
#include "core/log.h"
#include "model/model_identity.h"
#include "model/quantization.h"
#include "model/safetensors.h"
#include "core/status_macros.h"
#include "model/synthetic_model.h"
#include "nlohmann/json.hpp"

namespace moe {

void ExpertWeights::Resize(const ModelSpec& spec) {
  const size_t n = static_cast<size_t>(spec.hidden) * spec.intermediate;
  gate.resize(n);
  up.resize(n);
  down.resize(n);
  const bool b = spec.expert_biases;
  gate_bias.resize(b ? spec.intermediate : 0);
  up_bias.resize(b ? spec.intermediate : 0);
  down_bias.resize(b ? spec.hidden : 0);
}

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

ModelIdentity IdentityOf(const ModelSource& source, const std::string& model) {
  return ModelIdentity{source.Identity(), model, ExpertMathName(source.spec()), RoutingModeName(source.spec().routing)};
}

std::vector<uint64_t> ModelIdentityHeader(const char* form, const ModelSpec& spec) {
  std::vector<uint64_t> h = {Hash64(form, std::strlen(form)), static_cast<uint64_t>(spec.hidden),
                             static_cast<uint64_t>(spec.intermediate), static_cast<uint64_t>(spec.num_experts),
                             spec.moe_layers.size()};
  for (int l : spec.moe_layers) h.push_back(static_cast<uint64_t>(l));
  return h;
}

namespace {

// E4M3 has no infinities; 0x7f and 0xff are its NaNs.
absl::Status CheckFiniteFp8(const std::vector<uint8_t>& codes, int layer, int expert, const char* what) {
  for (uint8_t c : codes)
    if ((c & 0x7f) == 0x7f)
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " expert ", expert, " ", what, " holds NaN fp8 weights"));
  return absl::OkStatus();
}

// p's shape and scale grid for a [rows, cols] projection quantized as q says
// (fp8: blocks of block_rows x block_cols; int4: 1 x group_size).
void ShapeCodes(const QuantConfig& q, int rows, int cols, CodedProjection* p) {
  const bool int4 = q.scheme == WeightQuant::kInt4Group;
  p->scheme = q.scheme;
  p->rows = rows, p->cols = cols, p->r0 = p->c0 = 0;
  p->br = int4 ? 1 : q.block_rows, p->bc = int4 ? q.group_size : q.block_cols;
  p->scale_cols = static_cast<int>(CeilDiv(cols, p->bc));
  p->codes.resize(static_cast<size_t>(rows) * cols);
  p->scales.resize(static_cast<size_t>(CeilDiv(rows, p->br)) * p->scale_cols);
}

bool HasCodes(const ModelSpec& spec) {
  return spec.quant.scheme == WeightQuant::kFp8Block || spec.quant.scheme == WeightQuant::kInt4Group;
}
absl::Status NotCoded(const ModelSpec& spec) {
  return absl::FailedPreconditionError(absl::StrCat(
      "the model's experts are not an fp8 or int4 checkpoint (quantization: ", spec.quant.Describe(), ")"));
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
    if (spec_.expert_biases) {
      GenerateExpertBias(uri_.seed, layer, expert, Projection::kGate, I, out->gate_bias.data());
      GenerateExpertBias(uri_.seed, layer, expert, Projection::kUp, I, out->up_bias.data());
      GenerateExpertBias(uri_.seed, layer, expert, Projection::kDown, H, out->down_bias.data());
    }
    // A quantized synthetic model gives what its checkpoint (moe-make-model --dtype) gives back.
    QuantizeDequantize(spec_.quant, I, H, out->gate.data());
    QuantizeDequantize(spec_.quant, I, H, out->up.data());
    QuantizeDequantize(spec_.quant, H, I, out->down.data());
    return absl::OkStatus();
  }
  // The codes moe-make-model --dtype fp8 / int4 writes for this expert.
  absl::Status ReadExpertCodes(int layer, int expert, ExpertCodes* out) const override {
    if (!HasCodes(spec_)) return NotCoded(spec_);
    MOE_RETURN_IF_ERROR(CheckExpertIndex(spec_, layer, expert));
    const int H = spec_.hidden, I = spec_.intermediate;
    std::vector<bf16_t> w;
    std::vector<int32_t> words;
    for (auto [p, proj, rows, cols] : {std::tuple{&out->gate, Projection::kGate, I, H},
                                       std::tuple{&out->up, Projection::kUp, I, H},
                                       std::tuple{&out->down, Projection::kDown, H, I}}) {
      ShapeCodes(spec_.quant, rows, cols, p);
      w.resize(static_cast<size_t>(rows) * cols);
      GenerateExpertMatrix(uri_.seed, layer, expert, proj, rows, cols, w.data());
      if (p->scheme == WeightQuant::kFp8Block) {
        QuantizeFp8Block(w.data(), rows, cols, p->br, p->bc, p->codes.data(), p->scales.data());
      } else {
        words.resize(static_cast<size_t>(rows) * CeilDiv(cols, 8));
        QuantizeInt4Group(w.data(), rows, cols, p->bc, words.data(), p->scales.data());
        UnpackInt4Words(words.data(), rows, cols, reinterpret_cast<int8_t*>(p->codes.data()));
      }
    }
    return absl::OkStatus();
  }
  // The weights are a pure function of the generator, the seed, the geometry
  // and the quantization: the identity is theirs, computed without a weight.
  uint64_t Identity() const override {
    std::vector<uint64_t> h = ModelIdentityHeader("synthetic-v1 (GenerateExpertMatrix)", spec_);
    const char* dtype = DTypeName(spec_.dtype);
    const std::string math = ExpertMathName(spec_);
    h.insert(h.end(), {uri_.seed, Hash64(dtype, std::strlen(dtype)), static_cast<uint64_t>(spec_.quant.scheme),
                       static_cast<uint64_t>(spec_.quant.block_rows), static_cast<uint64_t>(spec_.quant.block_cols),
                       static_cast<uint64_t>(spec_.quant.group_size)});
    if (spec_.activation != ExpertActivation{} || spec_.expert_biases) h.push_back(Hash64(math.data(), math.size()));
    const uint64_t d = Hash64(h.data(), h.size() * sizeof(uint64_t));
    return d != 0 ? d : 1;
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

// n values of a scale tensor as f32 (BF16, F16, F32); InvalidArgument naming
// it for another dtype or a value that is NaN, Inf or negative.
absl::Status ScalesToF32(const TensorInfo& t, std::vector<float>* out) {
  const size_t n = static_cast<size_t>(NumElements(t.shape));
  out->resize(n);
  switch (t.dtype) {
    case DType::kF32: std::memcpy(out->data(), t.data, n * 4); break;
    case DType::kBF16: Bf16ToF32(reinterpret_cast<const bf16_t*>(t.data), out->data(), n); break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) (*out)[i] = F16ToF32(reinterpret_cast<const uint16_t*>(t.data)[i]);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(t.name, ": dtype ", DTypeName(t.dtype), " not supported for scales (F32, BF16, F16)"));
  }
  for (float v : *out)
    if (!std::isfinite(v) || v < 0)
      return absl::InvalidArgumentError(absl::StrCat(t.name, ": holds a scale that is NaN, Inf or negative (", v, ")"));
  return absl::OkStatus();
}

// The tensor `name` of `ckpt` with exactly this dtype and shape, else
// NotFound / InvalidArgument naming it.
absl::StatusOr<const TensorInfo*> FindTensor(const Checkpoint& ckpt, const std::string& name,
                                             std::initializer_list<DType> dtypes, const std::vector<int64_t>& shape,
                                             const std::string& why) {
  const TensorInfo* t = ckpt.Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("no tensor ", name, " (", why, ")"));
  if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end()) {
    std::vector<std::string> names;
    for (DType d : dtypes) names.push_back(DTypeName(d));
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", DTypeName(t->dtype), ", expected ",
                                                   absl::StrJoin(names, " or "), " (", why, ")"));
  }
  if (t->shape != shape)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": shape ", ShapeString(t->shape), ", expected ", ShapeString(shape), " (", why, ")"));
  return t;
}

// The tensor whose presence says an expert projection is in the checkpoint.
std::string PrimaryTensorName(const QuantConfig& q, const std::string& weight_name) {
  if (q.scheme == WeightQuant::kMxfp4) return Mxfp4PartName(weight_name, "blocks");
  return q.scheme == WeightQuant::kInt4Group ? QuantizedPartName(weight_name, "weight_packed") : weight_name;
}

// An MXFP4 projection's blocks and scales (U8 [lead..., rows, cols/32, 16] and
// [lead..., rows, cols/32]; `lead` is {E} for fused 3-D experts), checked
// against the model's shape; the scales hold no NaN (255). InvalidArgument
// naming the tensor otherwise.
absl::StatusOr<std::pair<const TensorInfo*, const TensorInfo*>> FindMxfp4(const Checkpoint& ckpt,
                                                                         const std::string& name,
                                                                         std::vector<int64_t> lead, int64_t rows,
                                                                         int64_t cols) {
  const std::string why = "quantization_config: mxfp4";
  const std::string blocks = Mxfp4PartName(name, "blocks"), scales = Mxfp4PartName(name, "scales");
  if (cols % kMxfp4Block != 0)
    return absl::InvalidArgumentError(absl::StrCat(blocks, ": the model's ", cols, " input columns are not a multiple of ",
                                                   kMxfp4Block, " (", why, ")"));
  std::vector<int64_t> sshape = lead;
  sshape.insert(sshape.end(), {rows, cols / kMxfp4Block});
  std::vector<int64_t> bshape = sshape;
  bshape.push_back(kMxfp4Block / 2);
  MOE_ASSIGN_OR_RETURN(const TensorInfo* b, FindTensor(ckpt, blocks, {DType::kU8}, bshape, why));
  MOE_ASSIGN_OR_RETURN(const TensorInfo* s, FindTensor(ckpt, scales, {DType::kU8}, sshape, why));
  const uint8_t* e = reinterpret_cast<const uint8_t*>(s->data);
  if (const uint8_t* nan = std::find(e, e + s->nbytes, uint8_t{255}); nan != e + s->nbytes)
    return absl::InvalidArgumentError(absl::StrCat(scales, ": holds the E8M0 NaN code 255 at element ", nan - e));
  return std::pair{b, s};
}

// An fp8 projection's codes and scale_inv tensors, checked against the
// model's shape and block size.
absl::StatusOr<std::pair<const TensorInfo*, const TensorInfo*>> FindFp8(const Checkpoint& ckpt, const QuantConfig& q,
                                                                       const std::string& name, int64_t rows,
                                                                       int64_t cols) {
  const std::string why = "quantization_config: fp8";
  MOE_ASSIGN_OR_RETURN(const TensorInfo* w, FindTensor(ckpt, name, {DType::kF8E4M3}, {rows, cols}, why));
  MOE_ASSIGN_OR_RETURN(const TensorInfo* s,
                       FindTensor(ckpt, name + "_scale_inv", {DType::kF32, DType::kBF16, DType::kF16},
                                  {CeilDiv(rows, q.block_rows), CeilDiv(cols, q.block_cols)},
                                  absl::StrCat(why, ", blocks ", q.block_rows, "x", q.block_cols)));
  return std::pair{w, s};
}

// An int4 projection (compressed-tensors pack-quantized: X.weight_packed,
// X.weight_scale, X.weight_shape) as its codes and f32 scales, checked
// against the model's shape and the config's group size.
absl::Status ReadInt4(const Checkpoint& ckpt, const QuantConfig& q, const std::string& name, int64_t rows,
                      int64_t cols, CodedProjection* p) {
  const std::string why = absl::StrCat("quantization_config: int4, group ", q.group_size);
  const std::string packed_name = QuantizedPartName(name, "weight_packed");
  const std::string scale_name = QuantizedPartName(name, "weight_scale");
  const std::string shape_name = QuantizedPartName(name, "weight_shape");
  MOE_ASSIGN_OR_RETURN(const TensorInfo* w, FindTensor(ckpt, packed_name, {DType::kI32}, {rows, CeilDiv(cols, 8)}, why));
  MOE_ASSIGN_OR_RETURN(const TensorInfo* s, FindTensor(ckpt, scale_name, {DType::kBF16, DType::kF16, DType::kF32},
                                                       {rows, CeilDiv(cols, q.group_size)}, why));
  MOE_ASSIGN_OR_RETURN(const TensorInfo* shape, FindTensor(ckpt, shape_name, {DType::kI64, DType::kI32}, {2}, why));
  int64_t r0 = 0, c0 = 0;
  if (shape->dtype == DType::kI64) {
    std::memcpy(&r0, shape->data, 8);
    std::memcpy(&c0, shape->data + 8, 8);
  } else {
    int32_t v[2];
    std::memcpy(v, shape->data, 8);
    r0 = v[0];
    c0 = v[1];
  }
  if (r0 != rows || c0 != cols)
    return absl::InvalidArgumentError(
        absl::StrCat(shape->name, ": says [", r0, ",", c0, "], the model needs [", rows, ",", cols, "]"));
  ShapeCodes(q, static_cast<int>(rows), static_cast<int>(cols), p);
  MOE_RETURN_IF_ERROR(ScalesToF32(*s, &p->scales));
  const int32_t* words = reinterpret_cast<const int32_t*>(w->data);
  std::vector<int32_t> aligned;  // safetensors does not align tensors to their element size
  if (reinterpret_cast<uintptr_t>(w->data) % alignof(int32_t) != 0) {
    aligned.resize(w->nbytes / sizeof(int32_t));
    std::memcpy(aligned.data(), w->data, w->nbytes);
    words = aligned.data();
  }
  UnpackInt4Words(words, static_cast<int>(rows), static_cast<int>(cols), reinterpret_cast<int8_t*>(p->codes.data()));
  return absl::OkStatus();
}

// One [rows, cols] expert projection (its ".weight" name) as bf16, in the
// checkpoint's format (plain, fp8 block-scaled, or int4 group-quantized).
absl::Status ReadProjection(const Checkpoint& ckpt, const QuantConfig& q, const std::string& name, int64_t rows,
                            int64_t cols, bf16_t* dst) {
  std::vector<float> scales;
  switch (q.scheme) {
    case WeightQuant::kNone: {
      const TensorInfo* t = ckpt.Find(name);
      if (t == nullptr) return absl::NotFoundError(absl::StrCat("no tensor ", name));
      if (t->shape != std::vector<int64_t>{rows, cols})
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": shape ", ShapeString(t->shape), ", expected [", rows, ",", cols, "]"));
      return ToBf16(*t, 0, static_cast<size_t>(rows * cols), dst);
    }
    case WeightQuant::kFp8Block: {
      MOE_ASSIGN_OR_RETURN(const auto ws, FindFp8(ckpt, q, name, rows, cols));
      const auto [w, s] = ws;
      MOE_RETURN_IF_ERROR(ScalesToF32(*s, &scales));
      DequantizeFp8Block(reinterpret_cast<const uint8_t*>(w->data), scales.data(), static_cast<int>(rows),
                         static_cast<int>(cols), q.block_rows, q.block_cols, dst);
      return absl::OkStatus();
    }
    case WeightQuant::kInt4Group: {
      CodedProjection p;
      MOE_RETURN_IF_ERROR(ReadInt4(ckpt, q, name, rows, cols, &p));
      DequantizeInt4Codes(reinterpret_cast<const int8_t*>(p.codes.data()), p.scales.data(), p.rows, p.cols, p.bc, dst);
      return absl::OkStatus();
    }
    case WeightQuant::kMxfp4: {
      MOE_ASSIGN_OR_RETURN(const auto bs, FindMxfp4(ckpt, name, {}, rows, cols));
      DequantizeMxfp4(reinterpret_cast<const uint8_t*>(bs.first->data), reinterpret_cast<const uint8_t*>(bs.second->data),
                      static_cast<int>(rows), static_cast<int>(cols), dst);
      return absl::OkStatus();
    }
    case WeightQuant::kGgufBlock: break;  // no safetensors checkpoint declares it (QuantConfigFromJson)
  }
  return absl::InternalError("unknown quantization scheme");
}

// Fused 3-D expert tensors of one layer (all experts in one tensor):
//   {prefix}gate_up_proj  [E, 2I, H]  (transformers' in-memory layout, rows = outputs)
//                      or [E, H, 2I]  (Llama 4, GPT-OSS: x @ W; GPT-OSS interleaves the gate and up columns)
//   {prefix}down_proj     [E, H, I]   or [E, I, H] respectively
// or, as Granite MoE checkpoints name them, model.layers.{l}.block_sparse_moe.
// input_linear.weight [E, 2I, H] (gate rows first) and output_linear.weight [E, H, I].
// The orientation is read from down_proj's shape (x @ W when it is [E, I, H]
// and I != H). MXFP4 (GPT-OSS's naming): {prefix}gate_up_proj_blocks
// [E, 2I, H/32, 16] + _scales [E, 2I, H/32] and {prefix}down_proj_blocks
// [E, H, I/32, 16] + _scales [E, H, I/32]; blocks run along the input, so rows
// are outputs (gate rows first).
// and I != H); GPT-OSS's is always x @ W (its H = I). Families whose experts
// carry biases (spec.expert_biases: GPT-OSS) add {prefix}gate_up_proj_bias
// [E, 2I] (interleaved like the columns) and {prefix}down_proj_bias [E, H].
struct FusedExperts {
  const TensorInfo* gate_up = nullptr;  // mxfp4: the blocks
  const TensorInfo* down = nullptr;
  const TensorInfo* gate_up_scales = nullptr;  // mxfp4 only
  const TensorInfo* down_scales = nullptr;
  const TensorInfo* gate_up_bias = nullptr;  // spec.expert_biases only
  const TensorInfo* down_bias = nullptr;
  bool x_times_w = false;    // [E, H, 2I] / [E, I, H]
  bool interleaved = false;  // gate = even columns, up = odd (GPT-OSS)
};

std::string FusedPrefix(ExpertNaming naming, int layer) {
  return absl::StrCat("model.layers.", layer,
                      naming == ExpertNaming::kBlockSparseMoe ? ".block_sparse_moe.experts." : ".mlp.experts.");
}

// The fused biases {gate_up}_bias [E, 2I] and {down}_bias [E, H] of a family
// whose experts carry them (spec.expert_biases); InvalidArgument naming a
// missing or misshapen one.
absl::Status FindFusedBiases(const Checkpoint& ckpt, const ModelSpec& spec, const std::string& gate_up,
                             const std::string& down, FusedExperts* f) {
  if (!spec.expert_biases) return absl::OkStatus();
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  const std::string why = absl::StrCat(spec.model_type, " experts carry biases");
  const std::initializer_list<DType> dtypes = {DType::kBF16, DType::kF16, DType::kF32};
  MOE_ASSIGN_OR_RETURN(f->gate_up_bias, FindTensor(ckpt, gate_up + "_bias", dtypes, {E, 2 * I}, why));
  MOE_ASSIGN_OR_RETURN(f->down_bias, FindTensor(ckpt, down + "_bias", dtypes, {E, H}, why));
  return absl::OkStatus();
}

// The fused tensors of `layer`, or nullopt when it has none; InvalidArgument
// naming the tensor when their shapes do not fit the model.
absl::StatusOr<std::optional<FusedExperts>> FindFused(const Checkpoint& ckpt, const ModelSpec& spec, int layer) {
  const std::string prefix = FusedPrefix(spec.naming, layer);
  std::string gate_up = prefix + "gate_up_proj", down = prefix + "down_proj";
  if (spec.quant.scheme == WeightQuant::kMxfp4) {
    if (ckpt.Find(Mxfp4PartName(gate_up, "blocks")) == nullptr && ckpt.Find(Mxfp4PartName(down, "blocks")) == nullptr)
      return std::optional<FusedExperts>();
    const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
    FusedExperts f;
    MOE_ASSIGN_OR_RETURN(std::tie(f.gate_up, f.gate_up_scales), FindMxfp4(ckpt, gate_up, {E}, 2 * I, H));
    MOE_ASSIGN_OR_RETURN(std::tie(f.down, f.down_scales), FindMxfp4(ckpt, down, {E}, H, I));
    f.interleaved = IsGptOss(spec.model_type);  // its gate/up rows alternate, as its bf16 columns do
    MOE_RETURN_IF_ERROR(FindFusedBiases(ckpt, spec, gate_up, down, &f));
    return std::optional<FusedExperts>(f);
  }
  if (spec.naming == ExpertNaming::kBlockSparseMoe && ckpt.Find(gate_up) == nullptr && ckpt.Find(down) == nullptr) {
    const std::string granite = absl::StrCat("model.layers.", layer, ".block_sparse_moe.");
    gate_up = granite + "input_linear.weight";
    down = granite + "output_linear.weight";
  }
  FusedExperts f;
  f.gate_up = ckpt.Find(gate_up);
  f.down = ckpt.Find(down);
  if (f.gate_up == nullptr && f.down == nullptr) return std::optional<FusedExperts>();
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  if (f.gate_up == nullptr || f.down == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(gate_up, " and ", down, ": only one present"));
  using Shape = std::vector<int64_t>;
  if (IsGptOss(spec.model_type)) {
    f.x_times_w = f.interleaved = true;
    if (f.down->shape != Shape{E, I, H})
      return absl::InvalidArgumentError(absl::StrCat(f.down->name, ": shape ", ShapeString(f.down->shape),
                                                     ", expected ", ShapeString(Shape{E, I, H}), " (gpt_oss)"));
  } else if (f.down->shape == Shape{E, H, I}) {
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
  MOE_RETURN_IF_ERROR(FindFusedBiases(ckpt, spec, gate_up, down, &f));
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
      if (absl::Status st = ReadProjection(*ckpt_, spec_.quant, name, w.rows, w.cols, w.dst->data()); !st.ok())
        return absl::Status(st.code(), absl::StrCat("checkpoint ", dir_, ": ", st.message()));
      MOE_RETURN_IF_ERROR(CheckFinite(*w.dst, layer, expert, w.what));
    }
    return absl::OkStatus();
  }
  absl::Status ReadExpertCodes(int layer, int expert, ExpertCodes* out) const override {
    if (!HasCodes(spec_)) return NotCoded(spec_);
    MOE_RETURN_IF_ERROR(CheckExpertIndex(spec_, layer, expert));
    const int H = spec_.hidden, I = spec_.intermediate;
    for (auto [p, proj, rows, cols, what] : {std::tuple{&out->gate, Projection::kGate, I, H, "gate"},
                                             std::tuple{&out->up, Projection::kUp, I, H, "up"},
                                             std::tuple{&out->down, Projection::kDown, H, I, "down"}}) {
      const std::string name = ExpertTensorName(spec_.naming, layer, expert, proj);
      if (spec_.quant.scheme == WeightQuant::kInt4Group) {
        if (absl::Status st = ReadInt4(*ckpt_, spec_.quant, name, rows, cols, p); !st.ok())
          return absl::Status(st.code(), absl::StrCat("checkpoint ", dir_, ": ", st.message()));
        continue;
      }
      absl::StatusOr<std::pair<const TensorInfo*, const TensorInfo*>> ws = FindFp8(*ckpt_, spec_.quant, name, rows, cols);
      if (!ws.ok()) return absl::Status(ws.status().code(), absl::StrCat("checkpoint ", dir_, ": ", ws.status().message()));
      ShapeCodes(spec_.quant, rows, cols, p);
      std::memcpy(p->codes.data(), ws->first->data, p->codes.size());
      MOE_RETURN_IF_ERROR(ScalesToF32(*ws->second, &p->scales));
      MOE_RETURN_IF_ERROR(CheckFiniteFp8(p->codes, layer, expert, what));
    }
    return absl::OkStatus();
  }
  // The stored bytes of every tensor ReadExpert / ReadExpertCodes read, in
  // (layer, expert, projection, part) order; a fused layer's two tensors.
  uint64_t Identity() const override {
    std::vector<StoredTensor> tensors;
    auto add = [&](const TensorInfo* t) {  // a missing one (ReadExpert refuses it) as an empty U8 record
      if (t == nullptr) {
        tensors.push_back(StoredTensor{DType::kU8, {}, nullptr, 0});
        return;
      }
      const auto [fd, offset] = ckpt_->Locate(*t);
      tensors.push_back(StoredTensor{t->dtype, t->shape, t->data, t->nbytes, fd, offset});
    };
    for (int l : spec_.moe_layers) {
      if (auto it = fused_.find(l); it != fused_.end()) {
        add(it->second.gate_up);
        add(it->second.down);
        if (it->second.gate_up_scales != nullptr) {
          add(it->second.gate_up_scales);
          add(it->second.down_scales);
        }
        if (it->second.gate_up_bias != nullptr) {
          add(it->second.gate_up_bias);
          add(it->second.down_bias);
        }
        continue;
      }
      for (int e = 0; e < spec_.num_experts; ++e)
        for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
          const std::string name = ExpertTensorName(spec_.naming, l, e, p);
          switch (spec_.quant.scheme) {
            case WeightQuant::kNone: add(ckpt_->Find(name)); break;
            case WeightQuant::kFp8Block:
              add(ckpt_->Find(name));
              add(ckpt_->Find(name + "_scale_inv"));
              break;
            case WeightQuant::kInt4Group:
              for (const char* part : {"weight_packed", "weight_scale", "weight_shape"})
                add(ckpt_->Find(QuantizedPartName(name, part)));
              break;
            case WeightQuant::kMxfp4:
              add(ckpt_->Find(Mxfp4PartName(name, "blocks")));
              add(ckpt_->Find(Mxfp4PartName(name, "scales")));
              break;
            case WeightQuant::kGgufBlock: break;  // no safetensors checkpoint declares it
          }
        }
    }
    return DigestExpertTensors(ModelIdentityHeader("checkpoint-v1 (stored expert tensors)", spec_), tensors);
  }

 private:
  // Expert `expert` out of a layer's fused tensors, into gate [I,H], up [I,H], down [H,I].
  absl::Status ReadFused(const FusedExperts& f, int layer, int expert, ExpertWeights* out) const {
    const size_t H = spec_.hidden, I = spec_.intermediate, e = static_cast<size_t>(expert);
    std::vector<bf16_t> slab(2 * I * H);
    if (f.gate_up_scales != nullptr) {  // mxfp4: [2I, H] and [H, I] from 32-value blocks (16 bytes + 1 scale)
      auto read = [&](const TensorInfo* b, const TensorInfo* s, size_t rows, size_t cols, bf16_t* dst) {
        const size_t n = rows * cols;
        DequantizeMxfp4(reinterpret_cast<const uint8_t*>(b->data) + e * n / 2,
                        reinterpret_cast<const uint8_t*>(s->data) + e * n / kMxfp4Block, static_cast<int>(rows),
                        static_cast<int>(cols), dst);
      };
      read(f.gate_up, f.gate_up_scales, 2 * I, H, slab.data());
      for (size_t i = 0; i < I; ++i) {  // gate rows then up rows, or alternating (GPT-OSS)
        const size_t g = f.interleaved ? 2 * i : i, u = f.interleaved ? 2 * i + 1 : I + i;
        std::copy_n(slab.begin() + g * H, H, out->gate.begin() + i * H);
        std::copy_n(slab.begin() + u * H, H, out->up.begin() + i * H);
      }
      read(f.down, f.down_scales, H, I, out->down.data());
    } else {
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
    }
    if (f.gate_up_bias != nullptr) {  // [2I], laid out as the columns
      MOE_RETURN_IF_ERROR(ToBf16(*f.gate_up_bias, e * 2 * I, 2 * I, slab.data()));
      for (size_t i = 0; i < I; ++i) {
        out->gate_bias[i] = slab[f.interleaved ? 2 * i : i];
        out->up_bias[i] = slab[f.interleaved ? 2 * i + 1 : I + i];
      }
      MOE_RETURN_IF_ERROR(ToBf16(*f.down_bias, e * H, H, out->down_bias.data()));
    }
    if (f.gate_up_scales != nullptr) {  // mxfp4: read above
    } else if (!f.x_times_w) {  // [H, I] as is
      MOE_RETURN_IF_ERROR(ToBf16(*f.down, e * H * I, H * I, out->down.data()));
    } else {  // [I, H] -> [H, I]
      slab.resize(I * H);
      MOE_RETURN_IF_ERROR(ToBf16(*f.down, e * I * H, I * H, slab.data()));
      for (size_t i = 0; i < I; ++i)
        for (size_t h = 0; h < H; ++h) out->down[h * I + i] = slab[i * H + h];
    }
    for (auto [v, what] : {std::pair{&out->gate, "gate"}, std::pair{&out->up, "up"}, std::pair{&out->down, "down"},
                           std::pair{&out->gate_bias, "gate bias"}, std::pair{&out->up_bias, "up bias"},
                           std::pair{&out->down_bias, "down bias"}})
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
  // The tensors are the truth for which layers have experts (dense layers have none)
  // and how they are named: per-expert tensors, or fused 3-D ones (FusedExperts),
  // under the naming the model type implies, else the other one (families whose
  // checkpoints keep Mixtral's block_sparse_moe names, e.g. PhiMoE, MiniMax, Granite).
  std::vector<int> moe_layers;
  std::map<int, FusedExperts> fused;
  const ExpertNaming implied = spec->naming;
  for (ExpertNaming naming : {implied, implied == ExpertNaming::kMlpExperts ? ExpertNaming::kBlockSparseMoe
                                                                              : ExpertNaming::kMlpExperts}) {
    spec->naming = naming;
    for (int l = 0; l < spec->num_layers; ++l) {
      const std::string gate = ExpertTensorName(spec->naming, l, 0, Projection::kGate);
      if (ckpt->Find(PrimaryTensorName(spec->quant, gate)) != nullptr) {
        moe_layers.push_back(l);
        continue;
      }
      absl::StatusOr<std::optional<FusedExperts>> f = FindFused(*ckpt, *spec, l);
      if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", f.status().message()));
      if (f->has_value()) {
        if (spec->quant.scheme != WeightQuant::kNone && spec->quant.scheme != WeightQuant::kMxfp4)
          return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", (**f).gate_up->name,
                                                         ": fused 3-D expert tensors with ", spec->quant.Describe(),
                                                         " quantization are not supported (per-expert tensors are)"));
        moe_layers.push_back(l);
        fused[l] = **f;
      }
    }
    if (!moe_layers.empty()) break;
  }
  if (moe_layers.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("model ", dir, ": no expert tensors named like ",
                     PrimaryTensorName(spec->quant, ExpertTensorName(implied, 0, 0, Projection::kGate)), " or ",
                     PrimaryTensorName(spec->quant, ExpertTensorName(implied == ExpertNaming::kMlpExperts
                                                                         ? ExpertNaming::kBlockSparseMoe
                                                                         : ExpertNaming::kMlpExperts,
                                                                     0, 0, Projection::kGate))));
  // Expert biases of a family without them (spec.expert_biases false) are
  // refused: served as W x they would be wrong. A family with them
  // (GPT-OSS) has its fused experts, their biases checked by FindFused.
  if (spec->expert_biases && fused.size() != moe_layers.size())
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", dir, ": ", ExpertTensorName(spec->naming, moe_layers.front(), 0, Projection::kGate), ": ",
        spec->model_type, " experts are read from fused gate_up_proj / down_proj tensors with their biases"));
  for (int l : spec->expert_biases ? std::vector<int>{} : moe_layers) {
    std::vector<std::string> biases;
    if (auto f = fused.find(l); f != fused.end()) {
      for (const TensorInfo* t : {f->second.gate_up, f->second.down})
        biases.push_back(t->name.size() > 7 && t->name.compare(t->name.size() - 7, 7, ".weight") == 0
                             ? t->name.substr(0, t->name.size() - 7) + ".bias"
                             : t->name + "_bias");
    } else {
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const std::string w = ExpertTensorName(spec->naming, l, 0, p);
        biases.push_back(w.substr(0, w.size() - 7) + ".bias");
      }
    }
    for (const std::string& b : biases)
      if (ckpt->Find(b) != nullptr)
        return absl::InvalidArgumentError(absl::StrCat("model ", dir, ": ", b,
                                                       ": expert biases are not computed by this service"));
  }
  if (moe_layers != spec->moe_layers)
    LogWarning("model", "config.json implies ", spec->moe_layers.size(), " MoE layers, checkpoint has ",
               moe_layers.size(), "; using the checkpoint's");
  spec->moe_layers = std::move(moe_layers);
  return std::unique_ptr<ModelSource>(new CheckpointSource(*std::move(spec), std::move(ckpt), dir, std::move(fused)));
}

}  // namespace

namespace {

class SlicedSource final : public ModelSource {
 public:
  SlicedSource(std::unique_ptr<ModelSource> base, ExpertSlice slice, int begin, int end)
      : base_(std::move(base)), slice_(slice), begin_(begin), end_(end) {
    spec_ = base_->spec();
    spec_.intermediate = end - begin;
  }
  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override {
    return absl::StrCat(base_->Describe(), ", slice ", slice_.ToString(), " (intermediate rows ", begin_, "-", end_,
                        " of ", base_->spec().intermediate, ")");
  }
  absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const override {
    ExpertWeights& full = Scratch();
    MOE_RETURN_IF_ERROR(base_->ReadExpert(layer, expert, &full));
    const size_t H = static_cast<size_t>(spec_.hidden), I = static_cast<size_t>(base_->spec().intermediate);
    const size_t n = static_cast<size_t>(end_ - begin_);
    out->Resize(spec_);
    std::copy_n(full.gate.begin() + begin_ * H, n * H, out->gate.begin());
    std::copy_n(full.up.begin() + begin_ * H, n * H, out->up.begin());
    for (size_t h = 0; h < H; ++h) std::copy_n(full.down.begin() + h * I + begin_, n, out->down.begin() + h * n);
    if (full.has_biases()) {  // the down bias once: in slice 0's partial sum
      std::copy_n(full.gate_bias.begin() + begin_, n, out->gate_bias.begin());
      std::copy_n(full.up_bias.begin() + begin_, n, out->up_bias.begin());
      if (slice_.index == 0) out->down_bias = full.down_bias;
      else std::fill(out->down_bias.begin(), out->down_bias.end(), bf16_t{0});
    }
    return absl::OkStatus();
  }
  // The slice's rows of gate and up and columns of down; the scale grids
  // stay whole, offset by the slice's start.
  absl::Status ReadExpertCodes(int layer, int expert, ExpertCodes* out) const override {
    MOE_RETURN_IF_ERROR(base_->ReadExpertCodes(layer, expert, out));
    const size_t H = static_cast<size_t>(spec_.hidden), I = static_cast<size_t>(base_->spec().intermediate);
    const size_t n = static_cast<size_t>(end_ - begin_);
    for (CodedProjection* p : {&out->gate, &out->up}) {
      p->codes.erase(p->codes.begin(), p->codes.begin() + begin_ * H);
      p->codes.resize(n * H);
      p->rows = static_cast<int>(n);
      p->r0 += begin_;
    }
    CodedProjection& d = out->down;
    for (size_t h = 0; h < H; ++h) std::copy_n(d.codes.begin() + h * I + begin_, n, d.codes.begin() + h * n);
    d.codes.resize(H * n);
    d.cols = static_cast<int>(n);
    d.c0 += begin_;
    return absl::OkStatus();
  }
  // The whole model's: the slice is a share of it, checked on its own.
  uint64_t Identity() const override { return base_->Identity(); }

 private:
  static ExpertWeights& Scratch() {  // ReadExpert runs on several loader threads
    thread_local ExpertWeights w;
    return w;
  }
  std::unique_ptr<ModelSource> base_;
  ModelSpec spec_;
  ExpertSlice slice_;
  int begin_, end_;
};

}  // namespace

absl::Status ModelSource::ReadExpertCodes(int, int, ExpertCodes*) const { return NotCoded(spec()); }

absl::StatusOr<std::unique_ptr<ModelSource>> SliceModel(std::unique_ptr<ModelSource> base, ExpertSlice slice) {
  if (slice.whole()) return base;
  MOE_ASSIGN_OR_RETURN(const auto range, SliceRange(base->spec().intermediate, slice));
  return std::unique_ptr<ModelSource>(new SlicedSource(std::move(base), slice, range.first, range.second));
}

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
  if (LooksLikeGguf(uri)) return OpenGgufModel(uri);
  return OpenCheckpoint(uri);
}

}  // namespace moe
