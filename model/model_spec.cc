#include "model/model_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe {

bool ModelSpec::IsMoeLayer(int layer) const {
  return std::binary_search(moe_layers.begin(), moe_layers.end(), layer);
}

absl::Status ModelSpec::Validate() const {
  if (num_layers <= 0) return absl::InvalidArgumentError("model: num_layers must be > 0");
  if (num_experts <= 0) return absl::InvalidArgumentError("model: num_experts must be > 0");
  if (top_k <= 0 || top_k > num_experts)
    return absl::InvalidArgumentError(
        absl::StrCat("model: top_k ", top_k, " must be in [1, num_experts=", num_experts, "]"));
  if (hidden <= 0 || intermediate <= 0)
    return absl::InvalidArgumentError("model: hidden_size and intermediate size must be > 0");
  if (quant.scheme == WeightQuant::kMxfp4 && (hidden % kMxfp4Block != 0 || intermediate % kMxfp4Block != 0))
    return absl::InvalidArgumentError(absl::StrCat("model: mxfp4 experts need hidden_size and intermediate size in whole "
                                                   "blocks of ", kMxfp4Block, " (H=", hidden, ", I=", intermediate, ")"));
  if (moe_layers.empty()) return absl::InvalidArgumentError("model: no MoE layers");
  for (int l : moe_layers) {
    if (l < 0 || l >= num_layers)
      return absl::InvalidArgumentError(absl::StrCat("model: MoE layer ", l, " out of range"));
  }
  if (!std::is_sorted(moe_layers.begin(), moe_layers.end()))
    return absl::InvalidArgumentError("model: moe_layers must be ascending");
  return absl::OkStatus();
}

std::string ModelSpec::Summary() const {
  return absl::StrCat(model_type, ": ", num_layers, " layers (", moe_layers.size(), " MoE), ",
                      num_experts, " experts, top-", top_k, ", H=", hidden, ", I=", intermediate,
                      ", ", DTypeName(dtype),
                      activation == ExpertActivation{} && !expert_biases ? "" : absl::StrCat(", ", ExpertMathName(*this)),
                      quant.scheme == WeightQuant::kNone ? "" : absl::StrCat(", experts ", quant.Describe()));
}

std::string ExpertSlice::ToString() const { return absl::StrCat(index, "/", count); }

absl::StatusOr<ExpertSlice> ParseSlice(const std::string& text) {
  ExpertSlice s;
  const size_t slash = text.find('/');
  if (slash == std::string::npos || !absl::SimpleAtoi(text.substr(0, slash), &s.index) ||
      !absl::SimpleAtoi(text.substr(slash + 1), &s.count) || s.count < 1 || s.count > kMaxSlices || s.index < 0 ||
      s.index >= s.count)
    return absl::InvalidArgumentError(absl::StrCat("--slice: '", text, "' is not i/n with 0 <= i < n <= ", kMaxSlices));
  return s;
}

absl::StatusOr<std::pair<int, int>> SliceRange(int intermediate, ExpertSlice s) {
  if (s.count < 1 || s.count > kMaxSlices || s.index < 0 || s.index >= s.count)
    return absl::InvalidArgumentError(absl::StrCat("slice ", s.ToString(), " out of range"));
  if (s.whole()) return std::make_pair(0, intermediate);
  const int unit = intermediate % 128 == 0 && intermediate / 128 >= s.count ? 128 : 64;
  const int units = intermediate / unit;
  if (intermediate % 64 != 0 || units < s.count)
    return absl::InvalidArgumentError(absl::StrCat("slice ", s.ToString(), ": the intermediate size ", intermediate,
                                                   " is not ", s.count, " or more multiples of 64"));
  const auto at = [&](int i) { return static_cast<int>(static_cast<int64_t>(units) * i / s.count) * unit; };
  return std::make_pair(at(s.index), at(s.index + 1));
}

std::string ExpertTensorName(ExpertNaming naming, int layer, int expert, Projection proj) {
  if (naming == ExpertNaming::kBlockSparseMoe) {
    const char* w = proj == Projection::kGate ? "w1" : proj == Projection::kUp ? "w3" : "w2";
    return absl::StrCat("model.layers.", layer, ".block_sparse_moe.experts.", expert, ".", w,
                        ".weight");
  }
  const char* p = proj == Projection::kGate ? "gate_proj" : proj == Projection::kUp ? "up_proj"
                                                                                     : "down_proj";
  return absl::StrCat("model.layers.", layer, ".mlp.experts.", expert, ".", p, ".weight");
}

bool IsGptOss(const std::string& model_type) { return model_type.rfind("gpt_oss", 0) == 0; }

absl::Status ExpertMathForModelType(const nlohmann::json& config, ModelSpec* spec) {
  if (!IsGptOss(spec->model_type)) {
    spec->activation = ExpertActivation::Silu();
    spec->expert_biases = false;
    spec->routing = RoutingMode::kSoftmaxTopK;
    return absl::OkStatus();
  }
  float limit = ExpertActivation::kGptOssLimit;
  if (auto it = config.find("swiglu_limit"); it != config.end()) {
    if (!it->is_number() || !(it->get<double>() > 0) || !std::isfinite(it->get<double>()))
      return absl::InvalidArgumentError(absl::StrCat("config.json: swiglu_limit ", it->dump(), " is not a positive number"));
    limit = it->get<float>();
  }
  spec->activation = ExpertActivation::ClampedSwiglu(ExpertActivation::kGptOssAlpha, limit);
  spec->expert_biases = true;
  spec->routing = RoutingMode::kTopKSoftmax;
  return absl::OkStatus();
}

std::string ExpertMathName(const ModelSpec& spec) {
  const ExpertActivation& a = spec.activation;
  std::string name = a.kind == ActivationKind::kClampedSwiglu
                         ? absl::StrCat("clamped_swiglu(alpha=", a.alpha, ", limit=", a.limit, ")")
                         : std::string("silu");
  return spec.expert_biases ? absl::StrCat(name, "+bias") : name;
}

ExpertNaming NamingForModelType(const std::string& model_type) {
  return model_type.rfind("mixtral", 0) == 0 ? ExpertNaming::kBlockSparseMoe
                                             : ExpertNaming::kMlpExperts;
}

namespace {

// The first of `keys` holding an integer, or a list of equal integers (a
// per-layer value that is the same for every layer, e.g. Hunyuan's moe_topk).
absl::StatusOr<int> GetInt(const nlohmann::json& j, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    auto it = j.find(k);
    if (it == j.end()) continue;
    if (it->is_number_integer()) return it->get<int>();
    if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) {
      const auto first = (*it)[0];
      if (std::all_of(it->begin(), it->end(), [&](const nlohmann::json& v) { return v == first; }))
        return first.get<int>();
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", k, ": differs between layers (not supported)"));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: missing integer ", absl::StrJoin(keys, " / ")));
}

}  // namespace

absl::StatusOr<ModelSpec> ModelSpecFromConfig(const nlohmann::json& config) {
  if (!config.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  ModelSpec s;
  s.model_type = config.value("model_type", std::string("unknown"));
  s.naming = NamingForModelType(s.model_type);
  MOE_ASSIGN_OR_RETURN(s.num_layers, GetInt(config, {"num_hidden_layers"}));
  // The names the MoE families of transformers use (DeepSeek, Qwen, Mixtral,
  // ERNIE 4.5, Hunyuan, ...).
  MOE_ASSIGN_OR_RETURN(s.num_experts,
                       GetInt(config, {"n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"}));
  // A config carrying two of these (Hunyuan's moe_topk beside another key)
  // gets the largest: the server takes calls of up to top_k experts per
  // token.
  s.top_k = 0;
  for (const char* key : {"num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk"})
    if (absl::StatusOr<int> k = GetInt(config, {key}); k.ok()) s.top_k = std::max(s.top_k, *k);
    else if (config.contains(key)) return k.status();
  if (s.top_k == 0) {
    MOE_ASSIGN_OR_RETURN(s.top_k, GetInt(config, {"num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk"}));
  }
  MOE_ASSIGN_OR_RETURN(s.hidden, GetInt(config, {"hidden_size"}));
  MOE_ASSIGN_OR_RETURN(s.intermediate, GetInt(config, {"moe_intermediate_size", "intermediate_size"}));
  const std::string dtype = config.value("torch_dtype", std::string("bfloat16"));
  s.dtype = dtype == "float32" ? DType::kF32 : dtype == "float16" ? DType::kF16 : DType::kBF16;
  absl::StatusOr<QuantConfig> quant = QuantConfigFromJson(config);
  if (!quant.ok()) return quant.status();
  s.quant = *quant;
  MOE_RETURN_IF_ERROR(ExpertMathForModelType(config, &s));

  const int first_dense = config.value("first_k_dense_replace", 0);
  const int freq = std::max(1, config.value("moe_layer_freq", config.value("decoder_sparse_step", 1)));
  std::vector<int> mlp_only;
  if (auto it = config.find("mlp_only_layers"); it != config.end() && it->is_array()) {
    for (const auto& x : *it) {
      if (x.is_number_integer()) mlp_only.push_back(x.get<int>());
    }
  }
  for (int l = 0; l < s.num_layers; ++l) {
    if (l < first_dense) continue;
    if (std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end()) continue;
    // DeepSeek: MoE when (l - first_dense) % freq == 0; Qwen: (l + 1) % step == 0.
    const bool sparse = config.contains("moe_layer_freq") ? (l - first_dense) % freq == 0
                                                          : (l + 1) % freq == 0;
    if (sparse) s.moe_layers.push_back(l);
  }
  MOE_RETURN_IF_ERROR(s.Validate());
  return s;
}

nlohmann::json ConfigFromModelSpec(const ModelSpec& s) {
  nlohmann::json j;
  j["model_type"] = s.model_type;
  j["num_hidden_layers"] = s.num_layers;
  j["hidden_size"] = s.hidden;
  j["num_experts_per_tok"] = s.top_k;
  j["torch_dtype"] = s.dtype == DType::kF32 ? "float32" : s.dtype == DType::kF16 ? "float16" : "bfloat16";
  if (s.quant.scheme != WeightQuant::kNone) j["quantization_config"] = QuantConfigToJson(s.quant);
  const int first_dense = s.moe_layers.empty() ? 0 : s.moe_layers.front();
  if (IsGptOss(s.model_type)) {  // as openai/gpt-oss-* publish it: every layer has experts
    j["architectures"] = {"GptOssForCausalLM"};
    j["num_local_experts"] = s.num_experts;
    j["experts_per_token"] = s.top_k;
    j["intermediate_size"] = s.intermediate;
    j["swiglu_limit"] = s.activation.limit;
  } else if (s.naming == ExpertNaming::kBlockSparseMoe) {
    j["num_local_experts"] = s.num_experts;
    j["intermediate_size"] = s.intermediate;
  } else if (s.model_type.rfind("deepseek", 0) == 0) {
    j["n_routed_experts"] = s.num_experts;
    j["moe_intermediate_size"] = s.intermediate;
    j["first_k_dense_replace"] = first_dense;
    j["moe_layer_freq"] = 1;
  } else {
    j["num_experts"] = s.num_experts;
    j["moe_intermediate_size"] = s.intermediate;
    j["decoder_sparse_step"] = 1;
    std::vector<int> dense;
    for (int l = 0; l < s.num_layers; ++l) {
      if (!s.IsMoeLayer(l)) dense.push_back(l);
    }
    j["mlp_only_layers"] = dense;
  }
  return j;
}

}  // namespace moe
