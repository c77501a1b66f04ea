// Synthetic MoE models: named presets with real geometries, and seeded random
// expert weights of realistic scale (uniform, std = 1/sqrt(fan_in)). The same
// generator backs `moe-make-model` (weights written to a checkpoint) and the
// `synthetic:PRESET[:layers=N][:seed=S]` model URI (weights built in memory),
// so both give bit-identical bf16 weights. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "model/model_spec.h"

namespace moe {

struct SyntheticModelUri {
  std::string preset;
  int layers = -1;     // keep the first N decoder layers; -1 = all
  uint64_t seed = 0;
  int experts = -1;    // override the preset's routed experts per layer
  int top_k = -1;      // override the preset's top-k
  std::string dtype;   // bf16 (default), fp8, int4 or mxfp4: the weights a checkpoint of that format gives back
  int group = -1;      // dtype=int4: columns per scale (default 128; 32 is Kimi-K2's)
  // The preset's geometry with the overrides above applied.
  absl::StatusOr<ModelSpec> Spec() const;
};

// Names accepted by PresetSpec: tiny, tiny-mixtral, tiny-gpt-oss, demo, mixtral-8x7b, qwen3-30b-a3b,
// deepseek-v3, olmoe-1b-7b, kimi-linear-48b, gpt-oss-20b, gpt-oss-120b.
std::vector<std::string> PresetNames();

// The geometry of a preset, cut to its first `layers` decoder layers (-1 = all).
absl::StatusOr<ModelSpec> PresetSpec(std::string_view preset, int layers = -1);

// True iff `uri` starts with "synthetic:".
bool IsSyntheticUri(std::string_view uri);
// Parses "synthetic:PRESET[:layers=N][:seed=S][:experts=E][:top_k=K][:dtype=bf16|fp8|int4|mxfp4]".
absl::StatusOr<SyntheticModelUri> ParseSyntheticUri(std::string_view uri);

// Fills `dst` with the rows x cols row-major bf16 matrix of (seed, layer, expert, proj).
void GenerateExpertMatrix(uint64_t seed, int layer, int expert, Projection proj, int rows, int cols,
                          bf16_t* dst);

// Fills `dst` with the n bf16 bias values of (seed, layer, expert, proj), for
// models whose experts carry biases (GPT-OSS): uniform on [-0.5, 0.5], a
// stream independent of the matrices'.
void GenerateExpertBias(uint64_t seed, int layer, int expert, Projection proj, int n, bf16_t* dst);

// The router of (seed, layer) as a synthetic gpt_oss checkpoint holds it:
// weight [E, H] (GenerateExpertMatrix's scale, fan-in H) and bias [E]
// (GenerateExpertBias's), row-major bf16.
void GenerateRouter(uint64_t seed, int layer, int num_experts, int hidden, bf16_t* weight, bf16_t* bias);

// Writes config.json plus a sharded safetensors checkpoint of every expert of every
// MoE layer of `spec`, with weights from GenerateExpertMatrix: in spec.dtype, or
// quantized as spec.quant says, in the real formats (model/quantization.h: fp8
// `weight` + `weight_scale_inv`, int4 compressed-tensors `weight_packed` +
// `weight_scale` + `weight_shape`, mxfp4 GPT-OSS's `X_blocks` + `X_scales`
// per expert, and the matching quantization_config).
absl::Status WriteSyntheticCheckpoint(const std::string& dir, const ModelSpec& spec, uint64_t seed,
                                      size_t max_shard_bytes);

}  // namespace moe
