#include "model/gguf_model.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "model/model_identity.h"
#include "core/status_macros.h"
#include "model/synthetic_model.h"
#include "nlohmann/json.hpp"

namespace moe {

namespace {

// GGUF architectures whose experts are ours (three tensors per layer: SiLU-
// gated, or GPT-OSS's clamped SwiGLU with biases), and the model_type each
// stands for.
struct Arch {
  const char* gguf;
  const char* model_type;
};
constexpr Arch kArchs[] = {
    {"qwen3moe", "qwen3_moe"}, {"qwen2moe", "qwen2_moe"},       {"deepseek2", "deepseek_v3"}, {"glm4moe", "glm4_moe"},
    {"olmoe", "olmoe"},        {"kimi-linear", "kimi_linear"}, {"llama", "mixtral"},         {"gpt-oss", "gpt_oss"},
};
constexpr char kKnownArchs[] =
    "qwen3moe, qwen2moe, deepseek2, glm4moe, olmoe, kimi-linear, llama with experts (Mixtral), gpt-oss";
// {arch}.expert_gating_func (llama.cpp's llama_expert_gating_func_type):
// softmax then top-k, sigmoid, and top-k then softmax (GPT-OSS's, which
// llama.cpp's gpt-oss graph fixes without reading the key).
constexpr int kGatingSoftmax = 1, kGatingSigmoid = 2, kGatingSoftmaxWeight = 3;

std::string ExpertTensor(int layer, Projection p, const char* part = "weight") {
  const char* what = p == Projection::kGate ? "gate" : p == Projection::kUp ? "up" : "down";
  return absl::StrCat("blk.", layer, ".ffn_", what, "_exps.", part);
}

// One MoE layer's expert tensors: gate, up, down, and their biases (null
// unless the experts carry them).
struct LayerTensors {
  std::array<const GgufTensor*, 3> weight{};
  std::array<const GgufTensor*, 3> bias{};
};

// A type's precision (quantization.h gguf_bits).
int TypeBits(uint32_t t) {
  switch (static_cast<GgmlType>(t)) {
    case GgmlType::kQ4_K: case GgmlType::kMXFP4: return 4;
    case GgmlType::kQ8_0: case GgmlType::kQ6_K: return 8;
    default: return 16;
  }
}

class GgufSource final : public ModelSource {
 public:
  // tensors[i]: the expert tensors of spec.moe_layers[i].
  GgufSource(ModelSpec spec, std::unique_ptr<GgufFile> file, std::string arch, std::string routing,
             std::vector<LayerTensors> tensors)
      : spec_(std::move(spec)), file_(std::move(file)), arch_(std::move(arch)), routing_(std::move(routing)),
        tensors_(std::move(tensors)) {}
  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override {
    return absl::StrCat("gguf ", file_->path(), " (", arch_, ", experts ",
                        spec_.quant.scheme == WeightQuant::kGgufBlock ? spec_.quant.gguf_types : DTypeName(spec_.dtype),
                        "; routing ", routing_, "; ", file_->tensors().size(), " tensors)");
  }
  absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const override {
    MOE_RETURN_IF_ERROR(CheckExpertIndex(spec_, layer, expert));
    out->Resize(spec_);
    const size_t li = static_cast<size_t>(
        std::lower_bound(spec_.moe_layers.begin(), spec_.moe_layers.end(), layer) - spec_.moe_layers.begin());
    std::vector<float>& scratch = Scratch();
    const int64_t H = spec_.hidden, I = spec_.intermediate;
    for (auto [k, dst, rows, cols, what] : {std::tuple{0, &out->gate, I, H, "gate"}, std::tuple{1, &out->up, I, H, "up"},
                                            std::tuple{2, &out->down, H, I, "down"}}) {
      const GgufTensor& t = *tensors_[li].weight[k];
      const size_t bytes = GgmlRowBytes(t.type, cols) * static_cast<size_t>(rows);  // one expert's slab
      scratch.resize(static_cast<size_t>(rows * cols));
      DequantizeGgml(static_cast<GgmlType>(t.type), t.data + bytes * static_cast<size_t>(expert), rows * cols,
                     scratch.data());
      F32ToBf16(scratch.data(), dst->data(), scratch.size());
      if (absl::Status st = CheckFinite(*dst, layer, expert, what); !st.ok())
        return absl::InvalidArgumentError(absl::StrCat("gguf ", file_->path(), ": ", t.name, ": ", st.message()));
    }
    if (!spec_.expert_biases) return absl::OkStatus();
    for (auto [k, dst, n, what] : {std::tuple{0, &out->gate_bias, I, "gate bias"}, std::tuple{1, &out->up_bias, I, "up bias"},
                                   std::tuple{2, &out->down_bias, H, "down bias"}}) {
      const GgufTensor& t = *tensors_[li].bias[k];
      scratch.resize(static_cast<size_t>(n));
      DequantizeGgml(static_cast<GgmlType>(t.type), t.data + GgmlRowBytes(t.type, n) * static_cast<size_t>(expert), n,
                     scratch.data());
      F32ToBf16(scratch.data(), dst->data(), scratch.size());
      if (absl::Status st = CheckFinite(*dst, layer, expert, what); !st.ok())
        return absl::InvalidArgumentError(absl::StrCat("gguf ", file_->path(), ": ", t.name, ": ", st.message()));
    }
    return absl::OkStatus();
  }
  // The stored bytes of every layer's expert tensors (biases included), with their ggml types.
  uint64_t Identity() const override {
    std::vector<uint64_t> header = ModelIdentityHeader("gguf-v1 (stored expert tensors)", spec_);
    std::vector<StoredTensor> stored;
    for (const LayerTensors& layer : tensors_)
      for (const auto& part : {layer.weight, layer.bias})
        for (const GgufTensor* t : part) {
          if (t == nullptr) continue;
          header.push_back(t->type);
          stored.push_back(StoredTensor{DType::kU8, t->dims, t->data, t->nbytes, file_->fd(), file_->OffsetOf(t->data)});
        }
    return DigestExpertTensors(header, stored);
  }

 private:
  static std::vector<float>& Scratch() {  // ReadExpert runs on several loader threads
    thread_local std::vector<float> v;
    return v;
  }
  ModelSpec spec_;
  std::unique_ptr<GgufFile> file_;
  std::string arch_, routing_;
  std::vector<LayerTensors> tensors_;
};

bool IsFloatType(uint32_t t) {
  return t == static_cast<uint32_t>(GgmlType::kF32) || t == static_cast<uint32_t>(GgmlType::kF16) ||
         t == static_cast<uint32_t>(GgmlType::kBF16);
}

// Some layer has experts; a leading_dense_block_count that disagrees with the
// tensors is reported (the tensors are what is served).
absl::Status CheckMoeLayers(const GgufFile& file, const std::string& dense_key, const std::vector<int>& moe_layers) {
  if (moe_layers.empty()) return absl::InvalidArgumentError("no expert tensors (blk.N.ffn_gate_exps.weight)");
  if (file.Value(dense_key) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t dense, file.Int(dense_key));
    if (dense != moe_layers.front())
      LogWarning("model", file.path(), ": ", dense_key, " is ", dense, ", the first layer with experts is ",
                 moe_layers.front(), "; using the tensors'");
  }
  return absl::OkStatus();
}

// Long: the architecture, the geometry keys, then every expert tensor checked.
absl::StatusOr<std::unique_ptr<ModelSource>> Open(std::unique_ptr<GgufFile> file) {
  MOE_ASSIGN_OR_RETURN(const std::string arch, file->String("general.architecture"));
  const Arch* known = nullptr;
  for (const Arch& a : kArchs)
    if (arch == a.gguf) known = &a;
  if (known == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("architecture ", arch, " is not one this service reads (", kKnownArchs, ")"));
  auto key = [&](const char* k) { return absl::StrCat(arch, ".", k); };
  auto positive = [&](const char* k) -> absl::StatusOr<int> {
    MOE_ASSIGN_OR_RETURN(const int64_t v, file->Int(key(k)));
    if (v <= 0 || v > (1 << 20))
      return absl::InvalidArgumentError(absl::StrCat("metadata ", key(k), ": ", v, " is out of range"));
    return static_cast<int>(v);
  };
  ModelSpec spec;
  spec.model_type = known->model_type;
  const bool gpt_oss = IsGptOss(spec.model_type);
  MOE_ASSIGN_OR_RETURN(spec.num_layers, positive("block_count"));
  MOE_ASSIGN_OR_RETURN(spec.hidden, positive("embedding_length"));
  MOE_ASSIGN_OR_RETURN(spec.num_experts, positive("expert_count"));
  MOE_ASSIGN_OR_RETURN(spec.top_k, positive("expert_used_count"));
  if (file->Value(key("expert_feed_forward_length")) != nullptr || arch != "llama") {
    MOE_ASSIGN_OR_RETURN(spec.intermediate, positive("expert_feed_forward_length"));
  } else {
    MOE_ASSIGN_OR_RETURN(spec.intermediate, positive("feed_forward_length"));
  }
  // Routing: read, checked and described (the callers route). GPT-OSS's is
  // top-k then softmax whatever the key says (llama.cpp's graph fixes it).
  int gating = gpt_oss ? kGatingSoftmaxWeight : kGatingSoftmax;
  if (file->Value(key("expert_gating_func")) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t g, file->Int(key("expert_gating_func")));
    if (gpt_oss ? g != kGatingSoftmaxWeight : g != kGatingSoftmax && g != kGatingSigmoid)
      return absl::InvalidArgumentError(absl::StrCat("metadata ", key("expert_gating_func"), ": ", g,
                                                     gpt_oss ? " is not top-k then softmax (3), GPT-OSS's routing"
                                                             : " is not softmax (1) or sigmoid (2)"));
    gating = static_cast<int>(g);
  }
  if (arch == "deepseek2" && gating == kGatingSoftmax) spec.model_type = "deepseek_v2";
  spec.naming = NamingForModelType(spec.model_type);
  // The expert math: GPT-OSS's clamped SwiGLU with biases (limit 7: llama.cpp's
  // gpt-oss graph fixes alpha 1.702 and limit 7, and no GGUF key carries them),
  // SiLU for the others.
  MOE_RETURN_IF_ERROR(ExpertMathForModelType(nlohmann::json::object(), &spec));
  std::string routing = gating == kGatingSoftmaxWeight ? absl::StrCat("top-", spec.top_k, " then softmax")
                                                       : absl::StrCat(gating == kGatingSigmoid ? "sigmoid" : "softmax", " top-", spec.top_k);
  if (const GgufValue* v = file->Value(key("expert_weights_norm")); v != nullptr && std::get_if<bool>(v) && std::get<bool>(*v))
    routing += ", normalized";
  if (file->Value(key("expert_weights_scale")) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const double s, file->Float(key("expert_weights_scale")));
    absl::StrAppend(&routing, ", scaled ", s);
  }
  if (file->Value(key("expert_shared_count")) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t n, file->Int(key("expert_shared_count")));
    absl::StrAppend(&routing, ", ", n, " shared expert(s) (not served here)");
  }
  // The MoE layers: those with expert tensors, each checked.
  const int64_t H = spec.hidden, I = spec.intermediate, E = spec.num_experts;
  std::vector<LayerTensors> tensors;
  std::set<uint32_t> types;
  for (int l = 0; l < spec.num_layers; ++l) {
    if (file->Find(ExpertTensor(l, Projection::kGate)) == nullptr) {
      if (const std::string fused = absl::StrCat("blk.", l, ".ffn_gate_up_exps.weight"); file->Find(fused) != nullptr)
        return absl::InvalidArgumentError(absl::StrCat(fused, ": fused gate/up expert tensors are not read (separate ones are)"));
      continue;
    }
    LayerTensors t;
    for (auto [k, p, dims, bias_dims] : {std::tuple{0, Projection::kGate, std::vector<int64_t>{H, I, E}, std::vector<int64_t>{I, E}},
                                         std::tuple{1, Projection::kUp, std::vector<int64_t>{H, I, E}, std::vector<int64_t>{I, E}},
                                         std::tuple{2, Projection::kDown, std::vector<int64_t>{I, H, E}, std::vector<int64_t>{H, E}}}) {
      const std::string name = ExpertTensor(l, p);
      t.weight[k] = file->Find(name);
      if (t.weight[k] == nullptr) return absl::InvalidArgumentError(absl::StrCat("no tensor ", name, " (layer ", l, " has gate experts)"));
      if (!GgmlTypeDecoded(t.weight[k]->type))
        return absl::InvalidArgumentError(absl::StrCat(name, ": type ", GgmlTypeName(t.weight[k]->type),
                                                       " is not one this service reads (F32, F16, BF16, Q8_0, Q4_K, Q6_K, MXFP4)"));
      if (t.weight[k]->dims != dims)
        return absl::InvalidArgumentError(absl::StrCat(name, ": dims ", ShapeString(t.weight[k]->dims), ", expected ",
                                                       ShapeString(dims), " (embedding_length, expert_feed_forward_length, expert_count)"));
      types.insert(t.weight[k]->type);
      const std::string bias = ExpertTensor(l, p, "bias");
      t.bias[k] = file->Find(bias);
      if (!spec.expert_biases) {
        if (t.bias[k] != nullptr)
          return absl::InvalidArgumentError(absl::StrCat(bias, ": expert biases are not part of the expert math this service computes for ", arch));
        continue;
      }
      if (t.bias[k] == nullptr)
        return absl::InvalidArgumentError(absl::StrCat("no tensor ", bias, " (", arch, " experts carry biases)"));
      if (!IsFloatType(t.bias[k]->type))
        return absl::InvalidArgumentError(absl::StrCat(bias, ": type ", GgmlTypeName(t.bias[k]->type), " (F32, F16 or BF16 expected)"));
      if (t.bias[k]->dims != bias_dims)
        return absl::InvalidArgumentError(absl::StrCat(bias, ": dims ", ShapeString(t.bias[k]->dims), ", expected ",
                                                       ShapeString(bias_dims), k == 2 ? " (embedding_length, expert_count)"
                                                                                      : " (expert_feed_forward_length, expert_count)"));
    }
    spec.moe_layers.push_back(l);
    tensors.push_back(t);
  }
  MOE_RETURN_IF_ERROR(CheckMoeLayers(*file, key("leading_dense_block_count"), spec.moe_layers));
  // The expert types: one float type, or a quantization of the widest class.
  std::vector<std::string> names;
  int bits = 0;
  bool quantized = false;
  for (uint32_t t : types) {
    names.push_back(GgmlTypeName(t));
    bits = std::max(bits, TypeBits(t));
    quantized |= TypeBits(t) < 16;
  }
  if (!quantized && types.size() == 1) {
    const GgmlType t = static_cast<GgmlType>(*types.begin());
    spec.dtype = t == GgmlType::kF32 ? DType::kF32 : t == GgmlType::kF16 ? DType::kF16 : DType::kBF16;
  } else {
    spec.quant.scheme = WeightQuant::kGgufBlock;
    spec.quant.gguf_bits = bits;
    spec.quant.gguf_types = absl::StrJoin(names, "+");
    spec.quant.gguf_mxfp4 = types == std::set<uint32_t>{static_cast<uint32_t>(GgmlType::kMXFP4)};
  }
  MOE_RETURN_IF_ERROR(spec.Validate());
  return std::unique_ptr<ModelSource>(new GgufSource(std::move(spec), std::move(file), arch, routing, std::move(tensors)));
}

// The metadata WriteSyntheticGguf writes: the architecture's geometry keys,
// and the routing keys its llama.cpp converter writes.
std::vector<GgufKv> SyntheticGgufMetadata(const ModelSpec& spec, const std::string& arch, uint64_t seed) {
  auto key = [&](const char* k) { return absl::StrCat(arch, ".", k); };
  std::vector<GgufKv> kv = {
      {"general.architecture", arch},
      {"general.name", absl::StrCat("moe-make-model ", spec.model_type, " seed ", seed)},
      {"general.alignment", uint32_t{32}},
      {"moe_expert_service.synthetic_seed", static_cast<int64_t>(seed)},
      {key("block_count"), static_cast<uint32_t>(spec.num_layers)},
      {key("embedding_length"), static_cast<uint32_t>(spec.hidden)},
      {key("expert_count"), static_cast<uint32_t>(spec.num_experts)},
      {key("expert_used_count"), static_cast<uint32_t>(spec.top_k)},
      {key("expert_feed_forward_length"), static_cast<uint32_t>(spec.intermediate)},
  };
  if (spec.moe_layers.front() > 0) kv.push_back({key("leading_dense_block_count"), static_cast<uint32_t>(spec.moe_layers.front())});
  if (spec.model_type == "deepseek_v3" || spec.model_type == "glm4_moe") {  // what their converters write
    kv.push_back({key("expert_gating_func"), static_cast<uint32_t>(kGatingSigmoid)});
    kv.push_back({key("expert_weights_norm"), true});
  }
  return kv;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelSource>> OpenGgufModel(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  absl::StatusOr<std::unique_ptr<ModelSource>> s = Open(std::move(file));
  if (!s.ok()) return absl::Status(s.status().code(), absl::StrCat("model ", path, ": ", s.status().message()));
  return s;
}

absl::StatusOr<std::string> GgufArchitecture(const std::string& model_type) {
  if (model_type == "deepseek_v2") return std::string("deepseek2");
  for (const Arch& a : kArchs)
    if (model_type == a.model_type) return std::string(a.gguf);
  return absl::InvalidArgumentError(absl::StrCat("model_type ", model_type, " has no GGUF architecture we write"));
}

absl::StatusOr<GgmlType> ParseGgmlType(const std::string& name) {
  std::string n = name;
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (auto [s, t] : {std::pair{"bf16", GgmlType::kBF16}, std::pair{"f16", GgmlType::kF16}, std::pair{"f32", GgmlType::kF32},
                      std::pair{"q8_0", GgmlType::kQ8_0}, std::pair{"q4_k", GgmlType::kQ4_K}, std::pair{"q6_k", GgmlType::kQ6_K},
                      std::pair{"mxfp4", GgmlType::kMXFP4}})
    if (n == s) return t;
  return absl::InvalidArgumentError(absl::StrCat("GGUF type '", name, "' is not one we write (bf16, f16, f32, q8_0, q4_k, q6_k, mxfp4)"));
}

absl::Status WriteSyntheticGguf(const std::string& path, const ModelSpec& spec, uint64_t seed, GgmlType type) {
  MOE_RETURN_IF_ERROR(spec.Validate());
  MOE_ASSIGN_OR_RETURN(const std::string arch, GgufArchitecture(spec.model_type));
  const char* tname = GgmlTypeName(static_cast<uint32_t>(type));
  const int block = GgmlBlock(static_cast<uint32_t>(type)).first;
  if (spec.hidden % block != 0 || spec.intermediate % block != 0)
    return absl::InvalidArgumentError(absl::StrCat(tname, " needs rows that are a multiple of its block of ", block,
                                                   "; the model has H = ", spec.hidden, ", I = ", spec.intermediate));
  if (IsGptOss(spec.model_type) &&
      spec.activation != ExpertActivation::ClampedSwiglu(ExpertActivation::kGptOssAlpha, ExpertActivation::kGptOssLimit))
    return absl::InvalidArgumentError(absl::StrCat("gpt-oss GGUF: no key carries the expert math ", ExpertMathName(spec),
                                                   " (llama.cpp fixes alpha 1.702, limit 7)"));
  const std::vector<GgufKv> kv = SyntheticGgufMetadata(spec, arch, seed);
  // The experts of every MoE layer; GPT-OSS's also carry their biases and the
  // router, as llama.cpp's converter writes them (F32: ggml_add_id takes F32
  // biases), with GenerateExpertBias's and GenerateRouter's values.
  enum class Part { kWeight, kBias, kRouter, kRouterBias };
  struct Item {
    int layer;
    Projection p;
    Part part;
  };
  const bool gpt_oss = IsGptOss(spec.model_type);
  const int64_t H = spec.hidden, I = spec.intermediate, E = spec.num_experts;
  std::vector<GgufTensorSpec> tensors;
  std::vector<Item> items;
  for (int l : spec.moe_layers) {
    for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
      const int64_t cols = p == Projection::kDown ? I : H, rows = p == Projection::kDown ? H : I;
      tensors.push_back({ExpertTensor(l, p), type, {cols, rows, E}});
      items.push_back({l, p, Part::kWeight});
      if (!gpt_oss) continue;
      tensors.push_back({ExpertTensor(l, p, "bias"), GgmlType::kF32, {rows, E}});
      items.push_back({l, p, Part::kBias});
    }
    if (!gpt_oss) continue;
    tensors.push_back({absl::StrCat("blk.", l, ".ffn_gate_inp.weight"), GgmlType::kF32, {H, E}});
    items.push_back({l, Projection::kGate, Part::kRouter});
    tensors.push_back({absl::StrCat("blk.", l, ".ffn_gate_inp.bias"), GgmlType::kF32, {E}});
    items.push_back({l, Projection::kGate, Part::kRouterBias});
  }
  std::vector<bf16_t> w, b;
  std::vector<float> f;
  auto fill = [&](size_t i, std::span<std::byte> dst) {
    const auto [l, p, part] = items[i];
    const int cols = p == Projection::kDown ? spec.intermediate : spec.hidden;
    const int rows = p == Projection::kDown ? spec.hidden : spec.intermediate;
    if (part == Part::kRouter || part == Part::kRouterBias) {
      w.resize(static_cast<size_t>(E * H));
      b.resize(static_cast<size_t>(E));
      GenerateRouter(seed, l, spec.num_experts, spec.hidden, w.data(), b.data());
      const std::vector<bf16_t>& v = part == Part::kRouter ? w : b;
      f.resize(v.size());
      Bf16ToF32(v.data(), f.data(), v.size());
      std::memcpy(dst.data(), f.data(), f.size() * sizeof(float));
      return;
    }
    const size_t n = part == Part::kBias ? static_cast<size_t>(rows) : static_cast<size_t>(rows) * cols;
    const size_t slab = dst.size() / static_cast<size_t>(spec.num_experts);
    w.resize(n);
    f.resize(n);
    for (int e = 0; e < spec.num_experts; ++e) {
      if (part == Part::kBias) {
        GenerateExpertBias(seed, l, e, p, rows, w.data());
      } else {
        GenerateExpertMatrix(seed, l, e, p, rows, cols, w.data());
      }
      Bf16ToF32(w.data(), f.data(), n);
      QuantizeGgml(part == Part::kBias ? GgmlType::kF32 : type, f.data(), static_cast<int64_t>(n),
                   dst.data() + slab * static_cast<size_t>(e));
    }
  };
  return WriteGguf(path, kv, tensors, fill);
}

}  // namespace moe
