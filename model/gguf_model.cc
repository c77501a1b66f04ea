#include "model/gguf_model.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "model/model_identity.h"
#include "core/status_macros.h"
#include "model/synthetic_model.h"

namespace moe {

namespace {

// GGUF architectures whose experts are ours (SiLU-gated, three fused tensors
// per layer), and the model_type each stands for.
struct Arch {
  const char* gguf;
  const char* model_type;
};
constexpr Arch kArchs[] = {
    {"qwen3moe", "qwen3_moe"}, {"qwen2moe", "qwen2_moe"}, {"deepseek2", "deepseek_v3"}, {"glm4moe", "glm4_moe"},
    {"olmoe", "olmoe"},        {"kimi-linear", "kimi_linear"}, {"llama", "mixtral"},
};
constexpr char kKnownArchs[] = "qwen3moe, qwen2moe, deepseek2, glm4moe, olmoe, kimi-linear, llama with experts (Mixtral)";
constexpr int kGatingSoftmax = 1, kGatingSigmoid = 2;  // {arch}.expert_gating_func (ExpertGatingFuncType)

std::string ExpertTensor(int layer, Projection p) {
  const char* what = p == Projection::kGate ? "gate" : p == Projection::kUp ? "up" : "down";
  return absl::StrCat("blk.", layer, ".ffn_", what, "_exps.weight");
}

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
  // tensors[i] = gate, up, down of spec.moe_layers[i].
  GgufSource(ModelSpec spec, std::unique_ptr<GgufFile> file, std::string arch, std::string routing,
             std::vector<std::array<const GgufTensor*, 3>> tensors)
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
      const GgufTensor& t = *tensors_[li][k];
      const size_t bytes = GgmlRowBytes(t.type, cols) * static_cast<size_t>(rows);  // one expert's slab
      scratch.resize(static_cast<size_t>(rows * cols));
      DequantizeGgml(static_cast<GgmlType>(t.type), t.data + bytes * static_cast<size_t>(expert), rows * cols,
                     scratch.data());
      F32ToBf16(scratch.data(), dst->data(), scratch.size());
      if (absl::Status st = CheckFinite(*dst, layer, expert, what); !st.ok())
        return absl::InvalidArgumentError(absl::StrCat("gguf ", file_->path(), ": ", t.name, ": ", st.message()));
    }
    return absl::OkStatus();
  }
  // The stored bytes of every layer's three expert tensors, with their ggml types.
  uint64_t Identity() const override {
    std::vector<uint64_t> header = ModelIdentityHeader("gguf-v1 (stored expert tensors)", spec_);
    std::vector<StoredTensor> stored;
    for (const auto& layer : tensors_)
      for (const GgufTensor* t : layer) {
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
  std::vector<std::array<const GgufTensor*, 3>> tensors_;
};

// Long: the architecture, the geometry keys, then every expert tensor checked.
absl::StatusOr<std::unique_ptr<ModelSource>> Open(std::unique_ptr<GgufFile> file) {
  MOE_ASSIGN_OR_RETURN(const std::string arch, file->String("general.architecture"));
  if (arch == "gpt-oss")
    return absl::InvalidArgumentError(
        "architecture gpt-oss: its expert math (biases, clamped SwiGLU) is not one this service computes yet");
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
  MOE_ASSIGN_OR_RETURN(spec.num_layers, positive("block_count"));
  MOE_ASSIGN_OR_RETURN(spec.hidden, positive("embedding_length"));
  MOE_ASSIGN_OR_RETURN(spec.num_experts, positive("expert_count"));
  MOE_ASSIGN_OR_RETURN(spec.top_k, positive("expert_used_count"));
  if (file->Value(key("expert_feed_forward_length")) != nullptr || arch != "llama") {
    MOE_ASSIGN_OR_RETURN(spec.intermediate, positive("expert_feed_forward_length"));
  } else {
    MOE_ASSIGN_OR_RETURN(spec.intermediate, positive("feed_forward_length"));
  }
  // Routing: read, checked and described (the callers route).
  int gating = kGatingSoftmax;
  if (file->Value(key("expert_gating_func")) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t g, file->Int(key("expert_gating_func")));
    if (g != kGatingSoftmax && g != kGatingSigmoid)
      return absl::InvalidArgumentError(absl::StrCat("metadata ", key("expert_gating_func"), ": ", g,
                                                     " is not softmax (1) or sigmoid (2)"));
    gating = static_cast<int>(g);
  }
  if (arch == "deepseek2" && gating == kGatingSoftmax) spec.model_type = "deepseek_v2";
  spec.naming = NamingForModelType(spec.model_type);
  std::string routing = absl::StrCat(gating == kGatingSigmoid ? "sigmoid" : "softmax", " top-", spec.top_k);
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
  std::vector<std::array<const GgufTensor*, 3>> tensors;
  std::set<uint32_t> types;
  for (int l = 0; l < spec.num_layers; ++l) {
    if (file->Find(ExpertTensor(l, Projection::kGate)) == nullptr) {
      if (const std::string fused = absl::StrCat("blk.", l, ".ffn_gate_up_exps.weight"); file->Find(fused) != nullptr)
        return absl::InvalidArgumentError(absl::StrCat(fused, ": fused gate/up expert tensors are not read (separate ones are)"));
      continue;
    }
    std::array<const GgufTensor*, 3> t{};
    for (auto [k, p, dims] : {std::tuple{0, Projection::kGate, std::vector<int64_t>{H, I, E}},
                              std::tuple{1, Projection::kUp, std::vector<int64_t>{H, I, E}},
                              std::tuple{2, Projection::kDown, std::vector<int64_t>{I, H, E}}}) {
      const std::string name = ExpertTensor(l, p);
      t[k] = file->Find(name);
      if (t[k] == nullptr) return absl::InvalidArgumentError(absl::StrCat("no tensor ", name, " (layer ", l, " has gate experts)"));
      if (!GgmlTypeDecoded(t[k]->type))
        return absl::InvalidArgumentError(absl::StrCat(name, ": type ", GgmlTypeName(t[k]->type),
                                                       " is not one this service reads (F32, F16, BF16, Q8_0, Q4_K, Q6_K, MXFP4)"));
      if (t[k]->dims != dims)
        return absl::InvalidArgumentError(absl::StrCat(name, ": dims ", ShapeString(t[k]->dims), ", expected ",
                                                       ShapeString(dims), " (embedding_length, expert_feed_forward_length, expert_count)"));
      const std::string bias = absl::StrCat(name.substr(0, name.size() - 6), "bias");
      if (file->Find(bias) != nullptr)
        return absl::InvalidArgumentError(absl::StrCat(bias, ": expert biases are not part of the expert math this service computes"));
      types.insert(t[k]->type);
    }
    spec.moe_layers.push_back(l);
    tensors.push_back(t);
  }
  if (spec.moe_layers.empty()) return absl::InvalidArgumentError("no expert tensors (blk.N.ffn_gate_exps.weight)");
  if (file->Value(key("leading_dense_block_count")) != nullptr) {
    MOE_ASSIGN_OR_RETURN(const int64_t dense, file->Int(key("leading_dense_block_count")));
    if (dense != spec.moe_layers.front())
      LogWarning("model", file->path(), ": ", key("leading_dense_block_count"), " is ", dense, ", the first layer with experts is ",
                 spec.moe_layers.front(), "; using the tensors'");
  }
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
  std::vector<GgufTensorSpec> tensors;
  std::vector<std::pair<int, Projection>> items;
  for (int l : spec.moe_layers)
    for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
      const int64_t cols = p == Projection::kDown ? spec.intermediate : spec.hidden;
      const int64_t rows = p == Projection::kDown ? spec.hidden : spec.intermediate;
      tensors.push_back({ExpertTensor(l, p), type, {cols, rows, spec.num_experts}});
      items.push_back({l, p});
    }
  std::vector<bf16_t> w;
  std::vector<float> f;
  auto fill = [&](size_t i, std::span<std::byte> dst) {
    const auto [l, p] = items[i];
    const int cols = p == Projection::kDown ? spec.intermediate : spec.hidden;
    const int rows = p == Projection::kDown ? spec.hidden : spec.intermediate;
    const size_t n = static_cast<size_t>(rows) * cols, slab = dst.size() / static_cast<size_t>(spec.num_experts);
    w.resize(n);
    f.resize(n);
    for (int e = 0; e < spec.num_experts; ++e) {
      GenerateExpertMatrix(seed, l, e, p, rows, cols, w.data());
      Bf16ToF32(w.data(), f.data(), n);
      QuantizeGgml(type, f.data(), static_cast<int64_t>(n), dst.data() + slab * static_cast<size_t>(e));
    }
  };
  return WriteGguf(path, kv, tensors, fill);
}

}  // namespace moe
