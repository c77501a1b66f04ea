// ModelSource: where expert weights come from — a safetensors checkpoint
// directory (config.json + shards), a GGUF file (model/gguf_model.h) or a
// synthetic model built in memory ("synthetic:PRESET[:layers=N][:seed=S]"). Every consumer (the expert server's
// packer, the reference MoE, benchmarks) reads weights through it, as row-major
// bf16. All methods are thread-safe after OpenModel returns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/model_identity.h"
#include "model/model_spec.h"

namespace moe {

// Row-major bf16 weights of one expert: gate [I,H], up [I,H], down [H,I],
// and its biases when spec.expert_biases (gate [I], up [I], down [H]; empty
// otherwise). A slice's down bias is the whole expert's in slice 0 and zero
// in the others, so the slices' outputs still add up to the expert's.
struct ExpertWeights {
  std::vector<bf16_t> gate, up, down;
  std::vector<bf16_t> gate_bias, up_bias, down_bias;
  bool has_biases() const { return !down_bias.empty(); }
  void Resize(const ModelSpec& spec);
};

// One expert projection exactly as a quantized checkpoint stores it: its codes
// [rows, cols], a byte each (fp8: E4M3; int4: q in [-8, 7] as int8), and the
// f32 scale grid of br x bc blocks (fp8: weight_scale_inv's blocks; int4:
// weight_scale's 1 x group_size); w[r, c] = Value(code[r, c]) * Scale(r, c),
// Value the E4M3 value or q. A slice (SliceModel) keeps the whole grid and
// offsets into it (r0, c0).
struct CodedProjection {
  WeightQuant scheme = WeightQuant::kNone;  // kFp8Block or kInt4Group
  std::vector<uint8_t> codes;  // [rows, cols]
  std::vector<float> scales;   // [ceil(grid rows / br), scale_cols]
  int rows = 0, cols = 0, br = 0, bc = 0, scale_cols = 0, r0 = 0, c0 = 0;
  float Scale(int r, int c) const { return scales[size_t((r + r0) / br) * scale_cols + (c + c0) / bc]; }
};
struct ExpertCodes {
  CodedProjection gate, up, down;  // [I,H], [I,H], [H,I]
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
  // The same expert as the checkpoint's own codes and scales (what ReadExpert
  // dequantizes). FailedPrecondition unless spec().quant is fp8 block-scaled
  // or int4 grouped; otherwise ReadExpert's errors.
  virtual absl::Status ReadExpertCodes(int layer, int expert, ExpertCodes* out) const;
  // The digest of the experts' content (model/model_identity.h says what it
  // covers): equal for two sources of one model, different for another seed,
  // a fine-tune, a requantization. A checkpoint's costs one read of its
  // expert tensors, hashed on every core (a page-cached checkpoint at memory
  // speed); a synthetic model's is immediate. Never 0.
  virtual uint64_t Identity() const = 0;
};

// What a process serving `source` as --model `model` tells its peers
// (model/model_identity.h): Identity() and the spec's expert math and routing.
// Computes Identity(): see its cost above.
ModelIdentity IdentityOf(const ModelSource& source, const std::string& model);

// A synthetic model of any geometry (weights from GenerateExpertMatrix).
std::unique_ptr<ModelSource> MakeSyntheticSource(const ModelSpec& spec, uint64_t seed);

// `base` restricted to one slice of every expert (model_spec.h ExpertSlice):
// its spec's intermediate is the slice's length and ReadExpert returns gate
// and up rows [begin, end) and those columns of down. InvalidArgument when the
// model's intermediate size cannot be cut that way (SliceRange).
absl::StatusOr<std::unique_ptr<ModelSource>> SliceModel(std::unique_ptr<ModelSource> base, ExpertSlice slice);

// Opens a synthetic model URI, a GGUF file (a path ending in .gguf, or a file
// starting with the GGUF magic; model/gguf_model.h) or a checkpoint directory.
absl::StatusOr<std::unique_ptr<ModelSource>> OpenModel(const std::string& uri);

// For ModelSource implementations. InvalidArgument unless `layer` is an MoE
// layer of `spec` and `expert` one of its experts.
absl::Status CheckExpertIndex(const ModelSpec& spec, int layer, int expert);
// InvalidArgument naming (layer, expert, what) when v holds NaN or Inf.
absl::Status CheckFinite(const std::vector<bf16_t>& v, int layer, int expert, const char* what);
// The geometry every identity covers (H, I, E, the MoE layers), after a tag
// naming the form (model/model_identity.h).
std::vector<uint64_t> ModelIdentityHeader(const char* form, const ModelSpec& spec);

}  // namespace moe
