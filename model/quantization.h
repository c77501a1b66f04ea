// Quantized expert weights as real checkpoints store them, and the way back to
// bf16. Two formats, read the way transformers / vLLM read them:
//
//   fp8    DeepSeek-V3/R1, Qwen3-*-FP8 ("quant_method": "fp8"): `X.weight` is
//          F8_E4M3 [rows, cols] and `X.weight_scale_inv` F32
//          [ceil(rows/br), ceil(cols/bc)]; w = fp8 * scale_inv of its block
//          (weight_block_size [br, bc], 128 x 128 in practice).
//   int4   compressed-tensors "pack-quantized" (GPTQ/AWQ-style symmetric
//          group quantization, "quant_method": "compressed-tensors", weights
//          num_bits 4, type int, strategy group): `X.weight_packed` I32
//          [rows, ceil(cols/8)] holds 8 values per int32, value j of a word in
//          bits [4j, 4j+4) as q + 8 (q in [-8, 7]); `X.weight_scale`
//          [rows, ceil(cols/g)] (BF16/F16/F32); `X.weight_shape` [rows, cols];
//          w = q * scale of its group of g columns.
//
// X is the projection's name without ".weight". A GGUF file's block-quantized
// experts (Q8_0, Q4_K, Q6_K; model/gguf.h) are a third scheme, kGgufBlock: its
// source gives their dequantized values and `gguf_bits` their precision class.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "nlohmann/json_fwd.hpp"

namespace moe {

enum class WeightQuant { kNone, kFp8Block, kInt4Group, kGgufBlock };

struct QuantConfig {
  WeightQuant scheme = WeightQuant::kNone;
  int block_rows = 128, block_cols = 128;  // fp8: weight_block_size
  int group_size = 128;                    // int4: columns per scale
  // gguf: the widest expert tensor type's precision (4: Q4_K only; 8: Q8_0 or
  // Q6_K; 16: a float type among them) and the types ("Q4_K+Q6_K").
  // --weight-dtype auto stores < 16 as int8 (expert_store.h StorageGeometry).
  int gguf_bits = 0;
  std::string gguf_types = "";
  // "none", "fp8 (block 128x128)", "int4 (group 128)", "gguf Q8_0".
  std::string Describe() const;
};

// The quantization a config.json declares ("quantization_config"); kNone
// without one. InvalidArgument naming the key for formats this service does
// not read (e.g. quantization_config.quant_method: 'awq') or inconsistent
// values.
absl::StatusOr<QuantConfig> QuantConfigFromJson(const nlohmann::json& config);
// The "quantization_config" object QuantConfigFromJson maps back to `q`
// (null for kNone; {"quant_method": "gguf", ...} for kGgufBlock, which no
// config.json declares and QuantConfigFromJson refuses).
nlohmann::json QuantConfigToJson(const QuantConfig& q);
// "bf16", "f16", "f32" (no quantization) or "fp8", "int4"; InvalidArgument otherwise.
absl::StatusOr<WeightQuant> ParseWeightQuant(const std::string& name);

// OCP FP8 E4M3 ("e4m3fn": bias 7, no infinities, 0x7f / 0xff are NaN, max 448).
float Fp8E4M3ToF32(uint8_t v);
// Round to nearest even, saturating to +-448; NaN stays NaN.
uint8_t F32ToFp8E4M3(float f);

// Tensor sizes of one quantized [rows, cols] weight.
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A part of a quantized projection, named after its module: "X.weight" ->
// "X.<part>" (e.g. weight_packed, weight_scale, weight_shape).
std::string QuantizedPartName(const std::string& weight_name, const char* part);

// dst[r, c] = fp8(w[r, c]) * scale_inv[r / br, c / bc], as bf16.
void DequantizeFp8Block(const uint8_t* w, const float* scale_inv, int rows, int cols, int br, int bc,
                        bf16_t* dst);
// dst[r, c] = (nibble(r, c) - 8) * scale[r, c / g], as bf16. `scales` are f32.
void DequantizeInt4Group(const int32_t* packed, const float* scales, int rows, int cols, int g, bf16_t* dst);

// The inverses, for moe-make-model and synthetic:...:dtype= models: per block
// (per group) the scale maps the largest magnitude to 448 (to 7); an all-zero
// block gets scale 1 (fp8) / 0 (int4), exactly what real quantizers write.
void QuantizeFp8Block(const bf16_t* w, int rows, int cols, int br, int bc, uint8_t* q, float* scale_inv);
void QuantizeInt4Group(const bf16_t* w, int rows, int cols, int g, int32_t* packed, float* scales);

// w as a checkpoint of scheme `q` would give it back: quantized, then
// dequantized (kNone: unchanged). In place.
void QuantizeDequantize(const QuantConfig& q, int rows, int cols, bf16_t* w);

}  // namespace moe
