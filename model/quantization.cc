#include "model/quantization.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe {

std::string QuantConfig::Describe() const {
  switch (scheme) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kFp8Block: return absl::StrCat("fp8 (block ", block_rows, "x", block_cols, ")");
    case WeightQuant::kInt4Group: return absl::StrCat("int4 (group ", group_size, ")");
    case WeightQuant::kGgufBlock: return absl::StrCat("gguf ", gguf_types);
    case WeightQuant::kMxfp4: return "mxfp4";
  }
  return "?";
}

namespace {

absl::Status Bad(const std::string& key, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: quantization_config.", key, ": ", why));
}

absl::StatusOr<QuantConfig> Fp8FromJson(const nlohmann::json& q) {
  QuantConfig c;
  c.scheme = WeightQuant::kFp8Block;
  if (auto fmt = q.find("fmt"); fmt != q.end() && (!fmt->is_string() || fmt->get<std::string>() != "e4m3"))
    return Bad("fmt", absl::StrCat(fmt->dump(), " not supported (e4m3)"));
  auto bs = q.find("weight_block_size");
  if (bs == q.end()) return Bad("weight_block_size", "missing (per-tensor fp8 scales are not supported)");
  if (!bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() || !(*bs)[1].is_number_integer() ||
      (*bs)[0].get<int>() <= 0 || (*bs)[1].get<int>() <= 0)
    return Bad("weight_block_size", absl::StrCat(bs->dump(), " is not [rows, cols] > 0"));
  c.block_rows = (*bs)[0].get<int>();
  c.block_cols = (*bs)[1].get<int>();
  return c;
}

absl::StatusOr<QuantConfig> CompressedTensorsFromJson(const nlohmann::json& q) {
  const std::string format = q.value("format", std::string());
  if (format != "pack-quantized")
    return Bad("format", absl::StrCat("'", format, "' not supported (pack-quantized)"));
  auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty())
    return Bad("config_groups", "missing or empty");
  QuantConfig c;
  c.scheme = WeightQuant::kInt4Group;
  bool first = true;
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    const std::string key = absl::StrCat("config_groups.", it.key(), ".weights");
    const nlohmann::json* w = it->is_object() && it->contains("weights") ? &(*it)["weights"] : nullptr;
    if (w == nullptr || !w->is_object()) return Bad(key, "missing");
    if (w->value("num_bits", 0) != 4) return Bad(key + ".num_bits", "only 4 is supported");
    if (w->value("type", std::string()) != "int") return Bad(key + ".type", "only int is supported");
    if (!w->value("symmetric", false)) return Bad(key + ".symmetric", "only symmetric quantization is supported");
    if (w->value("strategy", std::string()) != "group") return Bad(key + ".strategy", "only group is supported");
    const int g = w->value("group_size", 0);
    if (g <= 0) return Bad(key + ".group_size", "must be > 0");
    if (!first && g != c.group_size)
      return Bad(key + ".group_size", absl::StrCat(g, " differs from another group's ", c.group_size));
    c.group_size = g;
    first = false;
  }
  return c;
}

}  // namespace

absl::StatusOr<QuantConfig> QuantConfigFromJson(const nlohmann::json& config) {
  auto q = config.find("quantization_config");
  if (q == config.end() || q->is_null()) return QuantConfig{};
  if (!q->is_object()) return absl::InvalidArgumentError("config.json: quantization_config: not an object");
  const std::string method = q->value("quant_method", std::string());
  if (method == "fp8") return Fp8FromJson(*q);
  if (method == "compressed-tensors") return CompressedTensorsFromJson(*q);
  if (method == "mxfp4") return QuantConfig{.scheme = WeightQuant::kMxfp4};
  return Bad("quant_method", absl::StrCat("'", method, "' not supported (fp8, compressed-tensors, mxfp4)"));
}

nlohmann::json QuantConfigToJson(const QuantConfig& q) {
  switch (q.scheme) {
    case WeightQuant::kNone: return nullptr;
    case WeightQuant::kFp8Block:
      return {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
              {"weight_block_size", {q.block_rows, q.block_cols}}};
    case WeightQuant::kInt4Group:
      return {{"quant_method", "compressed-tensors"},
              {"format", "pack-quantized"},
              {"config_groups",
               {{"group_0",
                 {{"targets", {"Linear"}},
                  {"weights",
                   {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"},
                    {"group_size", q.group_size}}}}}}},
              {"ignore", {"lm_head"}}};
    case WeightQuant::kGgufBlock: return {{"quant_method", "gguf"}, {"types", q.gguf_types}};
    case WeightQuant::kMxfp4: return {{"quant_method", "mxfp4"}};  // as GPT-OSS's config.json
  }
  return nullptr;
}

std::string QuantizedPartName(const std::string& weight_name, const char* part) {
  constexpr std::string_view kWeight = ".weight";
  const size_t base = weight_name.size() >= kWeight.size() && weight_name.ends_with(kWeight)
                          ? weight_name.size() - kWeight.size()
                          : weight_name.size();
  return absl::StrCat(weight_name.substr(0, base), ".", part);
}

std::string Mxfp4PartName(const std::string& weight_name, const char* part) {
  constexpr std::string_view kWeight = ".weight";
  const size_t base = weight_name.ends_with(kWeight) ? weight_name.size() - kWeight.size() : weight_name.size();
  return absl::StrCat(weight_name.substr(0, base), "_", part);
}

absl::StatusOr<WeightQuant> ParseWeightQuant(const std::string& name) {
  if (name == "fp8") return WeightQuant::kFp8Block;
  if (name == "int4") return WeightQuant::kInt4Group;
  if (name == "mxfp4") return WeightQuant::kMxfp4;
  if (name == "bf16" || name == "f16" || name == "f32") return WeightQuant::kNone;
  return absl::InvalidArgumentError(absl::StrCat("dtype '", name, "' not supported (bf16, f16, f32, fp8, int4, mxfp4)"));
}

float Fp8E4M3ToF32(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float f;
  if (exp == 0xf && man == 7) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  } else {
    f = std::ldexp(static_cast<float>(8 + man), exp - 10);  // (1 + man/8) * 2^(exp-7)
  }
  return sign ? -f : f;
}

uint8_t F32ToFp8E4M3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const float a = std::fabs(f);
  if (a < std::ldexp(1.f, -6)) {  // subnormal range: quantum 2^-9; 8 quanta is the smallest normal (0x08)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int q = static_cast<int>(std::nearbyint((2.f * m - 1.f) * 8.f));  // mantissa in eighths, round half even
  int exp = e - 1 + 7;
  if (q == 8) {
    q = 0;
    ++exp;
  }
  if (exp > 15 || (exp == 15 && q == 7)) return sign | 0x7e;  // saturate to 448
  return sign | static_cast<uint8_t>(exp << 3 | q);
}

void DequantizeFp8Block(const uint8_t* w, const float* scale_inv, int rows, int cols, int br, int bc,
                        bf16_t* dst) {
  const int64_t sc = CeilDiv(cols, bc);
  float lut[256];
  for (int i = 0; i < 256; ++i) lut[i] = Fp8E4M3ToF32(static_cast<uint8_t>(i));
  for (int r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / br) * sc;
    const uint8_t* wrow = w + static_cast<size_t>(r) * cols;
    bf16_t* drow = dst + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) drow[c] = F32ToBf16(lut[wrow[c]] * srow[c / bc]);
  }
}

void UnpackInt4Words(const int32_t* packed, int rows, int cols, int8_t* codes) {
  const int64_t words = CeilDiv(cols, 8);
  for (int r = 0; r < rows; ++r) {
    const uint32_t* prow = reinterpret_cast<const uint32_t*>(packed) + r * words;
    int8_t* crow = codes + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) crow[c] = static_cast<int8_t>(static_cast<int>((prow[c / 8] >> (4 * (c % 8))) & 0xf) - 8);
  }
}

void DequantizeInt4Codes(const int8_t* codes, const float* scales, int rows, int cols, int g, bf16_t* dst) {
  const int64_t groups = CeilDiv(cols, g);
  for (int r = 0; r < rows; ++r) {
    const int8_t* crow = codes + static_cast<size_t>(r) * cols;
    const float* srow = scales + r * groups;
    bf16_t* drow = dst + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) drow[c] = F32ToBf16(static_cast<float>(crow[c]) * srow[c / g]);
  }
}

void DequantizeInt4Group(const int32_t* packed, const float* scales, int rows, int cols, int g, bf16_t* dst) {
  const int64_t words = CeilDiv(cols, 8), groups = CeilDiv(cols, g);
  std::vector<int8_t> q(static_cast<size_t>(cols));
  for (int r = 0; r < rows; ++r) {
    UnpackInt4Words(packed + r * words, 1, cols, q.data());
    DequantizeInt4Codes(q.data(), scales + r * groups, 1, cols, g, dst + static_cast<size_t>(r) * cols);
  }
}

namespace {
// The midpoints between the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 passed;
// at a tie the even code (mantissa bit 0) wins, as round-to-nearest-even
// does: > where the code below is even, >= where it is odd. Branch-free and
// inlined into QuantizeMxfp4Block's loop (a model's whole expert store is
// quantized through here at load); NaN: 0.
inline uint8_t E2M1Code(float v) {
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const float a = std::fabs(v);
  const int m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(sign | m);
}
}  // namespace

uint8_t F32ToE2M1(float v) { return E2M1Code(v); }

float E8M0ToF32(uint8_t e) {
  return e == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, static_cast<int>(e) - 127);
}

uint8_t Mxfp4ScaleFor(float amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 127;
  int e;
  std::frexp(amax, &e);  // amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
  return static_cast<uint8_t>(std::clamp(e - 1 - 2 + 127, 0, 254));
}

void DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int rows, int cols, bf16_t* dst) {
  const int nb = cols / kMxfp4Block;
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b) {
      const size_t i = static_cast<size_t>(r) * nb + b;
      const float s = E8M0ToF32(scales[i]);
      const uint8_t* q = blocks + i * 16;
      bf16_t* d = dst + i * kMxfp4Block;
      for (int j = 0; j < 16; ++j) {
        d[2 * j] = F32ToBf16(E2M1ToF32(q[j] & 0xf) * s);
        d[2 * j + 1] = F32ToBf16(E2M1ToF32(q[j] >> 4) * s);
      }
    }
}

uint8_t QuantizeMxfp4Block(const float* v, uint8_t* codes) {
  float amax = 0;
  for (int j = 0; j < kMxfp4Block; ++j) amax = std::max(amax, std::fabs(v[j]));
  const uint8_t e = Mxfp4ScaleFor(amax);
  const float inv = 1.0f / E8M0ToF32(e);  // a power of two: exact
  for (int j = 0; j < kMxfp4Block; ++j) codes[j] = E2M1Code(v[j] * inv);
  return e;
}

void QuantizeMxfp4(const bf16_t* w, int rows, int cols, uint8_t* blocks, uint8_t* scales) {
  const int nb = cols / kMxfp4Block;
  float v[kMxfp4Block];
  uint8_t codes[kMxfp4Block];
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b) {
      const size_t i = static_cast<size_t>(r) * nb + b;
      Bf16ToF32(w + i * kMxfp4Block, v, kMxfp4Block);
      scales[i] = QuantizeMxfp4Block(v, codes);
      for (int j = 0; j < 16; ++j) blocks[i * 16 + j] = static_cast<uint8_t>(codes[2 * j] | codes[2 * j + 1] << 4);
    }
}

void QuantizeFp8Block(const bf16_t* w, int rows, int cols, int br, int bc, uint8_t* q, float* scale_inv) {
  const int64_t sr = CeilDiv(rows, br), sc = CeilDiv(cols, bc);
  for (int64_t bi = 0; bi < sr; ++bi)
    for (int64_t bj = 0; bj < sc; ++bj) {
      const int r1 = static_cast<int>(std::min<int64_t>(rows, (bi + 1) * br));
      const int c1 = static_cast<int>(std::min<int64_t>(cols, (bj + 1) * bc));
      float amax = 0;
      for (int r = static_cast<int>(bi * br); r < r1; ++r)
        for (int c = static_cast<int>(bj * bc); c < c1; ++c)
          amax = std::max(amax, std::fabs(Bf16ToF32(w[static_cast<size_t>(r) * cols + c])));
      const float s = amax > 0 ? amax / 448.f : 1.f;
      scale_inv[bi * sc + bj] = s;
      for (int r = static_cast<int>(bi * br); r < r1; ++r)
        for (int c = static_cast<int>(bj * bc); c < c1; ++c)
          q[static_cast<size_t>(r) * cols + c] = F32ToFp8E4M3(Bf16ToF32(w[static_cast<size_t>(r) * cols + c]) / s);
    }
}

void QuantizeInt4Group(const bf16_t* w, int rows, int cols, int g, int32_t* packed, float* scales) {
  const int64_t words = CeilDiv(cols, 8), groups = CeilDiv(cols, g);
  std::fill(packed, packed + rows * words, 0);
  for (int r = 0; r < rows; ++r) {
    const bf16_t* wrow = w + static_cast<size_t>(r) * cols;
    uint32_t* prow = reinterpret_cast<uint32_t*>(packed) + r * words;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int c0 = static_cast<int>(gi * g), c1 = static_cast<int>(std::min<int64_t>(cols, c0 + int64_t{g}));
      float amax = 0;
      for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(Bf16ToF32(wrow[c])));
      // compressed-tensors' symmetric scale (max / 7.5), stored as bf16: quantize with the stored value.
      const float s = Bf16ToF32(F32ToBf16(amax > 0 ? amax / 7.5f : 1.f));
      scales[r * groups + gi] = s;
      for (int c = c0; c < c1; ++c) {
        const int q = std::clamp(static_cast<int>(std::nearbyint(Bf16ToF32(wrow[c]) / s)), -8, 7);
        prow[c / 8] |= static_cast<uint32_t>(q + 8) << (4 * (c % 8));
      }
    }
  }
}

void QuantizeDequantize(const QuantConfig& q, int rows, int cols, bf16_t* w) {
  if (q.scheme == WeightQuant::kFp8Block) {
    std::vector<uint8_t> v(static_cast<size_t>(rows) * cols);
    std::vector<float> s(CeilDiv(rows, q.block_rows) * CeilDiv(cols, q.block_cols));
    QuantizeFp8Block(w, rows, cols, q.block_rows, q.block_cols, v.data(), s.data());
    DequantizeFp8Block(v.data(), s.data(), rows, cols, q.block_rows, q.block_cols, w);
  } else if (q.scheme == WeightQuant::kInt4Group) {
    std::vector<int32_t> p(rows * CeilDiv(cols, 8));
    std::vector<float> s(rows * CeilDiv(cols, q.group_size));
    QuantizeInt4Group(w, rows, cols, q.group_size, p.data(), s.data());
    DequantizeInt4Group(p.data(), s.data(), rows, cols, q.group_size, w);
  } else if (q.scheme == WeightQuant::kMxfp4) {
    std::vector<uint8_t> b(static_cast<size_t>(rows) * cols / 2), s(static_cast<size_t>(rows) * cols / kMxfp4Block);
    QuantizeMxfp4(w, rows, cols, b.data(), s.data());
    DequantizeMxfp4(b.data(), s.data(), rows, cols, w);
  }
}

}  // namespace moe
