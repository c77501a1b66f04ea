#include "model/synthetic_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

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
    // Small enough for a 2-core demo, big enough that caching matters.
    {"demo", "qwen3_moe", 32, 0, 32, 4, 512, 256},
    {"mixtral-8x7b", "mixtral", 32, 0, 8, 2, 4096, 14336},
    {"qwen3-30b-a3b", "qwen3_moe", 48, 0, 128, 8, 2048, 768},
    {"deepseek-v3", "deepseek_v3", 61, 3, 256, 8, 7168, 2048},
    // The geometries of the recorded traces in ../shared/data/traces (bench/moe_layer --trace).
    {"olmoe-1b-7b", "olmoe", 16, 0, 64, 8, 2048, 1024},
    {"kimi-linear-48b", "kimi_linear", 27, 1, 256, 8, 2304, 1024},
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
    } else {
      ok = false;
    }
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat("model URI '", uri, "': bad option '", parts[i],
                                                     "' (expected layers=N, seed=S, experts=E, top_k=K or dtype=bf16|fp8|int4|mxfp4)"));
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
  if (absl::Status st = s->Validate(); !st.ok())
    return absl::InvalidArgumentError(absl::StrCat("model URI: ", st.message()));
  return s;
}

void GenerateExpertMatrix(uint64_t seed, int layer, int expert, Projection proj, int rows, int cols,
                          bf16_t* dst) {
  const uint64_t key = SplitMix64(seed ^ SplitMix64((static_cast<uint64_t>(layer) << 40) ^
                                                    (static_cast<uint64_t>(expert) << 8) ^
                                                    static_cast<uint64_t>(proj)));
  // Uniform on [-a, a] has std a/sqrt(3); we want std = 1/sqrt(fan_in) = 1/sqrt(cols).
  const float a = std::sqrt(3.0f / static_cast<float>(cols));
  const float scale = 2.0f * a / 65536.0f;
  const size_t n = static_cast<size_t>(rows) * cols;
  size_t i = 0;
  for (uint64_t block = 0; i < n; ++block) {
    uint64_t r = SplitMix64(key + block);
    for (int j = 0; j < 4 && i < n; ++j, ++i, r >>= 16) {
      dst[i] = F32ToBf16(static_cast<float>(r & 0xffff) * scale - a + 0.5f * scale);
    }
  }
}

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
    } else if (spec.dtype == DType::kBF16) {
      std::memcpy(dst.data(), w.data(), n * 2);
    } else {
      for (size_t i = 0; i < n; ++i) {
        const float f = Bf16ToF32(w[i]);
        if (spec.dtype == DType::kF32) {
          std::memcpy(dst.data() + 4 * i, &f, 4);
        } else {
          const uint16_t h = F32ToF16(f);
          std::memcpy(dst.data() + 2 * i, &h, 2);
        }
      }
    }
  };
  return WriteCheckpoint(dir, specs, max_shard_bytes, fill,
                         {{"format", "pt"}, {"generator", "moe-make-model"}});
}

}  // namespace moe
