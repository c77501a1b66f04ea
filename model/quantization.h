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
//   mxfp4  OCP microscaling FP4, as GPT-OSS publishes it ("quant_method":
//          "mxfp4"): `X_blocks` U8 [rows, cols/32, 16] holds 32 E2M1 codes per
//          block, two per byte, value 2j in the low nibble and 2j+1 in the high
//          one; `X_scales` U8 [rows, cols/32] one E8M0 exponent e per block;
//          w = E2M1(code) * 2^(e - 127). An E2M1 code is sign (bit 3) |
//          exponent (bits 1-2) | mantissa (bit 0): +-{0, 0.5, 1, 1.5, 2, 3, 4,
//          6}. Fused 3-D experts carry the expert index first ([E, rows, ...]).
//          4.25 bits per weight, served as such (WeightFormat::kMxfp4).
//
// X is the projection's name without ".weight". A GGUF file's block-quantized
// experts (Q8_0, Q4_K, Q6_K, MXFP4; model/gguf.h) are a fourth scheme,
// kGgufBlock: its source gives their dequantized values and `gguf_bits` their
// precision class (an all-MXFP4 file is served as mxfp4: `gguf_mxfp4`).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "nlohmann/json_fwd.hpp"

namespace moe {

enum class WeightQuant { kNone, kFp8Block, kInt4Group, kGgufBlock, kMxfp4 };

struct QuantConfig {
  WeightQuant scheme = WeightQuant::kNone;
  int block_rows = 128, block_cols = 128;  // fp8: weight_block_size
  int group_size = 128;                    // int4: columns per scale
  // gguf: the widest expert tensor type's precision (4: Q4_K only; 8: Q8_0 or
  // Q6_K; 16: a float type among them) and the types ("Q4_K+Q6_K").
  // --weight-dtype auto stores < 16 as int8 (expert_store.h StorageGeometry).
  int gguf_bits = 0;
  std::string gguf_types = "";
  bool gguf_mxfp4 = false;  // gguf: every expert tensor is MXFP4 (--weight-dtype auto keeps it)
  // "none", "fp8 (block 128x128)", "int4 (group 128)", "gguf Q8_0", "mxfp4".
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
// "bf16", "f16", "f32" (no quantization) or "fp8", "int4", "mxfp4"; InvalidArgument otherwise.
absl::StatusOr<WeightQuant> ParseWeightQuant(const std::string& name);

// OCP FP8 E4M3 ("e4m3fn": bias 7, no infinities, 0x7f / 0xff are NaN, max 448).
float Fp8E4M3ToF32(uint8_t v);
// Round to nearest even, saturating to +-448; NaN stays NaN.
uint8_t F32ToFp8E4M3(float f);

// MXFP4's element and scale codes (OCP MX v1.0). E2M1: the 16 codes' values
// times 2 (integers in [-12, 12]: what the integer kernels multiply).
inline constexpr int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float E2M1ToF32(uint8_t code) {  // code 8 is -0
  const float m = 0.5f * kE2M1Doubled[code & 7];
  return code & 8 ? -m : m;
}
// The E2M1 code nearest to v (ties to the even code), saturating to +-6.
uint8_t F32ToE2M1(float v);
// E8M0: 2^(e - 127); 255 is NaN.
float E8M0ToF32(uint8_t e);
// The OCP scale of a block whose largest magnitude is amax: 2^(floor(log2
// amax) - 2) (E2M1's largest exponent is 2), clamped to [2^-127, 2^127];
// 127 (1.0) for an all-zero block. Values of a block then lie below 8 x the
// scale and round to nearest E2M1, saturating above 6.
uint8_t Mxfp4ScaleFor(float amax);
inline constexpr int kMxfp4Block = 32;  // values per scale
// One block of 32 values (v[0..32)): returns its exponent (Mxfp4ScaleFor of
// the largest magnitude) and writes each value's nearest E2M1 code to codes.
// Every MXFP4 writer's quantizer (checkpoints, GGUF blocks, packed experts).
uint8_t QuantizeMxfp4Block(const float* v, uint8_t* codes);

// Tensor sizes of one quantized [rows, cols] weight.
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A part of a quantized projection, named after its module: "X.weight" ->
// "X.<part>" (e.g. weight_packed, weight_scale, weight_shape).
std::string QuantizedPartName(const std::string& weight_name, const char* part);
// An MXFP4 projection's tensors as GPT-OSS names them: "X.weight" (or "X")
// -> "X_blocks", "X_scales" (`part` "blocks" or "scales").
std::string Mxfp4PartName(const std::string& weight_name, const char* part);

// dst[r, c] = fp8(w[r, c]) * scale_inv[r / br, c / bc], as bf16.
void DequantizeFp8Block(const uint8_t* w, const float* scale_inv, int rows, int cols, int br, int bc,
                        bf16_t* dst);
// dst[r, c] = (nibble(r, c) - 8) * scale[r, c / g], as bf16. `scales` are f32.
void DequantizeInt4Group(const int32_t* packed, const float* scales, int rows, int cols, int g, bf16_t* dst);
// dst[r, c] = codes[r, c] * scale[r, c / g], as bf16: int4 values already
// unpacked (UnpackInt4Words).
void DequantizeInt4Codes(const int8_t* codes, const float* scales, int rows, int cols, int g, bf16_t* dst);
// codes[r, c] = nibble(r, c) - 8 (in [-8, 7]): the values of pack-quantized
// int32 words [rows, ceil(cols / 8)], eight nibbles each, the lowest first.
void UnpackInt4Words(const int32_t* packed, int rows, int cols, int8_t* codes);

// dst[r, c] = E2M1(code(r, c)) * 2^(scales[r, c / 32] - 127), as bf16 (exact
// for exponents in bf16's range): blocks as `X_blocks` stores them (cols a
// multiple of 32).
void DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int rows, int cols, bf16_t* dst);

// The inverses, for moe-make-model and synthetic:...:dtype= models: per block
// (per group) the scale maps the largest magnitude to 448 (to 7); an all-zero
// block gets scale 1 (fp8) / 0 (int4), exactly what real quantizers write.
void QuantizeFp8Block(const bf16_t* w, int rows, int cols, int br, int bc, uint8_t* q, float* scale_inv);
void QuantizeInt4Group(const bf16_t* w, int rows, int cols, int g, int32_t* packed, float* scales);
// Per block of 32: Mxfp4ScaleFor(max|w|), codes rounded to nearest (cols a multiple of 32).
void QuantizeMxfp4(const bf16_t* w, int rows, int cols, uint8_t* blocks, uint8_t* scales);

// w as a checkpoint of scheme `q` would give it back: quantized, then
// dequantized (kNone: unchanged). In place.
void QuantizeDequantize(const QuantConfig& q, int rows, int cols, bf16_t* w);

}  // namespace moe
