// ModelSource: where expert weights come from — a safetensors checkpoint
// directory (config.json + shards) or a synthetic model built in memory
// ("synthetic:PRESET[:layers=N][:seed=S]"). Every consumer (the expert server's
// packer, the reference MoE, benchmarks) reads weights through it, as row-major
// bf16. All methods are thread-safe after OpenModel returns.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "core/model_spec.h"

namespace moe {

// Row-major bf16 weights of one expert: gate [I,H], up [I,H], down [H,I].
struct ExpertWeights {
  std::vector<bf16_t> gate, up, down;
  void Resize(const ModelSpec& spec);
};

class ModelSource {
 public:
  virtual ~ModelSource() = default;
  virtual const ModelSpec& spec() const = 0;
  // Where the weights come from, for logs.
  virtual std::string Describe() const = 0;
  // Fills `out` (resized as needed) with expert `expert` of MoE layer `layer`.
  // InvalidArgument when the layer is not an MoE layer, the expert is out of
  // range, a tensor has the wrong shape or dtype, or holds NaN/Inf.
  virtual absl::Status ReadExpert(int layer, int expert, ExpertWeights* out) const = 0;
};

// A synthetic model of any geometry (weights from GenerateExpertMatrix).
std::unique_ptr<ModelSource> MakeSyntheticSource(const ModelSpec& spec, uint64_t seed);

// `base` restricted to one slice of every expert (model_spec.h ExpertSlice):
// its spec's intermediate is the slice's length and ReadExpert returns gate
// and up rows [begin, end) and those columns of down. InvalidArgument when the
// model's intermediate size cannot be cut that way (SliceRange).
absl::StatusOr<std::unique_ptr<ModelSource>> SliceModel(std::unique_ptr<ModelSource> base, ExpertSlice slice);

// Opens a checkpoint directory or a synthetic model URI.
absl::StatusOr<std::unique_ptr<ModelSource>> OpenModel(const std::string& uri);

}  // namespace moe
