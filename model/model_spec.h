// ModelSpec: the geometry of an MoE model's routed experts, and how its expert
// tensors are named in a checkpoint. Plain values; thread-safe to share.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/expert_activation.h"
#include "model/quantization.h"
#include "model/routing.h"
#include "core/tensor.h"
#include "nlohmann/json_fwd.hpp"

namespace moe {

// Which of an expert's three projections. FFN(x) = Down(act(Gate x + bg, Up x + bu)) + bd,
// act the model's ExpertActivation (silu(g) * u for most families), the
// biases b only in families that have them (GPT-OSS).
// Mixtral calls them w1 (gate), w3 (up), w2 (down).
enum class Projection { kGate, kUp, kDown };

// How a checkpoint names its expert tensors.
enum class ExpertNaming {
  kMlpExperts,      // DeepSeek / Qwen: model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight
  kBlockSparseMoe,  // Mixtral: model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
};

struct ModelSpec {
  std::string model_type;      // config.json "model_type", e.g. "deepseek_v3"
  int num_layers = 0;          // decoder layers, dense ones included
  std::vector<int> moe_layers; // ascending; layers that have routed experts
  int num_experts = 0;         // routed experts per MoE layer
  int top_k = 0;
  int hidden = 0;              // H
  int intermediate = 0;        // I, per expert
  DType dtype = DType::kBF16;  // weight dtype in the checkpoint (of unquantized ones; torch_dtype)
  QuantConfig quant;           // how the checkpoint's expert weights are quantized (quantization_config)
  ExpertNaming naming = ExpertNaming::kMlpExperts;
  // The family's expert math (ExpertMathForModelType): the activation, whether
  // each expert carries gate/up [I] and down [H] biases, and how its router
  // turns logits into routing weights (what an engine computes; the service
  // takes the weights as given).
  ExpertActivation activation;
  bool expert_biases = false;
  RoutingMode routing = RoutingMode::kSoftmaxTopK;

  bool IsMoeLayer(int layer) const;
  // Bytes of one expert's three matrices in bf16 (3 * H * I * 2).
  uint64_t ExpertBf16Bytes() const { return 6ull * hidden * intermediate; }
  // Checks internal consistency (positive sizes, top_k <= num_experts, ...).
  absl::Status Validate() const;
  std::string Summary() const;
};

// One server's share of every expert (--slice i/n, "NUMA-aware expert tensor
// parallelism"): rows [begin, end) of gate and up, the same columns of down.
// FFN(x) = sum over the n slices of Down[:, s] silu(Gate[s] x) * (Up[s] x), so
// the partial outputs of the n slice holders of one expert add up to the
// whole expert's output. {0, 1} is the whole expert.
struct ExpertSlice {
  int index = 0;
  int count = 1;
  bool whole() const { return count == 1; }
  bool operator==(const ExpertSlice&) const = default;
  std::string ToString() const;  // "i/n"
};
// The most slices of one expert.
inline constexpr int kMaxSlices = 8;
// "i/n" with 0 <= i < n <= kMaxSlices; InvalidArgument naming --slice otherwise.
absl::StatusOr<ExpertSlice> ParseSlice(const std::string& text);
// [begin, end) of slice s of an intermediate dimension I, cut at multiples
// of 128 (of 64 when I is not a multiple of 128: the packed layouts' and
// int4 groups' unit), every slice within one unit of the others; the same
// function on both ends of the wire. InvalidArgument when I is not a multiple
// of 64 or has fewer units than s.count, or s is out of range.
absl::StatusOr<std::pair<int, int>> SliceRange(int intermediate, ExpertSlice s);

// Expert tensor name for the given naming scheme.
std::string ExpertTensorName(ExpertNaming naming, int layer, int expert, Projection proj);

// True iff model_type names the GPT-OSS family ("gpt_oss").
bool IsGptOss(const std::string& model_type);
// Sets `spec`'s activation, expert_biases and routing for its model_type:
// gpt_oss -> clamped SwiGLU (alpha 1.702, limit = config swiglu_limit, 7 when
// absent), biases, top-k then softmax; every other family -> SiLU, no
// biases, softmax then top-k. InvalidArgument when swiglu_limit is not a
// positive number.
absl::Status ExpertMathForModelType(const nlohmann::json& config, ModelSpec* spec);
// "silu", or "clamped_swiglu(alpha=1.702, limit=7)", with "+bias" when the
// experts carry biases: what logs, ServerInfo and moectl name.
std::string ExpertMathName(const ModelSpec& spec);

// The naming scheme a model_type uses ("mixtral" -> kBlockSparseMoe, else kMlpExperts).
ExpertNaming NamingForModelType(const std::string& model_type);

// Reads the MoE geometry from a HuggingFace config.json object. Understands
// num_experts / n_routed_experts / num_local_experts, num_experts_per_tok /
// experts_per_token (GPT-OSS),
// moe_intermediate_size / intermediate_size, hidden_size, num_hidden_layers,
// first_k_dense_replace + moe_layer_freq (DeepSeek), mlp_only_layers +
// decoder_sparse_step (Qwen), and the expert math (ExpertMathForModelType).
// InvalidArgument naming the key when one is missing.
absl::StatusOr<ModelSpec> ModelSpecFromConfig(const nlohmann::json& config);

// The config.json that ModelSpecFromConfig maps back to `spec`.
nlohmann::json ConfigFromModelSpec(const ModelSpec& spec);

}  // namespace moe
