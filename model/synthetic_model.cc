#include "model/synthetic_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "model/quantization.h"
#include "model/safetensors.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe {

namespace {

struct Preset {
  const char* name;
  const char* model_type;
  int layers, first_dense, experts, top_k, hidden, intermediate;
};

// Real geometries (hidden size, per-expert intermediate size, routed experts, top-k).
constexpr Preset kPresets[] = {
    {"tiny", "deepseek_v3", 3, 1, 8, 2, 96, 80},
    {"tiny-mixtral", "mixtral", 2, 0, 4, 2, 80, 72},
    {"tiny-gpt-oss", "gpt_oss", 2, 0, 8, 4, 96, 80},
    // Small enough for a 2-core demo, big enough that caching matters.
    {"demo", "qwen3_moe", 32, 0, 32, 4, 512, 256},
    {"mixtral-8x7b", "mixtral", 32, 0, 8, 2, 4096, 14336},
    {"qwen3-30b-a3b", "qwen3_moe", 48, 0, 128, 8, 2048, 768},
    {"deepseek-v3", "deepseek_v3", 61, 3, 256, 8, 7168, 2048},
    // The geometries of the recorded traces in ../shared/data/traces (bench/moe_layer --trace).
    {"olmoe-1b-7b", "olmoe", 16, 0, 64, 8, 2048, 1024},
    {"kimi-linear-48b", "kimi_linear", 27, 1, 256, 8, 2304, 1024},
    // openai/gpt-oss-20b and -120b (H = I = 2880; experts with biases, clamped SwiGLU).
    {"gpt-oss-20b", "gpt_oss", 24, 0, 32, 4, 2880, 2880},
    {"gpt-oss-120b", "gpt_oss", 36, 0, 128, 4, 2880, 2880},
};

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<ModelSpec> PresetSpec(std::string_view preset_view, int layers) {
  const std::string preset(preset_view);
  for (const Preset& p : kPresets) {
    if (preset != p.name) continue;
    ModelSpec s;
    s.model_type = p.model_type;
    s.naming = NamingForModelType(s.model_type);
    s.num_layers = layers < 0 ? p.layers : std::min(layers, p.layers);
    for (int l = p.first_dense; l < s.num_layers; ++l) s.moe_layers.push_back(l);
    s.num_experts = p.experts;
    s.top_k = p.top_k;
    s.hidden = p.hidden;
    s.intermediate = p.intermediate;
    s.dtype = DType::kBF16;
    if (absl::Status st = ExpertMathForModelType(nlohmann::json::object(), &s); !st.ok()) return st;
    if (s.moe_layers.empty())
      return absl::InvalidArgumentError(absl::StrCat("preset ", preset, " cut to ", layers,
                                                     " layers has no MoE layer (first ",
                                                     p.first_dense, " are dense)"));
    return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown model preset '", preset,
                                                 "' (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
}

bool IsSyntheticUri(std::string_view uri) { return uri.rfind("synthetic:", 0) == 0; }

absl::StatusOr<SyntheticModelUri> ParseSyntheticUri(std::string_view uri_view) {
  const std::string uri(uri_view);
  if (!IsSyntheticUri(uri)) return absl::InvalidArgumentError(absl::StrCat("not a synthetic model URI: ", uri));
  std::vector<std::string> parts = absl::StrSplit(uri.substr(10), ':');
  SyntheticModelUri out;
  out.preset = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    bool ok = kv.size() == 2;
    if (ok && kv[0] == "layers") {
      ok = absl::SimpleAtoi(kv[1], &out.layers) && out.layers > 0;
    } else if (ok && kv[0] == "seed") {
      ok = absl::SimpleAtoi(kv[1], &out.seed);
    } else if (ok && kv[0] == "experts") {
      ok = absl::SimpleAtoi(kv[1], &out.experts) && out.experts > 0 && out.experts <= 4096;
    } else if (ok && kv[0] == "top_k") {
      ok = absl::SimpleAtoi(kv[1], &out.top_k) && out.top_k > 0;
    } else if (ok && kv[0] == "dtype") {
      out.dtype = kv[1];
      ok = out.dtype == "bf16" || out.dtype == "fp8" || out.dtype == "int4" || out.dtype == "mxfp4";
    } else if (ok && kv[0] == "group") {
      ok = absl::SimpleAtoi(kv[1], &out.group) && out.group > 0 && out.group <= 4096;
    } else {
      ok = false;
    }
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat("model URI '", uri, "': bad option '", parts[i],
                                                     "' (expected layers=N, seed=S, experts=E, top_k=K, dtype=bf16|fp8|int4|mxfp4 or group=G)"));
  }
  if (absl::StatusOr<ModelSpec> s = out.Spec(); !s.ok()) return s.status();
  return out;
}

absl::StatusOr<ModelSpec> SyntheticModelUri::Spec() const {
  absl::StatusOr<ModelSpec> s = PresetSpec(preset, layers);
  if (!s.ok()) return s;
  if (experts > 0) s->num_experts = experts;
  if (top_k > 0) s->top_k = top_k;
  if (!dtype.empty()) {
    absl::StatusOr<WeightQuant> q = ParseWeightQuant(dtype);
    if (!q.ok()) return absl::InvalidArgumentError(absl::StrCat("model URI: ", q.status().message()));
    s->quant.scheme = *q;
  }
  if (group > 0) {
    if (s->quant.scheme != WeightQuant::kInt4Group) return absl::InvalidArgumentError("model URI: group= is for dtype=int4");
    s->quant.group_size = group;
  }
  if (absl::Status st = s->Validate(); !st.ok())
    return absl::InvalidArgumentError(absl::StrCat("model URI: ", st.message()));
  return s;
}

namespace {

// n values uniform on [-a, a] from the stream of (seed, layer, expert, tag).
void UniformBf16(uint64_t seed, int layer, int expert, uint64_t tag, float a, size_t n, bf16_t* dst) {
  const uint64_t key = SplitMix64(seed ^ SplitMix64((static_cast<uint64_t>(layer) << 40) ^
                                                    (static_cast<uint64_t>(expert) << 8) ^ tag));
  const float scale = 2.0f * a / 65536.0f;
  size_t i = 0;
  for (uint64_t block = 0; i < n; ++block) {
    uint64_t r = SplitMix64(key + block);
    for (int j = 0; j < 4 && i < n; ++j, ++i, r >>= 16) {
      dst[i] = F32ToBf16(static_cast<float>(r & 0xffff) * scale - a + 0.5f * scale);
    }
  }
}

// Tags of the streams after the three projections' (0, 1, 2).
constexpr uint64_t kBiasTag = 16, kRouterTag = 32;

}  // namespace

void GenerateExpertMatrix(uint64_t seed, int layer, int expert, Projection proj, int rows, int cols,
                          bf16_t* dst) {
  // Uniform on [-a, a] has std a/sqrt(3); we want std = 1/sqrt(fan_in) = 1/sqrt(cols).
  UniformBf16(seed, layer, expert, static_cast<uint64_t>(proj), std::sqrt(3.0f / static_cast<float>(cols)),
              static_cast<size_t>(rows) * cols, dst);
}

void GenerateExpertBias(uint64_t seed, int layer, int expert, Projection proj, int n, bf16_t* dst) {
  UniformBf16(seed, layer, expert, kBiasTag + static_cast<uint64_t>(proj), 0.5f, static_cast<size_t>(n), dst);
}

void GenerateRouter(uint64_t seed, int layer, int num_experts, int hidden, bf16_t* weight, bf16_t* bias) {
  UniformBf16(seed, layer, 0, kRouterTag, std::sqrt(3.0f / static_cast<float>(hidden)),
              static_cast<size_t>(num_experts) * hidden, weight);
  UniformBf16(seed, layer, 0, kRouterTag + 1, 0.5f, static_cast<size_t>(num_experts), bias);
}

namespace {

// n bf16 values stored as `dtype` (BF16, F16 or F32) at dst.
void StoreAs(DType dtype, const bf16_t* src, size_t n, std::byte* dst) {
  if (dtype == DType::kBF16) {
    std::memcpy(dst, src, n * 2);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float f = Bf16ToF32(src[i]);
    if (dtype == DType::kF32) {
      std::memcpy(dst + 4 * i, &f, 4);
    } else {
      const uint16_t h = F32ToF16(f);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

// A gpt_oss checkpoint's tensors (WriteSyntheticCheckpoint's contract), one
// layer's in the order of the list below.
absl::Status WriteGptOssTensors(const std::string& dir, const ModelSpec& spec, uint64_t seed,
                                size_t max_shard_bytes) {
  if (spec.quant.scheme != WeightQuant::kNone)
    return absl::InvalidArgumentError(absl::StrCat("gpt_oss checkpoints are written in bf16, f16 or f32, not ",
                                                   spec.quant.Describe()));
  enum class Part { kGateUp, kGateUpBias, kDown, kDownBias, kRouter, kRouterBias };
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  std::vector<TensorSpec> specs;
  std::vector<std::pair<int, Part>> items;
  for (int l : spec.moe_layers) {
    const std::string mlp = absl::StrCat("model.layers.", l, ".mlp.");
    for (auto [name, part, shape] : {std::tuple{"experts.gate_up_proj", Part::kGateUp, std::vector<int64_t>{E, H, 2 * I}},
                                     std::tuple{"experts.gate_up_proj_bias", Part::kGateUpBias, std::vector<int64_t>{E, 2 * I}},
                                     std::tuple{"experts.down_proj", Part::kDown, std::vector<int64_t>{E, I, H}},
                                     std::tuple{"experts.down_proj_bias", Part::kDownBias, std::vector<int64_t>{E, H}},
                                     std::tuple{"router.weight", Part::kRouter, std::vector<int64_t>{E, H}},
                                     std::tuple{"router.bias", Part::kRouterBias, std::vector<int64_t>{E}}}) {
      specs.push_back({mlp + name, spec.dtype, shape});
      items.emplace_back(l, part);
    }
  }
  const size_t elem = spec.dtype == DType::kF32 ? 4 : 2;
  std::vector<bf16_t> a, b, t;
  auto fill = [&](size_t idx, std::span<std::byte> dst) {
    const auto [l, part] = items[idx];
    for (int64_t e = 0; e < (part == Part::kRouter || part == Part::kRouterBias ? 1 : E); ++e) {
      switch (part) {
        case Part::kGateUp:  // [H, 2I]: column 2i is gate row i, 2i + 1 up row i
          a.resize(I * H), b.resize(I * H), t.resize(2 * I * H);
          GenerateExpertMatrix(seed, l, e, Projection::kGate, I, H, a.data());
          GenerateExpertMatrix(seed, l, e, Projection::kUp, I, H, b.data());
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < I; ++i) {
              t[h * 2 * I + 2 * i] = a[i * H + h];
              t[h * 2 * I + 2 * i + 1] = b[i * H + h];
            }
          break;
        case Part::kGateUpBias:
          a.resize(I), b.resize(I), t.resize(2 * I);
          GenerateExpertBias(seed, l, e, Projection::kGate, I, a.data());
          GenerateExpertBias(seed, l, e, Projection::kUp, I, b.data());
          for (int64_t i = 0; i < I; ++i) t[2 * i] = a[i], t[2 * i + 1] = b[i];
          break;
        case Part::kDown:  // [I, H]: the transpose of down [H, I]
          a.resize(H * I), t.resize(I * H);
          GenerateExpertMatrix(seed, l, e, Projection::kDown, H, I, a.data());
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < I; ++i) t[i * H + h] = a[h * I + i];
          break;
        case Part::kDownBias:
          t.resize(H);
          GenerateExpertBias(seed, l, e, Projection::kDown, H, t.data());
          break;
        case Part::kRouter:
        case Part::kRouterBias:
          t.resize(E * H), b.resize(E);
          GenerateRouter(seed, l, E, H, t.data(), b.data());
          if (part == Part::kRouterBias) t = b;
          break;
      }
      StoreAs(spec.dtype, t.data(), t.size(), dst.data() + e * t.size() * elem);
    }
  };
  return WriteCheckpoint(dir, specs, max_shard_bytes, fill, {{"format", "pt"}, {"generator", "moe-make-model"}});
}

}  // namespace

// Long: config.json, then every layer's tensors in each checkpoint format
// (bf16, FP8 blocks, INT4 groups) into shards and their index, in file order.
absl::Status WriteSyntheticCheckpoint(const std::string& dir, const ModelSpec& spec, uint64_t seed,
                                      size_t max_shard_bytes) {
  MOE_RETURN_IF_ERROR(spec.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  {
    nlohmann::json config = ConfigFromModelSpec(spec);
    config["moe_expert_service_synthetic_seed"] = seed;
    std::ofstream out(dir + "/config.json");
    out << config.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", dir, "/config.json"));
  }
  if (IsGptOss(spec.model_type)) return WriteGptOssTensors(dir, spec, seed, max_shard_bytes);
  // One tensor of the checkpoint: a part of (layer, expert, projection).
  enum class Part { kWeight, kScaleInv, kPacked, kScale, kShape, kMxBlocks, kMxScales };
  struct Item { int layer, expert; Projection proj; Part part; };
  std::vector<TensorSpec> specs;
  std::vector<Item> items;
  const QuantConfig& q = spec.quant;
  for (int l : spec.moe_layers) {
    for (int e = 0; e < spec.num_experts; ++e) {
      for (Projection p : {Projection::kGate, Projection::kUp, Projection::kDown}) {
        const int64_t rows = p == Projection::kDown ? spec.hidden : spec.intermediate;
        const int64_t cols = p == Projection::kDown ? spec.intermediate : spec.hidden;
        const std::string name = ExpertTensorName(spec.naming, l, e, p);
        auto add = [&](std::string n, DType d, std::vector<int64_t> shape, Part part) {
          specs.push_back({std::move(n), d, std::move(shape)});
          items.push_back({l, e, p, part});
        };
        if (q.scheme == WeightQuant::kFp8Block) {
          add(name, DType::kF8E4M3, {rows, cols}, Part::kWeight);
          add(name + "_scale_inv", DType::kF32, {CeilDiv(rows, q.block_rows), CeilDiv(cols, q.block_cols)},
              Part::kScaleInv);
        } else if (q.scheme == WeightQuant::kInt4Group) {
          add(QuantizedPartName(name, "weight_packed"), DType::kI32, {rows, CeilDiv(cols, 8)}, Part::kPacked);
          add(QuantizedPartName(name, "weight_scale"), DType::kBF16, {rows, CeilDiv(cols, q.group_size)},
              Part::kScale);
          add(QuantizedPartName(name, "weight_shape"), DType::kI64, {2}, Part::kShape);
        } else if (q.scheme == WeightQuant::kMxfp4) {
          add(Mxfp4PartName(name, "blocks"), DType::kU8, {rows, cols / kMxfp4Block, kMxfp4Block / 2}, Part::kMxBlocks);
          add(Mxfp4PartName(name, "scales"), DType::kU8, {rows, cols / kMxfp4Block}, Part::kMxScales);
        } else {
          add(name, spec.dtype, {rows, cols}, Part::kWeight);
        }
      }
    }
  }
  // The quantized parts of the projection last generated (its tensors are written one after another).
  std::vector<bf16_t> w;
  std::vector<uint8_t> fp8, mx_blocks, mx_scales;
  std::vector<int32_t> packed;
  std::vector<float> scales;
  int cached = -1;
  auto fill = [&](size_t idx, std::span<std::byte> dst) {
    const Item& it = items[idx];
    const int rows = it.proj == Projection::kDown ? spec.hidden : spec.intermediate;
    const int cols = it.proj == Projection::kDown ? spec.intermediate : spec.hidden;
    const size_t n = static_cast<size_t>(rows) * cols;
    const int key = (it.layer * spec.num_experts + it.expert) * 3 + static_cast<int>(it.proj);
    if (key != cached) {
      w.resize(n);
      GenerateExpertMatrix(seed, it.layer, it.expert, it.proj, rows, cols, w.data());
      if (q.scheme == WeightQuant::kFp8Block) {
        fp8.resize(n);
        scales.resize(CeilDiv(rows, q.block_rows) * CeilDiv(cols, q.block_cols));
        QuantizeFp8Block(w.data(), rows, cols, q.block_rows, q.block_cols, fp8.data(), scales.data());
      } else if (q.scheme == WeightQuant::kInt4Group) {
        packed.resize(rows * CeilDiv(cols, 8));
        scales.resize(rows * CeilDiv(cols, q.group_size));
        QuantizeInt4Group(w.data(), rows, cols, q.group_size, packed.data(), scales.data());
      } else if (q.scheme == WeightQuant::kMxfp4) {
        mx_blocks.resize(n / 2);
        mx_scales.resize(n / kMxfp4Block);
        QuantizeMxfp4(w.data(), rows, cols, mx_blocks.data(), mx_scales.data());
      }
      cached = key;
    }
    switch (it.part) {
      case Part::kScaleInv: std::memcpy(dst.data(), scales.data(), dst.size()); return;
      case Part::kPacked: std::memcpy(dst.data(), packed.data(), dst.size()); return;
      case Part::kMxBlocks: std::memcpy(dst.data(), mx_blocks.data(), dst.size()); return;
      case Part::kMxScales: std::memcpy(dst.data(), mx_scales.data(), dst.size()); return;
      case Part::kScale:
        for (size_t i = 0; i < scales.size(); ++i) {
          const bf16_t b = F32ToBf16(scales[i]);  // exact: the quantizer rounded the scales to bf16
          std::memcpy(dst.data() + 2 * i, &b, 2);
        }
        return;
      case Part::kShape: {
        const int64_t shape[2] = {rows, cols};
        std::memcpy(dst.data(), shape, sizeof(shape));
        return;
      }
      case Part::kWeight: break;
    }
    if (q.scheme == WeightQuant::kFp8Block) {
      std::memcpy(dst.data(), fp8.data(), n);
    } else {
      StoreAs(spec.dtype, w.data(), n, dst.data());
    }
  };
  return WriteCheckpoint(dir, specs, max_shard_bytes, fill,
                         {{"format", "pt"}, {"generator", "moe-make-model"}});
}

}  // namespace moe
